"""benchmarks.tensor_channel on a small run across the multi-host rig: every piece streamed and
drained, the rates and the paired ratios written (the bench's own numbers are judged on its page,
not here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import tensor_channel
from tests.multihost.rig import missing_prerequisites

pytest.importorskip("torch", reason="the tensor channel moves torch tensors (a test dependency)")


@pytest.mark.parametrize("read_ahead", [False, True])
def test_a_small_run_streams_and_drains_in_pieces(tmp_path: Path, read_ahead: bool) -> None:
    missing = missing_prerequisites(with_pods=False)
    if missing:
        pytest.skip(f"the multi-host rig: {missing}")
    out = tmp_path / "rows.jsonl"
    argv = ["--items", "64", "--batch", "4", "--pairs", "4", "--rounds", "2", "--drain-rounds", "2", "--runs", "1",
            "--json", str(out)] + (["--read-ahead"] if read_ahead else [])
    assert tensor_channel.main(argv) == 0
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["read_ahead"] is read_ahead and row["pairs"] == 4 and row["items"] == 64
    for field in ("channel_gbps", "producer_gbps", "drain_gbps", "get_many_into_gbps", "ratio", "drain_ratio"):
        assert row[field] > 0, field
    # Each process's CPU per GB, over the baselines and over the streamed pieces, and in all what
    # the three spent. (/proc counts in clock ticks of 10 ms: a run this small may read 0 for one
    # process, as a CI run did for the consumer's baselines, so no process is asked for more.)
    for work in ("get_many_into", "streaming"):
        cpu = row["cpu_per_gb"][work]
        assert set(cpu) == {"master", "producer", "consumer", "all"} and min(cpu.values()) >= 0, (work, cpu)
        assert cpu["all"] == pytest.approx(cpu["master"] + cpu["producer"] + cpu["consumer"]), (work, cpu)


def test_items_must_come_in_whole_pieces() -> None:
    with pytest.raises(SystemExit):
        tensor_channel.main(["--items", "100", "--batch", "16", "--pairs", "8"])
