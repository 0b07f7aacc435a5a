"""The trace simulation (tidekv.trace.cache) on hand-made traces whose answers are worked out by
hand, and against a brute-force reference on generated ones."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.trace.traces import HAND, request
from tidekv.trace import TraceRequest
from tidekv.trace.cache import (
    CacheKind,
    Routing,
    capacity_for_fraction,
    simulate_global,
    simulate_local,
    simulate_two_tier,
    working_set,
)

TOTAL = 1024 + 1500 + 700 + 300


def test_unbounded_global_by_hand() -> None:
    # r1 misses; r2 finds [1, 2] (1024); r3 finds [1] (512); r4 finds [1], capped at its 300 tokens.
    result = simulate_global(HAND, 0)
    assert (result.hit_tokens, result.input_tokens, result.requests) == (1024 + 512 + 300, TOTAL, 4)
    assert result.hit_rate == pytest.approx(1836 / 3524)
    assert result.kind is CacheKind.GLOBAL and result.routing is None


def test_two_block_global_by_hand() -> None:
    # 1024 tokens = 2 blocks. After r1 {1, 2}; r2 hits 2 blocks, then holds {2, 3}; r3 misses
    # (1 was evicted), holds {1, 4}; r4 hits [1]: 300.
    assert simulate_global(HAND, 1024).hit_tokens == 1024 + 300
    # 1535 tokens is still 2 blocks (capacity // 512).
    assert simulate_global(HAND, 1535).hit_tokens == 1024 + 300


def test_a_request_longer_than_the_cache_evicts_its_own_blocks() -> None:
    # One block of room: after [1, 2] only 2 is held, so the repeat misses its first block.
    trace = [request([1, 2], 1024), request([1, 2], 1024)]
    assert simulate_global(trace, 512).hit_tokens == 0
    assert simulate_global(trace, 1024).hit_tokens == 1024


def test_two_tiers_by_hand() -> None:
    # Memory of one block, disk of two. r1 [1, 2]: memory {2}, disk {1}. r2 [1, 2, 3] finds 1 on
    # disk and 2 in memory (1024, 512 of it from disk); then memory {3}, disk {1, 2}.
    # r3 [1, 4] finds 1 on disk (512): 1 stays there, 4 pushes 3 out of memory onto the disk,
    # which drops its least recent, 2: disk {1, 3}. r4 [1] finds 1 on disk: 300 tokens.
    result = simulate_two_tier(HAND, 512, 1024)
    assert (result.hit_tokens, result.disk_hit_tokens) == (1024 + 512 + 300, 512 + 512 + 300)
    assert (result.capacity_tokens, result.disk_capacity_tokens) == (512, 1024)
    without = simulate_global(HAND, 512)
    assert without.hit_tokens == 0, "one block of memory alone finds nothing in this trace"


def test_a_disk_tier_never_lowers_the_hit_rate_and_a_big_memory_needs_none() -> None:
    trace = [request([i % 7, (i * 3) % 11 + 100], 1024) for i in range(200)]
    for memory in (512, 1024, 2048):
        assert simulate_two_tier(trace, memory, 4096).hit_tokens >= simulate_global(trace, memory).hit_tokens
    roomy = simulate_two_tier(trace, 100 * 512, 512)
    assert roomy.disk_hit_tokens == 0 and roomy.hit_tokens == simulate_global(trace, 0).hit_tokens
    with pytest.raises(ValueError):
        simulate_two_tier(trace, 0, 512)


def test_a_capacity_under_one_block_holds_nothing() -> None:
    assert simulate_global(HAND, 100).hit_tokens == 0


def test_local_round_robin_by_hand() -> None:
    # r1, r3 -> instance 0 ({1, 2}, then r3 hits [1]: 512); r2, r4 -> instance 1 (r4 hits [1]: 300).
    result = simulate_local(HAND, 0, 2, Routing.ROUND_ROBIN)
    assert result.hit_tokens == 512 + 300
    assert (result.kind, result.routing, result.instances) == (CacheKind.LOCAL, Routing.ROUND_ROBIN, 2)


def test_local_prefix_unbounded_by_hand() -> None:
    # r1 takes the first turn (instance 0); everything after finds its prefix there.
    assert simulate_local(HAND, 0, 2, Routing.PREFIX).hit_tokens == 1836


def test_local_prefix_bounded_by_hand() -> None:
    # 2048 tokens over 2 instances: 2 blocks each. r1 -> 0 {1, 2}; r2 -> 0 (holds 2 blocks), hits
    # 1024, holds {2, 3}; r3: nobody holds 1, second turn -> 1 {1, 4}; r4 -> 1, hits 300.
    assert simulate_local(HAND, 2048, 2, Routing.PREFIX).hit_tokens == 1024 + 300


def test_one_local_cache_is_the_global_pool() -> None:
    for capacity in (0, 512, 1024, 4096):
        assert simulate_local(HAND, capacity, 1, Routing.PREFIX).hit_tokens == simulate_global(HAND, capacity).hit_tokens


def test_capacity_for_fraction_by_hand() -> None:
    # Unbounded: 1836 hit tokens. 1 block: r1 {2}, r2 misses 1, {3}, r3 {4}, r4 misses: 0.
    # 2 blocks: 1324 >= 0.7 * 1836 = 1285.2; 0.75 needs 1377: 3 blocks (r2 keeps {1,2,3}: r3 hits).
    assert capacity_for_fraction(HAND, 0.7) == (1024, pytest.approx(1324 / TOTAL))
    assert capacity_for_fraction(HAND, 0.75)[0] == 3 * 512
    assert capacity_for_fraction([request([1], 512)], 0.9) == (0, 0.0)


def test_working_set_by_hand() -> None:
    # Window 0 (0..60 s): r1, r2 touch {1, 2, 3}; window 1: r3, r4 touch {1, 4}; 4 distinct in all.
    points = working_set(HAND, 60)
    assert [(p.start_s, p.window_tokens, p.footprint_tokens) for p in points] == [
        (0.0, 3 * 512, 3 * 512), (60.0, 2 * 512, 4 * 512)]


# ---- brute force ---------------------------------------------------------------------------


def reference_hits(requests: Sequence[TraceRequest], capacity_tokens: int, instances: int = 1,
                   routing: Routing = Routing.ROUND_ROBIN) -> int:
    """The documented semantics, literally: caches are lists, least recent first; evict after each insert."""
    limit = None if capacity_tokens == 0 else capacity_tokens // instances // 512
    caches: list[list[int]] = [[] for _ in range(instances)]
    turn = 0

    def leading(cache: list[int], ids: Sequence[int]) -> int:
        n = 0
        while n < len(ids) and ids[n] in cache:
            n += 1
        return n

    total = 0
    for r in requests:
        if routing is Routing.PREFIX:
            held = [leading(c, r.hash_ids) for c in caches]
            candidates = [i for i in range(instances) if held[i] == max(held)] if max(held) > 0 else list(range(instances))
        else:
            candidates = list(range(instances))
        if len(candidates) > 1:
            turn += 1
            choice = candidates[(turn - 1) % len(candidates)]
        else:
            choice = candidates[0]
        cache = caches[choice]
        total += min(leading(cache, r.hash_ids) * 512, r.input_length)
        for block in r.hash_ids:
            if block in cache:
                cache.remove(block)
            cache.append(block)
            while limit is not None and len(cache) > limit:
                cache.pop(0)
    return total


requests_strategy = st.lists(
    st.builds(lambda ids, extra: request(ids, max(0, len(ids) * 512 - extra)),
              st.lists(st.integers(0, 12), min_size=0, max_size=6), st.integers(0, 700)),
    max_size=30)


@settings(max_examples=150, deadline=None)
@given(requests_strategy, st.integers(0, 8 * 512), st.integers(1, 3), st.sampled_from(list(Routing)))
def test_simulation_matches_brute_force(trace: list[TraceRequest], capacity: int, instances: int,
                                        routing: Routing) -> None:
    assert simulate_global(trace, capacity).hit_tokens == reference_hits(trace, capacity)
    assert simulate_local(trace, capacity, instances, routing).hit_tokens == reference_hits(
        trace, capacity, instances, routing)


@settings(max_examples=60, deadline=None)
@given(requests_strategy, st.floats(0.05, 1.0))
def test_capacity_for_fraction_is_the_smallest(trace: list[TraceRequest], fraction: float) -> None:
    capacity, rate = capacity_for_fraction(trace, fraction)
    unbounded = reference_hits(trace, 0)
    if unbounded == 0:
        assert (capacity, rate) == (0, 0.0)
        return
    # (0 blocks holds nothing: 0 hits, while a target above 0 is asked for)
    smallest = next(b for b in range(1, 200) if reference_hits(trace, b * 512) >= fraction * unbounded)
    assert capacity == smallest * 512
    assert rate == pytest.approx(reference_hits(trace, capacity) / sum(r.input_length for r in trace))
