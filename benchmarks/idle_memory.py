"""How fast memory reads after it sat idle: memfd shared memory, anonymous 4 KiB pages, and
anonymous transparent huge pages (the three kinds a store segment or a KV cache can live in).

Each kind: 512 MiB written, then copied into a hot destination right away ("hot") and again after
``--idle`` seconds without touching it ("after idle"). On bare metal the two match; on some VMs
the idle copy of 4 KiB-page memory runs 3-4x slower, while huge pages are unaffected. The guest's
page faults during the idle copy are counted too (none means the cost is below the guest).

Then the short version a serving engine meets between requests: 1 MiB copies between 16 KiB
blocks of two 512 MiB 4 KiB-page buffers (vLLM's CPU KV cache of the benchmark's tiny model), a
different stretch each time, back to back vs after a ``--nap-ms`` sleep of the process.

Usage: .venv/bin/python benchmarks/idle_memory.py [--mib 512] [--idle 2 4] [--nap-ms 35]
"""

from __future__ import annotations

import argparse
import mmap
import os
import resource
import statistics
import time

import numpy as np


def _buffer(kind: str, size: int) -> np.ndarray:
    if kind == "memfd":
        fd = os.memfd_create("idle-bench")
        os.ftruncate(fd, size)
        m = mmap.mmap(fd, size)
        os.close(fd)
    else:
        m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        m.madvise(mmap.MADV_HUGEPAGE if kind == "thp" else mmap.MADV_NOHUGEPAGE)
    a = np.frombuffer(m, dtype=np.uint8)
    a[:] = 7
    return a


def _copy_gbps(dst: np.ndarray, src: np.ndarray) -> tuple[float, int]:
    faults = resource.getrusage(resource.RUSAGE_SELF)
    started = time.perf_counter()
    np.copyto(dst, src)
    elapsed = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_SELF)
    return src.nbytes / elapsed / 1e9, (after.ru_minflt - faults.ru_minflt) + (after.ru_majflt - faults.ru_majflt)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=512, help="buffer size in MiB (default 512)")
    ap.add_argument("--idle", type=float, nargs="+", default=[2.0, 4.0], help="idle times in seconds (default 2 4)")
    ap.add_argument("--nap-ms", type=float, default=35.0, help="sleep before each short copy (default 35 ms)")
    args = ap.parse_args()
    size = args.mib << 20
    dst = _buffer("thp", size)
    print(f"{'memory':8s} {'hot GB/s':>9s} " + " ".join(f"{f'idle {s:g}s GB/s':>14s}" for s in args.idle)
          + "  faults in idle copies")
    for kind in ("memfd", "anon4k", "thp"):
        src = _buffer(kind, size)
        _copy_gbps(dst, src)  # warm-up
        hot = max(_copy_gbps(dst, src)[0] for _ in range(3))
        cold, faults = [], 0
        for idle in args.idle:
            time.sleep(idle)
            dst[:] = 1  # the destination stays hot: only the source sat idle
            gbps, n = _copy_gbps(dst, src)
            cold.append(gbps)
            faults += n
        print(f"{kind:8s} {hot:9.1f} " + " ".join(f"{c:14.1f}" for c in cold) + f"  {faults}")
        del src
    _nap(args.nap_ms)


def _nap(nap_ms: float, samples: int = 40) -> None:
    block, blocks = 16 << 10, 64  # 64 blocks of 16 KiB = 1 MiB per copy
    src, dst = _buffer("anon4k", 512 << 20), _buffer("anon4k", 512 << 20)
    stride = (len(src) // block - blocks) // samples
    for nap in (0.0, nap_ms / 1e3):
        times = []
        for i in range(samples):
            time.sleep(nap)
            at = i * stride * block
            started = time.perf_counter()
            np.copyto(dst[at : at + blocks * block], src[at : at + blocks * block])
            times.append(time.perf_counter() - started)
        print(f"1 MiB copy of KV-sized blocks, {'back to back' if nap == 0 else f'after a {nap_ms:g} ms sleep':24s}: "
              f"p50 {statistics.median(times) * 1e6:6.0f} us")


if __name__ == "__main__":
    main()
