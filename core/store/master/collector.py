"""Python's cycle collector in a master process: kept off the index, which has no cycles. Nothing else.

A full collection scans every tracked object with the event loop held, and a master's index is
millions of small objects in no cycle. ``FrozenHeap.tick`` (on the master's timer, every
``freeze_every_s``) collects what is not frozen yet, only what was made since the last freeze,
then freezes the survivors (``gc.freeze``), so full collections scan only what is new; every
``thaw_every_s`` everything is thawed and collected once, to find cycles that became garbage
among frozen objects. Only for a process tidekv owns (``tidekv master``, ``tidekv up``); a master
started inside another program leaves the collector alone.
Design notes: docs/store-design.md#tidekvstoremastercollector
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

FREEZE_EVERY_S = 10.0
THAW_EVERY_S = 3600.0


class FrozenHeap:
    """Freezes the process's surviving objects every ``freeze_every_s``; thaws them every ``thaw_every_s``."""

    def __init__(self, freeze_every_s: float = FREEZE_EVERY_S, thaw_every_s: float = THAW_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._freeze_every_s = freeze_every_s
        self._thaw_every_s = thaw_every_s
        self._clock = clock
        now = clock()
        self._next_freeze = now
        self._next_thaw = now + thaw_every_s
        self.freezes = 0
        self.thaws = 0

    def tick(self) -> None:
        """Freezes (after collecting what is not frozen) or thaws, when one is due; else nothing."""
        now = self._clock()
        if now >= self._next_thaw:
            gc.unfreeze()  # the collection below then looks at everything, once
            self._next_thaw = now + self._thaw_every_s
            self._next_freeze = now
            self.thaws += 1
        if now >= self._next_freeze:
            gc.collect()
            gc.freeze()
            self._next_freeze = now + self._freeze_every_s
            self.freezes += 1
