"""The master's object index (``store.master.index``): plain objects packed into one int, unpacked
in place for whoever changes them, and packed again at ``settle``."""

from __future__ import annotations

import gc

import pytest
from tidekv.store.master.index import ObjectIndex, ObjectMeta, PendingPut, lease_ticks
from tidekv.store.master.journal import Mirror, decode_ops, encode_ops
from tidekv.store.wire.protocol import Status

from .rig import ServiceRig
from .test_master_service import PAGE, _rig


def _meta(replicas: tuple[object, ...] = ("seg-a", 4096), **fields: object) -> ObjectMeta:
    meta = ObjectMeta(int(fields.pop("size", 70_001)), replicas, None, int(fields.pop("pin", 1)),  # type: ignore[call-overload]
                      int(fields.pop("token", 123_456_789)), int(fields.pop("want", 0)))  # type: ignore[call-overload]
    for name, value in fields.items():
        setattr(meta, name, value)
    return meta


def _fields(meta: ObjectMeta) -> tuple[object, ...]:
    return (meta.size, meta.replicas, meta.put, meta.pin, meta.token, meta.want, meta.held, meta.lease_until)


def test_a_plain_object_packs_and_unpacks_to_the_same_fields() -> None:
    index = ObjectIndex()
    for meta in (_meta(), _meta(("seg-a", 0, "seg-b", (1 << 44) - 4096), want=3, lease_until=1234.5),
                 _meta(size=(1 << 40) - 1, token=(1 << 48) - 1, pin=2), _meta(lease_until=0.25)):
        v = index.pack(meta, 77)
        assert type(v) is int
        back = index.unpack(v)
        assert _fields(back) == _fields(meta) and back.used == 77
        assert index.size_of(v) == meta.size and index.token_of(v) == meta.token and index.pin_of(v) == meta.pin


def test_what_is_not_plain_stays_a_record() -> None:
    index = ObjectIndex()
    pending = _meta()
    pending.put = PendingPut(1, "w", 0.0, False)
    held = _meta()
    held.held = ("seg-c", 0)
    for meta in (pending, held, _meta(replicas=()), _meta(size=1 << 40), _meta(token=1 << 48),
                 _meta(("seg-a", 1 << 44)), _meta(want=64), _meta(tuple(v for i in range(16) for v in (f"s{i}", 0)))):
        assert index.pack(meta, 1) is None


def test_a_lease_is_kept_to_a_microsecond_and_never_shortened() -> None:
    index = ObjectIndex()
    for until in (1_000.123456789, 3.0e6 + 1e-7, 0.5):
        back = index.unpack(index.pack(_meta(lease_until=until), 1))  # type: ignore[arg-type]
        assert until <= back.lease_until < until + 1e-6
    assert lease_ticks(0.0) == 0


def test_reading_a_key_unpacks_it_in_place_until_settle() -> None:
    index = ObjectIndex()
    index[b"k"] = _meta()
    assert type(index.raw(b"k")) is int, "a plain object is stored packed"
    meta = index[b"k"]
    assert index[b"k"] is meta and index.get(b"k") is meta, "the caller holds the table's own record"
    meta.replicas = ("seg-z", 8192)
    meta.lease_until = 99.0
    index.settle()
    assert type(index.raw(b"k")) is int
    back = index.get(b"k")
    assert back is not None and back.replicas == ("seg-z", 8192) and back.lease_until == 99.0, "changes kept"
    index.settle()
    copy = next(index.values())
    copy.pin = 0
    index.settle()
    assert index[b"k"].pin == 1, "values() gives copies"


def test_read_moves_to_the_lru_end_and_only_lengthens_the_lease() -> None:
    index = ObjectIndex()
    for key in (b"a", b"b", b"c"):
        index[key] = _meta()
    v = index.read(b"a", 50.0)
    assert [k for k, _ in index.by_age()] == [b"b", b"c", b"a"]
    assert index.lease_of(v) >= 50.0
    v = index.read(b"a", 10.0)
    assert 50.0 <= index.lease_of(v) < 50.0 + 1e-6
    assert [c[0] for c in index.oldest()] == [b"b", b"c", b"a"]


def test_a_master_keeps_its_objects_packed_between_requests() -> None:
    rig = _rig(pages=64)
    keys = [b"k%d" % i for i in range(32)]
    for key in keys:
        assert rig.put("w", key, PAGE).status == Status.OK
    for key in keys[:8]:
        assert rig.get(key).status == Status.OK
    index = rig.service.objects.objects
    assert all(type(index.raw(k)) is int for k in keys)
    assert index.unsettled == 0
    # a snapshot and a restore give the same objects, packed again
    mirror = Mirror(rig.config.lease_ttl_s)
    mirror.apply(decode_ops(encode_ops(rig.service.snapshot())), rig.clock.now)
    new = ServiceRig(lease_ttl_s=rig.config.lease_ttl_s)
    new.service.restore(mirror)
    assert all(type(new.service.objects.objects.raw(k)) is int for k in keys)
    assert {k: (m.size, m.replicas, m.token) for k, m in new.service.objects.objects.items()} == \
        {k: (m.size, m.replicas, m.token) for k, m in index.items()}


