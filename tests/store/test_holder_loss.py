"""Puts while a holder is dead and the master does not know it yet (issue 17): a write that fails
because its holder is gone is put again elsewhere (``PutStart.avoid``), so the puts of the
seconds before the master declares the holder dead succeed instead of failing with
``PeerUnavailableError``. Service level: ``avoid`` keeps every replica off those engines. Over
processes: a holder is SIGKILLed and puts right after it all succeed, on the survivors."""

from __future__ import annotations

import time

import msgspec
import pytest
from tidekv.errors import PeerUnavailableError
from tidekv.store.wire import protocol as p
from tidekv.store.wire.protocol import Status

from tests.store.conftest import Connect, SpawnAgent, SpawnMaster
from tests.store.payload import payload
from tests.store.rig import ServiceRig

MIB = 1 << 20


def _slots(rig: ServiceRig, body: p.PutStart) -> list[p.PutSlot]:
    return msgspec.convert(rig.call(body), list[p.PutSlot])


def test_avoid_keeps_every_replica_off_those_engines() -> None:
    rig = ServiceRig()
    for c in ("a", "b", "c"):
        rig.hello(c)
        rig.mount(c, f"seg-{c}", MIB)
    avoided = "engine-of-seg-a"
    for i in range(20):
        slot = _slots(rig, p.PutStart("a", [b"k%d" % i], [4096], 2, "seg-a", 0, False, [avoided]))[0]
        assert slot.status == Status.OK
        assert {loc.engine for loc in slot.locations} == {"engine-of-seg-b", "engine-of-seg-c"}, slot
    # Only avoided segments left: out of space, and nothing was evicted to make room there.
    slots = _slots(rig, p.PutStart("a", [b"x"], [4096], 1, "", 0, False,
                                   ["engine-of-seg-a", "engine-of-seg-b", "engine-of-seg-c"]))
    assert slots[0].status == Status.OUT_OF_SPACE
    assert rig.service.objects.counters.evictions == 0


def test_puts_right_after_a_holder_dies_go_to_the_survivors(spawn_master: SpawnMaster, spawn_agent: SpawnAgent,
                                                          connect: Connect) -> None:
    # A long client_ttl_s: for all of this test the master still lists the dead holder.
    master = spawn_master(client_ttl_s=60.0, lease_ttl_s=0.5)
    doomed = spawn_agent(master.address, 16 * MIB)
    survivors = [spawn_agent(master.address, 16 * MIB), spawn_agent(master.address, 16 * MIB)]
    writer = connect(master.address)
    doomed.kill()
    started = time.monotonic()
    objects = {f"obj-{i}": payload(i, 64 << 10) for i in range(30)}
    for key, data in list(objects.items())[:10]:
        writer.put(key, data)  # one at a time: the master places some on the dead holder
    keys = list(objects)[10:20]
    writer.put_many(keys, [objects[k] for k in keys])  # a batch
    keys = list(objects)[20:]
    writer.put_many(keys, [objects[k] for k in keys], replicas=2)  # two replicas, both on survivors
    assert time.monotonic() - started < 30, "puts waited for the master to notice, not for a retry"
    assert doomed.segment in writer.stats()["segments"], "the master still lists the dead holder"
    engines = {s.engine for s in survivors}
    for key, located in zip(objects, writer.locate_many(list(objects))):
        assert located and set(located) <= engines, (key, located)
        if key in keys:
            assert sorted(located) == sorted(engines), (key, located)
    for key, data in objects.items():
        assert writer.get(key) == data


def test_a_put_with_no_live_holder_left_still_fails_with_its_reason(spawn_master: SpawnMaster,
                                                                     spawn_agent: SpawnAgent,
                                                                     connect: Connect) -> None:
    master = spawn_master(client_ttl_s=60.0)
    doomed = spawn_agent(master.address, 16 * MIB)
    writer = connect(master.address)
    doomed.kill()
    # Retried once, avoiding the dead holder: nowhere else to go, and the error says why.
    with pytest.raises(PeerUnavailableError) as info:
        writer.put("k", b"v" * 4096)
    assert info.value.peer == doomed.engine
