"""Does Mooncake's C API (tidekv's libtransfer_engine.so) cost anything over tidekv.TransferEngine?

The same transfers both ways in one run: batches of 1,024 x 64 KiB (64 MiB) READ and WRITE from a
registered host buffer of this machine to a TransferEngine target in another process, which
registers a plain host buffer as TensorRT-LLM's KV cache would be. All three buffers (the target's
and both legs' local ones) are host memory on transparent huge pages (numpy advises them for large
arrays; the C program does the same), since cross-memory attach is slower over 4 KiB pages, and
all three start on a 2 MiB boundary: the kernel's copy of a WRITE costs ~15% more when the local
and remote buffers sit at different offsets within their pages (numpy's own arrays start 16 bytes
into a page, an aligned_alloc'ed one at its start). Leg "capi": the C program
tests/trtllm/agent_harness.c (bench mode) drives libtransfer_engine.so as TensorRT-LLM's agent
does (allocateBatchID, submitTransfer, getTransferStatus of every task, freeBatchID); it opens the
target as a plain tidekv engine. Leg "python": tidekv.TransferEngine.transfer(...).wait() in this
process. Each repetition runs both legs back to back (which goes first alternates), each leg
reporting GB/s over its timed rounds after one warm-up; the ratio capi/python is taken per
repetition (the load of a shared machine drifts less within one) and the median is judged.
Bar: capi >= 0.9 x python for both directions.

    .venv/bin/python benchmarks/trtllm_abi.py [--rounds 100] [--reps 7] [--transport auto|tcp] [--json out.json]

Exit status 0 when the bar holds, 1 when it does not, 2 when something needed is missing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
HARNESS = ROOT / "tests" / "trtllm" / "agent_harness.c"
BATCH = 1024
REQUEST_BYTES = 64 << 10
BAR = 0.9

ALIGN_BYTES = 2 << 20  # every buffer of both legs and the target starts on a huge-page boundary

TARGET = """
import sys
sys.path.insert(0, sys.argv[3])
from tidekv import TransferConfig, TransferEngine
from tidekv.config import TransportKind
from trtllm_abi import aligned_buffer
engine = TransferEngine(config=TransferConfig.from_env(transport=TransportKind(sys.argv[1])))
buf = aligned_buffer(int(sys.argv[2]), 0)
region = engine.register(buf)
print(engine.name, region.addr(), region.length, flush=True)
sys.stdin.read()
engine.close()
"""


def aligned_buffer(size: int, fill: int) -> Any:
    """A numpy uint8 array of `size` bytes set to `fill`, starting on an ALIGN_BYTES boundary
    (numpy's own large arrays start 16 bytes into a page; the C leg's aligned_alloc one does not)."""
    import numpy as np

    raw = np.full(size + ALIGN_BYTES, fill, dtype=np.uint8)
    skip = -raw.ctypes.data % ALIGN_BYTES
    return raw[skip:skip + size]  # a view: it keeps `raw` alive


def build_harness(out_dir: Path) -> Path:
    """Compiles the C harness against the built library; returns the executable."""
    from tidekv_trtllm import header_dir, library_dir

    lib = library_dir()
    exe = out_dir / "agent_harness"
    subprocess.run(["gcc", "-std=c11", "-O2", f"-I{header_dir()}", str(HARNESS), f"-L{lib}", "-ltransfer_engine",
                    f"-Wl,-rpath,{lib}", "-o", str(exe)], check=True)
    return exe


def python_leg(target: str, remote: int, rounds: int, transport: str) -> dict[str, dict[str, float]]:
    from tidekv import TransferConfig, TransferEngine
    from tidekv.config import TransportKind
    from tidekv.transfer import TransferOp, TransferRequest

    out: dict[str, dict[str, float]] = {}
    with TransferEngine(config=TransferConfig.from_env(transport=TransportKind(transport))) as engine:
        buf = aligned_buffer(BATCH * REQUEST_BYTES, 1)
        local = engine.register(buf)
        engine.connect(target)
        for op, label in ((TransferOp.READ, "read"), (TransferOp.WRITE, "write")):
            reqs = [TransferRequest(op, local.addr(i * REQUEST_BYTES), REQUEST_BYTES, target, remote + i * REQUEST_BYTES)
                    for i in range(BATCH)]
            times = []
            for k in range(rounds + 1):
                t0 = time.perf_counter()
                engine.transfer(reqs).wait()
                if k:
                    times.append(time.perf_counter() - t0)
            out[label] = {"rounds": rounds, "mean_s": sum(times) / rounds, "best_s": min(times),
                          "gbps": BATCH * REQUEST_BYTES * rounds / sum(times) / 1e9}
        engine.unregister(local)
    return out


def capi_leg(exe: Path, target: str, remote: int, size: int, rounds: int, transport: str) -> dict[str, dict[str, float]]:
    env = dict(os.environ, TIDEKV_TRANSPORT=transport)
    proc = subprocess.run([str(exe), "bench", target, str(remote), str(size), str(rounds)], env=env, check=False,
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"C harness failed ({proc.returncode}): {proc.stderr[-2000:]}")
    result: dict[str, dict[str, float]] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=100, help="timed batches per leg and direction (default 100)")
    parser.add_argument("--reps", type=int, default=7, help="repetitions of both legs (default 7)")
    parser.add_argument("--transport", choices=("auto", "tcp"), default="auto", help="transport of both legs")
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args(argv)
    if shutil.which("gcc") is None:
        print("gcc is needed to build the C harness", file=sys.stderr)
        return 2
    try:
        with tempfile.TemporaryDirectory() as tmp:
            exe = build_harness(Path(tmp))
            size = BATCH * REQUEST_BYTES
            target = subprocess.Popen([sys.executable, "-c", TARGET, args.transport, str(size), str(Path(__file__).parent)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            try:
                assert target.stdout is not None and target.stdin is not None
                name, remote_text, _ = target.stdout.readline().split()
                remote = int(remote_text)
                assert remote % ALIGN_BYTES == 0, f"the target's buffer at {remote:#x} is not {ALIGN_BYTES}-aligned"
                legs: dict[str, list[dict[str, dict[str, float]]]] = {"python": [], "capi": []}
                for rep in range(args.reps):
                    for leg in (("python", "capi") if rep % 2 == 0 else ("capi", "python")):
                        if leg == "python":
                            legs["python"].append(python_leg(name, remote, args.rounds, args.transport))
                        else:
                            legs["capi"].append(capi_leg(exe, name, remote, size, args.rounds, args.transport))
            finally:
                if target.stdin is not None:
                    target.stdin.close()
                target.wait(timeout=30)
    except FileNotFoundError as exc:
        print(f"cannot run: {exc}", file=sys.stderr)
        return 2
    import statistics

    result: dict[str, object] = {"batch": BATCH, "request_bytes": REQUEST_BYTES, "transport": args.transport,
                                 "rounds": args.rounds, "reps": args.reps, "legs": legs}
    ok = True
    for op in ("read", "write"):
        ratios = [c[op]["gbps"] / p[op]["gbps"] for p, c in zip(legs["python"], legs["capi"])]
        ratio = statistics.median(ratios)
        gbps = {leg: statistics.median(r[op]["gbps"] for r in runs) for leg, runs in legs.items()}
        result[op] = {"python_gbps": round(gbps["python"], 3), "capi_gbps": round(gbps["capi"], 3),
                      "ratios": [round(r, 3) for r in ratios], "ratio": round(ratio, 3), "bar": BAR,
                      "passed": ratio >= BAR}
        ok = ok and ratio >= BAR
        print(f"{op:5s}  python {gbps['python']:7.2f} GB/s   C API {gbps['capi']:7.2f} GB/s   median ratio "
              f"{ratio:.3f} ({'>=' if ratio >= BAR else '<'} {BAR}; per repetition {', '.join(f'{r:.2f}' for r in ratios)})")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
