"""OffsetAllocator against a byte-map reference: no overlap, bounds, alignment, coalescing."""

from __future__ import annotations

import random

import pytest

from tidekv.errors import ConfigError
from tidekv.store.allocator import ALIGNMENT, OffsetAllocator, align, used_range


def _check_disjoint(live: dict[int, int], capacity: int) -> None:
    spans = sorted((off, off + align(size)) for off, size in live.items())
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert end <= start, f"allocations overlap: one ends at {end}, the next starts at {start}"
    if spans:
        assert spans[0][0] >= 0 and spans[-1][1] <= capacity


@pytest.mark.parametrize("seed", range(5))
def test_random_allocate_release_never_overlaps_and_coalesces(seed: int) -> None:
    rng = random.Random(seed)
    capacity = 1 << 20
    alloc = OffsetAllocator(capacity)
    live: dict[int, int] = {}
    for step in range(3000):
        if live and (rng.random() < 0.45 or alloc.free < 4096):
            offset = rng.choice(list(live))
            alloc.release(offset, live.pop(offset))
        else:
            size = rng.choice([1, 63, 64, 65, 4096, rng.randint(1, 20000)])
            offset = alloc.allocate(size)
            if offset is None:
                assert alloc.largest_free() < align(size), f"step {step}: refused {size} B with a big enough block free"
                continue
            assert offset % ALIGNMENT == 0
            assert offset not in live
            live[offset] = size
        assert alloc.used == sum(align(s) for s in live.values())
        if step % 50 == 0:
            _check_disjoint(live, capacity)
    _check_disjoint(live, capacity)
    for offset in list(live):
        alloc.release(offset, live.pop(offset))
    assert alloc.used == 0
    assert alloc.largest_free() == capacity, "free neighbours did not coalesce back into one block"
    assert alloc.allocate(capacity) == 0


def test_exact_fit_reuses_a_freed_block_and_split_keeps_the_rest() -> None:
    alloc = OffsetAllocator(4096)
    a = alloc.allocate(1000)  # 1024 aligned
    b = alloc.allocate(1024)
    assert (a, b) == (0, 1024)
    alloc.release(a, 1000)
    assert alloc.allocate(1024) == 0, "an exact-size free block must be reused"
    assert alloc.free == 4096 - 2048
    assert alloc.largest_free() == 2048


def test_full_allocator_refuses_then_accepts_after_release() -> None:
    alloc = OffsetAllocator(640)
    offsets = [alloc.allocate(64) for _ in range(10)]
    assert sorted(offsets) == list(range(0, 640, 64))
    assert alloc.allocate(1) is None
    alloc.release(offsets[3], 64)
    alloc.release(offsets[4], 64)
    assert alloc.allocate(128) == offsets[3], "two adjacent freed blocks must merge"


def test_fragmentation_refuses_a_size_no_single_block_fits() -> None:
    alloc = OffsetAllocator(64 * 8)
    offsets = [alloc.allocate(64) for _ in range(8)]
    for off in offsets[::2]:
        alloc.release(off, 64)
    assert alloc.free == 256
    assert alloc.allocate(128) is None


@pytest.mark.parametrize("capacity", [0, -64])
def test_bad_capacity_is_a_config_error(capacity: int) -> None:
    with pytest.raises(ConfigError, match="capacity"):
        OffsetAllocator(capacity)


def test_zero_size_allocation_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="size"):
        OffsetAllocator(4096).allocate(0)


@pytest.mark.parametrize("seed", range(3))
def test_an_allocator_rebuilt_from_its_allocations_frees_the_same_blocks(seed: int) -> None:
    """``with_used`` (a restored master's allocator) from the live ranges, in any
    order: the same bytes in use, the same free blocks, and never an offset of a live one."""
    rng = random.Random(seed)
    capacity = 1 << 20
    alloc = OffsetAllocator(capacity)
    live: dict[int, int] = {}
    for _ in range(2000):
        if live and rng.random() < 0.4:
            offset = rng.choice(list(live))
            alloc.release(offset, live.pop(offset))
        else:
            size = rng.choice([1, 64, 100, 4096, rng.randint(1, 9000)])
            offset = alloc.allocate(size)
            if offset is not None:
                live[offset] = size
    used = [used_range(offset, size) for offset, size in live.items()]
    rng.shuffle(used)
    rebuilt = OffsetAllocator.with_used(capacity, used)
    assert rebuilt.used == alloc.used == sum(align(s) for s in live.values())
    assert rebuilt.free == alloc.free
    assert rebuilt.largest_free() == alloc.largest_free()
    # Taking every free block, largest first, gives the same blocks from both, none of them live.
    blocks = []
    for a in (alloc, rebuilt):
        taken = []
        while a.free and (block := a.largest_free()):
            offset = a.allocate(block)
            assert offset is not None and all(not (o <= offset < o + align(s)) for o, s in live.items())
            taken.append((offset, block))
        blocks.append(sorted(taken))
    assert blocks[0] == blocks[1] and blocks[0]
