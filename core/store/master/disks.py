"""The disk tier's index: which objects holders keep on their disks, and what they spill next.

A holder may contribute disks besides memory (``store.client.disk``). The master indexes one
disk copy per key (``DiskEntry``: disk, offset, version, crc), with its own LRU and capacity.
Spilling is write-back, ahead of eviction. Each object put in the memory of a holder with disks
joins that holder's queue, in put order: *urgent* when ``write_through`` ("pinned" or "all")
wants it on disk at once, else *lazy*, handed out only while the pool is nearly full
(``spill_at``). A holder asking (``Spills``, about once a heartbeat) is handed the head of its
queues; eviction skips objects while they are written (a remove or upsert meanwhile makes the
spill stale: its record is freed, never indexed). Eviction itself never waits: a victim with a
disk copy of its version stays in the pool, disk-only; one without is dropped and counted (the
spill did not keep up).

A get of a disk-only object returns a ``DiskCopy`` under a lease: the reader asks the holder,
which reads and verifies the record. With ``promote``, while the pool is not under pressure, a
hit also queues the object for its holder to bring back to memory: a put of its own version
(``ObjectTable.promote_start``) into free bytes of the holder's segment, filled from its disk.

A holder's disks outlive its process: when it lapses they go offline (their objects misses, the
entries kept), and when it comes back it reports what its disks hold; records the master no
longer wants are freed. Disk space is the holder's to place
(its allocator); the master counts each record's footprint against the disk's capacity, and
evicts the disk's LRU entries to make room for a spill.

Neighbours: ``objects`` (owns this table and calls it on get, put_end, remove and eviction),
``master`` (the ``Spills`` request, the tick), ``store.client.spill_worker`` (the holder's side).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tidekv.store.master import journal as j
from tidekv.store.wire import protocol as p
from tidekv.store.wire.protocol import Pin, Status, disk_footprint

if TYPE_CHECKING:
    from tidekv.store.master.objects import ObjectMeta, ObjectTable

logger = logging.getLogger(__name__)

MAX_PROMOTE_BYTES = 64 << 20
"""Bytes of promotions handed to a holder per ``Spills`` round, at most."""
MAX_SCAN = 4096
"""Queued objects (or disk records, for room) one ``Spills`` request looks at, at most (it must
not hold the event loop)."""


@dataclass(slots=True)
class SpillQueue:
    """One holder's objects without a disk copy, in put order."""

    urgent: dict[bytes, None]  # write-through: handed out at once
    lazy: dict[bytes, None]  # handed out under pressure


@dataclass(slots=True)
class Disk:
    name: str
    client_id: str
    engine: str
    address: str
    capacity: int
    used: int = 0  # footprints of its records and of the spills under way to it
    online: bool = True
    offline_since: float = 0.0
    trust_report: bool = False  # new to this master: the holder's report of its records is taken as is


class DiskEntry:
    __slots__ = ("disk", "offset", "size", "token", "crc", "lease_until")
    put = None  # complete, as a listing asks of every object (``listing``)

    def __init__(self, disk: str, offset: int, size: int, token: int, crc: int) -> None:
        self.disk, self.offset, self.size, self.token, self.crc = disk, offset, size, token, crc
        self.lease_until = 0.0


@dataclass(slots=True)
class Spill:
    token: int
    client_id: str
    disk: str
    footprint: int
    deadline: float


@dataclass(slots=True)
class DiskCounters:
    spills: int = 0  # records written and indexed
    spilled_bytes: int = 0
    spill_failures: int = 0  # reported failed, or past their deadline
    spills_dropped: int = 0  # objects evicted from memory before their holder could spill them
    kept_on_disk: int = 0  # objects evicted from memory that stayed in the pool, disk-only
    disk_evictions: int = 0  # records evicted from a disk to make room
    disk_hits: int = 0  # gets answered with a disk copy
    promotions: int = 0  # disk hits handed to their holders to bring back to memory
    stale_records: int = 0  # records a holder held that the master no longer wanted (freed)


