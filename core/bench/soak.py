"""Soak: a store under full load for minutes while its holders are SIGKILLed and restarted, with
every acknowledged object accounted for (``benchmarks/soak.py``).

One master, two holders and ``clients`` client processes on 127.0.0.1 run ``churn``'s mix (plus
transfer-engine WRITE/READ checks) while one holder in turn is SIGKILLed every ``kill_every_s``
and replaced; RSS, fds and the master's segment books are sampled. Each read is checked against
the last acknowledged write: a loss is classed *every holder died*, *after a failed write* or
*unexplained* (a bug); another version or a torn value is stale or corrupt.

Neighbours: ``churn`` (values and books), ``tidekv.helper_process``, ``failover``.
Design notes: docs/design-bench.md#tidekvbenchsoak
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import tempfile
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from tidekv.bench import churn
from tidekv.errors import LeaseExpiredError, ObjectNotFoundError, TidekvError
from tidekv.helper_process import HelperProcess, send_ready, serve

logger = logging.getLogger(__name__)

MASTER = {"port": 0, "client_ttl_s": 3.0, "lease_ttl_s": 2.0, "busy_poll_us": 0, "metrics_port": 0}  # any free ports
"""A killed holder is declared dead after 3 s (default 10), so puts stop choosing it sooner.
No busy polling anywhere: eleven processes share this VM's two vCPUs."""
CLIENT = {"rpc_timeout_s": 2.0, "heartbeat_interval_s": 0.5, "rpc_busy_poll_us": 0, "staging_size_bytes": 8 << 20}
SLOT_BYTES = 16 << 10
"""Bytes of one transfer (a client's slot in the next client's region)."""


# ---- helpers (separate processes) ---------------------------------------------------------


def _master_main(conn: Connection, config: dict[str, Any]) -> None:
    from tidekv.config import MasterConfig
    from tidekv.store import MasterServer

    server = MasterServer(MasterConfig(**config)).start()
    send_ready(conn, {"address": server.address, "metrics_port": server.metrics_port, "pid": os.getpid()})
    serve(conn)
    server.stop()


def _holder_main(conn: Connection, master: str, segment_bytes: int) -> None:
    from tidekv.config import StoreConfig
    from tidekv.store import Store

    store = Store.connect(master, segment_size=segment_bytes, config=StoreConfig(**CLIENT))
    send_ready(conn, {"client_id": store.client_id, "pid": os.getpid()})
    serve(conn)  # until killed, mostly
    store.close()


@dataclass
class _Written:
    version: int
    started: float  # monotonic (system-wide on Linux: comparable across processes)
    acked: float


@dataclass
class _ClientState:
    books: churn.Books = field(default_factory=churn.Books)
    written: dict[str, _Written] = field(default_factory=dict)
    failed_since: set[str] = field(default_factory=set)  # keys whose last write attempt failed
    attempts: dict[str, dict[int, _Written]] = field(default_factory=dict)  # failed writes since the last success
    losses: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict)
    transfers: Counter[str] = field(default_factory=Counter)
    versions: dict[str, int] = field(default_factory=dict)
    errors: Counter[str] = field(default_factory=Counter)  # "op ErrorType"
    error_examples: dict[str, str] = field(default_factory=dict)
    error_seconds: Counter[int] = field(default_factory=Counter)  # errors per whole second (monotonic)

    def error(self, op: str, exc: BaseException) -> None:
        what = f"{op} {type(exc).__name__}"
        self.errors[what] += 1
        self.error_examples.setdefault(what, str(exc)[:300])
        self.error_seconds[int(time.monotonic())] += 1


