"""JournalFile: what a lone master with --state-dir writes, read back after compactions and a
crash that cut the last frame short; a half-written snapshot is ignored. Folds in a forked
child (``Fold``): the snapshot is the index at the cut, and a child that fails, is killed or a
crash between the cut and the rename loses nothing."""

from __future__ import annotations

import errno
import os
import pickle
import signal
import time
from pathlib import Path

import pytest
from tidekv import Store
from tidekv.config import MasterConfig, StoreConfig
from tidekv.store.master import fold as fold_module
from tidekv.store.master.fold import Fold
from tidekv.store.master.journal import ColumnPartOp, ColumnsOp, JournalFile, Mirror
from tidekv.store.master.server import MasterServer
from tidekv.store.wire import protocol as p

from tests.store.procs import wait_until
from tests.store.rig import ServiceRig, flush_journal, reloaded

PAGE = 4096


def _index(rig: ServiceRig) -> dict[bytes, tuple[int, tuple[object, ...]]]:
    return {k: (m.size, m.replicas) for k, m in rig.service.objects.objects.items() if m.put is None}


def _filled(tmp_path: Path, keys: range) -> tuple[ServiceRig, JournalFile]:
    rig = ServiceRig(lease_ttl_s=0.0)
    rig.service.enable_journal()
    journal = JournalFile(tmp_path)
    journal.load(Mirror(0.0), 0.0)
    journal.resume()
    rig.hello("h")
    rig.mount("h", "seg", 256 * PAGE)
    _put(rig, journal, keys)
    return rig, journal


def _put(rig: ServiceRig, journal: JournalFile, keys: range) -> None:
    for i in keys:
        rig.put("h", f"a{i}".encode(), PAGE)
        flush_journal(rig, journal)


def _snapshot_alone(tmp_path: Path, generation: int) -> dict[bytes, tuple[int, tuple[object, ...]]]:
    """The index snapshot.GENERATION holds by itself (read from a copy, without the logs)."""
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / f"snapshot.{generation}").write_bytes((tmp_path / f"snapshot.{generation}").read_bytes())
    return _index(reloaded(alone))


@pytest.mark.parametrize("columns", [True, False], ids=["columns", "ops"])  # (ops: snapshots before columns)
def test_snapshot_then_log_then_a_torn_frame_read_back(tmp_path: Path, columns: bool) -> None:
    rig, journal = _filled(tmp_path, range(40))
    journal.rewrite(rig.service.snapshot(columns))  # generation 1
    for i in range(10):
        rig.remove(f"a{i}".encode())
        rig.call(p.PutStart("h", [f"a{20 + i}".encode()], [2 * PAGE], upsert=True))
        flush_journal(rig, journal)
    for key, token in [(f"a{20 + i}".encode(), rig.service.objects.upserts[f"a{20 + i}".encode()].put.token)
                       for i in range(10)]:
        rig.put_end("h", key, token)
        flush_journal(rig, journal)
    journal.rewrite(rig.service.snapshot(columns))  # generation 2: the old files go
    rig.put("h", b"last", PAGE)
    flush_journal(rig, journal)
    journal.close()
    assert sorted(f.name for f in tmp_path.iterdir()) == ["log.2", "snapshot.2"]
    with open(tmp_path / "log.2", "ab") as f:
        f.write(b"\x40\x00\x00\x00 cut short")  # a crash in the middle of an unanswered batch
    (tmp_path / "snapshot.3.tmp").write_bytes(b"half a snapshot")  # a crash in the middle of compaction

    restored = reloaded(tmp_path)
    assert _index(restored) == _index(rig)
    assert len(_index(restored)) == 31
    assert os.path.getsize(tmp_path / "log.2") < 100, "resume cut the torn frame off"
    assert _index(reloaded(tmp_path)) == _index(rig), "and reading again gives the same"


def test_a_snapshot_in_columns_is_read_whole_and_builds_no_object_but_keys_and_ints(tmp_path: Path) -> None:
    """The columns' path: the packed objects come back as the index's own shards (no op each),
    leases dropped; a column part that would build anything else (a class, a function) is
    refused, so the master does not serve from it."""
    rig, journal = _filled(tmp_path, range(30))
    index = rig.service.objects.objects
    index.read(b"a3", rig.clock.now + 100.0)  # a lease (as a get grants): the old process's clock, not written
    assert index.lease_of(index.raw(b"a3")) > 0
    journal.rewrite(rig.service.snapshot(columns=True))
    journal.close()
    mirror = Mirror(0.0)
    JournalFile(tmp_path).load(mirror, 0.0)
    assert mirror.base is not None and len(mirror.base) == 30 and not mirror.objects
    assert all(meta.lease_until == 0.0 for _, meta in mirror.base.items())
    assert _index(reloaded(tmp_path)) == _index(rig)

    bad = Mirror(0.0)
    bad.apply([ColumnsOp(16, ["seg"], 1)], 0.0)
    with pytest.raises(pickle.UnpicklingError, match="only keys and ints"):
        bad.apply([ColumnPartOp(0, pickle.dumps({b"k": os.getcwd}))], 0.0)
    with pytest.raises(pickle.UnpicklingError, match="not a dict"):
        bad.apply([ColumnPartOp(0, pickle.dumps([1, 2]))], 0.0)


