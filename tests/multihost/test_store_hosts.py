"""The store across hosts (network namespaces on one bridge, ``rig``): with nothing set but the
master's address, holders advertise the address that routes to the master, clients on other
hosts put and get through them, a holder forced onto loopback is refused, and a holder's host
cut off mid-run loses nothing (typed errors, no stale reads, its objects copied elsewhere); and
a pool sharded over four master groups, one of them cut off."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from tidekv.store.wire.pool_map import PoolMap

from tests.multihost.rig import Host, Rig
from tests.store.payload import digest, payload
from tests.store.procs import AgentProcess, ChildError, MasterProcess, wait_until

MIB = 1 << 20
FAST = {"heartbeat_interval_s": 0.2, "rpc_timeout_s": 5.0}
"""Client settings that only make liveness second-scale (the test's clock), nothing about addresses."""
TYPED_ERRORS = {"PeerUnavailableError", "TransferError", "ObjectNotFoundError", "MasterUnavailableError",
                "TimeoutError", "StoreError"}
"""What a get may raise while a holder is cut off: tidekv's typed errors, never wrong bytes."""


@pytest.fixture
def on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Any]]:
    """``on(host, "master", **config)`` / ``on(host, "agent", master, segment_size, **store)``:
    a master or a store client on a rig host, stopped after the test (``engine_host=`` forces a
    client's engine address)."""
    monkeypatch.delenv("TIDEKV_HOST", raising=False)  # nothing set but the master's address
    started: list[Any] = []
    names = itertools.count()

    def start(where: Host, kind: str, *args: Any, **kwargs: Any) -> Any:
        n = next(names)
        log = tmp_path / f"{kind}-{n}-{where.name}.log"
        if kind == "master":
            child: Any = MasterProcess({"host": where.ip, **kwargs}, log, name=f"master@{where.name}",
                                       prefix=where.command([]))
        else:
            master, segment_size = args
            engine_host = kwargs.pop("engine_host", None)
            child = AgentProcess(master, segment_size, kwargs, log, f"agent{n}@{where.name}",
                                 prefix=where.command([]), host=engine_host)
        started.append(child)
        return child

    yield start
    for child in reversed(started):
        child.stop()


def _get_digest(agent: AgentProcess, key: str) -> str:
    return str(agent.call("get", key=key)["digest"])


def test_three_hosts_work_with_only_the_masters_address(multihost: Callable[..., Rig],
                                                        on: Callable[..., Any]) -> None:
    """The many-hosts issue's run: master on host 1, a holder on host 2, a client on host 3."""
    h1, h2, h3 = multihost(3).hosts
    master = on(h1, "master")
    assert master.address == f"{h1.ip}:{master.port}"
    holder = on(h2, "agent", master.address, 64 * MIB)
    assert holder.engine.startswith(f"{h2.ip}:"), f"the holder advertises {holder.engine}, not host 2's address"
    client = on(h3, "agent", master.address, 0)
    client.call("put", key="k1", seed=1, size=300_000)
    assert _get_digest(client, "k1") == digest(payload(1, 300_000))
    assert client.call("locate", keys=["k1"])["engines"] == [[holder.engine]]
    # Forced onto loopback on a host that reached the master from elsewhere: refused, naming the fix.
    with pytest.raises(ChildError) as refused:
        on(h3, "agent", master.address, 64 * MIB, engine_host="127.0.0.1")
    text = str(refused.value)
    assert "listens on loopback" in text and f"connected from {h3.ip}" in text and "TIDEKV_HOST" in text, text


def test_a_holder_on_the_masters_loopback_is_refused_by_clients_elsewhere(multihost: Callable[..., Rig],
                                                                         on: Callable[..., Any]) -> None:
    """A master bound to every address accepts a holder on its own host that came in through
    loopback and advertises loopback (right for that host's clients); a client on another host
    is then named "127.0.0.1:..." and refuses it with the fix, rather than dialing its own
    loopback: its put fails typed and is revoked, its get fails typed, and nothing is left."""
    h1, h3 = multihost(2).hosts
    master = on(h1, "master", host="0.0.0.0")
    holder = on(h1, "agent", f"127.0.0.1:{master.port}", 64 * MIB)
    assert holder.engine.startswith("127.0.0.1:"), holder.engine
    holder.call("put", key="own", seed=1, size=4096)
    client = on(h3, "agent", f"{h1.ip}:{master.port}", 0)
    for reply in (client.try_call("put", key="k1", seed=2, size=4096), client.try_call("get", key="own")):
        assert not reply["ok"] and reply["error_type"] == "ConfigError", reply
        assert holder.engine in reply["error"] and "TIDEKV_HOST" in reply["error"], reply
    assert client.call("locate", keys=["k1"])["engines"] == [[]], "the refused put was revoked"
    assert _get_digest(holder, "own") == digest(payload(1, 4096))


