# Shared by setup_vllm.sh and setup_sglang.sh (sourced, not run): idempotent, timed setup steps and
# the editable install of tidekv itself. Needs PY (the venv's python) set before sourcing.

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

# tidekv itself, editable. Its metadata (entry points, package mapping) is a copy of
# pyproject.toml, so it is redone whenever the build files change; code changes need nothing.
tidekv_stamp() { echo "$(dirname "$(dirname "$PY")")/.tidekv-build-files.sha256"; }

tidekv_current() {  # tidekv_current [MODULE]: tidekv (and MODULE) import, and the build files are unchanged
  "$PY" -c "import tidekv, tidekv._native${1:+, $1}" && sha256sum pyproject.toml setup.py | cmp -s - "$(tidekv_stamp)"
}

install_tidekv_editable() {  # install_tidekv_editable [PIP ARGS...]
  # One install at a time per checkout (.ci/run sets up both integration venvs at once): the
  # second waits, then finds the native build current (setup.py: built_in_place_is_current).
  (
    flock 9
    # The editable install rebuilds tidekv._native when native/ changed since core/_native*.so
    # was built, and writes it over that file in place, which would crash processes (say, a
    # test run from .venv) that have it loaded. Swapping in a copy first leaves them on the old
    # inode and gives pip a file nobody has mapped.
    local so
    for so in core/_native*.so; do
      [ -e "$so" ] && cp -p "$so" "$so.detach" && mv -f "$so.detach" "$so"
    done
    # Build isolation fetches setuptools/pybind11 from the index; without an index reachable,
    # fall back to building with what the venv has.
    pip_quiet install -q "$@" -e . \
      || { pip_quiet install -q "setuptools>=68" wheel "pybind11>=2.12" \
           && pip_quiet install -q --no-build-isolation "$@" -e .; }
  ) 9>.native-build.lock
  sha256sum pyproject.toml setup.py >"$(tidekv_stamp)"
}
