"""``tidekv bench master`` at a small size: every row is there and self-consistent."""

from __future__ import annotations

import gc

from tidekv.bench import master_scale


def test_rows_of_a_small_run() -> None:
    listed = master_scale.run(objects=20_000, seconds=0.1)
    rows = {r["metric"].strip(): r for r in listed}
    assert rows["get ops/s"]["at_n"] > 0 and rows["put ops/s"]["at_n"] > 0
    assert rows["bytes/object"]["at_n"] > 0
    for name in ("Exists", "Get", "PutStart+PutEnd"):
        row = rows[f"{name} us/key, batches of 64"]
        assert row["at_1k"] > 0 and row["at_n"] > 0, row
    assert rows["put ops/s, full pool (1k vs 20,000 objects)"]["at_n"] > 0  # the bench checks they evicted
    assert rows["standby: snapshot applied to a mirror, s"]["at_n"] > 0
    assert rows["promotion: master restored from the mirror, s"]["at_n"] > 0
    assert 0 < rows["floor: one dict of as many keys, built in C, s"]["at_n"]
    restarts = [r for r in listed if r["metric"].startswith("restart from --state-dir")]
    assert [r["metric"].split(":")[1].split("(")[0].strip() for r in restarts] == [
        "log of the puts", "snapshot", "snapshot and the most log a fold lets through"]
    assert all(r["at_n"] > 0 and " MB)" in r["metric"] for r in restarts)  # the bench checks every object came back
    assert restarts[2]["at_n"] > restarts[1]["at_n"], "a log after the snapshot adds to the restart"
    assert rows["standby: longest put applied ms (10,000 puts)"]["at_n"] >= rows["p99.9 put applied ms"]["at_n"] > 0
    longest = rows["longest put ms, collector as it comes (10,000 puts)"]["at_n"]
    frozen = rows["longest put or tick ms, index frozen (10,000 puts)"]["at_n"]
    assert longest >= rows["p99.9 put ms"]["at_n"] > 0
    assert frozen >= rows["p99.9 put or tick ms"]["at_n"] > 0
    gets = rows["longest get or tick ms, index frozen (20,000 gets)"]["at_n"]
    assert gets >= rows["p99.9 get or tick ms"]["at_n"] > 0
    collections = [r["at_n"] for r in listed if r["metric"].strip() == "longest full collection ms"]
    assert len(collections) == 2 and all(c >= 0 for c in collections)
    assert gc.get_freeze_count() == 0, "the bench thaws what it froze"
    assert gc.callbacks == [] or all(cb.__name__ != "timed" for cb in gc.callbacks), "the bench's timer is gone"


def test_restarts_only_gives_the_restart_rows_alone() -> None:
    rows = master_scale.restart_rows(objects=5_000)
    assert [r["metric"].split(",")[0].split(" (")[0] for r in rows] == [
        "promotion: master restored from the mirror", "restart from --state-dir: log of the puts",
        "restart from --state-dir: snapshot", "restart from --state-dir: snapshot and the most log a fold lets through",
        "floor: one dict of as many keys", "fold: a lone master's loop pauses", "fold: its child writes the snapshot"]
    assert all(r["at_n"] > 0 and r["objects"] == 5_000 for r in rows)
    assert rows[5]["at_n"] < rows[6]["at_n"], "the loop pauses for the fork, not for the whole fold"
    # One dict of the keys is part of what the restart builds (it fills several, and more)
    assert rows[4]["at_n"] < rows[2]["at_n"]
