"""``ObjectIndex``: the object table's key -> object map (``shards.LruTable``), with every plain
object packed into one int.

A plain object is complete (no put under way), has every replica readable (none held) and fits
the fields below: it is its key, its dict entry and one int of 64 bytes (one replica), about 215
bytes with 64-byte keys against about 460 as a record. The rest (pending puts, objects with held
replicas, the odd huge one) stay ``ObjectMeta`` records in a side dict, their shard entry a marker
int carrying only the LRU stamp, so shards hold nothing the cycle collector tracks.

Reading an object through ``index[key]`` or ``get`` unpacks it in place (it becomes a record), so
the caller holds the table's own record and may change it; ``settle`` packs such records again
(the master calls it after every request and tick, so none outlives the request that unpacked
it). ``pop``, ``items``, ``values`` and ``by_age`` give unpacked copies: change an object through
``index[key]``. The master's hot paths (get, exists, locate, eviction) read the ints unpacked.

Layout, lowest bits first: LRU stamp (48), lease end in 2^-20 s rounded up (52), pin (2), replicas
wanted (6), token (48), size (40), replica count (4), then per replica the segment's number in
this index (20) and the offset (44). Design notes: docs/store-design.md#the-object-index-packed
"""
from __future__ import annotations

import io
import math
import pickle
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from itertools import chain, islice
from typing import Any
from zlib import crc32

from tidekv.store.allocator import ALIGNMENT, RANGE_SHIFT, align
from tidekv.store.master.shards import LruTable
from tidekv.store.wire.protocol import Location

_USED_BITS, _LEASE_BITS = 48, 52
_LEASE_SHIFT = _USED_BITS
_PIN_SHIFT = _LEASE_SHIFT + _LEASE_BITS  # 100
_WANT_SHIFT = _PIN_SHIFT + 2  # 102
_TOKEN_SHIFT = _WANT_SHIFT + 6  # 108
_SIZE_SHIFT = _TOKEN_SHIFT + 48  # 156
_COUNT_SHIFT = _SIZE_SHIFT + 40  # 196
_REPLICAS_SHIFT = _COUNT_SHIFT + 4  # 200
_SEG_BITS, _OFFSET_BITS = 20, 44
_REPLICA_BITS = _SEG_BITS + _OFFSET_BITS

_USED = (1 << _USED_BITS) - 1
_LEASE = (1 << _LEASE_BITS) - 1
_WANT = 63
_TOKEN = (1 << 48) - 1
_SIZE = (1 << 40) - 1
_COUNT = 15
_SEG = (1 << _SEG_BITS) - 1
_OFFSET = (1 << _OFFSET_BITS) - 1
_STAMPLESS = ~((1 << _PIN_SHIFT) - 1)  # every field but the stamp and the lease
_PACKED = 1 << _COUNT_SHIFT  # every packed object is at least this (one replica); a marker is below

TICKS = 1 << 20  # lease ends are kept in 2^-20 s (about a µs), rounded up: a lease never ends early
COLUMN_OBJECTS = 65536  # packed objects per part of a snapshot's columns


