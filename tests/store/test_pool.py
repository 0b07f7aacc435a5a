"""A key space sharded over master groups: the pool address, the map from keys to groups, and a
Store over four lone masters (each master holds exactly the keys the map gives it; a group that
is down fails only its keys)."""

from __future__ import annotations

import collections

import pytest
from tidekv.config import MasterAddress, PoolAddress
from tidekv.errors import ConfigError, MasterUnavailableError
from tidekv.store.client.master_client import MasterClient
from tidekv.store.wire import protocol as p
from tidekv.store.wire.pool_map import SLOTS, PoolMap, slot_of

from tests.store.conftest import Connect, SpawnMaster


def test_pool_address_forms() -> None:
    one = PoolAddress.parse("10.0.0.1:50051")
    assert one.groups == (("10.0.0.1:50051", MasterAddress("10.0.0.1:50051")),)
    pool = PoolAddress.parse("g0=10.0.0.1:50051; etcd://10.0.0.9:2379,10.0.0.8:2379/g1")
    assert [n for n, _ in pool.groups] == ["g0", "g1"]
    assert pool.groups[1][1].etcd_endpoints == ("http://10.0.0.9:2379", "http://10.0.0.8:2379")
    assert pool.hosts == ("10.0.0.1", "10.0.0.9", "10.0.0.8")
    assert PoolAddress.parse(str(pool)) == pool
    assert PoolAddress.parse(["a:1", "b:2"]) == PoolAddress.parse("a:1;b:2")
    assert PoolAddress.parse(MasterAddress("a:1")) == PoolAddress.parse("a:1")


