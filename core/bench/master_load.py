"""``tidekv bench master --load N``: a master's capacity under N clients sending a KV-cache mix.

Each client process runs prompts: a prompt is ``--blocks`` block keys of one of a few hundred
prefixes (longer prefixes share their head with shorter ones); it looks all of them up in one
batch (``exists_many``), reads the leading run found (``get_many_into``) and saves the rest
(``put_many_from``) — what a prefill's connector asks of the pool. Objects are small
(``--object-bytes``) so that the master, not the data path, is what is loaded. The clients drive
tidekv's master and Mooncake's ``mooncake_master`` through the same Mooncake store API (tidekv's
drop-in, ``tidekv.compat``, over a tidekv master), so the two masters see the same calls.

Reported per master: key operations (the keys the three batch calls carried) per second of wall
time, and the master process's CPU time per key operation, read from ``/proc/<pid>/stat`` before
and after: on a VM with two cores shared by clients and master, CPU per key is what stays
comparable when wall-clock rates are capped by the clients.

With ``--groups G`` the tidekv pool is also run sharded over G master groups (``Store`` with
``master="a;b;..."``), and the row says how many keys per second G groups would serve, each on
a core of its own, against one: the busiest group saturates first, so capacity is the keys
carried per CPU second of the busiest master.
"""

from __future__ import annotations

import os
import random
import signal
import tempfile
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from tidekv.bench.mooncake_store import (
    LOCAL_BUFFER_BYTES,
    MooncakeApi,
    MooncakeMaster,
    _MooncakeClient,
    _setup,
    check_available,
)
from tidekv import eventloop
from tidekv.helper_process import HelperProcess, send_ready, serve

