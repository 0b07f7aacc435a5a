"""The master's side of the disk tier (``store.master.disks``), on a fake clock: spills handed out
under pressure and indexed when reported, evicted objects kept disk-only, disk copies superseded,
removed, evicted for room, taken offline with their holder and brought back by its report, and
carried by the journal."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from tidekv.store.master.journal import JournalFile
from tidekv.store.wire import protocol as p
from tidekv.store.wire.protocol import Pin, Status, disk_footprint

from tests.store.rig import ServiceRig, flush_journal, reloaded

SEG = 64 << 10
OBJ = 4096
DISK = p.DiskInfo("disk-1", "engine-of-h-seg", "h:7000", 16 * disk_footprint(OBJ))


def _rig(**config: object) -> ServiceRig:
    rig = ServiceRig(disk_spill_at=0.5, high_watermark=0.9, eviction_ratio=0.3, disk_write_through="off", **config)
    rig.hello("h")
    rig.mount("h", "h-seg", SEG)
    return rig


def _spills(rig: ServiceRig, done: list[p.SpillDone] | None = None, failed: list[bytes] | None = None,
            report: bool = False, disks: list[p.DiskInfo] | None = None, client: str = "h") -> p.SpillWork:
    body = p.Spills(client, [DISK] if disks is None else disks, done or [], failed or [], report)
    return msgspec.convert(rig.call(body), p.SpillWork)


def _done(task: p.SpillTask, offset: int) -> p.SpillDone:
    return p.SpillDone(task.key, task.token, task.disk, offset, task.size, 0xC0FFEE)


def _spill_all(rig: ServiceRig) -> list[p.SpillTask]:
    """Asks for spills and reports each done at its own offset; returns the tasks."""
    tasks = _spills(rig).tasks
    _spills(rig, [_done(t, 4096 + i * disk_footprint(OBJ)) for i, t in enumerate(tasks)])
    return tasks


def _ten_on_disk(rig: ServiceRig) -> list[p.SpillTask]:
    """Registers h's disk, puts k0..k9 and spills them all (still in memory too); the tasks."""
    _spills(rig)
    for i in range(10):
        rig.put("h", b"k%d" % i, OBJ)
    return _spill_all(rig)


def _past_spill_leases(rig: ServiceRig) -> None:
    rig.advance(4 * rig.config.lease_ttl_s + 11, tick=False)
    rig.heartbeat("h")
    rig.advance(0.1)


def test_spills_come_under_pressure_oldest_first_and_keep_evicted_objects_in_the_pool() -> None:
    rig = _rig()
    assert _spills(rig).report, "a disk the master did not know: it asks what the disk holds"
    for i in range(4):  # 4 of 16 slots: below disk_spill_at
        rig.put("h", b"k%d" % i, OBJ)
    assert _spills(rig).tasks == [], "no pressure, no write-through: nothing to spill"
    for i in range(4, 10):
        rig.put("h", b"k%d" % i, OBJ)
    tasks = _spill_all(rig)
    assert [t.key for t in tasks] == [b"k%d" % i for i in range(10)], "oldest first, every object without a copy"
    base = rig.bases["h-seg"]
    assert all(base <= t.source <= base + SEG - OBJ and t.disk == "disk-1" for t in tasks)
    assert len({t.source for t in tasks}) == 10
    stats = rig.stats()["disk"]
    assert stats["keys"] == 10 and stats["spills"] == 10 and stats["used_bytes"] == 10 * disk_footprint(OBJ)
    scrape = rig.service.metrics.render()
    scrape = scrape.decode() if isinstance(scrape, bytes) else scrape
    assert "tidekv_disk_keys 10.0" in scrape and "tidekv_disk_spills_total 10.0" in scrape
    assert f'tidekv_disk_used_bytes{{disk="disk-1"}} {float(10 * disk_footprint(OBJ))}' in scrape
    for i in range(10, 16):  # past the high watermark: the tick evicts the oldest
        rig.put("h", b"k%d" % i, OBJ)
    _past_spill_leases(rig)
    assert rig.stats()["evictions"] > 0
    evicted = [b"k%d" % i for i in range(16) if rig.get(b"k%d" % i).locations == []]
    assert evicted and all(k in {t.key for t in tasks} for k in evicted)
    r = rig.get(evicted[0])
    assert r.status == Status.OK and r.size == OBJ and r.disk is not None
    assert (r.disk.engine, r.disk.address, r.disk.disk, r.disk.crc) == ("engine-of-h-seg", "h:7000", "disk-1", 0xC0FFEE)
    assert rig.exists(evicted[0]) and rig.call(p.Locate([evicted[0]])) == [["engine-of-h-seg"]]
    assert rig.stats()["disk"]["kept_on_disk"] == len(evicted) and rig.stats()["disk"]["spills_dropped"] == 0


