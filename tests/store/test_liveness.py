"""Client liveness seen from the data path: dead holders fail transfers fast, paused ones come back.

A holder the master still believes alive fails reads and writes at once (connection refused),
and a failed write revokes its put. A holder paused past ``client_ttl_s`` is declared dead: its
segment is suspended (its objects unreadable); when it resumes, its next heartbeat re-mounts the
segment and every object not re-put meanwhile is readable again, byte for byte. A new process
of a holder gets nothing of the old one's; the old objects go when the suspension grace ends.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.store.conftest import Connect, SpawnAgent, SpawnMaster
from tests.store.payload import payload
from tests.store.procs import wait_until
from tidekv.errors import ObjectNotFoundError, TransferError

MIB = 1 << 20


def test_transfers_to_a_killed_holder_fail_fast_and_revoke_the_put(spawn_master: SpawnMaster,
                                                                   spawn_agent: SpawnAgent, connect: Connect) -> None:
    master = spawn_master(client_ttl_s=30.0)
    holder = spawn_agent(master.address, 4 * MIB)
    st = connect(master.address)
    st.put("before", b"b" * 1000)
    used = st.stats()["used_bytes"]
    holder.kill()
    started = time.monotonic()
    with pytest.raises(TransferError):
        st.get("before")
    with pytest.raises(TransferError):
        st.put("during", b"d" * 1000)
    assert time.monotonic() - started < 5.0, "a refused connection must not wait for a timeout"
    stats = st.stats()
    assert (stats["pending_puts"], stats["used_bytes"]) == (0, used), "the failed write's put must be revoked"
    assert not st.exists("during")


def test_paused_holder_gets_every_object_back_when_it_resumes(spawn_master: SpawnMaster, spawn_agent: SpawnAgent,
                                                             connect: Connect) -> None:
    master = spawn_master(client_ttl_s=1.0)
    holder = spawn_agent(master.address, 8 * MIB)
    st = connect(master.address, segment_size=4 * MIB)
    sizes = {f"h{i}": 1000 + i * 9973 for i in range(20)}
    for i, (key, size) in enumerate(sizes.items()):
        holder.call("put", key=key, size=size, seed=i)
    assert all(engines == [holder.engine] for engines in st.locate_many(list(sizes))), "puts land in its own segment"
    os.kill(holder.pid, signal.SIGSTOP)
    try:
        stats = wait_until(lambda: (s := st.stats())["suspended_segments"] and s, 10.0,
                           "the master to suspend the paused holder's segment")
        assert stats["suspended_segments"].keys() == {holder.segment} and stats["segments"].keys() == {st.segment_name}
        assert (stats["keys"], stats["suspended_keys"], stats["objects_lost"]) == (0, 20, 0)
        with pytest.raises(ObjectNotFoundError):
            st.get("h0")
        st.put("h1", b"newer" * 100)  # re-put while the holder is away: this version wins
    finally:
        os.kill(holder.pid, signal.SIGCONT)
    resumed = time.monotonic()
    stats = wait_until(lambda: (s := st.stats())["keys"] == 20 and s, 10.0, "the resumed holder's objects to return")
    assert time.monotonic() - resumed < 5.0, "a resumed holder re-mounts within a few heartbeats"
    assert stats["suspended_segments"] == {} and stats["segments"].keys() == {st.segment_name, holder.segment}
    assert (stats["objects_restored"], stats["objects_superseded"], stats["objects_lost"]) == (19, 1, 0)
    for i, (key, size) in enumerate(sizes.items()):
        assert st.get(key) == (b"newer" * 100 if key == "h1" else payload(i, size)), key
    assert "had expired client" in holder.log_text() and "19 objects restored, 1 superseded" in holder.log_text()


def test_a_killed_and_restarted_holder_does_not_get_its_old_objects(spawn_master: SpawnMaster,
                                                                    spawn_agent: SpawnAgent, connect: Connect) -> None:
    master = spawn_master(client_ttl_s=1.0, suspend_grace_s=4.0)
    holder = spawn_agent(master.address, 4 * MIB)
    st = connect(master.address)
    holder.call("put", key="old", size=5000, seed=7)
    holder.kill()
    wait_until(lambda: st.stats()["suspended_segments"].keys() == {holder.segment}, 10.0,
               "the master to suspend the killed holder's segment")
    again = spawn_agent(master.address, 4 * MIB)
    stats = wait_until(lambda: (s := st.stats())["segments"].keys() == {again.segment} and s, 10.0,
                       "the new holder process to mount its segment")
    assert stats["segments"][again.segment]["used"] == 0 and stats["keys"] == 0
    assert not st.exists("old") and "restored" not in again.log_text()
    stats = wait_until(lambda: (s := st.stats())["suspended_segments"] == {} and s, 10.0,
                       "the suspension grace to end")
    assert (stats["objects_lost"], stats["suspended_objects_dropped"], stats["objects_restored"]) == (1, 1, 0)
    again.call("put", key="old", size=100, seed=8)
    assert st.get("old") == payload(8, 100)


def test_a_segment_slower_to_allocate_than_client_ttl_still_mounts(spawn_master: SpawnMaster) -> None:
    """A large segment takes seconds to fault in (64 GiB, or a VM that backs fresh memory
    lazily): the client must not be declared dead meanwhile and then refused its own mount."""
    from tidekv.config import StoreConfig
    from tidekv.store import Store
    from tidekv.transfer import TransferEngine

    class SlowEngine(TransferEngine):
        def allocate(self, size: int, *, huge: bool = False):  # type: ignore[no-untyped-def]
            time.sleep(1.5)  # three client TTLs
            return super().allocate(size, huge=huge)

    master = spawn_master(client_ttl_s=0.5)
    engine = SlowEngine("127.0.0.1")
    try:
        st = Store.connect(master.address, segment_size=4 * MIB, engine=engine,
                           config=StoreConfig(staging_size_bytes=1 * MIB, heartbeat_interval_s=0.1))
        try:
            st.put("k", b"v" * 1000)
            assert st.get("k") == b"v" * 1000
            assert st.locate_many(["k"]) == [[engine.name]], "the put lands in the slow-to-allocate segment"
        finally:
            st.close()
    finally:
        engine.close()
