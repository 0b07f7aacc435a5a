"""``benchmarks/ha_cost.py`` small: it runs, every system served both loads in every round without a
stale read, and its JSON holds what the HA page's table is made of. Real etcd and processes; skips
only without the etcd binary."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.childproc import REPO_ROOT
from tidekv.bench.etcd_server import MISSING, etcd_binary

pytestmark = [pytest.mark.slow, pytest.mark.timeout(200)]


@pytest.mark.skipif(etcd_binary() is None, reason=MISSING)
def test_two_rounds_of_each_system(tmp_path: Path) -> None:
    out = tmp_path / "ha_cost.json"
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "benchmarks" / "ha_cost.py"), "--rounds", "2", "--ops", "30", "--clients",
         "2", "--churn-s", "1", "--json", str(out)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "ha-nowait / single: quiet put" in result.stdout, result.stdout
    rounds = json.loads(out.read_text())["rounds"]
    assert len(rounds) == 2
    for row in rounds:
        assert set(row) == {"single", "ha", "ha-nowait", "ha-nowait-noapply"}, row
        for system, numbers in row.items():
            assert numbers["quiet_put_p50_us"] > 0 and numbers["churn_get_p50_us"] > 0, (system, numbers)
            assert len(numbers["churn_master_cpu_s"]) == (1 if system == "single" else 3), (system, numbers)
            # Nobody died and each round churns keys of its own: no system may serve a stale read.
            assert numbers["churn_stale_reads"] == 0, (system, numbers)
