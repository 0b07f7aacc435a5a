"""Client liveness seen from the data path: dead holders fail transfers fast, paused ones come back.

A holder the master still believes alive fails reads and writes at once (connection refused),
and a failed write revokes its put. A holder paused past ``client_ttl_s`` is declared dead (its
segment and objects leave the pool); when it resumes, its next heartbeat re-mounts the segment.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.store.conftest import Connect, SpawnAgent, SpawnMaster
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


def test_paused_holder_is_dropped_then_remounts_when_it_resumes(spawn_master: SpawnMaster, spawn_agent: SpawnAgent,
                                                               connect: Connect) -> None:
    master = spawn_master(client_ttl_s=1.0)
    holder = spawn_agent(master.address, 4 * MIB)
    st = connect(master.address)
    st.put("k", b"v" * 1000)
    os.kill(holder.pid, signal.SIGSTOP)
    try:
        wait_until(lambda: not st.stats()["segments"], 10.0, "the master to drop the paused holder's segment")
        assert st.stats()["objects_lost"] == 1
        with pytest.raises(ObjectNotFoundError):
            st.get("k")
    finally:
        os.kill(holder.pid, signal.SIGCONT)
    stats = wait_until(lambda: (s := st.stats())["segments"].keys() == {holder.segment} and s, 10.0,
                       "the resumed holder to re-mount its segment")
    assert stats["clients"] == 2 and stats["used_bytes"] == 0
    st.put("k", b"w" * 1000)
    assert st.get("k") == b"w" * 1000
    assert holder.call("get", key="k")["size"] == 1000
