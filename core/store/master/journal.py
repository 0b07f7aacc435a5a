"""The master's journal: every change of its index as an op, and a ``Mirror`` rebuilt from ops.

The tables emit one op per change; the ops go to a file in ``--state-dir`` (a restarting lone
master replays it) and to standbys (``replication``), and both rebuild the index in a ``Mirror``,
which ``MasterService.restore`` turns back into a serving master (allocated offsets re-reserved
from the replicas, so nothing live is handed out twice). Gets are not journaled, so the mirror
keeps freed bytes for a lease TTL after it learns of the free, and a restored master keeps what
it frees for a lease TTL after taking over. Suspended segments keep their objects and replicas.

On disk (``JournalFile``): an atomically written snapshot plus the logs since, whose frames are
written before the requests that made them are answered; a torn last frame is ignored and cut
off. A lone master folds its logs into a new snapshot in a forked child (``fold``).
Neighbours: ``objects``/``master`` emit ops, ``replication`` streams them, ``server`` writes them.
Design notes: docs/store-design.md#tidekvstoremasterjournal
"""

from __future__ import annotations

import collections
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Union
from zlib import crc32

import msgspec
from tidekv.store.allocator import RANGE_SHIFT, align
from tidekv.store.master.index import ObjectIndex, ObjectMeta
from tidekv.store.master.retired import KeptBytes
from tidekv.store.wire import protocol as p

logger = logging.getLogger(__name__)


class MountOp(msgspec.Struct, tag="mount", array_like=True):
    client_id: str
    name: str
    engine: str
    base: int
    capacity: int
    incarnation: str = ""  # the holder's secret (journals written before it have none)


class UnmountOp(msgspec.Struct, tag="unmount", array_like=True):
    names: list[str]


class SuspendOp(msgspec.Struct, tag="suspend", array_like=True):
    """Mounted segments whose holder lapsed, kept aside for ``grace_s``; pending puts lose their
    replicas there."""

    names: list[str]
    grace_s: float


class ResumeOp(msgspec.Struct, tag="resume", array_like=True):
    """A suspended segment mounted again by its holder, with the objects still holding a replica there."""

    name: str


class StartOp(msgspec.Struct, tag="start", array_like=True, gc=False):
    token: int
    key: bytes
    size: int
    replicas: list[object]  # flat: segment, offset, segment, offset, ...
    pin: int
    is_upsert: bool
    writer: str
    want: int = 0  # replicas asked for (0: as many as placed; journals written before it)


class EndOp(msgspec.Struct, tag="end", array_like=True):
    key: bytes
    token: int


class DropOp(msgspec.Struct, tag="drop", array_like=True):
    token: int


class RemoveOp(msgspec.Struct, tag="remove", array_like=True):
    key: bytes


class EvictOp(msgspec.Struct, tag="evict", array_like=True):
    keys: list[bytes]


class ObjectOp(msgspec.Struct, tag="object", array_like=True, gc=False):
    """A complete object (snapshots, and a put through a spare: ``ObjectTable.put_bind``). Neither it
    nor ``StartOp`` is in a reference cycle, so the collector does not track them (``gc=False``): a
    restore decodes ten million, and a standby's mirror keeps them."""

    key: bytes
    size: int
    replicas: list[object]
    pin: int
    token: int
    want: int = 0  # replicas asked for (0: as many as it has)
    used: int = 0  # its LRU stamp (snapshots: a restore keeps the order exactly); 0: none, newer than any


class RepairOp(msgspec.Struct, tag="repair", array_like=True):
    """A copy of object ``key`` (version ``token``) being made at ``offset`` of ``segment``:
    those bytes are reserved until it ends (``RepairedOp``)."""

    key: bytes
    token: int
    size: int
    segment: str
    offset: int


class RepairedOp(msgspec.Struct, tag="repaired", array_like=True):
    """A repair ended: with ``ok`` (and the object still that version) the copy is a replica;
    else its bytes are freed (kept a lease TTL when the copy may still be landing: not ok)."""

    key: bytes
    token: int
    segment: str
    offset: int
    ok: bool


