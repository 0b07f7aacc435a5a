"""Read leases through a real master: they block remove and eviction, then lapse."""

from __future__ import annotations

import time

import pytest

from tests.store.conftest import Connect, SpawnAgent, SpawnMaster
from tests.store.payload import payload
from tests.store.procs import wait_until
from tidekv.errors import LeaseExpiredError, ObjectLeasedError, OutOfSpaceError
from tidekv.store import Status, Store

LEASE_S = 1.0
PAGE = 64 * 1024
MIB = 1 << 20


def _remove_ok(st: Store, key: str) -> bool:
    try:
        st.remove(key)
    except ObjectLeasedError:
        return False
    return True


def _try_put(st: Store, key: str, data: bytes) -> bool:
    try:
        st.put(key, data)
    except OutOfSpaceError:
        return False
    return True


def test_lease_blocks_remove_until_it_lapses(spawn_master: SpawnMaster, connect: Connect) -> None:
    master = spawn_master(lease_ttl_s=LEASE_S)
    st = connect(master.address, segment_size=4 * MIB)
    st.put("k", b"v" * 100)
    st.put("other", b"o")
    assert st.get("k") == b"v" * 100
    leased_at = time.monotonic()
    with pytest.raises(ObjectLeasedError, match="leased"):
        st.remove("k")
    assert st.remove_many(["k", "other"]) == [Status.LEASED, Status.OK]
    assert st.exists("k"), "a refused remove must leave the object"
    wait_until(lambda: _remove_ok(st, "k"), LEASE_S + 5, "the lease on 'k' to lapse")
    assert time.monotonic() - leased_at >= LEASE_S * 0.8
    assert not st.exists("k")
    stats = st.stats()
    assert stats["used_bytes"] == stats["spare_bytes"], "every object's bytes are free (the spare stays reserved)"


def test_force_remove_ignores_the_lease(spawn_master: SpawnMaster, connect: Connect) -> None:
    master = spawn_master(lease_ttl_s=30.0)
    st = connect(master.address, segment_size=4 * MIB)
    st.put("k", b"v")
    st.get("k")
    st.remove("k", force=True)
    assert not st.exists("k")
    st.put("k", b"again")
    assert st.get("k") == b"again"


def test_eviction_skips_leased_objects(spawn_master: SpawnMaster, spawn_agent: SpawnAgent, connect: Connect) -> None:
    master = spawn_master(lease_ttl_s=LEASE_S, high_watermark=1.0)
    spawn_agent(master.address, 4 * PAGE)
    st = connect(master.address)
    keys = [f"k{i}" for i in range(4)]
    for i, k in enumerate(keys):
        st.put(k, payload(i, PAGE))
    st.get("k0")  # oldest, but leased
    st.put("n0", payload(10, PAGE))
    assert st.exists_many(keys) == [True, False, True, True]
    values = st.get_many(["k0", "k2", "k3", "n0"])  # now every object is leased
    assert values == [payload(0, PAGE), payload(2, PAGE), payload(3, PAGE), payload(10, PAGE)]
    with pytest.raises(OutOfSpaceError):
        st.put("n1", payload(11, PAGE))
    wait_until(lambda: _try_put(st, "n1", payload(11, PAGE)), LEASE_S + 5, "room once the leases lapse")
    assert st.get("n1") == payload(11, PAGE)
    assert not st.exists("k0"), "after the leases, the least recently used object goes first"


def test_read_that_outlives_its_lease_raises_and_is_reported(spawn_master: SpawnMaster, connect: Connect) -> None:
    master = spawn_master(lease_ttl_s=1e-6)
    st = connect(master.address, segment_size=16 * MIB)
    st.put("k", payload(1, 4 * MIB))
    with pytest.raises(LeaseExpiredError, match="outlived its lease"):
        st.get("k")
    wait_until(lambda: st.stats()["lease_expiries"] >= 1, 5.0, "the heartbeat to report the expired lease")


def test_zero_lease_ttl_means_no_lease(spawn_master: SpawnMaster, connect: Connect) -> None:
    # MasterConfig accepts lease_ttl_s=0: reads are then unprotected, but they must still work.
    master = spawn_master(lease_ttl_s=0.0)
    st = connect(master.address, segment_size=4 * MIB)
    st.put("k", b"v" * 1000)
    assert st.get("k") == b"v" * 1000
    st.remove("k")


def test_lookup_takes_a_lease_as_get_does(spawn_master: SpawnMaster, connect: Connect) -> None:
    master = spawn_master(lease_ttl_s=LEASE_S)
    st = connect(master.address, segment_size=4 * MIB)
    st.put("k", b"v" * 100)
    assert st.exists("k")
    st.remove("k")  # exists grants no lease
    st.put("k", b"w" * 300)
    info = st.lookup_many(["k", "missing"])
    assert info[1] is None and info[0] is not None and info[0].size_bytes == 300
    assert [(loc.engine, loc.length) for loc in info[0].locations] == [(st.engine.name, 300)]
    with pytest.raises(ObjectLeasedError):
        st.remove("k")
    wait_until(lambda: _remove_ok(st, "k"), LEASE_S + 5, "the lease lookup took on 'k' to lapse")