def test_a_holders_host_cut_off_loses_nothing(multihost: Callable[..., Rig], on: Callable[..., Any]) -> None:
    """Master, two holders and a client (which holds a segment too) on four hosts, two replicas of
    every object; holder b's host is cut off (not killed), then healed."""
    hm, ha, hb, hc = multihost(4).hosts
    master = on(hm, "master", client_ttl_s=1.0, lease_ttl_s=0.5, suspend_grace_s=60.0)
    a = on(ha, "agent", master.address, 16 * MIB, **FAST)
    b = on(hb, "agent", master.address, 16 * MIB, **FAST)
    client = on(hc, "agent", master.address, 16 * MIB, **FAST)
    keys = [f"obj-{i}" for i in range(30)]
    for i, key in enumerate(keys):
        client.call("put", key=key, seed=i, size=64 * 1024 + i, replicas=2)
    located = client.call("locate", keys=keys)["engines"]
    on_b = [k for k, engines in zip(keys, located) if b.engine in engines]
    assert on_b and all(len(engines) == 2 for engines in located), located
    hb.cut()
    wait_until(lambda: b.segment not in client.call("stats")["stats"]["segments"], 15.0,
               "the master to stop placing on and reading from the cut-off holder")
    # Every object reads back whole from its other replica; a put lands on the hosts still reachable.
    for i, key in enumerate(keys):
        reply = client.try_call("get", key=key)
        if reply["ok"]:
            assert reply["digest"] == digest(payload(i, 64 * 1024 + i)), f"{key}: wrong bytes"
        else:
            assert reply["error_type"] in TYPED_ERRORS, reply
            pytest.fail(f"{key} unreadable with one replica left: {reply}")
    client.call("put", key="during-cut", seed=99, size=4096, replicas=2)
    wait_until(lambda: client.call("stats")["stats"]["repairs"]["done"] >= len(on_b), 30.0,
               "the objects b held to be copied to the hosts still reachable")
    after = client.call("locate", keys=keys)["engines"]
    assert all(len(engines) == 2 and b.engine not in engines for engines in after), after
    hb.heal()
    wait_until(lambda: b.segment in client.call("stats")["stats"]["segments"], 20.0,
               "the healed holder to be taken back")
    for i, key in enumerate(keys):
        assert _get_digest(client, key) == digest(payload(i, 64 * 1024 + i)), f"{key} after the heal"
    assert _get_digest(a, "during-cut") == digest(payload(99, 4096))
    stats = client.call("stats")["stats"]
    assert stats["objects_lost"] == 0 and stats["repairs"]["failed"] == 0, stats