class RetireOp(msgspec.Struct, tag="retire", array_like=True):
    """Bytes freed but perhaps still read under a lease (snapshots)."""

    size: int
    replicas: list[object]


class TokensOp(msgspec.Struct, tag="tokens", array_like=True):
    """The last put token handed out (snapshots): tokens are never reused."""

    last: int


class ChannelOp(msgspec.Struct, tag="channel", array_like=True):
    """Items appended to channel ``name`` (``channels``): their seqs and objects' keys, and the
    channel's counter after them (seqs are never reused)."""

    name: str
    seqs: list[int]
    keys: list[bytes]
    next_seq: int


class ChannelAckOp(msgspec.Struct, tag="channel_ack", array_like=True):
    """Items that left channel ``name`` (acknowledged, or their objects gone)."""

    name: str
    seqs: list[int]


class TaskOp(msgspec.Struct, tag="task", array_like=True):
    """A copy or move task as it now stands (``tasks``): the last one of an id is its state."""

    id: list[int]  # two 64-bit halves of a UUID
    kind: int
    key: bytes
    targets: list[str]
    source: str
    status: int
    created_ms: int
    updated_ms: int
    assigned: str = ""
    message: str = ""
    token: int = 0  # the version of the object the task works on


class DropReplicaOp(msgspec.Struct, tag="drop_replica", array_like=True):
    """An object's replica on ``segment`` dropped (a move's source): its bytes are freed."""

    key: bytes
    segment: str


class DiskMountOp(msgspec.Struct, tag="disk_mount", array_like=True):
    """A holder's disk registered, or back with it (``disks``)."""

    client_id: str
    name: str
    engine: str
    address: str
    capacity: int


class DiskUnmountOp(msgspec.Struct, tag="disk_unmount", array_like=True):
    """Disks dropped with every record on them."""

    names: list[str]


class DiskPutOp(msgspec.Struct, tag="disk_put", array_like=True):
    """An object's copy on a disk: the record at ``offset`` (replacing any other copy of ``key``)."""

    key: bytes
    disk: str
    offset: int
    size: int
    token: int
    crc: int


class DiskDropOp(msgspec.Struct, tag="disk_drop", array_like=True):
    """Disk copies dropped (evicted from their disk, removed, superseded)."""

    keys: list[bytes]


class ColumnsOp(msgspec.Struct, tag="columns", array_like=True):
    """A journal snapshot's packed objects follow, as ``ColumnPartOp``s of an ``ObjectIndex`` of
    ``shards`` shards whose segment numbers are ``segments`` and LRU clock ``clock``: what a
    restart adopts without an op per object (``index.ObjectIndex.column_parts``)."""

    shards: int
    segments: list[str]
    clock: int
    short: list[bytes] = []  # the keys of those with fewer replicas than they want (``repairs``)


class ColumnPartOp(msgspec.Struct, tag="column_part", array_like=True):
    """Packed objects of shard ``shard``, appended in order (``ObjectIndex.adopt_part``)."""

    shard: int
    data: bytes


class ColumnsFreeOp(msgspec.Struct, tag="columns_free", array_like=True):
    """The bytes of segment ``segment`` that the snapshot's packed objects leave free, as flat
    (offset, size, ...): a restart builds its allocator from them, not from every replica."""

    segment: str
    capacity: int
    free: list[int]


Op = Union[MountOp, UnmountOp, SuspendOp, ResumeOp, StartOp, EndOp, DropOp, RemoveOp, EvictOp, ObjectOp, RetireOp,
           TokensOp, RepairOp, RepairedOp, ChannelOp, ChannelAckOp, TaskOp, DropReplicaOp, DiskMountOp, DiskUnmountOp,
           DiskPutOp, DiskDropOp, ColumnsOp, ColumnPartOp, ColumnsFreeOp]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(list[Op])


