#!/usr/bin/env bash
# Creates or refreshes .venv-sglang, the environment the SGLang integration tests and the
# HiCache benchmark run in (README: "SGLang plugin"), and .venv-sglang-mooncake next to it (the
# same packages plus Mooncake's wheel, for the benchmark's real-Mooncake side).
#
# SGLang's own dependency set is CUDA-only (it pins CUDA torch, flashinfer, sglang-kernel, ...),
# so sglang==0.5.23 goes in with --no-deps next to the small set its storage, disaggregation and
# cache-controller modules import, with torch pinned to the CPU wheel this machine's pip
# find-links folder provides. torchvision is not installed (PyPI's is a CUDA build that fails
# against CPU torch); integration/sglang/conftest.py stubs it for the one import chain that needs it.
#
# Idempotent: each step checks whether it is already satisfied and skips if so.
# Usage: integration/setup_sglang.sh        (from anywhere; works on the repo it lives in)
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1

SGLANG_VERSION=0.5.23
VENV=.venv-sglang
PY=$VENV/bin/python
CONSTRAINTS=$VENV/constraints.txt
# shellcheck source=integration/venv_steps.sh
source integration/venv_steps.sh
total_start=$(date +%s)

step "create $VENV" "test -x $PY" python3.11 -m venv "$VENV"
# Keeps every later pip call from swapping in a CUDA torch from PyPI.
echo "torch==2.13.0+cpu" >"$CONSTRAINTS"

DEPS=(torch==2.13.0+cpu numpy orjson psutil pybase64 requests packaging pillow starlette msgspec pydantic
      pyzmq tqdm IPython aiohttp
      # deeper imports: disaggregation.{common,mooncake}.conn, managers.cache_controller
      transformers==5.19.0 dill apache-tvm-ffi==0.1.11 sentencepiece==0.2.1 compressed-tensors gguf
      prometheus_client
      "pytest>=7.4" "pytest-timeout>=2.2")
has_deps() {
  "$PY" -c "import torch, numpy, orjson, psutil, pybase64, requests, PIL, starlette, msgspec, pydantic, zmq, tqdm, IPython, aiohttp, transformers, dill, tvm_ffi, sentencepiece, compressed_tensors, gguf, prometheus_client, pytest, pytest_timeout, sys; sys.exit(torch.__version__ != '2.13.0+cpu')"
}
step "install CPU torch and sglang's import-time dependencies (~2 min)" has_deps \
  pip_quiet install -q -c "$CONSTRAINTS" "${DEPS[@]}"

has_sglang() {
  "$PY" -c "import importlib.metadata as m, sys; sys.exit(m.version('sglang') != '$SGLANG_VERSION' or m.version('triton') != '3.9.0')"
}
step "install sglang==$SGLANG_VERSION and triton==3.9.0 (--no-deps)" has_sglang \
  pip_quiet install -q --no-deps "sglang==$SGLANG_VERSION" triton==3.9.0

# --no-deps: tidekv's own dependencies (msgspec, pyzmq, tqdm) are in DEPS above.
step "install tidekv (editable, --no-deps)" "tidekv_current tidekv_sglang" install_tidekv_editable --no-deps

# The Mooncake drop-in (README: "Mooncake drop-in"), editable: SGLang's mooncake HiCache backend
# and PD connector then run on tidekv. No Mooncake wheel goes into this venv (both own `mooncake`).
has_shim() { "$PY" -c "import mooncake, mooncake.store, sys; sys.exit(not getattr(mooncake, 'IS_TIDEKV_SHIM', False))"; }
install_shim() {  # as install_tidekv_editable: an isolated build, else the venv's own setuptools
  pip_quiet install -q --no-deps -e plugins/mooncake \
    || { pip_quiet install -q "setuptools>=68" wheel && pip_quiet install -q --no-deps --no-build-isolation -e plugins/mooncake; }
}
step "install the Mooncake drop-in (plugins/mooncake, editable, --no-deps)" has_shim install_shim

# .venv-sglang-mooncake: the same SGLang with Mooncake's own wheel, for the side-by-side benchmark
# (benchmarks/sglang_hicache.py --compare mooncake). The wheel cannot go into .venv-sglang (the
# drop-in owns `mooncake` there), and a second SGLang install would cost minutes and could differ:
# so this venv holds only the wheel (--no-deps) and a .pth that adds .venv-sglang's site-packages
# after its own (site.addsitedir, so their .pth files, tidekv's editable finder among them, work).
# `import mooncake` then finds the wheel: it is on sys.path, the drop-in's editable finder is not.
MC_VENV=.venv-sglang-mooncake
MC_PY=$MC_VENV/bin/python
MC_WHEEL=mooncake-transfer-engine-non-cuda==0.3.13.post1
MC_PTH=$MC_VENV/lib/python3.11/site-packages/zz_tidekv_sglang_base.pth
has_real_mooncake() {
  "$MC_PY" -c "import importlib.metadata as m, mooncake, mooncake.store, sglang, tidekv, sys; sys.exit(getattr(mooncake, 'IS_TIDEKV_SHIM', False) or m.version('mooncake-transfer-engine-non-cuda') != '0.3.13.post1' or m.version('sglang') != '$SGLANG_VERSION')"
}
install_real_mooncake() {
  [ -x "$MC_PY" ] || python3.11 -m venv "$MC_VENV"
  PIP_PROGRESS_BAR=off "$MC_PY" -m pip install -q --no-deps "$MC_WHEEL" \
    2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2)
  echo "import os, site, sys; site.addsitedir(os.path.join(os.path.dirname(sys.prefix), '.venv-sglang', 'lib', 'python3.11', 'site-packages'))" >"$MC_PTH"
}
step "create $MC_VENV: Mooncake's wheel over $VENV's packages (needs libibverbs1)" has_real_mooncake install_real_mooncake

"$PY" -c "
import sglang, torch, tidekv, tidekv._native, mooncake.store
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
from sglang.srt.mem_cache.storage import StorageBackendFactory
print('== check: sglang', sglang.__version__, '| torch', torch.__version__, '| tidekv', tidekv.__file__,
      '| mooncake', mooncake.store.__file__)"
"$MC_PY" -c "import mooncake.store; print('== check: $MC_VENV imports Mooncake from', mooncake.store.__file__)"
echo "== setup_sglang: done in $(( $(date +%s) - total_start )) s"