def test_four_groups_one_cut_off_delays_only_its_keys(multihost: Callable[..., Rig], on: Callable[..., Any]) -> None:
    """A pool sharded over four master groups, each a master on a host of its own (h0..h3), with
    a holder on h4 and a reader on h5 that find them by the pool address alone. Cutting h0 off
    fails exactly group g0's keys (typed, within the client's failover timeout) while batches of
    the other groups' keys are read as fast as before; healed, every key reads back."""
    hosts = multihost(6).hosts
    masters = [on(h, "master") for h in hosts[:4]]
    pool = ";".join(f"g{i}={m.address}" for i, m in enumerate(masters))
    clients = {**FAST, "rpc_timeout_s": 1.0, "failover_timeout_s": 1.0}
    holder = on(hosts[4], "agent", pool, 64 * MIB, **clients)
    reader = on(hosts[5], "agent", pool, 0, **clients)
    keys = [f"obj-{i}" for i in range(48)]
    for i, key in enumerate(keys):
        holder.call("put", key=key, seed=i, size=32 * 1024 + i)
    expected = [digest(payload(i, 32 * 1024 + i)) for i in range(len(keys))]
    pool_map = PoolMap([f"g{i}" for i in range(4)])
    cut_keys = {k for k in keys if pool_map.group_of(k.encode()) == 0}
    others = [k for k in keys if k not in cut_keys]
    assert cut_keys and others
    before = reader.call("get_many", keys=others, rounds=20)
    assert before["digests"] == [d for k, d in zip(keys, expected) if k not in cut_keys]

    hosts[0].cut()
    during = reader.call("get_many", keys=others, rounds=20)
    assert not during["failed"] and during["digests"] == before["digests"], during["failed"]
    slowest_before, slowest_during = max(before["elapsed_s"]), max(during["elapsed_s"])
    assert slowest_during < max(0.5, 5 * slowest_before), \
        f"the other groups' gets slowed while g0 was cut off: {slowest_before:.3f} s -> {slowest_during:.3f} s"
    print(f"other groups' batch of {len(others)} gets, slowest of 20: {slowest_before * 1e3:.1f} ms before the cut, "
          f"{slowest_during * 1e3:.1f} ms during it")
    mixed = reader.call("get_many", keys=keys)
    assert set(mixed["failed"]) == cut_keys and set(mixed["failed"].values()) == {"MasterUnavailableError"}, mixed
    assert mixed["elapsed_s"][0] < 5.0, "a cut-off group's keys fail after the client's failover timeout"
    fresh = next(k for k in (f"new-{i}" for i in range(100)) if pool_map.group_of(k.encode()) != 0)
    holder.call("put", key=fresh, seed=7, size=4096)  # puts of the other groups' keys go on too
    assert reader.call("get_many", keys=[fresh])["digests"] == [digest(payload(7, 4096))]

    hosts[0].heal()
    wait_until(lambda: not reader.call("get_many", keys=keys)["failed"], 20.0, "g0's keys to read again")
    assert reader.call("get_many", keys=keys)["digests"] == expected


def test_a_tensor_channel_from_one_host_to_another(multihost: Callable[..., Rig], on: Callable[..., Any]) -> None:
    """A producer on host 2 (its own segment holds the tensors) streams 1 MiB tensors to a
    consumer on host 3 through a master on host 1; the consumer reads them over the network."""
    h1, h2, h3 = multihost(3).hosts
    master = on(h1, "master")
    producer = on(h2, "agent", master.address, 64 * MIB, **FAST)
    consumer = on(h3, "agent", master.address, 0, **FAST)
    seqs = producer.call("chan_put", name="hidden", seeds=list(range(8)), size=MIB,
                         options={"max_items": 16})["seqs"]
    assert seqs == list(range(8))
    got = []
    while len(got) < 8:
        got += consumer.call("chan_take", name="hidden", max_items=8, wait_s=10)["items"]
    assert got == [[i, digest(payload(i, MIB))] for i in range(8)]
    assert producer.call("stats")["stats"]["keys"] == 0  # acked: the tensors left the pool


def test_a_disk_only_object_reads_on_another_host(multihost: Callable[..., Rig], on: Callable[..., Any],
                                                   tmp_path: Path) -> None:
    """A holder on host 2 with a disk tier, its memory too small for what is put: the objects
    evicted from memory are read by a client on host 3 through the holder's disk server, byte
    for byte."""
    h1, h2, h3 = multihost(3).hosts
    master = on(h1, "master", disk_write_through="all", lease_ttl_s=0.5)
    disk = tmp_path / "disk"
    disk.mkdir()
    holder = on(h2, "agent", master.address, MIB, disk_paths=str(disk), disk_size_bytes=16 * MIB, **FAST)
    client = on(h3, "agent", master.address, 0, **FAST)
    keys = [f"obj-{i}" for i in range(32)]
    for first in range(0, 32, 8):  # 32 x 64 KiB through a 1 MiB segment, each batch on disk first
        for i in range(first, first + 8):
            holder.call("put", key=keys[i], seed=i, size=64 * 1024)
        wait_until(lambda n=first + 8: holder.call("stats")["stats"]["disk"]["keys"] == n, 15.0,
                   f"{first + 8} objects on the holder's disk")
    disk_only = client.call("stats")["stats"]["disk"]["disk_only_keys"]
    assert disk_only >= 16, f"only {disk_only} objects left memory"
    assert client.call("get_many", keys=keys)["digests"] == [digest(payload(i, 64 * 1024)) for i in range(32)]
