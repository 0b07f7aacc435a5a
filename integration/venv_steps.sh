# Shared by setup_vllm.sh and setup_sglang.sh (sourced, not run): idempotent, timed setup steps.
# Needs PY (the venv's python) set before sourcing.

pip_quiet() {  # pip, minus the warning this machine's pip config prints for every package it looks up
  PIP_PROGRESS_BAR=off "$PY" -m pip "$@" 2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2)
}

step() {  # step NAME CHECK-COMMAND DO-COMMAND...: runs DO only when CHECK fails, prints how long it took
  local name=$1 check=$2; shift 2
  local t0; t0=$(date +%s)
  if eval "$check" >/dev/null 2>&1; then
    echo "== $name: already done"
    return
  fi
  echo "== $name"
  "$@"
  echo "== $name: $(( $(date +%s) - t0 )) s"
}
