"""Retired bytes: replicas that wait for their readers' leases to end before they are freed. Nothing else.

An object removed, upserted over or evicted while a reader holds a lease on it cannot give its
bytes back at once: the reader may still be copying them. Its replicas wait here until the time
they may be freed. A full pool looks for due bytes on every allocation it cannot make, so the
entries sit in a heap by that time: finding that nothing is due is O(1) and freeing what is due
O(log n) per entry (a list scanned on every allocation made puts into a full pool quadratic).

Neighbours: ``objects`` retires and frees (it owns the allocator calls and the tenants' usage);
``repairs`` retires the range of a repair it abandons.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Iterator

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
