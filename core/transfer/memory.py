"""Huge pages for transfer memory: whether memory that other processes read should be on them.

On some VMs memory in 4 KiB pages that sat idle for a second or two reads 3-4x slower the first
time it is touched again; memory on transparent huge pages (THP) does not. A store segment is
exactly such memory: written once, read whenever someone asks. Neighbours:
``TransferEngine.allocate(huge=True)`` allocates on huge pages; the store decides with this.
"""

from __future__ import annotations

import ctypes
import os

HUGE_PAGE = 2 << 20


def thp_enabled() -> bool:
    """Whether transparent huge pages can back anonymous memory here (``enabled`` is not never)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def huge_pages_shareable() -> bool:
    """Whether ``allocate(huge=True)`` memory is a good choice for memory other processes read.

    True where THP can back anonymous memory, ``process_vm_readv`` is allowed (no seccomp profile
    forbids it) and processes of one user may attach to each other's memory (no Yama, or
    ptrace_scope 0); otherwise same-host peers could not reach it without tcp.
    """
    if not thp_enabled() or not _cross_memory_attach_allowed():
        return False
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            return f.read().strip() == "0"
    except OSError:
        return True  # no Yama: same-uid processes may attach


def _cross_memory_attach_allowed() -> bool:
    """Whether process_vm_readv works at all here (a seccomp profile may forbid the syscall)."""
    libc = ctypes.CDLL(None, use_errno=True)
    src, dst = ctypes.create_string_buffer(b"tidekv", 8), ctypes.create_string_buffer(8)
    local, remote = _IoVec(ctypes.addressof(dst), 8), _IoVec(ctypes.addressof(src), 8)
    n = libc.process_vm_readv(os.getpid(), ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    return n == 8 and dst.raw == src.raw


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("length", ctypes.c_size_t)]