def encode_ops(ops: list[Op]) -> bytes:
    return _encoder.encode(ops)


def decode_ops(data: bytes | memoryview) -> list[Op]:
    return _decoder.decode(data)


class OpLog:
    """The ops of changes not yet taken, and (``track_keys``) which keys have changes that are
    not yet committed, so a read waits only for the batches that touched what it reads.

    Ops collected now belong to batch ``seq``; ``take`` closes the batch. Single-threaded."""

    def __init__(self, track_keys: bool = False) -> None:
        self.ops: list[Op] = []
        self.seq = 1
        self._track = track_keys
        self._dirty: dict[bytes, int] = {}  # key -> last batch that changed it (uncommitted)
        self._dirty_all = 0  # last batch that changed keys it does not name (segments dropped)
        self._keys: list[bytes] = []
        self._batches: collections.deque[tuple[int, list[bytes]]] = collections.deque()

    def add(self, op: Op, *keys: bytes) -> None:
        self.ops.append(op)
        if self._track:
            for key in keys:
                self._dirty[key] = self.seq
            self._keys.extend(keys)

    def add_everything(self, op: Op) -> None:
        """An op that may change any key."""
        self.ops.append(op)
        self._dirty_all = self.seq

    def take(self) -> tuple[int, list[Op]]:
        """(seq, ops) of the batch collected so far ((0, []) when empty); a new batch starts."""
        if not self.ops:
            return 0, []
        seq, ops = self.seq, self.ops
        if self._track:
            self._batches.append((seq, self._keys))
            self._keys = []
        self.ops = []
        self.seq += 1
        return seq, ops

    def depends(self, keys: list[bytes]) -> int:
        """The last batch a read of ``keys`` must wait for (0: none)."""
        dirty = self._dirty
        last = self._dirty_all
        for key in keys:
            seq = dirty.get(key, 0)
            if seq > last:
                last = seq
        return last

    def committed(self, seq: int) -> None:
        """Batches up to ``seq`` are safe: their keys are no longer dirty."""
        batches, dirty = self._batches, self._dirty
        while batches and batches[0][0] <= seq:
            batch, keys = batches.popleft()
            for key in keys:
                if dirty.get(key, batch + 1) <= batch:
                    del dirty[key]


