"""``tidekv bench store --tier disk`` end to end on a small workload, and its io_uring baseline."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tidekv.bench import uring


def test_uring_moves_the_bytes_it_says(tmp_path: Path) -> None:
    why = uring.available()
    if why:
        pytest.skip(f"io_uring is not usable on this kernel: {why}")
    write, read = uring.raw_uring_bandwidth(str(tmp_path), 8 << 20, 1 << 20, depth=4)
    assert write > 0 and read > 0
    assert list(tmp_path.iterdir()) == [], "the scratch file is removed"


def test_the_disk_tier_bench_runs_and_reports_every_row(tmp_path: Path) -> None:
    out = tmp_path / "rows.jsonl"
    done = subprocess.run([sys.executable, "-m", "tidekv", "bench", "store", "--tier", "disk", "--quick", "--rounds",
                           "1", "--sizes", "256K", "--no-progress", "--disk-dir", str(tmp_path), "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    paths = [r["path"] for r in rows]
    assert "spill (holder -> disk)" in paths and "disk-hit get, on the holder" in paths
    assert "disk-hit get, other client" in paths and "SGLang file backend read" in paths
    assert all(r["gb_s"] > 0 for r in rows)
    assert "performance bars" in done.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rows.jsonl"], "the bench cleans up after itself"
