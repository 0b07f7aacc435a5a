"""What store HA costs on this machine, and the least that sending every change to standbys can cost.

Four systems alive side by side, their rounds alternating (all on 127.0.0.1, each party its own
process, as in ``tidekv bench failover``):

- *single*: a lone master;
- *HA*: three masters of one etcd cluster, as shipped (a reply waits until the standbys hold
  the change it made or read: zero loss, no stale read across a failover);
- *HA, no wait*: the same three masters with one line patched in their processes only, so that
  replies go out at once while the changes still stream to the standbys. This is **not** a mode
  of tidekv (it can lose acknowledged writes and serve stale reads when the leader dies): what
  the shipped replication stream costs when nothing waits for it, i.e. the standbys' and etcd's
  share of the same CPUs;
- *HA, no wait, no apply*: as the last, and each standby acks every batch but applies none once
  it holds an object (measurement only): the floor under any protocol that sends every change to
  two standbys, whatever they do with it.

Each has a holder process (64 MiB segment). Two loads per round: *quiet* (one client, N puts of
fresh 4 KiB keys, then N gets of them, sequential) and *churn* (``--clients`` processes running
``tidekv.bench.churn`` for ``--churn-s``: gets, puts, upserts, removes). Printed per round: p50
of put and get for each system, the HA / single ratios, and the CPU seconds each master process
used in the churn (a lone master busy-polls; HA masters share the VM's vCPUs with each other and
etcd). ``--json FILE`` writes every round.

Usage: .venv/bin/python benchmarks/ha_cost.py [--rounds 3] [--ops 1000] [--clients 3]
       [--churn-s 4] [--master-busy-poll-us US] [--rpc-busy-poll-us US] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from tidekv.bench import churn, failover
from tidekv.bench.etcd_server import EtcdServer
from tidekv.helper_process import HelperProcess, send_ready, serve

SYSTEMS = ("single", "ha", "ha-nowait", "ha-nowait-noapply")


def _nowait_master_main(conn: Connection, config: dict[str, Any]) -> None:
    """A cluster master whose replies do not wait for the standbys (measurement only)."""
    from tidekv.store.master.connection import MasterConnection

    send = MasterConnection._send_when_committed
    MasterConnection._send_when_committed = lambda self, replies, _committed: send(self, replies, 1 << 62)
    failover._master_main(conn, config)


def _noapply_master_main(conn: Connection, config: dict[str, Any]) -> None:
    """As ``_nowait_master_main``, and a standby acks each batch but applies none once it holds an
    object (measurement only: what delivering the changes alone costs)."""
    from tidekv.store.master.journal import Mirror

    apply = Mirror.apply
    Mirror.apply = lambda self, ops, now: None if self.objects else apply(self, ops, now)
    Mirror.forget_expired = lambda self, now: None
    _nowait_master_main(conn, config)


def _client_main(conn: Connection, master: str, segment_size: int, settings: dict[str, Any]) -> None:
    from tidekv.config import StoreConfig
    from tidekv.store import Store

    store = Store.connect(master, segment_size=segment_size, config=StoreConfig(**failover.CLIENT, **settings))

    def handle(message: tuple[Any, ...]) -> Any:
        if message[0] == "quiet":  # sequential puts of fresh keys, then gets of them
            _, prefix, ops, size = message
            value = os.urandom(size)
            put_s, get_s = [], []
            for i in range(ops):
                t = time.perf_counter()
                store.put(f"{prefix}/{i}", value)
                put_s.append(time.perf_counter() - t)
            for i in range(ops):
                t = time.perf_counter()
                if store.get(f"{prefix}/{i}") != value:
                    raise AssertionError(f"{prefix}/{i} came back different")
                get_s.append(time.perf_counter() - t)
            return statistics.median(put_s), statistics.median(get_s)
        if message[0] == "churn":
            _, prefix, duration_s, seed = message
            books = churn.churn(store, prefix, duration_s, keys=200, size=4096, seed=seed)
            return statistics.median(books.put_s), statistics.median(books.get_s), books.stale_reads
        raise ValueError(f"unknown call {message!r}")

    send_ready(conn, None)
    try:
        serve(conn, handle)
    finally:
        store.close()


def _cpu_s(helper: HelperProcess) -> float:
    fields = Path(f"/proc/{helper.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ops", type=int, default=1000, help="puts (then gets) of the quiet load")
    parser.add_argument("--clients", type=int, default=3, help="processes of the churn load")
    parser.add_argument("--churn-s", type=float, default=4.0)
    parser.add_argument("--master-busy-poll-us", type=int, help="every master's busy_poll_us (default: its default)")
    parser.add_argument("--rpc-busy-poll-us", type=int, help="every client's rpc_busy_poll_us (default: its default)")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="tidekv-ha-cost-"))
    helpers: list[HelperProcess] = []

    def helper(name: str, main: Any, *a: Any) -> HelperProcess:
        helpers.append(HelperProcess(name, main, a, work))
        return helpers[-1]

    master_cfg = {**failover.MASTER, "port": 0}
    if args.master_busy_poll_us is not None:
        master_cfg["busy_poll_us"] = args.master_busy_poll_us
    client_cfg = {} if args.rpc_busy_poll_us is None else {"rpc_busy_poll_us": args.rpc_busy_poll_us}
    etcd = EtcdServer(work)
    try:
        masters: dict[str, list[HelperProcess]] = {}
        clients: dict[str, list[HelperProcess]] = {}
        for system in SYSTEMS:
            if system == "single":
                masters[system] = [helper("single-master", failover._master_main, master_cfg)]
                address = masters[system][0].hello["address"]
            else:
                cfg = {**master_cfg, "etcd": etcd.url, "cluster": system}
                main_fn = {"ha": failover._master_main, "ha-nowait": _nowait_master_main,
                           "ha-nowait-noapply": _noapply_master_main}[system]
                masters[system] = [helper(f"{system}-master-{i}", main_fn, cfg) for i in range(3)]
                failover._leader(masters[system])
                address = f"etcd://{etcd.endpoints}/{system}"
            helper(f"{system}-holder", _client_main, address, 64 << 20, client_cfg)
            clients[system] = [helper(f"{system}-client-{i}", _client_main, address, 0, client_cfg)
                               for i in range(args.clients)]
        rounds = []
        for r in range(args.rounds):
            row: dict[str, Any] = {}
            for system in SYSTEMS:
                quiet = clients[system][0].call(("quiet", f"q{r}", args.ops, 4096), 600)
                before = [_cpu_s(m) for m in masters[system]]
                for i, c in enumerate(clients[system]):
                    c.send(("churn", f"r{r}c{i}", args.churn_s, 1000 * r + i))  # keys of its own per round
                mixed = [c.receive(args.churn_s + 120) for c in clients[system]]
                row[system] = {
                    "quiet_put_p50_us": quiet[0] * 1e6, "quiet_get_p50_us": quiet[1] * 1e6,
                    "churn_put_p50_us": statistics.median(m[0] for m in mixed) * 1e6,
                    "churn_get_p50_us": statistics.median(m[1] for m in mixed) * 1e6,
                    "churn_stale_reads": sum(m[2] for m in mixed),
                    "churn_master_cpu_s": [round(_cpu_s(m) - b, 2) for m, b in zip(masters[system], before)],
                }
            rounds.append(row)
            single = row["single"]
            print(f"round {r + 1}: " + " | ".join(
                f"{s}: quiet put {v['quiet_put_p50_us']:.0f} get {v['quiet_get_p50_us']:.0f} µs, churn put "
                f"{v['churn_put_p50_us']:.0f} get {v['churn_get_p50_us']:.0f} µs, master cpu {v['churn_master_cpu_s']}"
                for s, v in row.items()), flush=True)
            for system in SYSTEMS[1:]:
                v = row[system]
                print(f"  {system} / single: quiet put {v['quiet_put_p50_us'] / single['quiet_put_p50_us']:.2f}x "
                      f"get {v['quiet_get_p50_us'] / single['quiet_get_p50_us']:.2f}x, churn put "
                      f"{v['churn_put_p50_us'] / single['churn_put_p50_us']:.2f}x "
                      f"get {v['churn_get_p50_us'] / single['churn_get_p50_us']:.2f}x", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({"args": vars(args), "rounds": rounds}, indent=2))
    finally:
        for h in reversed(helpers):
            h.stop()
        etcd.stop()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
