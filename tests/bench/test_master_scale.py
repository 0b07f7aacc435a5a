"""``tidekv bench master`` at a small size: every row is there and self-consistent."""

from __future__ import annotations

import gc

from tidekv.bench import master_scale


def test_rows_of_a_small_run() -> None:
    rows = {r["metric"].strip(): r for r in master_scale.run(objects=20_000, seconds=0.1)}
    assert rows["get ops/s"]["at_n"] > 0 and rows["put ops/s"]["at_n"] > 0
    assert rows["bytes/object"]["at_n"] > 0
    longest = rows["longest put ms, collector as it comes (10,000 puts)"]["at_n"]
    frozen = rows["longest put or tick ms, index frozen (10,000 puts)"]["at_n"]
    assert longest >= rows["p99.9 put ms"]["at_n"] > 0
    assert frozen >= rows["p99.9 put or tick ms"]["at_n"] > 0
    assert gc.get_freeze_count() == 0, "the bench thaws what it froze"
