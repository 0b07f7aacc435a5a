"""Retired bytes: replicas that wait for their readers' leases to end before they are freed. Nothing else.

An object removed, upserted over or evicted while a reader holds a lease on it cannot give its
bytes back at once: the reader may still be copying them. Its replicas wait here, in a heap by
the time they may be freed (a full pool checks on every allocation it cannot make). A
``journal.Mirror`` knows no leases, so it keeps every freed range for a lease TTL (``KeptBytes``)
unless the leader places a put over it first; those ranges are indexed by segment and offset
because standbys check every placed put against them.

Neighbours: ``objects`` retires and frees (it owns the allocator calls and the tenants' usage);
``repairs`` retires the range of a repair it abandons; ``journal`` keeps bytes in its mirror.
Design notes: docs/store-design.md#tidekvstoremasterretired
"""

from __future__ import annotations

import bisect
import collections
import heapq
import itertools
from collections.abc import Iterable, Iterator, Sequence

from tidekv.store.allocator import align

Entry = tuple[float, int, tuple[object, ...], str | None]
"""(free_at, size, replicas (flat: segment, offset, ...), tenant charged for them: None when not known)."""


class RetiredBytes:
    """Entries ordered by ``free_at``; iteration yields them in no particular order."""

    __slots__ = ("_heap", "_seq")

    def __init__(self, entries: Iterable[Entry] = ()) -> None:
        self._seq = itertools.count()  # ties on free_at never compare replicas
        self._heap = [(e[0], next(self._seq), e) for e in entries]
        heapq.heapify(self._heap)

    def add(self, free_at: float, size: int, replicas: tuple[object, ...], tenant: str | None) -> None:
        heapq.heappush(self._heap, (free_at, next(self._seq), (free_at, size, replicas, tenant)))

    def next_due(self) -> float:
        """When the earliest entry may be freed (infinity when there is none)."""
        return self._heap[0][0] if self._heap else float("inf")

    def pop_due(self, now: float) -> list[Entry]:
        """Removes and returns the entries that may be freed at ``now``, earliest first."""
        heap, due = self._heap, []
        while heap and heap[0][0] <= now:
            due.append(heapq.heappop(heap)[2])
        return due

    def __iter__(self) -> Iterator[Entry]:
        return (e for _, _, e in self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)


class _Offsets:
    """Sorted ints kept in blocks of at most ``2 * _BLOCK``: an insert or delete moves one block,
    not the whole list (a replayed journal can free hundreds of thousands of ranges at once)."""

    __slots__ = ("_blocks", "_maxes")
    _BLOCK = 512

    def __init__(self) -> None:
        self._blocks: list[list[int]] = []
        self._maxes: list[int] = []  # the last (largest) of each block

    @classmethod
    def from_sorted(cls, xs: list[int]) -> _Offsets:
        offsets = cls()
        offsets._blocks = [xs[i: i + cls._BLOCK] for i in range(0, len(xs), cls._BLOCK)]
        offsets._maxes = [block[-1] for block in offsets._blocks]
        return offsets

    def add(self, x: int) -> None:
        blocks, maxes = self._blocks, self._maxes
        if not blocks:
            blocks.append([x])
            maxes.append(x)
            return
        i = min(bisect.bisect_left(maxes, x), len(maxes) - 1)
        block = blocks[i]
        bisect.insort(block, x)
        maxes[i] = block[-1]
        if len(block) > 2 * self._BLOCK:
            half = self._BLOCK
            blocks[i: i + 1] = [block[:half], block[half:]]
            maxes[i: i + 1] = [block[half - 1], block[-1]]

    def remove(self, x: int) -> None:
        i = bisect.bisect_left(self._maxes, x)
        block = self._blocks[i]
        del block[bisect.bisect_left(block, x)]
        if block:
            self._maxes[i] = block[-1]
        else:
            del self._blocks[i], self._maxes[i]

    def below(self, x: int) -> Iterator[int]:
        """The ints smaller than ``x``, largest first (do not change the set while iterating)."""
        blocks = self._blocks
        i = bisect.bisect_left(self._maxes, x)  # the first block holding one >= x
        if i < len(blocks):
            block = blocks[i]
            for j in range(bisect.bisect_left(block, x) - 1, -1, -1):
                yield block[j]
        for k in range(i - 1, -1, -1):
            yield from reversed(blocks[k])

    def __iter__(self) -> Iterator[int]:
        return itertools.chain.from_iterable(self._blocks)

    def __bool__(self) -> bool:
        return bool(self._blocks)