PREFIXES = 256
"""Prefix families per client: prompts of one family share their leading blocks."""


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of process ``pid`` so far (``/proc/<pid>/stat``)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _client_main(conn: Connection, api: MooncakeApi, master: str, segment_bytes: int, index: int,
                 blocks: int, object_bytes: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    store = _setup(api, master, segment_bytes, LOCAL_BUFFER_BYTES)
    client = _MooncakeClient(store, blocks * object_bytes)
    spans = [(client.buffer_address + i * object_bytes, object_bytes) for i in range(blocks)]
    rng = random.Random(index)

    def run(seconds: float) -> dict[str, int]:
        counts = {"prompts": 0, "looked_up": 0, "read": 0, "saved": 0}
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            family = int(rng.paretovariate(1.2)) % PREFIXES  # a few prefixes are hot
            length = rng.randint(1, blocks)
            keys = [f"c{index}-p{family}-b{b}" for b in range(length)]
            found = client.exists_many(keys)
            hits = next((i for i, ok in enumerate(found) if not ok), length)
            if hits:
                client.get_many_into(keys[:hits], spans[:hits])
            if hits < length:
                client.put_many_from(keys[hits:], spans[hits:length])
            counts["prompts"] += 1
            counts["looked_up"] += length
            counts["read"] += hits
            counts["saved"] += length - hits
        return counts

    send_ready(conn, os.getpid())
    serve(conn, run)
    store.close()


def measure(api: MooncakeApi, clients: int, seconds: float, blocks: int, object_bytes: int,
            groups: int = 1) -> dict[str, Any]:
    """``groups`` masters of ``api`` (one pool; several only for tidekv's) under ``clients``
    client processes for ``seconds`` (after a warm-up of ``seconds / 4`` that fills the pool);
    returns its row."""
    segment = PREFIXES * blocks * object_bytes * 2 + (16 << 20)  # each client's share: all its keys fit
    segment *= groups  # carved between the groups: each still holds all of its keys
    masters: list[MooncakeMaster] = []
    with tempfile.TemporaryDirectory(prefix="tidekv-bench-master-load-") as log_dir:
        helpers: list[HelperProcess] = []
        try:
            for g in range(groups):
                group_dir = Path(log_dir) / f"g{g}"
                group_dir.mkdir()
                masters.append(MooncakeMaster(group_dir, api, lease_ttl_s=2.0))
            address = ";".join(m.address for m in masters)
            for i in range(clients):
                helpers.append(HelperProcess(f"{api.value}-client{i}", _client_main,
                                             (api, address, segment, i, blocks, object_bytes), log_dir))
            for phase in ("warm-up", "measure"):
                span = seconds / 4 if phase == "warm-up" else seconds
                cpu0, t0 = [cpu_seconds(m.pid) for m in masters], time.monotonic()
                for h in helpers:
                    h.send(span)
                reports = [h.receive(span + 120) for h in helpers]
                wall = time.monotonic() - t0
                cpus = [cpu_seconds(m.pid) - c for m, c in zip(masters, cpu0)]
        finally:
            for h in helpers:
                h.stop()
            for m in masters:
                m.stop()
    totals = {k: sum(r[k] for r in reports) for k in reports[0]}
    keys = totals["looked_up"] + totals["read"] + totals["saved"]
    cpu, busiest = sum(cpus), max(cpus)
    return {"master": api.value, "groups": groups, "clients": clients, "blocks": blocks, "object_bytes": object_bytes,
            "seconds": round(wall, 2), **totals, "key_ops": keys, "keys_per_s": keys / wall,
            "master_cpu_s": round(cpu, 3), "master_cpu_us_per_key": cpu / keys * 1e6 if keys else None,
            "master_cpu_share": cpu / wall, "busiest_master_cpu_s": round(busiest, 3),
            "keys_per_busiest_cpu_s": keys / busiest if busiest else None}


def request_costs(batches: Sequence[int] = (1, 64), seconds: float = 2.0,
                  loops: Sequence[str] = ("asyncio", "auto")) -> list[dict[str, Any]]:
    """Master CPU per request of one client sending ``Exists`` requests of each batch size in a
    loop, one at a time: what a request costs before its keys (a sharded pool sends one per group),
    with the master on each event loop of ``loops`` (``TIDEKV_EVENT_LOOP``; "auto" is the default,
    uvloop where installed)."""
    from tidekv.store.client.master_client import MasterClient
    from tidekv.store.wire import protocol as p

    rows = []
    for loop in loops:
        with tempfile.TemporaryDirectory(prefix="tidekv-bench-master-request-") as log_dir:
            before = os.environ.get(eventloop.VARIABLE)
            os.environ[eventloop.VARIABLE] = loop  # the master process inherits it
            try:
                master = MooncakeMaster(log_dir, MooncakeApi.SHIM, lease_ttl_s=2.0)
                kind = eventloop.kind()
            finally:
                if before is None:
                    os.environ.pop(eventloop.VARIABLE, None)
                else:
                    os.environ[eventloop.VARIABLE] = before
            client = MasterClient(master.address, "bench-request-cost", timeout_s=5.0)
            try:
                client.connect()
                for batch in batches:
                    body = p.Exists([b"request-cost-%d" % i for i in range(batch)])
                    cpu0, t0, n = cpu_seconds(master.pid), time.monotonic(), 0
                    while time.monotonic() - t0 < seconds:
                        client.call(body)
                        n += 1
                    cpu = cpu_seconds(master.pid) - cpu0
                    rows.append({"loop": kind, "batch": batch, "requests": n,
                                 "master_cpu_us_per_request": cpu / n * 1e6})
            finally:
                client.close()
                master.stop()
    return rows


def run_load(clients: int, seconds: float, blocks: int, object_bytes: int, compare: Sequence[str],
             groups: int = 1) -> list[dict]:
    """Rows for tidekv's master, with ``compare`` naming "mooncake" Mooncake's, and with
    ``groups`` > 1 a tidekv pool of that many master groups, measured one after the other with
    the same clients and mix. The sharded row's ``capacity_vs_one_group`` is its keys per CPU
    second of the busiest master over the single master's keys per CPU second."""
    apis = [MooncakeApi.SHIM]
    if "mooncake" in compare:
        check_available()
        apis.append(MooncakeApi.MOONCAKE)
    rows = [measure(api, clients, seconds, blocks, object_bytes) for api in apis]
    if groups > 1:
        sharded = measure(MooncakeApi.SHIM, clients, seconds, blocks, object_bytes, groups)
        if sharded["keys_per_busiest_cpu_s"] and rows[0]["keys_per_busiest_cpu_s"]:
            sharded["capacity_vs_one_group"] = sharded["keys_per_busiest_cpu_s"] / rows[0]["keys_per_busiest_cpu_s"]
        rows.append(sharded)
    if len(apis) == 2 and rows[0]["master_cpu_us_per_key"] and rows[1]["master_cpu_us_per_key"]:
        rows[0]["keys_per_cpu_s_vs_mooncake"] = rows[1]["master_cpu_us_per_key"] / rows[0]["master_cpu_us_per_key"]
        rows[0]["keys_per_s_vs_mooncake"] = rows[0]["keys_per_s"] / rows[1]["keys_per_s"]
    return rows

