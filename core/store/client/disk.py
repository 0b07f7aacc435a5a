"""A store holder's local disk tier: records on preallocated files, read back verified. I/O only.

The master decides what spills (not here); this module stores a record (key, token, bytes) on a
holder's disk, reads it back into registered memory checked, frees it, and rescans after a restart.
Neighbours: ``tidekv.store.allocator`` places records in a file; the store owns the memory.

File layout (``<path>/tidekv-<name>.disk``, units of 4096 bytes): a superblock page (magic, version,
a random generation, file size, ``high_water``: no record ever ended past it), then records: a
header page (magic, version, generation, its own offset, key, token, size, data crc32, header crc32)
and the data, padded. Data is written before its header and ``free`` zeroes the header before the
space is reused, so a holder killed at any point leaves a whole record or none. ``scan`` trusts
headers only (of this generation, at the offset they name) and reads no data; data crcs are checked
by ``read_into``, which also catches a header that outlived its data in a power loss (no fsync).

Thread-safety: ``write``, ``read_into`` and ``free`` may run on many threads at once (a lock per
disk guards its allocator); ``scan`` runs once, before any of them, and ``close`` after.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import mmap
import os
import secrets
import struct
import threading
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from tidekv.errors import ConfigError, DiskCorruptError, OutOfSpaceError, StoreError
from tidekv.store.allocator import OffsetAllocator, used_range
from tidekv.store.wire.protocol import DISK_BLOCK, disk_footprint

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

PAGE = DISK_BLOCK
"""Unit of every offset, length and (for O_DIRECT) memory address on disk."""
MAX_KEY_BYTES = 4000
"""Longest key a record header holds."""
FORMAT_VERSION = 1
HIGH_WATER_STEP = 64 << 20
"""``high_water`` is stored rounded up to this, so the superblock is rewritten rarely."""
BOUNCE_BYTES = 4 << 20
"""Per-thread bounce buffer: unaligned memory moves through it in pieces of this size."""
MAX_IO_BYTES = 256 << 20
"""Largest single syscall (Linux moves at most 2 GiB - 4 KiB per call)."""
SCAN_BATCH = 1 << 20

_SUPER = struct.Struct("<4sIQQQ")  # magic, version, generation, file size, high_water; then crc32
_HEAD = struct.Struct("<4sIQQH")  # magic, version, generation, offset, key length; then the key
_TAIL = struct.Struct("<QQI")  # token, data size, data crc32; then the header's crc32
_CRC = struct.Struct("<I")
_ZERO_PAGE = mmap.mmap(-1, PAGE)


@dataclass(frozen=True, slots=True)
class DiskRecord:
    """One object version on disk: what ``read_into`` needs to fetch and verify it."""

    key: bytes
    token: int
    size: int
    crc: int
    disk: int
    offset: int


def _pad(n: int) -> int:
    return (n + PAGE - 1) & ~(PAGE - 1)


def _view(address: int, size: int) -> memoryview:
    return memoryview((ctypes.c_char * size).from_address(address)).cast("B")


class DiskTier:
    """A holder's disk files. ``capacity``/``used`` count bytes on disk (headers and padding too).

    Open creates missing files. An existing file may hold records: call ``scan()`` once before
    any other I/O (until then ``write``/``read_into``/``free`` raise ``StoreError``); a tier whose
    files were all just created needs no scan.
    """

    def __init__(self, paths: list[str], size_per_path: int, name: str = "tier", io_threads: int = 4) -> None:
        """Raises:
            ConfigError: an invalid argument, a missing directory, a file of another size, a file
                another DiskTier holds, or no room to preallocate.
            StoreError: writing a new file's superblock failed."""
        size = size_per_path & ~(PAGE - 1)
        for field, value, is_valid, allowed in (
                ("paths", paths, bool(paths), "at least one directory"),
                ("size_per_path", size_per_path, size >= 2 * PAGE, f">= {2 * PAGE} bytes"),
                ("name", name, bool(name) and "/" not in name, "non-empty, without '/'"),
                ("io_threads", io_threads, io_threads >= 1, ">= 1")):
            if not is_valid:
                raise ConfigError(f"DiskTier {field} must be {allowed}, got {value!r}")
        self.name, self.paths, self.size_per_path = name, list(paths), size
        self.files = [os.path.join(p, f"tidekv-{name}.disk") for p in self.paths]
        self.direct: list[bool] = []
        self.capacity = (size - PAGE) * len(paths)
        self._fds: list[int] = []
        self._locks = [threading.Lock() for _ in paths]
        self._allocs = [OffsetAllocator(size - PAGE) for _ in paths]
        self._live: list[dict[int, int]] = [{} for _ in paths]  # offset -> token of each record
        self._generation = [0] * len(paths)
        self._high_water = [PAGE] * len(paths)
        self._tls = threading.local()
        self._is_closed = False
        try:
            is_new = [self._open(i) for i in range(len(paths))]
        except BaseException:
            self.close()
            raise
        self._is_scanned = all(is_new)
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix=f"tidekv-disk-{name}")
        logger.info("disk tier %s: %d file(s) of %d bytes: %s", name, len(paths), size, ", ".join(self.files))

    @property
    def used(self) -> int:
        return sum(a.used for a in self._allocs)

    @staticmethod
    def footprint(size: int) -> int:
        """Bytes a record of ``size`` data bytes occupies on disk: its header page and padded data."""
        return disk_footprint(size)

    @property
    def ids(self) -> list[str]:
        """Each disk's name in the pool: from its file's random generation, so the same file is
        the same disk after a restart (and a file made anew is not)."""
        return [f"disk-{g:016x}" for g in self._generation]

    @property
    def capacities(self) -> list[int]:
        """Bytes of records each disk can hold (its file less the superblock)."""
        return [self.size_per_path - PAGE] * len(self.paths)

    def _open(self, disk: int) -> bool:
        """Opens (creating and preallocating if needed) one disk's file; True when it is new."""
        path, file = self.paths[disk], self.files[disk]
        if not os.path.isdir(path):
            raise ConfigError(f"disk tier {self.name}: directory {path!r} does not exist; create it first")
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)
        try:
            try:
                fd = os.open(file, flags | os.O_DIRECT, 0o600)
                self.direct.append(True)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                fd = os.open(file, flags, 0o600)
                self.direct.append(False)
                logger.info("disk tier %s: %s refuses O_DIRECT; buffered I/O is used there", self.name, path)
        except OSError as exc:
            raise ConfigError(f"disk tier {self.name}: cannot open {file}: {exc}") from exc
        self._fds.append(fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(f"disk tier {self.name}: {file} is in use by another DiskTier (this process "
                              f"or another); give each a distinct path or name") from None
        found = os.fstat(fd).st_size
        if found not in (0, self.size_per_path):
            raise ConfigError(f"disk tier {self.name}: {file} holds {found} bytes, not the {self.size_per_path} "
                              f"configured; set size_per_path to {found}, or remove the file to drop its cache")
        if found:
            return False
        try:
            os.posix_fallocate(fd, 0, self.size_per_path)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL):
                os.unlink(file)
                raise ConfigError(f"disk tier {self.name}: cannot preallocate {self.size_per_path} bytes "
                                  f"for {file}: {exc}") from exc
            os.ftruncate(fd, self.size_per_path)  # no fallocate here: a sparse file, filled as used
        self._generation[disk] = secrets.randbits(64)
        self._write_superblock(disk, PAGE)
        return True

    def _write_superblock(self, disk: int, high_water: int) -> None:
        page = self._buffers()[0]
        fields = _SUPER.pack(b"TKVS", FORMAT_VERSION, self._generation[disk], self.size_per_path, high_water)
        page[:] = _ZERO_PAGE
        page[:_SUPER.size + 4] = fields + _CRC.pack(zlib.crc32(fields))
        self._syscall(disk, [page], 0, is_write=True)
        self._high_water[disk] = high_water

    def _read_superblock(self, disk: int) -> int | None:
        """Sets the disk's generation and returns its high_water; None when the superblock is invalid."""
        page = self._buffers()[0]
        self._syscall(disk, [page], 0, is_write=False)
        magic, version, generation, size, high_water = _SUPER.unpack_from(page)
        if magic == b"TKVS" and version != FORMAT_VERSION:
            raise ConfigError(f"disk tier {self.name}: {self.files[disk]} has format version {version}, this "
                              f"tidekv reads {FORMAT_VERSION}; use a matching tidekv or remove the file")
        (crc,) = _CRC.unpack_from(page, _SUPER.size)
        if (magic != b"TKVS" or crc != zlib.crc32(page[:_SUPER.size]) or size != self.size_per_path
                or not PAGE <= high_water <= size):
            return None
        self._generation[disk] = generation
        return int(high_water)

    def scan(self) -> list[DiskRecord]:
        """Finds the records on every disk (headers only: data crcs are checked by ``read_into``)
        and rebuilds the allocators from them. Call once, before any other I/O.

        Returns:
            The records, by disk and offset.
        Raises:
            StoreError: reading a file failed. ConfigError: a file of a newer format version.
        """
        self._check_open()
        records: list[DiskRecord] = []
        for disk in range(len(self.paths)):
            found = self._scan_disk(disk)
            self._allocs[disk] = OffsetAllocator.with_used(
                self.size_per_path - PAGE, [used_range(r.offset - PAGE, self.footprint(r.size)) for r in found])
            self._live[disk] = {r.offset: r.token for r in found}
            records += found
            logger.info("disk tier %s: %s holds %d records (%d bytes)", self.name, self.files[disk], len(found),
                        self._allocs[disk].used)
        self._is_scanned = True
        return records

    def _scan_disk(self, disk: int) -> list[DiskRecord]:
        high_water = self._read_superblock(disk)
        if high_water is None:
            logger.warning("disk tier %s: %s has no valid superblock; treating it as empty", self.name,
                           self.files[disk])
            self._generation[disk] = secrets.randbits(64)  # old headers carry the old one: never resurrected
            self._write_superblock(disk, PAGE)
            return []
        batch = mmap.mmap(-1, SCAN_BATCH)
        view = memoryview(batch)
        records: list[DiskRecord] = []
        pos = PAGE
        while pos < high_water:
            n = min(SCAN_BATCH, high_water - pos)
            self._syscall(disk, [view[:n]], pos, is_write=False)
            i = 0
            while i < n:  # free space is mostly zeros: find() skips it without a Python loop
                i = batch.find(b"TKVR", i, n)
                if i < 0:
                    i = n
                elif i % PAGE:
                    i = _pad(i)
                elif (record := self._parse_header(disk, view[i:i + PAGE], pos + i)) is None:
                    i += PAGE
                else:
                    records.append(record)
                    i += self.footprint(record.size)
            pos += i
        view.release()
        batch.close()
        if records:
            self._raise_high_water(disk, records[-1].offset + self.footprint(records[-1].size))
        return records

    def _parse_header(self, disk: int, page: memoryview, offset: int) -> DiskRecord | None:
        """The record whose header ``page`` (read at ``offset``) is, or None if it is not a valid one."""
        magic, version, generation, at, key_len = _HEAD.unpack_from(page)
        if magic != b"TKVR" or version != FORMAT_VERSION or key_len > MAX_KEY_BYTES:
            return None
        end = _HEAD.size + key_len + _TAIL.size
        token, size, crc = _TAIL.unpack_from(page, _HEAD.size + key_len)
        (header_crc,) = _CRC.unpack_from(page, end)
        if (header_crc != zlib.crc32(page[:end]) or generation != self._generation[disk] or at != offset
                or offset + self.footprint(size) > self.size_per_path):
            return None
        return DiskRecord(bytes(page[_HEAD.size:_HEAD.size + key_len]), token, size, crc, disk, offset)

    def write(self, key: bytes, token: int, address: int, size: int, disk: int | None = None) -> DiskRecord:
        """Stores ``size`` bytes at ``address`` as a record of ``key`` version ``token``.

        Args:
            disk: the disk to use; None picks the one with the most free bytes that fits.
        Raises:
            ConfigError: key longer than MAX_KEY_BYTES, token outside u64, size < 0, address 0, bad disk.
            OutOfSpaceError: no disk (or not the one named) has a free range this large.
            StoreError: the write failed (its space is reclaimed, no header left), or no scan yet.
        """
        self._check_ready()
        if len(key) > MAX_KEY_BYTES or not 0 <= token < 1 << 64 or size < 0 or (size and not address):
            raise ConfigError(f"disk tier {self.name}: a record needs a key of <= {MAX_KEY_BYTES} bytes, a u64 token, "
                              f"size >= 0 and an address; got {len(key)}-byte key {key[:64]!r}, token {token}, "
                              f"size {size}, address {address:#x}")
        disk, offset = self._allocate(key, self.footprint(size), disk)
        try:
            crc = self._move(disk, offset, address, size, header=None, is_write=True)
        except BaseException:
            self._release(disk, offset, size)
            raise
        header = self._buffers()[0]
        header[:] = _ZERO_PAGE
        fields = (_HEAD.pack(b"TKVR", FORMAT_VERSION, self._generation[disk], offset, len(key)) + key
                  + _TAIL.pack(token, size, crc))
        header[:len(fields) + 4] = fields + _CRC.pack(zlib.crc32(fields))
        try:
            self._syscall(disk, [header], offset, is_write=True)
        except StoreError:
            self._discard(disk, offset, size)
            raise
        with self._locks[disk]:
            self._live[disk][offset] = token
        return DiskRecord(key, token, size, crc, disk, offset)

    def write_many(self, items: list[tuple[Any, ...]]) -> list[DiskRecord | BaseException]:
        """``write`` of each (key, token, address, size[, disk]), several in flight on the I/O threads.
        Returns, per item in order, its record or the exception its write raised."""
        return list(self._pool.map(lambda item: _outcome(self.write, *item), items))

    def read_into(self, record: DiskRecord, address: int) -> None:
        """Reads ``record``'s data into ``record.size`` bytes at ``address``, verified.

        Raises:
            DiskCorruptError: the header does not name this record, or the data fails its crc32;
                the bytes at ``address`` are then undefined (treat the read as a miss).
            StoreError: the read failed, or no scan yet.
        """
        self._check_ready()
        header = self._buffers()[0]
        crc = self._move(record.disk, record.offset, address, record.size, header=header, is_write=False)
        found = self._parse_header(record.disk, header, record.offset)
        where = (f"disk tier {self.name}: record of key {record.key[:64]!r} token {record.token} at "
                 f"{self.files[record.disk]}:{record.offset}")
        if found is None or (found.key, found.token, found.size) != (record.key, record.token, record.size):
            named = "no valid header" if found is None else f"key {found.key[:64]!r} token {found.token}"
            raise DiskCorruptError(f"{where}: the disk holds {named} there; free it and treat the object as "
                                   f"missing", key=record.key)
        if not crc == found.crc == record.crc:
            raise DiskCorruptError(f"{where}: data crc32 {crc:#010x}, expected {record.crc:#010x}; free it and "
                                   f"treat the object as missing", key=record.key)

    def read_many(self, items: list[tuple[DiskRecord, int]]) -> list[BaseException | None]:
        """``read_into`` of each (record, address), several in flight on the I/O threads.
        Returns, per item in order, None or the exception its read raised."""
        return list(self._pool.map(lambda item: _outcome(self.read_into, *item), items))

    def free(self, record: DiskRecord) -> None:
        """Erases ``record`` (its header first, so a rescan never finds it) and frees its space.

        Raises:
            StoreError: the record is not live (freed already, or never written), or erasing failed
                (its space then stays taken until the next scan, so it is never overwritten early).
        """
        self._check_ready()
        with self._locks[record.disk]:
            if self._live[record.disk].get(record.offset) != record.token:
                raise StoreError(f"disk tier {self.name}: free of a record that is not live: key "
                                 f"{record.key[:64]!r} token {record.token} at {record.offset}", key=record.key)
            del self._live[record.disk][record.offset]
        self._discard(record.disk, record.offset, record.size)

    def close(self) -> None:
        """Waits for I/O in flight and closes the files. Idempotent."""
        if self._is_closed:
            return
        self._is_closed = True
        if hasattr(self, "_pool"):
            self._pool.shutdown(wait=True)
        for fd in self._fds:
            os.close(fd)

    def __enter__(self) -> DiskTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._is_closed:
            raise StoreError(f"disk tier {self.name} is closed; open a new DiskTier")

    def _check_ready(self) -> None:
        self._check_open()
        if not self._is_scanned:
            raise StoreError(f"disk tier {self.name}: {', '.join(self.files)} may hold records: call scan() "
                             f"before any other I/O")

    def _allocate(self, key: bytes, need: int, disk: int | None) -> tuple[int, int]:
        """Takes ``need`` bytes on ``disk`` (or the freest disk that fits); raises the high water
        mark first when the record ends past it, so a rescan covers the record."""
        if disk is not None and not 0 <= disk < len(self.paths):
            raise ConfigError(f"disk tier {self.name}: disk {disk} is not in [0, {len(self.paths)})")
        candidates = [disk] if disk is not None else sorted(range(len(self.paths)), key=lambda d: -self._allocs[d].free)
        for d in candidates:
            with self._locks[d]:
                at = self._allocs[d].allocate(need)
                if at is None:
                    continue
                try:
                    self._raise_high_water(d, at + PAGE + need)
                except BaseException:
                    self._allocs[d].release(at, need)
                    raise
                return d, at + PAGE
        free = ", ".join(f"{self.paths[d]}: {self._allocs[d].free} free" for d in candidates)
        raise OutOfSpaceError(f"disk tier {self.name}: no room for a {need}-byte record ({free}); free records "
                              f"or add disk space", key=key)

    def _raise_high_water(self, disk: int, end: int) -> None:
        if end > self._high_water[disk]:
            self._write_superblock(disk, min(self.size_per_path, -(-end // HIGH_WATER_STEP) * HIGH_WATER_STEP))

    def _release(self, disk: int, offset: int, size: int) -> None:
        with self._locks[disk]:
            self._allocs[disk].release(offset - PAGE, self.footprint(size))

    def _discard(self, disk: int, offset: int, size: int) -> None:
        """Zeroes a header, then frees its record's space; if zeroing fails the space stays taken:
        a valid header over reused space would resurrect a record over newer ones at a rescan."""
        self._syscall(disk, [memoryview(_ZERO_PAGE)], offset, is_write=True)
        self._release(disk, offset, size)

    def _buffers(self) -> tuple[memoryview, memoryview]:
        """This thread's page-aligned header page and bounce buffer."""
        tls = self._tls
        if not hasattr(tls, "header"):
            tls.header, tls.bounce = memoryview(mmap.mmap(-1, PAGE)), memoryview(mmap.mmap(-1, BOUNCE_BYTES))
        return tls.header, tls.bounce

    def _move(self, disk: int, offset: int, address: int, size: int, header: memoryview | None,
              is_write: bool) -> int:
        """Writes or reads a record's data (and, reading, its ``header`` page in the same first
        call); returns the data's crc32. Page-aligned memory moves directly, the rest and the
        tail past the last full page through the bounce buffer."""
        user = _view(address, size) if size else memoryview(b"")
        bounce = self._buffers()[1]
        direct = size & ~(PAGE - 1) if address % PAGE == 0 else 0
        steps = [(s, min(MAX_IO_BYTES, direct - s), False) for s in range(0, direct, MAX_IO_BYTES)]
        steps += [(s, min(BOUNCE_BYTES, size - s), True) for s in range(direct, size, BOUNCE_BYTES)]
        calls: list[list[tuple[int, int, bool]]] = [[]]  # (data offset, length, via bounce) per syscall
        for step in steps:  # the bounce is reused by the next call, so it ends one
            if calls[-1] and (calls[-1][-1][2] or sum(n for _, n, _ in calls[-1]) >= MAX_IO_BYTES):
                calls.append([])
            calls[-1].append(step)
        crc, at = 0, offset if header is not None else offset + PAGE
        for call in calls:
            if is_write:
                for s, n, via_bounce in call:
                    crc = zlib.crc32(user[s:s + n], crc)
                    if via_bounce:
                        bounce[:n] = user[s:s + n]
                        bounce[n:_pad(n)] = _ZERO_PAGE[:_pad(n) - n]
            iovs = [header] if header is not None else []
            iovs += [bounce[:_pad(n)] if via_bounce else user[s:s + n] for s, n, via_bounce in call]
            if iovs:
                at += self._syscall(disk, iovs, at, is_write)
            if not is_write:
                for s, n, via_bounce in call:
                    if via_bounce:
                        user[s:s + n] = bounce[:n]
                    crc = zlib.crc32(user[s:s + n], crc)
            header = None
        return crc

    def _syscall(self, disk: int, iovs: list[memoryview], at: int, is_write: bool) -> int:
        """One pwritev/preadv of all of ``iovs`` at ``at``; returns the byte count."""
        self._check_open()
        want = sum(len(v) for v in iovs)
        try:
            done = os.pwritev(self._fds[disk], iovs, at) if is_write else os.preadv(self._fds[disk], iovs, at)
        except OSError as exc:
            raise StoreError(f"disk tier {self.name}: {'write' if is_write else 'read'} of {want} bytes at "
                             f"{self.files[disk]}:{at} failed: {exc}") from exc
        if done != want:
            raise StoreError(f"disk tier {self.name}: {'write' if is_write else 'read'} of {want} bytes at "
                             f"{self.files[disk]}:{at} moved only {done}")
        return done


def _outcome(fn: Callable[..., _T], *args: Any) -> _T | BaseException:
    try:
        return fn(*args)
    except Exception as exc:
        return exc


def raw_direct_bandwidth(directory: str, total: int, chunk: int, threads: int = 4) -> tuple[float, float]:
    """Plain O_DIRECT pwrite then pread of ``chunk``-byte blocks of a ``total``-byte scratch file
    in ``directory`` (buffered where O_DIRECT is refused), ``threads`` in flight; the file is
    removed after. A baseline for benchmarks of the tier, not used by it.

    Returns:
        (write bytes/s, read bytes/s).
    Raises:
        ConfigError: chunk not a positive multiple of 4096, or total < chunk.
    """
    if chunk <= 0 or chunk % PAGE or total < chunk or threads < 1:
        raise ConfigError(f"raw_direct_bandwidth needs chunk a positive multiple of {PAGE}, total >= chunk and "
                          f"threads >= 1; got chunk={chunk}, total={total}, threads={threads}")
    blocks = total // chunk
    path = os.path.join(directory, f"tidekv-bandwidth-{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    buffers = [mmap.mmap(-1, chunk) for _ in range(threads)]
    for i, buf in enumerate(buffers):
        buf.write(bytes([i + 1]) * chunk)  # not zeros: no device may shortcut them

    def stripe(t: int, is_write: bool) -> None:
        for b in range(t, blocks, threads):
            done = os.pwritev(fd, [buffers[t]], b * chunk) if is_write else os.preadv(fd, [buffers[t]], b * chunk)
            if done != chunk:
                raise OSError(f"moved {done} of {chunk} bytes at {b * chunk} of {path}")

    def rate(is_write: bool) -> float:
        start = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(stripe, range(threads), [is_write] * threads))
        return blocks * chunk / (time.perf_counter() - start)

    try:
        try:
            os.posix_fallocate(fd, 0, blocks * chunk)  # as the tier's files are: writes allocate no blocks
        except OSError:
            os.ftruncate(fd, blocks * chunk)
        return rate(True), rate(False)
    finally:
        os.close(fd)
        os.unlink(path)
        for buf in buffers:
            buf.close()