def test_an_object_evicted_before_its_spill_is_dropped_and_counted() -> None:
    rig = _rig()
    _spills(rig)
    for i in range(16):
        rig.put("h", b"k%d" % i, OBJ)
    rig.advance(0.1)  # evicts; nothing was spilled
    stats = rig.stats()
    assert stats["evictions"] > 0 and stats["disk"]["spills_dropped"] == stats["evictions"]
    assert not rig.exists(b"k0")


def test_a_spill_under_way_is_leased_so_eviction_skips_it() -> None:
    rig = _rig()
    _spills(rig)
    for i in range(10):
        rig.put("h", b"k%d" % i, OBJ)
    tasks = _spills(rig).tasks  # handed out, not yet reported
    assert tasks
    for i in range(10, 16):
        rig.put("h", b"k%d" % i, OBJ)
    rig.advance(0.1)
    assert all(rig.exists(t.key) for t in tasks), "objects being spilled are not evicted from under their writer"


def test_a_disk_only_key_exists_for_puts_upsert_replaces_it_and_its_record_is_freed() -> None:
    rig = _rig()
    tasks = _ten_on_disk(rig)
    rig.service.objects.evict(10 * OBJ, rig.clock.now + 100)  # everything leaves memory
    assert rig.get(b"k0").disk is not None
    assert rig.put_start("h", b"k0", OBJ).status == Status.EXISTS, "a complete object, on disk"
    slot = rig.put("h", b"k0", OBJ, upsert=True)
    assert slot.status == Status.OK
    r = rig.get(b"k0")
    assert r.locations and r.disk is None, "the new version, in memory"
    drops = _spills(rig).drops
    assert [(d.key, d.token) for d in drops] == [(b"k0", tasks[0].token)], "the holder frees the old version's record"


def test_remove_drops_the_disk_copy_and_respects_its_lease() -> None:
    rig = _rig()
    _ten_on_disk(rig)
    rig.service.objects.evict(10 * OBJ, rig.clock.now + 100)
    assert rig.get(b"k1").disk is not None  # leased now
    assert rig.remove(b"k1") == Status.LEASED
    assert rig.remove(b"k1", force=True) == Status.OK and not rig.exists(b"k1")
    assert rig.remove(b"k2") == Status.OK, "no lease on k2"
    assert {d.key for d in _spills(rig).drops} == {b"k1", b"k2"}
    assert rig.remove(b"k2") == Status.NOT_FOUND


def test_a_full_disk_evicts_its_least_recently_used_records_for_a_spill() -> None:
    rig = _rig()
    small = p.DiskInfo("disk-1", "engine-of-h-seg", "h:7000", 4 * disk_footprint(OBJ))
    _spills(rig, disks=[small])
    for i in range(10):
        rig.put("h", b"k%d" % i, OBJ)
    work = _spills(rig, disks=[small])
    assert len(work.tasks) == 4, "as many as fit on the disk"
    work = _spills(rig, [_done(t, 4096 + i * disk_footprint(OBJ)) for i, t in enumerate(work.tasks)], disks=[small])
    assert [t.key for t in work.tasks] == [b"k4", b"k5", b"k6", b"k7"]
    assert [d.key for d in work.drops] == [b"k0", b"k1", b"k2", b"k3"], \
        "the disk's least recently used records make room; the holder frees them before it writes"
    assert rig.stats()["disk"]["disk_evictions"] == 4


