"""The object table: key -> size -> replicas, two-phase puts, upserts, read leases, pins.

States: a key is *pending* between put_start and put_end (invisible to readers), then
*complete*. Complete objects are immutable; an upsert writes a new version beside the old one
and put_end swaps them in one step, so a reader sees old or new, never a mix. Bytes a reader may
still hold a lease on (an upserted-over version) are freed only when that lease ends.

A *spare* (reserved ``spare_key``) is a pending put standing for its writer's next put of that
size, bound by ``put_bind``; at most one per writer, and only its writer may end it. Replicas on
a suspended segment are *held* (neither read nor freed) and given back when the holder returns;
an object with no other replica sits in ``suspended`` until superseded or resumed.

Neighbours: ``segments`` (placement and freeing), ``eviction`` (victim choice), ``master``
(drives the table from RPCs and its timer). Single-threaded.
Design notes: docs/store-design.md#tidekvstoremasterobjects
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Container, Iterable, Iterator, MutableMapping
from dataclasses import dataclass
from itertools import chain

from tidekv.store.allocator import RANGE_SHIFT, RANGE_SIZE, align, free_ranges
from tidekv.store.master import eviction
from tidekv.store.master import journal as j
from tidekv.store.master.disks import DiskTable
from tidekv.store.master.index import ObjectIndex, ObjectMeta, PendingPut
from tidekv.store.master.repairs import RepairBook
from tidekv.store.master.retired import RetiredBytes
from tidekv.store.master.segments import SegmentTable
from tidekv.store.wire import names
from tidekv.store.wire.protocol import SPARE_MARK, GetResult, Location, PutSlot, Status

logger = logging.getLogger(__name__)

def spare_key(key: bytes, token: int) -> bytes:
    """The reserved key of spare ``token``, in the tenant namespace of the (internal) ``key``."""
    return names.prefix(names.tenant_of(key)).encode() + SPARE_MARK + b"%d" % token


def is_spare(key: bytes) -> bool:
    """Whether the internal ``key`` is a spare's (``spare_key``)."""
    if key[:1] != b"\0":
        return False
    return key.startswith(SPARE_MARK) or key.startswith(SPARE_MARK, len(names.prefix(names.tenant_of(key))))


@dataclass(slots=True)
class TableCounters:
    evictions: int = 0
    evicted_bytes: int = 0
    puts_reclaimed: int = 0
    replicas_lost: int = 0
    objects_lost: int = 0
    objects_restored: int = 0  # objects that got their held replicas back (their holder came back)
    replicas_trimmed: int = 0  # held replicas freed when their holder came back: copies elsewhere had replaced them
    objects_superseded: int = 0  # objects held on a suspended segment that were replaced or removed meanwhile
    suspended_lost: int = 0  # objects lost because their holder did not come back within the grace


