"""``benchmarks/soak.py`` for a few seconds: its report's structure, and what must hold.

Real processes (a master, two holders, three clients); two holder kills six seconds apart, so
both original holders die: the cold keys, written once at the start with a replica on each of
them, survive only because the first killed holder's replacement copied them (``store.master.repairs``)
before the second kill; nothing may be lost, stale or corrupt.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from tidekv.bench import soak

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

ROOT = Path(__file__).resolve().parents[2]
CLIENTS = 3
COLD_KEYS = 10


def test_soak_accounts_for_every_acknowledged_object(tmp_path: Path) -> None:
    report = soak.run(15.0, clients=CLIENTS, kill_every_s=6.0, keys=40, cold_keys=COLD_KEYS, sample_every_s=1.0,
                      log_dir=str(tmp_path))
    text = soak.format_report(report)
    assert [k["holder"] for k in report["kills"]] == ["holder0.1", "holder1.1"], text
    assert report["ops"]["get"] > 0 and report["ops"]["write"] > 0 and report["ops"]["remove"] > 0, text
    assert report["transfers"].get("ok", 0) > 0 and "mismatch" not in report["transfers"], text
    assert set(report["errors"]) <= {f"{op} {kind}" for op in ("put", "upsert", "get", "remove", "cold put")
                                     for kind in ("PeerUnavailableError", "TransferError", "TransferTimeoutError",
                                                  "OutOfSpaceError", "MasterUnavailableError")}, text
    # The cold keys sat on the two first holders only, and both were killed: copied in between.
    cold_acked = CLIENTS * COLD_KEYS - sum(n for what, n in report["errors"].items() if what.startswith("cold put"))
    assert cold_acked > 0 and report["master_segments"]["end"]["repairs"]["done"] >= cold_acked, text
    assert report["lost"]["unexplained"] == 0, report["lost"]["unexplained_examples"]
    assert report["lost"]["every_replica_holder_died"] == 0, text
    assert report["stale_reads"] == 0 and "corrupt" not in report["found"], text
    assert report["checked"] == report["acknowledged"] > 0, text  # every acknowledged object read back
    processes = report["memory"]["processes"]
    assert {"master", *(f"client{i}" for i in range(CLIENTS)), "holder0.1", "holder1.1", "holder0.2",
            "holder1.2"} <= set(processes), text
    for name in ("master", *(f"client{i}" for i in range(CLIENTS))):
        row = processes[name]
        assert row["rss_end_mib"] > 0 and row["fds_end"] > 0 and "rss_growth_pct" in row, (name, row)
    assert report["master_segments"]["end"]["segments"] >= 2, text
    assert "lost:" in text and "memory (RSS MiB" in text


def test_soak_command_line_prints_its_report(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--minutes", "0.1", "--clients", "2",
                          "--kill-every-s", "3", "--keys", "20", "--json", str(tmp_path / "soak.json")],
                         cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "unexplained" in out.stdout and "errors by kind" in out.stdout, out.stdout
    assert (tmp_path / "soak.json").stat().st_size > 0
