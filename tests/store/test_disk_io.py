"""DiskTier I/O: bytes in, same bytes out (aligned and unaligned memory), across a reopen and
rescan; freed and torn records never come back; corruption and identity mismatches are caught;
space accounting over one and two disks. Real files under tmp_path (and /dev/shm)."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import random
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from tidekv.errors import ConfigError, DiskCorruptError, OutOfSpaceError, StoreError
from tidekv.store.client import disk as disk_module
from tidekv.store.client.disk import PAGE, DiskRecord, DiskTier, raw_direct_bandwidth

MiB = 1 << 20
SIZES = [1, 4095, 4096, 4097, 256 << 10, 2 * MiB + 13]


class Memory:
    """``size`` bytes at a known address: page-aligned (an mmap) or deliberately not (a ctypes
    buffer at an odd offset), like registered transfer memory."""

    def __init__(self, size: int, is_aligned: bool) -> None:
        if is_aligned:
            self._mm = mmap.mmap(-1, max(size, 1))
            self.address = ctypes.addressof(ctypes.c_char.from_buffer(self._mm))
        else:
            self._buf = ctypes.create_string_buffer(size + PAGE + 8)
            base = ctypes.addressof(self._buf)
            self.address = base + (PAGE - base % PAGE) + 3  # 3 past a page boundary: never aligned
        self.view = memoryview((ctypes.c_char * max(size, 1)).from_address(self.address)).cast("B")[:size]

    def fill(self, data: bytes) -> Memory:
        self.view[:] = data
        return self


def _data(size: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(size)


def _put(tier: DiskTier, key: bytes, token: int, data: bytes, is_aligned: bool = True) -> DiskRecord:
    src = Memory(len(data), is_aligned).fill(data)  # alive until the write returns
    return tier.write(key, token, src.address, len(data))


def _get(tier: DiskTier, record: DiskRecord, is_aligned: bool = False) -> bytes:
    dst = Memory(record.size, is_aligned)
    tier.read_into(record, dst.address)
    return bytes(dst.view)


@pytest.fixture
def tier(tmp_path: Path) -> Iterator[DiskTier]:
    with DiskTier([str(tmp_path)], 16 * MiB, io_threads=4) as t:
        yield t


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("src_aligned,dst_aligned", [(True, True), (False, False), (True, False), (False, True)])
def test_round_trip_byte_for_byte(tier: DiskTier, size: int, src_aligned: bool, dst_aligned: bool) -> None:
    data = _data(size, size)
    src = Memory(size, src_aligned).fill(data)
    record = tier.write(b"key-%d" % size, 7, src.address, size)
    assert record.offset % PAGE == 0 and record.size == size and tier.used == DiskTier.footprint(size)
    dst = Memory(size, dst_aligned)
    tier.read_into(record, dst.address)
    assert bytes(dst.view) == data


def test_empty_record_round_trips(tier: DiskTier) -> None:
    record = tier.write(b"empty", 0, 0, 0)
    tier.read_into(record, 0)
    assert DiskTier.footprint(0) == PAGE and tier.used == PAGE


def test_survives_reopen_and_scan(tmp_path: Path) -> None:
    datas = {b"k%d" % i: _data(s, i) for i, s in enumerate(SIZES)}
    with DiskTier([str(tmp_path)], 16 * MiB) as tier:
        written = [_put(tier, k, i, d) for i, (k, d) in enumerate(datas.items())]
        used = tier.used
    with DiskTier([str(tmp_path)], 16 * MiB) as tier:
        with pytest.raises(StoreError, match="call scan"):
            tier.write(b"x", 1, 0, 0)
        found = tier.scan()
        assert sorted(found, key=lambda r: r.offset) == sorted(written, key=lambda r: r.offset)
        assert tier.used == used
        for record in found:
            assert _get(tier, record) == datas[record.key]


def test_freed_record_stays_gone_and_its_space_is_reused(tmp_path: Path) -> None:
    data = _data(100_000)
    with DiskTier([str(tmp_path)], 16 * MiB) as tier:
        keep = _put(tier, b"keep", 1, b"0123456789")
        gone = _put(tier, b"gone", 2, data)
        tier.free(gone)
        with pytest.raises(StoreError, match="not live"):
            tier.free(gone)
        assert tier.used == DiskTier.footprint(10)
        again = _put(tier, b"again", 3, data)
        assert again.offset == gone.offset
        tier.free(again)
    with DiskTier([str(tmp_path)], 16 * MiB) as tier:
        assert tier.scan() == [keep]


def test_torn_write_is_not_seen_and_its_space_is_free(tmp_path: Path) -> None:
    """A holder killed between a record's data and its header: only the data reached the file."""
    data = _data(3 * PAGE)
    with DiskTier([str(tmp_path)], 16 * MiB) as tier:
        kept = _put(tier, b"kept", 1, b"hello")
        disk, offset = tier._allocate(b"torn", DiskTier.footprint(len(data)), None)
        src = Memory(len(data), True).fill(data)
        tier._move(disk, offset, src.address, len(data), header=None, is_write=True)
    with DiskTier([str(tmp_path)], 16 * MiB) as tier:
        assert tier.scan() == [kept]
        assert tier.used == DiskTier.footprint(5)
        assert tier.write(b"next", 2, 0, 0).offset == offset