class ObjectTable:
    def __init__(self, segments: SegmentTable, max_key_bytes: int) -> None:
        self.segments = segments
        self.max_key_bytes = max_key_bytes
        self.objects = ObjectIndex()  # complete and pending, plain ones packed; by_age() is LRU order
        self.upserts: dict[bytes, ObjectMeta] = {}  # pending new versions of complete objects
        self.suspended: dict[bytes, ObjectMeta] = {}  # complete, every replica held: unreadable
        self.pending: dict[int, bytes] = {}  # token -> key of every pending put
        self.pending_by: dict[str, int] = {}  # writer -> how many pending puts it has (``max_pending_puts``)
        self.retired = RetiredBytes()  # bytes freed once the leases on them end
        self.counters = TableCounters()
        self.last_token = 0  # tokens are never reused, across restores too
        self.journal: j.OpLog | None = None  # when set, every change is added as an op
        self.quarantine_until = 0.0  # a restored table frees nothing before this (leases it cannot know)
        # With tenants (``tenants``): each tenant's quota in bytes (absent: unlimited), and the
        # bytes its objects occupy - every replica of every version, pending or retired. None:
        # no tenants, nothing counted.
        self.quotas: dict[str, int] | None = None
        self.usage: dict[str, int] = {}
        self.repairs = RepairBook(self)
        self.disks = DiskTable(self)  # copies on holders' disks (the disk tier)
        self.spares: dict[str, int] = {}  # writer -> the token of its spare (absent from pending once ended)

    # ---- writes -------------------------------------------------------------------------

    def put_start(
        self, writer: str, key: bytes, size: int, replicas: int, preferred: str, pin: int, upsert: bool, now: float,
        pool: Container[str] | None = None, avoid: Container[str] | None = None,
    ) -> PutSlot:
        """``pool``: the tenants whose segments may hold the object (None: any segment);
        ``avoid``: engines whose segments may not (the writer could not reach them)."""
        if is_spare(key):
            return PutSlot(Status.INVALID)
        return self._start(writer, key, size, replicas, preferred, pin, upsert, now, pool, avoid)

    def _start(
        self, writer: str, key: bytes, size: int, replicas: int, preferred: str, pin: int, upsert: bool, now: float,
        pool: Container[str] | None = None, avoid: Container[str] | None = None, spare: bytes | None = None,
        evict: bool = True,
    ) -> PutSlot:
        """put_start of any key; with ``spare`` (the key of the writer's spare, ``put_bind``) the
        object takes the spare's bytes instead of new ones; without ``evict``, it takes only free
        bytes (a quota is then checked, not made room in)."""
        if not key or len(key) > self.max_key_bytes or size <= 0 or replicas < 1 or pin not in (0, 1, 2):
            return PutSlot(Status.INVALID)
        if not upsert and type(self.objects.raw(key)) is int:
            return PutSlot(Status.EXISTS)  # complete (a saver's put of a block the pool has: no unpacking)
        existing = self.objects.get(key)
        if existing is not None and existing.put is not None:
            # Another writer's put of the key is under way: a put is a no-op. This writer's own
            # (a put_start whose answer it never got, across a failover) would never end: the
            # newer put replaces it, as an upsert replaces anyone's.
            if not upsert and existing.put.writer != writer:
                return PutSlot(Status.EXISTS)
            self._drop_pending(existing.put.token)
            existing = None
        if existing is not None and not upsert:
            return PutSlot(Status.EXISTS)
        if existing is None and not upsert and key in self.disks.entries:
            return PutSlot(Status.EXISTS)  # complete, on a disk only
        older = self.upserts.get(key)
        if older is not None and older.put is not None:
            self._drop_pending(older.put.token)
        # An upsert never evicts the version it replaces: readers must find the old version or
        # the new one, never neither.
        keep = key if existing is not None else None
        only = None
        if spare is not None:
            placed = self._take_spare(spare)  # its bytes, charged to this tenant already
        else:
            if self.quotas is not None and not evict:
                if not self.fits_quota(key, align(size) * replicas):
                    return PutSlot(Status.QUOTA)
            elif self.quotas is not None:
                only = names.owns(names.tenant_of(key))  # a tenant's put evicts its own objects only
                refusal = self._fit_quota(key, align(size) * replicas, now, keep, only)
                if refusal:
                    return PutSlot(Status.QUOTA, detail=refusal)
            if evict:
                placed = self._allocate(size, replicas, preferred, now, keep, pool, only, avoid)
            else:
                placed = self.segments.allocate(size, replicas, preferred, pool, avoid)
            if not placed:
                return PutSlot(Status.OUT_OF_SPACE)
            if self.quotas is not None:
                self.charge(key, align(size) * len(placed))
        token = self.last_token = self.last_token + 1
        flat = placed[0] if len(placed) == 1 else tuple(v for pair in placed for v in pair)
        meta = ObjectMeta(size, flat, PendingPut(token, writer, now, existing is not None), pin, token, replicas)
        if existing is not None:
            self.upserts[key] = meta
        else:
            self.objects[key] = meta
            if self.suspended:
                held = self.suspended.pop(key, None)
                if held is not None:  # a put of a suspended key replaces it (as the journal's Mirror does)
                    self._retire(key, held, now)
        self.pending[token] = key
        self.pending_by[writer] = self.pending_by.get(writer, 0) + 1
        if self.journal is not None:
            self.journal.add(j.StartOp(token, key, size, list(flat), pin, existing is not None, writer, replicas), key)
        return PutSlot(Status.OK, token, self.locations(meta))

    def reserve(self, writer: str, key: bytes, size: int, replicas: int, preferred: str, now: float,
                pool: Container[str] | None = None) -> PutSlot:
        """A spare of ``size`` bytes for ``writer``, in the tenant namespace of ``key`` (an
        internal key it is putting): a pending put of a reserved key, on free bytes only (a
        reservation never evicts anyone's objects). The writer's previous spare is dropped."""
        self.drop_spare(writer)
        slot = self._start(writer, spare_key(key, self.last_token + 1), size, replicas, preferred, 0, False, now, pool,
                           evict=False)
        if slot.status == Status.OK:
            self.spares[writer] = slot.token
        return slot

    def drop_spare(self, writer: str) -> None:
        """Frees ``writer``'s spare, if it has one (a writer asking for a spare uses none)."""
        old = self.spares.pop(writer, None)
        if old is not None and old in self.pending and is_spare(self.pending[old]):
            self._drop_pending(old)

    def put_bind(self, writer: str, token: int, key: bytes, size: int, pin: int, upsert: bool,
                 now: float) -> Status:
        """Makes ``writer``'s spare ``token`` (of ``size`` bytes) the object ``key``: OK, EXISTS (a
        no-op put; the spare stays), STALE (no such spare: reclaimed, or its segment lost) or
        INVALID (a bad key, or a spare of another size or tenant)."""
        spare = self.pending.get(token)
        meta = self.objects.get(spare) if spare is not None and is_spare(spare) else None
        if meta is None or meta.put is None or meta.put.token != token or meta.put.writer != writer:
            return Status.STALE
        if meta.size != size or names.tenant_of(spare) != names.tenant_of(key):  # type: ignore[arg-type]
            return Status.INVALID
        if is_spare(key) or not key or len(key) > self.max_key_bytes or pin not in (0, 1, 2):
            return Status.INVALID
        if key not in self.objects and key not in self.upserts and key not in self.suspended \
                and key not in self.disks.entries:
            # A new key (the common case): the spare's entry becomes the object, token and all.
            self._take_spare(spare)
            meta.put, meta.pin = None, pin
            self.objects[key] = meta
            self.repairs.check(key, meta)  # a replica of the spare's may have gone with its holder
            if self.journal is not None:
                self.journal.add(j.ObjectOp(key, size, list(meta.replicas), pin, token, meta.want), key)
            if self.disks.disks:
                self.disks.published(key, meta)
            return Status.OK
        slot = self._start(writer, key, size, meta.want, "", pin, upsert, now, spare=spare)
        if slot.status != Status.OK:
            return Status(slot.status)
        return self.put_end(key, slot.token, now)

    def live_spares(self) -> list[ObjectMeta]:
        """Every writer's spare that is still reserved."""
        out = []
        for token in self.spares.values():
            key = self.pending.get(token)
            meta = self.objects.get(key) if key is not None else None
            if meta is not None and meta.put is not None and meta.put.token == token:
                out.append(meta)
        return out

    def promote_start(self, writer: str, key: bytes, token: int, segment: str, now: float) -> PutSlot:
        """A memory replica for the disk-only object ``key`` (version ``token``) on ``segment``, its
        holder's own, in free bytes only: a pending put under the version's own token, which the
        holder fills from its disk and ends like any put (the disk copy stays: same version).
        STALE when the disk no longer holds that version alone, OUT_OF_SPACE without room."""
        entry = self.disks.entries.get(key)
        if entry is None or entry.token != token or key in self.objects or key in self.upserts \
                or token in self.pending:
            return PutSlot(Status.STALE)
        seg = self.segments.segments.get(segment)
        if seg is None or seg.client_id != writer:
            return PutSlot(Status.INVALID)
        if self.quotas is not None and not self.fits_quota(key, align(entry.size)):
            return PutSlot(Status.QUOTA)
        offset = self.segments.allocate_on(segment, entry.size)
        if offset is None:
            return PutSlot(Status.OUT_OF_SPACE)
        if self.quotas is not None:
            self.charge(key, align(entry.size))
        meta = ObjectMeta(entry.size, (segment, offset), PendingPut(token, writer, now, False), 0, token, 1)
        self.objects[key] = meta
        self.pending[token] = key
        self.pending_by[writer] = self.pending_by.get(writer, 0) + 1
        if self.journal is not None:
            self.journal.add(j.StartOp(token, key, entry.size, [segment, offset], 0, False, writer, 1), key)
        return PutSlot(Status.OK, token, self.locations(meta))

    def put_end(self, key: bytes, token: int, now: float) -> Status:
        """Publishes the put ``token`` of ``key``; OK again for a put already ended (a writer that
        retried across a failover), STALE for one that was revoked or reclaimed."""
        meta = self._pending_meta(key, token)
        if meta is None or meta.put is None:
            done = self.objects.raw(key)
            if type(done) is int:
                return Status.OK if ObjectIndex.token_of(done) == token else Status.STALE
            return Status.OK if done is not None and done.put is None and done.token == token else Status.STALE
        del self.pending[token]
        self._ended(meta.put.writer)
        if meta.put.is_upsert:
            del self.upserts[key]
            old = self.objects.pop(key, None)
            if old is not None:
                self._retire(key, old, now)
        else:
            self.objects.pop(key, None)
        meta.put = None
        self.objects[key] = meta  # newest at the LRU end
        if self.journal is not None:
            self.journal.add(j.EndOp(key, token), key)
        if self.disks.disks:
            self.disks.published(key, meta)
        return Status.OK

    def put_revoke(self, key: bytes, token: int, writer: str) -> Status:
        """Drops the pending put ``token`` of ``key``; token 0: whatever put of ``key`` ``writer``
        has pending (a writer whose put_start failed without an answer cleans up with it)."""
        if token == 0:
            mine = [m for m in (self.objects.get(key), self.upserts.get(key))
                    if m is not None and m.put is not None and m.put.writer == writer]
            for meta in mine:
                assert meta.put is not None
                self._drop_pending(meta.put.token)
            return Status.OK if mine else Status.STALE
        if self._pending_meta(key, token) is None:
            return Status.STALE
        self._drop_pending(token)
        return Status.OK

    def remove(self, key: bytes, force: bool, now: float) -> Status:
        """Deletes the complete object ``key``, readable or suspended (its holder then gets no
        version of it back)."""
        table = self.objects
        meta = table.get(key)
        if meta is None and self.suspended:
            table = self.suspended
            meta = table.get(key)
        if meta is None or meta.put is not None:
            if not self.disks.entries:
                return Status.NOT_FOUND
            entry = self.disks.entries.get(key)
            promoting = meta is not None and meta.put is not None and entry is not None and entry.token == meta.token
            status = self.disks.remove(key, force, now)
            if status == Status.OK and promoting:
                self._drop_pending(meta.token)  # type: ignore[union-attr]  # its promotion: no version is left
            return status
        if meta.lease_until > now and not force:
            return Status.LEASED
        del table[key]
        self._retire(key, meta, now)
        if self.journal is not None:
            self.journal.add(j.RemoveOp(key), key)
        if self.disks.entries:
            self.disks.forget(key)
        return Status.OK

    # ---- reads --------------------------------------------------------------------------

    def get(self, key: bytes, lease_s: float, now: float) -> GetResult:
        index = self.objects
        meta = index.raw(key)
        if type(meta) is int:
            v = index.read(key, now + lease_s)
            return GetResult(Status.OK, index.size_of(v), index.locations_of(v, self.segments.segments))
        if meta is None or meta.put is not None:
            return self.disks.get(key, lease_s, now) if self.disks.entries else GetResult(Status.NOT_FOUND)
        until = now + lease_s
        if until > meta.lease_until:
            meta.lease_until = until
        self.objects.move_to_end(key)
        return GetResult(Status.OK, meta.size, self.locations(meta))

    def want(self, key: bytes) -> int:
        """How many replicas the object ``key`` asked for (1 when there is no such object)."""
        v = self.objects.raw(key)
        if v is None:
            return 1
        return ObjectIndex.want_of(v) if type(v) is int else v.want  # type: ignore[union-attr]

    def drop_replica(self, key: bytes, segment: str) -> None:
        """Drops ``key``'s replica on ``segment`` (a move's source); its bytes are freed when the
        reads leased on the object are over."""
        meta = self.objects.get(key)
        if meta is None or segment not in meta.replicas[::2]:
            return
        i = meta.replicas[::2].index(segment) * 2
        dropped = meta.replicas[i:i + 2]
        meta.replicas = meta.replicas[:i] + meta.replicas[i + 2:]
        free_at = max(meta.lease_until, self.quarantine_until)
        self.retired.add(free_at, meta.size, dropped, names.tenant_of(key))
        if self.journal is not None:
            self.journal.add(j.DropReplicaOp(key, segment), key)

    def exists(self, key: bytes) -> bool:
        meta = self.objects.raw(key)
        if type(meta) is int:
            return True
        if meta is None or meta.put is not None:
            return bool(self.disks.entries) and self.disks.engine(key) is not None
        return True

    def engines(self, key: bytes) -> list[str]:
        """Transfer engines whose segments hold a replica of the complete object ``key``
        (none if absent); no lease, no LRU touch."""
        meta = self.objects.raw(key)
        if type(meta) is int:
            segments = self.segments.segments
            return list(dict.fromkeys(segments[name].engine for name in self.objects.segments_of(meta)))
        if meta is None or meta.put is not None:
            engine = self.disks.engine(key) if self.disks.entries else None
            return [engine] if engine is not None else []
        return list(dict.fromkeys(loc.engine for loc in self.locations(meta)))

    # ---- housekeeping -------------------------------------------------------------------

    def reclaim_stale_puts(self, now: float, put_timeout_s: float, dead_writers: set[str]) -> int:
        """Drops pending puts older than the timeout or whose writer died; returns how many."""
        stale = []
        for token, key in self.pending.items():
            meta = self._pending_meta(key, token)
            assert meta is not None and meta.put is not None
            if meta.put.writer in dead_writers or now - meta.put.started > put_timeout_s:
                stale.append(token)
        spares = 0
        for token in stale:
            key = self.pending[token]
            if is_spare(key):
                spares += 1  # an unused reservation, not a failed put
            else:
                logger.warning("reclaimed unfinished put of key %r (token %d)", key[:64], token)
            self._drop_pending(token)
        self.counters.puts_reclaimed += len(stale) - spares
        return len(stale) - spares

    def free_retired(self, now: float) -> None:
        for _, size, replicas, tenant in self.retired.pop_due(now):
            self._release(size, replicas)
            if tenant is not None and self.quotas is not None:
                self.usage[tenant] -= align(size) * (len(replicas) // 2)

    def drop_segments(self, names: set[str]) -> None:
        """Forgets replicas on dropped segments (unmounted, or suspended ones whose grace ended);
        objects left with none readable or held are gone, those left with held ones suspended."""
        if not names:
            return
        self.repairs.forget_on(names)
        for table in (self.objects, self.upserts, self.suspended):
            for key in self._keys_on(table, names):
                meta = table[key]
                replicas, held = _without(meta.replicas, names), _without(meta.held, names)
                if len(replicas) == len(meta.replicas) and len(held) == len(meta.held):
                    continue
                lost = (len(meta.replicas) - len(replicas) + len(meta.held) - len(held)) // 2
                spare = meta.put is not None and is_spare(key)  # a reservation: nothing of anyone's is lost
                if not spare:
                    self.counters.replicas_lost += lost
                if self.quotas is not None:
                    self.charge(key, -align(meta.size) * lost)
                meta.replicas, meta.held = replicas, held
                if replicas:
                    self.repairs.check(key, meta)
                    continue
                if held:
                    if table is not self.suspended:
                        del table[key]
                        self.suspended[key] = meta
                    continue
                del table[key]
                self.counters.objects_lost += 0 if spare else 1
                if meta.put is not None:
                    self.pending.pop(meta.put.token, None)
                    self._ended(meta.put.writer)
        retired = []
        for t, size, r, tenant in self.retired:
            kept = _without(r, names)
            if tenant is not None and self.quotas is not None and len(kept) != len(r):
                self.usage[tenant] -= align(size) * ((len(r) - len(kept)) // 2)
            retired.append((t, size, kept, tenant))
        self.retired = RetiredBytes(retired)

    def suspend_segments(self, names: set[str], now: float) -> dict[str, int]:
        """Holds the replicas on ``names`` (segments just suspended): complete objects keep them in
        ``held`` (one left with no readable replica moves to ``suspended``); pending puts lose
        them, their bytes freed (a put left with no replica is dropped: its writer's put_end
        answers STALE), and repairs there end unfinished. Returns, per segment, how many objects
        hold a replica there."""
        self.repairs.cancel_on(names, now)
        held_on = dict.fromkeys(names, 0)
        for table in (self.objects, self.upserts):
            for key in self._keys_on(table, names):
                meta = table[key]
                if not any(s in names for s in meta.replicas[::2]):
                    continue
                replicas = _without(meta.replicas, names)
                moved = [(s, o) for s, o in meta.replica_pairs() if s in names]
                meta.replicas = replicas
                if meta.put is not None:
                    for seg, offset in moved:
                        self.segments.release(seg, offset, meta.size)
                    if self.quotas is not None:
                        self.charge(key, -align(meta.size) * len(moved))
                    if not replicas:
                        del table[key]
                        del self.pending[meta.put.token]
                        self._ended(meta.put.writer)
                        self.counters.puts_reclaimed += 0 if is_spare(key) else 1
                    continue
                meta.held += tuple(v for pair in moved for v in pair)
                for seg, _ in moved:
                    held_on[seg] += 1
                if not replicas:
                    del table[key]
                    self.suspended[key] = meta
                else:
                    self.repairs.check(key, meta)
        return held_on

    def resume_segment(self, name: str) -> int:
        """Gives the replicas held on ``name`` (a suspended segment mounted again) back to their
        objects, which are readable again; returns how many objects got one back. A replica an
        object no longer needs (copies elsewhere made up its count meanwhile: ``repairs``) is
        freed instead (``Mirror`` does the same on its ``ResumeOp``)."""
        restored = 0
        for table in (self.objects, self.suspended):
            for key in self._keys_on(table, {name}, held=True):
                meta = table[key]
                if not meta.held or name not in meta.held[::2]:
                    continue
                back = tuple(v for s, o in _pairs(meta.held) if s == name for v in (s, o))
                meta.held = _without(meta.held, {name})
                if len(meta.replicas) // 2 >= meta.want:
                    self._release(meta.size, back)
                    if self.quotas is not None:
                        self.charge(key, -align(meta.size) * (len(back) // 2))
                    self.counters.replicas_trimmed += 1
                    continue
                meta.replicas += back
                restored += 1
                if table is self.suspended:
                    del table[key]
                    self.objects[key] = meta  # at the most-recently-used end
        self.counters.objects_restored += restored
        return restored

    def evict(self, bytes_needed: int, now: float, keep: bytes | None = None,
              only: Callable[[bytes], bool] | None = None) -> int:
        """Evicts LRU objects (never ``keep``; with ``only``, only keys it accepts) to free about
        ``bytes_needed``; returns bytes freed."""
        if now < self.quarantine_until:
            return 0  # any object may be read under a lease granted before the restore
        candidates = self.objects.oldest()
        spilling = self.disks.under_way  # kept in memory until their holder has written them to disk
        if keep is not None or only is not None or spilling:
            candidates = (c for c in self.objects.oldest()
                          if c[0] != keep and (only is None or only(c[0])) and c[0] not in spilling)
        victims = eviction.select_victims(candidates, now, bytes_needed)
        freed = 0
        for key in victims:
            meta = self.objects.pop(key)
            if self.disks.disks:
                self.disks.evicted(key, meta)  # it may stay in the pool, disk-only
            if meta.held:
                self.counters.objects_superseded += 1
            n = len(meta.replicas) // 2
            freed += align(meta.size) * n
            self._release(meta.size, meta.all_replicas)
            if self.quotas is not None:
                self.charge(key, -align(meta.size) * (len(meta.all_replicas) // 2))
            self.counters.evictions += 1
            self.counters.evicted_bytes += meta.size
        if victims:
            logger.debug("evicted %d objects (%d bytes)", len(victims), freed)
            if self.journal is not None:
                self.journal.add(j.EvictOp(victims), *victims)
        return freed

    def restore(self, mirror: j.Mirror, now: float) -> list[bytes] | None:
        """Fills an empty table from ``mirror`` (segments must be restored first): its objects,
        its pending puts (ended by their writers' put_end, or reclaimed as usual), and bytes kept
        for leases; nothing it frees is reused before ``now + mirror.lease_ttl_s``. Tenants' usage
        is the caller's to count, once the repairs are restored too (``MasterService.restore``).
        Returns the keys short of replicas where the load found them, else None (scan for them)."""
        # In the mirror's order (the snapshot's, then the puts since), which ``load`` keeps; a
        # million objects at a promotion, so one comprehension.
        if mirror.base is not None:  # a journal snapshot's packed objects, adopted whole; the puts since after them
            index = self.objects
            index.adopt(mirror.base)
            short = index.load_ops(mirror.objects.values())
            if short is not None:  # and the base's: short at the snapshot, or changed since and short now
                short += [k for k in dict.fromkeys(chain(mirror.base_short, mirror.base_changed))
                          if index.is_short_of_replicas(k)]
        elif self.segments.suspended:
            readable = self._hold_suspended([(op.key, ObjectMeta(op.size, tuple(op.replicas), None, op.pin, op.token,
                                                                 op.want)) for op in mirror.objects.values()])
            self.objects.load(readable)  # type: ignore[arg-type]
            short = None
        else:  # packed straight from the ops, with the stamps they were snapshotted with
            short = self.objects.load_ops(mirror.objects.values())
        for start in mirror.pending.values():
            meta = ObjectMeta(start.size, tuple(start.replicas), PendingPut(start.token, start.writer, now,
                                                                            start.is_upsert), start.pin, start.token,
                              start.want)
            (self.upserts if start.is_upsert else self.objects)[start.key] = meta
            self.pending[start.token] = start.key
            self.pending_by[start.writer] = self.pending_by.get(start.writer, 0) + 1
            if is_spare(start.key):
                self.spares[start.writer] = start.token
        self.quarantine_until = now + mirror.lease_ttl_s
        # Whose retired bytes these were is not kept: they count against no quota until freed.
        self.retired = RetiredBytes((max(t, self.quarantine_until), size, tuple(replicas), None)
                                    for t, size, replicas in mirror.retired)
        self.last_token = mirror.max_token
        return short

    def _hold_suspended(self, restored: list[tuple[bytes, ObjectMeta]]) -> list[tuple[bytes, ObjectMeta]]:
        """Restored objects with replicas on suspended segments hold those aside; the ones left with
        no readable replica go to ``suspended``. Returns the rest (readable), in order."""
        suspended = self.segments.suspended
        readable = []
        for key, meta in restored:
            if any(s in suspended for s in meta.replicas[::2]):
                meta.replicas, meta.held = _without(meta.replicas, suspended), _only(meta.replicas, suspended)
                for seg in meta.held[::2]:
                    suspended[seg].objects += 1  # type: ignore[index]
                if not meta.replicas:
                    self.suspended[key] = meta
                    continue
            readable.append((key, meta))
        return readable

    def snapshot(self, columns: bool = False) -> Iterable[j.Op]:
        """Ops that rebuild this table (after the segments' MountOps). With ``columns`` (a journal's
        snapshot), the packed objects go as column parts, with each segment's bytes they leave
        free (``journal.ColumnsOp``); the parts are made as the result is iterated."""
        out: list[j.Op] = [j.TokensOp(self.last_token)]
        parts: Iterable[j.Op] = ()
        if columns:
            index = self.objects
            out.append(j.ColumnsOp(index.shard_count, list(index.seg_names), index.clock,
                                   index.short_of_replicas_keys(packed_only=True)))
            parts = (j.ColumnPartOp(shard, data) for shard, data in index.column_parts())
            used = index.used_ranges()
            for name, seg in self.segments.segments.items():
                free = free_ranges(seg.capacity, used.pop(name, []))
                out.append(j.ColumnsFreeOp(name, seg.capacity, [v for r in free for v in (r >> RANGE_SHIFT,
                                                                                          r & RANGE_SIZE)]))
            if used:
                raise AssertionError(f"packed objects on segments not mounted: {sorted(used)}")
            out += self.objects.object_ops(j.ObjectOp, records_only=True)
        else:  # shard by shard, each oldest first: LruTable.load
            out += self.objects.object_ops(j.ObjectOp)
        out += [j.ObjectOp(key, meta.size, list(meta.all_replicas), meta.pin, meta.token, meta.want, meta.used)
                for key, meta in self.suspended.items() if meta.put is None]
        for table in (self.objects.record_items(), self.upserts.items()):  # a pending put is a record
            for key, meta in table:
                if meta.put is not None:
                    out.append(j.StartOp(meta.put.token, key, meta.size, list(meta.replicas), meta.pin,
                                         meta.put.is_upsert, meta.put.writer, meta.want))
        out += [j.RetireOp(size, list(replicas)) for _, size, replicas, _ in self.retired]
        out += self.repairs.snapshot() + self.disks.snapshot()
        return chain(out, parts) if columns else out

    def count_usage(self) -> dict[str, int]:
        """Each tenant's bytes counted from scratch (what ``usage`` keeps up to date)."""
        usage: dict[str, int] = {}
        footprint = self.objects.footprint
        for table in (self.objects.raw_items(), self.upserts.items(), self.suspended.items()):
            for key, meta in table:
                t = names.tenant_of(key)
                usage[t] = usage.get(t, 0) + (footprint(meta) if type(meta) is int  # type: ignore[arg-type]
                                              else align(meta.size) * (len(meta.all_replicas) // 2))
        for _, size, replicas, t in self.retired:
            if t is not None:
                usage[t] = usage.get(t, 0) + align(size) * (len(replicas) // 2)
        for key, repair in self.repairs.under_way.items():
            t = names.tenant_of(key)
            usage[t] = usage.get(t, 0) + align(repair.size)
        return usage

    # ---- internals ----------------------------------------------------------------------

    def _fit_quota(self, key: bytes, need: int, now: float, keep: bytes | None,
                   only: Callable[[bytes], bool]) -> str:
        """Makes room for ``need`` more bytes in the quota of ``key``'s tenant by evicting its own
        objects; returns why not ("" when they fit)."""
        assert self.quotas is not None
        tenant = names.tenant_of(key)
        quota = self.quotas.get(tenant)
        if quota is None or self.usage.get(tenant, 0) + need <= quota:
            return ""
        if need > quota:
            return (f"tenant {tenant!r}: the object needs {need} bytes (every replica), more than the tenant's whole "
                    f"quota of {quota} bytes")
        self.free_retired(now)
        used = self.usage.get(tenant, 0)
        if used + need > quota:
            self.evict(used + need - quota, now, keep, only)
            self.free_retired(now)
            used = self.usage.get(tenant, 0)
        if used + need <= quota:
            return ""
        return (f"tenant {tenant!r} uses {used} of its quota of {quota} bytes and the object needs {need} more; "
                "what it holds beyond that is being written, read under a lease or pinned")

    def fits_quota(self, key: bytes, nbytes: int) -> bool:
        """Whether ``nbytes`` more fit in the quota of ``key``'s tenant as it stands (with quotas)."""
        assert self.quotas is not None
        tenant = names.tenant_of(key)
        quota = self.quotas.get(tenant)
        return quota is None or self.usage.get(tenant, 0) + nbytes <= quota

    def charge(self, key: bytes, nbytes: int) -> None:
        """Adds ``nbytes`` (negative: frees) to the usage of ``key``'s tenant (with quotas)."""
        tenant = names.tenant_of(key)
        self.usage[tenant] = self.usage.get(tenant, 0) + nbytes

    def _allocate(self, size: int, replicas: int, preferred: str, now: float, keep: bytes | None = None,
                  pool: Container[str] | None = None, only: Callable[[bytes], bool] | None = None,
                  avoid: Container[str] | None = None) -> list[tuple[str, int]]:
        placed = self.segments.allocate(size, replicas, preferred, pool, avoid)
        if placed or not self.segments.fits_anywhere(size, pool, avoid):
            return placed
        # Full: evict LRU objects and retry; fragmentation may need a few rounds.
        need = align(size) * replicas
        for _ in range(4):
            self.free_retired(now)
            if self.evict(need, now, keep, only) == 0 and self.retired.next_due() > now:
                break  # nothing evictable and nothing due: another round would find the same
            placed = self.segments.allocate(size, replicas, preferred, pool, avoid)
            if placed:
                return placed
            need *= 2
        return []

    def _keys_on(self, table: MutableMapping[bytes, ObjectMeta], names: Container[object],
                 held: bool = False) -> list[bytes]:
        """Keys of ``table`` with a replica (with ``held``: a held one) on ``names``; packed objects
        are read without unpacking (they hold none)."""
        if table is not self.objects:
            return [k for k, m in table.items() if any(s in names for s in (m.held if held else m.all_replicas)[::2])]
        segments_of = self.objects.segments_of
        return [k for k, m in self.objects.raw_items()
                if ((not held and any(s in names for s in segments_of(m))) if type(m) is int
                    else any(s in names for s in (m.held if held else m.all_replicas)[::2]))]

    def _pending_meta(self, key: bytes, token: int) -> ObjectMeta | None:
        for meta in (self.upserts.get(key), self.objects.raw(key)):
            if meta is not None and type(meta) is not int and meta.put is not None and meta.put.token == token:
                return meta  # type: ignore[return-value]
        return None

    def _ended(self, writer: str) -> None:
        left = self.pending_by[writer] - 1
        if left:
            self.pending_by[writer] = left
        else:
            del self.pending_by[writer]

    def _drop_pending(self, token: int) -> None:
        key = self.pending.pop(token)
        meta = self._pending_meta(key, token)
        assert meta is not None and meta.put is not None
        self._ended(meta.put.writer)
        if self.spares.get(meta.put.writer) == token:
            del self.spares[meta.put.writer]
        if meta.put.is_upsert:
            del self.upserts[key]
        else:
            del self.objects[key]
        self._release(meta.size, meta.replicas)
        if self.quotas is not None:
            self.charge(key, -align(meta.size) * (len(meta.replicas) // 2))
        if self.journal is not None:
            self.journal.add(j.DropOp(token), key)

    def _take_spare(self, key: bytes) -> list[tuple[str, int]]:
        """Ends the spare under ``key`` without freeing its bytes: the caller's object takes them."""
        meta = self.objects.pop(key)
        assert meta.put is not None
        if self.spares.get(meta.put.writer) == meta.put.token:
            del self.spares[meta.put.writer]
        del self.pending[meta.put.token]
        self._ended(meta.put.writer)
        if self.journal is not None:
            self.journal.add(j.DropOp(meta.put.token), key)
        return list(_pairs(meta.replicas))

    def _retire(self, key: bytes, meta: ObjectMeta, now: float) -> None:
        if meta.held:
            self.counters.objects_superseded += 1  # its holder, when back, gets no version of it
        replicas = meta.all_replicas
        free_at = max(meta.lease_until, self.quarantine_until)
        if free_at > now:
            self.retired.add(free_at, meta.size, replicas, names.tenant_of(key))
        else:
            self._release(meta.size, replicas)
            if self.quotas is not None:
                self.charge(key, -align(meta.size) * (len(replicas) // 2))

    def _release(self, size: int, replicas: tuple[object, ...]) -> None:
        for seg, offset in _pairs(replicas):
            self.segments.release(seg, offset, size)

    def locations(self, meta: ObjectMeta) -> list[Location]:
        segments, r, size = self.segments.segments, meta.replicas, meta.size
        out = []
        for i in range(0, len(r), 2):
            seg = segments[r[i]]  # type: ignore[index]
            out.append(Location(r[i], seg.engine, seg.base + r[i + 1], size))  # type: ignore[arg-type, operator]
        return out


def _pairs(flat: tuple[object, ...]) -> Iterator[tuple[str, int]]:
    for i in range(0, len(flat), 2):
        yield flat[i], flat[i + 1]  # type: ignore[misc]


def _without(flat: tuple[object, ...], names: Container[object]) -> tuple[object, ...]:
    """The (segment, offset) pairs of ``flat`` not on ``names``."""
    return tuple(v for s, o in _pairs(flat) if s not in names for v in (s, o))


def _only(flat: tuple[object, ...], names: Container[object]) -> tuple[object, ...]:
    """The (segment, offset) pairs of ``flat`` on ``names``."""
    return tuple(v for s, o in _pairs(flat) if s in names for v in (s, o))
