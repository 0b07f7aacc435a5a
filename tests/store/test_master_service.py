"""MasterService on a fake clock: leases, put timeouts, dead clients, eviction, pins, upserts.

No sockets and no sleeping: requests go through ``MasterService.handle`` (the server's decode and
dispatch path) and time moves only when a test advances the fake clock.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tidekv.store.wire import protocol as p
from tidekv.store.wire.protocol import Pin, Status

from tests.store.rig import RpcFailed, ServiceRig

PAGE = 4096


def _rig(pages: int = 16, **config: object) -> ServiceRig:
    """A master with one holder ("h", segment "seg-h" of ``pages`` pages) and one pure client ("w")."""
    rig = ServiceRig(**config)
    rig.hello("h")
    rig.hello("w")
    rig.mount("h", "seg-h", pages * PAGE)
    return rig


def _keys(prefix: str, n: int) -> list[bytes]:
    return [f"{prefix}{i}".encode() for i in range(n)]


# ---- leases ---------------------------------------------------------------------------------


def test_get_lease_blocks_remove_until_it_expires() -> None:
    rig = _rig(lease_ttl_s=2.0)
    rig.put("w", b"k", 100)
    assert rig.get(b"k").status == Status.OK
    assert rig.remove(b"k") == Status.LEASED
    rig.advance(1.9)
    assert rig.remove(b"k") == Status.LEASED
    rig.advance(0.2)
    assert rig.remove(b"k") == Status.OK
    assert not rig.exists(b"k")
    assert rig.stats()["used_bytes"] == 0


def test_exists_grants_no_lease_and_force_overrides_one() -> None:
    rig = _rig(lease_ttl_s=5.0)
    rig.put("w", b"a", 100)
    rig.put("w", b"b", 100)
    assert rig.exists(b"a")
    assert rig.remove(b"a") == Status.OK, "exists() must not lease the object"
    rig.get(b"b")
    assert rig.remove(b"b", force=True) == Status.OK
    assert not rig.exists(b"b")
    assert rig.stats()["used_bytes"] == 128, "a force-removed leased object is freed only when its lease ends"
    rig.advance(5.1)
    assert rig.stats()["used_bytes"] == 0


def test_eviction_skips_leased_objects_and_reports_out_of_space_when_only_they_remain() -> None:
    rig = _rig(pages=4, lease_ttl_s=3.0, high_watermark=1.0)
    keys = _keys("k", 4)
    for k in keys:
        rig.put("w", k, PAGE)
    rig.get(keys[0])
    assert rig.put("w", b"new0", PAGE).status == Status.OK
    assert rig.alive(*keys) == {keys[0], keys[2], keys[3]}, "the leased oldest key must survive; the next goes"
    for k in (keys[2], keys[3], b"new0"):
        rig.get(k)
    assert rig.put("w", b"new1", PAGE).status == Status.OUT_OF_SPACE
    rig.advance(3.1, tick=False)
    assert rig.put("w", b"new1", PAGE).status == Status.OK
    assert not rig.exists(keys[0]), "after its lease the least recently used key is the victim"


# ---- unfinished puts and dead clients ----------------------------------------------------------


def test_put_not_ended_in_time_is_reclaimed_and_its_key_is_usable_again() -> None:
    rig = _rig(put_timeout_s=30.0, client_ttl_s=1000.0)
    slot = rig.put_start("w", b"k", 3 * PAGE)
    assert slot.status == Status.OK
    assert rig.stats()["pending_puts"] == 1
    assert not rig.exists(b"k") and rig.get(b"k").status == Status.NOT_FOUND, "a pending put is invisible"
    assert rig.put_start("h", b"k", PAGE).status == Status.EXISTS, "a key being written is taken"
    rig.advance(29.0)
    assert rig.stats()["pending_puts"] == 1
    rig.advance(1.5)
    stats = rig.stats()
    assert (stats["pending_puts"], stats["used_bytes"], stats["puts_reclaimed"]) == (0, 0, 1)
    assert rig.put_end("w", b"k", slot.token) == Status.STALE, "a late put_end must be refused"
    assert not rig.exists(b"k")
    assert rig.put("h", b"k", PAGE).status == Status.OK
    assert rig.get(b"k").size == PAGE


def test_put_revoke_frees_the_space_and_a_second_revoke_is_stale() -> None:
    rig = _rig()
    slot = rig.put_start("w", b"k", PAGE)
    assert rig.stats()["used_bytes"] == PAGE
    assert Status(rig.call(p.PutRevoke("w", [b"k"], [slot.token]))[0]) == Status.OK
    assert rig.stats()["used_bytes"] == 0 and not rig.exists(b"k")
    assert Status(rig.call(p.PutRevoke("w", [b"k"], [slot.token]))[0]) == Status.STALE
    assert rig.put("w", b"k", PAGE).status == Status.OK


def test_dead_writer_loses_its_pending_puts_and_dead_holder_its_segment() -> None:
    rig = _rig(client_ttl_s=10.0, put_timeout_s=1000.0)
    rig.put("w", b"done", PAGE)
    pending = rig.put_start("w", b"half", PAGE)
    assert pending.status == Status.OK
    rig.advance(6.0)
    assert not rig.heartbeat("h") and not rig.heartbeat("w")
    rig.advance(6.0)
    assert not rig.heartbeat("h")
    rig.advance(5.0)  # w silent for 11 s, h for 5 s
    stats = rig.stats()
    assert stats["clients"] == 1
    assert (stats["pending_puts"], stats["puts_reclaimed"]) == (0, 1), "a dead writer's put must be reclaimed"
    assert stats["used_bytes"] == PAGE
    assert rig.exists(b"done"), "objects a dead pure client wrote live on in other segments"
    assert rig.put_end("w", b"half", pending.token) == Status.STALE
    assert rig.heartbeat("w") is True, "a forgotten client must be told to hello and re-mount"

    rig.advance(11.0)  # now h is silent too
    stats = rig.stats()
    assert stats["segments"] == {} and stats["capacity_bytes"] == 0 and stats["used_bytes"] == 0
    assert stats["objects_lost"] == 1 and stats["keys"] == 0
    assert not rig.exists(b"done")
    assert rig.heartbeat("h") is True
    rig.hello("h")
    rig.mount("h", "seg-h", 16 * PAGE)
    assert rig.stats()["capacity_bytes"] == 16 * PAGE
    assert rig.put("w", b"done", PAGE).status == Status.OK


def test_disconnect_unmounts_and_loses_objects_held_only_there() -> None:
    rig = _rig()
    rig.mount("w", "seg-w", 16 * PAGE)
    rig.put("w", b"two", 100, replicas=2)
    rig.put("w", b"only-h", 100, preferred="seg-h")
    rig.call(p.Disconnect("h"))
    stats = rig.stats()
    assert list(stats["segments"]) == ["seg-w"] and stats["clients"] == 1
    assert rig.alive(b"two", b"only-h") == {b"two"}
    assert [loc.segment for loc in rig.get(b"two").locations] == ["seg-w"]
    assert stats["objects_lost"] == 1


# ---- placement and eviction --------------------------------------------------------------------


def test_replicas_land_on_distinct_segments_best_effort() -> None:
    rig = _rig()
    rig.mount("w", "seg-w", 16 * PAGE)
    rig.hello("x")
    rig.mount("x", "seg-x", 16 * PAGE)
    slot = rig.put("w", b"k2", 1000, replicas=2, preferred="seg-x")
    segments = [loc.segment for loc in slot.locations]
    assert len(set(segments)) == 2 and segments[0] == "seg-x", "preferred segment first, then distinct others"
    slot = rig.put("w", b"k9", 1000, replicas=9)
    assert sorted(loc.segment for loc in slot.locations) == ["seg-h", "seg-w", "seg-x"]
    for loc in slot.locations:
        assert loc.length == 1000
    got = rig.get(b"k9")
    assert got.size == 1000 and len(got.locations) == 3
    assert rig.stats()["used_bytes"] == 5 * 1024


def test_eviction_takes_least_recently_used_first() -> None:
    rig = _rig(pages=16, lease_ttl_s=0.0, high_watermark=1.0)
    keys = _keys("k", 16)
    for k in keys:
        rig.put("w", k, PAGE)
    for k in keys[:4]:
        rig.advance(0.01, tick=False)
        assert rig.get(k).status == Status.OK  # moves to the most recently used end
    new = _keys("n", 4)
    for k in new:
        assert rig.put("w", k, PAGE).status == Status.OK
    assert rig.alive(*keys, *new) == set(keys[:4] + keys[8:] + new)
    assert rig.stats()["evictions"] == 4


def test_watermark_eviction_on_tick_frees_down_to_the_target() -> None:
    rig = _rig(pages=20, high_watermark=0.9, eviction_ratio=0.2)
    keys = _keys("k", 19)
    for k in keys[:18]:
        rig.put("w", k, PAGE)
    rig.advance(0.1)
    assert rig.stats()["evictions"] == 0, "90% used is not above a 0.9 watermark"
    rig.put("w", keys[18], PAGE)
    rig.advance(0.1)
    stats = rig.stats()
    assert stats["used_bytes"] <= (0.9 - 0.2) * 20 * PAGE, stats
    assert stats["evictions"] == 5
    assert rig.alive(*keys) == set(keys[5:]), "the oldest objects go first"


def test_soft_pins_go_after_unpinned_and_hard_pins_never() -> None:
    rig = _rig(pages=16, high_watermark=1.0)
    soft, plain, hard = _keys("s", 4), _keys("n", 4), _keys("h", 8)
    for k in soft:
        rig.put("w", k, PAGE, pin=Pin.SOFT)
    for k in plain:
        rig.put("w", k, PAGE)
    for k in hard:
        rig.put("w", k, PAGE, pin=Pin.HARD)
    new = _keys("x", 9)
    for i, k in enumerate(new[:4]):
        assert rig.put("w", k, PAGE, pin=Pin.HARD).status == Status.OK
        assert rig.alive(*plain) == set(plain[i + 1 :]), "unpinned objects go first, oldest first"
        assert rig.alive(*soft) == set(soft)
    for i, k in enumerate(new[4:8]):
        assert rig.put("w", k, PAGE, pin=Pin.HARD).status == Status.OK
        assert rig.alive(*soft) == set(soft[i + 1 :]), "soft pins go once nothing unpinned is left"
    assert rig.put("w", new[8], PAGE).status == Status.OUT_OF_SPACE, "only hard-pinned objects remain"
    assert rig.alive(*hard) == set(hard)
    assert rig.remove(hard[0]) == Status.OK, "remove deletes a hard-pinned object"
    assert rig.put("w", new[8], PAGE).status == Status.OK


def test_pending_puts_are_never_evicted() -> None:
    rig = _rig(pages=4, high_watermark=1.0)
    slot = rig.put_start("w", b"pending", 3 * PAGE)
    rig.put("w", b"a", PAGE)
    assert rig.put("w", b"c", 2 * PAGE).status == Status.OUT_OF_SPACE
    assert rig.put_end("w", b"pending", slot.token) == Status.OK
    assert rig.get(b"pending").size == 3 * PAGE


def test_object_larger_than_every_segment_is_out_of_space_without_evicting() -> None:
    rig = _rig(pages=4)
    rig.put("w", b"a", PAGE)
    assert rig.put("w", b"huge", 5 * PAGE).status == Status.OUT_OF_SPACE
    assert rig.exists(b"a") and rig.stats()["evictions"] == 0


# ---- upsert -----------------------------------------------------------------------------------


def test_upsert_swaps_versions_atomically_and_frees_the_old_after_its_lease() -> None:
    rig = _rig(lease_ttl_s=5.0)
    rig.put("w", b"k", PAGE)
    old = rig.get(b"k").locations
    slot = rig.put_start("w", b"k", 2 * PAGE, upsert=True)
    assert slot.status == Status.OK and slot.locations != old
    got = rig.get(b"k")
    assert (got.size, got.locations) == (PAGE, old), "readers see the old version until put_end"
    assert rig.stats()["keys"] == 1
    assert rig.put_end("w", b"k", slot.token) == Status.OK
    got = rig.get(b"k")
    assert (got.size, got.locations) == (2 * PAGE, slot.locations)
    assert rig.stats()["used_bytes"] == 3 * PAGE, "the old version stays while a reader may hold it"
    rig.advance(5.1)
    assert rig.stats()["used_bytes"] == 2 * PAGE
    assert rig.stats()["keys"] == 1


def test_a_newer_upsert_wins_over_a_pending_one() -> None:
    rig = _rig()
    rig.put("w", b"k", PAGE)
    first = rig.put_start("w", b"k", PAGE, upsert=True)
    second = rig.put_start("h", b"k", PAGE, upsert=True)
    assert rig.put_end("w", b"k", first.token) == Status.STALE
    assert rig.put_end("h", b"k", second.token) == Status.OK
    assert rig.get(b"k").locations == second.locations
    assert rig.stats()["pending_puts"] == 0 and rig.stats()["used_bytes"] == PAGE


def test_plain_put_of_an_existing_key_is_a_no_op() -> None:
    rig = _rig()
    first = rig.put("w", b"k", PAGE)
    assert rig.put_start("w", b"k", 2 * PAGE).status == Status.EXISTS
    got = rig.get(b"k")
    assert (got.size, got.locations) == (PAGE, first.locations)


# ---- refused requests ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "size", "replicas", "pin"),
    [(b"", 10, 1, 0), (b"x" * 65, 10, 1, 0), (b"k", 0, 1, 0), (b"k", -5, 1, 0), (b"k", 10, 0, 0), (b"k", 10, 1, 7)],
    ids=["empty-key", "long-key", "zero-size", "negative-size", "zero-replicas", "bad-pin"],
)
def test_invalid_put_arguments_are_refused_per_key(key: bytes, size: int, replicas: int, pin: int) -> None:
    rig = _rig(max_key_bytes=64)
    raw = rig.call(p.PutStart("w", [b"fine", key], [10, size], replicas, "", pin, False))
    statuses = [s[0] for s in raw]
    expected_first = Status.OK if replicas >= 1 and pin in (0, 1, 2) else Status.INVALID
    assert statuses == [expected_first, Status.INVALID]


def test_batch_with_mismatched_lengths_is_refused_whole() -> None:
    rig = _rig()
    with pytest.raises(RpcFailed) as info:
        rig.call(p.PutStart("w", [b"a", b"b"], [10], 1, "", 0, False))
    assert info.value.kind == "invalid" and "2 keys but 1" in info.value.message
    assert rig.stats()["used_bytes"] == 0


def test_mount_needs_hello_and_a_name_owned_by_one_client() -> None:
    rig = _rig()
    with pytest.raises(RpcFailed, match="hello"):
        rig.mount("stranger", "seg-s", PAGE)
    with pytest.raises(RpcFailed, match="already mounted"):
        rig.mount("w", "seg-h", PAGE)
    rig.put("w", b"k", PAGE)
    rig.mount("h", "seg-h", 16 * PAGE)  # a re-mount by the owner keeps its allocations
    assert rig.exists(b"k") and rig.stats()["used_bytes"] == PAGE


def test_hello_with_another_protocol_version_names_both_versions() -> None:
    rig = ServiceRig()
    with pytest.raises(RpcFailed) as info:
        rig.call(p.Hello("c", 99))
    assert "v99" in info.value.message and f"v{p.PROTOCOL_VERSION}" in info.value.message
    assert info.value.kind == "version", "a version mismatch must reach clients as ProtocolVersionError"


def test_stats_count_complete_keys_only() -> None:
    rig = _rig()
    rig.put("w", b"a", 100)
    rig.put_start("w", b"b", 100)
    rig.put_start("w", b"a", 100, upsert=True)
    stats = rig.stats()
    assert (stats["keys"], stats["pending_puts"]) == (1, 2)
    assert stats["segments"]["seg-h"]["used"] == 3 * 128


# ---- not ready ------------------------------------------------------------------------------


def test_a_master_not_serving_refuses_everything_as_not_ready() -> None:
    rig = _rig()
    rig.service.not_serving = "is rebuilding its index"
    rig.service.leader_hint = "10.0.0.9:50051"
    for body in (p.Get([b"k"]), p.PutStart("w", [b"k"], [10]), p.Hello("w", p.PROTOCOL_VERSION)):
        with pytest.raises(RpcFailed) as info:
            rig.call(body)
        assert info.value.kind == p.ErrorKind.NOT_READY and "rebuilding" in str(info.value)
    rig.service.not_serving = ""
    assert rig.put("w", b"k", 10).status == Status.OK


def test_a_fresh_master_without_segments_is_not_ready_for_puts_until_its_grace_ends() -> None:
    from tidekv.config import MasterConfig
    from tidekv.store.master.service import MasterService

    from tests.store.rig import FakeClock

    clock = FakeClock()
    service = MasterService(MasterConfig(client_ttl_s=3.0, metrics_port=-1), clock=clock)

    def put_kind() -> str:
        reply = p.decode_reply(service.handle(p.encode(p.Envelope(p.PROTOCOL_VERSION, 1, p.PutStart("w", [b"k"], [9])))))
        return reply.error_kind or str(p.Status(reply.result[0][0]).name)

    assert put_kind() == p.ErrorKind.NOT_READY, "holders re-mount within a heartbeat of a restart"
    clock.now += 3.1
    assert put_kind() == "OUT_OF_SPACE", "after client_ttl_s with no holder the pool is simply empty"


def test_a_restored_master_frees_nothing_it_removes_or_evicts_before_a_lease_ttl() -> None:
    """Readers may hold leases the old master granted: after a restore (failover or restart) the
    bytes of a removed object stay untouched for lease_ttl_s, and nothing is evicted meanwhile."""
    from tidekv.store.master.journal import Mirror

    old = _rig(pages=4, lease_ttl_s=2.0)
    old.service.enable_journal()
    for i in range(4):
        old.put("w", f"k{i}".encode(), PAGE)
    mirror = Mirror(2.0)
    mirror.apply(old.service.snapshot(), old.clock.now)
    new = ServiceRig(lease_ttl_s=2.0, high_watermark=1.0)
    new.service.restore(mirror)
    new.hello("w")
    offset = new.service.objects.objects[b"k0"].replicas[1]  # no get: no lease of the new master's own
    assert new.remove(b"k0") == Status.OK
    assert new.put("w", b"n0", PAGE).status == Status.OUT_OF_SPACE, "k0's bytes wait out the old leases; no eviction"
    new.advance(2.1)
    assert new.put("w", b"n0", PAGE).status == Status.OK
    assert new.service.objects.objects[b"n0"].replicas[1] == offset


def test_a_writers_own_unanswered_put_is_replaced_or_revoked_not_a_no_op() -> None:
    """After a failover a writer's put_start may have been applied without the writer knowing:
    its next put of the key replaces that orphan (instead of the no-op it is for another writer's
    pending put, which would acknowledge an object that never appears), and a revoke with token
    0 drops it."""
    rig = _rig()
    orphan = rig.put_start("w", b"k", PAGE)
    assert rig.put_start("h", b"k", PAGE).status == Status.EXISTS, "another writer's pending put still wins"
    again = rig.put_start("w", b"k", PAGE)
    assert again.status == Status.OK and again.token != orphan.token
    assert rig.put_end("w", b"k", orphan.token) == Status.STALE
    assert rig.put_end("w", b"k", again.token) == Status.OK and rig.exists(b"k")
    second = rig.put_start("w", b"j", PAGE)
    assert rig.call(p.PutRevoke("h", [b"j"], [0])) == [Status.STALE], "only the writer's own"
    assert rig.call(p.PutRevoke("w", [b"j"], [0])) == [Status.OK]
    assert rig.put_end("w", b"j", second.token) == Status.STALE
    assert rig.stats()["pending_puts"] == 0 and rig.stats()["used_bytes"] == PAGE


def test_a_restored_master_keeps_each_shards_lru_order_and_evicts_the_old_first() -> None:
    """The index is in hash shards (``store.master.shards``): a snapshot sends each shard oldest first,
    wire-encoded as a standby gets it, and the restored table keeps every shard's order, so what
    the old master read last is evicted last by the new one."""
    from tidekv.store.master.journal import Mirror, decode_ops, encode_ops

    old = _rig(pages=64)
    keys = _keys("k", 64)
    for key in keys:
        old.put("w", key, PAGE)
    touched = keys[:8]  # the oldest puts, read last: the newest by use
    for key in touched:
        assert old.get(key).status == Status.OK
    mirror = Mirror(old.config.lease_ttl_s)
    mirror.apply(decode_ops(encode_ops(old.service.snapshot())), old.clock.now)
    new = ServiceRig(lease_ttl_s=old.config.lease_ttl_s, high_watermark=1.0)
    new.service.restore(mirror)
    before, after = old.service.objects.objects, new.service.objects.objects
    assert [list(s) for s in after._shards] == [list(s) for s in before._shards], "each shard's order kept"
    assert sorted(k for k, _ in after.by_age()) == sorted(keys)
    new.hello("w")
    new.advance(new.config.lease_ttl_s + 0.1)  # past the restored table's quarantine
    for i in range(8):
        assert new.put("w", f"n{i}".encode(), PAGE).status == Status.OK  # a full segment: each evicts one
    assert all(new.exists(key) for key in touched), "the recently read objects outlive the eviction"


def test_a_restore_keeps_the_lru_order_across_shards_and_puts_since_the_snapshot_are_newest() -> None:
    """A snapshot carries each object's LRU stamp, so the restored index has the old one's order
    exactly, across shards too (a journal written before stamps is placed approximately: the test
    below); a put journaled after the snapshot is newer than everything in it."""
    from tidekv.store.master.journal import EndOp, Mirror, StartOp, decode_ops, encode_ops

    old = _rig(pages=64)
    keys = _keys("k", 48)
    for key in keys:
        old.put("w", key, PAGE)
    for key in keys[10:30:3] + keys[:4]:
        assert old.get(key).status == Status.OK
    order = [k for k, _ in old.service.objects.objects.by_age()]
    assert order != keys, "the reads changed the order"
    mirror = Mirror(old.config.lease_ttl_s)
    mirror.apply(decode_ops(encode_ops(old.service.snapshot())), old.clock.now)
    start = StartOp(10**6, b"later", PAGE, ["seg-h", 63 * PAGE], 0, False, "w", 1)
    mirror.apply([start, EndOp(b"later", 10**6)], old.clock.now)  # as the log after the snapshot has it
    new = ServiceRig(lease_ttl_s=old.config.lease_ttl_s, high_watermark=1.0)
    new.service.restore(mirror)
    assert [k for k, _ in new.service.objects.objects.by_age()] == [*order, b"later"]
    assert new.service.objects.objects.records == 0, "restored packed"
    new.hello("w")
    new.advance(new.config.lease_ttl_s + 0.1)  # past the restored table's quarantine
    assert new.put("w", b"next", PAGE).status == Status.OK
    assert [k for k, _ in new.service.objects.objects.by_age()][-2:] == [b"later", b"next"]


def test_a_journal_without_stamps_restores_each_shards_order() -> None:
    """Snapshots written before they carried stamps (every ``ObjectOp.used`` 0) still restore, each
    shard in its order."""
    from tidekv.store.master.journal import Mirror, ObjectOp, decode_ops, encode_ops

    old = _rig(pages=64)
    keys = _keys("k", 32)
    for key in keys:
        old.put("w", key, PAGE)
    for key in keys[:5]:
        assert old.get(key).status == Status.OK
    ops = [ObjectOp(op.key, op.size, op.replicas, op.pin, op.token, op.want) if isinstance(op, ObjectOp) else op
           for op in old.service.snapshot()]
    mirror = Mirror(old.config.lease_ttl_s)
    mirror.apply(decode_ops(encode_ops(ops)), old.clock.now)
    new = ServiceRig(lease_ttl_s=old.config.lease_ttl_s, high_watermark=1.0)
    new.service.restore(mirror)
    before, after = old.service.objects.objects, new.service.objects.objects
    assert [list(s) for s in after._shards] == [list(s) for s in before._shards]


def _snapshot_after_reads(path: str) -> None:
    """The old master of the test below: 64 puts, the 8 oldest read again, its snapshot written
    to ``path`` as a standby or a journal gets it."""
    from tidekv.store.master.journal import encode_ops

    old = _rig(pages=64)
    keys = _keys("k", 64)
    for key in keys:
        old.put("w", key, PAGE)
    for key in keys[:8]:
        assert old.get(key).status == Status.OK
    with open(path, "wb") as f:
        f.write(encode_ops(old.service.snapshot()))


def _restore_and_evict(path: str) -> None:
    """The new master: restores the snapshot, puts 8 new objects into its full segment (each
    evicts one) and prints the old keys still there."""
    from tidekv.store.master.journal import Mirror, decode_ops

    new = ServiceRig(high_watermark=1.0)
    mirror = Mirror(new.config.lease_ttl_s)
    with open(path, "rb") as f:
        mirror.apply(decode_ops(f.read()), new.clock.now)
    new.service.restore(mirror)
    new.hello("w")
    new.advance(new.config.lease_ttl_s + 0.1)  # past the restored table's quarantine
    for i in range(8):
        assert new.put("w", f"n{i}".encode(), PAGE).status == Status.OK
    print(json.dumps([k.decode() for k in _keys("k", 64) if new.exists(k)]))


def test_a_master_restored_in_another_process_keeps_what_was_read_last(tmp_path) -> None:
    """A promoted standby or a restarted master is another process, whose ``hash()`` of the same
    keys differs (PYTHONHASHSEED): a key's shard must not depend on it, or the shards of the
    snapshot (each in its LRU order) land mixed in the new ones and a key read last can go first
    (with ``hash()`` these seeds evicted k4). Across shards the order is approximate (``shards``)."""
    path = str(tmp_path / "snapshot")
    root = Path(__file__).resolve().parents[2]
    for seed, call in (("1", f"_snapshot_after_reads({path!r})"), ("2", f"_restore_and_evict({path!r})")):
        out = subprocess.run([sys.executable, "-c", "from tests.store.test_master_service import _restore_and_evict, _snapshot_after_reads; " + call],
                             cwd=root, env={**os.environ, "PYTHONHASHSEED": seed}, capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0, out.stderr
    kept = json.loads(out.stdout.strip().splitlines()[-1])
    evicted = sorted(set(f"k{i}" for i in range(64)) - set(kept), key=lambda k: int(k[1:]))
    assert len(evicted) == 8
    assert all(f"k{i}" in kept for i in range(8)), f"evicted {evicted}: the 8 read last were among them"
