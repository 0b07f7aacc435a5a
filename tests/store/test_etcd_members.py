"""The loss of an etcd member: the etcd client, the masters' election and the store clients move
to another member of a three-member etcd, with nothing lost.

Masters get every member in ``--etcd`` and clients every member in ``etcd://H:P,H:P,H:P/NAME``,
the raft leader first, so that the member everyone talks to is also the one whose loss costs
an etcd election. It is lost under load in one of two ways: SIGKILLed (connections refused at
once), or cut off behind a relay (connections black-holed: every call to it times out, as a
host that is gone looks). Then, with it still lost, the leading master is SIGKILLed too, so a
standby must campaign and clients must find it through the members left. Every acknowledged
object is read back byte for byte (``tidekv.bench.churn``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import pytest
from tidekv.bench.etcd_server import EtcdServer
from tidekv.store.ha.etcd import EtcdClient, EtcdUnavailableError

from tests.store.cluster_rig import (
    CLIENT,
    HOLDER_BYTES,
    MASTER,
    TcpRelay,
    churn_through,
    in_sync,
    leader_of,
    verify,
)
from tests.store.conftest import SpawnAgent, SpawnMaster
from tests.store.procs import wait_until

FAILURES = ["sigkill", "cut"]


@dataclass
class Links:
    """How the test reaches the etcd members (raft leader first), and how it loses the first."""

    urls: list[str]
    lose_first: Callable[[], None]
    restore_first: Callable[[], None]

    @property
    def etcd(self) -> str:
        return ",".join(self.urls)

    def store_address(self, cluster: str) -> str:
        return "etcd://" + ",".join(u.removeprefix("http://") for u in self.urls) + "/" + cluster


def _links(etcd: EtcdServer, failure: str, relays: Callable[[str], TcpRelay]) -> Links:
    leader = etcd.leader()
    members = [leader, *(m for m in etcd.members if m is not leader)]
    if failure == "sigkill":
        def restart() -> None:
            leader.start()
            leader.wait_healthy()
        return Links([m.url for m in members], leader.kill, restart)
    links = [relays(m.url) for m in members]
    return Links([f"http://{link.address}" for link in links], links[0].cut, links[0].heal)


def _or_none(call: Callable[..., int], *args: object) -> int | None:
    try:
        return call(*args)
    except EtcdUnavailableError:
        return None


@pytest.mark.parametrize("failure", FAILURES)
def test_etcd_client_moves_to_the_next_member_and_the_lease_lives_on(
        etcd3: EtcdServer, relays: Callable[[str], TcpRelay], failure: str) -> None:
    links = _links(etcd3, failure, relays)
    client = EtcdClient(links.urls, timeout_s=1.0)
    lease = client.grant(5)
    assert client.create("/t/k", b"v1", lease) > 0
    links.lose_first()
    started = time.monotonic()
    # Until the members left elect a raft leader (0.5 s here, more on a loaded machine) a call
    # that needs one waits, times out on each member and raises; its callers retry.
    ttl = wait_until(lambda: _or_none(client.keep_alive, lease), 5.0, "a keep-alive through the members left")
    assert ttl > 0, "the lease survives the loss of the raft leader"
    client.put("/t/k2", b"v2")
    kv2 = client.get("/t/k2")
    assert kv2 is not None and kv2.value == b"v2"
    kv = client.get("/t/k")
    assert kv is not None and kv.value == b"v1" and kv.lease == lease
    assert client.create("/t/k", b"again", lease) == 0, "a create still sees the key"
    assert time.monotonic() - started < 8.0
    assert client.endpoints[0] != links.urls[0], "a live member is tried first from now on"
    started = time.monotonic()
    for _ in range(5):
        client.get("/t/k")
    assert time.monotonic() - started < client.timeout_s, "the lost member costs no more timeouts"


@pytest.mark.parametrize("failure", FAILURES)
def test_masters_and_clients_survive_the_loss_of_their_etcd_member(
        etcd3: EtcdServer, spawn_master: SpawnMaster, spawn_agent: SpawnAgent,
        relays: Callable[[str], TcpRelay], failure: str) -> None:
    links = _links(etcd3, failure, relays)
    address = links.store_address("t")
    masters = [spawn_master(etcd=links.etcd, cluster="t", **MASTER) for _ in range(3)]
    leader_of(masters)
    spawn_agent(address, HOLDER_BYTES, **CLIENT)
    clients = [spawn_agent(address, 0, **CLIENT) for _ in range(2)]
    in_sync(masters, 2)

    reports = churn_through(clients, 5.0, (1.5, "member lost", links.lose_first))
    for r in reports:
        assert r["stale_reads"] == 0, r
        assert r["max_gap_s"] < 5.0, f"clients went on within 5 s: {r}"
    assert all(m.is_alive() for m in masters)
    leader = leader_of(masters)
    in_sync(masters, 2)
    verify(clients)

    # a standby campaigns through the members left, clients find it there
    reports = churn_through(clients, 6.0, (1.5, "leader killed", leader.kill))
    for r in reports:
        assert r["stale_reads"] == 0, r
        assert r["max_gap_s"] < 10.0, f"clients re-attached within 10 s: {r}"
    new = leader_of([m for m in masters if m.is_alive()])
    assert new is not leader
    verify(clients)

    links.restore_first()  # the lost member is back; the cluster goes on with it
    masters.append(spawn_master(etcd=links.etcd, cluster="t", **MASTER))
    in_sync([m for m in masters if m.is_alive()], 2)
    verify(clients)
