"""The disk tier end to end (``disk_paths``): a master process, holders and readers as Stores.

Objects spill to the holder's disk and stay in the pool once evicted from memory; they read back
byte for byte on the holder itself (straight from its disk) and on another client (through the
holder's disk server); a holder restarted on the same paths gets its objects back; a corrupted
record is a miss, never data; tmpfs (buffered or direct) and two disks at once work.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from tidekv.errors import ConfigError, DiskCorruptError, OutOfSpaceError
from tidekv.store.client.store import Store
from tidekv.store.wire.protocol import Pin, disk_footprint

from tests.store.conftest import Connect, SpawnAgent, SpawnMaster
from tests.store.payload import digest, payload
from tests.store.procs import wait_until

SEG = 1 << 20
OBJ = 64 << 10
DISK = 8 << 20


def _disk_keys(store: Store) -> int:
    return store.stats()["disk"]["keys"]


def _disk_only(store: Store, keys: list[bytes]) -> list[bytes]:
    return [k for k, info in zip(keys, store.lookup_many(keys)) if info is not None and not info.locations]


@pytest.fixture
def master_address(spawn_master: SpawnMaster) -> str:
    return spawn_master(disk_write_through="all", disk_spill_at=0.5, lease_ttl_s=0.5).address


def _holder(connect: Connect, address: str, *paths: Path, size: int = DISK) -> Store:
    return connect(address, SEG, disk_paths=",".join(str(p) for p in paths), disk_size_bytes=size,
                   heartbeat_interval_s=0.05)


def _fill(store: Store, first: int, n: int) -> list[bytes]:
    keys = [b"obj-%d" % i for i in range(first, first + n)]
    for i, key in zip(range(first, first + n), keys):
        store.put(key, payload(i, OBJ))
    return keys


def _fill_on_disk(store: Store, n: int) -> list[bytes]:
    """Puts ``n`` objects, 8 at a time, each batch on disk before the next (none evicted unspilled)."""
    keys: list[bytes] = []
    for first in range(0, n, 8):
        keys += _fill(store, first, min(8, n - first))
        wait_until(lambda: _disk_keys(store) == len(keys), 10, f"{len(keys)} objects on disk")
    return keys


def test_evicted_objects_stay_in_the_pool_and_read_back_on_the_holder_and_elsewhere(
        connect: Connect, master_address: str, tmp_path: Path) -> None:
    holder = _holder(connect, master_address, tmp_path)
    reader = connect(master_address)
    keys = _fill(holder, 0, 12)
    wait_until(lambda: _disk_keys(holder) == 12, 10, "every object written through to disk")
    keys += _fill(holder, 12, 12)  # 24 x 64 KiB in a 1 MiB segment: the first ones leave memory
    wait_until(lambda: _disk_keys(holder) == 24, 10, "the rest on disk too")
    on_disk = _disk_only(reader, keys)
    assert len(on_disk) >= 8, "objects evicted from memory, kept on disk"
    stats = holder.stats()["disk"]
    assert stats["kept_on_disk"] >= len(on_disk) and stats["spills_dropped"] == 0
    for store in (reader, holder):  # elsewhere: through the disk server; on the holder: its own disk
        got = store.get_many(keys)
        assert [g == payload(i, OBJ) for i, g in enumerate(got)] == [True] * 24
    buf = bytearray(OBJ + 100)
    region = reader.register(buf)
    try:
        assert reader.get_into(on_disk[0], region) == OBJ
        assert bytes(buf[:OBJ]) == payload(keys.index(on_disk[0]), OBJ)
        assert reader.get_ranges_into([on_disk[1]], [[(100, memoryview(buf)[:1000])]]) == [OBJ]
        assert bytes(buf[:1000]) == payload(keys.index(on_disk[1]), OBJ)[100:1100]
    finally:
        reader.unregister(region)
    holder.put(on_disk[0], b"other")  # a disk-only object is complete: a put of its key is a no-op
    assert holder.get(on_disk[0]) == payload(keys.index(on_disk[0]), OBJ)
    holder.remove(on_disk[2], force=True)  # read above: under a lease
    assert not reader.exists(on_disk[2])
    time.sleep(0.6)  # every object was just read: memory has room again once those leases end
    holder.upsert(on_disk[3], b"new version")
    assert reader.get(on_disk[3]) == b"new version"


def test_a_restarted_holder_gets_its_objects_back_from_its_disks_and_hits_back_in_memory(connect: Connect, master_address: str,
                                                                  tmp_path: Path) -> None:
    holder = _holder(connect, master_address, tmp_path)
    keys = _fill(holder, 0, 10)
    wait_until(lambda: _disk_keys(holder) == 10, 10, "every object on disk")
    holder.close()
    reader = connect(master_address)
    assert reader.get_many(keys) == [None] * 10, "the holder's disk is offline: misses"
    again = _holder(connect, master_address, tmp_path)
    wait_until(lambda: reader.exists_many(keys) == [True] * 10, 10, "the restarted holder's report")
    assert reader.get_many(keys) == [payload(i, OBJ) for i in range(10)]
    assert again.stats()["disk"]["stale_records"] == 0
    # Those reads were disk hits in a pool with room: the holder brings them back to memory.
    wait_until(lambda: all(info is not None and info.locations for info in reader.lookup_many(keys)), 10,
               "the disk hits back in the holder's memory")
    assert reader.get_many(keys) == [payload(i, OBJ) for i in range(10)]
    assert again.stats()["disk"]["promotions"] == 10


def test_a_corrupted_record_is_a_miss_never_data(connect: Connect, master_address: str, tmp_path: Path) -> None:
    holder = _holder(connect, master_address, tmp_path)
    reader = connect(master_address)
    keys = _fill_on_disk(holder, 24)
    victim = _disk_only(reader, keys)[0]
    [file] = [str(f) for f in tmp_path.glob("tidekv-*.disk")]
    offset = _record_offset(file, victim)
    fd = os.open(file, os.O_RDWR)
    try:
        byte = os.pread(fd, 1, offset + 4096 + 1000)
        os.pwrite(fd, bytes([byte[0] ^ 0xFF]), offset + 4096 + 1000)
        os.fsync(fd)
    finally:
        os.close(fd)
    for store in (reader, holder):
        with pytest.raises(DiskCorruptError):
            store.get(victim)
    others = [k for k in keys if k != victim]
    assert reader.get_many(others) == [payload(keys.index(k), OBJ) for k in others]


def _record_offset(file: str, key: bytes) -> int:
    """Where the record of ``key`` starts in a disk file (its header names the key)."""
    with open(file, "rb") as f:
        data = f.read()
    for at in range(4096, len(data), 4096):  # a header: magic, version, generation, offset, key length, key
        if data[at:at + 4] == b"TKVR" and data[at + 26:at + 26 + len(key)] == key:
            return at
    raise AssertionError(f"no record of {key!r} in {file}")


def test_two_disks_fill_together(connect: Connect, master_address: str, tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    holder = _holder(connect, master_address, a, b)
    keys = _fill_on_disk(holder, 24)
    used = [d["used"] for d in holder.stats()["disk"]["disks"].values()]
    assert len(used) == 2 and min(used) > 0, used
    assert connect(master_address).get_many(keys) == [payload(i, OBJ) for i in range(24)]


def test_a_tmpfs_path_works(connect: Connect, master_address: str) -> None:
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm (tmpfs) on this machine")
    import tempfile
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        holder = _holder(connect, master_address, Path(shm))
        keys = _fill_on_disk(holder, 24)
        assert connect(master_address).get_many(keys) == [payload(i, OBJ) for i in range(24)]
        holder.close()


def test_bad_disk_settings_are_refused(connect: Connect, master_address: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="needs a segment"):
        connect(master_address, 0, disk_paths=str(tmp_path), disk_size_bytes=DISK)
    with pytest.raises(ConfigError, match="disk_size"):
        connect(master_address, SEG, disk_paths=str(tmp_path))
    with pytest.raises(ConfigError, match="does not exist"):
        connect(master_address, SEG, disk_paths=str(tmp_path / "nope"), disk_size_bytes=DISK)
    _holder(connect, master_address, tmp_path)
    with pytest.raises(ConfigError, match="in use"):
        _holder(connect, master_address, tmp_path)


def test_a_full_disk_evicts_its_oldest_records_and_a_full_pool_names_both_tiers(
        connect: Connect, master_address: str, tmp_path: Path) -> None:
    small = 8 * (4096 + OBJ) + 4096  # eight records and the superblock
    holder = _holder(connect, master_address, tmp_path, size=small)
    reader = connect(master_address)
    keys = _fill_on_disk(holder, 8)
    more = _fill(holder, 8, 8)  # the disk is full: its oldest records make room for these
    wait_until(lambda: holder.stats()["disk"]["disk_evictions"] >= 8, 10, "the disk to evict its oldest records")
    keys += more
    got = reader.get_many(keys)
    assert [g is None or g == payload(i, OBJ) for i, g in enumerate(got)] == [True] * 16, "misses, never wrong bytes"
    assert got[8:] == [payload(i, OBJ) for i in range(8, 16)], "the newest objects are in the pool"
    time.sleep(0.6)  # the reads' leases end
    pinned = 0
    with pytest.raises(OutOfSpaceError) as full:
        for i in range(100):  # memory filled with objects nothing may evict
            holder.put(b"pinned-%d" % i, payload(i, OBJ), pin=Pin.HARD)
            pinned += 1
    assert 0 < pinned < 100 and "memory:" in str(full.value) and "disk tier:" in str(full.value), str(full.value)


def test_a_holder_killed_while_spilling_loses_no_reported_object_and_leaks_no_space(
        spawn_master: SpawnMaster, spawn_agent: SpawnAgent, tmp_path: Path) -> None:
    """A holder process killed (SIGKILL) while its spills are in flight: started again on the
    same disk, every object the master indexed on it reads back byte for byte, and the tier's
    used space is exactly what those records take (a torn or unreported record came back free)."""
    master = spawn_master(disk_write_through="all", client_ttl_s=1.0, suspend_grace_s=0.0)
    disk = {"disk_paths": str(tmp_path), "disk_size_bytes": 64 << 20, "heartbeat_interval_s": 0.05}
    size = 256 << 10
    holder = spawn_agent(master.address, 8 << 20, **disk)
    for i in range(24):
        holder.call("put", key=f"k{i}", seed=i, size=size)
    holder.proc.kill()
    holder.proc.wait()
    again = spawn_agent(master.address, 8 << 20, **disk)

    def settled() -> dict[str, int] | None:
        stats = again.call("stats")["stats"]
        online = [d for d in stats["disk"]["disks"].values() if d["online"]]
        if not online or stats["disk_tier"]["used"] != stats["disk"]["used_bytes"] or len(stats["segments"]) != 1:
            return None  # not reported yet, frees pending, or the killed holder's memory not yet dropped
        return {"keys": stats["disk"]["keys"], "used": stats["disk_tier"]["used"]}

    state = wait_until(settled, 15, "the restarted holder's report, and the frees of what the master did not index")
    assert state["used"] == state["keys"] * disk_footprint(size)
    reader = spawn_agent(master.address, 0)
    found = reader.call("get_many", keys=[f"k{i}" for i in range(24)])
    assert not found["failed"], found["failed"]
    digests = found["digests"]
    assert sum(d is not None for d in digests) == state["keys"], "every indexed object, and only those, reads"
    assert all(d is None or d == digest(payload(i, size)) for i, d in enumerate(digests)), "never wrong bytes"


@pytest.mark.parametrize("staging", [16 << 20, 48 << 20, 96 << 20], ids=["16M", "48M", "96M"])
def test_a_read_of_many_disk_only_objects_is_served_in_rounds(connect: Connect, master_address: str,
                                                              tmp_path: Path, staging: int) -> None:
    """80 MiB of disk-only objects read elsewhere in one call: the holder stages them in rounds
    (overlapping when its staging memory holds two, one at a time when not), byte for byte."""
    big = 4 << 20
    holder = connect(master_address, 16 << 20, disk_paths=str(tmp_path), disk_size_bytes=256 << 20,
                     heartbeat_interval_s=0.05, staging_size_bytes=staging)
    keys = []
    for first in range(0, 20, 2):
        for i in range(first, first + 2):
            keys.append(b"big-%d" % i)
            holder.put(keys[-1], payload(i, big))
        wait_until(lambda n=len(keys): _disk_keys(holder) == n, 15, f"{len(keys)} objects on disk")
    reader = connect(master_address)
    assert len(_disk_only(reader, keys)) >= 14  # memory is full: no promotion meanwhile
    assert reader.get_many(keys) == [payload(i, big) for i in range(20)]
    assert holder.disk_reads_served >= 14