def test_write_through_queues_pinned_objects_without_pressure() -> None:
    rig = _rig()
    rig.service.objects.disks.write_through = "pinned"
    _spills(rig)
    rig.put("h", b"plain", OBJ)
    rig.put("h", b"pinned", OBJ, pin=Pin.SOFT)
    assert [t.key for t in _spills(rig).tasks] == [b"pinned"]


def test_a_failed_spill_frees_its_room_and_the_object_is_asked_for_again() -> None:
    rig = _rig()
    _spills(rig)
    for i in range(10):
        rig.put("h", b"k%d" % i, OBJ)
    tasks = _spills(rig).tasks
    work = _spills(rig, failed=[t.key for t in tasks])
    assert rig.stats()["disk"]["spill_failures"] == len(tasks)
    assert [t.key for t in work.tasks] == [t.key for t in tasks], "asked again, the room counted once"
    assert rig.stats()["disk"]["used_bytes"] == len(tasks) * disk_footprint(OBJ)


def test_a_lapsed_holders_disk_goes_offline_and_its_report_brings_it_back() -> None:
    rig = _rig(client_ttl_s=5.0, suspend_grace_s=0.0)
    tasks = _ten_on_disk(rig)
    rig.advance(6.0)  # h lapses: its segment goes, its disk stays indexed, offline
    assert not rig.exists(b"k0") and rig.get(b"k0").status == Status.NOT_FOUND
    assert rig.stats()["disk"]["disks"]["disk-1"]["online"] is False
    rig.hello("h2")  # the holder restarted: a new client, the same disk file
    rig.mount("h2", "h2-seg", SEG)
    work = _spills(rig, client="h2")
    assert work.report, "a disk back online: the master asks what it holds"
    known = [_done(t, 4096 + i * disk_footprint(OBJ)) for i, t in enumerate(tasks)]
    stranger = p.SpillDone(b"never-indexed", 99, "disk-1", 1 << 20, OBJ, 1)
    work = _spills(rig, known + [stranger], report=True, client="h2")
    assert [d.key for d in _spills(rig, client="h2").drops + work.drops] == [b"never-indexed"], \
        "a record the master never indexed (removed meanwhile) is freed, not served"
    r = rig.get(b"k0", client="h2")
    assert r.disk is not None and r.disk.offset == 4096


def test_the_journal_carries_disk_copies(tmp_path: Path) -> None:
    rig = _rig()
    journal = JournalFile(tmp_path)
    rig.service.enable_journal()
    journal.rewrite(rig.service.snapshot())
    _ten_on_disk(rig)
    rig.remove(b"k3")
    flush_journal(rig, journal)
    journal.close()
    restored = reloaded(tmp_path)
    disks = restored.service.objects.disks
    assert set(disks.entries) == {b"k%d" % i for i in range(10)} - {b"k3"}
    assert disks.disks["disk-1"].online is False and disks.disks["disk-1"].used == 9 * disk_footprint(OBJ)
    restored.hello("h")
    restored.mount("h", "h-seg", SEG)
    assert _spills(restored).report
    assert restored.get(b"k5").status == Status.OK


@pytest.mark.parametrize("size", [1, 4095, 4096, 4097, 2 << 20])
def test_a_records_footprint_is_a_header_block_and_whole_data_blocks(size: int) -> None:
    assert disk_footprint(size) % 4096 == 0 and size + 4096 <= disk_footprint(size) < size + 8192


def test_write_through_queues_what_the_holder_held_before_its_disks_were_known() -> None:
    rig = _rig()
    rig.service.objects.disks.write_through = "all"
    rig.put("h", b"early", OBJ)  # before the holder's first Spills
    rig.hello("other")
    rig.mount("other", "other-seg", SEG)
    rig.put("other", b"elsewhere", OBJ, preferred="other-seg")
    assert [t.key for t in _spills(rig).tasks] == [b"early"], "its own objects only"


