#!/usr/bin/env bash
# The GPU device check: builds tidekv from this checkout and runs, on this host's GPU, every
# cuda-transport scenario byte for byte (tests/cuda_fake/scenarios.py: cuda<->cuda in one
# process, IPC between processes for cudaMalloc'd, VMM and torch expandable-segments memory,
# cuda<->cpu, GPU memory over forced tcp (staged), 2,000 scattered 16 KiB blocks in one batch,
# a peer that dies), then `tidekv bench gpu` (IPC vs in-process D2D copies, staged tcp vs host
# tcp, the vLLM-shaped hand-off). Needs python3 with pybind11 and setuptools (torch with CUDA for
# the torch scenario and the torch baseline); installs nothing. 48-68 s on one H200 with 16
# cores, build included (four runs, 2026-12-04).
#
#   integration/gpu_check.sh            # $OUT (default /tmp/gpu-check) gets three files:
#                                       # check.log (this output), logs.tgz (build and scenario
#                                       # logs), bench-gpu.json
#
# With TIDEKV_LIBCUDA set (the fake driver, tests/cuda_fake) it runs the same steps on a host
# without a GPU, minus the torch scenario: a check of this script, not of a GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-check}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
build=$(mktemp -d)
logs="$build/logs"
mkdir -p "$logs"
exec > >(tee "$OUT/check.log") 2>&1
# Few files, so that a device tool that brings back a handful carries them all; packed on any
# exit, a timeout's included.
trap 'tar czf "$OUT/logs.tgz" -C "$build" logs; rm -rf "$build"' EXIT
trap 'exit 143' TERM INT
t0=$(date +%s)

echo "== build ($($PY --version 2>&1))"
if ! $PY setup.py -q build_ext -b "$build" -t "$build/tmp" -j "$(nproc)" >"$logs/build.log" 2>&1; then
  tail -40 "$logs/build.log"
  echo "FAIL build (see build.log in $OUT/logs.tgz)"
  exit 1
fi
cp "$build"/tidekv/_native*.so core/
mkdir -p "$build/site"
ln -sfn "$PWD/core" "$build/site/tidekv"
export PYTHONPATH="$build/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
scenarios="registration in_process forced two_process scattered_blocks staged peer_exit torch_tensors"
if [ -n "${TIDEKV_LIBCUDA:-}" ]; then
  echo "== on the fake CUDA driver $TIDEKV_LIBCUDA (no GPU is checked)"
  scenarios=${scenarios% torch_tensors}
else
  command -v nvidia-smi >/dev/null && nvidia-smi -L
fi
$PY -c "from tidekv import _native; ok, why = _native.cuda_driver(); print('driver:', why); raise SystemExit(0 if ok else 1)" || {
  echo "FAIL no usable CUDA driver"
  exit 1
}

fail=0
for s in $scenarios; do
  start=$(date +%s%N)
  if timeout 150 $PY -m tests.cuda_fake.scenarios "$s" >"$logs/$s.log" 2>&1; then
    printf 'PASS %-18s %6d ms\n' "$s" "$(( ($(date +%s%N) - start) / 1000000 ))"
  else
    printf 'FAIL %-18s (exit %s)\n' "$s" "$?"
    grep -v ' INFO ' "$logs/$s.log" | tail -25
    fail=1
  fi
done

echo "== tidekv bench gpu"
timeout 300 $PY -m tidekv.bench.gpu --json "$OUT/bench-gpu.json" || fail=1
echo "== done in $(( $(date +%s) - t0 )) s: $([ $fail = 0 ] && echo every check passed || echo FAILURES above)"
exit $fail
