"""Clusters of masters on a real etcd: failover under load, with every acknowledged object checked.

Three masters campaign for one cluster; holders and load clients are separate processes that
reach the leader through ``etcd://``. Each load client runs ``tidekv.bench.churn`` (put, get,
upsert, remove on its own keys) and keeps books of what was acknowledged; after each failure and
at the end it reads every key back: zero acknowledged objects lost, zero stale reads (a read
that shows anything but the last acknowledged version). Failures: the leader SIGKILLed under
load (twice), a standby SIGKILLed, etcd SIGKILLed and restarted, the leader cut off from etcd,
one client cut off from the leader of a cluster (alone: through relays of its own, see
``cluster_rig.EtcdView``) and then the leader killed while it is cut off, and a client cut off
from a lone master. Losing an etcd member of three is in ``test_etcd_members``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from tidekv.bench.etcd_server import EtcdServer
from tidekv.errors import MasterNotReadyError, MasterUnavailableError
from tidekv.store.client.master_client import MasterClient
from tidekv.store.wire import protocol as p

from tests.store.cluster_rig import (
    CLIENT,
    HOLDER_BYTES,
    MASTER,
    EtcdView,
    TcpRelay,
    churn,
    churn_through,
    health,
    in_sync,
    leader_of,
    role,
    verify,
)
from tests.store.conftest import Connect, SpawnAgent, SpawnMaster
from tests.store.procs import MasterProcess, wait_until

MIB = 1 << 20
TYPED = {"MasterUnavailableError", "MasterNotReadyError"}
"""What a store client cut off from its master may raise (names as churn counts them)."""


def _cluster(spawn_master: SpawnMaster, etcd_urls: list[str], cluster: str = "t") -> list[MasterProcess]:
    return [spawn_master(etcd=url, cluster=cluster, **MASTER) for url in etcd_urls]


def _url(cluster: str, etcd: EtcdServer) -> str:
    return f"etcd://{etcd.endpoints}/{cluster}"


def test_leader_sigkill_under_load_loses_nothing(etcd: EtcdServer, spawn_master: SpawnMaster,
                                                 spawn_agent: SpawnAgent) -> None:
    masters = _cluster(spawn_master, [etcd.url] * 3)
    address = _url("t", etcd)
    leader = leader_of(masters)
    for _ in range(2):
        spawn_agent(address, HOLDER_BYTES, **CLIENT)
    clients = [spawn_agent(address, 0, **CLIENT) for _ in range(3)]
    in_sync(masters, 2)
    kills = []
    for round_ in range(2):
        victim = leader_of(masters)
        reports = churn_through(clients, 5.0, (1.5, "leader killed", victim.kill))
        kills.append(victim)
        print("round", round_, reports)
        for r in reports:
            assert r["stale_reads"] == 0, r
            assert r["max_gap_s"] < 10.0, f"clients re-attached within 10 s: {r}"
        verify(clients)
        survivors = [m for m in masters if m.is_alive()]
        new = leader_of(survivors)
        assert new not in kills
        masters.append(spawn_master(etcd=etcd.url, cluster="t", **MASTER))  # the killed one comes back as a standby
        in_sync([m for m in masters if m.is_alive()], 2)
    assert leader is kills[0]
    verify(clients)


def test_standby_sigkill_and_then_leader_sigkill(etcd: EtcdServer, spawn_master: SpawnMaster,
                                                 spawn_agent: SpawnAgent) -> None:
    masters = _cluster(spawn_master, [etcd.url] * 3)
    address = _url("t", etcd)
    leader = leader_of(masters)
    spawn_agent(address, HOLDER_BYTES, **CLIENT)
    clients = [spawn_agent(address, 0, **CLIENT) for _ in range(2)]
    in_sync(masters, 2)
    standby = next(m for m in masters if m is not leader)
    reports = churn_through(clients, 3.0, (1.0, "standby killed", standby.kill))
    assert all(r["stale_reads"] == 0 and r["max_gap_s"] < 3.0 for r in reports), reports
    in_sync(masters, 1)  # the leader went on with the standby left
    verify(clients)

    # The survivor leads alone: it acknowledges nothing (min_standbys=1) until the master a
    # supervisor starts again has caught up with it.
    reports = churn_through(clients, 6.0, (1.0, "leader killed", leader.kill),
                            (0.5, "a master restarted",
                             lambda: masters.append(spawn_master(etcd=etcd.url, cluster="t", **MASTER))))
    assert all(r["stale_reads"] == 0 for r in reports), reports
    survivor = leader_of([m for m in masters if m.is_alive()])
    assert survivor not in (leader, standby)
    verify(clients)


def test_etcd_restart_under_load(etcd: EtcdServer, spawn_master: SpawnMaster, spawn_agent: SpawnAgent) -> None:
    masters = _cluster(spawn_master, [etcd.url] * 3)
    address = _url("t", etcd)
    leader_of(masters)
    spawn_agent(address, HOLDER_BYTES, **CLIENT)
    clients = [spawn_agent(address, 0, **CLIENT) for _ in range(2)]
    in_sync(masters, 2)
    member = etcd.members[0]
    reports = churn_through(clients, 5.0, (1.0, "etcd killed", member.kill),
                            (0.5, "etcd restarted", lambda: (member.start(), member.wait_healthy())))
    assert all(r["stale_reads"] == 0 for r in reports), reports
    leader_of(masters)
    verify(clients)


def test_leader_cut_off_from_etcd_steps_down_before_another_leads(
        etcd: EtcdServer, spawn_master: SpawnMaster, spawn_agent: SpawnAgent,
        relays: Callable[[str], TcpRelay]) -> None:
    links = [relays(etcd.endpoints) for _ in range(3)]
    masters = _cluster(spawn_master, [f"http://{link.address}" for link in links])
    address = _url("t", etcd)
    leader = leader_of(masters)
    spawn_agent(address, HOLDER_BYTES, **CLIENT)
    clients = [spawn_agent(address, 0, **CLIENT) for _ in range(2)]
    in_sync(masters, 2)
    direct = MasterClient(leader.address, "direct", timeout_s=1.0)  # talks to the old leader, never follows
    try:
        reports = churn_through(clients, 6.0, (1.0, "leader cut off from etcd", links[masters.index(leader)].cut))
        assert all(r["stale_reads"] == 0 for r in reports), reports
        new = leader_of(masters)
        assert new is not leader
        assert role(leader) == "standby", "the cut-off leader stepped down"
        with pytest.raises(MasterNotReadyError, match="standby"):
            direct.call(p.PutStart("direct", [b"x"], [10]))
        verify(clients)
        links[masters.index(leader)].heal()
        in_sync(masters, 2)  # it follows the new leader once it reaches etcd again
    finally:
        direct.close()


def test_client_cut_off_from_the_leader_of_a_cluster_gets_typed_errors_then_follows(
        etcd: EtcdServer, spawn_master: SpawnMaster, spawn_agent: SpawnAgent,
        relays: Callable[[str], TcpRelay]) -> None:
    masters = _cluster(spawn_master, [etcd.url] * 3)
    leader = leader_of(masters)
    links = {m.address: relays(m.address) for m in masters}  # the cut-off client's own way to each master
    view = EtcdView(etcd.url, {a: link.address for a, link in links.items()})
    try:
        address = _url("t", etcd)
        spawn_agent(address, HOLDER_BYTES, **CLIENT)
        others = [spawn_agent(address, 0, **CLIENT) for _ in range(2)]
        cut_off = spawn_agent(f"etcd://{view.address}/t", 0, **{**CLIENT, "failover_timeout_s": 1.5})
        clients = [*others, cut_off]
        in_sync(masters, 2)
        link = links[leader.address]
        *theirs, mine = churn_through(clients, 7.0, (1.0, "cut", link.cut), (4.0, "healed", link.heal))
        assert all(r["stale_reads"] == 0 and r["max_gap_s"] < 2.0 and not r["errors"] for r in theirs), theirs
        assert mine["stale_reads"] == 0, mine
        assert mine["errors"] and set(mine["errors"]) <= TYPED, f"only typed errors while cut off: {mine}"
        assert 3.0 < mine["max_gap_s"] < 7.0, f"it was cut off for 4 s, then went on: {mine}"
        assert leader_of(masters) is leader, "one client cut off moves no leadership"
        verify(clients)  # the cut-off client reads every key back through its healed link
        errors_before = sum(mine["errors"].values())
        mine = churn(clients, 1.0)[-1]
        assert sum(mine["errors"].values()) == errors_before, mine

        # cut off, then the leader dies: it must follow to the new leader, which it can reach
        reports = churn_through(clients, 8.0, (1.0, "cut", link.cut), (1.0, "leader killed", leader.kill))
        assert all(r["stale_reads"] == 0 and r["max_gap_s"] < 10.0 for r in reports), \
            [{k: r[k] for k in ("stale_reads", "max_gap_s", "errors", "stale_examples") if k in r} for r in reports]
        new = leader_of([m for m in masters if m.is_alive()])
        assert new is not leader
        verify(clients)
    finally:
        view.close()


def test_client_cut_off_from_the_master_gets_typed_errors_then_everything(
        spawn_master: SpawnMaster, connect: Connect, relays: Callable[[str], TcpRelay]) -> None:
    master = spawn_master()
    holder = connect(master.address, segment_size=8 * MIB)
    link = relays(master.address)
    client = connect(link.address, rpc_timeout_s=0.5, failover_timeout_s=1.0)
    objects = {f"k{i}": bytes([i]) * (1000 + i) for i in range(30)}
    for key, data in objects.items():
        client.put(key, data)
    link.cut()
    with pytest.raises(MasterUnavailableError, match=link.address):
        client.get("k1")
    with pytest.raises(MasterUnavailableError) as info:
        client.put("during-cut", b"never acknowledged")
    link.heal()
    wait_until(lambda: _answers(client), 10.0, "the client to reach the master again")
    for key, data in objects.items():
        assert client.get(key) == data
        assert holder.get(key) == data
    assert not holder.exists("during-cut") or info.value.is_request_sent


def _answers(store: Any) -> bool:
    try:
        store.exists("k0")
    except MasterUnavailableError:
        return False
    return True


def test_health_names_roles(etcd: EtcdServer, spawn_master: SpawnMaster) -> None:
    masters = _cluster(spawn_master, [etcd.url] * 2)
    leader = leader_of(masters)
    standby = next(m for m in masters if m is not leader)
    wait_until(lambda: role(standby) == "standby", 10.0, "the other master to stand by")
    assert health(leader)["serving"] and not health(standby)["serving"]


def test_a_channels_items_survive_the_leaders_death(etcd: EtcdServer, spawn_master: SpawnMaster,
                                                    spawn_agent: SpawnAgent) -> None:
    """Items pushed (one taken, not acked) before the leader is SIGKILLed are all there on the
    new leader, with their seqs, ready again; the counter goes on without reusing a seq."""
    from tests.store.payload import digest, payload

    masters = _cluster(spawn_master, [etcd.url] * 3)
    address = _url("t", etcd)
    spawn_agent(address, HOLDER_BYTES, **CLIENT)
    producer, first, second = (spawn_agent(address, 0, **CLIENT) for _ in range(3))
    assert producer.call("chan_put", name="q", seeds=[0, 1, 2], size=65536)["seqs"] == [0, 1, 2]
    assert [s for s, _ in first.call("chan_take", name="q", wait_s=5, ack=False)["items"]] == [0]
    in_sync(masters, 2)
    old = leader_of(masters)
    old.kill()
    leader_of([m for m in masters if m.is_alive()])
    got = second.call("chan_take", name="q", max_items=5, wait_s=30, timeout_s=60)["items"]
    assert got == [[i, digest(payload(i, 65536))] for i in range(3)]  # the taken one is ready again too
    assert producer.call("chan_put", name="q", seeds=[3], size=65536, timeout_s=60)["seqs"] == [3]
