"""What a key costs in the store's batch calls: the same bytes as P*N objects or as N objects of P parts.

A HiCache page (MHA) is a K and a V buffer (``--parts 2``); a vLLM block of a 32-layer model with
K and V apart is 64 runs (``--parts 64 --part-size 4KiB``). Stored as one object per part (the
connectors' key scheme 1) a batch of N is P*N keys for the master to place, end and locate;
stored as one object of P parts (``put_many_from(keys, [[run, ...], ...])``, scheme 2) it is N.
Same bytes, same copies: the difference is what the store spends per key. A ``tidekv master`` process (lease 0.3 s, so
removed rounds free their space quickly) and, with ``--layout other``, a holder process; the
measuring client registers one source and one target buffer. Rounds alternate the two forms
(and which goes first); every round's bytes are checked after the timing. Reported: best and
median GB/s of each, and their ratio.

Usage: .venv/bin/python -m benchmarks.store_batch_keys [--layout same|other] [--pages 128]
       [--parts 2] [--part-size 1MiB] [--rounds 12]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np

from tidekv import Store
from tidekv.bench.ports import free_port
from tidekv.values import format_size, parse_size


def _holder(master: str, segment: int, ready: Any) -> None:
    Store.connect(master, segment_size=segment)
    ready.set()
    time.sleep(3600)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layout", choices=["same", "other"], default="same",
                   help="same: the measuring client holds the pool's segment; other: a holder process does")
    p.add_argument("--pages", type=int, default=128, help="pages per batch call (default 128, SGLang's batch)")
    p.add_argument("--parts", type=int, default=2, help="parts per page or block (default 2: K and V; 64: a "
                   "32-layer block with K and V apart)")
    p.add_argument("--part-size", type=lambda v: parse_size(v, "--part-size"), default=1 << 20, help="bytes of a part (default 1MiB)")
    p.add_argument("--rounds", type=int, default=12, help="rounds per form (default 12)")
    args = p.parse_args(argv)
    n, part, parts = args.pages, args.part_size, args.parts
    if parts < 1:
        raise SystemExit(f"--parts {parts}: at least 1")
    batch = parts * n * part
    segment = 3 * batch + (64 << 20)
    port = free_port()
    master = subprocess.Popen([sys.executable, "-m", "tidekv", "master", "--host", "127.0.0.1", "--port", str(port),
                               "--metrics-port", "-1", "--lease-ttl-s", "0.3"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    holder = None
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline or master.poll() is not None:
                    raise SystemExit("tidekv master did not start") from None
                time.sleep(0.1)
        address = f"127.0.0.1:{port}"
        if args.layout == "other":
            ready = mp.Event()
            holder = mp.Process(target=_holder, args=(address, segment, ready), daemon=True)
            holder.start()
            if not ready.wait(60):
                raise SystemExit("the holder did not mount its segment")
        store = Store.connect(address, segment_size=segment if args.layout == "same" else 0)
        src = np.random.default_rng(1).integers(0, 255, size=batch, dtype=np.uint8)
        dst = np.zeros_like(src)
        store.register(src)
        store.register(dst)
        s0, d0 = src.ctypes.data, dst.ctypes.data

        def run(base: int, i: int, c: int) -> tuple[int, int]:
            """Part ``c`` of page ``i``: parts lie apart, as layers' runs do (part-major)."""
            return base + (c * n + i) * part, part

        per_part, per_page = f"{parts} objects per page", f"1 object of {parts} parts"
        times: dict[str, tuple[list[float], list[float]]] = {per_part: ([], []), per_page: ([], [])}
        for r in range(args.rounds):
            forms = list(times) if r % 2 == 0 else list(reversed(times))
            for form in forms:
                if form == per_part:
                    keys: list[str] = [f"r{r}-{i}-{c}" for i in range(n) for c in range(parts)]
                    puts: list[Any] = [run(s0, i, c) for i in range(n) for c in range(parts)]
                    gets: list[Any] = [run(d0, i, c) for i in range(n) for c in range(parts)]
                else:
                    keys = [f"r{r}-{i}" for i in range(n)]
                    puts = [[run(s0, i, c) for c in range(parts)] for i in range(n)]
                    gets = [[run(d0, i, c) for c in range(parts)] for i in range(n)]
                dst[:] = 0
                t0 = time.perf_counter()
                store.put_many_from(keys, puts)
                t1 = time.perf_counter()
                store.get_many_into(keys, gets)
                t2 = time.perf_counter()
                if not np.array_equal(src, dst):
                    raise SystemExit(f"round {r}, {form}: bytes read differ from bytes written")
                times[form][0].append(t1 - t0)
                times[form][1].append(t2 - t1)
                store.remove_many(keys, force=True)
                time.sleep(0.35)  # the read leases (0.3 s) end and the bytes are free again
        store.close()
        print(f"store batch: {n} pages of {parts} x {format_size(part)} per call, layout {args.layout}, "
              f"{args.rounds} rounds per form (alternating); GB/s = 1e9 bytes/s, best (median)")
        rates = {}
        for form, (put_s, get_s) in times.items():
            rates[form] = {op: (batch / min(ts) / 1e9, batch / statistics.median(ts) / 1e9)
                           for op, ts in (("put", put_s), ("get", get_s))}
            print(f"  {form:<20}  put {rates[form]['put'][0]:6.2f} ({rates[form]['put'][1]:5.2f})   "
                  f"get {rates[form]['get'][0]:6.2f} ({rates[form]['get'][1]:5.2f})")
        one, two = rates[per_page], rates[per_part]
        print("  parts / objects       put {:.2f}x ({:.2f}x)   get {:.2f}x ({:.2f}x)".format(
            one["put"][0] / two["put"][0], one["put"][1] / two["put"][1],
            one["get"][0] / two["get"][0], one["get"][1] / two["get"][1]))
        return 0
    finally:
        if holder is not None:
            holder.kill()
        master.kill()
        master.wait(10)


if __name__ == "__main__":
    sys.exit(main())