def _client_main(conn: Connection, master: str, index: int, replicas: int) -> None:
    from tidekv import TransferEngine, TransferOp, TransferRequest
    from tidekv.config import StoreConfig
    from tidekv.store import Store

    store = Store.connect(master, segment_size=0, config=StoreConfig(**CLIENT, replicas=replicas))
    engine = TransferEngine()
    region = engine.register(bytearray(3 * SLOT_BYTES))  # [slot my predecessor writes | my source | my reads]
    state = _ClientState()
    peer: dict[str, Any] = {}

    def transfer(rng: random.Random) -> None:
        data = rng.randbytes(SLOT_BYTES)
        region.view()[SLOT_BYTES: 2 * SLOT_BYTES] = data
        engine.transfer([TransferRequest(TransferOp.WRITE, region.addr(SLOT_BYTES), SLOT_BYTES, peer["engine"],
                                         peer["addr"])]).wait(timeout_s=10)
        engine.transfer([TransferRequest(TransferOp.READ, region.addr(2 * SLOT_BYTES), SLOT_BYTES, peer["engine"],
                                         peer["addr"])]).wait(timeout_s=10)
        state.transfers["ok" if bytes(region.view()[2 * SLOT_BYTES:]) == data else "mismatch"] += 1

    def handle(message: tuple[Any, ...]) -> Any:
        if message[0] == "peer":
            peer.update(engine=message[1], addr=message[2])
            return True
        if message[0] == "run":
            _, duration_s, keys, cold_keys, size, transfer_every, seed = message
            _load(store, state, f"c{index}", duration_s, keys, cold_keys, size, transfer_every, random.Random(seed),
                  transfer)
            return _summary(state)
        if message[0] == "verify":
            return _verify(store, state, message[1])
        raise ValueError(f"unknown call {message!r}")

    send_ready(conn, {"engine": engine.name, "addr": region.addr(0), "pid": os.getpid()})
    try:
        serve(conn, handle)
    finally:
        store.close()
        engine.close()


def _load(store: Any, state: _ClientState, prefix: str, duration_s: float, keys: int, cold_keys: int, size: int,
          transfer_every: int, rng: random.Random, transfer: Any) -> None:
    books = state.books
    deadline = time.monotonic() + duration_s
    for i in range(cold_keys):  # written once, read back only at the end
        key = f"{prefix}/cold/{i}"
        started = time.monotonic()
        try:
            store.put(key, churn.value(key, 1, size))
        except TidekvError as exc:
            state.error("cold put", exc)
            continue
        books.wrote(key, 1)
        state.written[key] = _Written(1, started, time.monotonic())
    n = 0
    while time.monotonic() < deadline:
        n += 1
        if transfer_every and n % transfer_every == 0:
            books.ops["transfer"] = books.ops.get("transfer", 0) + 1
            try:
                transfer(rng)
            except TidekvError as exc:
                state.error("transfer", exc)
            continue
        key = f"{prefix}/{rng.randrange(keys)}"
        roll = rng.random()
        kind = "get" if roll < 0.5 else "write" if roll < 0.9 else "remove"
        books.ops[kind] = books.ops.get(kind, 0) + 1
        try:
            if kind == "get":
                _read(store, state, key, size)
            elif kind == "remove":
                try:
                    store.remove(key, force=True)
                except ObjectNotFoundError:
                    pass
                books.wrote(key, churn.ABSENT)
                state.written.pop(key, None)
                state.attempts.pop(key, None)
                state.failed_since.discard(key)
            else:
                version = state.versions[key] = state.versions.get(key, 0) + 1
                is_new = books.allowed(key) == {churn.ABSENT}
                started = time.monotonic()
                try:
                    (store.put if is_new else store.upsert)(key, churn.value(key, version, size))
                except TidekvError as exc:
                    books.failed(key, version, exc)
                    state.error("upsert" if not is_new else "put", exc)
                    state.failed_since.add(key)
                    state.attempts.setdefault(key, {})[version] = _Written(version, started, time.monotonic())
                    continue
                books.wrote(key, version)
                state.attempts.pop(key, None)
                state.written[key] = _Written(version, started, time.monotonic())
                state.failed_since.discard(key)
        except TidekvError as exc:
            if kind == "remove":
                books.uncertain.setdefault(key, set()).add(churn.ABSENT)
                state.failed_since.add(key)
            state.error(kind, exc)


def _read(store: Any, state: _ClientState, key: str, size: int, *, is_final: bool = False) -> str:
    """Reads ``key`` and settles it in the books; returns what it found: "intact", "absent"
    (acknowledged absent, fine), "lost", "stale", "corrupt", "unreadable"."""
    books = state.books
    try:
        data = store.get(key)
    except ObjectNotFoundError:
        seen = churn.ABSENT
    except LeaseExpiredError:
        return "unreadable"
    else:
        v = churn.version_of(key, data, size)
        if v is None:
            books.stale(key, None)
            return "corrupt"
        seen = v
    allowed = books.allowed(key)
    if seen in allowed:
        if books.uncertain.get(key):
            books.wrote(key, seen)  # the read settles it: a failed write (or remove) did land
            landed = state.attempts.pop(key, {}).get(seen)
            if seen == churn.ABSENT:
                state.written.pop(key, None)
            elif landed is not None:
                state.written[key] = landed
        return "absent" if seen == churn.ABSENT else "intact"
    acked = books.acked.get(key, churn.ABSENT)
    if seen == churn.ABSENT and acked != churn.ABSENT:
        _lost(state, key, acked, is_final)
        return "lost"
    books.stale(key, seen)
    return "stale"


