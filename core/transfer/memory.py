"""Huge pages for transfer memory: whether memory that other processes read should be on them.

On some VMs memory in 4 KiB pages that sat idle for a second or two reads 3-4x slower the first
time it is touched again; memory on transparent huge pages (THP) does not. A store segment is
exactly such memory: written once, read whenever someone asks. Neighbours:
``TransferEngine.allocate(huge=True)`` allocates on huge pages; the store decides with this, and
``transports`` (what ``tidekv doctor`` prints) reports the same host facts.
"""

from __future__ import annotations

import ctypes
import os

HUGE_PAGE = 2 << 20
THP_ENABLED_PATH = "/sys/kernel/mm/transparent_hugepage/enabled"
YAMA_PTRACE_SCOPE_PATH = "/proc/sys/kernel/yama/ptrace_scope"


def thp_mode() -> str | None:
    """The selected value of THP's ``enabled`` ("always", "madvise", "never"); None without THP."""
    try:
        with open(THP_ENABLED_PATH) as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def thp_enabled() -> bool:
    """Whether transparent huge pages can back anonymous memory here (``enabled`` is not never)."""
    return thp_mode() not in (None, "never")


def yama_ptrace_scope() -> int | None:
    """Yama's ptrace_scope (0 classic, 1 restricted, 2 admin-only, 3 none); None without Yama."""
    try:
        with open(YAMA_PTRACE_SCOPE_PATH) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def huge_pages_shareable() -> bool:
    """Whether ``allocate(huge=True)`` memory is a good choice for memory other processes read.

    True where THP can back anonymous memory, ``process_vm_readv`` is allowed (no seccomp profile
    forbids it) and processes of one user may attach to each other's memory (no Yama, or
    ptrace_scope 0); otherwise same-host peers could not reach it without tcp.
    """
    if not thp_enabled() or not cross_memory_attach_allowed():
        return False
    return yama_ptrace_scope() in (None, 0)  # no Yama: same-uid processes may attach


def cross_memory_attach_allowed() -> bool:
    """Whether process_vm_readv works at all here (a seccomp profile may forbid the syscall)."""
    libc = ctypes.CDLL(None, use_errno=True)
    src, dst = ctypes.create_string_buffer(b"tidekv", 8), ctypes.create_string_buffer(8)
    local, remote = _IoVec(ctypes.addressof(dst), 8), _IoVec(ctypes.addressof(src), 8)
    n = libc.process_vm_readv(os.getpid(), ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    return n == 8 and dst.raw == src.raw


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("length", ctypes.c_size_t)]


_MADV_HUGEPAGE = 14
_libc = ctypes.CDLL(None, use_errno=True)


def advise_huge(address: int, length: int) -> None:
    """Asks for huge pages under the 2 MiB-aligned interior of fresh memory, before its first
    touch: a 64 MiB buffer then takes 32 page faults where it took 16,384 (first-touch time of a
    new 64 MiB read buffer: ~15 ms -> ~4 ms on this project's VM). Advisory: ignored without THP."""
    start = -(-address // HUGE_PAGE) * HUGE_PAGE
    end = (address + length) // HUGE_PAGE * HUGE_PAGE
    if end > start:
        _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_HUGEPAGE)
