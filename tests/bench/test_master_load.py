"""``tidekv bench master --load``: clients load tidekv's master and Mooncake's with one mix."""

from __future__ import annotations

import os
import time

import pytest

from tidekv.bench import master_load


def test_both_masters_are_loaded_and_their_cpu_per_key_is_counted() -> None:
    rows = master_load.run_load(clients=2, seconds=1.0, blocks=8, object_bytes=256, compare=["mooncake"])
    assert [r["master"] for r in rows] == ["shim", "mooncake"]
    for r in rows:
        assert r["prompts"] > 0 and r["looked_up"] >= r["prompts"], r
        assert r["read"] > 0 and r["saved"] > 0, f"the mix reads stored prefixes and saves new blocks: {r}"
        assert r["key_ops"] == r["looked_up"] + r["read"] + r["saved"]
        assert r["master_cpu_s"] > 0 and r["master_cpu_us_per_key"] > 0, r
    assert rows[0]["keys_per_cpu_s_vs_mooncake"] > 0 and rows[0]["keys_per_s_vs_mooncake"] > 0


def test_a_sharded_pool_spreads_the_load_over_its_groups() -> None:
    """Every group of a four-group pool carries keys; the row compares it with one master."""
    rows = master_load.run_load(clients=2, seconds=1.0, blocks=8, object_bytes=256, compare=[], groups=4)
    assert [(r["master"], r["groups"]) for r in rows] == [("shim", 1), ("shim", 4)]
    sharded = rows[1]
    assert sharded["read"] > 0 and sharded["saved"] > 0, sharded
    assert 0 < sharded["busiest_master_cpu_s"] < sharded["master_cpu_s"], "one master did all the work"
    assert sharded["capacity_vs_one_group"] > 0, sharded


def test_request_cost_is_counted_per_request() -> None:
    rows = master_load.request_costs(batches=(4,), seconds=0.3)
    assert [r["loop"] for r in rows] == ["asyncio", "uvloop"], "the master runs on each loop asked for"
    for row in rows:
        assert row["batch"] == 4 and row["requests"] > 0 and row["master_cpu_us_per_request"] > 0, row


def test_cpu_seconds_reads_this_process() -> None:
    before, start = master_load.cpu_seconds(os.getpid()), time.process_time()
    while time.process_time() - start < 0.3:  # CPU time, not wall time: a loaded host stretches the wall
        pass
    assert master_load.cpu_seconds(os.getpid()) - before >= 0.25  # /proc counts in ticks of 10 ms
    with pytest.raises(FileNotFoundError):
        master_load.cpu_seconds(1 << 30)
