"""Re-replication: objects that lost replicas get them back, copied by the holders themselves.

An object with fewer live replicas than its put's ``want`` is *degraded*. Holders ask for work
(``Repairs``, about once a heartbeat); the master hands each a few degraded objects its segment
can take (no replica there, in the object's pool, room: repairs never evict), reserving the
bytes. A success for the same version (put token) adds the replica; one for a version since gone
frees its bytes; a failure or overrun keeps the bytes reserved until the deadline. No lease is
taken. Every repair is journaled when handed out (``RepairOp``) and when it ends (``RepairedOp``);
a lapsed holder's repairs are cancelled, a dropped segment's go with it.

Neighbours: ``objects`` (owns the table this works on), ``master`` (the ``Repairs`` request,
timeouts on its tick), ``repair_worker`` (the holder's side).
Design notes: docs/store-design.md#tidekvstoremasterrepairs
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Container
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tidekv.store.allocator import align
from tidekv.store.master import journal as j
from tidekv.store.master.segments import Segment
from tidekv.store.wire import names
from tidekv.store.wire.protocol import RepairTask

if TYPE_CHECKING:
    from tidekv.store.master.objects import ObjectMeta, ObjectTable

logger = logging.getLogger(__name__)

MAX_SCAN = 4096
"""Degraded keys one ``Repairs`` request looks at, at most (it must not hold the event loop)."""


@dataclass(slots=True)
class Repair:
    token: int
    size: int
    segment: str
    offset: int
    client_id: str  # the holder making the copy (the segment's)
    deadline: float


@dataclass(slots=True)
class RepairCounters:
    started: int = 0
    done: int = 0  # copies that became replicas
    failed: int = 0  # reported failed, or past their deadline
    stale: int = 0  # the object was removed or replaced meanwhile


class RepairBook:
    """The repairs under way and the degraded objects of one ``ObjectTable``. Single-threaded."""

    def __init__(self, table: ObjectTable) -> None:
        self.table = table
        self.under_way: dict[bytes, Repair] = {}  # key -> its repair (one at a time per key)
        self.degraded: dict[bytes, None] = {}  # keys that may have fewer live replicas than wanted
        self.counters = RepairCounters()
        self.targets: dict[bytes, set[str]] = {}  # key -> the segments a task wants copies on (``tasks``)
        self.on_handed: Callable[[bytes, str, str], None] = lambda key, segment, client_id: None
        self.on_finished: Callable[[bytes, str, bool], None] = lambda key, segment, ok: None

    def check(self, key: bytes, meta: ObjectMeta) -> None:
        """Notes ``key`` as degraded when it has fewer live replicas than it wants."""
        if meta.put is None and len(meta.replicas) // 2 < meta.want:
            self.degraded[key] = None

    def take(self, client_id: str, segments: list[Segment], may_hold: Callable[[bytes, Segment], bool] | None,
             max_bytes: int, max_tasks: int, now: float, timeout_s: float) -> list[RepairTask]:
        """Repairs for ``client_id`` to make into ``segments`` (its own), up to ``max_bytes``."""
        table = self.table
        tasks: list[RepairTask] = []
        if not segments or not self.degraded:
            return tasks
        budget = max_bytes
        for key in list(self.degraded)[:MAX_SCAN]:
            meta = table.objects.get(key)
            wanted = self.targets.get(key)
            if meta is None or meta.put is not None or (len(meta.replicas) // 2 >= meta.want and not wanted):
                del self.degraded[key]  # gone, replaced (its new version was placed afresh), or whole again
                continue
            if key in self.under_way or align(meta.size) > budget or now < table.quarantine_until:
                continue
            if table.quotas is not None and not table.fits_quota(key, align(meta.size)):
                continue  # a copy counts against the tenant's quota like any replica
            have = set(meta.all_replicas[::2])
            for seg in segments:
                if seg.name in have or (may_hold is not None and not may_hold(key, seg)):
                    continue
                if wanted is not None and seg.name not in wanted:
                    continue  # a task's copy goes where the task says
                offset = table.segments.allocate_on(seg.name, meta.size)
                if offset is None:
                    continue
                deadline = now + timeout_s
                self.under_way[key] = Repair(meta.token, meta.size, seg.name, offset, client_id, deadline)
                if table.quotas is not None:
                    table.charge(key, align(meta.size))
                if table.journal is not None:
                    table.journal.add(j.RepairOp(key, meta.token, meta.size, seg.name, offset), key)
                tasks.append(RepairTask(key, meta.token, meta.size, seg.base + offset, table.locations(meta), timeout_s))
                self.on_handed(key, seg.name, client_id)
                self.counters.started += 1
                budget -= align(meta.size)
                break
            if len(tasks) >= max_tasks:
                break
        return tasks

    def finish(self, key: bytes, token: int, ok: bool, client_id: str, now: float) -> None:
        """A holder's report on its repair of ``key`` (a report for no repair of its is ignored)."""
        repair = self.under_way.get(key)
        if repair is None or repair.token != token or repair.client_id != client_id:
            return
        del self.under_way[key]
        table = self.table
        meta = table.objects.get(key) or table.suspended.get(key)
        current = meta is not None and meta.put is None and meta.token == token
        if ok and current and repair.segment in table.segments.segments:
            assert meta is not None
            meta.replicas += (repair.segment, repair.offset)
            if key in table.suspended:  # readable again through the copy
                del table.suspended[key]
                table.objects[key] = meta
            if len(meta.replicas) // 2 >= meta.want:
                self.degraded.pop(key, None)
            self.counters.done += 1
        elif ok:  # the copy is complete but nobody needs it: free at once
            table.segments.release(repair.segment, repair.offset, repair.size)
            if table.quotas is not None:
                table.charge(key, -align(repair.size))
            self.counters.stale += 1
        else:
            self._abandon(key, repair, now)
        if table.journal is not None:
            table.journal.add(j.RepairedOp(key, token, repair.segment, repair.offset, ok), key)
        if key in self.targets:
            self.on_finished(key, repair.segment, ok and current)

    def expire(self, now: float) -> None:
        """Gives up on repairs past their deadline."""
        late = [(k, r) for k, r in self.under_way.items() if r.deadline <= now]
        for key, repair in late:
            logger.warning("repair of key %r on segment %s missed its deadline", key[:64], names.plain(repair.segment))
            self.finish(key, repair.token, False, repair.client_id, now)

    def cancel_on(self, names: Container[str], now: float) -> None:
        """Segments suspended: their repairs end unfinished (bytes kept to the deadline)."""
        for key, repair in [(k, r) for k, r in self.under_way.items() if r.segment in names]:
            self.finish(key, repair.token, False, repair.client_id, now)

    def forget_on(self, names: Container[str]) -> None:
        """Segments dropped: their repairs' bytes went with them."""
        for key in [k for k, r in self.under_way.items() if r.segment in names]:
            repair = self.under_way.pop(key)
            if self.table.quotas is not None:
                self.table.charge(key, -align(repair.size))

    def snapshot(self) -> list[j.Op]:
        return [j.RepairOp(key, r.token, r.size, r.segment, r.offset) for key, r in self.under_way.items()]

    def restore(self, repairs: list[j.RepairOp], now: float, timeout_s: float,
                short: list[bytes] | None = None) -> None:
        """Repairs from a journal (their bytes already re-reserved): each ends by its holder's
        report to this master, or at a new deadline. ``short``: the objects with fewer replicas
        than they want, where the restore found them (None: found here, by a scan)."""
        segments = self.table.segments.segments
        for op in repairs:
            seg = segments.get(op.segment)
            if seg is not None:
                self.under_way[op.key] = Repair(op.token, op.size, op.segment, op.offset, seg.client_id, now + timeout_s)
        if short is None:
            short = self.table.objects.short_of_replicas_keys()
        self.degraded.update(dict.fromkeys(short))

    def _abandon(self, key: bytes, repair: Repair, now: float) -> None:
        table = self.table
        table.retired.add(max(repair.deadline, now), repair.size, (repair.segment, repair.offset),
                          names.tenant_of(key))
        self.counters.failed += 1
        meta = table.objects.get(key)
        if meta is not None:
            self.check(key, meta)