def test_the_collector_never_tracks_the_index() -> None:
    """Shards hold only bytes and ints (a record's entry is a marker), so the cycle collector
    never scans them: pending puts, whose records are tracked, come and go without making it."""
    rig = _rig(pages=64)
    for i in range(32):
        assert rig.put("w", b"k%d" % i, PAGE).status == Status.OK
    index = rig.service.objects.objects
    gc.collect()
    slot = rig.put_start("w", b"pending", PAGE)  # a record, in the index until its put ends
    assert slot.status == Status.OK and index.records == 1
    assert not any(gc.is_tracked(shard) for shard in index._shards)
    assert rig.put_end("w", b"pending", slot.token) == Status.OK
    assert index.records == 0 and type(index.raw(b"pending")) is int


def test_a_restore_packs_ops_as_objects_pack() -> None:
    from tidekv.store.master import journal as j

    ops = [j.ObjectOp(b"a", 4096, ["s0", 0], 0, 7, 1), j.ObjectOp(b"b", 4096, ["s1", 1 << 40], 2, 8, 0),
           j.ObjectOp(b"c", 100, ["s0", 64, "s1", 128], 1, 9, 2), j.ObjectOp(b"d", 1 << 41, ["s0", 0], 0, 10, 1),
           j.ObjectOp(b"e", 4096, ["s0", 4096], 1, 11, 3)]
    index = ObjectIndex()
    packed = dict(index.pack_ops(ops))
    assert type(packed[b"d"]) is ObjectMeta, "a size past 1 TiB stays a record"
    for op in ops:
        meta = ObjectMeta(op.size, tuple(op.replicas), None, op.pin, op.token, op.want)
        if type(packed[op.key]) is int:
            assert packed[op.key] == index.pack(meta, 0)
            assert _fields(index.unpack(packed[op.key])) == _fields(meta)


@pytest.mark.parametrize("stamped", [True, False], ids=["stamped", "journal-before-stamps"])
def test_a_restore_finds_the_objects_short_of_replicas(stamped: bool) -> None:
    """Packed or not, an object restored with fewer replicas than it wants is queued for repair:
    found while loading stamped ops, by a scan after loading a journal written before stamps."""
    from tidekv.store.master import journal as j

    used = [1, 2, 3, 4, 5] if stamped else [0] * 5
    mirror = Mirror(5.0)
    mirror.apply([j.MountOp("h", "seg", "10.0.0.1:1", 1 << 20, 1 << 30),
                  j.ObjectOp(b"whole", 4096, ["seg", 0], 0, 1, 1, used[0]),
                  j.ObjectOp(b"short", 4096, ["seg", 4096], 0, 2, 2, used[1]),  # packed: one replica of two
                  j.ObjectOp(b"big", 1 << 41, ["seg", 8192], 0, 3, 2, used[2]),  # a record: too big to pack
                  j.ObjectOp(b"two", 4096, ["seg", 12288, "seg", 16384], 0, 4, 3, used[3]),  # packed: two of three
                  j.ObjectOp(b"also", 4096, ["seg", 20480], 1, 5, 1, used[4])], 0.0)  # another pin: new fields
    rig = ServiceRig()
    rig.service.restore(mirror)
    objects = rig.service.objects.objects
    assert type(objects.raw(b"short")) is int and type(objects.raw(b"two")) is int
    assert set(rig.service.objects.repairs.degraded) == {b"short", b"big", b"two"}
    for key, size, replicas, pin, token, want in ((b"whole", 4096, ("seg", 0), 0, 1, 1),
                                                  (b"two", 4096, ("seg", 12288, "seg", 16384), 0, 4, 3),
                                                  (b"also", 4096, ("seg", 20480), 1, 5, 1)):
        meta = objects.pop(key)
        assert (meta.size, meta.replicas, meta.pin, meta.token, meta.want) == (size, replicas, pin, token, want)


def test_a_restore_with_a_suspended_segment_packs_the_objects_it_does_not_hold() -> None:
    """A master restored while a holder's segment is suspended holds aside the replicas there;
    every other object is packed as usual (they stayed records, at twice the memory, before)."""
    from tidekv.store.master import journal as j

    mirror = Mirror(5.0)
    mirror.apply([j.MountOp("h", "a", "10.0.0.1:1", 1 << 20, 1 << 30),
                  j.MountOp("h2", "b", "10.0.0.2:1", 1 << 20, 1 << 30), j.SuspendOp(["b"], 30.0),
                  *(j.ObjectOp(b"k%d" % i, 4096, ["a", i * 4096], 0, i + 1, 1, i + 1) for i in range(50)),
                  j.ObjectOp(b"both", 4096, ["a", 1 << 20, "b", 0], 0, 51, 2, 51),
                  j.ObjectOp(b"away", 4096, ["b", 4096], 0, 52, 1, 52)], 0.0)
    rig = ServiceRig()
    rig.service.restore(mirror)
    objects = rig.service.objects
    assert all(type(objects.objects.raw(b"k%d" % i)) is int for i in range(50))
    assert objects.objects.records == 1  # "both": its replica on b held aside
    both = objects.objects.raw(b"both")
    assert both.replicas == ("a", 1 << 20) and both.held == ("b", 0)
    assert b"away" in objects.suspended and b"away" not in objects.objects  # no readable replica
    assert objects.objects.pop(b"k7").replicas == ("a", 7 * 4096)
