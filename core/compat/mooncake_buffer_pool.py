"""Mooncake's ``mooncake.buffer_pool``: ``BufferPool``, which leases scratch buffers of registered
host memory for a store's zero-copy calls (``get_into``, ``put_from``, ``get_into_ranges``), and
its ``BufferLease`` (``ptr``, ``size``, ``buffer``, ``release()``, a ``with`` block).

The pool registers one local buffer of the store's ``local_buffer_size`` through the store's own
``register_buffer`` and carves leases from it (tidekv's ``OffsetAllocator``); when it is full, a
lease gets an overflow buffer of its own, registered for the lease and unregistered at its
release. ``max_bytes`` bounds local and overflow leases together (default: twice the local
buffer, Mooncake's "one local-buffer-sized overflow burst"). Mooncake's rules hold: ``release()``
is refused while a view of ``lease.buffer`` is alive, ``close()`` while a lease is, and an
exhausted pool blocks (``block``, ``timeout``) or raises. Errors are ``RuntimeError`` subclasses,
as Mooncake raises, and tidekv errors (``BufferPoolError``, ``BufferPoolExhaustedError``).

Difference: Mooncake leases from the store's own staging buffer; tidekv's drop-in keeps that one
private, so the pool's local buffer is a second one of the same size (virtual memory until
touched). ``min_size_class``, ``max_size_class`` and ``alignment`` are checked and have no
effect, and ``prewarm`` does nothing, as in Mooncake when it leases from the local buffer.
Neighbours: ``tidekv.compat.mooncake_store`` (the store), ``mooncake_types.MooncakeHostMemAllocator``
(the memory). Thread-safe.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
import weakref
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from tidekv.compat.mooncake_types import MooncakeHostMemAllocator
from tidekv.errors import ConfigError, OutOfSpaceError, TidekvError
from tidekv.store.allocator import OffsetAllocator

logger = logging.getLogger(__name__)

_MEMORY = MooncakeHostMemAllocator()


class BufferPoolError(TidekvError, RuntimeError):
    """A refused BufferPool call (closed pool, live views, failed registration); a RuntimeError,
    as Mooncake raises."""


class BufferPoolExhaustedError(BufferPoolError, OutOfSpaceError):
    """No lease of the size asked for within ``max_bytes`` / ``max_regions`` (or the timeout)."""


@dataclass(frozen=True, slots=True)
class _Piece:
    """Leased memory: ``offset`` into the local buffer, or None for an overflow buffer at ``ptr``."""

    ptr: int
    length: int
    offset: int | None


class BufferLease:
    """One leased buffer. ``ptr`` and ``buffer`` are valid until ``release()`` (or the end of the
    ``with`` block); each ``buffer`` is a fresh memoryview of ``size`` bytes. A lease is used by
    one thread at a time (the pool is thread-safe)."""

    def __init__(self, pool: BufferPool, piece: _Piece, size: int) -> None:
        self._pool: BufferPool | None = pool
        self._piece = piece
        self._size = size
        self._views: list[weakref.ref[Any]] = []

    @property
    def ptr(self) -> int:
        """The address to hand to the store's zero-copy calls."""
        self._check_open()
        return self._piece.ptr

    @property
    def size(self) -> int:
        """The size asked for."""
        return self._size

    @property
    def buffer(self) -> memoryview:
        """The leased bytes as a writable memoryview (format "B")."""
        self._check_open()
        array = (ctypes.c_uint8 * self._size).from_address(self._piece.ptr)
        array._lease = self  # type: ignore[attr-defined]  # a live view keeps its lease (and memory) alive
        self._views = [v for v in self._views if v() is not None]
        self._views.append(weakref.ref(array))
        return memoryview(array).cast("B")

    def release(self) -> None:
        """Returns the memory to the pool; again is a no-op.

        Raises:
            BufferPoolError: a view of ``buffer`` (or a slice, or an array over it) is alive.
        """
        if self._pool is None:
            return
        live = self._live_views()
        if live:
            raise BufferPoolError(f"cannot release the lease at {self._piece.ptr:#x}: {live} view(s) of its buffer "
                                  "are alive; delete them first (copy what must outlive the lease)")
        pool, self._pool = self._pool, None
        pool._give_back(self._piece)

    def __enter__(self) -> BufferLease:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if kind is not None and self._live_views():
            return  # not to hide the error in flight: the lease goes back with its last view (``__del__``)
        self.release()

    def __del__(self) -> None:
        # No view can be alive here: each holds its lease.
        if getattr(self, "_pool", None) is not None:
            self._views.clear()
            self.release()

    def _check_open(self) -> None:
        if self._pool is None:
            raise BufferPoolError(f"the lease at {self._piece.ptr:#x} is released")

    def _live_views(self) -> int:
        return sum(1 for v in self._views if v() is not None)


