"""``tidekv bench failover``: leader kills under load, with every acknowledged object checked.

Three phases on 127.0.0.1, each party its own process: *single* (a lone master under ``churn``
load, the p50 baseline), *HA* (etcd, three masters; ``--kills`` times the leader is SIGKILLed
mid-period, every key is read back, the master rejoins as a standby; failover time per client
and put/get p50 against the single master's), and *restart* (``--state-dir`` recovery time,
``restart_recovery_s``). ``--json FILE`` writes one summary object.
Neighbours: ``churn`` (the load and its books), ``tidekv.helper_process`` (helpers),
``etcd_server`` (the etcd).
Design notes: docs/design-bench.md#tidekvbenchfailover
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import tempfile
import time
import urllib.request
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from tidekv.bench import churn
from tidekv.bench.etcd_server import EtcdServer
from tidekv.errors import ConfigError, TidekvError
from tidekv.helper_process import HelperProcess, send_ready, serve

logger = logging.getLogger(__name__)

MASTER = {"leader_ttl_s": 2, "sync_timeout_s": 0.5, "client_ttl_s": 10.0, "lease_ttl_s": 2.0, "metrics_port": 0}
CLIENT = {"rpc_timeout_s": 1.0, "failover_timeout_s": 15.0, "staging_size_bytes": 16 << 20}


# ---- helpers (separate processes) ---------------------------------------------------------


def _master_main(conn: Connection, config: dict[str, Any]) -> None:
    from tidekv.config import MasterConfig
    from tidekv.store import MasterServer

    deadline = time.monotonic() + 10
    while True:
        try:
            server = MasterServer(MasterConfig(**config)).start()
            break
        except ConfigError:
            if not config.get("port") or time.monotonic() > deadline:
                raise
            time.sleep(0.1)  # the port of a master just killed
    send_ready(conn, {"address": server.address, "port": server.rpc_port, "metrics_port": server.metrics_port})
    serve(conn)
    server.stop()


def _client_main(conn: Connection, master: str, segment_size: int) -> None:
    from tidekv.config import StoreConfig
    from tidekv.store import Store

    store = Store.connect(master, segment_size=segment_size, config=StoreConfig(**CLIENT))
    books = churn.Books()

    def handle(message: tuple[Any, ...]) -> Any:
        if message[0] == "churn":
            _, prefix, duration_s, keys, size, seed = message
            churn.churn(store, prefix, duration_s, keys=keys, size=size, seed=seed, books=books)
            return books.summary()
        if message[0] == "verify":
            return churn.verify(store, books, message[1])
        if message[0] == "gap":  # (last success before t, first success after t)
            t = message[1]
            before = max((s for s in books.successes if s <= t), default=None)
            after = min((s for s in books.successes if s > t), default=None)
            return before, after
        if message[0] == "latency":
            return (statistics.median(books.put_s) if books.put_s else None,
                    statistics.median(books.get_s) if books.get_s else None)
        if message[0] == "fill":
            _, count, size = message
            for i in range(count):
                store.put(f"fill/{i}", churn.value(f"fill/{i}", 1, size))
            return count
        if message[0] == "read_all":
            _, count, size = message
            for i in range(count):
                if store.get(f"fill/{i}") != churn.value(f"fill/{i}", 1, size):
                    raise TidekvError(f"fill/{i} came back different")
            return count
        raise ValueError(f"unknown call {message!r}")

    send_ready(conn, {"client_id": store.client_id})
    try:
        serve(conn, handle)
    finally:
        store.close()


# ---- the run --------------------------------------------------------------------------


def _health(master: HelperProcess) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{master.hello['metrics_port']}/health", timeout=1) as r:
        return dict(json.loads(r.read()))


def _leader(masters: list[HelperProcess], timeout_s: float = 20.0) -> HelperProcess:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for m in masters:
            try:
                h = _health(m)
            except OSError:
                continue
            if h["role"] == "leader" and h["serving"] and len(h.get("insync", [])) == 3:
                return m
        time.sleep(0.1)
    raise TidekvError(f"no leader with two standbys in sync within {timeout_s:.0f} s")


def _churn_round(clients: list[HelperProcess], period_s: float, keys: int, size: int, seed: int,
                 kill: Any = None) -> float | None:
    for i, c in enumerate(clients):
        c.send(("churn", f"c{i}", period_s, keys, size, seed + i))
    killed_at = None
    if kill is not None:
        time.sleep(period_s / 3)
        killed_at = time.monotonic()
        kill()
    for c in clients:
        c.receive(period_s + 120)
    return killed_at


def run(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="tidekv-bench-failover-"))
    helpers: list[HelperProcess] = []

    def helper(name: str, main: Any, *a: Any) -> HelperProcess:
        h = HelperProcess(name, main, a, work)
        helpers.append(h)
        return h

    etcd = None
    try:
        # 1 and 2 side by side: their rounds alternate, so passing machine load hits both alike
        lone = helper("single-master", _master_main, {**MASTER, "port": 0})
        helper("single-holder", _client_main, lone.hello["address"], args.segment_bytes)
        singles = [helper(f"single-client-{i}", _client_main, lone.hello["address"], 0) for i in range(args.clients)]
        etcd = EtcdServer(work)
        cfg = {**MASTER, "port": 0, "etcd": etcd.url, "cluster": "bench"}
        masters = [helper(f"master-{i}", _master_main, cfg) for i in range(3)]
        address = f"etcd://{etcd.endpoints}/bench"
        helper("holder", _client_main, address, args.segment_bytes)
        clients = [helper(f"client-{i}", _client_main, address, 0) for i in range(args.clients)]
        failovers, lost, stale = [], 0, 0
        kill_times: list[float] = []
        for k in range(args.kills):
            _churn_round(singles, args.baseline_s, args.keys, args.size, 0)
            victim = _leader(masters)
            killed_at = _churn_round(clients, args.period_s, args.keys, args.size, 100 * (k + 1),
                                     lambda v=victim: v.kill())
            assert killed_at is not None
            kill_times.append(round(killed_at, 3))
            for c in clients:
                before, after = c.call(("gap", killed_at), 30)
                failovers.append((after - before) if before is not None and after is not None else float("inf"))
                report = c.call(("verify", args.size), 120)
                lost += report["lost"]
                stale += report["stale"]
            masters.remove(victim)
            masters.append(helper(f"master-{3 + k}", _master_main, cfg))
            print(f"kill {k + 1}/{args.kills}: failover {max(failovers[-len(clients):]):.2f} s (worst client)",
                  flush=True)
        single = [c.call(("latency",), 30) for c in singles]
        summaries = [c.call(("churn", f"c{i}", 0.0, args.keys, args.size, 0), 30) for i, c in enumerate(clients)]
        ha = [c.call(("latency",), 30) for c in clients]
        for h in helpers:
            h.stop()
        helpers.clear()
        # 3. a lone master that restarts from its state directory
        restart_s = _restart(helper, work, args)
    finally:
        for h in helpers:
            h.stop()
        if etcd is not None:
            etcd.stop()
        shutil.rmtree(work, ignore_errors=True)
    stale_reads = stale + sum(s["stale_reads"] for s in summaries)
    return {
        "kills": args.kills,
        "clients": args.clients,
        "acknowledged": sum(s["acknowledged"] for s in summaries),
        "lost": lost,
        "readable": sum(s["acknowledged"] for s in summaries) - lost,
        "stale_reads": stale_reads,
        "failover_p50_s": statistics.median(failovers) if failovers else None,
        "failover_max_s": max(failovers) if failovers else None,
        "put_p50_ha_s": statistics.median(p for p, _ in ha), "put_p50_single_s": statistics.median(p for p, _ in single),
        "get_p50_ha_s": statistics.median(g for _, g in ha), "get_p50_single_s": statistics.median(g for _, g in single),
        "put_p50_ratio": statistics.median(p for p, _ in ha) / statistics.median(p for p, _ in single),
        "get_p50_ratio": statistics.median(g for _, g in ha) / statistics.median(g for _, g in single),
        "restart_objects": args.restart_objects,
        "restart_recovery_s": restart_s,
        "errors": {k: sum(s["errors"].get(k, 0) for s in summaries) for s in summaries for k in s["errors"]},
        "stale_examples": [e for s in summaries for e in s["stale_examples"]],
        "kill_times": kill_times,
    }


def _restart(helper: Any, work: Path, args: argparse.Namespace) -> float:
    cfg = {**MASTER, "port": 0, "state_dir": str(work / "state")}
    first = helper("restart-master", _master_main, cfg)
    address = first.hello["address"]
    helper("restart-holder", _client_main, address, max(args.segment_bytes, 2 * args.restart_objects * 4096))
    writer = helper("restart-client", _client_main, address, 0)
    writer.call(("fill", args.restart_objects, 4096), 600)
    first.kill()
    started = time.monotonic()
    helper("restart-master-2", _master_main, {**cfg, "port": first.hello["port"]})
    writer.call(("read_all", args.restart_objects, 4096), 600)
    return time.monotonic() - started


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("failover", help="leader kills under load: failover time, lost objects, HA cost",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kills", type=int, default=10, help="leader kills (default 10)")
    p.add_argument("--clients", type=int, default=3, help="load client processes (default 3)")
    p.add_argument("--period-s", type=float, default=6.0, help="load per kill, the kill a third in (default 6)")
    p.add_argument("--baseline-s", type=float, default=3.0,
                   help="load on the single master before each kill round (default 3)")
    p.add_argument("--keys", type=int, default=200, help="keys per client (default 200)")
    p.add_argument("--size", type=int, default=4096, help="object bytes (default 4096)")
    p.add_argument("--segment-bytes", type=int, default=64 << 20, help="the holder's segment (default 64 MiB)")
    p.add_argument("--restart-objects", type=int, default=10000,
                   help="objects in the lone-master restart (default 10000)")
    p.add_argument("--json", metavar="FILE", help="write the summary here")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    summary = run(args)
    print(json.dumps(summary, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if summary["lost"] == 0 and summary["stale_reads"] == 0 else 1