@dataclass
class Mirror:
    """The index rebuilt from ops, without allocators. ``lease_ttl_s`` is how long freed bytes
    are kept (see the module docstring); ``now`` is the caller's clock.

    A journal snapshot's packed objects (``ColumnsOp``) are kept as they were written, in
    ``base`` (an ``ObjectIndex`` a restore adopts whole), not as ops in ``objects``; ops after
    it change ``base`` in place, and the mirror books which replicas' bytes left or joined it
    since the snapshot's free ranges (``base_free``), so a restore builds each allocator from
    those, not from ten million replicas. ``objects`` then holds only what is not in ``base``."""

    lease_ttl_s: float
    segments: dict[str, MountOp] = field(default_factory=dict)
    suspended: dict[str, tuple[MountOp, float]] = field(default_factory=dict)  # name -> (mount, grace ends)
    objects: dict[bytes, ObjectOp] = field(default_factory=dict)  # complete, in LRU order
    pending: dict[int, StartOp] = field(default_factory=dict)
    retired: KeptBytes = field(default_factory=KeptBytes)  # freed bytes kept for the leases it cannot know
    repairs: dict[tuple[str, int], RepairOp] = field(default_factory=dict)  # (segment, offset) -> copy under way
    max_token: int = 0
    channels: dict[str, tuple[int, dict[int, bytes]]] = field(default_factory=dict)  # name -> (next seq, seq -> key)
    tasks: dict[tuple[int, int], TaskOp] = field(default_factory=dict)  # id -> the task's last state
    disks: dict[str, DiskMountOp] = field(default_factory=dict)
    disk_entries: dict[bytes, DiskPutOp] = field(default_factory=dict)  # key -> its disk copy, in LRU order
    base: ObjectIndex | None = None  # a snapshot's packed objects, as changed since
    base_free: dict[str, ColumnsFreeOp] = field(default_factory=dict)  # segment -> bytes the snapshot's base left free
    base_gone: dict[str, list[int]] = field(default_factory=dict)  # segment -> used ranges that left base since
    base_new: dict[str, list[int]] = field(default_factory=dict)  # segment -> used ranges that joined base since
    base_short: list[bytes] = field(default_factory=list)  # keys in base short of replicas at the snapshot
    base_changed: set[bytes] = field(default_factory=set)  # keys in base whose replicas changed since
    _touched: set[bytes] = field(default_factory=set)  # base objects unpacked in place by this apply

    def apply(self, ops: list[Op], now: float) -> None:
        """Applies ``ops`` in order. The three kinds almost every op is (a snapshot's objects, a
        put's start and end: what a restart replays a million of, and what a standby applies
        for every put while the leader waits for its ack) are handled inline, the rest by ``_apply``."""
        objects, pending, retired = self.objects, self.pending, self.retired
        base = self.base
        shards, mask = (base.dicts, base.shard_count - 1) if base is not None else ((), 0)
        top = self.max_token
        for op in ops:
            kind = type(op)
            if kind is ObjectOp:
                if base is not None and op.key in shards[crc32(op.key) & mask]:
                    self._base_pop(op.key)
                objects[op.key] = op
                if op.token > top:
                    top = op.token
            elif kind is StartOp:
                pending[op.token] = op
                if op.token > top:
                    top = op.token
                if retired:
                    retired.reused(op.size, op.replicas)
                if not op.is_upsert:
                    # A put (not an upsert) of a complete key: the key was suspended on the leader,
                    # and a put of it supersedes the suspended version (``ObjectTable.put_start``).
                    old = objects.pop(op.key, None)
                    if old is None and base is not None and op.key in shards[crc32(op.key) & mask]:
                        old = self._base_pop(op.key)
                    if old is not None:
                        self._retire(old.size, old.replicas, now)
            elif kind is EndOp:
                start = pending.pop(op.token, None)
                if start is None:
                    continue
                old = objects.pop(op.key, None)
                if old is None and base is not None and op.key in shards[crc32(op.key) & mask]:
                    old = self._base_pop(op.key)
                if old is not None:
                    self._retire(old.size, old.replicas, now)
                objects[op.key] = ObjectOp(op.key, start.size, start.replicas, start.pin, start.token, start.want)
            else:
                self.max_token = top
                self._apply(op, now)
                top = self.max_token
                if base is not self.base:  # a ColumnsOp sets it
                    base = self.base
                    shards, mask = (base.dicts, base.shard_count - 1) if base is not None else ((), 0)
        self.max_token = top
        if self._touched:
            self._settle_base()

    def _apply(self, op: Op, now: float) -> None:
        if isinstance(op, DropOp):
            self.pending.pop(op.token, None)
        elif isinstance(op, RemoveOp):
            old = self._pop(op.key)
            if old is not None:
                self._retire(old.size, old.replicas, now)
        elif isinstance(op, EvictOp):
            for key in op.keys:  # eviction takes only objects nobody holds a lease on
                self._pop(key)
        elif isinstance(op, MountOp):
            self.segments[op.name] = op
        elif isinstance(op, UnmountOp):
            self._unmount(set(op.names))
        elif isinstance(op, SuspendOp):
            self._suspend(set(op.names), now + op.grace_s, now)
        elif isinstance(op, ResumeOp):
            held = self.suspended.pop(op.name, None)
            if held is not None:
                self._trim_surplus(op.name)
                self.segments[op.name] = held[0]
        elif isinstance(op, ObjectOp):
            if self.base is not None and op.key in self.base:
                self._base_pop(op.key)
            self.objects[op.key] = op
            self.max_token = max(self.max_token, op.token)
        elif isinstance(op, ColumnsOp):
            self.base = ObjectIndex(op.shards)
            self.base.adopt_segments(op.segments, op.clock)
            self.base_short = list(op.short)
        elif isinstance(op, ColumnPartOp):
            if self.base is None:
                raise ValueError("a snapshot's column part before its ColumnsOp")
            self.base.adopt_part(op.shard, op.data)
        elif isinstance(op, ColumnsFreeOp):
            self.base_free[op.segment] = op
        elif isinstance(op, RetireOp):
            self._retire(op.size, op.replicas, now)
        elif isinstance(op, TokensOp):
            self.max_token = max(self.max_token, op.last)
        elif isinstance(op, RepairOp):
            if self.retired:  # placed like a put: on bytes whose leases were over by the leader's clock
                self.retired.reused(op.size, [op.segment, op.offset])
            self.repairs[(op.segment, op.offset)] = op
        elif isinstance(op, ChannelOp):
            next_seq, items = self.channels.get(op.name, (0, {}))
            items.update(zip(op.seqs, op.keys))
            self.channels[op.name] = (max(next_seq, op.next_seq), items)
        elif isinstance(op, TaskOp):
            self.tasks[(op.id[0], op.id[1])] = op
        elif isinstance(op, DropReplicaOp):
            obj = self._object(op.key)
            if obj is not None and op.segment in obj.replicas[::2]:
                i = obj.replicas[::2].index(op.segment) * 2
                self._retire(obj.size, obj.replicas[i:i + 2], now)
                obj.replicas = obj.replicas[:i] + obj.replicas[i + 2:]
        elif isinstance(op, ChannelAckOp):
            held = self.channels.get(op.name)
            if held is not None:
                for seq in op.seqs:
                    held[1].pop(seq, None)
        elif isinstance(op, DiskPutOp):
            self.disk_entries.pop(op.key, None)
            self.disk_entries[op.key] = op
            self.max_token = max(self.max_token, op.token)
        elif isinstance(op, DiskDropOp):
            for key in op.keys:
                self.disk_entries.pop(key, None)
        elif isinstance(op, DiskMountOp):
            self.disks[op.name] = op
        elif isinstance(op, DiskUnmountOp):
            gone = set(op.names)
            for name in gone:
                self.disks.pop(name, None)
            self.disk_entries = {k: e for k, e in self.disk_entries.items() if e.disk not in gone}
        elif isinstance(op, RepairedOp):
            repair = self.repairs.pop((op.segment, op.offset), None)
            if repair is None:
                return
            obj = self._object(op.key)
            if op.ok and obj is not None and obj.token == op.token:
                obj.replicas = _replicas(obj, [*obj.replicas, op.segment, op.offset])
            elif not op.ok:
                self._retire(repair.size, [op.segment, op.offset], now)

    # ---- objects, in ``objects`` or ``base`` -----------------------------------------------

    def _object(self, key: bytes) -> ObjectOp | ObjectMeta | None:
        """The object ``key`` to change in place: its op, or its record in ``base``."""
        obj = self.objects.get(key)
        if obj is None and self.base is not None:
            return self._base_record(key)
        return obj

    def _pop(self, key: bytes) -> ObjectOp | ObjectMeta | None:
        obj = self.objects.pop(key, None)
        if obj is None and self.base is not None:
            return self._base_pop(key)
        return obj

    def _base_pop(self, key: bytes) -> ObjectMeta | None:
        meta = self.base.pop(key, None)  # type: ignore[union-attr]
        if meta is not None:
            if key in self._touched:
                self._touched.discard(key)  # its bytes were booked as gone when it was first touched
            else:
                _book(self.base_gone, meta)
        return meta

    def _base_record(self, key: bytes) -> ObjectMeta | None:
        """A base object unpacked in place (``_settle_base`` packs it again after this apply):
        its bytes are booked as gone now, and as new again with its replicas then."""
        meta = self.base.get(key)  # type: ignore[union-attr]
        if meta is not None and key not in self._touched:
            self._touched.add(key)
            self.base_changed.add(key)
            _book(self.base_gone, meta)
        return meta

    def _settle_base(self) -> None:
        base = self.base
        assert base is not None
        for key in self._touched:
            meta = base.raw(key)
            assert isinstance(meta, ObjectMeta), "touched base objects stay records until settled"
            _book(self.base_new, meta)
        self._touched.clear()
        base.settle()

    def _each_object_on(self, names: set[str]) -> list[tuple[bytes, ObjectOp | ObjectMeta]]:
        """(key, object to change in place) of every object with a replica on a segment in ``names``."""
        out: list[tuple[bytes, ObjectOp | ObjectMeta]] = [
            (key, obj) for key, obj in self.objects.items() if any(s in names for s in obj.replicas[::2])]
        if self.base is not None:
            out += [(key, self._base_record(key)) for key in self.base.keys_on(names)]  # type: ignore[misc]
        return out

    def materialize(self) -> None:
        """Merges ``base`` into ``objects`` as ops (stamps kept, before the objects put since):
        the way every op and a restore read a mirror without a base. Shard by shard, each oldest
        first, as a leader's snapshot sends them to a standby."""
        base = self.base
        if base is None:
            return
        if self._touched:
            self._settle_base()
        merged = {k: ObjectOp(k, m.size, list(m.all_replicas), m.pin, m.token, m.want, m.used)
                  for k, m in base.items()}
        merged.update(self.objects)
        self.objects = merged
        self.base, self.base_free, self.base_gone, self.base_new = None, {}, {}, {}
        self.base_short, self.base_changed = [], set()

    @property
    def object_count(self) -> int:
        return len(self.objects) + (len(self.base) if self.base is not None else 0)

    def _trim_surplus(self, name: str) -> None:
        """As ``ObjectTable.resume_segment``: an object whose replicas on mounted segments make up
        its count drops its replica on the returning segment ``name``."""
        for _, obj in self._each_object_on({name}):
            segs = obj.replicas[::2]
            want = obj.want or len(segs)
            if sum(1 for s in segs if s in self.segments) >= want:
                obj.replicas = _replicas(obj, [v for i in range(0, len(obj.replicas), 2) if obj.replicas[i] != name
                                               for v in (obj.replicas[i], obj.replicas[i + 1])])

    def _retire(self, size: int, replicas: list[object], now: float) -> None:
        self.retired.add(now + self.lease_ttl_s, size, replicas)

    def forget_expired(self, now: float) -> None:
        """Drops freed bytes whose lease TTL has passed."""
        self.retired.expire(now)

    def _suspend(self, names: set[str], until: float, now: float) -> None:
        """As ``ObjectTable.suspend_segments``: objects keep their replicas there, pending puts do not."""
        for name in names:
            mount = self.segments.pop(name, None)
            if mount is not None:
                self.suspended[name] = (mount, until)
        for where in [w for w in self.repairs if w[0] in names]:  # cancelled (ObjectTable.suspend_segments)
            repair = self.repairs.pop(where)
            self._retire(repair.size, list(where), now)
        for token in list(self.pending):
            start = self.pending[token]
            left = [v for i in range(0, len(start.replicas), 2) if start.replicas[i] not in names
                    for v in (start.replicas[i], start.replicas[i + 1])]
            if not left:
                del self.pending[token]
            elif len(left) != len(start.replicas):
                start.replicas = left

    def _unmount(self, names: set[str]) -> None:
        """As ``ObjectTable.drop_segments``: replicas on the segments (mounted or suspended) go,
        objects left with none too."""
        for name in names:
            self.segments.pop(name, None)
            self.suspended.pop(name, None)
        self.repairs = {w: r for w, r in self.repairs.items() if w[0] not in names}

        def kept(replicas: list[object]) -> list[object]:
            return [v for i in range(0, len(replicas), 2) if replicas[i] not in names
                    for v in (replicas[i], replicas[i + 1])]

        for name in names:
            self.base_free.pop(name, None)
        for key, obj in self._each_object_on(names):
            left = kept(list(obj.replicas))
            if not left:
                self._pop(key)
            elif len(left) != len(obj.replicas):
                obj.replicas = _replicas(obj, left)
        for name in names:  # the base holds nothing there now (a name mounted again is a new segment)
            self.base_gone.pop(name, None)
            self.base_new.pop(name, None)
        for token in list(self.pending):
            start = self.pending[token]
            left = kept(start.replicas)
            if not left:
                del self.pending[token]
            elif len(left) != len(start.replicas):
                start.replicas = left
        self.retired.drop_segments(names)

    def ops(self, now: float) -> list[Op]:
        """Ops that rebuild this mirror from nothing (a snapshot; ``now`` for the graces left)."""
        self.materialize()
        out: list[Op] = [TokensOp(self.max_token), *self.segments.values()]
        for name, (mount, until) in self.suspended.items():
            out += [mount, SuspendOp([name], max(0.0, until - now))]
        out += self.objects.values()
        out += self.pending.values()
        out += [RetireOp(size, replicas) for _, size, replicas in self.retired]
        out += self.repairs.values()
        out += [ChannelOp(name, list(items), list(items.values()), next_seq)
                for name, (next_seq, items) in self.channels.items()]
        out += self.tasks.values()
        out += self.disks.values()
        out += self.disk_entries.values()
        return out


