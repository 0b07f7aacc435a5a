"""A cluster of masters across hosts (``rig``): the leader's host cut off from everything; and a
pool of four such clusters, one leader cut off (``test_four_ha_groups_...``).

Hosts h0, h1 and h2 each run one member of a three-member etcd (``EtcdServer(hosts=...)``) and
one ``tidekv master`` of cluster "ha" (``--etcd`` naming all three members, its own host's first);
h3 runs a holder and a client that find the leader through ``etcd://``. The first master starts
on the host of etcd's raft leader, so that cutting the leader's host off (not killing it: its
master and etcd member go on, out of everyone's reach) takes both leaders at once, the slowest
case (``NEW_LEADER_BOUND_S``). Run over plain http, and over https with client certificates and
etcd users (masters secured by their flags, clients by ``TIDEKV_ETCD_*``, the members'
certificate valid for their rig addresses).

Checked: a new master serves within the bound, and only once the old one stopped serving (both
watched through ``/health``: the old one from its own host, which still reaches it); a client on
the cut host bound to the old leader gets only typed errors, and whatever it was acknowledged the
new leader has; every acknowledged object reads back whole; once healed, the old leader stands
by in the new leader's in-sync set and answers NOT_READY; puts are acknowledged again within the
bound while the old leader is still cut off (the standby that was not elected leaves its silent
follow connection once etcd names the new leader, ``cluster.ClusterRole._follow``). Neighbours: ``test_store_hosts`` (holders cut off), ``tests/store/test_failover`` (one host).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.childproc import REPO_ROOT
from tests.multihost.rig import Host, Rig
from tests.store.cluster_rig import CLIENT, MASTER
from tests.store.payload import digest, payload
from tests.store.procs import AgentProcess, wait_until
from tests.store.tls_certs import Certs, issue_client_cert, make_certs
from tidekv.bench.etcd_server import MISSING, EtcdHost, EtcdServer, EtcdServerAuth, EtcdServerTls, etcd_binary

pytestmark = pytest.mark.skipif(etcd_binary() is None, reason=MISSING)

HEALTH = str(Path(__file__).with_name("master_health.py"))
MIB = 1 << 20
PASSWORD = "tidekv-rig-password"
STORE = {**CLIENT, "heartbeat_interval_s": 0.2, "staging_size_bytes": 16 * MIB}
"""The holder on h3: rpc_timeout_s 1, failover_timeout_s 15 (``cluster_rig.CLIENT``)."""
PROBING = {**STORE, "failover_timeout_s": 2.0}
"""The client on h3: it gives a call up after 2 s, so that the test tries again (and sees when
one first succeeds) rather than wait 15 s in one call while writes are held."""
DIRECT = {**STORE, "failover_timeout_s": 1.0}
"""The client on the cut host, bound to the old leader's address: it gives up after 1 s."""
TYPED = {"MasterUnavailableError", "MasterNotReadyError"}
"""What a call may raise while the leader is cut off: never a success it should not have."""

LEADER_TTL_S = 4
"""Longer than the loopback failover tests' 2 s (``cluster_rig.MASTER``) and the default 3 s: the
new leader must keep its lease through the cut, whatever the load: until the other standby has
caught up with it, it is the only master in the in-sync set, so that if it stepped down none
could lead. It keeps a lease through a stall of etcd or of itself of
up to ttl - margin - ttl/6 = 2.7 s; a stall of 2.2 s was seen here under ``-n 2``."""
ETCD_ELECTION_S = 0.5
"""``EtcdServer``'s ``--election-timeout``: a cut raft leader is replaced after 1 to 2 of these."""
ETCD_LEASE_CHECK_S = 0.5
"""etcd 3.4 revokes expired leases in a loop that runs every 500 ms."""
STANDBY_POLL_S = 0.1
"""``election.POLL_S``: how often a standby looks at the leader key."""
SLACK_S = 1.0
"""Promotion (a standby restores its mirror) and scheduling on two busy cores."""
NEW_LEADER_BOUND_S = (LEADER_TTL_S + 2 * ETCD_ELECTION_S + ETCD_ELECTION_S + ETCD_LEASE_CHECK_S + STANDBY_POLL_S
                      + SLACK_S)