class DiskTable:
    """The disk copies of one ``ObjectTable``'s objects. Single-threaded."""

    def __init__(self, table: ObjectTable) -> None:
        self.table = table
        self.disks: dict[str, Disk] = {}
        self.entries: collections.OrderedDict[bytes, DiskEntry] = collections.OrderedDict()  # LRU order
        self.under_way: dict[bytes, Spill] = {}
        self.queues: dict[str, SpillQueue] = {}  # holder -> its objects without a disk copy
        self.drops: dict[str, list[p.DiskDrop]] = {}  # client -> records to free, sent with its next work
        self.write_through = "off"  # "off", "pinned" or "all" (MasterConfig.disk_write_through)
        self.promote = False  # bring disk hits back to memory (MasterConfig.disk_promote) ...
        self.promote_ok = False  # ... while the pool is not under pressure (the master's tick says)
        self.promotions: dict[str, dict[bytes, None]] = {}  # holder -> disk hits to bring back
        self._holders: set[str] | None = None  # clients with an online disk (None: to be recounted)
        self.counters = DiskCounters()

    # ---- the object table's hooks ---------------------------------------------------------

    def get(self, key: bytes, lease_s: float, now: float) -> p.GetResult:
        """A disk-only object's copy, under a lease; NOT_FOUND when there is none readable."""
        entry = self.entries.get(key)
        disk = self.disks.get(entry.disk) if entry is not None else None
        if entry is None or disk is None or not disk.online:
            return p.GetResult(Status.NOT_FOUND)
        entry.lease_until = max(entry.lease_until, now + lease_s)
        self.entries.move_to_end(key)
        self.counters.disk_hits += 1
        if self.promote and self.promote_ok:
            self.promotions.setdefault(disk.client_id, {})[key] = None
        return p.GetResult(Status.OK, entry.size, [], p.DiskCopy(disk.engine, disk.address, disk.name, entry.offset,
                                                                  entry.token, entry.crc))

    def engine(self, key: bytes) -> str | None:
        """The engine of the holder whose disk has ``key`` (online), if any."""
        entry = self.entries.get(key)
        disk = self.disks.get(entry.disk) if entry is not None else None
        return disk.engine if disk is not None and disk.online else None

    def published(self, key: bytes, meta: ObjectMeta) -> None:
        """A new version of ``key`` is complete: a disk copy of another version goes, and the new
        one joins its holder's queue (urgent with write-through)."""
        entry = self.entries.get(key)
        if entry is not None and entry.token != meta.token:
            self.forget(key)
        holder = self._spiller(meta)
        if holder is not None:
            queue = self.queues.setdefault(holder, SpillQueue({}, {}))
            (queue.urgent if self._urgent(meta) else queue.lazy)[key] = None

    def remove(self, key: bytes, force: bool, now: float) -> int:
        """Deletes ``key``'s disk copy (the object is gone from memory too, or never was there)."""
        entry = self.entries.get(key)
        if entry is None:
            return Status.NOT_FOUND
        if entry.lease_until > now and not force:
            return Status.LEASED
        self.forget(key)
        return Status.OK

    def evicted(self, key: bytes, meta: ObjectMeta) -> bool:
        """``key`` left memory; whether it stays in the pool, disk-only (a copy of its version)."""
        holder = self._spiller(meta)
        queue = self.queues.get(holder) if holder is not None else None
        if queue is not None:
            queue.urgent.pop(key, None)
            queue.lazy.pop(key, None)
        entry = self.entries.get(key)
        if entry is not None and entry.token == meta.token:
            self.counters.kept_on_disk += 1
            return True
        if entry is not None:
            self.forget(key)
        if holder is not None:
            self.counters.spills_dropped += 1
        return False

    def forget(self, key: bytes) -> None:
        """Drops ``key``'s disk copy; its holder frees the record with its next work."""
        entry = self.entries.pop(key, None)
        if entry is None:
            return
        disk = self.disks.get(entry.disk)
        if disk is not None:
            disk.used -= disk_footprint(entry.size)
            self.drops.setdefault(disk.client_id, []).append(p.DiskDrop(disk.name, entry.offset, key, entry.token))
        if self.table.journal is not None:
            self.table.journal.add(j.DiskDropOp([key]), key)

    # ---- holders -----------------------------------------------------------------------------

    def spills(self, m: p.Spills, segments: Iterable[tuple[str, int]], pressure: bool, max_bytes: int,
               now: float, deadline_s: float) -> p.SpillWork:
        """One ``Spills`` round of holder ``m.client_id``, whose memory segments are ``segments``
        ((name, base) each): its disks registered, its reports applied, and its next work."""
        if m.unmount:
            mine = {d.name for d in m.disks if d.name in self.disks and self.disks[d.name].client_id == m.client_id}
            self.unmount(mine, "unmounted by its holder")
            self.drops.pop(m.client_id, None)
            return p.SpillWork()
        report = False
        for info in m.disks:
            report |= self._register(m.client_id, info, now)
        for done in m.done:
            self._done(m.client_id, done, m.report)
        for key in m.failed:
            spill = self.under_way.get(key)
            if spill is not None and spill.client_id == m.client_id:
                self._abandon(key)
                self.counters.spill_failures += 1
        mine = {d.name: d for d in self.disks.values() if d.client_id == m.client_id and d.online}
        drops = self.drops.pop(m.client_id, [])
        queue = self.queues.get(m.client_id)
        tasks = (self._tasks(queue, mine, dict(segments), pressure, max_bytes, now, deadline_s, drops)
                 if mine and queue is not None else [])
        return p.SpillWork(tasks, drops, report, self._promotions(m.client_id))

    def _promotions(self, client_id: str) -> list[p.PromoteTask]:
        """The disk hits ``client_id`` is to bring back to memory now (up to MAX_PROMOTE_BYTES)."""
        waiting = self.promotions.get(client_id)
        if not waiting:
            return []
        out: list[p.PromoteTask] = []
        budget = MAX_PROMOTE_BYTES
        for key in list(itertools.islice(waiting, MAX_SCAN)):
            del waiting[key]
            entry = self.entries.get(key)
            if entry is None or key in self.table.objects or not self.promote_ok:
                continue  # gone, in memory again, or the pool filled meanwhile
            if entry.size > budget:
                waiting[key] = None
                break
            budget -= entry.size
            out.append(p.PromoteTask(key, entry.token, entry.size, entry.disk, entry.offset, entry.crc))
        self.counters.promotions += len(out)
        return out

    def lapsed(self, client_id: str, now: float) -> None:
        """``client_id`` missed its heartbeats: its disks go offline (entries kept), its spills end."""
        for disk in self.disks.values():
            if disk.client_id == client_id and disk.online:
                disk.online, disk.offline_since = False, now
                self._holders = None
                logger.warning("disk %s of client %s offline: its objects are misses until it comes back",
                               disk.name, client_id)
        for key in [k for k, s in self.under_way.items() if s.client_id == client_id]:
            self._abandon(key, requeue=False)
        self.queues.pop(client_id, None)  # its memory is gone with it
        self.promotions.pop(client_id, None)

    def tick(self, now: float, grace_s: float) -> None:
        """Spills past their deadline fail; disks offline longer than ``grace_s`` are dropped."""
        for key in [k for k, s in self.under_way.items() if s.deadline < now]:
            self._abandon(key)
            self.counters.spill_failures += 1
        gone = {d.name for d in self.disks.values() if not d.online and now - d.offline_since > grace_s}
        if gone:
            self.unmount(gone, f"offline for over {grace_s:.0f} s")

    def unmount(self, names: set[str], why: str) -> None:
        """Drops disks ``names`` with every entry on them (objects on no other tier leave the pool)."""
        for name in names:
            disk = self.disks.pop(name, None)
            self._holders = None
            if disk is not None:
                logger.warning("disk %s of client %s dropped with its records: %s", name, disk.client_id, why)
        for key in [k for k, e in self.entries.items() if e.disk in names]:
            del self.entries[key]
        for key in [k for k, s in self.under_way.items() if s.disk in names]:
            del self.under_way[key]
        if self.table.journal is not None:
            self.table.journal.add_everything(j.DiskUnmountOp(sorted(names)))

    # ---- reports ------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """The tier as the master's stats show it (``stats()["disk"]``)."""
        disks = self.disks.values()
        only = sum(1 for k in self.entries if k not in self.table.objects)
        return {"keys": len(self.entries), "disk_only_keys": only,
                "spills_under_way": len(self.under_way), "capacity_bytes": sum(d.capacity for d in disks),
                "used_bytes": sum(d.used for d in disks),
                "disks": {d.name: {"client": d.client_id, "engine": d.engine, "capacity": d.capacity, "used": d.used,
                                   "online": d.online} for d in disks},
                **dataclasses.asdict(self.counters)}

    def why_full(self) -> str:
        """Why a put found no room, with a disk tier: both tiers' usage."""
        segments, disks = self.table.segments, self.disks.values()
        used, capacity = sum(d.used for d in disks), sum(d.capacity for d in disks)
        return (f"memory: {segments.used} of {segments.capacity} bytes used, the rest pinned, leased, being "
                f"written or being spilled; disk tier: {used} of {capacity} "
                f"bytes on {len(disks)} disk(s) (a put needs memory: disks take only what memory evicts)")

    # ---- journal --------------------------------------------------------------------------------

    def snapshot(self) -> list[j.Op]:
        out: list[j.Op] = [j.DiskMountOp(d.client_id, d.name, d.engine, d.address, d.capacity)
                           for d in self.disks.values()]
        return out + [j.DiskPutOp(k, e.disk, e.offset, e.size, e.token, e.crc) for k, e in self.entries.items()]

    def restore(self, mirror: j.Mirror, now: float) -> None:
        """Fills an empty table from ``mirror``: disks are offline until their holders report."""
        for op in mirror.disks.values():
            self._holders = None
            self.disks[op.name] = Disk(op.name, op.client_id, op.engine, op.address, op.capacity, online=False,
                                       offline_since=now)
        for op in mirror.disk_entries.values():
            disk = self.disks.get(op.disk)
            if disk is None:
                continue
            self.entries[op.key] = DiskEntry(op.disk, op.offset, op.size, op.token, op.crc)
            disk.used += disk_footprint(op.size)

    # ---- internals ----------------------------------------------------------------------------

    def _register(self, client_id: str, info: p.DiskInfo, now: float) -> bool:
        """Mounts (or brings back online) disk ``info`` of ``client_id``; True when the master
        needs the holder's report of what the disk holds (it did not have the disk online)."""
        disk = self.disks.get(info.name)
        if disk is not None and disk.online and disk.client_id == client_id:
            return False
        self._holders = None
        if disk is None:
            disk = self.disks[info.name] = Disk(info.name, client_id, info.engine, info.address, info.capacity,
                                                trust_report=True)
            logger.info("client %s mounted disk %s (%d bytes)", client_id, info.name, info.capacity)
        else:
            disk.client_id, disk.engine, disk.address = client_id, info.engine, info.address
            disk.capacity = info.capacity
            disk.online, disk.trust_report = True, False  # what it held is indexed here: the index decides
            logger.info("disk %s back online with client %s (%d records indexed)", info.name, client_id,
                        sum(1 for e in self.entries.values() if e.disk == info.name))
        if self.table.journal is not None:
            self.table.journal.add_everything(j.DiskMountOp(client_id, info.name, info.engine, info.address,
                                                            info.capacity))
        self._queue_holders_objects(client_id)
        return True

    def _queue_holders_objects(self, client_id: str) -> None:
        """Queues the objects ``client_id``'s memory holds that have no disk copy (put before its
        disks were known): one pass over the table, at a disk's registration."""
        segments = self.table.segments.segments
        mine = {name for name, seg in segments.items() if seg.client_id == client_id}
        queue = self.queues.setdefault(client_id, SpillQueue({}, {}))
        index = self.table.objects
        for key, v in index.raw_items():
            if type(v) is int:
                if not any(s in mine for s in index.segments_of(v)):
                    continue
                meta = index.unpack(v)  # (a copy: read only)
            else:
                meta = v
            if meta.put is not None or not any(s in mine for s in meta.replicas[::2]):
                continue
            entry = self.entries.get(key)
            if entry is None or entry.token != meta.token:
                (queue.urgent if self._urgent(meta) else queue.lazy)[key] = None

    def _urgent(self, meta: ObjectMeta) -> bool:
        """Whether write-through wants ``meta`` on disk at once, pressure or not."""
        return self.write_through == "all" or (self.write_through == "pinned" and meta.pin != Pin.NONE)

    def _spiller(self, meta: ObjectMeta) -> str | None:
        """The holder (with an online disk) whose memory has a replica of ``meta``, if any."""
        if not self.disks:
            return None
        segments = self.table.segments.segments
        holders = self._holders
        if holders is None:  # recounted after a disk came, went or changed hands: not per put
            holders = self._holders = {d.client_id for d in self.disks.values() if d.online}
        for name in meta.replicas[::2]:
            seg = segments.get(name)  # type: ignore[call-overload]
            if seg is not None and seg.client_id in holders:
                return seg.client_id
        return None

    def _done(self, client_id: str, done: p.SpillDone, report: bool) -> None:
        """A record ``client_id``'s disk holds: indexed when the master wants it, else freed."""
        disk = self.disks.get(done.disk)
        if disk is None or disk.client_id != client_id:
            return
        spill = self.under_way.get(done.key)
        if spill is not None and spill.token == done.token and spill.disk == done.disk and not report:
            del self.under_way[done.key]
            disk.used -= spill.footprint  # the entry below counts it again
            meta = self.table.objects.get(done.key)
            if meta is not None and meta.put is None and meta.token == done.token:
                self._index(done, disk)
                self.counters.spills += 1
                self.counters.spilled_bytes += done.size
                return
        elif report:
            entry = self.entries.get(done.key)
            if entry is not None and (entry.disk, entry.offset, entry.token) == (done.disk, done.offset, done.token):
                return  # known: nothing to do
            meta = self.table.objects.get(done.key)
            if entry is None and (meta is None or meta.token == done.token) and disk.trust_report:
                self._index(done, disk)  # a disk this master never indexed (none, or no journal): as reported
                return
        self.counters.stale_records += 1
        self.drops.setdefault(client_id, []).append(p.DiskDrop(done.disk, done.offset, done.key, done.token))

    def _index(self, done: p.SpillDone, disk: Disk) -> None:
        self.table.last_token = max(self.table.last_token, done.token)  # a reported version's token is never reused
        if done.key in self.entries:
            self.forget(done.key)
        self.entries[done.key] = DiskEntry(done.disk, done.offset, done.size, done.token, done.crc)
        disk.used += disk_footprint(done.size)
        if self.table.journal is not None:
            self.table.journal.add(j.DiskPutOp(done.key, done.disk, done.offset, done.size, done.token, done.crc),
                                   done.key)

    def _abandon(self, key: bytes, requeue: bool = True) -> None:
        """Ends the spill of ``key`` unfinished (its room freed); with ``requeue`` the object waits
        in its holder's queue again."""
        spill = self.under_way.pop(key)
        disk = self.disks.get(spill.disk)
        if disk is not None:
            disk.used -= spill.footprint
        meta = self.table.objects.get(key)
        queue = self.queues.get(spill.client_id)
        if requeue and meta is not None and queue is not None:
            (queue.urgent if self._urgent(meta) else queue.lazy)[key] = None

    def _tasks(self, queue: SpillQueue, mine: dict[str, Disk], segments: dict[str, int], pressure: bool,
               max_bytes: int, now: float, deadline_s: float, drops: list[p.DiskDrop]) -> list[p.SpillTask]:
        """The next spills for a holder with disks ``mine`` and memory ``segments``: the head of
        its urgent queue, then, under ``pressure``, of its lazy one."""
        tasks: list[p.SpillTask] = []
        budget = max_bytes
        objects = self.table.objects
        for waiting in (queue.urgent, queue.lazy) if pressure else (queue.urgent,):
            for key in list(itertools.islice(waiting, MAX_SCAN)):
                meta = objects.get(key)
                entry = self.entries.get(key)
                if meta is None or meta.put is not None or (entry is not None and entry.token == meta.token):
                    del waiting[key]  # gone, or on disk already
                    continue
                if key in self.under_way:
                    continue
                source = next(((s, o) for s, o in meta.replica_pairs() if s in segments), None)
                if source is None:
                    del waiting[key]  # no longer in this holder's memory
                    continue
                footprint = disk_footprint(meta.size)
                if footprint > budget:
                    return tasks
                disk = self._room(mine, footprint, now, drops)
                if disk is None:
                    continue
                del waiting[key]
                budget -= footprint
                disk.used += footprint
                self.under_way[key] = Spill(meta.token, disk.client_id, disk.name, footprint, now + deadline_s)
                tasks.append(p.SpillTask(key, meta.token, meta.size, segments[source[0]] + source[1], disk.name))
        return tasks

    def _room(self, mine: dict[str, Disk], footprint: int, now: float, drops: list[p.DiskDrop]) -> Disk | None:
        """The disk of ``mine`` with the most free bytes, made to fit ``footprint`` by evicting
        its least recently used unleased records (their frees go in ``drops``); None if none can."""
        disk = max(mine.values(), key=lambda d: d.capacity - d.used)
        if footprint > disk.capacity:
            return None
        if disk.capacity - disk.used >= footprint:
            return disk
        victims = []
        freed = disk.capacity - disk.used
        for key, entry in self.entries.items():
            if entry.disk != disk.name or entry.lease_until > now:
                continue
            victims.append(key)
            freed += disk_footprint(entry.size)
            if freed >= footprint or len(victims) >= MAX_SCAN:
                break
        if freed < footprint:
            return None
        for key in victims:
            gone = key not in self.table.objects
            self.forget(key)
            self.counters.disk_evictions += 1
            if gone:
                self.table.counters.evictions += 1
        drops += self.drops.pop(disk.client_id, [])
        return disk
