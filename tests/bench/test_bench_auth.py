"""``benchmarks/auth_cost.py`` end to end at a tiny size: every setup (an open master, one with a
secret, one with a secret and TLS; holders in their own processes) serve every put and get, and the summary holds the
p50s and their ratios. The 5% bar itself is judged on full runs (docs/benchmarks), not on this smoke run."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(180)

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "auth_cost.py"


def test_auth_cost_runs_every_setup(tmp_path: Path) -> None:
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is missing (Debian package openssl); the bench makes its TLS certificate")
    out = tmp_path / "auth.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--rounds", "2", "--ops", "50", "--json", str(out)],
                          capture_output=True, text=True, timeout=150)
    assert done.returncode in (0, 1), done.stderr  # 1: a ratio past the bar at this tiny size
    summary = json.loads(out.read_text())
    for setup in ("open", "secured", "tls"):
        for what in ("put_p50_us", "get_p50_us", "connect_p50_ms"):
            assert summary[f"{setup}_{what}"] > 0, (setup, what)
    for op in ("put", "get"):
        assert summary[f"{op}_p50_ratio"] == pytest.approx(summary[f"secured_{op}_p50_us"] / summary[f"open_{op}_p50_us"])
        assert summary[f"{op}_pair_ratio_median"] > 0 and summary[f"tls_{op}_pair_ratio_median"] > 0
    assert "secured / open" in done.stdout