def _flip_byte(file: str, at: int) -> None:
    fd = os.open(file, os.O_RDWR)
    try:
        os.pwrite(fd, bytes([os.pread(fd, 1, at)[0] ^ 0xFF]), at)
    finally:
        os.close(fd)


def test_corrupt_data_byte_is_caught(tier: DiskTier) -> None:
    data = _data(10_000)
    record = _put(tier, b"k", 1, data)
    _flip_byte(tier.files[0], record.offset + PAGE + 9_999)
    with pytest.raises(DiskCorruptError, match="crc32") as info:
        _get(tier, record)
    assert info.value.key == b"k"


def test_corrupt_header_or_wrong_identity_is_caught(tier: DiskTier) -> None:
    record = _put(tier, b"k", 5, _data(64))
    dst = Memory(64, True)
    for wrong in (DiskRecord(b"other", 5, 64, record.crc, 0, record.offset),
                  DiskRecord(b"k", 6, 64, record.crc, 0, record.offset),
                  DiskRecord(b"k", 5, 64, record.crc ^ 1, 0, record.offset)):
        with pytest.raises(DiskCorruptError):
            tier.read_into(wrong, dst.address)
    _flip_byte(tier.files[0], record.offset + 40)  # inside the header (its token)
    with pytest.raises(DiskCorruptError, match="no valid header"):
        tier.read_into(record, dst.address)


def test_full_disk_raises_out_of_space(tmp_path: Path) -> None:
    with DiskTier([str(tmp_path)], 1 * MiB) as tier:
        assert tier.capacity == MiB - PAGE
        src = Memory(100_000, True)
        records = []
        with pytest.raises(OutOfSpaceError, match=re.escape(str(tmp_path))):
            for i in range(100):
                records.append(tier.write(b"k%d" % i, i, src.address, 100_000))
        assert len(records) == tier.capacity // DiskTier.footprint(100_000)
        tier.free(records[0])
        tier.write(b"fits", 0, src.address, 100_000)


