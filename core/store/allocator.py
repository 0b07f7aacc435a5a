"""Offset allocator: hands out byte ranges of one segment. Nothing else.

Best fit over exact-size free lists: a request first looks for a free block of exactly its
(aligned) size, which is O(1) and the common case for uniform KV pages; otherwise it takes the
smallest free block that is large enough (a bisect over the sorted distinct free sizes) and
splits it. Freed blocks coalesce with free neighbours, so fragmentation stays bounded by the
live allocations' layout. Not thread-safe: the master owns it from one thread.
"""

from __future__ import annotations

import bisect

from tidekv.errors import ConfigError

ALIGNMENT = 64


RANGE_SHIFT = 48
"""An allocation for ``with_used`` is ``offset << RANGE_SHIFT | size`` (``used_range``)."""
RANGE_SIZE = (1 << RANGE_SHIFT) - 1


def align(size: int) -> int:
    return (size + ALIGNMENT - 1) & ~(ALIGNMENT - 1)


def used_range(offset: int, size: int) -> int:
    """An allocation as ``with_used`` takes it: one int that sorts by offset (sizes below 2^48)."""
    return offset << RANGE_SHIFT | size


def free_ranges(capacity: int, used: list[int]) -> list[int]:
    """The gaps ``used`` leaves in [0, capacity) as sorted ``used_range`` ints, each allocation
    counted at its aligned size (``used``: ``used_range`` ints, not overlapping; sorted in place)."""
    up, down, shift, mask = ALIGNMENT - 1, ~(ALIGNMENT - 1), RANGE_SHIFT, RANGE_SIZE
    used.sort()  # the caller's list, sorted in place: ten million at a restore
    out = []
    end = 0
    for v in used:  # ``align`` inline
        offset = v >> shift
        if offset > end:
            out.append(end << shift | (offset - end))
        end = offset + (((v & mask) + up) & down)
    if capacity > end:
        out.append(end << shift | (capacity - end))
    return out


def carve(free: list[int], taken: list[int]) -> list[int]:
    """``free`` (``used_range`` ints, not overlapping) without the allocations ``taken`` (at their
    aligned sizes), sorted; both lists are sorted in place. Raises ValueError when an allocation
    is not wholly inside the free ranges (two records of the same bytes disagree)."""
    up, down, shift, mask = ALIGNMENT - 1, ~(ALIGNMENT - 1), RANGE_SHIFT, RANGE_SIZE
    free.sort()
    taken.sort()
    merged: list[list[int]] = []  # [start, end] of each free run, neighbours merged
    for v in free:
        offset = v >> shift
        if merged and merged[-1][1] == offset:
            merged[-1][1] += v & mask
        else:
            merged.append([offset, offset + (v & mask)])
    out, i = [], 0
    for v in taken:
        offset = v >> shift
        end = offset + (((v & mask) + up) & down)
        while i < len(merged) and merged[i][1] <= offset:
            start, stop = merged[i]
            if stop > start:
                out.append(start << shift | (stop - start))
            i += 1
        if i == len(merged) or merged[i][0] > offset or merged[i][1] < end:
            raise ValueError(f"allocation [{offset}, {end}) is not inside the free ranges")
        if offset > merged[i][0]:
            out.append(merged[i][0] << shift | (offset - merged[i][0]))
        merged[i][0] = end
    for start, stop in merged[i:]:
        if stop > start:
            out.append(start << shift | (stop - start))
    return out


class OffsetAllocator:
    """Allocates offsets in [0, capacity)."""

    __slots__ = ("capacity", "used", "_by_offset", "_by_end", "_bins", "_sizes")

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ConfigError(f"segment capacity must be > 0, got {capacity}")
        self.capacity = capacity
        self.used = 0
        self._by_offset: dict[int, int] = {}  # free block offset -> size
        self._by_end: dict[int, int] = {}  # free block end -> offset
        self._bins: dict[int, set[int]] = {}  # size -> free offsets of that size
        self._sizes: list[int] = []  # sorted distinct sizes present in _bins
        self._add_free(0, capacity)

    @classmethod
    def with_used(cls, capacity: int, used: list[int]) -> OffsetAllocator:
        """An allocator whose only allocations are ``used`` (``used_range(offset, size)`` of each,
        any order, not overlapping; the list is sorted in place): what a restored master rebuilds
        from the replicas it knows. Ranges are ints, not (offset, size) tuples: a restore sorts ten
        million of them, in random order where a long-running pool's allocations are, and an int
        compares in one step where a tuple compares element by element."""
        return cls.with_free(capacity, free_ranges(capacity, used))

    @classmethod
    def with_free(cls, capacity: int, free: list[int]) -> OffsetAllocator:
        """An allocator whose free blocks are ``free`` (``used_range`` ints, sorted, not
        overlapping; neighbours are merged): a restore from a snapshot that saved them."""
        alloc = cls(capacity)
        alloc._remove_free(0, capacity)
        shift, mask = RANGE_SHIFT, RANGE_SIZE
        total = 0
        start = end = -1
        for v in free:
            offset, size = v >> shift, v & mask
            if offset + size > capacity:
                raise ConfigError(f"free range [{offset}, +{size}) past a capacity of {capacity}")
            if offset == end:  # adjacent: one block
                end += size
                continue
            if end > start >= 0:
                alloc._add_free(start, end - start)
                total += end - start
            start, end = offset, offset + size
        if end > start >= 0:
            alloc._add_free(start, end - start)
            total += end - start
        alloc.used = capacity - total
        return alloc

    @property
    def free(self) -> int:
        return self.capacity - self.used

    def largest_free(self) -> int:
        return self._sizes[-1] if self._sizes else 0

    def allocate(self, size: int) -> int | None:
        """Returns the offset of ``align(size)`` bytes, or None when no free block is big enough."""
        need = align(size)
        if need <= 0:
            raise ConfigError(f"allocation size must be > 0, got {size}")
        bucket = self._bins.get(need)
        if bucket:
            offset = next(iter(bucket))
            self._remove_free(offset, need)
        else:
            i = bisect.bisect_left(self._sizes, need)
            if i == len(self._sizes):
                return None
            block = self._sizes[i]
            offset = next(iter(self._bins[block]))
            self._remove_free(offset, block)
            self._add_free(offset + need, block - need)
        self.used += need
        return offset

    def release(self, offset: int, size: int) -> None:
        """Returns [offset, offset + align(size)) to the free pool, merging with free neighbours."""
        length = align(size)
        self.used -= length
        start, end = offset, offset + length
        before = self._by_end.get(start)
        if before is not None:
            self._remove_free(before, start - before)
            start = before
        after = self._by_offset.get(end)
        if after is not None:
            self._remove_free(end, after)
            end += after
        self._add_free(start, end - start)

    def _add_free(self, offset: int, size: int) -> None:
        if size <= 0:
            return
        self._by_offset[offset] = size
        self._by_end[offset + size] = offset
        bucket = self._bins.get(size)
        if bucket is None:
            self._bins[size] = {offset}
            bisect.insort(self._sizes, size)
        else:
            bucket.add(offset)

    def _remove_free(self, offset: int, size: int) -> None:
        del self._by_offset[offset]
        del self._by_end[offset + size]
        bucket = self._bins[size]
        bucket.discard(offset)
        if not bucket:
            del self._bins[size]
            del self._sizes[bisect.bisect_left(self._sizes, size)]
