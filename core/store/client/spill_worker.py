"""A holder's side of the disk tier: spills the objects the master names to this holder's disks,
frees the records it no longer wants, and reports what the disks hold.

About once a heartbeat (at once while there is work) the worker sends ``Spills``: its disks, the
spills it finished and failed since. The master answers with records to free (done first, so a
spill finds the room the master counted on) and spills to make: each object is written from
this holder's own segment, where the master keeps it leased until the report. When the master
asks (it did not know a disk: a new disk, a restarted holder, a master without the index), the
next rounds report every record the disks hold. Disk hits the master hands back (``promote``)
are read into slots of this holder's segment, put under their own version. Neighbours: ``disk``
(the files), ``membership`` (runs this beside the heartbeat), ``poller`` (the loop),
``master.disks`` (the master's side).
"""

from __future__ import annotations

import logging
import threading

from tidekv.errors import OutOfSpaceError, TidekvError
from tidekv.store.client.disk import DiskRecord, DiskTier
from tidekv.store.client.master_client import MasterClient
from tidekv.store.client.poller import MasterPoller
from tidekv.store.wire import protocol as p

logger = logging.getLogger(__name__)

MAX_BYTES_PER_ROUND = 64 << 20
"""Bytes of spills asked for per request: a round stays short, and so does its report's wait."""
REPORT_BATCH = 4096
"""Records per request when reporting what the disks hold."""


class SpillWorker(MasterPoller):
    def __init__(self, rpc: MasterClient, tier: DiskTier, records: list[DiskRecord], engine: str, address: str,
                 client_id: str, interval_s: float, closed: threading.Event, segment: str = "") -> None:
        super().__init__("spills", client_id, interval_s, closed, at_once=True)  # the first round registers the disks
        self._rpc = rpc
        self._segment = segment
        self._tier = tier
        self._disks = [p.DiskInfo(name, engine, address, capacity)
                       for name, capacity in zip(tier.ids, tier.capacities, strict=True)]
        self._records: dict[tuple[int, int], DiskRecord] = {(r.disk, r.offset): r for r in records}
        self._lock = threading.Lock()
        # Sent with the next request: spills finished and failed, or (when the master asked) every record.
        self._done: list[p.SpillDone] = []
        self._failed: list[bytes] = []
        self._report: list[p.SpillDone] = []
        self.spilled = 0  # records written (for tests and stats)
        self.promoted = 0  # objects brought back to memory from disk
        self.registered = threading.Event()  # set once the master answered a round (it knows the disks)

    def records(self) -> list[DiskRecord]:
        """What this holder's disks hold now."""
        with self._lock:
            return list(self._records.values())

    def _ask(self) -> p.SpillWork:
        sending = self._report[:REPORT_BATCH]
        work: p.SpillWork = self._rpc.call(
            p.Spills(self._client_id, self._disks, sending or self._done, [] if sending else self._failed,
                     bool(sending), MAX_BYTES_PER_ROUND), failover_timeout_s=0)
        self.registered.set()
        if sending:
            del self._report[:len(sending)]
        else:
            self._done, self._failed = [], []
        return work

    def _work(self, work: p.SpillWork) -> bool:
        if work.report:
            self._report = [self._wire(r) for r in self.records()]
            logger.info("store client %s: reporting %d records on its disks to the master", self._client_id,
                        len(self._report))
        self._free(work.drops)
        if work.promote:
            self._promote(work.promote)
        done, failed = self._spill(work.tasks)
        self._done += done
        self._failed += failed
        return bool(work.tasks or work.drops or self._report or work.promote)

    def _free(self, drops: list[p.DiskDrop]) -> None:
        for drop in drops:
            disk = self._index(drop.disk)
            with self._lock:
                record = self._records.get((disk, drop.offset)) if disk is not None else None
                if record is None or record.key != drop.key or record.token != drop.token:
                    continue
                del self._records[(disk, drop.offset)]  # type: ignore[index]
            try:
                self._tier.free(record)
            except TidekvError as exc:
                logger.warning("store client %s: freeing a record on disk %s failed: %s", self._client_id,
                               drop.disk, exc)

    def _spill(self, tasks: list[p.SpillTask]) -> tuple[list[p.SpillDone], list[bytes]]:
        done: list[p.SpillDone] = []
        failed: list[bytes] = []
        if not tasks:
            return done, failed
        items = [(t.key, t.token, t.source, t.size, self._index(t.disk)) for t in tasks]
        results = self._tier.write_many(items)
        full = 0
        for task, result in zip(tasks, results, strict=True):
            if isinstance(result, DiskRecord):
                with self._lock:
                    self._records[(result.disk, result.offset)] = result
                done.append(self._wire(result))
                continue
            failed.append(task.key)
            if isinstance(result, OutOfSpaceError):
                full += 1
            else:
                logger.warning("store client %s: spilling an object of %d bytes failed: %s", self._client_id,
                               task.size, result)
        if full:
            logger.info("store client %s: %d spills found no room on their disk (fragmented); reported failed",
                        self._client_id, full)
        self.spilled += len(done)
        return done, failed

    def _promote(self, tasks: list[p.PromoteTask]) -> None:
        """Reads each record into a slot of this holder's segment and ends the put (a failed read
        revokes it: the object stays disk-only)."""
        try:
            slots: list[p.PutSlot] = self._rpc.call(p.PutStart(
                self._client_id, [t.key for t in tasks], [t.size for t in tasks], 1, self._segment,
                promote=[t.token for t in tasks]), failover_timeout_s=0)
            reads, placed = [], []
            for task, slot in zip(tasks, slots, strict=True):
                disk = self._index(task.disk)
                if slot.status != p.Status.OK or disk is None or not slot.locations:
                    continue
                record = DiskRecord(task.key, task.token, task.size, task.crc, disk, task.offset)
                reads.append((record, slot.locations[0].addr))
                placed.append(task)
            if not reads:
                return
            errors = self._tier.read_many(reads)
            ended = [t for t, e in zip(placed, errors, strict=True) if e is None]
            failed = [t for t, e in zip(placed, errors, strict=True) if e is not None]
            if ended:
                self._rpc.call(p.PutEnd(self._client_id, [t.key for t in ended], [t.token for t in ended]),
                               failover_timeout_s=0)
            if failed:
                logger.warning("store client %s: %d promotions failed reading the disk (first: %s)",
                               self._client_id, len(failed), errors[placed.index(failed[0])])
                self._rpc.call(p.PutRevoke(self._client_id, [t.key for t in failed], [t.token for t in failed]),
                               failover_timeout_s=0)
            self.promoted += len(ended)
        except TidekvError as exc:  # the master reclaims what was started and not ended
            logger.warning("store client %s: promoting %d objects from disk failed: %s", self._client_id,
                           len(tasks), exc)

    def _index(self, name: str) -> int | None:
        try:
            return self._tier.ids.index(name)
        except ValueError:
            return None

    def _wire(self, r: DiskRecord) -> p.SpillDone:
        return p.SpillDone(r.key, r.token, self._tier.ids[r.disk], r.offset, r.size, r.crc)
