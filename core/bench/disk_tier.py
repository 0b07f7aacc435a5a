"""``tidekv bench store --tier disk``: the store's disk tier against the device it sits on.

For each object size, in one run:
- raw O_DIRECT writes and reads of the same directory: the baseline, with 4 threads as the
  tier's I/O pool (``store.client.disk.raw_direct_bandwidth``), and the same through io_uring
  at 4 and 16 in flight (``uring``: the alternative the tier did not take);
- the tier's spill throughput: a holder in its own process with write-through, from its first
  put until every object is on disk;
- disk-hit gets, the holder restarted on its disks first so that every object is on disk only
  (promotion off, so that every round reads the disk): read by the holder itself (straight from
  its disk) and by a client in this process (through the holder's disk server), throughput in
  batches and one-object latency p50/p99;
- SGLang's file backend read path (one file per object, ``open(buffering=0).readinto``, its
  pages dropped from the page cache first) on the same directory.

Each tidekv number is also given as a ratio to the 4-thread baseline of the same run.
Neighbours: ``store`` (the memory-tier bench this extends).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from tidekv import report
from tidekv.bench import uring
from tidekv.bench.store import _master_main
from tidekv.config import MasterConfig, StoreConfig
from tidekv.errors import ConfigError, TidekvError
from tidekv.helper_process import HelperProcess, send_ready, serve
from tidekv.report import Column, Row, format_size
from tidekv.store import Store
from tidekv.store.client.disk import raw_direct_bandwidth
from tidekv.store.wire.protocol import disk_footprint
from tidekv.transfer.region import Region

DEFAULT_SIZES = (256 << 10, 2 << 20)
DEFAULT_TOTAL = 256 << 20
BATCH_BYTES = 16 << 20
"""Bytes per get_many_into batch in the throughput rows."""
PUT_BATCH_BYTES = 8 << 20
"""Bytes per put_many while filling the pool (within the holder's staging memory)."""
LATENCY_SAMPLES = 200
URING_DEPTHS = (4, 16)
"""io_uring queue depths measured beside the thread pool (its ratio: to the 4 threads' rate)."""

BARS = (("spill_vs_raw_write", 0.7, 2 << 20), ("get_holder_vs_raw_read", 0.7, 2 << 20))
"""(ratio, at least, object size) the issue asks for."""


def _pattern(i: int, size: int) -> bytes:
    seed = i.to_bytes(8, "little") * 512
    return (seed * (size // len(seed) + 1))[:size]


def _holder_main(conn: Connection, master: str, segment: int, paths: str, disk_size: int) -> None:
    def connect() -> Store:
        config = StoreConfig.from_env(segment_size_bytes=segment, disk_paths=paths, disk_size_bytes=disk_size,
                                      heartbeat_interval_s=0.02)
        return Store.connect(master, config=config)

    state = {"store": connect()}

    def disk_keys() -> int:
        return int(state["store"].stats()["disk"]["keys"])

    def handle(message: tuple[Any, ...]) -> Any:
        op = message[0]
        store: Store = state["store"]
        if op == "spill":  # puts n objects; seconds from the first put until ``on_disk`` are on disk
            _, prefix, n, size, on_disk = message
            data = [_pattern(i, size) for i in range(min(n, 8))]
            started = time.perf_counter()
            per_batch = max(1, PUT_BATCH_BYTES // size)  # batched: the spill rate, not put round trips, is timed
            for first in range(0, n, per_batch):
                batch = range(first, min(n, first + per_batch))
                store.put_many([f"{prefix}{i}" for i in batch], [data[i % len(data)] for i in batch])
            while disk_keys() < on_disk:
                time.sleep(0.002)
            return time.perf_counter() - started
        if op == "restart":  # closed and opened again on its disks: every object is on disk only
            _, keys = message
            store.close()
            state["store"] = store = connect()
            while not all(store.exists_many(keys)):
                time.sleep(0.01)
            return store.engine.name
        if op == "reads":
            return _reads(store, *message[1:])
        raise TidekvError(f"unknown op {op!r}")

    send_ready(conn, state["store"].engine.name)
    try:
        serve(conn, handle)
    finally:
        state["store"].close()


def _reads(store: Store, keys: list[str], size: int, rounds: int) -> dict[str, list[float]]:
    """Batched throughput (bytes/s per round) and one-object latencies (s) of gets of ``keys``."""
    per_batch = max(1, BATCH_BYTES // size)
    region = store.engine.allocate(per_batch * size)
    try:
        views = [Region(region.address + i * size, size, "cpu", True, region) for i in range(per_batch)]
        rates = []
        for _ in range(rounds):
            started = time.perf_counter()
            for first in range(0, len(keys), per_batch):
                batch = keys[first:first + per_batch]
                got = store.get_many_into(batch, views[:len(batch)])
                if any(g != size for g in got):
                    raise TidekvError(f"disk-hit reads returned {got[:4]}..., expected {size} bytes each")
            rates.append(len(keys) * size / (time.perf_counter() - started))
        latencies = []
        for key in (keys * (LATENCY_SAMPLES // len(keys) + 1))[:LATENCY_SAMPLES]:
            started = time.perf_counter()
            store.get_into(key, views[0])
            latencies.append(time.perf_counter() - started)
        store.get_into(keys[-1], views[0])
        if bytes(views[0].view()) != _pattern(int(keys[-1].rsplit("-", 1)[1]) % 8, size):
            raise TidekvError("a disk-hit read returned other bytes than were put")
        return {"rates": rates, "latencies": latencies}
    finally:
        store.engine.unregister(region)


def _sglang_file_reads(directory: Path, n: int, size: int, rounds: int) -> dict[str, list[float]]:
    """SGLang's file backend (HiCacheFile): one file per object written with ``tofile``, read with
    ``open(path, "rb", buffering=0).readinto``; pages dropped from the page cache before each round."""
    paths = [directory / f"page{i}.bin" for i in range(n)]
    for i, path in enumerate(paths):
        path.write_bytes(_pattern(i, size))
    os.sync()
    buf = bytearray(size)

    def drop_cache(which: list[Path]) -> None:
        for path in which:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

    def read(path: Path) -> None:
        with open(path, "rb", buffering=0) as f:
            if f.readinto(buf) != size:
                raise TidekvError(f"short read of {path}")

    rates, latencies = [], []
    for _ in range(rounds):
        drop_cache(paths)
        started = time.perf_counter()
        for path in paths:
            read(path)
        rates.append(n * size / (time.perf_counter() - started))
    for path in (paths * (LATENCY_SAMPLES // n + 1))[:LATENCY_SAMPLES]:
        drop_cache([path])  # every read from the device, as the tier's O_DIRECT reads are
        started = time.perf_counter()
        read(path)
        latencies.append(time.perf_counter() - started)
    for path in paths:
        path.unlink()
    return {"rates": rates, "latencies": latencies}


def run(sizes: tuple[int, ...], total: int, rounds: int, directory: str, progress: Callable[[str], None]) -> list[Row]:
    rows: list[Row] = []
    work = Path(tempfile.mkdtemp(prefix="tidekv-bench-disk-", dir=directory))
    logs = work / "logs"
    logs.mkdir()
    try:
        for size in sizes:  # a pool of its own per size: nothing of the last one in its index
            master = HelperProcess(f"tidekv-master-disk-{size}", _master_main, (MasterConfig(
                port=0, metrics_port=-1, disk_write_through="all", disk_promote=False, lease_ttl_s=1.0),), logs)
            try:
                rows += _one_size(master.hello, work, size, max(8, total // size), rounds, progress)
            finally:
                master.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return rows


def _one_size(master: str, work: Path, size: int, n: int, rounds: int, progress: Callable[[str], None]) -> list[Row]:
    label = format_size(size)
    disk_dir = work / f"disk-{size}"
    disk_dir.mkdir()
    progress(f"{label}: raw O_DIRECT write and read of {format_size(n * size)}")
    raw = [raw_direct_bandwidth(str(work), n * size, size) for _ in range(rounds)]
    raw_write, raw_read = statistics.median(r[0] for r in raw), statistics.median(r[1] for r in raw)
    no_uring = uring.available()
    rings = {depth: [uring.raw_uring_bandwidth(str(work), n * size, size, depth) for _ in range(rounds)]
             for depth in URING_DEPTHS} if not no_uring else {}
    segment = (n * size * 5 // 4 + (1 << 20)) // 4096 * 4096
    disk_size = n * disk_footprint(size) * (rounds + 1) + (64 << 20)
    holder = HelperProcess(f"tidekv-disk-holder-{size}", _holder_main,
                           (master, segment, str(disk_dir), disk_size), work / "logs")
    try:
        progress(f"{label}: spilling {n} objects")
        spills = [n * size / holder.call(("spill", f"r{r}-", n, size, n * (r + 1)), 600) for r in range(rounds)]
        keys = [f"r0-{i}" for i in range(n)]
        progress(f"{label}: restarting the holder on its disks (every object on disk only)")
        holder.call(("restart", keys), 600)
        progress(f"{label}: disk-hit gets on the holder")
        local = holder.call(("reads", keys, size, rounds), 600)
        progress(f"{label}: disk-hit gets from another client")
        with Store.connect(master, config=StoreConfig.from_env(segment_size_bytes=0)) as reader:
            remote = _reads(reader, keys, size, rounds)
    finally:
        holder.stop()
    shutil.rmtree(disk_dir, ignore_errors=True)
    progress(f"{label}: SGLang's file backend read path")
    files = work / f"files-{size}"
    files.mkdir()
    sglang = _sglang_file_reads(files, n, size, rounds)
    spill = statistics.median(spills)

    def row(what: str, rates: list[float], latencies: list[float] | None, vs: float | None, **more: Any) -> Row:
        rate = statistics.median(rates)
        out: Row = {"size": label, "size_bytes": size, "path": what, "gb_s": rate / 1e9,
                    "runs_gb_s": [round(r / 1e9, 3) for r in rates]}
        if latencies:
            ordered = sorted(latencies)
            out["p50_ms"] = ordered[len(ordered) // 2] * 1e3
            out["p99_ms"] = ordered[min(len(ordered) - 1, len(ordered) * 99 // 100)] * 1e3
        if vs:
            out["vs_raw"] = rate / vs
        return {**out, **more}

    ring_rows = [row(f"raw O_DIRECT {what} (io_uring, {depth} in flight)", [r[i] for r in runs], None,
                     raw_write if i == 0 else raw_read)
                 for depth, runs in rings.items() for i, what in ((0, "write"), (1, "read"))]
    return [
        row("raw O_DIRECT write (4 threads)", [r[0] for r in raw], None, None),
        row("raw O_DIRECT read (4 threads)", [r[1] for r in raw], None, None),
        *ring_rows,
        row("spill (holder -> disk)", spills, None, raw_write, bar="spill_vs_raw_write"),
        row("disk-hit get, on the holder", local["rates"], local["latencies"], raw_read, bar="get_holder_vs_raw_read"),
        row("disk-hit get, other client", remote["rates"], remote["latencies"], raw_read),
        row("SGLang file backend read", sglang["rates"], sglang["latencies"], raw_read),
    ] if spill else []


def evaluate_bars(rows: list[Row]) -> list[str]:
    out = []
    for bar, least, size in BARS:
        found = [r for r in rows if r.get("bar") == bar and r["size_bytes"] == size]
        for r in found:
            ok = r["vs_raw"] >= least
            out.append(f"  {'PASS' if ok else 'MISS'} {bar} at {r['size']}: {r['vs_raw']:.2f}x (bar {least}x)")
    return out


COLUMNS = [Column("size", "size"), Column("path", "path", align="<"), Column("gb_s", "GB/s", ".2f"),
           Column("vs_raw", "vs raw", ".2f"), Column("p50_ms", "p50 ms", ".2f"), Column("p99_ms", "p99 ms", ".2f"),
           Column("runs_gb_s", "runs GB/s", lambda v: " ".join(f"{x:.2f}" for x in v), "<")]
STEPS = 6
"""Progress steps per size."""


def main(args: argparse.Namespace) -> int:
    """``tidekv bench store --tier disk``; returns the exit status."""
    sizes = tuple(args.sizes) if args.sizes else DEFAULT_SIZES
    rounds = args.rounds or 3
    directory = args.disk_dir or tempfile.gettempdir()
    if not os.path.isdir(directory):
        print(f"tidekv bench store: --disk-dir {directory!r} is not a directory", file=sys.stderr)
        return 2
    total = (32 << 20) if args.quick else DEFAULT_TOTAL
    try:
        with contextlib.closing(report.progress(STEPS * len(sizes), "bench store --tier disk",
                                                enabled=not args.no_progress)) as bar:
            def step(what: str) -> None:
                bar.set_postfix_str(what)
                bar.update(1)

            rows = run(sizes, total, rounds, directory, step)
    except (ConfigError, TidekvError) as exc:
        print(f"tidekv bench store --tier disk failed: {exc}", file=sys.stderr)
        return 1
    title = (f"tidekv bench store --tier disk: {os.cpu_count()} CPUs, {format_size(total)} per size in {directory}, "
             f"{rounds} round(s)")
    print(report.format_table(rows, COLUMNS, title=title))
    print("\nperformance bars (same-run ratios to the raw device):")
    print("\n".join(evaluate_bars(rows)))
    if args.json:
        report.write_json_lines(args.json, rows)
    return 0
