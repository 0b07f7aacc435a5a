"""Writes into engine memory while a forked child of the process lives.

``TransferEngine.allocate`` memory is not inherited by a child the process forks
(``MADV_DONTFORK``); were it inherited, its private pages (``huge=True``, the store's default
segment) would turn copy-on-write and every first write into a page while the child lives would
copy it. This times ``memset`` of ``--size`` of such memory with no child, then with a child
sleeping, for each kind of allocation, and a private mapping on huge pages as
``allocate(huge=True)`` makes it but inherited (``mmap``) as the reference of what copy-on-write
costs. Nothing else running.

Usage: .venv/bin/python -m benchmarks.fork_writes [--size 1GiB] [--json FILE]
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import time

from tidekv.report import Column, format_table, write_json_lines
from tidekv.transfer import TransferEngine
from tidekv.values import parse_size

_libc = ctypes.CDLL(None)


def _memset_s(address: int, size: int) -> float:
    started = time.perf_counter()
    _libc.memset(ctypes.c_void_p(address), 7, ctypes.c_size_t(size))
    return time.perf_counter() - started


def _measure(what: str, address: int, size: int) -> dict[str, object]:
    _memset_s(address, size)  # every page faulted in
    alone = min(_memset_s(address, size) for _ in range(3))
    pid = os.fork()
    if pid == 0:
        time.sleep(30)
        os._exit(0)
    try:
        with_child = _memset_s(address, size)  # the first writes since the fork
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    return {"memory": what, "bytes": size, "alone_s": alone, "child_alive_s": with_child,
            "ratio": with_child / alone}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="1GiB", help="bytes written per measurement")
    parser.add_argument("--json", help="write one row per kind of memory to this file")
    args = parser.parse_args()
    size = parse_size(args.size, "--size")
    engine = TransferEngine()
    rows = []
    for what, huge in (("allocate(huge=True)", True), ("allocate()", False)):
        region = engine.allocate(size, huge=huge)
        rows.append(_measure(what, region.address, size))
        engine.unregister(region)
    plain = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    plain.madvise(mmap.MADV_HUGEPAGE)  # as allocate(huge=True) maps it, but inherited
    rows.append(_measure("mmap private huge, inherited", ctypes.addressof(ctypes.c_char.from_buffer(plain)), size))
    print(format_table(rows, [Column("memory", "memory", align="<"), Column("alone_s", "alone s", ".3f"),
                              Column("child_alive_s", "child alive s", ".3f"), Column("ratio", "ratio", ".1f")]))
    if args.json:
        write_json_lines(args.json, rows)

if __name__ == "__main__":
    main()