@pytest.mark.parametrize("text, says", [
    ("", "names no master"),
    ("a:1;a:1", "names a group twice"),
    ("g=a:1;g=b:2", "names a group twice"),
    ("g0=a:1;nope", "is not 'host:port'"),
    ("bad name=a:1", "group name"),
])
def test_pool_address_refuses(text: str, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        PoolAddress.parse(text, "master")


def test_map_is_stable_and_balanced() -> None:
    names = ["g0", "g1", "g2", "g3"]
    pool_map = PoolMap(names)
    assert [PoolMap(list(reversed(names))).names[PoolMap(list(reversed(names))).group_of(b"k%d" % i)]
            for i in range(200)] == [names[pool_map.group_of(b"k%d" % i)] for i in range(200)], \
        "the map depends on the set of names, not their order"
    slots = [pool_map.slots_of(g) for g in range(4)]
    assert sum(slots) == SLOTS and min(slots) > SLOTS / 4 * 0.85, slots
    keys = [f"kv2/m/{i:016x}/0".encode() for i in range(20000)]
    per_group = collections.Counter(pool_map.group_of(k) for k in keys)
    assert min(per_group.values()) > 20000 / 4 * 0.85, per_group
    assert slot_of(b"abc") == slot_of(b"abc") < SLOTS


def test_adding_a_group_moves_only_its_share() -> None:
    four, five = PoolMap(["g0", "g1", "g2", "g3"]), PoolMap(["g0", "g1", "g2", "g3", "g4"])
    moved = 0
    for slot in range(SLOTS):
        before = four.names[four._owner[slot]]
        after = five.names[five._owner[slot]]
        if before != after:
            assert after == "g4", f"slot {slot} moved from {before} to {after}, not to the new group"
            moved += 1
    assert SLOTS / 5 * 0.8 < moved < SLOTS / 5 * 1.2, moved


def test_split_keeps_positions() -> None:
    pool_map = PoolMap(["a", "b", "c"])
    keys = [b"k%d" % i for i in range(100)]
    shares = pool_map.split(keys)
    assert sorted(i for _, positions in shares for i in positions) == list(range(100))
    for group, positions in shares:
        assert positions == sorted(positions)
        assert all(pool_map.group_of(keys[i]) == group for i in positions)
    assert PoolMap(["only"]).split(keys) == [(0, list(range(100)))]


def test_store_over_four_groups(spawn_master: SpawnMaster, connect: Connect) -> None:
    addresses = [spawn_master().address for _ in range(4)]
    pool = ";".join(f"g{i}={a}" for i, a in enumerate(addresses))
    holder = connect(pool, 8 << 20)
    reader = connect(pool)
    assert holder.groups == ("g0", "g1", "g2", "g3")
    keys = [f"key-{i}".encode() for i in range(200)]
    values = [bytes([i % 251]) * (100 + i) for i in range(200)]
    holder.put_many(keys, values)
    assert reader.get_many(keys + [b"absent"]) == values + [None]
    assert reader.exists_many([b"absent", keys[7]]) == [False, True]
    assert sorted(reader.keys()) == sorted(keys)

    pool_map = PoolMap(["g0", "g1", "g2", "g3"])
    expected = collections.defaultdict(set)
    for key in keys:
        expected[pool_map.group_of(key)].add(key)
    for g, address in enumerate(addresses):
        client = MasterClient(address, "test", timeout_s=5.0)
        try:
            held = {k for k, found in zip(keys, client.exists_many(keys)) if found}
            stats = client.call(p.StatsRequest())
        finally:
            client.close()
        assert held == expected[g], f"group g{g} holds keys the map does not give it"
        assert [s["capacity"] for s in stats["segments"].values()] == [(8 << 20) // 4], stats["segments"]

    totals = reader.stats()
    assert totals["keys"] == 200 and set(totals["groups"]) == {"g0", "g1", "g2", "g3"}
    assert reader.remove_many([keys[0], b"absent"], force=True) == [p.Status.OK, p.Status.NOT_FOUND]
    assert not reader.exists(keys[0])


def test_a_group_down_fails_only_its_keys(spawn_master: SpawnMaster, connect: Connect) -> None:
    masters = [spawn_master() for _ in range(4)]
    pool = ";".join(f"g{i}={m.address}" for i, m in enumerate(masters))
    holder = connect(pool, 8 << 20, failover_timeout_s=0.3)
    keys = [f"key-{i}".encode() for i in range(64)]
    holder.put_many(keys, [k * 10 for k in keys])
    pool_map = PoolMap(["g0", "g1", "g2", "g3"])
    down = pool_map.group_of(keys[0])
    masters[down].stop()
    lost = {k for k in keys if pool_map.group_of(k) == down}
    buffers = [bytearray(64) for _ in keys]
    regions = [holder.register(b) for b in buffers]
    with pytest.raises(MasterUnavailableError) as caught:
        holder.get_many_into(keys, buffers)
    assert set(caught.value.failed_keys) == lost
    for key, buf in zip(keys, buffers):
        if key not in lost:
            assert bytes(buf[: len(key) * 10]) == key * 10, f"{key!r} was not read while another group was down"
    for region in regions:
        holder.unregister(region)


def test_adding_a_group_turns_only_its_keys_into_misses(spawn_master: SpawnMaster, connect: Connect) -> None:
    """The procedure docs/design-sharding.md gives: start the new group and add it to every
    client's pool address. A client with the new map finds every key that stayed where it was,
    misses (never misreads) the keys whose slots moved to the new group, and puts them there."""
    addresses = [spawn_master().address for _ in range(4)]
    old_pool = ";".join(f"g{i}={a}" for i, a in enumerate(addresses[:3]))
    new_pool = old_pool + f";g3={addresses[3]}"
    old = connect(old_pool, 6 << 20)
    keys = [f"key-{i}".encode() for i in range(300)]
    old.put_many(keys, [k * 3 for k in keys])
    new = connect(new_pool, 8 << 20)
    moved = {k for k in keys if PoolMap(["g0", "g1", "g2", "g3"]).group_of(k) == 3}
    assert 0 < len(moved) < len(keys) / 2
    found = new.get_many(keys)
    assert all((v is None) == (k in moved) for k, v in zip(keys, found)), "only the moved keys are missed"
    assert all(v == k * 3 for k, v in zip(keys, found) if v is not None)
    new.put_many(sorted(moved), [k * 3 for k in sorted(moved)])
    assert new.get_many(keys) == [k * 3 for k in keys]
    assert old.get_many(keys) == [k * 3 for k in keys], "clients with the old map still read every key"