"""From the cut to a new master serving, 7.1 s: the raft leader, cut too, is replaced within two
election timeouts; the new one gives every lease its whole TTL again plus one election timeout
(etcd's ``lessor.Promote``: it cannot know when the old one last renewed it, and the old one,
cut off, renews for its master until it sees it lost its quorum); it revokes the lease at its
next check, and a standby sees the key gone at its next poll. With etcd's raft leader elsewhere
the lease alone bounds it: ttl + check + poll."""
CLIENT_BOUND_S = NEW_LEADER_BOUND_S + STORE["rpc_timeout_s"] + 1.0
"""From the cut to a client on another host answered, 9.1 s: the new leader's bound, plus one
call sent to the old leader (unanswered for ``rpc_timeout_s``) and one etcd call to the cut
member (1 s, once: then it asks the member that answers)."""
EARLIEST_S = LEADER_TTL_S * 5 / 6 - 0.2
"""No master may serve sooner after the cut: the old leader renewed its lease every ttl/6, so
etcd keeps it at least ttl - ttl/6 from the cut (0.2 s for the renewal's own round trip)."""
OBJECTS = 40
SIZE = 64 * 1024
_LISTENING = re.compile(r"listening on (\S+):(\d+)\S* \(metrics http port (\d+)\)")


class CliMaster:
    """``tidekv master`` on a rig host, as an operator runs it; its address from its log."""

    def __init__(self, where: Host, flags: list[str], log_path: Path, name: str) -> None:
        self.name = name
        self.log_path = log_path
        with open(log_path, "wb") as log:
            self.proc = where.popen([sys.executable, "-m", "tidekv", "master", *flags], cwd=REPO_ROOT,
                                    stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                    env=dict(os.environ, PYTHONUNBUFFERED="1"))
        self.pid = self.proc.pid
        wait_until(lambda: _LISTENING.search(self.log_text()) or self.proc.poll() is not None, 30.0,
                   f"{name} to listen")
        found = _LISTENING.search(self.log_text())
        if found is None:
            raise AssertionError(f"{name} exited with {self.proc.returncode}:\n{self.log_text()}")
        self.host, self.metrics_port = found.group(1), int(found.group(3))
        self.address = f"{self.host}:{found.group(2)}"
        self.health_url = f"http://{self.host}:{self.metrics_port}/health"

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def interrupt(self) -> None:
        """SIGINT: it stops cleanly (a leader gives its lease back); ``stop()`` waits for it."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.interrupt()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


@dataclass
class HaRig:
    """The rig (masters' hosts h0-h2, then the edge h3), its etcd, and what runs on them."""

    rig: Rig
    etcd: EtcdServer
    tmp_path: Path
    master_flags: list[str]
    """``tidekv master`` flags besides host, ports, etcd and cluster (the settings, etcd's security)."""
    children: list[Any] = field(default_factory=list)
    masters: dict[str, CliMaster] = field(default_factory=dict)
    """By host name."""
    _names: Iterator[int] = field(default_factory=itertools.count)

    @property
    def master_hosts(self) -> list[Host]:
        return self.rig.hosts[:3]

    @property
    def edge(self) -> Host:
        return self.rig.hosts[3]

    @property
    def address(self) -> str:
        return f"etcd://{self.etcd.endpoints}/ha"

    def start_master(self, where: Host) -> CliMaster:
        """A master of cluster "ha" on ``where``, its own host's etcd member first."""
        i = self.master_hosts.index(where)
        urls = [m.url for m in self.etcd.members]
        etcd = ",".join([urls[i], *urls[:i], *urls[i + 1:]])
        master = CliMaster(where, ["--host", where.ip, "--port", "0", "--metrics-port", "0", "--etcd", etcd,
                                   "--cluster", "ha", *self.master_flags],
                           self.tmp_path / f"master-{where.name}.log", f"master@{where.name}")
        self.children.append(master)
        self.masters[where.name] = master
        return master

    def start_agent(self, where: Host, master: str, segment_size: int, **store: Any) -> AgentProcess:
        n = next(self._names)
        agent = AgentProcess(master, segment_size, store, self.tmp_path / f"agent{n}-{where.name}.log",
                             f"agent{n}@{where.name}", prefix=where.command([]))
        self.children.append(agent)
        return agent

    def health(self, seen_from: Host, *masters: CliMaster) -> list[dict[str, Any]]:
        """Each master's ``/health`` as ``seen_from`` reads it ({"error"} when it does not answer)."""
        done = seen_from.run([sys.executable, "-I", HEALTH, "once", *(m.health_url for m in masters)], timeout_s=15)
        assert done.returncode == 0, done.stderr
        out: list[dict[str, Any]] = json.loads(done.stdout)
        return out

    def leader(self, timeout_s: float = 20.0) -> CliMaster:
        """The one master that leads and serves, as the edge sees them (waits for it)."""
        def find() -> CliMaster | None:
            masters = list(self.masters.values())
            serving = [m for m, h in zip(masters, self.health(self.edge, *masters))
                       if h.get("role") == "leader" and h.get("serving")]
            return serving[0] if len(serving) == 1 else None
        master: CliMaster = wait_until(find, timeout_s, "one serving leader", interval_s=0.1)
        return master

    def wait_in_sync(self, leader: CliMaster, standbys: int, timeout_s: float = 20.0) -> list[str]:
        """Waits until ``leader`` has ``standbys`` standbys in sync; its in-sync ids."""
        def insync() -> list[str] | None:
            ids = self.health(self.edge, leader)[0].get("insync", [])
            return ids if len(ids) == standbys + 1 else None
        ids: list[str] = wait_until(insync, timeout_s, f"{standbys} standbys in sync with {leader.name}",
                                    interval_s=0.1)
        return ids

    def logs(self) -> str:
        parts = [f"--- {child.name} (pid {child.pid})\n{child.log_text()}" for child in self.children]
        return "\n".join([*parts, self.etcd.log_text()])


class Watch:
    """``master_health.py watch`` on ``host``: the changes of ``masters``' roles, as they came."""

    def __init__(self, host: Host, masters: list[CliMaster]) -> None:
        self.proc = host.popen([sys.executable, "-I", HEALTH, "watch", *(m.health_url for m in masters)],
                               stdout=subprocess.PIPE, text=True)
        self.changes: list[dict[str, Any]] = []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        wait_until(lambda: {c["url"] for c in self.changes} == {m.health_url for m in masters}, 15.0,
                   "the watch's first polls")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.changes.append(json.loads(line))

    def of(self, master: CliMaster) -> list[dict[str, Any]]:
        return [c for c in self.changes if c["url"] == master.health_url]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)
        self._thread.join(timeout=10)


