"""Huge pages for transfer memory: whether to allocate on them, and moving existing memory onto them.

On some VMs memory in 4 KiB pages that sat idle for a second or two reads and writes 3-4x slower
the first time it is touched again; memory on transparent huge pages (THP) does not. Transfers
touch exactly such memory: a store segment written minutes ago, KV-cache blocks that were free
until the copy lands in them. Neighbours: ``TransferEngine.allocate(huge=True)`` allocates on
huge pages; the store and the engine plugins decide with the functions here.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25  # Linux 6.1


def thp_enabled() -> bool:
    """Whether transparent huge pages can back anonymous memory here (``enabled`` is not never)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def huge_pages_shareable() -> bool:
    """Whether ``allocate(huge=True)`` memory is a good choice for memory other processes read.

    True where THP can back anonymous memory and processes of one user may attach to each other's
    memory (no Yama, or ptrace_scope 0); otherwise same-host peers could not reach it without tcp.
    """
    if not thp_enabled():
        return False
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            return f.read().strip() == "0"
    except OSError:
        return True  # no Yama: same-uid processes may attach


_libc: ctypes.CDLL | None = None


def promote_to_huge_pages(address: int, length: int) -> int:
    """Moves the whole 2 MiB pages inside [address, address + length) onto huge pages, in place.

    For memory someone else allocated (an engine's KV cache): asks the kernel to back the range
    with THP from now on and to collapse what is already there (the contents stay as they are;
    unpopulated pages get populated). Best effort: returns the bytes collapsed, 0 where the kernel
    cannot (THP off, before Linux 6.1, no free huge pages).
    """
    global _libc
    start = (address + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
    end = (address + length) // HUGE_PAGE * HUGE_PAGE
    if end <= start or not thp_enabled():
        return 0
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if _libc.madvise(start, end - start, _MADV_HUGEPAGE) != 0:
        return 0
    if _libc.madvise(start, end - start, _MADV_COLLAPSE) != 0:
        logger.debug("MADV_COLLAPSE of %d bytes failed: errno %d", end - start, ctypes.get_errno())
        return 0
    return end - start
