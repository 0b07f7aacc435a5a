"""Eviction through a real master: LRU order, soft and hard pins, and a full pool.

The pool is one small segment in a holder process; the test process is a pure client. The
background watermark is off (1.0) so that only puts that find no room evict, in a known order.
"""

from __future__ import annotations

import time

import pytest

from tests.store.conftest import Connect, SpawnAgent, SpawnMaster
from tests.store.payload import payload
from tidekv.errors import OutOfSpaceError
from tidekv.store import Pin, Store

PAGE = 64 * 1024
LEASE_S = 0.2


@pytest.fixture
def pool(spawn_master: SpawnMaster, spawn_agent: SpawnAgent, connect: Connect) -> Store:
    """A pure client of a 16-page pool."""
    master = spawn_master(high_watermark=1.0, lease_ttl_s=LEASE_S)
    spawn_agent(master.address, 16 * PAGE)
    return connect(master.address)


def _alive(st: Store, keys: list[str]) -> set[str]:
    return {k for k, present in zip(keys, st.exists_many(keys)) if present}


def _put_all(st: Store, keys: list[str], pin: Pin = Pin.NONE) -> None:
    for i, k in enumerate(keys):
        st.put(k, payload(i, PAGE), pin=pin)


def test_least_recently_used_go_first(pool: Store) -> None:
    old = [f"k{i}" for i in range(16)]
    _put_all(pool, old)
    assert pool.stats()["used_bytes"] == 16 * PAGE
    for k in old[:4]:
        assert pool.get(k) == payload(old.index(k), PAGE)  # each get moves its key to the MRU end
    time.sleep(LEASE_S + 0.1)  # leased objects are skipped; let the gets' leases pass
    new = [f"n{i}" for i in range(4)]
    _put_all(pool, new)
    assert _alive(pool, old + new) == set(old[:4] + old[8:] + new)
    assert pool.stats()["evictions"] == 4
    for k in old[8:]:
        assert pool.get(k) == payload(old.index(k), PAGE), "a survivor's bytes must be intact"


def test_soft_pins_outlive_unpinned_and_hard_pins_are_never_evicted(pool: Store) -> None:
    soft, plain, hard = [f"s{i}" for i in range(4)], [f"p{i}" for i in range(4)], [f"h{i}" for i in range(8)]
    _put_all(pool, soft, Pin.SOFT)
    _put_all(pool, plain)
    _put_all(pool, hard, Pin.HARD)
    new = [f"x{i}" for i in range(8)]
    _put_all(pool, new[:4], Pin.HARD)
    assert _alive(pool, soft + plain) == set(soft), "unpinned objects go before soft-pinned ones"
    _put_all(pool, new[4:], Pin.HARD)
    assert _alive(pool, soft) == set(), "soft-pinned objects go when nothing unpinned is left"
    with pytest.raises(OutOfSpaceError, match="late"):
        pool.put("late", payload(0, PAGE))
    assert _alive(pool, hard + new) == set(hard + new)
    assert pool.stats()["used_bytes"] == 16 * PAGE
    pool.remove("h0")
    pool.put("late", payload(0, PAGE))
    assert pool.get("late") == payload(0, PAGE)


def test_full_pool_raises_out_of_space(pool: Store) -> None:
    with pytest.raises(OutOfSpaceError, match="even after eviction"):
        pool.put("bigger-than-the-pool", payload(1, 17 * PAGE))
    _put_all(pool, [f"k{i}" for i in range(16)])
    with pytest.raises(OutOfSpaceError):
        pool.put("bigger-than-the-pool", payload(1, 17 * PAGE))
    assert pool.stats()["evictions"] == 0, "an object no segment can hold must not evict anything"
    big = payload(2, 16 * PAGE)
    pool.put("whole-pool", big)  # evicts everything unpinned
    assert pool.get("whole-pool") == big
    assert pool.stats()["keys"] == 1


def test_batch_put_into_a_full_pool_fails_only_the_keys_that_do_not_fit(pool: Store) -> None:
    _put_all(pool, [f"h{i}" for i in range(14)], Pin.HARD)
    keys = [f"b{i}" for i in range(4)]
    with pytest.raises(OutOfSpaceError) as info:
        pool.put_many(keys, [payload(i, PAGE) for i in range(4)])
    failed = set(info.value.failed_keys)  # type: ignore[attr-defined]
    assert len(failed) == 2
    stored = _alive(pool, keys)
    assert len(stored) == 2 and {k.encode() for k in stored}.isdisjoint(failed)


def test_an_upsert_never_evicts_the_version_it_replaces(pool: Store) -> None:
    """With the pool full of its own key, an upsert fails with OutOfSpaceError instead of evicting
    the current version: a reader finds the old version or the new one, never neither."""
    pool.put("hot", payload(0, 15 * PAGE))
    time.sleep(LEASE_S + 0.1)
    with pytest.raises(OutOfSpaceError):
        pool.upsert("hot", payload(1, 2 * PAGE))  # 17 pages would need "hot" gone
    assert pool.get("hot") == payload(0, 15 * PAGE)
    pool.upsert("hot", payload(2, PAGE))  # fits beside it: the old version goes once replaced
    assert pool.get("hot") == payload(2, PAGE)
