"""Re-replication (``store.master.repairs``): objects that lost replicas get them back from a holder.

Service level (``ServiceRig``): a lapsed holder's objects are handed to another holder to copy;
a good report adds the replica, a report for a version removed meanwhile frees the copy, a
failed or late one keeps its bytes to the deadline and the object is tried again; repairs never
evict, never go where a replica already is, and a journal carries them across a restore. Over
processes: two holders, one killed and a new one started, the new one copies everything, then
the other is killed too and every object still reads back byte for byte.
"""

from __future__ import annotations

import random

import msgspec
import pytest
from tidekv.store.master.journal import Mirror, decode_ops, encode_ops
from tidekv.store.wire import protocol as p
from tidekv.store.wire.protocol import Status

from tests.store.conftest import Connect, SpawnAgent, SpawnMaster
from tests.store.payload import payload
from tests.store.procs import wait_until
from tests.store.rig import ServiceRig

SEG = 1 << 20


def _repairs(rig: ServiceRig, client: str, done: list[p.RepairResult] | None = None) -> list[p.RepairTask]:
    return msgspec.convert(rig.call(p.Repairs(client, done or [])), list[p.RepairTask])


@pytest.fixture
def rig() -> ServiceRig:
    """Holders a, b, c with a segment each; a and b hold "k" (two replicas); a then lapses."""
    r = ServiceRig(client_ttl_s=1.0, suspend_grace_s=30.0, put_timeout_s=5.0, lease_ttl_s=0.0)
    for c in ("a", "b"):
        r.hello(c)
        r.mount(c, f"seg-{c}", SEG, incarnation=f"inc-{c}")
    slot = r.put("a", b"k", 5000, replicas=2, preferred="seg-a")
    assert {loc.segment for loc in slot.locations} == {"seg-a", "seg-b"}
    r.hello("c")
    r.mount("c", "seg-c", SEG)
    assert _repairs(r, "c") == [], "nothing is degraded yet"
    for _ in range(3):  # a falls silent; b and c keep beating
        r.heartbeat("b")
        r.heartbeat("c")
        r.advance(0.5)
    assert "seg-a" in r.service.segments.suspended
    return r


def test_a_lapsed_holders_objects_are_copied_to_another_holder(rig: ServiceRig) -> None:
    assert _repairs(rig, "b") == [], "b holds a replica already"
    [task] = _repairs(rig, "c")
    assert (task.key, task.size) == (b"k", 5000)
    assert [loc.segment for loc in task.sources] == ["seg-b"]
    seg_c = rig.service.segments.segments["seg-c"]
    assert seg_c.base <= task.target < seg_c.base + SEG and seg_c.used > 0
    assert _repairs(rig, "c") == [], "one repair per object at a time"
    assert _repairs(rig, "c", [p.RepairResult(b"k", task.token, True)]) == []
    assert {loc.segment for loc in rig.get(b"k").locations} == {"seg-b", "seg-c"}
    assert rig.stats()["repairs"] == {"under_way": 0, "done": 1, "failed": 0, "stale": 0, "started": 1}


def test_a_copy_of_a_version_removed_meanwhile_is_freed(rig: ServiceRig) -> None:
    [task] = _repairs(rig, "c")
    assert rig.remove(b"k") == Status.OK
    _repairs(rig, "c", [p.RepairResult(b"k", task.token, True)])
    assert rig.service.segments.segments["seg-c"].used == 0
    assert rig.stats()["repairs"]["stale"] == 1


def test_a_failed_or_late_repair_keeps_its_bytes_to_the_deadline_and_is_retried(rig: ServiceRig) -> None:
    [task] = _repairs(rig, "c")
    used = rig.service.segments.segments["seg-c"].used
    # Failed (the copy may still be landing): tried again at once, into other bytes.
    [again] = _repairs(rig, "c", [p.RepairResult(b"k", task.token, False)])
    assert again.target != task.target and rig.service.segments.segments["seg-c"].used >= 2 * used
    for _ in range(12):  # no report at all: given up at the deadline (put_timeout_s), and retried
        rig.heartbeat("b")
        rig.heartbeat("c")
        rig.advance(0.5)
    assert rig.stats()["repairs"]["failed"] == 2
    [third] = _repairs(rig, "c")
    _repairs(rig, "c", [p.RepairResult(b"k", third.token, True)])
    assert len(rig.get(b"k").locations) == 2
    _repairs(rig, "c", [p.RepairResult(b"k", again.token, True)])  # a report for a repair given up: ignored
    assert len(rig.get(b"k").locations) == 2


