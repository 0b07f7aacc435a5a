"""``benchmarks/sglang_hicache.py`` runs end to end on a small workload: both backends measured,
every call succeeded and every page read back equals its source (no timing is asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import sglang_rig


def test_hicache_bench_runs_small_and_checks_bytes(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    cmd = [sys.executable, str(sglang_rig.REPO / "benchmarks" / "sglang_hicache.py"), "--pages", "12", "--batch", "5",
           "--rounds", "2", "--layers", "4", "--heads", "2", "--head-dim", "64", "--file-dir", str(tmp_path),
           "--json", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    results = json.loads(out.read_text())
    assert set(results["backends"]) == {"tidekv", "file", "file_cold"}
    for name, r in results["backends"].items():
        assert r["all_calls_ok"] and r["bytes_equal"], (name, r)
        assert r["get_pages_per_s"] > 0 and r["set_pages_per_s"] > 0
    assert results["page_bytes"] == 2 * 4 * 2 * 64 * 16 * 2
    assert "tidekv / HiCacheFile, page cache:" in run.stdout
