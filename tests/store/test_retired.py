"""Retired bytes (removed or replaced under a read lease) come back exactly when their leases end,
whatever order they were retired in, and a full pool that has nothing to free answers fast."""

from __future__ import annotations

import time

from tests.store.rig import ServiceRig
from tidekv.store import eviction
from tidekv.store.protocol import Status
from tidekv.store.retired import RetiredBytes

PAGE = 4096


def test_entries_come_out_when_due_earliest_first() -> None:
    retired = RetiredBytes()
    for free_at, name in [(5.0, "c"), (1.0, "a"), (3.0, "b"), (3.0, "b2"), (9.0, "d")]:
        retired.add(free_at, 64, (name, 0), None)
    assert len(retired) == 5 and retired.next_due() == 1.0
    assert retired.pop_due(0.5) == []
    due = retired.pop_due(3.0)
    assert [e[2][0] for e in due] == ["a", "b", "b2"]  # ties keep insertion order, never compare replicas
    assert len(retired) == 2 and retired.next_due() == 5.0
    assert sorted(e[2][0] for e in retired) == ["c", "d"]
    assert [e[2][0] for e in retired.pop_due(100.0)] == ["c", "d"]
    assert not retired and retired.next_due() == float("inf")


def test_tied_entries_with_unorderable_tenants_do_not_break_the_heap() -> None:
    retired = RetiredBytes([(2.0, 64, ("s", 0), None), (2.0, 64, ("s", 0), "tenant")])
    retired.add(2.0, 64, ("s", 0), None)
    assert len(retired.pop_due(2.0)) == 3


def _rig(pages: int, lease_s: float) -> ServiceRig:
    rig = ServiceRig(lease_ttl_s=lease_s, high_watermark=1.0)
    rig.hello("h")
    rig.hello("w")
    rig.mount("h", "seg-h", pages * PAGE)
    return rig


def test_bytes_removed_under_leases_return_as_each_lease_ends() -> None:
    rig = _rig(pages=8, lease_s=4.0)
    keys = [f"k{i}".encode() for i in range(8)]
    for k in keys:
        assert rig.put("w", k, PAGE).status == Status.OK
    # Leases taken at different times, removals in another order: k3 (t=0), k1 (t=1), k6 (t=2).
    rig.get(keys[3])
    rig.advance(1.0)
    rig.get(keys[1])
    rig.advance(1.0)
    rig.get(keys[6])
    for k in (keys[6], keys[1], keys[3]):
        assert rig.remove(k, force=True) == Status.OK
    assert rig.stats()["used_bytes"] == 8 * PAGE
    expected = [(2.1, 7), (1.0, 6), (1.0, 5)]  # k3's lease ends at t=4, k1's at 5, k6's at 6
    for step, pages_used in expected:
        rig.advance(step)
        assert rig.stats()["used_bytes"] == pages_used * PAGE


def test_a_full_pool_of_leased_bytes_refuses_a_batch_with_one_scan_per_key(monkeypatch: object) -> None:
    rig = _rig(pages=64, lease_s=30.0)
    keys = [f"k{i}".encode() for i in range(64)]
    for k in keys:
        rig.put("w", k, PAGE)
    for k in keys[:32]:  # half removed under a lease (retired), half leased in place
        rig.get(k)
        assert rig.remove(k, force=True) == Status.OK
    for k in keys[32:]:
        rig.get(k)
    scans = []
    select = eviction.select_victims
    monkeypatch.setattr(eviction, "select_victims",  # type: ignore[attr-defined]
                        lambda *a: scans.append(1) or select(*a))
    started = time.perf_counter()
    slots = [rig.put_start("w", f"new{i}".encode(), PAGE) for i in range(20)]
    assert [s.status for s in slots] == [Status.OUT_OF_SPACE] * 20
    assert len(scans) == 20, "nothing evictable and nothing due: one look per key, not four"
    assert time.perf_counter() - started < 5.0
    rig.advance(30.1, tick=False)
    assert rig.put("w", b"after", PAGE).status == Status.OK, "the retired bytes are free once their leases end"
