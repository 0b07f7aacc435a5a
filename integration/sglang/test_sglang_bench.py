"""``python -m benchmarks.sglang_hicache`` runs end to end on a small workload: every backend measured,
every call succeeded and every page read back equals its source (no timing is asserted). The
``--compare mooncake`` run needs ``.venv-sglang-mooncake`` (Mooncake's wheel, made by
``integration/setup_sglang.sh``) and root for the network namespace; without them it skips saying so."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import sglang_rig


def test_hicache_bench_runs_small_and_checks_bytes(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "benchmarks.sglang_hicache", "--pages", "12", "--batch", "5",
           "--rounds", "2", "--layers", "4", "--heads", "2", "--head-dim", "64", "--file-dir", str(tmp_path),
           "--json", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=sglang_rig.REPO)
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    results = json.loads(out.read_text())
    assert set(results["backends"]) == {"tidekv", "file", "file_cold"}
    for name, r in results["backends"].items():
        assert r["all_calls_ok"] and r["bytes_equal"], (name, r)
        assert r["get_pages_per_s"] > 0 and r["set_pages_per_s"] > 0
    assert results["page_bytes"] == 2 * 4 * 2 * 64 * 16 * 2
    assert "tidekv / HiCacheFile, page cache:" in run.stdout


def _real_mooncake_missing() -> str | None:
    python = sglang_rig.REPO / ".venv-sglang-mooncake" / "bin" / "python"
    how = "run integration/setup_sglang.sh (it makes .venv-sglang-mooncake with mooncake-transfer-engine-non-cuda)"
    if not python.exists():
        return f"{python} is missing; {how}"
    probe = subprocess.run([str(python), "-c", "import mooncake, mooncake.store; "
                            "print(getattr(mooncake, 'IS_TIDEKV_SHIM', False), mooncake.store.__file__)"],
                           capture_output=True, text=True, timeout=120)
    if probe.returncode != 0:
        return f"Mooncake's wheel does not import in {python}: {probe.stderr.strip().splitlines()[-1:]}; {how}"
    if probe.stdout.split()[0] != "False":
        return f"`mooncake` in {python} is tidekv's drop-in, not Mooncake's wheel; {how}"
    if os.geteuid() != 0:
        return "the real Mooncake runs in a network namespace of its own, which needs root (CAP_SYS_ADMIN)"
    return None


def test_mooncake_side_by_side_runs_small_and_checks_bytes(tmp_path: Path) -> None:
    missing = _real_mooncake_missing()
    if missing:
        pytest.skip(missing)
    out = tmp_path / "bench.json"
    pages, warmup, rounds = 6, 1, 2
    cmd = [sys.executable, "-m", "benchmarks.sglang_hicache", "--compare", "mooncake",
           "--pages", str(pages), "--batch", "4", "--rounds", str(rounds), "--warmup", str(warmup), "--layers", "4",
           "--heads", "2", "--head-dim", "64", "--json", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=sglang_rig.REPO)
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    results = json.loads(out.read_text())
    assert results["page_bytes"] == 2 * 4 * 2 * 64 * 16 * 2
    assert set(results["layouts"]) == {"same", "other"}
    for layout, found in results["layouts"].items():
        assert found["unavailable"] == {}, (layout, found["unavailable"])
        assert set(found["backends"]) == {"mooncake", "shim", "tidekv"}
        for name, r in found["backends"].items():
            assert r["all_calls_ok"] and r["bytes_equal"], (layout, name, r)
            assert r["pages_checked"] == pages * (warmup + rounds), (layout, name, r)
            assert len(r["set_s_all"]) == len(r["get_s_all"]) == rounds
            assert r["set_gb_per_s"] > 0 and r["get_gb_per_s"] > 0
        real, shim = found["backends"]["mooncake"]["worker"], found["backends"]["shim"]["worker"]
        # SGLang's backend really ran on Mooncake's wheel, in a namespace with only loopback, and on the drop-in.
        assert ".venv-sglang-mooncake" in real["mooncake_store"] and real["api"] == "mooncake", real
        assert real["netns_interfaces"] == ["lo"], real
        assert real["env"] == ({"MC_STORE_MEMCPY": "0"} if layout == "other" else {}), real
        assert shim["api"] == "shim" and "plugins/mooncake" in shim["mooncake_store"], shim
    assert len(results["bars"]) == 8
    assert {b["status"] for b in results["bars"]} <= {"PASS", "FAIL"}
    assert "performance bars (issue 18" in run.stdout and "SGLang mooncake on Mooncake" in run.stdout
