"""Replicas: copies on distinct segments, and reads that survive the SIGKILL of one holder."""

from __future__ import annotations

import random

import msgspec
import pytest
from tidekv.errors import ObjectNotFoundError
from tidekv.store.client.rpc import MasterChannel
from tidekv.store.wire import protocol as p

from tests.store.conftest import Connect, SpawnAgent, SpawnMaster
from tests.store.payload import digest, payload
from tests.store.procs import wait_until

MIB = 1 << 20


def _locations(address: str, keys: list[str]) -> list[list[p.Location]]:
    channel = MasterChannel(address, "test-probe", 5.0)
    try:
        _, raw = channel.call(p.Get([k.encode() for k in keys]))
    finally:
        channel.close()
    return [r.locations for r in msgspec.convert(raw, list[p.GetResult])]


def test_reads_survive_sigkill_of_one_replica_holder(spawn_master: SpawnMaster, spawn_agent: SpawnAgent,
                                                      connect: Connect) -> None:
    master = spawn_master(client_ttl_s=1.0, lease_ttl_s=0.5)
    holder_a = spawn_agent(master.address, 16 * MIB)
    holder_b = spawn_agent(master.address, 16 * MIB)
    writer = connect(master.address)
    reader = spawn_agent(master.address)
    rng = random.Random(11)
    objects = {f"rep-{i}": payload(i, rng.randint(1, MIB)) for i in range(12)}
    for key, data in objects.items():
        writer.put(key, data, replicas=2)
    holder_a.call("put", key="only-on-a", size=1000, seed=99, replicas=1)  # prefers its own segment

    for locs in _locations(master.address, list(objects)):
        assert sorted(loc.segment for loc in locs) == sorted([holder_a.segment, holder_b.segment])
        assert {loc.engine for loc in locs} == {holder_a.engine, holder_b.engine}
    assert [loc.segment for loc in _locations(master.address, ["only-on-a"])[0]] == [holder_a.segment]

    holder_a.kill()
    # Before the master notices: every read whose first replica is gone falls back to the second.
    for key, data in objects.items():
        assert writer.get(key) == data, f"{key} unreadable after its holder was killed"
        assert reader.call("get", key=key)["digest"] == digest(data)
    assert writer.get_many(list(objects)) == list(objects.values())

    stats = wait_until(lambda: (s := writer.stats())["segments"].keys() == {holder_b.segment} and s, 10.0,
                       "the master to suspend the killed holder's segment")
    assert stats["clients"] == 3 and stats["suspended_segments"].keys() == {holder_a.segment}
    assert (stats["suspended_keys"], stats["objects_lost"]) == (1, 0), \
        "only the single-replica object is unreadable (held for its holder until the suspension grace ends)"
    with pytest.raises(ObjectNotFoundError):
        writer.get("only-on-a")
    for key, data in objects.items():
        assert reader.call("get", key=key)["digest"] == digest(data)
    for locs in _locations(master.address, list(objects)):
        assert [loc.segment for loc in locs] == [holder_b.segment]

    writer.put("after", b"z" * 5000, replicas=2)  # best effort: one segment left, one replica
    assert [loc.segment for loc in _locations(master.address, ["after"])[0]] == [holder_b.segment]
    assert reader.call("get", key="after")["size"] == 5000


def test_locate_names_the_engines_holding_each_object_and_grants_no_lease(
        spawn_master: SpawnMaster, spawn_agent: SpawnAgent, connect: Connect) -> None:
    master = spawn_master()
    holder_a = spawn_agent(master.address, 16 * MIB)
    holder_b = spawn_agent(master.address, 16 * MIB)
    writer = connect(master.address)
    writer.put("two", b"x" * 1000, replicas=2)
    holder_a.call("put", key="only-on-a", size=1000, seed=5, replicas=1)  # prefers its own segment
    located = writer.locate_many(["two", "only-on-a", "absent"])
    assert sorted(located[0]) == sorted([holder_a.engine, holder_b.engine])
    assert located[1] == [holder_a.engine]
    assert located[2] == []
    assert writer.locate_many([]) == []
    writer.remove("only-on-a")  # a Get would have leased it; Locate did not
    assert writer.locate_many(["only-on-a"]) == [[]]
