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
_RANGE_SIZE = (1 << RANGE_SHIFT) - 1


def align(size: int) -> int:
    return (size + ALIGNMENT - 1) & ~(ALIGNMENT - 1)


def used_range(offset: int, size: int) -> int:
    """An allocation as ``with_used`` takes it: one int that sorts by offset (sizes below 2^48)."""
    return offset << RANGE_SHIFT | size


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
        alloc = cls(capacity)
        alloc._remove_free(0, capacity)
        end = total = 0
        up, down, shift, mask = ALIGNMENT - 1, ~(ALIGNMENT - 1), RANGE_SHIFT, _RANGE_SIZE
        used.sort()  # the caller's list, sorted in place: ten million at a restore
        for v in used:  # ``align`` inline, no empty gaps
            offset = v >> shift
            if offset > end:
                alloc._add_free(end, offset - end)
            size = ((v & mask) + up) & down
            end = offset + size
            total += size
        alloc.used = total
        alloc._add_free(end, capacity - end)
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