class BufferPool:
    """Leases registered host memory from ``store`` (a set-up ``MooncakeDistributedStore``).

    Args:
        store: the store whose ``register_buffer`` / ``unregister_buffer`` the memory goes through.
        max_bytes: bound on the bytes of all active leases; 0 = twice the local buffer.
        min_size_class, max_size_class, alignment: Mooncake's size classes; checked, no effect.
        block_on_exhaustion: whether ``acquire`` waits for a release by default.
        default_timeout: seconds ``acquire`` waits by default (None: no limit).
        max_regions: bound on the number of active leases (None: none).
        prewarm_size, prewarm_count: passed to ``prewarm``.

    Raises:
        BufferPoolError: the store is not set up, or its memory cannot be registered.
        ConfigError: an argument out of range (named).
    """

    def __init__(self, store: Any, max_bytes: int = 0, min_size_class: int = 64 << 10,
                 max_size_class: int | None = None, alignment: int = 8 << 20, block_on_exhaustion: bool = True,
                 default_timeout: float | None = None, max_regions: int | None = None, prewarm_size: int | None = None,
                 prewarm_count: int = 0) -> None:
        for name, value in (("max_bytes", max_bytes), ("max_regions", max_regions), ("prewarm_count", prewarm_count)):
            if value is not None and value < 0:
                raise ConfigError(f"BufferPool {name}={value} is out of range; allowed at least 0")
        for name, value in (("min_size_class", min_size_class), ("max_size_class", max_size_class)):
            if value is not None and value < 1:
                raise ConfigError(f"BufferPool {name}={value} is out of range; allowed at least 1")
        if alignment < ctypes.sizeof(ctypes.c_void_p) or alignment & (alignment - 1):
            raise ConfigError(f"BufferPool alignment={alignment} is not a power of two of at least 8")
        if default_timeout is not None and default_timeout < 0:
            raise ConfigError(f"BufferPool default_timeout={default_timeout} is out of range; allowed at least 0")
        self._store = store
        local = _local_buffer_bytes(store)
        self._max_bytes = max_bytes or 2 * local
        self._block = block_on_exhaustion
        self._timeout_s = default_timeout
        self._max_regions = max_regions
        self._cond = threading.Condition()
        self._alloc = OffsetAllocator(local)
        self._active_bytes = 0
        self._active = 0  # leases out, overflow buffers being registered included
        self._is_closed = False
        self._local = _registered(store, local)
        self._finalizer = weakref.finalize(self, _drop, store, self._local)
        if prewarm_size is not None and prewarm_count > 0:
            self.prewarm(prewarm_size, prewarm_count)

    def acquire(self, size: int, block: bool | None = None, timeout: float | None = None) -> BufferLease:
        """A lease of ``size`` bytes: from the local buffer, else an overflow buffer.

        Args:
            block: wait for a release when exhausted (None: ``block_on_exhaustion``).
            timeout: the longest wait, in seconds (None: ``default_timeout``).

        Raises:
            BufferPoolExhaustedError: ``size`` exceeds ``max_bytes``, or the pool is exhausted and
                ``block`` is false or ``timeout`` ran out.
            BufferPoolError: the pool is closed, or an overflow buffer could not be registered.
        """
        if size < 0:
            raise ConfigError(f"BufferPool.acquire size={size} is out of range; allowed at least 0")
        should_block = self._block if block is None else block
        timeout_s = self._timeout_s if timeout is None else timeout
        if timeout_s is not None and timeout_s < 0:
            raise ConfigError(f"BufferPool.acquire timeout={timeout_s} is out of range; allowed at least 0")
        need = max(size, 1)
        if need > self._max_bytes:
            raise BufferPoolExhaustedError(f"a buffer of {size} bytes exceeds the pool's max_bytes={self._max_bytes}")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while True:
                self._check_open()
                if self._has_room(need):
                    offset = self._alloc.allocate(need)  # None: no room in the local buffer, an overflow one
                    self._active_bytes += need
                    self._active += 1
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if not should_block or (left is not None and left <= 0):
                    why = "is exhausted" if not should_block else f"stayed exhausted for {timeout_s} s"
                    raise BufferPoolExhaustedError(
                        f"the buffer pool {why}: {self._active} lease(s) hold {self._active_bytes} of "
                        f"{self._max_bytes} bytes (max_regions={self._max_regions}); release leases or raise max_bytes")
                self._cond.wait(left)
        piece = self._overflow(need) if offset is None else _Piece(self._local + offset, need, offset)
        return BufferLease(self, piece, size)

    def buffer(self, size: int, block: bool | None = None, timeout: float | None = None) -> BufferLease:
        """``acquire``, spelled for ``with pool.buffer(n) as lease:``."""
        return self.acquire(size, block, timeout)

    def prewarm(self, size: int, count: int) -> None:
        """Nothing to do: the local buffer is registered up front (as in Mooncake's local-buffer mode).

        Raises:
            BufferPoolError: the pool is closed.
        """
        with self._cond:
            self._check_open()

    def close(self) -> None:
        """Unregisters and frees the local buffer; again is a no-op.

        Raises:
            BufferPoolError: a lease is still active (release it first).
        """
        with self._cond:
            if self._is_closed:
                return
            if self._active:
                raise BufferPoolError(f"cannot close the buffer pool: {self._active} lease(s) are active; "
                                      "release them first")
            self._is_closed = True
            self._cond.notify_all()
        self._finalizer()

    # ---- internals ---------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._is_closed:
            raise BufferPoolError("the buffer pool is closed")

    def _has_room(self, need: int) -> bool:
        """Under the lock: whether ``max_bytes`` and ``max_regions`` leave room for one more lease."""
        return self._active_bytes + need <= self._max_bytes and \
            (self._max_regions is None or self._active < self._max_regions)

    def _overflow(self, need: int) -> _Piece:
        try:
            return _Piece(_registered(self._store, need), need, None)
        except BaseException:
            self._forget(need)
            raise

    def _give_back(self, piece: _Piece) -> None:
        if piece.offset is None:
            _drop(self._store, piece.ptr)
        with self._cond:
            if piece.offset is not None:
                self._alloc.release(piece.offset, piece.length)
        self._forget(piece.length)

    def _forget(self, length: int) -> None:
        with self._cond:
            self._active_bytes -= length
            self._active -= 1
            self._cond.notify_all()


