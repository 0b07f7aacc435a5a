"""Copy and move tasks on the master (``tidekv.store.master.tasks``) on a fake clock: the copy
handed to the target segment's holder as a repair, the task's states, a move dropping its source
replica, refusals, failures, and a task and its outcome surviving a journal replay."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from tidekv.store.master.journal import JournalFile, Mirror
from tidekv.store.wire import protocol as p
from tidekv.store.wire.protocol import Status

from tests.store.rig import RpcFailed, ServiceRig, flush_journal, reloaded

PAGE = 4096
PENDING, PROCESSING, SUCCESS, FAILED = 0, 1, 2, 3


def _rig() -> ServiceRig:
    """Holders h1 (seg-1), h2 (seg-2), h3 (seg-3); the object "k" on seg-1."""
    rig = ServiceRig(lease_ttl_s=0.0)
    for n in (1, 2, 3):
        rig.hello(f"h{n}")
        rig.mount(f"h{n}", f"seg-{n}", 16 * PAGE)
    rig.hello("w")
    assert rig.put("w", b"k", PAGE, preferred="seg-1").status == Status.OK
    return rig


def _repairs(rig: ServiceRig, client: str, done: list[p.RepairResult] | None = None) -> list[p.RepairTask]:
    return msgspec.convert(rig.call(p.Repairs(client, done or []), client), list[p.RepairTask])


def _state(rig: ServiceRig, task_id: list[int]) -> dict:
    return rig.call(p.QueryTask(task_id), "w")


def _segments(rig: ServiceRig, key: bytes) -> list[str]:
    return sorted(loc.segment for loc in rig.get(key).locations)


def test_a_copy_is_made_by_the_target_holder_and_the_task_says_so() -> None:
    rig = _rig()
    task = rig.call(p.CreateTask(0, [b"k"], ["seg-3"]), "w")
    assert _state(rig, task)["status"] == PENDING
    assert _repairs(rig, "h2") == []  # not a target
    (copy,) = _repairs(rig, "h3")
    state = _state(rig, task)
    assert state["status"] == PROCESSING and state["assigned_client"] == "h3"
    _repairs(rig, "h3", [p.RepairResult(b"k", copy.token, True)])
    assert _state(rig, task)["status"] == SUCCESS and _segments(rig, b"k") == ["seg-1", "seg-3"]


def test_a_move_drops_its_source_and_a_failed_copy_fails_the_task() -> None:
    rig = _rig()
    task = rig.call(p.CreateTask(1, [b"k"], ["seg-2"], "seg-1"), "w")
    (copy,) = _repairs(rig, "h2")
    _repairs(rig, "h2", [p.RepairResult(b"k", copy.token, True)])
    assert _state(rig, task)["status"] == SUCCESS and _segments(rig, b"k") == ["seg-2"]
    rig.advance(0.1)
    assert rig.stats()["segments"]["seg-1"]["used"] == 0  # the source's bytes are free
    failing = rig.call(p.CreateTask(0, [b"k"], ["seg-3"]), "w")
    (copy,) = _repairs(rig, "h3")
    _repairs(rig, "h3", [p.RepairResult(b"k", copy.token, False)])
    state = _state(rig, failing)
    assert state["status"] == FAILED and "failed" in state["message"] and _segments(rig, b"k") == ["seg-2"]


@pytest.mark.parametrize("body, why", [
    (p.CreateTask(0, [b"absent"], ["seg-2"]), "no complete object"),
    (p.CreateTask(0, [b"k"], ["seg-9"]), "not a mounted segment"),
    (p.CreateTask(0, [b"k"], ["seg-1"]), "holds a replica"),
    (p.CreateTask(1, [b"k"], ["seg-2"], "seg-3"), "holds none"),
    (p.CreateTask(1, [b"k"], ["seg-2", "seg-3"], "seg-1"), "one target"),
    (p.CreateTask(5, [b"k"], ["seg-2"]), "kind"),
])
def test_tasks_that_cannot_be_done_are_refused_by_name(body: p.CreateTask, why: str) -> None:
    rig = _rig()
    with pytest.raises(RpcFailed, match=why):
        rig.call(body, "w")


def test_a_task_whose_object_is_removed_fails_and_an_unknown_id_is_none() -> None:
    rig = _rig()
    task = rig.call(p.CreateTask(0, [b"k"], ["seg-2"]), "w")
    with pytest.raises(RpcFailed, match="under way"):
        rig.call(p.CreateTask(0, [b"k"], ["seg-3"]), "w")
    assert rig.remove(b"k", force=True) == Status.OK
    rig.advance(0.1)
    assert _state(rig, task)["status"] == FAILED and "removed" in _state(rig, task)["message"]
    assert _state(rig, [1, 2]) is None


def test_a_task_and_its_outcome_survive_a_journal_replay(tmp_path: Path) -> None:
    rig = _rig()
    rig.service.enable_journal()
    journal = JournalFile(tmp_path)
    journal.load(Mirror(0.0), 0.0)
    journal.resume()
    journal.rewrite(rig.service.snapshot())
    done = rig.call(p.CreateTask(1, [b"k"], ["seg-2"], "seg-1"), "w")
    (copy,) = _repairs(rig, "h2")
    _repairs(rig, "h2", [p.RepairResult(b"k", copy.token, True)])
    assert rig.put("w", b"k2", PAGE, preferred="seg-1").status == Status.OK
    open_task = rig.call(p.CreateTask(0, [b"k2"], ["seg-3"]), "w")
    flush_journal(rig, journal)
    journal.close()
    restored = reloaded(tmp_path)
    for n in (1, 2, 3):
        restored.hello(f"h{n}")
    restored.hello("w")
    assert _state(restored, done)["status"] == SUCCESS and _segments(restored, b"k") == ["seg-2"]
    assert _state(restored, open_task)["status"] == PENDING
    (copy,) = _repairs(restored, "h3")  # the task goes on under the new master
    _repairs(restored, "h3", [p.RepairResult(b"k2", copy.token, True)])
    assert _state(restored, open_task)["status"] == SUCCESS