class _PlainUnpickler(pickle.Unpickler):
    """Loads only what pickle builds without naming a class (dicts, bytes, ints): a snapshot's
    columns, never code."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"a snapshot's columns hold only keys and ints, not {module}.{name}")



@dataclass(slots=True)
class PendingPut:
    token: int
    writer: str
    started: float
    is_upsert: bool


class ObjectMeta:
    """One object as a record. ``replicas`` is flat: (segment, offset, segment, offset, ...);
    ``held``, as flat, its replicas on suspended segments (complete objects only)."""

    __slots__ = ("size", "replicas", "put", "lease_until", "pin", "token", "held", "want", "used")

    def __init__(self, size: int, replicas: tuple[object, ...], put: PendingPut | None, pin: int, token: int,
                 want: int = 0) -> None:
        self.want = want or len(replicas) // 2  # replicas asked for (``repairs`` restores lost ones)
        self.size = size
        self.replicas = replicas
        self.put = put
        self.lease_until = 0.0  # no lease
        self.pin = pin
        self.token = token  # the put that wrote this version (put_end quoting it again is answered OK)
        self.held: tuple[object, ...] = ()
        self.used = 0  # when last touched (``shards``: set by the object table)

    @property
    def all_replicas(self) -> tuple[object, ...]:
        """Replicas readable or held: the bytes this version occupies."""
        return self.replicas + self.held if self.held else self.replicas

    @property
    def is_pending(self) -> bool:
        return self.put is not None

    def replica_pairs(self) -> Iterator[tuple[str, int]]:
        r = self.replicas
        for i in range(0, len(r), 2):
            yield r[i], r[i + 1]  # type: ignore[misc]


def lease_ticks(until: float) -> int:
    return math.ceil(until * TICKS) if until > 0 else 0


class ObjectIndex(LruTable[bytes, ObjectMeta]):
    """Key -> ``ObjectMeta`` in LRU order; plain objects kept packed (module docstring)."""

    __slots__ = ("_live", "_records", "_seg_ids", "seg_names")

    def __init__(self, shards: int = 16) -> None:
        super().__init__(shards)
        self._records: dict[bytes, ObjectMeta] = {}  # objects not packed; their shard entry is a marker
        self._seg_ids: dict[str, int] = {}
        self.seg_names: list[str] = []  # a segment's number -> its name; numbers are never reused
        self._live: list[bytes] = []  # keys unpacked in place since the last ``settle``

    # ---- packing ------------------------------------------------------------------------

    def pack(self, meta: ObjectMeta, used: int) -> int | None:
        """``meta`` as an int with stamp ``used``; None when it is not plain."""
        if meta.put is not None or meta.held:
            return None
        v = self.pack_fields(meta.size, meta.replicas, meta.pin, meta.token, meta.want)
        if v is None:
            return None
        lease = lease_ticks(meta.lease_until)
        return v | lease << _LEASE_SHIFT | used & _USED if lease <= _LEASE else None

    def pack_fields(self, size: int, replicas: tuple[object, ...] | list[object], pin: int, token: int,
                    want: int) -> int | None:
        """A complete object with every replica readable, as an int with no stamp and no lease;
        None when a field does not fit (a restore packs a million objects with it)."""
        count = len(replicas) >> 1
        want = want or count
        if not 0 < count <= _COUNT or want > _WANT or size > _SIZE or token > _TOKEN:
            return None
        v = (pin << _PIN_SHIFT | want << _WANT_SHIFT | token << _TOKEN_SHIFT | size << _SIZE_SHIFT
             | count << _COUNT_SHIFT)
        ids, shift = self._seg_ids, _REPLICAS_SHIFT
        for i in range(0, len(replicas), 2):
            name, offset = replicas[i], replicas[i + 1]
            seg = ids.get(name)  # type: ignore[call-overload]
            if seg is None:
                seg = self._seg_id(name)  # type: ignore[arg-type]
                if seg is None:
                    return None
            if not 0 <= offset <= _OFFSET:  # type: ignore[operator]
                return None
            v |= (seg | offset << _SEG_BITS) << shift  # type: ignore[operator]
            shift += _REPLICA_BITS
        return v

    def pack_ops(self, ops: Iterable[Any]) -> list[tuple[bytes, int | ObjectMeta]]:
        """(key, packed object) of journal ``ObjectOp``s, a record where one does not fit: a restore's
        million objects, the one-replica case inline."""
        ids, out = self._seg_ids, []
        fixed: dict[int, int] = {}  # size * 4 + pin -> those fields, one replica, wanted one
        placed: dict[str, int] = {}  # segment name -> its number, in place
        token_shift, offset_shift = _TOKEN_SHIFT, _REPLICAS_SHIFT + _SEG_BITS
        for op in ops:
            r = op.replicas
            if len(r) == 2 and op.want <= 1 and op.token <= _TOKEN and 0 <= r[1] <= _OFFSET:
                base = fixed.get(op.size * 4 + op.pin)
                seg = placed.get(r[0])
                if base is None and op.size <= _SIZE and 0 <= op.pin <= 3:
                    base = fixed[op.size * 4 + op.pin] = (op.pin << _PIN_SHIFT | 1 << _WANT_SHIFT
                                                          | op.size << _SIZE_SHIFT | 1 << _COUNT_SHIFT)
                if seg is None and ids.get(r[0]) is not None:
                    seg = placed[r[0]] = ids[r[0]] << _REPLICAS_SHIFT
                if base is not None and seg is not None:
                    out.append((op.key, base | seg | op.token << token_shift | r[1] << offset_shift))
                    continue
            v = self.pack_fields(op.size, op.replicas, op.pin, op.token, op.want)
            out.append((op.key, v if v is not None else
                        ObjectMeta(op.size, tuple(op.replicas), None, op.pin, op.token, op.want)))
        return out

    def load_ops(self, ops: Iterable[Any]) -> list[bytes] | None:
        """Fills the index from journal ``ObjectOp``s of keys it does not hold, in a mirror's order
        (after what it holds: a snapshot's columns adopted): a restore's ten million objects, so
        one pass with the one-replica case inline and nothing built between. Each keeps the LRU
        stamp it was snapshotted with, so the order survives a restart exactly; one without (a put
        since the snapshot, in the order put) is newer than everything before it. Returns the keys
        of the objects loaded with fewer replicas than they want (``repairs``), found on the way.
        Into an empty index, a journal written before snapshots carried stamps is placed as
        ``load`` places pairs; then None (the caller scans: ``short_of_replicas_keys``)."""
        ops = iter(ops)
        first = next(ops, None)
        if first is None:
            return []
        ops = chain((first,), ops)
        if not first.used and not self:
            self.load(self.pack_ops(ops))
            return None
        shards, records, mask = self._shards, self._records, self._mask
        top = self._clock
        last = [top] * (mask + 1)  # each shard's newest stamp: a shard stays in stamp order
        short: list[bytes] = []
        # One replica, wanted once: every field but token, offset and stamp comes from (size, pin,
        # segment), which in a pool of one object size repeat from one object to the next.
        size = pin = name = None
        fields: int | None = None
        token_shift, gap = _TOKEN_SHIFT, _REPLICAS_SHIFT + _SEG_BITS - _TOKEN_SHIFT
        for op in ops:
            key = op.key
            i = crc32(key) & mask
            used = op.used
            if used <= last[i]:
                used = top + 1 if not used else last[i] + 1
            last[i] = used
            if used > top:
                top = used
            r = op.replicas
            if len(r) == 2 and op.want <= 1:
                if op.size != size or op.pin != pin or r[0] != name:
                    size, pin, name = op.size, op.pin, r[0]
                    seg = self._seg_id(name) if 0 <= size <= _SIZE and 0 <= pin <= 3 else None  # type: ignore
                    fields = None if seg is None else (pin << _PIN_SHIFT | 1 << _WANT_SHIFT | size << _SIZE_SHIFT
                                                       | 1 << _COUNT_SHIFT | seg << _REPLICAS_SHIFT)  # type: ignore
                token, offset = op.token, r[1]
                if fields is not None and token <= _TOKEN and 0 <= offset <= _OFFSET:
                    shards[i][key] = (offset << gap | token) << token_shift | fields | used  # type: ignore[assignment]
                    continue
            v = self.pack_fields(op.size, r, op.pin, op.token, op.want)
            if v is None:
                meta = records[key] = ObjectMeta(op.size, tuple(r), None, op.pin, op.token, op.want)
                meta.used = used
                shards[i][key] = used  # type: ignore[assignment]  # a marker
                if len(r) // 2 < meta.want:
                    short.append(key)
            else:
                shards[i][key] = v | used  # type: ignore[assignment]
                if v >> _COUNT_SHIFT & _COUNT < v >> _WANT_SHIFT & _WANT:
                    short.append(key)
        self._clock = top
        return short

    def object_ops(self, op: Callable[..., Any], records_only: bool = False) -> list[Any]:
        """``op(key, size, replicas, pin, token, want, used)`` of every complete object (with
        ``records_only``, of the complete records: what ``column_parts`` leaves out), in ``items``
        order (a snapshot's: packed objects read without unpacking)."""
        out = []
        replicas_of, names = self.replicas_of, self.seg_names
        records = self._records
        if records_only:
            return [op(key, m.size, list(m.all_replicas), m.pin, m.token, m.want, self._used(self.raw_stamp(key)))
                    for key, m in records.items() if m.put is None]
        for key, v in super().items():
            if v >= _PACKED:  # type: ignore[operator]
                if v >> _COUNT_SHIFT & _COUNT == 1:  # type: ignore[operator]
                    rep = v >> _REPLICAS_SHIFT  # type: ignore[operator]
                    replicas = [names[rep & _SEG], rep >> _SEG_BITS & _OFFSET]
                else:
                    replicas = list(replicas_of(v))  # type: ignore[arg-type]
                out.append(op(key, v >> _SIZE_SHIFT & _SIZE, replicas, v >> _PIN_SHIFT & 3,  # type: ignore[operator]
                              v >> _TOKEN_SHIFT & _TOKEN, v >> _WANT_SHIFT & _WANT, v & _USED))  # type: ignore[operator]
            elif records[key].put is None:
                m = records[key]
                out.append(op(key, m.size, list(m.all_replicas), m.pin, m.token, m.want, v))  # v: the marker's stamp
        return out

    # ---- a snapshot's columns (``journal.ColumnsOp``) ------------------------------------

    def column_parts(self) -> Iterator[tuple[int, bytes]]:
        """(shard, part) of every packed object, shard by shard, each in its order: a part is a
        pickled dict of up to ``COLUMN_OBJECTS`` keys -> packed ints, leases dropped (they are
        the old process's clock). What a restore adopts without an op per object (``adopt_part``)."""
        keep = ~(_LEASE << _LEASE_SHIFT)
        packed = _PACKED
        for i, shard in enumerate(self._shards):
            items = iter(shard.items())
            while chunk := list(islice(items, COLUMN_OBJECTS)):
                yield i, pickle.dumps({k: v & keep for k, v in chunk if v >= packed}, protocol=5)  # type: ignore

    def adopt_segments(self, seg_names: list[str], clock: int) -> None:
        """Before ``adopt_part`` into this empty index: the writer's segment numbers and LRU clock."""
        assert not self and not self.seg_names, "adopt into an empty index"
        self.seg_names = list(seg_names)
        self._seg_ids = {name: i for i, name in enumerate(seg_names)}
        self._clock = clock

    def adopt_part(self, shard: int, part: bytes | memoryview) -> None:
        """Appends a part of ``column_parts`` to shard ``shard`` (in order, after what it holds)."""
        values = _PlainUnpickler(io.BytesIO(part)).load()
        if type(values) is not dict:
            raise pickle.UnpicklingError(f"a snapshot's column part is a {type(values).__name__}, not a dict")
        self._shards[shard].update(values)

    def adopt(self, other: ObjectIndex) -> None:
        """Takes over ``other``'s objects (this index empty): a restore adopting a mirror's base."""
        assert not self, "adopt into an empty index"
        other.settle()
        self._shards, self._mask, self._clock = other._shards, other._mask, other._clock
        self._records, self._seg_ids, self.seg_names = other._records, other._seg_ids, other.seg_names
        other._shards = [{} for _ in other._shards]
        other._records, other._seg_ids, other.seg_names = {}, {}, []

    def used_ranges(self) -> dict[str, list[int]]:
        """Per segment, the ``allocator.used_range`` of every packed object's replica there, at its
        aligned size: what a snapshot's free ranges leave out (records are not counted)."""
        by_seg: list[list[int]] = [[] for _ in self.seg_names]
        up, down, packed = ALIGNMENT - 1, ~(ALIGNMENT - 1), _PACKED
        for v in super().values():
            if v < packed:  # type: ignore[operator]
                continue
            size = ((v >> _SIZE_SHIFT & _SIZE) + up) & down  # type: ignore[operator]
            count = v >> _COUNT_SHIFT & _COUNT  # type: ignore[operator]
            rep = v >> _REPLICAS_SHIFT  # type: ignore[operator]
            for _ in range(count):
                by_seg[rep & _SEG].append((rep >> _SEG_BITS & _OFFSET) << RANGE_SHIFT | size)
                rep >>= _REPLICA_BITS
        return {self.seg_names[i]: ranges for i, ranges in enumerate(by_seg) if ranges}

    def keys_on(self, names: set[str]) -> list[bytes]:
        """Keys of the objects with a replica (readable or held) on one of the segments ``names``."""
        out = [key for key, meta in self._records.items() if any(s in names for s in meta.all_replicas[::2])]
        ids = {self._seg_ids[n] for n in names if n in self._seg_ids}
        if not ids:
            return out
        for key, v in super().items():
            if v >= _PACKED:  # type: ignore[operator]
                rep = v >> _REPLICAS_SHIFT  # type: ignore[operator]
                for _ in range(v >> _COUNT_SHIFT & _COUNT):  # type: ignore[operator]
                    if rep & _SEG in ids:
                        out.append(key)
                        break
                    rep >>= _REPLICA_BITS
        return out

    def unpack(self, v: int) -> ObjectMeta:
        meta = ObjectMeta(v >> _SIZE_SHIFT & _SIZE, self.replicas_of(v), None, v >> _PIN_SHIFT & 3,
                          v >> _TOKEN_SHIFT & _TOKEN, v >> _WANT_SHIFT & _WANT)
        meta.lease_until = (v >> _LEASE_SHIFT & _LEASE) / TICKS
        meta.used = v & _USED
        return meta

    def _seg_id(self, name: str) -> int | None:
        seg = self._seg_ids.get(name)
        if seg is None:
            if len(self.seg_names) > _SEG:
                return None  # a million segments mounted in this master's life: records from here on
            seg = self._seg_ids[name] = len(self.seg_names)
            self.seg_names.append(name)
        return seg

    def _used(self, value: int) -> int:  # type: ignore[override]
        return value & _USED

    def _restamp(self, value: int, used: int) -> int:  # type: ignore[override]
        return value & ~_USED | used

    # ---- fields of a packed object (``raw`` values that are ints) -------------------------

    @staticmethod
    def size_of(v: int) -> int:
        return v >> _SIZE_SHIFT & _SIZE

    @staticmethod
    def token_of(v: int) -> int:
        return v >> _TOKEN_SHIFT & _TOKEN

    @staticmethod
    def lease_of(v: int) -> float:
        return (v >> _LEASE_SHIFT & _LEASE) / TICKS

    @staticmethod
    def pin_of(v: int) -> int:
        return v >> _PIN_SHIFT & 3

    @staticmethod
    def want_of(v: int) -> int:
        return v >> _WANT_SHIFT & _WANT

    @staticmethod
    def footprint(v: int) -> int:
        """Bytes a packed object occupies: its aligned size on each replica."""
        return align(v >> _SIZE_SHIFT & _SIZE) * (v >> _COUNT_SHIFT & _COUNT)

    def short_of_replicas_keys(self, packed_only: bool = False) -> list[bytes]:
        """Keys of the complete objects with fewer replicas than they want (what ``repairs``
        restores), in one pass: a restore's million objects. With ``packed_only``, of the packed
        objects alone (a snapshot's columns)."""
        count_shift, want_shift, records = _COUNT_SHIFT, _WANT_SHIFT, self._records
        out = [k for k, v in super().items()
               if v >= _PACKED and v >> count_shift & _COUNT < v >> want_shift & _WANT]  # type: ignore[operator]
        if not packed_only:
            out += [k for k, m in records.items() if m.put is None and len(m.replicas) // 2 < m.want]
        return out

    def is_short_of_replicas(self, key: bytes) -> bool:
        """Whether ``key`` is a complete object with fewer replicas than it wants."""
        v = self.raw(key)
        if v is None:
            return False
        if type(v) is int:
            return v >> _COUNT_SHIFT & _COUNT < v >> _WANT_SHIFT & _WANT
        return v.put is None and len(v.replicas) // 2 < v.want  # type: ignore[union-attr]

    def replicas_of(self, v: int) -> tuple[object, ...]:
        """The flat (segment, offset, ...) replicas of a packed object."""
        names = self.seg_names
        out: list[object] = []
        for i in range(v >> _COUNT_SHIFT & _COUNT):
            rep = v >> (_REPLICAS_SHIFT + i * _REPLICA_BITS)
            out += (names[rep & _SEG], rep >> _SEG_BITS & _OFFSET)
        return tuple(out)

    def segments_of(self, v: int) -> list[str]:
        names = self.seg_names
        return [names[v >> (_REPLICAS_SHIFT + i * _REPLICA_BITS) & _SEG] for i in range(v >> _COUNT_SHIFT & _COUNT)]

    def locations_of(self, v: int, segments: dict) -> list[Location]:  # type: ignore[type-arg]
        """Where a packed object's replicas are (``segments``: the segment table's, by name)."""
        names, size = self.seg_names, v >> _SIZE_SHIFT & _SIZE
        out = []
        for i in range(v >> _COUNT_SHIFT & _COUNT):
            rep = v >> (_REPLICAS_SHIFT + i * _REPLICA_BITS)
            name = names[rep & _SEG]
            seg = segments[name]
            out.append(Location(name, seg.engine, seg.base + (rep >> _SEG_BITS & _OFFSET), size))
        return out

    # ---- access -------------------------------------------------------------------------
    # A shard maps each key to an int: a packed object, or a marker (the stamp alone, below
    # ``_PACKED``) standing for the key's record in ``_records``. Shards hold nothing but bytes
    # and ints, so the cycle collector never tracks them (a dict of untracked values is
    # untracked): ten million objects cost a collection nothing.

    def raw_stamp(self, key: bytes) -> int:
        """The shard's value of ``key`` (packed, or a record's marker)."""
        return self._shards[crc32(key) & self._mask][key]  # type: ignore[return-value]

    def raw(self, key: bytes) -> ObjectMeta | int | None:
        """The object: an int (packed), an ``ObjectMeta`` (a record), or None. Nothing unpacked."""
        v = self._shards[crc32(key) & self._mask].get(key)
        if v is None or v >= _PACKED:  # type: ignore[operator]
            return v
        return self._records[key]

    def record_items(self) -> Iterator[tuple[bytes, ObjectMeta]]:
        """The objects kept as records (every pending put is one), in no particular order."""
        return iter(self._records.items())

    def raw_items(self) -> Iterator[tuple[bytes, ObjectMeta | int]]:
        records = self._records
        return ((k, v if v >= _PACKED else records[k]) for k, v in super().items())  # type: ignore[operator]

    def read(self, key: bytes, until: float) -> int:
        """Makes the packed object ``key`` the most recently used, with a lease to at least
        ``until``; returns its new value. The get path: nothing unpacked."""
        shard = self._shards[crc32(key) & self._mask]
        v: int = shard.pop(key)  # type: ignore[assignment]
        self._clock += 1
        lease = max(v >> _LEASE_SHIFT & _LEASE, lease_ticks(until))
        v = shard[key] = v & _STAMPLESS | lease << _LEASE_SHIFT | self._clock  # type: ignore[assignment]
        return v

    def __setitem__(self, key: bytes, meta: ObjectMeta) -> None:
        """Stores ``meta`` (packed when plain; the table then holds a copy, not ``meta``), keeping
        the key's place when it has one."""
        packed = self.pack(meta, 0)
        if packed is None:
            self._records[key] = meta
            packed = 0  # a marker
        elif self._records:
            self._records.pop(key, None)
        super().__setitem__(key, packed)  # type: ignore[arg-type]

    def __getitem__(self, key: bytes) -> ObjectMeta:
        meta = self.get(key)
        if meta is None:
            raise KeyError(key)
        return meta

    def get(self, key: bytes, default: ObjectMeta | None = None) -> ObjectMeta | None:  # type: ignore[override]
        """The object's record, unpacked in place (packed again by ``settle``)."""
        shard = self._shards[crc32(key) & self._mask]
        v = shard.get(key)
        if v is None:
            return default
        if v < _PACKED:  # type: ignore[operator]
            return self._records[key]
        meta = self._records[key] = self.unpack(v)  # type: ignore[arg-type]
        shard[key] = v & _USED  # type: ignore[assignment, operator]  # a marker: same place, same stamp
        self._live.append(key)
        return meta

    def __delitem__(self, key: bytes) -> None:
        super().__delitem__(key)
        if self._records:
            self._records.pop(key, None)

    def pop(self, key: bytes, *default: object) -> ObjectMeta:  # type: ignore[override]
        v = super().pop(key, *default)
        if type(v) is not int:
            return v  # the default
        return self.unpack(v) if v >= _PACKED else self._records.pop(key)  # type: ignore[arg-type, operator]

    def _meta(self, key: bytes, v: int) -> ObjectMeta:
        """A copy of a packed object, or the record a marker stands for."""
        return self.unpack(v) if v >= _PACKED else self._records[key]

    def items(self) -> Iterator[tuple[bytes, ObjectMeta]]:  # type: ignore[override]
        meta = self._meta
        return ((k, meta(k, v)) for k, v in super().items())  # type: ignore[arg-type]

    def values(self) -> Iterator[ObjectMeta]:  # type: ignore[override]
        return (m for _, m in self.items())

    def by_age(self) -> Iterator[tuple[bytes, ObjectMeta]]:
        meta = self._meta
        return ((k, meta(k, v)) for k, v in super().by_age())  # type: ignore[arg-type]

    def move_to_end(self, key: bytes) -> ObjectMeta:
        super().move_to_end(key)
        return self.raw(key)  # type: ignore[return-value]

    def load(self, pairs: list[tuple[bytes, ObjectMeta | int]]) -> None:  # type: ignore[override]
        """Fills the empty index from (key, packed int without a stamp, or record) pairs, oldest
        first, placed as ``LruTable.load`` places them; a record of a plain object is packed."""
        assert not self, "load into an empty table"
        where, stamps = self._placements([key for key, _ in pairs])
        shards, records, pack = self._shards, self._records, self.pack
        for (key, v), i, used in zip(pairs, where, stamps):
            if type(v) is not int:
                packed = pack(v, used)  # type: ignore[arg-type]
                if packed is None:
                    records[key] = v  # type: ignore[assignment]
                    shards[i][key] = used  # type: ignore[assignment]  # a marker
                    continue
                shards[i][key] = packed  # type: ignore[assignment]
            else:
                shards[i][key] = v | used  # type: ignore[assignment]
        self._clock = len(pairs)

    def oldest(self) -> Iterator[tuple[bytes, int, int, float, bool]]:
        """(key, size, pin, lease end, pending) in LRU order, oldest first: eviction's candidates,
        read without unpacking."""
        records = self._records
        for key, v in super().by_age():
            if v >= _PACKED:  # type: ignore[operator]
                yield (key, v >> _SIZE_SHIFT & _SIZE, v >> _PIN_SHIFT & 3,  # type: ignore[operator]
                       (v >> _LEASE_SHIFT & _LEASE) / TICKS, False)  # type: ignore[operator]
            else:
                m = records[key]
                yield key, m.size, m.pin, m.lease_until, m.put is not None

    def settle(self) -> None:
        """Packs again the records unpacked in place since the last call (the master's requests and
        timer end with it)."""
        if not self._live:
            return
        mask, shards, records, pack = self._mask, self._shards, self._records, self.pack
        for key in self._live:
            meta = records.get(key)
            if meta is None:
                continue
            shard = shards[crc32(key) & mask]
            mark = shard.get(key)
            packed = pack(meta, mark) if mark is not None else None  # type: ignore[arg-type]
            if packed is not None:
                shard[key] = packed  # type: ignore[assignment]
                del records[key]
        self._live.clear()

    @property
    def records(self) -> int:
        """Objects kept as records (pending puts, held replicas, what does not fit)."""
        return len(self._records)

    @property
    def unsettled(self) -> int:
        return len(self._live)
