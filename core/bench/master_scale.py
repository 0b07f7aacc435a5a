"""``tidekv bench master``: how the master's memory and speed scale with the number of objects.

Measured in-process on a MasterService (no network): bytes per object, single-key Get and
PutStart+PutEnd rates at 1k and N objects and into a full pool, the time per key of Exists, Get
and PutStart+PutEnd requests of 64 keys, pauses over N/2 puts and N gets
(collector as it comes, and frozen as ``tidekv master`` keeps it), a standby's snapshot load and
batch apply, and a lone master's restart from ``--state-dir`` (log, snapshot, promotion), checking
that every object came back. With ``--load N`` instead: a master process under N client
processes' prompt lookups, reads and saves, and its CPU time per key (``master_load``), against
Mooncake's master with ``--compare mooncake``.
Design notes: docs/design-bench.md#tidekvbenchmaster_scale
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import gc
import hashlib
import multiprocessing
import os
import random
import shutil
import tempfile
import time
from typing import Any, NamedTuple

from tidekv.config import MasterConfig
from tidekv.report import Column, format_table, write_json_lines
from tidekv.store.master.collector import FrozenHeap
from tidekv.store.master.fold import Fold
from tidekv.store.master.journal import EndOp, JournalFile, Mirror, StartOp, decode_ops, encode_ops
from tidekv.store.master.service import MasterService
from tidekv.store.wire import protocol as p

_OBJECT_BYTES = 4096
_BATCH = 1000


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _key(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(8, "little")).hexdigest().encode()  # 64 bytes, like a prefix hash


def _call(svc: MasterService, rid: int, body: Any) -> Any:
    reply = p.decode_reply(svc.handle(p.encode(p.Envelope(p.PROTOCOL_VERSION, rid, body))))
    if reply.error_kind:
        raise RuntimeError(reply.error)
    return reply.result


def _fill(svc: MasterService, start: int, stop: int, progress: Any = None, journal: JournalFile | None = None) -> None:
    """Puts objects ``start`` to ``stop`` in batches; with ``journal``, each request's ops are
    appended to it before the next, as ``tidekv master --state-dir`` does."""
    for lo in range(start, stop, _BATCH):
        keys = [_key(i) for i in range(lo, min(stop, lo + _BATCH))]
        slots = _call(svc, 1, p.PutStart("bench", keys, [_OBJECT_BYTES] * len(keys)))
        if journal is not None:
            _persist(svc, journal)
        _call(svc, 2, p.PutEnd("bench", keys, [s[1] for s in slots]))
        if journal is not None:
            _persist(svc, journal)
        if progress is not None:
            progress.update(len(keys))


def _persist(svc: MasterService, journal: JournalFile) -> None:
    _, ops = svc.take_ops()
    if ops:
        journal.append(ops)


def _get_rate(svc: MasterService, n_objects: int, seconds: float) -> float:
    """Single-key gets per second of random keys among the first ``n_objects``."""
    rng = random.Random(7)
    keys = [_key(rng.randrange(n_objects)) for _ in range(4096)]
    ops, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for k in keys[:256]:
            _call(svc, 3, p.Get([k]))
        ops += 256
        keys.append(keys.pop(0))
    return ops / (time.perf_counter() - t0)


def _put_rate(svc: MasterService, seconds: float, next_new: int) -> tuple[float, int]:
    """Single-key puts per second of new keys from ``next_new`` on; (rate, the next new key)."""
    ops, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(128):
            k = _key(next_new)
            next_new += 1
            slot = _call(svc, 4, p.PutStart("bench", [k], [_OBJECT_BYTES]))[0]
            _call(svc, 5, p.PutEnd("bench", [k], [slot[1]]))
        ops += 128
    return ops / (time.perf_counter() - t0), next_new


_KEY_BATCH = 64
"""Keys per request in the batch rows (a prompt's lookup or save of 64 blocks)."""


def _batch_costs(svc: MasterService, n_objects: int, seconds: float, next_new: int) -> tuple[dict[str, float], int]:
    """Microseconds of master time per key in requests of ``_KEY_BATCH`` keys: Exists and Get of
    stored keys, PutStart+PutEnd of new ones from ``next_new`` on; (costs, the next new key)."""
    rng = random.Random(11)
    stored = [[_key(rng.randrange(n_objects)) for _ in range(_KEY_BATCH)] for _ in range(64)]
    costs = {}
    for name, body in (("Exists", p.Exists), ("Get", p.Get)):
        calls, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            _call(svc, 6, body(stored[calls % len(stored)]))
            calls += 1
        costs[name] = (time.perf_counter() - t0) / (calls * _KEY_BATCH) * 1e6
    fresh = [[_key(next_new + b * _KEY_BATCH + i) for i in range(_KEY_BATCH)] for b in range(1000)]
    next_new += len(fresh) * _KEY_BATCH
    calls, elapsed = 0, 0.0
    while elapsed < seconds and calls < len(fresh):
        keys = fresh[calls]
        t0 = time.perf_counter()
        slots = _call(svc, 7, p.PutStart("bench", keys, [_OBJECT_BYTES] * len(keys)))
        _call(svc, 8, p.PutEnd("bench", keys, [s[1] for s in slots]))
        elapsed += time.perf_counter() - t0
        calls += 1
    costs["PutStart+PutEnd"] = elapsed / (calls * _KEY_BATCH) * 1e6
    return costs, next_new


def _full_pool_put_rate(objects: int, seconds: float) -> float:
    svc = MasterService(MasterConfig(port=0, metrics_port=-1, high_watermark=1.0))
    _call(svc, 0, p.Hello("bench", p.PROTOCOL_VERSION))
    _call(svc, 0, p.MountSegment("bench", "seg0", "127.0.0.1:1", 1 << 20, objects * _OBJECT_BYTES))
    _fill(svc, 0, objects)
    evicted = svc.objects.counters.evictions
    rate, _ = _put_rate(svc, seconds, 10**12)
    if svc.objects.counters.evictions - evicted < rate * seconds * 0.9:
        raise RuntimeError("the full-pool puts did not evict: the pool was not full")
    return rate


def _pauses(ops: Any, heap: FrozenHeap | None) -> tuple[float, float, float]:
    """(longest, 99.9th percentile) seconds of the requests ``ops`` makes (an iterator of
    callables, one request each) and, with ``heap``, of its ticks (every 0.1 s, as the master's
    timer); and the longest full collection meanwhile."""
    times: list[float] = []
    full: list[float] = []
    started = [0.0]

    def timed(phase: str, info: dict[str, int]) -> None:
        if info["generation"] == 2:
            if phase == "start":
                started[0] = time.perf_counter()
            else:
                full.append(time.perf_counter() - started[0])

    gc.callbacks.append(timed)
    tick_at = time.perf_counter()
    try:
        for op in ops:
            t0 = time.perf_counter()
            op()
            t1 = time.perf_counter()
            times.append(t1 - t0)
            if heap is not None and t1 >= tick_at:
                heap.tick()
                times.append(time.perf_counter() - t1)
                tick_at = t1 + 0.1
    finally:
        gc.callbacks.remove(timed)
    times.sort()
    return times[-1], times[int(len(times) * 0.999)], max(full, default=0.0)


def _puts(svc: MasterService, first: int, count: int) -> Any:
    """``count`` single-key puts (PutStart+PutEnd) of new keys from number ``first`` on."""
    def put(k: bytes) -> None:
        slot = _call(svc, 4, p.PutStart("bench", [k], [_OBJECT_BYTES]))[0]
        _call(svc, 5, p.PutEnd("bench", [k], [slot[1]]))

    return (lambda k=_key(i): put(k) for i in range(first, first + count))


def _gets(svc: MasterService, stored: int, count: int) -> Any:
    """``count`` single-key gets of random keys among the first ``stored``."""
    rng = random.Random(11)
    return (lambda k=_key(rng.randrange(stored)): _call(svc, 3, p.Get([k])) for _ in range(count))


def _standby(svc: MasterService, puts: int) -> tuple[float, float, float]:
    """(seconds to apply ``svc``'s snapshot to a Mirror, longest and 99.9th percentile seconds of
    applying one put's ops to it)."""
    gc.disable()
    try:
        ops = decode_ops(encode_ops(svc.snapshot()))  # as a standby or a journal gets them: objects of their own
        mirror = Mirror(svc.config.lease_ttl_s)
        t0 = time.perf_counter()
        mirror.apply(ops, 0.0)
        applied = time.perf_counter() - t0
        del ops
    finally:
        gc.enable()
    token = mirror.max_token
    offsets = iter(range(0, 1 << 62, _OBJECT_BYTES))

    def put(i: int) -> Any:
        start = StartOp(token + i, _key(10**15 + i), _OBJECT_BYTES, ["seg0", next(offsets)], 0, False, "bench", 1)
        end = EndOp(start.key, start.token)
        return lambda: mirror.apply([start, end], 1.0)

    try:
        longest, p999, _ = _pauses((put(i) for i in range(1, puts + 1)), _frozen())
    finally:
        gc.unfreeze()
    return applied, longest, p999


class Restarts(NamedTuple):
    """A lone master's restarts from ``--state-dir`` (``_restarts``): seconds, and the bytes read."""

    from_log: float  # the log of every put, no snapshot
    log_bytes: int
    from_snapshot: float  # a snapshot alone (columns), right after a fold
    snapshot_bytes: int
    promotion: float  # the restore a promoted standby does, from a mirror of ops
    fold_pause: float  # the fold that wrote the snapshot: the loop's pause (cut and fork)
    fold: float  # and its child's time to the renamed snapshot
    worst: float  # the snapshot and the most log the default fold_log_ratio lets through
    worst_log_bytes: int


def _restarts(objects: int, fold_log_ratio: float | None = None) -> Restarts:
    """A lone master's restarts from ``--state-dir`` (a temporary directory) holding ``objects``
    objects, as ``MasterServer`` recovers (journal read into a Mirror, a master restored from
    it, the collector off): from the log its puts wrote; from the snapshot a fold of the
    restarted master wrote (the fold timed too), alone and with the most log the default
    ``fold_log_ratio`` lets through after it (puts of new objects; or that many times the snapshot's
    bytes), and the restore a promoted standby does. Run in a process holding nothing else, as a
    restarted master is."""
    with tempfile.TemporaryDirectory(prefix="tidekv-bench-master-") as directory:
        return _restarts_in(directory, objects, fold_log_ratio)


def _restarts_in(directory: str, objects: int, fold_log_ratio: float | None = None) -> Restarts:
    from tqdm import tqdm

    svc = MasterService(MasterConfig(port=0, metrics_port=-1, high_watermark=1.0))
    svc.enable_journal()
    journal = JournalFile(directory)
    journal.resume()  # generation 0: no snapshot, every change in the log
    _call(svc, 0, p.Hello("bench", p.PROTOCOL_VERSION))
    # Room for the objects and the puts after the fold (below)
    _call(svc, 0, p.MountSegment("bench", "seg0", "127.0.0.1:1", 1 << 20, (2 * objects + 1000) * _OBJECT_BYTES))
    _persist(svc, journal)
    with tqdm(total=objects, desc=f"journaling {objects} puts", unit="obj", leave=False) as bar:
        _fill(svc, 0, objects, bar, journal)
    journal.close()
    log_bytes, lease_ttl_s = journal.log_bytes, svc.config.lease_ttl_s
    del svc
    gc.collect()
    from_log, _, restarted = _recover(directory, lease_ttl_s, objects)
    journal = JournalFile(directory)
    journal.load(Mirror(lease_ttl_s), 0.0)  # as the restarted master did, to append where the log ends
    journal.resume()
    fold = Fold(journal, functools.partial(restarted.snapshot, columns=True))  # the restarted master's first fold
    if not fold.finish():
        raise RuntimeError(f"the fold's child exited with {fold.exit_code}")
    alone = os.path.join(directory, "alone")  # the snapshot without the log written after it
    os.mkdir(alone)
    shutil.copy(os.path.join(directory, f"snapshot.{fold.generation}"), alone)
    # The most log a fold lets through at the default ratio: puts of new objects, as many as fit
    ratio = restarted.config.fold_log_ratio if fold_log_ratio is None else fold_log_ratio
    more = int(ratio * journal.snapshot_bytes / (log_bytes / objects))
    restarted.enable_journal()
    with tqdm(total=more, desc=f"journaling {more} puts after the fold", unit="obj", leave=False) as bar:
        _fill(restarted, objects, objects + more, bar, journal)
    journal.close()
    worst_log_bytes = journal.log_bytes
    del restarted
    gc.collect()
    worst, _, restarted = _recover(directory, lease_ttl_s, objects + more)
    del restarted
    gc.collect()
    from_snapshot, _, restarted = _recover(alone, lease_ttl_s, objects)
    del restarted
    gc.collect()
    _, promotion, _ = _recover(alone, lease_ttl_s, objects, as_standby=True)
    return Restarts(from_log, log_bytes, from_snapshot, journal.snapshot_bytes, promotion, fold.forked_s, fold.seconds,
                    worst, worst_log_bytes)


def _recover(directory: str, lease_ttl_s: float, objects: int,
             as_standby: bool = False) -> tuple[float, float, MasterService]:
    """(seconds in all, seconds of the restore from the Mirror, the restarted master). With
    ``as_standby``, the mirror is first made what a standby holds (every object an op, no
    snapshot's columns: ``Mirror.materialize``, not timed), so the restore is a promotion's."""
    gc.disable()
    try:
        t0 = time.perf_counter()
        mirror = Mirror(lease_ttl_s)
        JournalFile(directory).load(mirror, 0.0)
        if as_standby:
            mirror.materialize()
        t1 = time.perf_counter()
        new = MasterService(MasterConfig(port=0, metrics_port=-1))
        new.restore(mirror)
        took = time.perf_counter() - t0
        restore = time.perf_counter() - t1
    finally:
        gc.enable()
    if len(new.objects.objects) != objects:
        raise RuntimeError(f"the restart recovered {len(new.objects.objects)} of {objects} objects")
    return took, restore, new


def _frozen() -> FrozenHeap:
    heap = FrozenHeap(freeze_every_s=1.0)
    heap.tick()  # the first freeze takes the whole index at once (a master's first is at start, when it is empty)
    return heap


def _restarts_spawned(objects: int, fold_log_ratio: float | None = None) -> Restarts:
    """``_restarts`` in a new process of its own, as a restarted master is (and so that what it
    frees does not make room for a fill measured after it)."""
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as child:
        return child.submit(_restarts, objects, fold_log_ratio).result()


def _dict_floor(objects: int) -> float:
    """Seconds to build one dict of ``objects`` of the bench's keys in C (``dict(zip(...))``): the
    least any restore of an index held in Python dicts pays, once per dict it fills."""
    keys = [_key(i) for i in range(objects)]
    gc.disable()
    try:
        started = time.perf_counter()
        index = dict(zip(keys, range(objects)))
        took = time.perf_counter() - started
    finally:
        gc.enable()
    if len(index) != objects:
        raise RuntimeError(f"the dict holds {len(index)} of {objects} keys")
    return took


def _dict_floor_spawned(objects: int) -> float:
    """``_dict_floor`` in a new process of its own, as the restarts run."""
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as child:
        return child.submit(_dict_floor, objects).result()


def _restart_metrics(objects: int, restarts: Restarts, fold_log_ratio: float | None,
                     floor_s: float) -> list[dict[str, Any]]:
    r = restarts
    return [
        {"metric": "promotion: master restored from the mirror, s", "at_1k": None, "at_n": r.promotion,
         "ratio": None, "objects": objects},
        {"metric": f"restart from --state-dir: log of the puts ({r.log_bytes / 1e6:,.0f} MB), s", "at_1k": None,
         "at_n": r.from_log, "ratio": None, "objects": objects},
        {"metric": f"restart from --state-dir: snapshot ({r.snapshot_bytes / 1e6:,.0f} MB), s", "at_1k": None,
         "at_n": r.from_snapshot, "ratio": None, "objects": objects},
        {"metric": "restart from --state-dir: snapshot and the most log a fold lets through"
                   + ("" if fold_log_ratio is None else f" at --fold-log-ratio {fold_log_ratio:g}")
                   + f" ({r.worst_log_bytes / 1e6:,.0f} MB), s", "at_1k": None, "at_n": r.worst, "ratio": None,
         "objects": objects},
        {"metric": "floor: one dict of as many keys, built in C, s", "at_1k": None, "at_n": floor_s,
         "ratio": None, "objects": objects},
        {"metric": "fold: a lone master's loop pauses (cut and fork), s", "at_1k": None, "at_n": r.fold_pause,
         "ratio": None, "objects": objects},
        {"metric": "fold: its child writes the snapshot, s", "at_1k": None, "at_n": r.fold,
         "ratio": None, "objects": objects},
    ]


def restart_rows(objects: int, fold_log_ratio: float | None = None) -> list[dict[str, Any]]:
    """The restart rows alone (``--restarts-only``); ``fold_log_ratio``: the log after the snapshot
    of the worst-case restart, in snapshot bytes (None: the master's default)."""
    return _restart_metrics(objects, _restarts_spawned(objects, fold_log_ratio), fold_log_ratio,
                            _dict_floor_spawned(objects))


def run(objects: int, seconds: float) -> list[dict[str, Any]]:
    from tqdm import tqdm

    restarts = _restarts_spawned(objects)  # first: see there
    floor_s = _dict_floor_spawned(objects)
    svc = MasterService(MasterConfig(port=0, metrics_port=-1, high_watermark=1.0))
    _call(svc, 0, p.Hello("bench", p.PROTOCOL_VERSION))
    capacity = (objects * 2 + 1_000_000) * _OBJECT_BYTES  # bookkeeping only: no memory behind it
    _call(svc, 0, p.MountSegment("bench", "seg0", "127.0.0.1:1", 1 << 20, capacity))
    _fill(svc, 0, 1000)
    get_small = _get_rate(svc, 1000, seconds)
    put_small, next_new = _put_rate(svc, seconds, 10**12)
    batch_small, next_new = _batch_costs(svc, 1000, seconds, next_new)
    gc.collect()
    before = _rss_bytes()
    with tqdm(total=objects - 1000, desc=f"filling master to {objects} objects", unit="obj", leave=False) as bar:
        _fill(svc, 1000, objects, bar)
    gc.collect()
    per_object = (_rss_bytes() - before) / (objects - 1000)
    get_big = _get_rate(svc, objects, seconds)
    put_big, next_new = _put_rate(svc, seconds, next_new)
    batch_big, next_new = _batch_costs(svc, objects, seconds, next_new)
    full_small = _full_pool_put_rate(1000, seconds)
    full_big = _full_pool_put_rate(min(objects, 100_000), seconds)
    puts = max(10_000, objects // 2)
    mirror_s, longest_apply, p999_apply = _standby(svc, puts)
    try:
        longest_get, p999_get, _ = _pauses(_gets(svc, objects, 2 * puts), _frozen())
    finally:
        gc.unfreeze()
    longest, p999, collection = _pauses(_puts(svc, next_new, puts), None)
    try:
        longest_frozen, p999_frozen, collection_frozen = _pauses(_puts(svc, next_new + puts, puts), _frozen())
    finally:
        gc.unfreeze()
    return [
        {"metric": "get ops/s", "at_1k": get_small, "at_n": get_big, "ratio": get_big / get_small, "objects": objects},
        {"metric": "put ops/s", "at_1k": put_small, "at_n": put_big, "ratio": put_big / put_small, "objects": objects},
        *({"metric": f"{name} us/key, batches of {_KEY_BATCH}", "at_1k": batch_small[name], "at_n": batch_big[name],
           "ratio": batch_big[name] / batch_small[name], "objects": objects} for name in batch_small),
        {"metric": f"put ops/s, full pool (1k vs {min(objects, 100_000):,} objects)", "at_1k": full_small,
         "at_n": full_big, "ratio": full_big / full_small, "objects": objects},
        {"metric": "standby: snapshot applied to a mirror, s", "at_1k": None, "at_n": mirror_s, "ratio": None,
         "objects": objects},
        *_restart_metrics(objects, restarts, None, floor_s),
        {"metric": f"standby: longest put applied ms ({puts:,} puts)", "at_1k": None,
         "at_n": longest_apply * 1e3, "ratio": None, "objects": objects},
        {"metric": "  p99.9 put applied ms", "at_1k": None, "at_n": p999_apply * 1e3, "ratio": None,
         "objects": objects},
        {"metric": "bytes/object", "at_1k": None, "at_n": per_object, "ratio": None, "objects": objects},
        {"metric": f"longest put ms, collector as it comes ({puts:,} puts)", "at_1k": None, "at_n": longest * 1e3,
         "ratio": None, "objects": objects},
        {"metric": "  p99.9 put ms", "at_1k": None, "at_n": p999 * 1e3, "ratio": None, "objects": objects},
        {"metric": "  longest full collection ms", "at_1k": None, "at_n": collection * 1e3, "ratio": None,
         "objects": objects},
        {"metric": f"longest put or tick ms, index frozen ({puts:,} puts)", "at_1k": None,
         "at_n": longest_frozen * 1e3, "ratio": None, "objects": objects},
        {"metric": "  p99.9 put or tick ms", "at_1k": None, "at_n": p999_frozen * 1e3, "ratio": None,
         "objects": objects},
        {"metric": "  longest full collection ms", "at_1k": None, "at_n": collection_frozen * 1e3, "ratio": None,
         "objects": objects},
        {"metric": f"longest get or tick ms, index frozen ({2 * puts:,} gets)", "at_1k": None,
         "at_n": longest_get * 1e3, "ratio": None, "objects": objects},
        {"metric": "  p99.9 get or tick ms", "at_1k": None, "at_n": p999_get * 1e3, "ratio": None,
         "objects": objects},
    ]


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = sub.add_parser(
        "master",
        help="master memory per object and ops/s at 1k vs N objects",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--objects", type=int, default=1_000_000, help="objects to fill the master with (default 1000000)")
    parser.add_argument("--seconds", type=float, default=2.0, help="measuring time per rate (default 2)")
    parser.add_argument("--json", metavar="FILE", help="write one JSON object per row to FILE")
    parser.add_argument("--restarts-only", action="store_true",
                        help="only a lone master's restarts from --state-dir holding --objects objects (from the "
                             "log, from a snapshot) and the restore a promotion does: what sizes a master's outage")
    parser.add_argument("--fold-log-ratio", type=float, metavar="X",
                        help="the log after the snapshot in the worst-case restart row, in snapshot bytes (default: "
                             "the master's --fold-log-ratio default, the most log a fold lets through)")
    load = parser.add_argument_group("load mode (--load N): N client processes send prompt lookups, reads and saves "
                                     "to a master process; master CPU per key operation (tidekv.bench.master_load)")
    load.add_argument("--load", type=int, metavar="N", help="run the load mode with N client processes")
    load.add_argument("--blocks", type=int, default=64, help="blocks per prompt, at most (default 64)")
    load.add_argument("--object-bytes", type=int, default=1024, help="bytes per block object (default 1024: small, "
                      "so the master is what is loaded)")
    load.add_argument("--compare", choices=["mooncake"], action="append", default=[],
                      help="also load Mooncake's mooncake_master with the same clients and mix")
    load.add_argument("--groups", type=int, default=1, metavar="G",
                      help="also run a tidekv pool sharded over G master groups and report its capacity against "
                           "one master's, counted in CPU time of the busiest master (default 1: no sharded run)")
    parser.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    if args.load is not None:
        return _load_main(args)
    rows = restart_rows(args.objects, args.fold_log_ratio) if args.restarts_only else run(args.objects, args.seconds)
    cols = [
        Column("metric", "metric", align="<"),
        Column("at_1k", "at 1k objects", lambda v: f"{v:,.0f}" if v >= 100 else f"{v:.3g}"),
        Column("at_n", f"at {args.objects:,} objects", ",.6g"),
        Column("ratio", "ratio", ".2f"),
    ]
    print(format_table(rows, cols, title="tidekv master scaling (in-process MasterService.handle, encoded RPCs)"))
    if args.json:
        write_json_lines(args.json, rows)
    return 0


def _load_main(args: argparse.Namespace) -> int:
    from tidekv.bench.master_load import run_load

    if args.load < 1 or args.blocks < 1 or args.object_bytes < 1 or args.groups < 1:
        raise SystemExit("--load, --blocks, --object-bytes and --groups take a number >= 1")
    rows = run_load(args.load, args.seconds, args.blocks, args.object_bytes, args.compare, args.groups)
    cols = [
        Column("master", "master", align="<"),
        Column("groups", "groups", "d"),
        Column("clients", "clients", "d"),
        Column("prompts", "prompts", ",d"),
        Column("key_ops", "key ops", ",d"),
        Column("keys_per_s", "keys/s", ",.0f"),
        Column("master_cpu_us_per_key", "master CPU us/key", ".3f"),
        Column("master_cpu_share", "master CPU share", ".2f"),
        Column("keys_per_busiest_cpu_s", "keys per busiest master CPU s", ",.0f"),
    ]
    print(format_table(rows, cols, title=f"master under load: {args.load} clients, prompts of 1-{args.blocks} blocks "
                       f"of {args.object_bytes} B (lookup all, read the leading hits, save the rest), "
                       f"{args.seconds:g} s (Mooncake store API on both; tidekv = its drop-in over a tidekv master)"))
    if "keys_per_cpu_s_vs_mooncake" in rows[0]:
        r = rows[0]
        print(f"tidekv / Mooncake: keys per master CPU second {r['keys_per_cpu_s_vs_mooncake']:.2f}x, "
              f"keys/s {r['keys_per_s_vs_mooncake']:.2f}x")
    if "capacity_vs_one_group" in rows[-1]:
        print(f"{args.groups} groups / 1: keys per CPU second of the busiest master "
              f"{rows[-1]['capacity_vs_one_group']:.2f}x (each group on a core of its own)")
        from tidekv.bench.master_load import request_costs

        costs = request_costs()
        print("what a request costs the master before its keys (each group gets one per batch): " + ", ".join(
            f"{c['loop']}: Exists of {c['batch']} keys {c['master_cpu_us_per_request']:.1f} us" for c in costs))
        rows += costs
    if args.json:
        write_json_lines(args.json, rows)
    return 0
