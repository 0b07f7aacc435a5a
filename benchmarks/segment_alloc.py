"""How long a store segment takes to be allocated: ``TransferEngine.allocate`` (what a holder
does before it mounts, ``segment_memory`` huge or shared) against one thread faulting the same
kind of memory in, the way it did before (``MAP_POPULATE`` for shared memory, one
``MADV_POPULATE_WRITE`` for huge pages).

The kernel zeroes every page it faults in, so a large segment costs seconds per thread; the
engine faults disjoint pieces on up to 8 threads. Rounds alternate (baseline, engine, baseline,
...) so that a VM's slow phases hit both; each allocation is freed before the next. On some VMs the
first touch of memory the guest has not used for a while is far slower than the kernel's zeroing
(the host backs it again): the first rounds of a size show it, and the medians are what to read.

Usage: .venv/bin/python benchmarks/segment_alloc.py [--gib 1 4] [--rounds 5]
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import statistics
import time

from tidekv.transfer import TransferEngine

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MADV_HUGEPAGE, _MADV_POPULATE_WRITE, _MAP_POPULATE = 14, 23, 0x8000


def one_thread(size: int, huge: bool) -> float:
    """Seconds for one thread to map and fault in ``size`` bytes of that kind."""
    fd = -1
    started = time.perf_counter()
    if huge:
        base = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
        _libc.madvise(base, size, _MADV_HUGEPAGE)
        if _libc.madvise(base, size, _MADV_POPULATE_WRITE) != 0:
            raise OSError(ctypes.get_errno(), "MADV_POPULATE_WRITE")
    else:
        fd = os.memfd_create("segment-alloc-baseline")
        os.ftruncate(fd, size)
        base = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | _MAP_POPULATE, fd, 0)
    elapsed = time.perf_counter() - started
    if base in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap")
    _libc.munmap(base, size)
    if fd >= 0:
        os.close(fd)
    return elapsed


def engine_allocate(engine: TransferEngine, size: int, huge: bool) -> float:
    started = time.perf_counter()
    region = engine.allocate(size, huge=huge)
    elapsed = time.perf_counter() - started
    engine.unregister(region)
    return elapsed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, nargs="+", default=[1.0, 4.0], help="segment sizes in GiB (default 1 4)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of each per size (default 5)")
    args = ap.parse_args()
    engine = TransferEngine("127.0.0.1")
    try:
        print(f"{'kind':<8}{'GiB':>6}  {'one thread median / best':>26}  {'engine median / best':>22}  median ratio")
        for gib in args.gib:
            size = int(gib * (1 << 30))
            for kind, huge in (("shared", False), ("huge", True)):
                base, ours = [], []
                for _ in range(args.rounds):
                    base.append(one_thread(size, huge))
                    ours.append(engine_allocate(engine, size, huge))
                b, e = statistics.median(base), statistics.median(ours)
                print(f"{kind:<8}{gib:>6g}  {b:>15.3f} / {min(base):.3f} s  {e:>11.3f} / {min(ours):.3f} s  "
                      f"{b / e:>9.2f}x   (rounds: {' '.join(f'{x:.2f}' for x in base)} | "
                      f"{' '.join(f'{x:.2f}' for x in ours)})", flush=True)
    finally:
        engine.close()
    print(f"({os.cpu_count()} CPUs; the engine faults with up to min(CPUs, 8) threads, 256 MiB or more each)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
