"""Same-host copies with streaming stores against memcpy, through the engine, same run.

A client engine READs a batch of 1 MiB requests from a holder engine (``--layout process``: the
holder in this process, copied at its own addresses as a store client copies into its own
segment; ``memfd``: engine-allocated memory of a holder process, copied through a mapping) with
``stream_copy_bytes`` at 1 byte (every batch streams) and at 0 (memcpy), alternating, for each
batch size and ``shm_parallelism``. Each call copies the next of several batch-sized areas (512 MiB
in all, ``--hot`` for one area copied again and again): with one area a small batch's bytes are
still in the caches at the next call, which a KV hand-off's rarely are. Prints GB/s (10^9 bytes per second; best and median of the
rounds) and streaming / memcpy per row. What ``TransferConfig.stream_copy_bytes``'s default
(8 MiB) rests on: batches that outgrow the caches copy faster streaming, small ones with memcpy.

    .venv/bin/python benchmarks/copy_probe.py [--sizes 2M,8M,16M,256M] [--threads 1,2]
        [--layout process,memfd] [--rounds 7] [--hot]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tidekv.config import TransferConfig  # noqa: E402
from tidekv.helper_process import HelperProcess, send_ready, serve  # noqa: E402
from tidekv.report import format_size, parse_size  # noqa: E402
from tidekv.transfer.batch import TransferOp, TransferRequest  # noqa: E402
from tidekv.transfer.engine import TransferEngine  # noqa: E402

PIECE = 1 << 20
AREA_BYTES = 512 << 20


def _areas(size: int, hot: bool) -> int:
    return 1 if hot else max(1, AREA_BYTES // size)


def _holder_main(conn: Connection, size: int) -> None:
    with TransferEngine(config=TransferConfig()) as engine:
        region = engine.allocate(size)
        region.view()[:] = b"\x5a" * size
        send_ready(conn, (engine.name, region.address))
        serve(conn)


def _rate(engine: TransferEngine, batches: list[list[TransferRequest]], size: int, min_time_s: float) -> float:
    best = 0.0
    end = time.perf_counter() + min_time_s
    for i in itertools.count():
        start = time.perf_counter()
        engine.transfer(batches[i % len(batches)]).wait(60)
        best = max(best, size / (time.perf_counter() - start) / 1e9)
        if time.perf_counter() > end:
            return best
    raise AssertionError("unreachable")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="2M,8M,16M,256M", help="batch sizes (1 MiB requests)")
    p.add_argument("--threads", default="1,2", help="shm_parallelism values")
    p.add_argument("--layout", default="process,memfd", help="process, memfd, or both")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--min-time", type=float, default=0.5, help="seconds per size and setting (best call kept)")
    p.add_argument("--hot", action="store_true", help="copy one area again and again (cache-warm)")
    args = p.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    print(f"{'layout':8s} {'batch':>7s} {'threads':>7s} {'memcpy GB/s':>18s} {'streaming GB/s':>18s} {'ratio':>14s}")
    for layout in args.layout.split(","):
        for size in sizes:
            holder_proc = None
            span = size * _areas(size, args.hot)
            if layout == "memfd":
                holder_proc = HelperProcess("copy-probe-holder", _holder_main, (span,), "/tmp")
                peer, remote = holder_proc.hello
                holder = None
            else:
                holder = TransferEngine(config=TransferConfig())
                segment = holder.allocate(span)
                segment.view()[:] = b"\x5a" * span
                peer, remote = holder.name, segment.address
            try:
                for threads in [int(t) for t in args.threads.split(",")]:
                    rates: dict[str, list[float]] = {"memcpy": [], "stream": []}
                    engines = {name: TransferEngine(config=TransferConfig(
                        shm_parallelism=threads, stream_copy_bytes=0 if name == "memcpy" else 1))
                        for name in rates}
                    try:
                        bufs = {name: e.register(bytearray(span)) for name, e in engines.items()}
                        batches = {name: [[TransferRequest(TransferOp.READ, bufs[name].addr(a + off),
                                                           min(PIECE, size - off), peer, remote + a + off)
                                           for off in range(0, size, PIECE)] for a in range(0, span, size)]
                                   for name in rates}
                        for name in rates:
                            for batch in batches[name]:  # first touch of every page, untimed
                                engines[name].transfer(batch).wait(60)
                        for r in range(args.rounds):
                            for name in (list(rates) if r % 2 == 0 else list(reversed(rates))):
                                rates[name].append(_rate(engines[name], batches[name], size, args.min_time / args.rounds))
                        for name, e in engines.items():
                            if bytes(bufs[name].view()[:: 4096]) != b"\x5a" * len(range(0, span, 4096)):
                                raise SystemExit(f"{name}: wrong bytes")
                            streamed = e.stats()["shm_streamed_bytes"]
                            if (streamed > 0) != (name == "stream"):
                                raise SystemExit(f"{name}: shm_streamed_bytes={streamed}")
                    finally:
                        for e in engines.values():
                            e.close()
                    m, s = rates["memcpy"], rates["stream"]
                    print(f"{layout:8s} {format_size(size):>7s} {threads:7d} "
                          f"{max(m):7.2f} ({statistics.median(m):6.2f})   {max(s):7.2f} ({statistics.median(s):6.2f})"
                          f"   {max(s) / max(m):5.2f}x ({statistics.median(s) / statistics.median(m):4.2f}x)", flush=True)
            finally:
                if holder is not None:
                    holder.close()
                if holder_proc is not None:
                    holder_proc.stop()
    print("ratio = streaming / memcpy, best (median); bytes checked, and shm_streamed_bytes says which copied how")
    return 0


if __name__ == "__main__":
    sys.exit(main())
