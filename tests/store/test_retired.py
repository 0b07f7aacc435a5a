"""Retired bytes (removed or replaced under a read lease) come back exactly when their leases end,
whatever order they were retired in, and a full pool that has nothing to free answers fast. A
mirror's kept bytes (KeptBytes) go when their time passes or a put lands on them, and only then."""

from __future__ import annotations

import random
import time

import pytest
from tidekv.store.allocator import align
from tidekv.store.master import eviction
from tidekv.store.master.journal import Mirror, RetireOp, StartOp
from tidekv.store.master.retired import KeptBytes, RetiredBytes, _Offsets
from tidekv.store.wire.protocol import Status

from tests.store.rig import ServiceRig

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


def test_kept_bytes_go_when_a_put_overlaps_them_or_their_time_passes() -> None:
    kept = KeptBytes()
    kept.add(2.0, 4096, ["s", 0, "t", 0])  # two replicas of one object
    kept.add(2.0, 4096, ["s", 4096])
    kept.add(3.0, 4096, ["s", 8192])
    kept.reused(6000, ["s", 2048])  # [2048, 8064): the ends of the first two on s, not the third
    assert sorted((r[0], r[2][0], r[2][1]) for r in kept) == [(2.0, "t", 0), (3.0, "s", 8192)]
    kept.reused(64, ["s", 12288])  # just past the third: touches nothing
    assert len(kept) == 2
    kept.expire(1.9)
    assert len(kept) == 2
    kept.expire(2.0)
    assert [r[2] for r in kept] == [["s", 8192]]
    kept.add(4.0, 8192, ["s", 4096])  # freed again over the kept one (the leader had reused it): replaces it
    assert [(r[0], r[2]) for r in kept] == [(4.0, ["s", 4096])]
    kept.add(9.0, 64, ["u", 0])
    kept.drop_segments({"s"})
    assert [r[2] for r in kept] == [["u", 0]]
    kept.expire(100.0)
    assert not kept


@pytest.mark.parametrize("seed", range(3))
def test_kept_bytes_match_a_scan_of_every_range(seed: int) -> None:
    """Random frees, puts, expiries and unmounts: the index keeps exactly what checking every
    kept range against every put would (the mirror's rule before the index)."""
    rng = random.Random(seed)
    kept, model = KeptBytes(), []  # model: (until, segment, offset, size)
    grid = range(0, 1 << 20, 4096)
    now = 0.0
    for _ in range(3000):
        now += rng.random() * 0.01
        roll = rng.random()
        seg = rng.choice("ab")
        if roll < 0.45:  # a live range freed (never one still kept: ranges do not overlap)
            taken = {m[2] for m in model if m[1] == seg}
            offset = rng.choice([o for o in grid if o not in taken])
            size = rng.choice([100, 4096])
            kept.add(now + 1.0, size, [seg, offset])
            model.append((now + 1.0, seg, offset, size))
        elif roll < 0.9:  # a put placed anywhere (the leader's clock said the leases were over)
            offset, size = rng.randrange(0, 1 << 20, 64), rng.choice([64, 4096, 12288])
            kept.reused(size, [seg, offset])
            end = offset + align(size)
            model = [m for m in model if not (m[1] == seg and m[2] < end and offset < m[2] + align(m[3]))]
        elif roll < 0.99:
            kept.expire(now)
            model = [m for m in model if m[0] > now]
        else:
            kept.drop_segments({seg})
            model = [m for m in model if m[1] != seg]
        assert sorted((r[0], r[2][0], r[2][1], r[1]) for r in kept) == sorted(model)


def test_ranges_freed_over_each_other_before_the_index_keep_the_last_freed() -> None:
    kept = KeptBytes()
    kept.add(2.0, 8192, ["s", 0])
    kept.add(3.0, 4096, ["s", 4096])  # over the first one's second half, freed later
    kept.add(1.0, 4096, ["s", 12288])
    kept.reused(64, ["s", 1 << 20])  # the first put on s indexes it; lands on nothing
    assert sorted((r[2][1], r[0]) for r in kept) == [(4096, 3.0), (12288, 1.0)]
    kept.reused(64, ["s", 12288 + 4032])  # the last 64 bytes of the third
    assert [r[2][1] for r in kept] == [4096]


def test_offsets_stay_sorted_across_blocks() -> None:
    rng = random.Random(7)
    offsets, model = _Offsets(), []
    for _ in range(6000):  # well past a block's 1024, so blocks split and empty out
        if model and rng.random() < 0.3:
            x = model.pop(rng.randrange(len(model)))
            offsets.remove(x)
        else:
            x = rng.randrange(1 << 40)
            if x in model:
                continue
            offsets.add(x)
            model.append(x)
        if rng.random() < 0.05:
            probe = rng.randrange(1 << 40)
            assert list(offsets.below(probe)) == sorted((m for m in model if m < probe), reverse=True)
    assert list(offsets) == sorted(model)


def test_a_replayed_mass_remove_records_ranges_and_indexes_them_at_the_first_put() -> None:
    """A restart replays every range a remove freed before any put needs them by offset: each is
    recorded, not inserted into a sorted list (which moves half the list per range); the first
    put on the segment indexes them once."""
    offsets = random.Random(3).sample(range(0, 1 << 34, 4096), 200_000)
    mirror = Mirror(2.0)
    mirror.apply([RetireOp(4096, ["seg", o]) for o in offsets], 0.0)
    assert len(mirror.retired) == 200_000 and not mirror.retired._starts  # recorded, not indexed
    mirror.apply([StartOp(1, b"k", 4096, ["seg", offsets[0] + 64], 0, False, "w")], 0.0)  # in the first range
    assert len(mirror.retired) == 200_000 - 1
    assert list(mirror.retired._starts["seg"]) == sorted(offsets[1:])


def test_a_standby_checks_a_put_against_its_kept_bytes_without_a_scan() -> None:
    """A put the leader places costs the mirror the ranges it lands on, not every kept range
    (a scan of 3000 took milliseconds per put: standbys fell behind under churn)."""
    mirror = Mirror(2.0)
    mirror.apply([RetireOp(4096, ["seg", i * 8192]) for i in range(30000)], 0.0)
    started = time.perf_counter()
    for k in range(1000):
        mirror.apply([StartOp(k, b"k%d" % k, 4096, ["seg", (1 << 30) + k * 4096], 0, False, "w")], 0.0)
    per_put_s = (time.perf_counter() - started) / 1000
    assert len(mirror.retired) == 30000
    assert per_put_s < 1e-3, f"{per_put_s * 1e6:.0f} us per put against 30000 kept ranges (a scan: ~57,000)"


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
