"""Python's cycle collector in a master process: kept off the index, which has no cycles. Nothing else.

The collector finds reference cycles by scanning tracked objects; a full collection runs once the
objects that survived since the last one reach a quarter of all of them, and scans them all,
holding the event loop meanwhile. A master's index is millions of small objects (an ObjectMeta
per object, and its pending put) in no cycle, so every full collection scans them for nothing:
``tidekv bench master`` measures the longest single put at 1M objects.

``FrozenHeap.tick`` (on the master's timer, every ``freeze_every_s``) collects what is not frozen
yet, which is only what was made since the last freeze, and then freezes the survivors
(``gc.freeze``): full collections from then on scan only what is new. Frozen objects are still
freed the moment their last reference goes; what a freeze gives up is finding a cycle among them
that becomes garbage later (a closed connection's objects, say), so every ``thaw_every_s``
everything is thawed and collected once: one pause of the old kind an hour instead of one every
few hundred thousand puts. Only for a process tidekv owns (``tidekv master``, ``tidekv up``):
freezing a process's objects is the process owner's call, so a master started inside another
program (tests, an application calling ``MasterServer.start()``) leaves the collector alone.
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
