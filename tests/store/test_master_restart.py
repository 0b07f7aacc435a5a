"""Master restart on the same port: clients re-hello and re-mount; objects are not re-registered.

This is the documented behaviour until the high-availability work: a restarted master starts
empty. Heartbeats come back with need_remount, every live client says hello again and re-mounts
its segment, the keys written before the restart are gone (ObjectNotFound), and new puts and gets
work across the re-mounted segments.
"""

from __future__ import annotations

import pytest

from tests.store.conftest import Connect, SpawnAgent, SpawnMaster
from tests.store.payload import digest, payload
from tests.store.procs import wait_until
from tidekv.errors import MasterUnavailableError, ObjectNotFoundError

MIB = 1 << 20


@pytest.mark.parametrize("how", ["sigkill", "clean-stop"])
def test_restart_remounts_segments_and_starts_empty(how: str, spawn_master: SpawnMaster, spawn_agent: SpawnAgent,
                                                    connect: Connect) -> None:
    first = spawn_master(client_ttl_s=5.0)
    holder = spawn_agent(first.address, 8 * MIB, rpc_timeout_s=1.0)
    local = connect(first.address, segment_size=8 * MIB, rpc_timeout_s=1.0)
    old = [f"old-{i}" for i in range(6)]
    for i, key in enumerate(old):
        local.put(key, payload(i, 100_000))
    holder.call("put", key="old-on-holder", size=1000, seed=50)
    assert local.stats()["keys"] == 7

    if how == "sigkill":
        first.kill()
    else:
        first.stop()
    with pytest.raises(MasterUnavailableError, match=first.address):
        local.exists("old-0")

    second = spawn_master(port=first.port, client_ttl_s=5.0)
    assert second.address == first.address and second.master_id != first.master_id
    stats = wait_until(
        lambda: (s := local.stats())["segments"].keys() == {local.segment_name, holder.segment} and s,
        10.0, "both clients to re-mount their segments on the new master")
    assert stats["master_id"] == second.master_id
    assert stats["clients"] == 2 and stats["capacity_bytes"] == 16 * MIB
    assert (stats["keys"], stats["used_bytes"]) == (0, 0), "the new master starts empty"

    assert local.exists_many(old + ["old-on-holder"]) == [False] * 7
    with pytest.raises(ObjectNotFoundError):
        local.get("old-0")
    reply = holder.try_call("get", key="old-on-holder")
    assert (reply["ok"], reply["error_type"]) == (False, "ObjectNotFoundError")

    new = {f"new-{i}": payload(100 + i, 200_000) for i in range(6)}
    for key, data in new.items():
        local.put(key, data, replicas=2)
    holder.call("put", key="new-on-holder", size=5000, seed=51)
    segments = local.stats()["segments"]
    assert all(s["used"] > 0 for s in segments.values()), f"both re-mounted segments must take objects: {segments}"
    for key, data in new.items():
        assert local.get(key) == data
        assert holder.call("get", key=key)["digest"] == digest(data)
    assert local.get("new-on-holder") == payload(51, 5000)
    old_key_again = payload(7, 3000)
    local.put("old-0", old_key_again)
    assert local.get("old-0") == old_key_again
