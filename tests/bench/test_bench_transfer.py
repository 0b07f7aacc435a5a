"""``tidekv bench transfer``: a --quick run end to end (real processes on loopback) and its report.

The run is a smoke test of the bench, not of performance: it checks the rows' schema, that
every number is positive, and that each ratio is the one the table header promises.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from tidekv import report
from tidekv.bench.bars import Bar, evaluate_bars
from tidekv.bench.timing import Budget, measure, summarize
from tidekv.bench.transfer import plot
from tidekv.cli import main
from tidekv.errors import ConfigError

REQUIRED = {"transport", "op", "mode", "size_bytes", "gbps", "p50_us", "p99_us", "baseline", "ratio"}
POSITIVE = ("size_bytes", "gbps", "p50_us", "p99_us", "baseline_gbps", "baseline_p50_us", "ratio")


def _run_bench(args: list[str], timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tidekv", "--log-level", "WARNING", "bench", "transfer", *args],
                          capture_output=True, text=True, timeout=timeout_s)


@pytest.fixture(scope="module")
def quick_rows(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("bench") / "rows.jsonl"
    done = _run_bench(["--quick", "--no-progress", "--json", str(out)])
    assert done.returncode == 0, f"bench failed:\n{done.stdout}\n{done.stderr}"
    assert "ratio > 1 means tidekv is better" in done.stdout
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_quick_run_covers_every_row(quick_rows: list[dict[str, Any]]) -> None:
    shapes = {(r["transport"], r["op"], r["mode"], r["size_bytes"]) for r in quick_rows}
    expected = {(t, op, mode, size) for t in ("tcp", "shm") for op in ("READ", "WRITE")
                for mode in ("single", "batch") for size in (4096, 1 << 20)}
    assert shapes == expected
    assert len(quick_rows) == len(expected)


def test_quick_rows_schema_and_values(quick_rows: list[dict[str, Any]]) -> None:
    for row in quick_rows:
        assert row.keys() >= REQUIRED, row
        for key in POSITIVE:
            assert isinstance(row[key], (int, float)) and row[key] > 0 and math.isfinite(row[key]), (key, row)
        assert row["p99_us"] >= row["p50_us"]
        assert row["baseline"] == {"tcp": {"single": "socket_pingpong", "batch": "socket_stream"},
                                   "shm": {"single": "memcpy", "batch": "memcpy"}}[row["transport"]][row["mode"]]
        assert row["requests"] == (64 if row["mode"] == "batch" else 1)
        if row["ratio_by"] == "p50":
            assert row["mode"] == "single" and row["size_bytes"] <= 64 << 10
            assert row["ratio"] == pytest.approx(row["baseline_p50_us"] / row["p50_us"])
        else:
            assert row["ratio"] == pytest.approx(row["gbps"] / row["baseline_gbps"])


def test_plot_writes_png(quick_rows: list[dict[str, Any]], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "bench.png"
    plot(str(path), quick_rows, has_mooncake=False)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_has_mooncake_without_wheel_says_how_to_install(monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)  # what an uninstalled wheel looks like to import
    assert main(["bench", "transfer", "--quick", "--compare", "mooncake"]) == 2
    err = capsys.readouterr().err
    assert "pip install mooncake-transfer-engine-non-cuda" in err and "libibverbs1" in err


def test_has_mooncake_adds_its_ratio(tmp_path: Path) -> None:
    pytest.importorskip("mooncake.engine", reason="Mooncake wheel mooncake-transfer-engine-non-cuda not installed")
    out = tmp_path / "rows.jsonl"
    done = _run_bench(["--quick", "--no-progress", "--compare", "mooncake", "--sizes", "4K", "--ops", "write",
                       "--json", str(out)])
    assert done.returncode == 0, f"bench failed:\n{done.stdout}\n{done.stderr}"
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    for row in rows:
        if row["transport"] == "tcp":
            assert row["mooncake_gbps"] > 0 and row["mooncake_p50_us"] > 0 and row["ratio_mooncake"] > 0
        else:
            assert row["ratio_mooncake"] is None


def test_table_shows_missing_values_as_dash() -> None:
    columns = [report.Column("name", "name", align="<"), report.Column("size_bytes", "size", report.format_size),
               report.Column("gbps", "GB/s", ".2f")]
    rows = [{"name": "a", "size_bytes": 4096, "gbps": 1.234}, {"name": "bb", "size_bytes": 1 << 20}]
    text = report.format_table(rows, columns, title="t", notes=["n"])
    assert text.splitlines() == ["t", "name   size  GB/s", "----  -----  ----", "a     4 KiB  1.23",
                                 "bb    1 MiB     -", "n"]


def test_sizes_parse_and_format() -> None:
    sizes = [report.parse_size(t) for t in ("4096", "4K", "64KiB", "16M", "1g")]
    assert sizes == [4096, 4096, 65536, 16 << 20, 1 << 30]
    assert report.format_size(3000) == "3000 B"
    with pytest.raises(ConfigError):
        report.parse_size("0")


def test_json_lines_round_trip(tmp_path: Path) -> None:
    rows = [{"a": 1, "b": None}, {"a": 2.5, "b": "x"}]
    report.write_json_lines(tmp_path / "r.jsonl", rows)
    assert [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()] == rows


def test_budget_and_summary() -> None:
    calls = []
    samples = measure(lambda: calls.append(1), Budget.fixed(7, warmup_iterations=2))
    assert len(samples) == 7 and len(calls) == 9
    parts = [Budget.fixed(10).split(3, i) for i in range(3)]
    assert [p.min_iterations for p in parts] == [4, 3, 3] and [p.max_iterations for p in parts] == [4, 3, 3]
    s = summarize([1e-6, 2e-6, 3e-6, 4e-6], 1000)
    assert s.p50_us == pytest.approx(2.0) and s.p99_us == pytest.approx(4.0)
    assert s.gbps == pytest.approx(4000 / 10e-6 / 1e9)


def test_bars_report_pass_and_fail() -> None:
    rows = [{"transport": "tcp", "op": "READ", "mode": "batch", "size_bytes": 4096, "gbps": 0.7},
            {"transport": "tcp", "op": "WRITE", "mode": "batch", "size_bytes": 4096, "gbps": 0.5}]
    lines = evaluate_bars(rows, [Bar({"transport": "tcp", "size_bytes": (4096,)}, "gbps", 0.6, meaning="m")])
    assert [line.split()[0] for line in lines] == ["PASS", "FAIL"]


def test_fabric_rows_are_measured_against_tidekv_tcp_in_the_same_run(tmp_path: Path) -> None:
    from tests.transfer.harness import FABRIC_PROVIDER, TRANSPORTS

    if "fabric" not in TRANSPORTS:
        pytest.skip("fabric cannot run here (libfabric1 not installed)")
    out = tmp_path / "rows.jsonl"
    done = _run_bench(["--quick", "--no-progress", "--transports", "fabric", "--fabric-provider", FABRIC_PROVIDER,
                       "--json", str(out)])
    assert done.returncode == 0, f"bench failed:\n{done.stdout}\n{done.stderr}"
    assert "not RDMA speed" in done.stdout and "fabric 64x1 MiB >= 0.5x" in done.stdout
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert {(r["op"], r["mode"], r["size_bytes"]) for r in rows} == {
        (op, mode, size) for op in ("READ", "WRITE") for mode in ("single", "batch") for size in (4096, 1 << 20)}
    for row in rows:
        assert row["transport"] == "fabric" and row["baseline"] == "tidekv_tcp", row
        assert row["gbps"] > 0 and row["baseline_gbps"] > 0


def test_fabric_rows_without_a_provider_are_refused_with_the_reason() -> None:
    done = _run_bench(["--quick", "--no-progress", "--transports", "fabric", "--fabric-provider", "no-such-provider"])
    assert done.returncode == 2, done.stdout + done.stderr
    assert "the fabric transport cannot run here" in done.stderr
    assert "no-such-provider" in done.stderr or "does not load" in done.stderr, done.stderr


def test_compare_nixl_puts_nixl_beside_the_tcp_and_shm_rows(tmp_path: Path) -> None:
    from tidekv.bench import nixl_te

    try:
        nixl_te.check_available()
    except ConfigError as e:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI installs NIXL for this test (.ci/run): {e}")
        pytest.skip(str(e))
    out = tmp_path / "rows.jsonl"
    done = _run_bench(["--quick", "--no-progress", "--compare", "nixl", "--modes", "batch", "--sizes", "4K",
                       "--json", str(out)], timeout_s=180)
    assert done.returncode == 0, f"bench failed:\n{done.stdout}\n{done.stderr}"
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert {(r["transport"], r["nixl_ucx"]) for r in rows} == {("tcp", "tcp"), ("shm", "default")}
    for row in rows:
        assert row["nixl_gbps"] > 0 and row["ratio_nixl"] == pytest.approx(row["gbps"] / row["nixl_gbps"]), row
    assert "ratio_nixl" in done.stdout and "UCX_TLS=tcp" in done.stdout
