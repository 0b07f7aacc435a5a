"""Raw O_DIRECT I/O through io_uring, for the disk-tier bench: the other way to keep I/Os in
flight, measured in the same run as the thread pool the disk tier uses
(``store.client.disk.raw_direct_bandwidth``), so that the choice between them rests on numbers.

Talks to the kernel directly (``io_uring_setup``/``io_uring_enter`` and the shared rings): no
liburing, no dependency. Linux x86-64 only; ``available()`` says whether this kernel (and its
seccomp profile) allows io_uring here.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import struct
import tempfile
import time

_SETUP, _ENTER = 425, 426  # x86-64 syscall numbers
_OFF_SQ_RING, _OFF_CQ_RING, _OFF_SQES = 0, 0x8000000, 0x10000000
_OP_READ, _OP_WRITE = 22, 23
_ENTER_GETEVENTS = 1
# io_uring_params: 10 u32 (sq_entries .. resv[3]), io_sqring_offsets (7 u32, resv1 u32, user_addr
# u64), io_cqring_offsets (8 u32, user_addr u64): 120 bytes.
_PARAMS_SIZE = 120
_SQE = struct.Struct("<BBHiQQIIQ24x")  # opcode, flags, ioprio, fd, off, addr, len, rw_flags, user_data
_CQE = struct.Struct("<QiI")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _syscall(*args: int) -> int:
    ret = _libc.syscall(*[ctypes.c_long(a) for a in args])
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return int(ret)


class Ring:
    """One io_uring of ``depth`` entries: submit reads and writes, wait for their completions."""

    def __init__(self, depth: int) -> None:
        params = (ctypes.c_char * _PARAMS_SIZE)()
        self.fd = _syscall(_SETUP, depth, ctypes.addressof(params))
        raw = bytes(params)
        u32 = struct.unpack_from("<10I", raw, 0)
        sq_entries, cq_entries = u32[0], u32[1]
        sq_off = struct.unpack_from("<7I", raw, 40)  # head, tail, ring_mask, ring_entries, flags, dropped, array
        cq_off = struct.unpack_from("<7I", raw, 80)  # head, tail, ring_mask, ring_entries, overflow, cqes, flags
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        prot = mmap.PROT_READ | mmap.PROT_WRITE
        self._sq = mmap.mmap(self.fd, sq_off[6] + sq_entries * 4, flags, prot, offset=_OFF_SQ_RING)
        self._cq = mmap.mmap(self.fd, cq_off[5] + cq_entries * _CQE.size, flags, prot, offset=_OFF_CQ_RING)
        self._sqes = mmap.mmap(self.fd, sq_entries * _SQE.size, flags, prot, offset=_OFF_SQES)
        self._sq_head, self._sq_tail, self._sq_array = sq_off[0], sq_off[1], sq_off[6]
        self._cq_head, self._cq_tail, self._cqes = cq_off[0], cq_off[1], cq_off[5]
        self._sq_mask, self._cq_mask = self._u32(self._sq, sq_off[2]), self._u32(self._cq, cq_off[2])
        self.depth = sq_entries

    def _u32(self, ring: mmap.mmap, at: int) -> int:
        return int(struct.unpack_from("<I", ring, at)[0])

    def submit(self, ops: list[tuple[int, int, int, int, int, int]]) -> None:
        """Queues (opcode, fd, offset, address, length, user data) each, and enters."""
        tail = self._u32(self._sq, self._sq_tail)
        for i, (op, fd, off, addr, length, tag) in enumerate(ops):
            index = (tail + i) & self._sq_mask
            _SQE.pack_into(self._sqes, index * _SQE.size, op, 0, 0, fd, off, addr, length, 0, tag)
            struct.pack_into("<I", self._sq, self._sq_array + index * 4, index)
        struct.pack_into("<I", self._sq, self._sq_tail, (tail + len(ops)) & 0xFFFFFFFF)
        _syscall(_ENTER, self.fd, len(ops), 0, 0, 0, 0)

    def wait(self, n: int) -> list[tuple[int, int]]:
        """Waits for at least ``n`` completions; returns (user data, result: bytes moved or -errno) each."""
        out: list[tuple[int, int]] = []
        while len(out) < n:
            head, tail = self._u32(self._cq, self._cq_head), self._u32(self._cq, self._cq_tail)
            if head == tail:
                _syscall(_ENTER, self.fd, 0, 1, _ENTER_GETEVENTS, 0, 0)
                continue
            while head != tail:
                tag, res, _ = _CQE.unpack_from(self._cq, self._cqes + (head & self._cq_mask) * _CQE.size)
                out.append((tag, res))
                head = (head + 1) & 0xFFFFFFFF
            struct.pack_into("<I", self._cq, self._cq_head, head)
        return out

    def close(self) -> None:
        for ring in (self._sq, self._cq, self._sqes):
            ring.close()
        os.close(self.fd)


def available() -> str:
    """"" when io_uring works here, else why not."""
    try:
        Ring(2).close()
    except OSError as exc:
        return f"io_uring_setup failed: {exc.strerror}"
    return ""


def raw_uring_bandwidth(directory: str, total: int, chunk: int, depth: int = 4) -> tuple[float, float]:
    """(write, read) bytes/s of O_DIRECT writes and reads of ``chunk``-byte blocks of a scratch
    file of ``total`` bytes in ``directory``, ``depth`` in flight through one io_uring."""
    fd_path = tempfile.mkstemp(prefix="tidekv-uring-", dir=directory)
    os.close(fd_path[0])
    fd = os.open(fd_path[1], os.O_RDWR | os.O_DIRECT)
    ring = Ring(depth)
    buffers = [mmap.mmap(-1, chunk) for _ in range(depth)]
    addresses = [ctypes.addressof(ctypes.c_char.from_buffer(b)) for b in buffers]
    try:
        for b in buffers:
            b.write(os.urandom(min(chunk, 1 << 16)) * (chunk // min(chunk, 1 << 16)))
        os.posix_fallocate(fd, 0, total)
        blocks = total // chunk

        def run(op: int) -> float:
            """Keeps ``depth`` I/Os in flight: each completion's buffer takes the next block."""
            started = time.perf_counter()
            first = min(depth, blocks)
            ring.submit([(op, fd, i * chunk, addresses[i], chunk, i) for i in range(first)])
            issued, done = first, 0
            while done < blocks:
                again = []
                for slot, res in ring.wait(1):
                    if res != chunk:
                        raise OSError(f"an io_uring {'write' if op == _OP_WRITE else 'read'} returned {res}")
                    done += 1
                    if issued < blocks:
                        again.append((op, fd, issued * chunk, addresses[slot], chunk, slot))
                        issued += 1
                if again:
                    ring.submit(again)
            return blocks * chunk / (time.perf_counter() - started)

        write = run(_OP_WRITE)
        os.fsync(fd)
        return write, run(_OP_READ)
    finally:
        ring.close()
        os.close(fd)
        os.unlink(fd_path[1])
        for b in buffers:
            try:
                b.close()
            except BufferError:
                pass