def _replicas(obj: ObjectOp | ObjectMeta, flat: list[object]) -> list[object] | tuple[object, ...]:
    """``flat`` as ``obj`` keeps its replicas (an op a list, a record a tuple)."""
    return flat if isinstance(obj, ObjectOp) else tuple(flat)


def _book(book: dict[str, list[int]], meta: ObjectMeta) -> None:
    """Books each replica of ``meta`` as an ``allocator.used_range`` at its aligned size."""
    size, r = align(meta.size), meta.all_replicas
    for i in range(0, len(r), 2):
        book.setdefault(r[i], []).append(r[i + 1] << RANGE_SHIFT | size)  # type: ignore[arg-type, operator]


class JournalFile:
    """The ops journal in a state directory: generation N is ``snapshot.N`` (absent for N = 0)
    followed by ``log.N``, ``log.N+1``, ... up to the log being appended. A fold cuts to the
    next log at once and writes that generation's snapshot (the index at the cut) later, in a
    child process (``fold.Fold``); the snapshot becomes current by its atomic rename, so a crash at
    any point leaves a consistent chain: the newest snapshot, then every log from its
    generation on (never a snapshot with a log whose ops it already holds). ``load`` first,
    then ``resume``; one writer."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        snapshots = [int(n[1]) for n in self._names("snapshot")]
        self.generation = max(snapshots, default=0)  # the newest snapshot's: where replay starts
        logs = {int(n[1]) for n in self._names("log")}
        self.current = self.generation  # the log appended to
        while self.current + 1 in logs:
            self.current += 1
        self._fd = -1
        self.log_bytes = 0  # of the current log
        snapshot = self._snapshot(self.generation)
        self.snapshot_bytes = snapshot.stat().st_size if snapshot.exists() else 0

    def _names(self, kind: str) -> list[list[str]]:
        names = [f.name.split(".") for f in self.dir.glob(f"{kind}.*")]
        return [n for n in names if len(n) == 2 and n[1].isdigit()]  # not a snapshot.N.tmp

    def _snapshot(self, generation: int) -> Path:
        return self.dir / f"snapshot.{generation}"

    def _log(self, generation: int) -> Path:
        return self.dir / f"log.{generation}"

    def load(self, mirror: Mirror, now: float) -> int:
        """Replays the newest snapshot and the logs after it into ``mirror``; returns how many
        ops it applied."""
        applied = 0
        chain = [self._snapshot(self.generation)] + [self._log(g) for g in range(self.generation, self.current + 1)]
        for path in chain:
            if not path.exists():
                continue
            data = memoryview(path.read_bytes())
            pos = 0
            while pos + p.FRAME_HEADER <= len(data):
                size = int.from_bytes(data[pos: pos + p.FRAME_HEADER], "little")
                if pos + p.FRAME_HEADER + size > len(data):
                    break
                ops = decode_ops(data[pos + p.FRAME_HEADER: pos + p.FRAME_HEADER + size])
                mirror.apply(ops, now)
                applied += len(ops)
                pos += p.FRAME_HEADER + size
            if pos != len(data):
                logger.warning("journal %s: ignoring %d bytes of a frame cut short (never acknowledged)", path,
                               len(data) - pos)
            if path == self._log(self.current):
                self.log_bytes = pos
        return applied

    def resume(self) -> None:
        """Opens the current log for appending after ``load``, cut after its last whole frame, and
        removes what no replay reads (older generations, a snapshot a crash left half written)."""
        self._fd = os.open(self._log(self.current), os.O_WRONLY | os.O_CREAT, 0o644)
        os.ftruncate(self._fd, self.log_bytes)
        os.lseek(self._fd, 0, os.SEEK_END)
        self._remove_before(self.generation)
        for tmp in self.dir.glob("snapshot.*.tmp"):
            tmp.unlink(missing_ok=True)

    def _remove_before(self, generation: int) -> None:
        for kind in ("snapshot", "log"):
            for name in self._names(kind):
                if int(name[1]) < generation:
                    (self.dir / ".".join(name)).unlink(missing_ok=True)

    def cut(self) -> int:
        """A fold's first half, on the writer: appending goes on in a new, empty log, and the
        generation returned is the one whose snapshot must hold the index as it is now."""
        new = self.current + 1
        fd = os.open(self._log(new), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        if self._fd >= 0:
            os.close(self._fd)
        self._fd, self.current, self.log_bytes = fd, new, 0
        return new

    def write_snapshot(self, generation: int, ops: Iterable[Op]) -> None:
        """A fold's second half (anywhere, the writer's forked child included): writes ``ops`` as
        ``generation``'s snapshot, synced, and renames it into place: from then on replay starts
        there. Ops go 65,536 to a frame, a column part (megabytes) in a frame of its own."""
        tmp = self.dir / f"snapshot.{generation}.tmp"
        with open(tmp, "wb") as f:
            batch: list[Op] = []
            for op in ops:
                if type(op) is ColumnPartOp:
                    if batch:
                        f.write(p.frame(encode_ops(batch)))
                        batch = []
                    f.write(p.frame(encode_ops([op])))
                    continue
                batch.append(op)
                if len(batch) == 65536:
                    f.write(p.frame(encode_ops(batch)))
                    batch = []
            if batch:
                f.write(p.frame(encode_ops(batch)))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self._snapshot(generation))
        directory = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(directory)  # the rename survives the machine's crash too
        finally:
            os.close(directory)

    def folded(self, generation: int) -> None:
        """Back on the writer once ``generation``'s snapshot is in place: the files before it go."""
        self.generation = generation
        self.snapshot_bytes = self._snapshot(generation).stat().st_size
        self._remove_before(generation)

    def rewrite(self, ops: Iterable[Op]) -> None:
        """A fold in the calling thread: a new generation whose snapshot is ``ops``, its log empty."""
        generation = self.cut()
        self.write_snapshot(generation, ops)
        self.folded(generation)

    def fold_due(self, min_bytes: int, ratio: float) -> bool:
        """Whether the current log has outgrown ``min_bytes`` and ``ratio`` times the last snapshot."""
        return self.log_bytes > max(min_bytes, ratio * self.snapshot_bytes)

    def append(self, ops: list[Op]) -> None:
        """Writes one batch of ops, framed. It is in the kernel when this returns: it survives the
        death of this process (SIGKILL), not of the machine (there is no fsync per batch)."""
        frame = p.frame(encode_ops(ops))
        view = memoryview(frame)
        while view:
            view = view[os.write(self._fd, view):]
        self.log_bytes += len(frame)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

