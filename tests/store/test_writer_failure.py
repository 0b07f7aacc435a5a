"""Unfinished puts: a writer SIGKILLed mid-put, and one too slow to end its put.

Either way the master reclaims the put: its space returns to the pool, readers never saw the
partial object, and the key can be put again.
"""

from __future__ import annotations

import msgspec
import pytest
from tidekv.errors import ObjectNotFoundError
from tidekv.store import Status
from tidekv.store.client.rpc import MasterChannel
from tidekv.store.wire import protocol as p

from tests.store.conftest import Connect, SpawnAgent, SpawnMaster
from tests.store.payload import payload
from tests.store.procs import wait_until

MIB = 1 << 20


def test_writer_killed_mid_put_is_reclaimed_and_key_reusable(spawn_master: SpawnMaster, spawn_agent: SpawnAgent,
                                                              connect: Connect) -> None:
    master = spawn_master(client_ttl_s=1.0, put_timeout_s=600.0, tick_s=0.05)
    spawn_agent(master.address, 8 * MIB)
    st = connect(master.address)
    st.put("before", b"b" * 1000)
    baseline = st.stats()["used_bytes"]
    writer = spawn_agent(master.address)
    writer.call("put_start_raw", key="k", size=2 * MIB, seed=1)  # half the bytes written, no put_end
    stats = st.stats()
    assert (stats["pending_puts"], stats["used_bytes"]) == (1, baseline + 2 * MIB)
    assert not st.exists("k")
    with pytest.raises(ObjectNotFoundError):
        st.get("k")
    st.put("k", b"ignored")  # the key is being written: a no-op, not a second copy
    assert st.stats()["used_bytes"] == baseline + 2 * MIB

    writer.kill()
    stats = wait_until(lambda: (s := st.stats())["pending_puts"] == 0 and s, 10.0,
                       "the master to reclaim the dead writer's put")
    assert stats["used_bytes"] == baseline, "the dead writer's space must return to the pool"
    assert stats["puts_reclaimed"] == 1 and stats["clients"] == 2
    assert not st.exists("k")
    data = payload(2, 2 * MIB)
    st.put("k", data)
    assert st.get("k") == data
    assert st.get("before") == b"b" * 1000


def test_put_not_ended_within_put_timeout_is_reclaimed(spawn_master: SpawnMaster, spawn_agent: SpawnAgent,
                                                       connect: Connect) -> None:
    master = spawn_master(put_timeout_s=0.5, tick_s=0.05)
    spawn_agent(master.address, 8 * MIB)
    st = connect(master.address)
    channel = MasterChannel(master.address, st.client_id, 5.0)  # a slow writer that stays alive
    try:
        channel.call(p.Hello(st.client_id, p.PROTOCOL_VERSION))  # a connection acts for who said hello
        raw = channel.call(p.PutStart(st.client_id, [b"slow"], [MIB], 1, "", 0, False))
        slot = msgspec.convert(raw, list[p.PutSlot])[0]
        assert slot.status == Status.OK
        assert st.stats()["used_bytes"] == MIB
        wait_until(lambda: st.stats()["pending_puts"] == 0, 10.0, "the master to reclaim the slow put")
        assert st.stats()["used_bytes"] == 0
        assert channel.call(p.PutEnd(st.client_id, [b"slow"], [slot.token])) == [Status.STALE]
    finally:
        channel.close()
    assert not st.exists("slow")
    st.put("slow", b"now fast")
    assert st.get("slow") == b"now fast"
