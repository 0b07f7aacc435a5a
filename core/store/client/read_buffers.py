"""``ReadBuffers``: registered memory that batch reads land in, handed out again once the tensors
made from it are gone. Nothing else.

A consumer that reads a batch into fresh memory each time pays for it twice: the kernel faults
in (and zeroes) every page on the read's first touch, and the engine registers and unregisters
the memory. Here a read takes a buffer of the engine's own memory (huge pages), the caller builds
its tensors on ``torch.frombuffer`` of the memoryview it got, and when the last tensor viewing it
is gone (a finalizer on that memoryview: torch keeps the buffer object alive as long as any view
of it) the buffer goes back to be reused: no page faults and no registration per read. At most
``keep`` idle buffers are kept; the rest are freed.
"""

from __future__ import annotations

import threading
import weakref

from tidekv.errors import TidekvError
from tidekv.transfer.engine import TransferEngine
from tidekv.transfer.memory import HUGE_PAGE
from tidekv.transfer.region import Region


class ReadBuffers:
    def __init__(self, engine: TransferEngine, keep: int = 4) -> None:
        self._engine = engine
        self._keep = keep
        self._idle: list[Region] = []
        self._spoiled: set[int] = set()
        self._closed = False
        self._lock = threading.Lock()  # finalizers run in whichever thread drops the last tensor

    def take(self, size: int) -> tuple[memoryview, int]:
        """A writable memoryview of ``size`` bytes of registered memory and its address. The
        buffer is reused once the memoryview and everything made from it are gone."""
        size = max(1, size)
        with self._lock:
            fits = [r for r in self._idle if r.length >= size]
            region = min(fits, key=lambda r: r.length) if fits else None
            if region is not None:
                self._idle.remove(region)
        if region is None:
            region = self._engine.allocate(-(-size // HUGE_PAGE) * HUGE_PAGE, huge=True)
        view = region.view()[:size]
        weakref.finalize(view, self._give_back, region)
        return view, region.address

    def spoil(self, address: int) -> None:
        """The buffer at ``address`` is never reused: a read into it did not end clean, so a late
        write may still land there. It is freed when its tensors are gone (``unregister`` waits
        for copies in flight and refuses later ones)."""
        with self._lock:
            self._spoiled.add(address)

    def _give_back(self, region: Region) -> None:
        with self._lock:
            if region.address in self._spoiled:
                self._spoiled.discard(region.address)
            elif len(self._idle) < self._keep and not self._closed:
                self._idle.append(region)
                return
        self._free(region)

    def _free(self, region: Region) -> None:
        try:
            self._engine.unregister(region)
        except TidekvError:
            pass  # the engine closed meanwhile: it freed its memory itself

    def close(self) -> None:
        """Frees the idle buffers, and each buffer in use once its tensors are gone (or by the
        engine's close, whichever comes first)."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for region in idle:
            self._free(region)

    @property
    def idle(self) -> int:
        return len(self._idle)
