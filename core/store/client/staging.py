"""Staging memory: registered scratch space for put()/get() of plain bytes objects.

A bytes object cannot be the source or target of a one-sided transfer (it is not registered, and
is immutable), so its bytes pass through here. One registered region, carved up with the offset
allocator; a request larger than the whole region gets a temporary region of its own. Small
requests (the latency-bound ones) take one of a few fixed slots reserved up front, without a lock.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from tidekv.store.allocator import OffsetAllocator
from tidekv.transfer.engine import TransferEngine
from tidekv.transfer.region import Region

SMALL_SLOT = 64 << 10
"""Requests up to this size take a reserved slot."""
SMALL_SLOTS = 16
"""Reserved slots (taken only when the region is at least four times their total)."""


class StagingArea:
    def __init__(self, engine: TransferEngine, size: int) -> None:
        self._engine = engine
        self._region = engine.allocate(size)
        self._alloc = OffsetAllocator(size)
        self._lock = threading.Lock()
        self._freed = threading.Condition(self._lock)
        self._small: list[Region] = []
        if size >= 4 * SMALL_SLOT * SMALL_SLOTS:
            base = self._alloc.allocate(SMALL_SLOT * SMALL_SLOTS)
            assert base is not None
            self._small = [Region(self._region.address + base + i * SMALL_SLOT, SMALL_SLOT, "cpu", True, self._region)
                           for i in range(SMALL_SLOTS)]

    @property
    def capacity(self) -> int:
        """Bytes of the staging region (a larger borrow gets a temporary region of its own)."""
        return self._region.length

    def close(self) -> None:
        """Returns the staging region to the engine (when the engine outlives this store)."""
        self._engine.unregister(self._region)

    @contextmanager
    def borrow(self, size: int) -> Iterator[Region]:
        """A registered region of at least ``size`` bytes for the duration of the ``with`` block."""
        if size <= SMALL_SLOT:
            try:
                slot = self._small.pop()  # atomic; empty (all in use, or none reserved) -> general path
            except IndexError:
                pass
            else:
                try:
                    yield slot
                finally:
                    self._small.append(slot)
                return
        if size > self._region.length:
            region = self._engine.allocate(size)
            try:
                yield region
            finally:
                self._engine.unregister(region)
            return
        with self._freed:
            offset = self._alloc.allocate(size)
            while offset is None:
                self._freed.wait()
                offset = self._alloc.allocate(size)
        try:
            yield Region(self._region.address + offset, size, "cpu", True, self._region)
        finally:
            with self._freed:
                self._alloc.release(offset, size)
                self._freed.notify_all()
