"""tidekv bench weights runs end to end at a small size (correctness of the rows, not speed)."""

from __future__ import annotations

import pytest
from tidekv.bench import weights as bench


def test_transformer_shapes_fill_the_size() -> None:
    shapes = bench.transformer_shapes(1 << 30)
    total = sum(2 * bench._numel(s) for _, s in shapes)
    assert 0.75 * (1 << 30) <= total <= 1.1 * (1 << 30)
    assert len({len(s) for _, s in shapes}) == 2 and len({s for _, s in shapes}) >= 6  # many sizes


@pytest.mark.parametrize("fanout", [0, 1])
def test_bench_rows(fanout: int) -> None:
    rows = bench.run(8 << 20, [1, 2], rounds=1, fanout=fanout, show_progress=False)
    assert [(r["receivers"], r["mode"]) for r in rows] == [(1, "snapshot"), (1, "in-place"), (2, "snapshot"), (2, "in-place")]
    for row in rows:
        assert row["tidekv_s"] > 0 and row["gloo_s"] > 0
        assert row["speedup"] == pytest.approx(row["gloo_s"] / row["tidekv_s"])
    assert rows[0]["tidekv_growth"] == rows[1]["tidekv_growth"] == 1.0
    if fanout:
        assert rows[2]["relayed_bytes"] > 0 and rows[3]["relayed_bytes"] > 0  # the second receiver read from the first