def test_a_crash_between_the_cut_and_the_snapshot_replays_every_log(tmp_path: Path) -> None:
    rig, journal = _filled(tmp_path, range(20))
    at_cut = list(rig.service.snapshot(columns=True))
    assert journal.cut() == 1  # then the master dies before snapshot.1 is renamed into place
    rig.remove(b"a3")
    _put(rig, journal, range(20, 30))
    journal.close()
    (tmp_path / "snapshot.1.tmp").write_bytes(b"half a snapshot")
    assert _index(reloaded(tmp_path)) == _index(rig), "snapshot 0 (none), log.0 then log.1"
    assert sorted(f.name for f in tmp_path.iterdir()) == ["log.0", "log.1"], "both logs kept, the half snapshot gone"

    JournalFile(tmp_path).write_snapshot(1, at_cut)  # the crash comes after the rename, before the old log goes
    assert sorted(f.name for f in tmp_path.iterdir()) == ["log.0", "log.1", "snapshot.1"]
    assert _index(reloaded(tmp_path)) == _index(rig), "snapshot.1 then log.1; log.0 ignored"
    assert sorted(f.name for f in tmp_path.iterdir()) == ["log.1", "snapshot.1"], "log.0 removed on resume"


def test_a_forked_fold_writes_the_index_as_it_was_at_the_cut(tmp_path: Path) -> None:
    rig, journal = _filled(tmp_path, range(20))
    at_cut = _index(rig)
    fold = Fold(journal, lambda: rig.service.snapshot(columns=True))
    rig.remove(b"a0")  # the parent goes on while its child writes
    _put(rig, journal, range(20, 25))
    assert fold.finish(), f"the child exited with {fold.exit_code}"
    assert fold.exit_code == 0 and fold.generation == 1 and 0 < fold.forked_s <= fold.seconds
    assert sorted(f.name for f in tmp_path.iterdir()) == ["log.1", "snapshot.1"]
    assert (journal.generation, journal.current) == (1, 1)
    _put(rig, journal, range(25, 27))
    journal.close()
    assert _snapshot_alone(tmp_path, 1) == at_cut
    assert _index(reloaded(tmp_path)) == _index(rig)
    assert len(_index(rig)) == 26


def test_a_fold_whose_child_fails_loses_nothing(tmp_path: Path) -> None:
    rig, journal = _filled(tmp_path, range(10))

    def broken() -> list[object]:
        raise MemoryError("the child ran out of memory")

    fold = Fold(journal, broken)  # type: ignore[arg-type]
    _put(rig, journal, range(10, 15))
    assert not fold.finish() and fold.exit_code == 1
    assert sorted(f.name for f in tmp_path.iterdir()) == ["log.0", "log.1"]
    assert _index(reloaded(tmp_path)) == _index(rig)

    again = Fold(journal, lambda: rig.service.snapshot(columns=True))  # the next fold starts over from the whole index
    _put(rig, journal, range(15, 17))
    assert again.finish() and again.generation == 2
    assert sorted(f.name for f in tmp_path.iterdir()) == ["log.2", "snapshot.2"]
    journal.close()
    assert _index(reloaded(tmp_path)) == _index(rig)
    assert len(_index(rig)) == 17


def test_a_killed_fold_leaves_the_chain_whole(tmp_path: Path) -> None:
    rig, journal = _filled(tmp_path, range(10))

    def slow() -> list[object]:
        time.sleep(30)
        return []

    fold = Fold(journal, slow)  # type: ignore[arg-type]
    _put(rig, journal, range(10, 12))
    fold.kill()  # the master stopping mid-fold
    assert fold.exit_code == -signal.SIGKILL and fold.seconds < 10
    journal.close()
    assert _index(reloaded(tmp_path)) == _index(rig)


def test_a_master_refused_a_fork_folds_on_its_loop_and_loses_nothing(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """A fork refused (ENOMEM under strict overcommit) does not leave the log to grow without
    bound: the master folds on its loop, as it did before folds forked, and says why."""
    def refused() -> int:
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(fold_module.os, "fork", refused)
    state = tmp_path / "state"
    server = MasterServer(MasterConfig(port=0, metrics_port=-1, state_dir=str(state), fold_log_bytes=4096)).start()
    client = None
    try:
        wait_until(server.recovered.is_set, 10, "the master to recover its (empty) journal")
        client = Store.connect(server.address, 4 << 20, config=StoreConfig(rpc_timeout_s=0.5, failover_timeout_s=0.5))
        for i in range(100):
            client.put(f"k{i}", bytes([i]) * 100)
        assert server._folds["inline"] >= 2 and server._folds["done"] == 0
    finally:
        server.stop()  # before the client leaves: its segment, and so its objects, stay in the journal
        if client is not None:
            client.close()
    assert "cannot fork to fold its journal" in caplog.text
    snapshots = [f.name for f in state.glob("snapshot.*")]
    assert len(snapshots) == 1 and snapshots[0] != "snapshot.0", sorted(f.name for f in state.iterdir())
    assert len(_index(reloaded(state))) == 100


def test_a_fold_is_due_past_the_bytes_and_the_ratio_of_the_last_snapshot(tmp_path: Path) -> None:
    journal = JournalFile(tmp_path)
    journal.snapshot_bytes, journal.log_bytes = 1_000_000, 600_000
    assert journal.fold_due(4096, 0.5), "past half the snapshot"
    assert not journal.fold_due(4096, 2.0), "within twice the snapshot"
    assert not journal.fold_due(1 << 20, 0.5), "within fold_log_bytes"
    journal.snapshot_bytes = 0  # generation 0: no snapshot yet
    assert journal.fold_due(4096, 0.5) and not journal.fold_due(1 << 20, 0.5)