def test_repairs_never_evict_and_never_double_a_replica(rig: ServiceRig) -> None:
    for i in range(SEG // 4096):  # c's segment full of c's own pinned objects
        assert rig.put("c", f"c{i}".encode(), 4096, preferred="seg-c", pin=p.Pin.HARD).status == Status.OK
    assert _repairs(rig, "c") == []
    assert rig.stats()["evictions"] == 0


def test_a_target_holder_that_lapses_has_its_repairs_cancelled(rig: ServiceRig) -> None:
    rig.mount("c", "seg-c", SEG)
    [task] = _repairs(rig, "c")
    for _ in range(3):  # now c falls silent too (its segment has no incarnation: dropped)
        rig.heartbeat("b")
        rig.advance(0.5)
    assert not rig.service.objects.repairs.under_way
    rig.hello("d")
    rig.mount("d", "seg-d", SEG)
    [task] = _repairs(rig, "d")
    assert [loc.segment for loc in task.sources] == ["seg-b"]


def test_a_repair_survives_a_restore_from_the_journal() -> None:
    rig = ServiceRig(client_ttl_s=1.0, suspend_grace_s=30.0, put_timeout_s=5.0, lease_ttl_s=0.0)
    rig.service.enable_journal()
    mirror = Mirror(rig.config.lease_ttl_s)
    for c in ("a", "b", "c"):
        rig.hello(c)
        rig.mount(c, f"seg-{c}", SEG, incarnation=f"inc-{c}")
    rig.put("a", b"k", 5000, replicas=2, preferred="seg-a")
    rig.call(p.UnmountSegment("a", "seg-a"))
    [task] = _repairs(rig, "c" if "seg-c" not in {loc.segment for loc in rig.get(b"k").locations} else "b")
    mirror.apply(decode_ops(encode_ops(rig.service.take_ops()[1])), rig.clock.now)
    snapshot = Mirror(rig.config.lease_ttl_s)
    snapshot.apply(rig.service.snapshot(), rig.clock.now)
    for source in (mirror, snapshot):
        restored = ServiceRig(client_ttl_s=1.0, put_timeout_s=5.0, lease_ttl_s=0.0)
        restored.service.restore(source)
        under_way = restored.service.objects.repairs.under_way
        assert list(under_way) == [b"k"], "the repair and its reserved bytes came across"
        holder = under_way[b"k"].client_id
        for i in range(40):  # nothing new lands on the reserved bytes
            restored.put(holder, f"n{i}".encode(), 4096)
        restored.call(p.Repairs(holder, [p.RepairResult(b"k", task.token, True)]))
        assert len(restored.get(b"k").locations) == 2


MIB = 1 << 20


def test_holders_killed_one_after_another_lose_nothing(spawn_master: SpawnMaster, spawn_agent: SpawnAgent,
                                                       connect: Connect) -> None:
    """The soak's failure: objects on holders a and b (two replicas each); a is killed and a new
    holder c starts; c copies every object; then b is killed: every object is still there."""
    master = spawn_master(client_ttl_s=1.0, lease_ttl_s=0.5, suspend_grace_s=30.0)
    holder_a = spawn_agent(master.address, 16 * MIB)
    holder_b = spawn_agent(master.address, 16 * MIB)
    writer = connect(master.address)
    rng = random.Random(5)
    objects = {f"obj-{i}": payload(i, rng.randint(1, MIB // 4)) for i in range(40)}
    writer.put_many(list(objects), list(objects.values()), replicas=2)
    holder_a.kill()
    holder_c = spawn_agent(master.address, 16 * MIB)
    wait_until(lambda: writer.stats()["repairs"]["done"] >= len(objects), 20.0,
               "the new holder to copy every object of the killed one")
    located = writer.locate_many(list(objects))
    assert all(sorted(engines) == sorted([holder_b.engine, holder_c.engine]) for engines in located), located
    holder_b.kill()
    wait_until(lambda: writer.stats()["segments"].keys() == {holder_c.segment}, 10.0,
               "the master to suspend the second killed holder")
    for key, data in objects.items():
        assert writer.get(key) == data, f"{key} lost with its holders"
    stats = writer.stats()
    assert stats["objects_lost"] == 0 and stats["repairs"]["failed"] == 0


def test_a_returning_holder_gives_up_replicas_copied_elsewhere_meanwhile(rig: ServiceRig) -> None:
    """a lapsed, c copied "k": when a comes back, k has its two replicas (b, c), so a's is freed
    rather than making three; the same on a journal restore (Mirror's ResumeOp)."""
    rig.service.enable_journal()
    rig.service.take_ops()  # (the fixture's ops came before the journal: start from its snapshot)
    mirror = Mirror(rig.config.lease_ttl_s)
    mirror.apply(rig.service.snapshot(), rig.clock.now)
    [task] = _repairs(rig, "c")
    _repairs(rig, "c", [p.RepairResult(b"k", task.token, True)])
    rig.put("b", b"only-b", 4096, replicas=2, preferred="seg-b")  # a is away: b and c
    used_a = rig.service.segments.suspended["seg-a"].segment.used
    assert used_a > 0
    rig.hello("a")
    result = rig.mount("a", "seg-a", SEG, incarnation="inc-a")
    assert (result.outcome, result.restored, result.superseded) == (p.MountOutcome.RESUMED, 0, 1)
    assert {loc.segment for loc in rig.get(b"k").locations} == {"seg-b", "seg-c"}
    assert rig.service.segments.segments["seg-a"].used == 0, "a's copy of k is free again"
    assert rig.service.objects.counters.replicas_trimmed == 1
    mirror.apply(decode_ops(encode_ops(rig.service.take_ops()[1])), rig.clock.now)
    restored = ServiceRig(client_ttl_s=1.0, put_timeout_s=5.0, lease_ttl_s=0.0)
    restored.service.restore(mirror)
    assert {loc.segment for loc in restored.get(b"k").locations} == {"seg-b", "seg-c"}
    assert restored.service.segments.segments["seg-a"].used == 0


def test_a_returning_holder_keeps_the_replicas_still_short(rig: ServiceRig) -> None:
    """No copy was made while a was away: its replica of k comes back (k has two again)."""
    rig.hello("a")
    result = rig.mount("a", "seg-a", SEG, incarnation="inc-a")
    assert (result.restored, result.superseded) == (1, 0)
    assert {loc.segment for loc in rig.get(b"k").locations} == {"seg-a", "seg-b"}