RegisteredBufferPool = BufferPool
"""Mooncake's older name."""
RegisteredBufferLease = BufferLease
"""Mooncake's older name."""


def _local_buffer_bytes(store: Any) -> int:
    """The store's ``local_buffer_size`` (tidekv stages through at least 1 MiB)."""
    size: int = getattr(store, "local_buffer_size", 0)
    if size <= 0:
        raise BufferPoolError("MooncakeDistributedStore is not initialized; call setup() before BufferPool(store)")
    return size


def _registered(store: Any, size: int) -> int:
    """The address of ``size`` fresh bytes registered with ``store``."""
    ptr = _MEMORY.alloc(size)
    if not ptr:
        raise BufferPoolError(f"cannot allocate {size} bytes of host memory for the buffer pool")
    code = store.register_buffer(ptr, size)
    if code != 0:
        _MEMORY.free(ptr)
        raise BufferPoolError(f"register_buffer({ptr:#x}, {size}) failed with Mooncake code {code}")
    return ptr


def _drop(store: Any, ptr: int) -> None:
    """Unregisters and frees memory from ``_registered`` (a closed store has unregistered it)."""
    code = store.unregister_buffer(ptr)
    if code != 0:
        logger.debug("buffer pool: unregister_buffer(%#x) returned %d (the store is closed?)", ptr, code)
    _MEMORY.free(ptr)