class KeptBytes:
    """Freed replica ranges a mirror keeps until a time, or until the leader places a put (or
    a repair's copy) over them. Ranges of one segment never overlap. Iteration yields
    ``(keep until, size, [segment, offset])`` per range.

    A segment's ranges are indexed by offset from the first put placed on it: a journal replayed
    at a restart may free hundreds of thousands of ranges before any put, and records each in O(1)."""

    __slots__ = ("_by_place", "_starts", "_order")

    def __init__(self) -> None:
        self._by_place: dict[tuple[object, int], tuple[float, int]] = {}  # (segment, offset) -> (until, size)
        self._starts: dict[object, _Offsets] = {}  # segment -> its kept offsets (once indexed)
        self._order: collections.deque[tuple[float, object, int]] = collections.deque()  # by until; stale ones skipped

    def add(self, until: float, size: int, replicas: Sequence[object]) -> None:
        """Keeps each replica (flat: segment, offset, ...) of ``size`` bytes until ``until``.
        Kept ranges it overlaps go (the leader had placed something there since: their leases
        were over by its clock), so kept ranges never overlap."""
        for i in range(0, len(replicas), 2):
            segment, offset = replicas[i], replicas[i + 1]
            assert isinstance(offset, int)
            starts = self._starts.get(segment)
            if starts is not None:
                self._drop_overlapping(segment, starts, offset, size)
                starts.add(offset)
            self._by_place[(segment, offset)] = (until, size)
            self._order.append((until, segment, offset))

    def reused(self, size: int, replicas: Sequence[object]) -> None:
        """The leader placed ``size`` bytes at each replica: kept ranges they overlap are dropped."""
        for i in range(0, len(replicas), 2):
            segment, offset = replicas[i], replicas[i + 1]
            assert isinstance(offset, int)
            starts = self._starts.get(segment)
            if starts is None:
                if not self._by_place:
                    continue
                starts = self._index(segment)
            if starts:
                self._drop_overlapping(segment, starts, offset, size)

    def expire(self, now: float) -> None:
        """Drops the ranges kept until ``now`` or earlier."""
        order = self._order
        while order and order[0][0] <= now:
            until, segment, offset = order.popleft()
            kept = self._by_place.get((segment, offset))
            if kept is not None and kept[0] == until:
                self._drop(segment, offset)

    def drop_segments(self, names: set[str]) -> None:
        """Forgets every range on those segments (unmounted)."""
        for place in [place for place in self._by_place if place[0] in names]:
            del self._by_place[place]
        for name in names:
            self._starts.pop(name, None)

    def _index(self, segment: object) -> _Offsets:
        """Indexes a segment's ranges by offset; where ranges recorded unindexed overlap, the one
        kept longer (freed last) stays."""
        kept: list[int] = []
        end = -1
        for offset in sorted(offset for seg, offset in self._by_place if seg == segment):
            until, size = self._by_place[(segment, offset)]
            if offset < end:
                last = kept[-1]
                if until <= self._by_place[(segment, last)][0]:
                    del self._by_place[(segment, offset)]
                    continue
                del self._by_place[(segment, last)]
                kept.pop()
            kept.append(offset)
            end = offset + align(size)
        starts = self._starts[segment] = _Offsets.from_sorted(kept)
        return starts

    def _drop_overlapping(self, segment: object, starts: _Offsets, offset: int, size: int) -> None:
        # Disjoint ranges sorted by start end in the same order: walk left from the last one
        # starting before this range's end while they end after its start.
        overlapped = []
        for start in starts.below(offset + align(size)):
            if start + align(self._by_place[(segment, start)][1]) <= offset:
                break
            overlapped.append(start)
        for start in overlapped:
            self._drop(segment, start)

    def _drop(self, segment: object, offset: int) -> None:
        del self._by_place[(segment, offset)]
        starts = self._starts.get(segment)
        if starts is not None:
            starts.remove(offset)

    def __iter__(self) -> Iterator[tuple[float, int, list[object]]]:
        return ((until, size, [segment, offset]) for (segment, offset), (until, size) in self._by_place.items())

    def __len__(self) -> int:
        return len(self._by_place)

    def __bool__(self) -> bool:
        return bool(self._by_place)