def _lost(state: _ClientState, key: str, version: int, is_final: bool) -> None:
    w = state.written.get(key)
    state.losses.setdefault((key, version), {
        "key": key, "version": version, "seen_s": time.monotonic(), "final": is_final,
        "write": (w.started, w.acked) if w is not None and w.version == version else None,
        "after_failed_write": key in state.failed_since})


def _verify(store: Any, state: _ClientState, size: int) -> dict[str, Any]:
    found: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    for key, version in list(state.books.acked.items()):
        if version == churn.ABSENT:
            continue
        try:
            found[_read(store, state, key, size, is_final=True)] += 1
        except TidekvError as exc:
            errors[type(exc).__name__] += 1
            found["unreadable"] += 1
            _lost(state, key, version, True)
    return {"found": dict(found), "errors": dict(errors), "losses": list(state.losses.values())}


def _summary(state: _ClientState) -> dict[str, Any]:
    b = state.books
    return {"ops": b.ops, "errors": dict(state.errors), "error_examples": state.error_examples,
            "error_seconds": dict(state.error_seconds), "stale_reads": b.stale_reads, "stale_examples": b.stale_examples,
            "transfers": dict(state.transfers),
            "acknowledged": sum(1 for v in b.acked.values() if v != churn.ABSENT)}


# ---- the run --------------------------------------------------------------------------


@dataclass
class _Incarnation:
    name: str
    process: HelperProcess
    spawned_s: float
    killed_s: float | None = None
    samples: list[tuple[float, int, int]] = field(default_factory=list)  # (t, rss bytes, fds)


def _rss_and_fds(pid: int) -> tuple[int, int]:
    with open(f"/proc/{pid}/status") as f:
        rss_kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return rss_kib << 10, len(os.listdir(f"/proc/{pid}/fd"))


