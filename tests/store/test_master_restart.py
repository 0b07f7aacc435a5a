"""Master restart on the same port.

Without ``state_dir`` a restarted master starts empty: heartbeats come back with need_remount,
every live client says hello again and re-mounts its segment, the keys written before the
restart are gone (ObjectNotFound), and new puts and gets work across the re-mounted segments.
With ``state_dir`` (``test_restart_with_state_dir_loses_nothing``) every acknowledged object is
back, byte for byte, before the master serves again; removed keys stay removed and upserts show
their newest version; a holder suspended before the restart (paused past ``client_ttl_s``) is
still suspended after it, and gets its objects back when it resumes.
"""

from __future__ import annotations

import os
import re
import signal
import time
import urllib.request
from pathlib import Path

import pytest
from tidekv.errors import MasterUnavailableError, ObjectNotFoundError
from tidekv.store.wire import protocol as p

from tests.store.conftest import Connect, SpawnAgent, SpawnMaster
from tests.store.payload import digest, payload
from tests.store.procs import wait_until

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
        local._rpc.call(p.Exists([b"old-0"]), failover_timeout_s=0)

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


@pytest.mark.parametrize("how", ["sigkill", "clean-stop"])
def test_restart_with_state_dir_loses_nothing(how: str, tmp_path: Path, spawn_master: SpawnMaster,
                                              spawn_agent: SpawnAgent, connect: Connect) -> None:
    state = str(tmp_path / "state")
    first = spawn_master(client_ttl_s=5.0, state_dir=state)
    holder = spawn_agent(first.address, 8 * MIB, rpc_timeout_s=1.0, failover_timeout_s=20.0)
    local = connect(first.address, segment_size=8 * MIB, rpc_timeout_s=1.0, failover_timeout_s=20.0)
    objects = {f"k-{i}": payload(i, 1000 + 997 * i) for i in range(40)}
    for i, (key, data) in enumerate(objects.items()):
        local.put(key, data, replicas=2 if i % 3 == 0 else 1)
    holder.call("put", key="on-holder", size=5000, seed=77)
    objects["on-holder"] = payload(77, 5000)
    for i in range(5):
        local.remove(f"k-{i}")
        del objects[f"k-{i}"]
    local.upsert("k-10", b"newest version")
    objects["k-10"] = b"newest version"
    before = local.stats()

    first.kill() if how == "sigkill" else first.stop()
    second = spawn_master(port=first.port, client_ttl_s=5.0, state_dir=state)
    started = time.monotonic()
    for key, data in objects.items():  # the first get waits out the recovery (not_ready is retried)
        assert local.get(key) == data, key
    assert time.monotonic() - started < 5.0, "every object is readable within 5 s of the restart"
    for key, data in objects.items():
        assert holder.call("get", key=key)["digest"] == digest(data), key
    assert local.exists_many([f"k-{i}" for i in range(5)]) == [False] * 5, "removed keys stay removed"
    after = local.stats()
    assert after["master_id"] == second.master_id != before["master_id"]
    assert (after["keys"], after["used_bytes"], after["capacity_bytes"]) == \
        (before["keys"], before["used_bytes"], before["capacity_bytes"])
    # The recovered allocators know what is taken: new objects never overwrite old ones.
    new = {f"new-{i}": payload(500 + i, 50_000) for i in range(20)}
    for key, data in new.items():
        local.put(key, data)
    for key, data in {**objects, **new}.items():
        assert local.get(key) == data, key


def test_a_holder_suspended_before_a_restart_with_state_dir_gets_its_objects_back(
        tmp_path: Path, spawn_master: SpawnMaster, spawn_agent: SpawnAgent, connect: Connect) -> None:
    state = str(tmp_path / "state")
    first = spawn_master(client_ttl_s=1.0, state_dir=state)
    holder = spawn_agent(first.address, 8 * MIB, rpc_timeout_s=1.0, failover_timeout_s=20.0)
    local = connect(first.address, rpc_timeout_s=1.0, failover_timeout_s=20.0)
    for i in range(8):
        holder.call("put", key=f"h-{i}", size=3000 + i, seed=i)
    os.kill(holder.pid, signal.SIGSTOP)
    try:
        wait_until(lambda: local.stats()["suspended_keys"] == 8, 10.0, "the master to suspend the paused holder")
        first.kill()
        second = spawn_master(port=first.port, client_ttl_s=1.0, state_dir=state)
        stats = wait_until(lambda: (s := local.stats())["master_id"] == second.master_id and s, 10.0,
                           "the restarted master to serve")
        assert stats["suspended_segments"].keys() == {holder.segment} and stats["suspended_keys"] == 8
        assert not local.exists("h-0")
    finally:
        os.kill(holder.pid, signal.SIGCONT)
    wait_until(lambda: local.stats()["keys"] == 8, 10.0, "the resumed holder's objects to return")
    for i in range(8):
        assert local.get(f"h-{i}") == payload(i, 3000 + i)
    assert "8 objects restored, 0 superseded" in holder.log_text()


def test_a_master_folding_its_journal_as_it_serves_loses_nothing(tmp_path: Path, spawn_master: SpawnMaster,
                                                                  connect: Connect) -> None:
    """With a small ``fold_log_bytes`` the master folds its journal again and again in forked
    children while the client puts and removes; a SIGKILL at any point, a fold in flight or not,
    loses no acknowledged change."""
    state = tmp_path / "state"
    first = spawn_master(client_ttl_s=5.0, state_dir=str(state), fold_log_bytes=4096)
    local = connect(first.address, segment_size=8 * MIB, rpc_timeout_s=1.0, failover_timeout_s=20.0)
    objects: dict[str, bytes] = {}
    for i in range(300):
        objects[f"k-{i}"] = payload(i, 100 + i)
        local.put(f"k-{i}", objects[f"k-{i}"])
        if i % 7 == 3:
            local.remove(f"k-{i - 2}")
            del objects[f"k-{i - 2}"]
    log = (tmp_path / "master-0.log").read_text
    wait_until(lambda: "folded its journal into snapshot 2 " in log(), 10.0, "two folds")
    assert "the child folding its journal exited" not in log()
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{first.metrics_port}/metrics", timeout=5).read().decode()
    folds = re.search(r'^tidekv_journal_folds_total\{result="done"\} (\d+)', metrics, re.M)
    assert folds and int(folds.group(1)) >= 2, metrics
    assert re.search(r'^tidekv_journal_folds_total\{result="failed"\} 0', metrics, re.M)
    pause = re.search(r"^tidekv_journal_last_fold_pause_seconds (\S+)", metrics, re.M)
    assert pause and 0 < float(pause.group(1)) < 1.0, metrics

    first.kill()
    second = spawn_master(port=first.port, client_ttl_s=5.0, state_dir=str(state), fold_log_bytes=4096)
    for key, data in objects.items():
        assert local.get(key) == data, key
    assert local.exists_many([f"k-{i}" for i in range(1, 300, 7)]) == [False] * 43, "removed keys stay removed"
    assert second.master_id != first.master_id
    # A snapshot renamed into place while its parent was killed leaves the older one behind; the
    # restarted master removes what it does not read.
    snapshots = sorted(int(f.name.split(".")[1]) for f in state.glob("snapshot.*") if f.name.count(".") == 1)
    assert len(snapshots) == 1 and snapshots[0] >= 2, sorted(f.name for f in state.iterdir())
