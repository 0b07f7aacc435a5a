"""A holder declared dead is suspended, not forgotten: the service on a fake clock, through its wire entry point.

Its segment's objects are unreadable while it is away and come back, at the same locations, when
the same incarnation re-mounts; keys re-put, upserted or removed meanwhile are not restored (their
bytes are freed, leases honoured); another incarnation, another mount of the same memory, or the
end of the grace drops them. The journal (ops as they come, a snapshot, a state-dir file) rebuilds
the same suspended view, and a master restored from it resumes the holder alike.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tidekv.store.allocator import align
from tidekv.store.master.journal import JournalFile, Mirror, decode_ops, encode_ops
from tidekv.store.master.service import MasterService
from tidekv.store.wire import protocol as p
from tidekv.store.wire.protocol import MountOutcome, Status

from tests.store.rig import RpcFailed, ServiceRig

PAGE = 4096
TTL_S = 2.0
GRACE_S = 30.0
SECRET = "holder-incarnation-1"


def _rig(journal: bool = False, **config: Any) -> ServiceRig:
    rig = ServiceRig(**{"client_ttl_s": TTL_S, "suspend_grace_s": GRACE_S, "lease_ttl_s": 0.0, **config})
    if journal:
        rig.service.enable_journal()
    for client in ("holder", "other", "writer"):
        rig.hello(client)
    assert rig.mount("holder", "seg-h", 64 * PAGE, SECRET).outcome == MountOutcome.NEW
    assert rig.mount("other", "seg-o", 64 * PAGE, "other-incarnation").outcome == MountOutcome.NEW
    return rig


def _lapse(rig: ServiceRig, client: str = "holder") -> None:
    """Time passes: every client but ``client`` heartbeats; ``client`` is declared dead."""
    for _ in range(int(TTL_S / 0.5) + 2):
        for other in ("holder", "other", "writer"):
            if other != client and other in rig.service.segments.clients:
                assert not rig.heartbeat(other)
        rig.advance(0.5)
    assert client not in rig.service.segments.clients


def _locations(rig: ServiceRig, key: bytes) -> list[p.Location]:
    result = rig.get(key)
    assert result.status == Status.OK, key
    return result.locations


def _put_on_holder(rig: ServiceRig, keys: list[bytes]) -> dict[bytes, list[p.Location]]:
    for i, key in enumerate(keys):
        assert rig.put("writer", key, (i + 1) * 1000, preferred="seg-h").status == Status.OK
    return {key: _locations(rig, key) for key in keys}


def test_the_same_incarnation_gets_its_objects_back_at_the_same_locations() -> None:
    rig = _rig()
    keys = [f"k{i}".encode() for i in range(5)]
    before = _put_on_holder(rig, keys)
    assert all(loc.segment == "seg-h" for locs in before.values() for loc in locs)
    used = rig.service.segments.segments["seg-h"].used

    _lapse(rig)
    stats = rig.stats()
    assert rig.alive(*keys) == set() and rig.get(keys[0]).status == Status.NOT_FOUND
    assert stats["suspended_segments"].keys() == {"seg-h"} and stats["suspended_keys"] == 5
    assert (stats["keys"], stats["objects_lost"], stats["capacity_bytes"]) == (0, 0, 64 * PAGE)
    assert rig.put_start("writer", b"new", 1000, preferred="seg-h").locations[0].segment == "seg-o", \
        "nothing is placed on a suspended segment"
    assert rig.heartbeat("holder"), "a suspended client is told to re-mount"

    rig.hello("holder")
    result = rig.mount("holder", "seg-h", 64 * PAGE, SECRET)
    assert (result.outcome, result.restored, result.superseded) == (MountOutcome.RESUMED, 5, 0)
    assert {key: _locations(rig, key) for key in keys} == before
    assert rig.service.segments.segments["seg-h"].used == used
    stats = rig.stats()
    assert (stats["suspended_segments"], stats["suspended_keys"], stats["objects_restored"]) == ({}, 0, 5)
    assert stats["capacity_bytes"] == 128 * PAGE and not rig.heartbeat("holder")
    assert rig.mount("holder", "seg-h", 64 * PAGE, SECRET).outcome == MountOutcome.KEPT


def test_keys_re_put_upserted_or_removed_meanwhile_are_not_restored() -> None:
    rig = _rig()
    keys = [b"re-put", b"upserted", b"removed", b"kept-0", b"kept-1", b"kept-2"]
    before = _put_on_holder(rig, keys)
    assert rig.put("writer", b"two-replicas", 1000, replicas=2).status == Status.OK
    _lapse(rig)
    assert rig.exists(b"two-replicas"), "an object with a replica elsewhere stays readable"
    assert [loc.segment for loc in _locations(rig, b"two-replicas")] == ["seg-o"]

    assert rig.put("writer", b"re-put", 500).status == Status.OK
    assert rig.put("writer", b"upserted", 700, upsert=True).status == Status.OK
    assert rig.remove(b"removed") == Status.OK
    assert rig.remove(b"removed") == Status.NOT_FOUND
    assert rig.remove(b"two-replicas") == Status.OK
    new = {key: _locations(rig, key) for key in (b"re-put", b"upserted")}

    rig.hello("holder")
    result = rig.mount("holder", "seg-h", 64 * PAGE, SECRET)
    assert (result.outcome, result.restored, result.superseded) == (MountOutcome.RESUMED, 3, 4)
    assert {key: _locations(rig, key) for key in (b"re-put", b"upserted")} == new, "the newer versions win"
    assert rig.get(b"removed").status == Status.NOT_FOUND and rig.get(b"two-replicas").status == Status.NOT_FOUND
    for key in (b"kept-0", b"kept-1", b"kept-2"):
        assert _locations(rig, key) == before[key]
    on_holder = sum(align(size) for size in (4000, 5000, 6000))
    assert rig.service.segments.segments["seg-h"].used == on_holder, "superseded bytes are free again"
    assert rig.stats()["objects_superseded"] == 4


def test_leases_on_suspended_objects_are_honoured() -> None:
    rig = _rig(lease_ttl_s=5.0)
    _put_on_holder(rig, [b"read", b"replaced"])
    rig.get(b"read")
    rig.get(b"replaced")  # a reader may still be reading these when the holder is suspended
    _lapse(rig)
    assert rig.remove(b"read") == Status.LEASED, "a suspended object keeps its readers' lease"
    assert rig.put("writer", b"replaced", 300).status == Status.OK
    rig.hello("holder")
    result = rig.mount("holder", "seg-h", 64 * PAGE, SECRET)
    assert (result.restored, result.superseded) == (1, 1)
    seg = rig.service.segments.segments["seg-h"]
    assert seg.used == align(1000) + align(2000), "the replaced version's bytes wait for its lease"
    rig.advance(5.0)
    assert seg.used == align(1000)


def test_another_incarnation_or_mount_of_the_memory_gets_nothing_back() -> None:
    rig = _rig()
    _put_on_holder(rig, [b"a", b"b"])
    _lapse(rig)
    rig.hello("holder")
    with pytest.raises(RpcFailed, match="held suspended for client 'holder'"):
        rig.call(p.MountSegment("other", "seg-h", "engine-of-seg-h", rig.bases["seg-h"], 64 * PAGE, SECRET))
    for wrong in ("", "a-new-process", SECRET + "x"):
        assert rig.service.segments.suspended["seg-h"].matches("holder", "engine-of-seg-h", rig.bases["seg-h"],
                                                                64 * PAGE, wrong) is False
    assert not rig.service.segments.suspended["seg-h"].matches("holder", "engine-of-seg-h", rig.bases["seg-h"],
                                                                32 * PAGE, SECRET), "another range is another segment"
    result = rig.mount("holder", "seg-h", 64 * PAGE, "a-new-process")
    assert (result.outcome, result.restored) == (MountOutcome.NEW, 0)
    stats = rig.stats()
    assert rig.alive(b"a", b"b") == set() and stats["suspended_segments"] == {} and stats["suspended_keys"] == 0
    assert stats["objects_lost"] == 2 and rig.service.segments.segments["seg-h"].used == 0

    # A new process on the same engine (another client id, another segment name) mounting the
    # same memory: the suspended segment's holder is gone.
    assert rig.put("writer", b"c", 1000, preferred="seg-h").status == Status.OK
    _lapse(rig)
    rig.hello("holder-2")
    rig.call(p.MountSegment("holder-2", "seg-h2", "engine-of-seg-h", rig.bases["seg-h"] + PAGE, PAGE, "fresh"))
    assert rig.stats()["suspended_segments"] == {} and not rig.exists(b"c")


def test_the_grace_ends_and_the_objects_are_dropped_for_good() -> None:
    rig = _rig()
    _put_on_holder(rig, [b"a", b"b", b"c"])
    _lapse(rig)
    for _ in range(int(GRACE_S)):
        assert rig.heartbeat("other") is False and rig.heartbeat("writer") is False
        rig.advance(1.0)
    stats = rig.stats()
    assert stats["suspended_segments"] == {} and stats["suspended_keys"] == 0
    assert (stats["objects_lost"], stats["suspended_objects_dropped"]) == (3, 3)
    rig.hello("holder")
    assert rig.mount("holder", "seg-h", 64 * PAGE, SECRET).outcome == MountOutcome.NEW
    assert rig.alive(b"a", b"b", b"c") == set()


def test_without_an_incarnation_or_a_grace_a_lapsed_segment_is_unmounted_at_once() -> None:
    rig = _rig()
    rig.hello("plain")
    rig.mount("plain", "seg-plain", 64 * PAGE)  # a client of protocol v3 or a test: no incarnation
    assert rig.put("writer", b"k", 1000, preferred="seg-plain").status == Status.OK
    _lapse(rig, "plain")
    stats = rig.stats()
    assert "seg-plain" not in stats["suspended_segments"] and stats["objects_lost"] == 1

    rig = _rig(suspend_grace_s=0.0)
    assert rig.put("writer", b"k", 1000, preferred="seg-h").status == Status.OK
    _lapse(rig)
    stats = rig.stats()
    assert stats["suspended_segments"] == {} and stats["objects_lost"] == 1


def test_a_disconnect_drops_the_clients_suspended_segments() -> None:
    rig = _rig()
    _put_on_holder(rig, [b"a"])
    _lapse(rig)
    rig.hello("holder")
    rig.call(p.Disconnect("holder"))
    assert rig.stats()["suspended_segments"] == {} and rig.stats()["objects_lost"] == 1


# ---- the journal ---------------------------------------------------------------------------


def _view(service: MasterService) -> dict[str, Any]:
    """What a restored master must agree on (allocators included: used bytes per segment)."""
    table, segs = service.objects, service.segments
    return {
        "readable": {k: (m.size, m.replicas, m.held, m.token) for k, m in table.objects.items() if m.put is None},
        "suspended": {k: (m.size, m.held, m.token) for k, m in table.suspended.items()},
        "segments": {n: (s.client_id, s.base, s.capacity, s.used, s.incarnation) for n, s in segs.segments.items()},
        "held": {n: (h.segment.base, h.segment.used, h.segment.incarnation) for n, h in segs.suspended.items()},
        "pending": set(table.pending),
    }


def _restored(mirror: Mirror) -> ServiceRig:
    """A fresh master serving ``mirror``."""
    rig = ServiceRig(client_ttl_s=TTL_S, suspend_grace_s=GRACE_S, lease_ttl_s=0.0)
    rig.service.restore(mirror)
    return rig


def test_a_restored_master_and_a_standby_see_the_same_suspension_and_resume_it(tmp_path: Path) -> None:
    rig = _rig(journal=True)
    journal = JournalFile(tmp_path)
    journal.load(Mirror(0.0), rig.clock.now)
    journal.resume()
    standby = Mirror(0.0)
    is_closed = False

    def flush() -> None:
        ops = decode_ops(encode_ops(rig.service.take_ops()[1]))
        standby.apply(ops, rig.clock.now)
        if ops and not is_closed:
            journal.append(ops)

    _put_on_holder(rig, [b"a", b"b", b"c", b"d"])
    rig.put("writer", b"both", 1000, replicas=2)
    flush()
    _lapse(rig)
    flush()
    rig.put("writer", b"a", 100)
    rig.remove(b"b")
    flush()
    journal.close()
    is_closed = True
    from_file = Mirror(0.0)
    JournalFile(tmp_path).load(from_file, rig.clock.now)
    from_snapshot = Mirror(0.0)
    from_snapshot.apply(decode_ops(encode_ops(rig.service.snapshot())), rig.clock.now)

    expected = _view(rig.service)
    assert expected["held"].keys() == {"seg-h"} and expected["suspended"].keys() == {b"c", b"d"}
    for mirror in (standby, from_file, from_snapshot):
        mirror.forget_expired(rig.clock.now)  # bytes freed with no lease to wait for (lease_ttl_s 0)
        restored = _restored(mirror)
        restored.bases = dict(rig.bases)
        assert _view(restored.service) == expected
        assert restored.alive(b"a", b"b", b"c", b"d", b"both") == {b"a", b"both"}
        restored.hello("holder")
        result = restored.mount("holder", "seg-h", 64 * PAGE, SECRET)
        assert (result.outcome, result.restored) == (MountOutcome.RESUMED, 3)
        assert restored.alive(b"a", b"b", b"c", b"d", b"both") == {b"a", b"c", b"d", b"both"}

    rig.hello("holder")
    rig.mount("holder", "seg-h", 64 * PAGE, SECRET)
    flush()
    standby.forget_expired(rig.clock.now)
    assert _view(_restored(standby).service) == _view(rig.service), "the resume replicates too"