def _health(metrics_port: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/health", timeout=5) as r:
        return dict(json.loads(r.read()))


def _segments(health: dict[str, Any]) -> dict[str, Any]:
    return {"segments": len(health["segments"]), "suspended_segments": len(health["suspended_segments"]),
            "keys": health["keys"], "used_bytes": health["used_bytes"], "capacity_bytes": health["capacity_bytes"],
            "pending_puts": health["pending_puts"], "evictions": health["evictions"],
            "objects_lost": health["objects_lost"], "suspended_objects_dropped": health["suspended_objects_dropped"],
            "repairs": health.get("repairs", {})}


def _memory(procs: list[_Incarnation], window_start_s: float) -> dict[str, Any]:
    out = {}
    for p in procs:
        if not p.samples:
            continue
        start, end = p.samples[0], p.samples[-1]
        row: dict[str, Any] = {"rss_start_mib": round(start[1] / 2**20, 1), "rss_end_mib": round(end[1] / 2**20, 1),
                               "fds_start": start[2], "fds_end": end[2], "lived_s": round(end[0] - start[0], 1)}
        in_window = [s for s in p.samples if s[0] >= window_start_s]
        if p.killed_s is None and p.samples[0][0] <= window_start_s and in_window:
            at = in_window[0]
            row["rss_window_start_mib"] = round(at[1] / 2**20, 1)
            row["rss_growth_pct"] = round(100 * (end[1] - at[1]) / at[1], 2)
        out[p.name] = row
    return out


def classify(losses: list[dict[str, Any]], holders: list[_Incarnation]) -> dict[str, Any]:
    """Sorts losses into every-replica-holder-died / after-a-failed-write / unexplained."""
    kinds: Counter[str] = Counter()
    unexplained = []
    for loss in losses:
        if loss["write"] is None:
            kind = "after_failed_write" if loss["after_failed_write"] else "unexplained"
        else:
            started, acked = loss["write"]
            alive = [h for h in holders if h.spawned_s <= acked and (h.killed_s is None or h.killed_s >= started)]
            if alive and all(h.killed_s is not None and h.killed_s <= loss["seen_s"] for h in alive):
                kind = "every_replica_holder_died"
            elif loss["after_failed_write"]:
                kind = "after_failed_write"
            else:
                kind = "unexplained"
        kinds[kind] += 1
        if kind == "unexplained" and len(unexplained) < 10:
            unexplained.append(loss)
    return {"every_replica_holder_died": kinds["every_replica_holder_died"],
            "after_failed_write": kinds["after_failed_write"], "unexplained": kinds["unexplained"],
            "unexplained_examples": unexplained}


def run(duration_s: float, *, clients: int = 8, kill_every_s: float = 60.0, replicas: int = 2, keys: int = 200,
        cold_keys: int = 50, size: int = 4096, segment_bytes: int = 64 << 20, transfer_every: int = 8, sample_every_s: float = 5.0,
        window_start_s: float | None = None, log_dir: str | None = None) -> dict[str, Any]:
    """Runs the soak; returns its report (see the module docstring).

    Args:
        window_start_s: where the RSS growth window starts, seconds into the load (default
            min(120, duration_s / 5): "minute 2" of a 10-minute run).
    """
    work = Path(log_dir or tempfile.mkdtemp(prefix="tidekv-soak-"))
    window = min(120.0, duration_s / 5) if window_start_s is None else window_start_s
    with contextlib.ExitStack() as stack:
        master = stack.enter_context(HelperProcess("master", _master_main, (MASTER,), work))
        address, metrics_port = master.hello["address"], master.hello["metrics_port"]
        generation = Counter[int]()

        def start_holder(slot: int) -> _Incarnation:
            generation[slot] += 1
            name = f"holder{slot}.{generation[slot]}"
            spawned = time.monotonic()
            return _Incarnation(name, HelperProcess(name, _holder_main, (address, segment_bytes), work), spawned)

        holders = [start_holder(0), start_holder(1)]
        all_holders = list(holders)
        stack.callback(lambda: [h.process.stop() for h in all_holders if h.killed_s is None])
        client_procs = [stack.enter_context(HelperProcess(f"client{i}", _client_main, (address, i, replicas), work))
                        for i in range(clients)]
        for i, c in enumerate(client_procs):  # client i writes into client i+1's first slot
            nxt = client_procs[(i + 1) % clients].hello
            c.call(("peer", nxt["engine"], nxt["addr"]), timeout_s=10)
        procs = [_Incarnation("master", master, time.monotonic())] + [
            _Incarnation(f"client{i}", c, time.monotonic()) for i, c in enumerate(client_procs)]

        segment_samples: list[dict[str, Any]] = []

        def sample(t: float) -> None:
            for p in procs + [h for h in all_holders if h.killed_s is None]:
                with contextlib.suppress(OSError, StopIteration):
                    p.samples.append((t, *_rss_and_fds(p.process.hello["pid"])))
            with contextlib.suppress(OSError):
                segment_samples.append({"at_s": round(t - t0, 1), **_segments(_health(metrics_port))})

        t0 = time.monotonic()
        sample(t0)
        for i, c in enumerate(client_procs):
            c.send(("run", duration_s, keys, cold_keys, size, transfer_every, 1000 + i))
        kills = []
        next_kill, next_sample, turn = t0 + kill_every_s, t0 + sample_every_s, 0
        while (now := time.monotonic()) < t0 + duration_s:
            if now >= next_kill:
                slot = turn % 2
                victim = holders[slot]
                victim.process.kill()
                victim.killed_s = time.monotonic()
                holders[slot] = start_holder(slot)
                all_holders.append(holders[slot])
                kills.append({"holder": victim.name, "at_s": round(victim.killed_s - t0, 1),
                              "replacement_ready_in_s": round(time.monotonic() - victim.killed_s, 2)})
                turn += 1
                next_kill += kill_every_s
            if now >= next_sample:
                sample(now)
                next_sample += sample_every_s
            time.sleep(0.05)
        summaries = [c.receive(timeout_s=120) for c in client_procs]
        sample(time.monotonic())
        t_end = time.monotonic()
        verified = [c.call(("verify", size), timeout_s=600) for c in client_procs]
        segments_end = _segments(_health(metrics_port))
    losses = [loss for v in verified for loss in v["losses"]]
    ops: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    transfers: Counter[str] = Counter()
    found: Counter[str] = Counter()
    verify_errors: Counter[str] = Counter()
    for s, v in zip(summaries, verified):
        ops.update(s["ops"])
        errors.update(s["errors"])
        transfers.update(s["transfers"])
        found.update(v["found"])
        verify_errors.update(v["errors"])
    examples: dict[str, str] = {}
    for s in summaries:
        for what, text in s["error_examples"].items():
            examples.setdefault(what, text)
    kill_times = [k["at_s"] + t0 for k in kills]
    since_kill: Counter[str] = Counter()
    for s in summaries:
        for second, n in s["error_seconds"].items():
            t = int(second) + 0.5  # a whole second of errors, placed at its middle
            last = max((k for k in kill_times if k <= t), default=None)
            since_kill[_bucket(None if last is None else t - last)] += n
    memory = _memory(procs, t0 + window)
    memory.update(_memory(all_holders, t0 + window))
    checked = sum(found.values())
    return {
        "duration_s": round(t_end - t0, 1), "clients": clients, "holders": 2, "replicas": replicas,
        "kill_every_s": kill_every_s, "keys_per_client": keys, "cold_keys_per_client": cold_keys, "value_bytes": size,
        "ops": dict(ops), "ops_per_s": round(sum(ops.values()) / (t_end - t0)),
        "errors": dict(errors), "error_examples": examples, "errors_since_kill": dict(since_kill),
        "transfers": dict(transfers), "kills": kills,
        "stale_reads": sum(s["stale_reads"] for s in summaries),
        "stale_examples": [e for s in summaries for e in s["stale_examples"]][:10],
        "acknowledged": sum(s["acknowledged"] for s in summaries),
        "checked": checked, "found": dict(found), "verify_errors": dict(verify_errors),
        "lost": classify(losses, all_holders),
        "losses_during_load": sum(1 for loss in losses if not loss["final"]),
        "memory": {"window_start_s": round(window, 1), "processes": memory},
        "master_segments": {"start": segment_samples[0], "end": segments_end,
                             "window_start": next((x for x in segment_samples if x["at_s"] >= window), segments_end),
                             "max_used_bytes": max(x["used_bytes"] for x in segment_samples),
                             "samples": segment_samples},
        "log_dir": str(work),
    }


def _bucket(since_s: float | None) -> str:
    if since_s is None:
        return "before the first kill"
    for limit in (1, 2, 5, 10, 30):
        if since_s < limit:
            return f"< {limit} s after a kill"
    return ">= 30 s after a kill"


def format_report(r: dict[str, Any]) -> str:
    lines = [
        (f"soak: {r['duration_s']:.0f} s, {r['clients']} clients, {r['holders']} holders (one SIGKILLed and restarted "
         f"every {r['kill_every_s']:.0f} s: {len(r['kills'])} kills), replicas={r['replicas']}"),
        f"ops: {sum(r['ops'].values()):,} ({r['ops_per_s']:,}/s) {r['ops']}",
        f"errors by kind (load): {r['errors'] or 'none'}",
        f"errors by time since the last kill: {r['errors_since_kill'] or 'none'}",
        f"transfers: {r['transfers']}",
        (f"acknowledged objects at the end: {r['acknowledged']:,}; read back: {r['found']}; "
         f"verify errors: {r['verify_errors'] or 'none'}"),
        (f"lost: {r['lost']['every_replica_holder_died']} with every holder of their replicas killed before a copy "
         f"was made, {r['lost']['after_failed_write']} after a failed write of the key, "
         f"{r['lost']['unexplained']} unexplained; {r['losses_during_load']} of these seen during the load"),
        f"stale reads: {r['stale_reads']}",
        f"memory (RSS MiB start -> end, growth from {r['memory']['window_start_s']:.0f} s to the end; fds):",
    ]
    for name, m in r["memory"]["processes"].items():
        growth = f", {m['rss_window_start_mib']} -> {m['rss_end_mib']} = {m['rss_growth_pct']:+.2f}%" \
            if "rss_growth_pct" in m else f" (lived {m['lived_s']:.0f} s)"
        lines.append(f"  {name:11} {m['rss_start_mib']:7.1f} -> {m['rss_end_mib']:7.1f}{growth}; "
                     f"fds {m['fds_start']} -> {m['fds_end']}")
    s, e = r["master_segments"]["start"], r["master_segments"]["end"]
    w = r["master_segments"]["window_start"]
    lines.append(f"master segments: start {s}")
    lines.append(f"  at {w['at_s']:.0f} s {w}")
    lines.append(f"  end   {e}")
    lines.append(f"  most bytes in use at a sample: {r['master_segments']['max_used_bytes']:,}")
    return "\n".join(lines)