def test_each_holder_is_handed_only_its_own_objects_however_many_others_hold() -> None:
    """Under pressure, the oldest objects of the pool are another holder's, more of them than one
    request looks at: this holder is still handed its own, oldest first."""
    rig = ServiceRig(disk_spill_at=0.3, disk_write_through="off")
    rig.hello("other")
    rig.mount("other", "other-seg", 1 << 20)
    for i in range(5000):  # 5000 x 64 B on a holder without disks, put first
        rig.put("other", b"o%d" % i, 64, preferred="other-seg")
    rig.hello("h")
    rig.mount("h", "h-seg", SEG)
    _spills(rig)
    for i in range(16):
        rig.put("h", b"k%d" % i, OBJ, preferred="h-seg")
    assert rig.stats()["used_bytes"] >= 0.3 * rig.stats()["capacity_bytes"]
    assert [t.key for t in _spills(rig).tasks] == [b"k%d" % i for i in range(16)]


def test_a_listing_names_disk_only_objects_once() -> None:
    rig = _rig()
    _ten_on_disk(rig)
    rig.service.objects.evict(4 * OBJ, rig.clock.now + 100)  # some leave memory
    assert any(rig.get(b"k%d" % i).disk is not None for i in range(10))
    keys, is_last = rig.call(p.ListKeys(True, 100), client="h")
    assert is_last and sorted(keys) == sorted(b"k%d" % i for i in range(10))


def _promote_start(rig: ServiceRig, key: bytes, token: int, segment: str = "h-seg") -> p.PutSlot:
    raw = rig.call(p.PutStart("h", [key], [OBJ], 1, segment, promote=[token]))
    return msgspec.convert(raw, list[p.PutSlot])[0]


def test_a_disk_hit_comes_back_to_its_holders_memory_under_its_own_version() -> None:
    rig = _rig()
    tasks = _ten_on_disk(rig)
    rig.service.objects.evict(10 * OBJ, rig.clock.now + 100)  # every object on disk only
    rig.advance(0.1)  # the tick sees room in memory again
    assert rig.get(b"k0").disk is not None
    [promo] = _spills(rig).promote
    assert (promo.key, promo.token, promo.size) == (b"k0", tasks[0].token, OBJ)
    slot = _promote_start(rig, b"k0", promo.token)
    assert slot.status == Status.OK and slot.token == promo.token and slot.locations[0].segment == "h-seg"
    assert rig.get(b"k0").disk is not None, "until the holder ends it, readers read the disk"
    assert rig.put_start("other-writer", b"k0", OBJ).status == Status.EXISTS
    assert rig.put_end("h", b"k0", promo.token) == Status.OK
    r = rig.get(b"k0")
    assert r.locations and r.disk is None, "back in memory"
    assert rig.service.objects.disks.entries[b"k0"].token == promo.token, "its disk copy stays: the same version"
    rig.service.objects.evict(OBJ, rig.clock.now + 100)
    assert rig.get(b"k0").disk is not None, "evicted again: still in the pool, on disk"
    assert _promote_start(rig, b"k1", promo.token).status == Status.STALE, "another version's token"


def test_no_promotion_under_pressure_and_a_remove_drops_one_under_way() -> None:
    rig = _rig()
    _ten_on_disk(rig)
    rig.service.objects.evict(4 * OBJ, rig.clock.now + 100)  # 6 of 16 slots still used...
    for i in range(10, 14):
        rig.put("h", b"k%d" % i, OBJ)  # ... and 10 again: above disk_spill_at
    rig.advance(0.1)
    disk_only = [k for k in (b"k%d" % i for i in range(10)) if rig.get(k).disk is not None]
    assert disk_only and _spills(rig).promote == [], "the pool is under pressure: no promotion"
    rig.service.objects.evict(14 * OBJ, rig.clock.now + 200)
    rig.advance(0.1)
    assert rig.get(b"k0").disk is not None
    [promo] = _spills(rig).promote
    assert _promote_start(rig, b"k0", promo.token).status == Status.OK
    assert rig.remove(b"k0", force=True) == Status.OK
    assert not rig.exists(b"k0") and rig.put_end("h", b"k0", promo.token) == Status.STALE, \
        "a removed object is not brought back by its promotion"
