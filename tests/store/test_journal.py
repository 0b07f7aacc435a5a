"""JournalFile: what a lone master with --state-dir writes, read back after compactions and a
crash that cut the last frame short; a half-written snapshot is ignored."""

from __future__ import annotations

import os
from pathlib import Path

from tidekv.store.master.journal import JournalFile, Mirror
from tidekv.store.wire import protocol as p

from tests.store.rig import ServiceRig, flush_journal, reloaded

PAGE = 4096


def _index(rig: ServiceRig) -> dict[bytes, tuple[int, tuple[object, ...]]]:
    return {k: (m.size, m.replicas) for k, m in rig.service.objects.objects.items() if m.put is None}


def test_snapshot_then_log_then_a_torn_frame_read_back(tmp_path: Path) -> None:
    rig = ServiceRig(lease_ttl_s=0.0)
    rig.service.enable_journal()
    journal = JournalFile(tmp_path)
    journal.load(Mirror(0.0), 0.0)
    journal.resume()
    rig.hello("h")
    rig.mount("h", "seg", 256 * PAGE)
    for i in range(40):
        rig.put("h", f"a{i}".encode(), PAGE)
        flush_journal(rig, journal)
    journal.rewrite(rig.service.snapshot())  # generation 1
    for i in range(10):
        rig.remove(f"a{i}".encode())
        rig.call(p.PutStart("h", [f"a{20 + i}".encode()], [2 * PAGE], upsert=True))
        flush_journal(rig, journal)
    for key, token in [(f"a{20 + i}".encode(), rig.service.objects.upserts[f"a{20 + i}".encode()].put.token)
                       for i in range(10)]:
        rig.put_end("h", key, token)
        flush_journal(rig, journal)
    journal.rewrite(rig.service.snapshot())  # generation 2: the old files go
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
