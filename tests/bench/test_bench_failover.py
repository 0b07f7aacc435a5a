"""``tidekv bench failover`` as a CI smoke test: one leader kill, small load, the JSON summary.

It runs the real thing (etcd, three masters, holder and clients as processes) with small
parameters and checks the summary's fields and the zero-loss bar; skips only if the etcd binary
is missing.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.childproc import REPO_ROOT
from tidekv.bench.etcd_server import MISSING, etcd_binary

FIELDS = ("kills", "acknowledged", "lost", "stale_reads", "failover_p50_s", "failover_max_s", "put_p50_ratio",
          "get_p50_ratio", "restart_recovery_s")


@pytest.mark.skipif(etcd_binary() is None, reason=MISSING)
def test_one_kill_writes_the_summary(tmp_path: Path) -> None:
    out = tmp_path / "failover.json"
    result = subprocess.run(
        [sys.executable, "-m", "tidekv", "bench", "failover", "--kills", "1", "--clients", "2", "--period-s", "4",
         "--baseline-s", "1", "--keys", "40", "--restart-objects", "300", "--json", str(out)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert all(f in summary for f in FIELDS), summary
    assert summary["kills"] == 1 and summary["acknowledged"] > 0
    assert (summary["lost"], summary["stale_reads"]) == (0, 0), summary
    assert 0 < summary["failover_max_s"] < 10.0, summary
    assert 0 < summary["restart_recovery_s"] < 5.0, summary