def test_two_disks_fill_together_and_read_back(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with DiskTier([str(tmp_path / "a"), str(tmp_path / "b")], 8 * MiB, io_threads=4) as tier:
        datas = [_data(300_000, i) for i in range(16)]
        srcs = [Memory(len(d), i % 2 == 0).fill(d) for i, d in enumerate(datas)]
        records: list[DiskRecord | BaseException] = [tier.write(b"k%d" % i, i, srcs[i].address, len(datas[i]))
                                                      for i in range(8)]
        assert sorted(r.disk for r in records if isinstance(r, DiskRecord)) == [0] * 4 + [1] * 4
        records += tier.write_many([(b"k%d" % i, i, srcs[i].address, len(datas[i])) for i in range(8, 16)])
        assert all(isinstance(r, DiskRecord) for r in records)
        assert {r.disk for r in records[8:] if isinstance(r, DiskRecord)} == {0, 1}
        dsts = [Memory(len(d), i % 3 == 0) for i, d in enumerate(datas)]
        assert tier.read_many([(r, m.address) for r, m in zip(records, dsts)]) == [None] * 16  # type: ignore[misc]
        assert [bytes(m.view) for m in dsts] == datas
        too_big = tier.write_many([(b"huge", 0, srcs[0].address, 8 * MiB)])
        assert isinstance(too_big[0], OutOfSpaceError)


def test_tmpfs_works(tmp_path: Path) -> None:
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm on this host")
    shm = Path("/dev/shm") / f"tidekv-test-{os.getpid()}-{tmp_path.name}"
    shm.mkdir()
    try:
        with DiskTier([str(shm)], 4 * MiB) as tier:
            data = _data(5000)
            record = _put(tier, b"k", 1, data)
            assert _get(tier, record, is_aligned=True) == data
    finally:
        for f in shm.iterdir():
            f.unlink()
        shm.rmdir()


def test_buffered_when_o_direct_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           caplog: pytest.LogCaptureFixture) -> None:
    """tmpfs refused O_DIRECT with EINVAL before Linux 6.6; newer kernels accept it, so the refusal
    is simulated to exercise the buffered path."""
    real_open = os.open

    def refusing_open(path: str, flags: int, mode: int = 0o777) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real_open(path, flags, mode)

    monkeypatch.setattr(disk_module.os, "open", refusing_open)
    with caplog.at_level("INFO", logger=disk_module.__name__), DiskTier([str(tmp_path)], 4 * MiB) as tier:
        assert tier.direct == [False]
        assert any("buffered I/O" in r.getMessage() and str(tmp_path) in r.getMessage() for r in caplog.records)
        data = _data(3 * PAGE + 1)
        record = _put(tier, b"k", 1, data)
        assert _get(tier, record) == data


def test_direct_on_a_disk(tier: DiskTier) -> None:
    assert tier.direct == [True]  # tmp_path is on a real file system here, which takes O_DIRECT


def test_existing_file_of_another_size_is_refused(tmp_path: Path) -> None:
    DiskTier([str(tmp_path)], 4 * MiB).close()
    with pytest.raises(ConfigError, match=rf"tidekv-tier\.disk holds {4 * MiB} bytes, not the {8 * MiB}"):
        DiskTier([str(tmp_path)], 8 * MiB)
    assert os.path.getsize(tmp_path / "tidekv-tier.disk") == 4 * MiB


def test_bad_configuration_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        DiskTier([str(tmp_path / "missing")], 4 * MiB)
    with DiskTier([str(tmp_path)], 4 * MiB) as tier:
        with pytest.raises(ConfigError, match="in use"):
            DiskTier([str(tmp_path)], 4 * MiB)
        with pytest.raises(ConfigError, match="key"):
            tier.write(b"x" * 4001, 0, 0, 0)


def test_invalid_superblock_means_an_empty_disk(tmp_path: Path) -> None:
    with DiskTier([str(tmp_path)], 4 * MiB) as tier:
        _put(tier, b"old-a", 1, bytes(10))
        _put(tier, b"old-b", 2, bytes(10))
        file = tier.files[0]
    _flip_byte(file, 0)
    with DiskTier([str(tmp_path)], 4 * MiB) as tier:
        assert tier.scan() == [] and tier.used == 0
        new = _put(tier, b"new", 3, bytes(10))  # over old-a; old-b's header is still there
    with DiskTier([str(tmp_path)], 4 * MiB) as tier:
        assert tier.scan() == [new]  # old-b belongs to the discarded generation


def test_raw_direct_bandwidth(tmp_path: Path) -> None:
    write_bps, read_bps = raw_direct_bandwidth(str(tmp_path), 4 * MiB, 256 << 10, threads=2)
    assert write_bps > 0 and read_bps > 0
    assert list(tmp_path.iterdir()) == []
