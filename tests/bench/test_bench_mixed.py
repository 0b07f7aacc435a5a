"""``tidekv bench mixed`` end to end at a tiny size: it splits one batch into an shm half and a
tcp half (``run`` refuses to measure otherwise) and reports the ratio against the sum of parts."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tidekv.bench import mixed
from tidekv.bench.timing import Budget

pytestmark = pytest.mark.timeout(120)


def test_mixed_batch_row(tmp_path) -> None:
    row = mixed.run(64 << 10, 4, rounds=2, budget=Budget.fixed(4), log_dir=str(tmp_path))
    assert row["size_bytes"] == 64 << 10 and row["requests_per_half"] == 4
    for name in ("shm", "tcp", "mixed"):
        assert row[f"{name}_p50_us"] > 0 and row[f"{name}_gbps"] > 0
    assert row["ratio"] == pytest.approx((row["shm_p50_us"] + row["tcp_p50_us"]) / row["mixed_p50_us"])
    assert "x the sum of parts" in mixed.format_rows([row])


def test_cli_rejects_bad_counts() -> None:
    done = subprocess.run([sys.executable, "-m", "tidekv", "bench", "mixed", "--count", "0"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and "--count and --rounds must be >= 1" in done.stderr