def _rig_certs(directory: Path, ips: list[str]) -> tuple[Certs, str, str]:
    """make_certs' CA, and a server certificate it signed for ``ips`` (with its key)."""
    certs = make_certs(directory)
    (directory / "rig-san.ext").write_text("subjectAltName=" + ",".join(f"IP:{ip}" for ip in ips) + "\n")
    for args in (["req", "-newkey", "rsa:2048", "-nodes", "-keyout", "rig.key", "-out", "rig.csr",
                  "-subj", "/CN=tidekv test rig etcd"],
                 ["x509", "-req", "-in", "rig.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                  "-out", "rig.pem", "-days", "2", "-extfile", "rig-san.ext"]):
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True, timeout=60)
    return certs, str(directory / "rig.pem"), str(directory / "rig.key")


@pytest.fixture(params=["http", "https+users"])
def ha(request: pytest.FixtureRequest, multihost: Callable[..., Rig], tmp_path: Path,
       monkeypatch: pytest.MonkeyPatch) -> Iterator[HaRig]:
    """Four hosts, an etcd member on each of the first three (no master yet); over plain http, or
    over https with client certificates required and authentication on. Every child is stopped
    after the test."""
    rig = multihost(4)
    work = tmp_path / "etcd"
    work.mkdir()
    hosts = [EtcdHost(h.ip, tuple(h.command([]))) for h in rig.hosts[:3]]
    flags = ["--leader-ttl-s", str(LEADER_TTL_S), "--sync-timeout-s", str(MASTER["sync_timeout_s"]),
             "--client-ttl-s", str(MASTER["client_ttl_s"]), "--lease-ttl-s", str(MASTER["lease_ttl_s"])]
    tls = auth = None
    if request.param == "https+users":
        (tmp_path / "certs").mkdir()
        certs, server_cert, server_key = _rig_certs(tmp_path / "certs", [h.ip for h in hosts])
        cert, key = issue_client_cert(certs, "rig-client", "/O=tidekv")  # no Common Name: auth is on
        tls, auth = EtcdServerTls(certs.ca, server_cert, server_key, cert, key), EtcdServerAuth(PASSWORD)
    # Pre-vote: without it (etcd 3.4's default) the cut member, campaigning alone at ever higher
    # terms, deposes the raft leader when healed, and the cluster is without one for a second or
    # more: longer than the master's lease can wait (ttl - margin), so the new leader steps down.
    etcd = EtcdServer(work, hosts=hosts, tls=tls, auth=auth, pre_vote=True)
    if auth is not None:
        s = etcd.client_settings()
        password_file = tmp_path / "etcd-password"
        password_file.write_text(PASSWORD + "\n")
        secured = {"ca_file": s.ca_file, "cert_file": s.cert_file, "key_file": s.key_file, "user": s.user,
                   "password_file": str(password_file)}
        for name, value in secured.items():  # the masters by their flags, the store clients by the variables
            flags += [f"--etcd-{name.replace('_', '-')}", str(value)]
            monkeypatch.setenv(f"TIDEKV_ETCD_{name.upper()}", str(value))
    ha = HaRig(rig, etcd, tmp_path, flags)
    try:
        yield ha
    finally:
        for master in ha.masters.values():  # at once: each may take seconds to end its campaign
            master.interrupt()
        for child in reversed(ha.children):
            child.stop()
        etcd.stop()


@contextlib.contextmanager
def logs_on_failure(ha: HaRig) -> Iterator[None]:
    """Prints every child's log and etcd's when the body fails (pytest shows a failed test's
    output); not for pytest's own outcomes (an expected failure, a skip)."""
    try:
        yield
    except Exception:
        print(ha.logs())
        raise


def _put(agent: AgentProcess, key: str, seed: int) -> dict[str, Any]:
    return agent.try_call("put", 30.0, key=key, seed=seed, size=SIZE + seed)


def _until_ok(attempt: Callable[[int], dict[str, Any]], deadline: float,
              failed: Counter[str]) -> tuple[float, int] | None:
    """Calls ``attempt(0)``, ``attempt(1)``... until one succeeds (when, and its number) or one
    fails past ``deadline`` (None); every failure must be a typed one, counted in ``failed``."""
    for n in itertools.count():
        reply = attempt(n)
        if reply["ok"]:
            return time.monotonic(), n
        assert reply["error_type"] in TYPED, reply
        failed[reply["error_type"]] += 1
        if time.monotonic() > deadline:
            return None
    raise AssertionError("unreachable")


def _start(ha: HaRig) -> tuple[Host, CliMaster, AgentProcess]:
    """The masters (the leader on the raft leader's host), the holder and the client; the leader's
    host, the leader, and the client, once both standbys are in sync."""
    first = ha.master_hosts[ha.etcd.members.index(ha.etcd.leader())]
    ha.start_master(first)
    leader = ha.leader()
    for host in ha.master_hosts:
        if host is not first:
            ha.start_master(host)
    ha.start_agent(ha.edge, ha.address, 16 * MIB, **STORE)
    client = ha.start_agent(ha.edge, ha.address, 0, **PROBING)
    ha.wait_in_sync(leader, 2)
    return first, leader, client


def test_leader_host_cut_off_fails_over_without_split_brain_and_rejoins_as_standby(ha: HaRig) -> None:
    with logs_on_failure(ha):
        first, old, client = _start(ha)
        others = [m for m in ha.masters.values() if m is not old]
        acknowledged = {f"before-{i}": i for i in range(OBJECTS)}
        for key, seed in acknowledged.items():
            assert _put(client, key, seed)["ok"], key
        direct = ha.start_agent(first, old.address, 0, **DIRECT)  # reaches the old leader only, never follows
        raft_leader_cut = ha.etcd.leader().host.ip == first.ip
        old_watch, new_watch = Watch(first, [old]), Watch(ha.edge, others)

        cut_at = time.monotonic()
        first.cut()
        for n in range(3):
            direct.start_call("put", key=f"split-{n}", seed=500 + n, size=SIZE + 500 + n)
        failed: Counter[str] = Counter()
        # A lookup, not a get: a get's read lease counts from its first try, so a get retried
        # across the failover for longer than lease_ttl_s fails with LeaseExpiredError.
        looked_up = _until_ok(lambda n: client.try_call("locate", keys=["before-0"]), cut_at + CLIENT_BOUND_S, failed)
        put = _until_ok(lambda n: _put(client, f"during-{n}", 1000 + n), cut_at + CLIENT_BOUND_S, failed)
        if put is not None:
            acknowledged[f"during-{put[1]}"] = 1000 + put[1]
        for n in range(3):  # the client on the cut host: whatever it was acknowledged, the new leader has
            reply = direct.read_line(30.0)
            if reply["ok"]:
                acknowledged[f"split-{n}"] = 500 + n
            else:
                assert reply["error_type"] in TYPED, reply
        new = ha.leader()
        assert new is not old
        # Seen from its own host, which still reaches it: it stands by and serves nothing.
        wait_until(lambda: ha.health(first, old)[0].get("role") == "standby", 10.0, "the old leader to stand by",
                   interval_s=0.1)
        assert not ha.health(first, old)[0]["serving"]

        healed_at = time.monotonic()
        first.heal()
        healed_put = _until_ok(lambda n: _put(client, f"healed-{n}", 2000 + n), healed_at + 30.0, Counter())
        assert healed_put is not None, "no put acknowledged within 30 s of the heal"
        acknowledged[f"healed-{healed_put[1]}"] = 2000 + healed_put[1]
        ha.wait_in_sync(new, 2)
        old_watch.stop()
        new_watch.stop()
        # Once healed: it follows the new leader (in its in-sync set, under its new id) and says NOT_READY.
        old_health, new_health = ha.health(ha.edge, old, new)
        assert (old_health["role"], old_health["serving"]) == ("standby", False), old_health
        assert old_health["master_id"] in new_health["insync"], (old_health, new_health)
        refused = direct.try_call("put", key="after-heal", seed=7, size=SIZE)
        assert not refused["ok"] and refused["error_type"] == "MasterNotReadyError", refused
        assert "standby" in refused["error"], refused
        assert ha.leader() is new, "the healed master took leadership back"
        assert "stepped down" in old.log_text()

        # Every acknowledged object reads back whole, through the new leader.
        for key, seed in acknowledged.items():
            reply = client.call("get", key=key)
            assert reply["digest"] == digest(payload(seed, SIZE + seed)), f"{key}: wrong bytes"
        stats = client.call("stats")["stats"]
        assert stats["objects_lost"] == 0, stats

        # The timeline: the old leader stopped serving before another master served.
        stopped = next(c for c in old_watch.of(old) if c["received"] > cut_at and c["role"] != "down"
                       and not c["serving"])
        started = min((c for m in others for c in new_watch.of(m) if c["received"] > cut_at and c["serving"]),
                      key=lambda c: c["received"])
        assert started["url"] == new.health_url
        new_leader_s = started["received"] - cut_at
        print(f"raft leader cut too: {raft_leader_cut}; old leader served until {stopped['previous_sent'] - cut_at:.2f}"
              f"-{stopped['received'] - cut_at:.2f} s after the cut, the new one from "
              f"{started['previous_sent'] - cut_at:.2f}-{new_leader_s:.2f} s; first lookup answered "
              f"{'-' if looked_up is None else f'{looked_up[0] - cut_at:.2f}'} s, first put "
              f"{'-' if put is None else f'{put[0] - cut_at:.2f}'} s after the cut ({dict(failed)} before), "
              f"{healed_put[0] - healed_at:.2f} s after the heal")
        assert stopped["received"] < started["previous_sent"], "two masters served at once"
        assert started["previous_sent"] - cut_at > EARLIEST_S, "a master served before the old lease could expire"
        assert new_leader_s < NEW_LEADER_BOUND_S
        assert looked_up is not None and looked_up[0] - cut_at < CLIENT_BOUND_S
        assert put is not None and put[0] - cut_at < CLIENT_BOUND_S, "no put acknowledged while the old leader is cut off"


def test_four_ha_groups_a_leader_cut_off_delays_only_its_group(multihost: Callable[..., Rig], tmp_path: Path) -> None:
    """A pool sharded over four master groups, each an HA cluster (leader on h0..h3, a standby in
    sync on h4..h7; one etcd on h8, where the holder and the reader run too). Cutting group g0's
    leader off leaves the other groups' batches as fast as before, while g0's keys wait for its
    standby to take over; then every one of them reads back whole (none lost to the failover)."""
    from tidekv.store.wire.pool_map import PoolMap

    hosts = multihost(9).hosts
    edge = hosts[8]
    (tmp_path / "etcd").mkdir()
    etcd = EtcdServer(tmp_path / "etcd", hosts=[EtcdHost(edge.ip, tuple(edge.command([])))], pre_vote=True)
    flags = ["--leader-ttl-s", str(LEADER_TTL_S), "--sync-timeout-s", str(MASTER["sync_timeout_s"]),
             "--client-ttl-s", str(MASTER["client_ttl_s"]), "--lease-ttl-s", str(MASTER["lease_ttl_s"])]
    children: list[Any] = []

    def master(where: Host, group: int) -> CliMaster:
        started = CliMaster(where, ["--host", where.ip, "--port", "0", "--metrics-port", "0", "--etcd",
                                    etcd.members[0].url, "--cluster", f"g{group}", *flags],
                            tmp_path / f"master-g{group}-{where.name}.log", f"g{group}@{where.name}")
        children.append(started)
        return started

    def health(*masters: CliMaster) -> list[dict[str, Any]]:
        done = edge.run([sys.executable, "-I", HEALTH, "once", *(m.health_url for m in masters)], timeout_s=15)
        assert done.returncode == 0, done.stderr
        out: list[dict[str, Any]] = json.loads(done.stdout)
        return out

    try:
        leaders = [master(hosts[g], g) for g in range(4)]
        wait_until(lambda: all(h.get("role") == "leader" and h.get("serving") for h in health(*leaders)), 30.0,
                   "four serving leaders", interval_s=0.2)
        standbys = [master(hosts[4 + g], g) for g in range(4)]
        pool = ";".join(f"g{g}=etcd://{etcd.endpoints}/g{g}" for g in range(4))
        for name, segment, settings in (("holder", 64 * MIB, STORE), ("reader", 0, PROBING)):
            children.append(AgentProcess(pool, segment, settings, tmp_path / f"{name}.log", name,
                                         prefix=edge.command([])))
        holder, reader = children[-2:]
        wait_until(lambda: all(len(h.get("insync", [])) == 2 for h in health(*leaders)), 30.0,
                   "each leader's standby in sync", interval_s=0.2)
        keys = [f"obj-{i}" for i in range(48)]
        for i, key in enumerate(keys):
            holder.call("put", key=key, seed=i, size=32 * 1024 + i)
        expected = {k: digest(payload(i, 32 * 1024 + i)) for i, k in enumerate(keys)}
        pool_map = PoolMap([f"g{g}" for g in range(4)])
        cut_keys = [k for k in keys if pool_map.group_of(k.encode()) == 0]
        others = [k for k in keys if k not in cut_keys]
        assert cut_keys and others
        before = reader.call("get_many", keys=others, rounds=20)

        cut_at = time.monotonic()
        hosts[0].cut()
        during = reader.call("get_many", keys=others, rounds=20)
        assert not during["failed"] and during["digests"] == before["digests"], during["failed"]
        slowest_before, slowest_during = max(before["elapsed_s"]), max(during["elapsed_s"])
        assert slowest_during < max(0.5, 5 * slowest_before), \
            f"the other groups' gets slowed while g0's leader was cut off: {slowest_before:.3f} -> " \
            f"{slowest_during:.3f} s"
        # g0's keys: typed failures until its standby leads, then every one whole.
        failed: Counter[str] = Counter()
        while (reply := reader.call("get_many", keys=cut_keys))["failed"]:
            assert set(reply["failed"].values()) <= TYPED | {"LeaseExpiredError"}, reply["failed"]
            failed.update(reply["failed"].values())
            assert time.monotonic() < cut_at + CLIENT_BOUND_S + 5, f"g0's keys still fail after the bound: {failed}"
        answered_s = time.monotonic() - cut_at
        assert reply["digests"] == [expected[k] for k in cut_keys]
        assert [h["role"] for h in health(standbys[0])] == ["leader"]
        print(f"other groups' batch of {len(others)} gets, slowest of 20: {slowest_before * 1e3:.1f} ms before the "
              f"cut, {slowest_during * 1e3:.1f} ms during it; g0's keys read again {answered_s:.2f} s after the "
              f"cut ({dict(failed)} before)")
        hosts[0].heal()
        final = reader.call("get_many", keys=keys)
        assert not final["failed"] and final["digests"] == [expected[k] for k in keys]
    except Exception:
        print("\n".join(f"--- {c.name}\n{c.log_text()}" for c in children), etcd.log_text())
        raise
    finally:
        for child in children:
            if isinstance(child, CliMaster):
                child.interrupt()
        for child in reversed(children):
            child.stop()
        etcd.stop()
