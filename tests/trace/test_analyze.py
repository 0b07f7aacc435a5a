"""``tidekv trace analyze`` through its command line: the table, --json, --plot, the bars on the
real conversation trace (when the file is there), and input errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.trace.traces import HAND, write_trace
from tidekv.cli import main
from tidekv.errors import ConfigError
from tidekv.trace import load_trace, parse_token_count
from tidekv.trace.analyze import AnalyzeSettings, analyze

CONVERSATION = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "fast25" / "conversation_trace.jsonl"


def test_json_has_one_object_per_capacity_instances_policy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = write_trace(tmp_path / "t.jsonl", HAND)
    out = tmp_path / "out.json"
    assert main(["trace", "analyze", str(trace), "--capacity", "0,1024", "--instances", "1,2", "--routing",
                 "round_robin,prefix", "--json", str(out), "--no-progress"]) == 0
    report = json.loads(out.read_text())
    rows = {(r["capacity_tokens"], r["instances"], r["policy"], r["routing"]): r for r in report["results"]}
    assert len(rows) == len(report["results"]) == 2 * 2 * 3
    assert rows[(0, 2, "global", None)]["hit_rate"] == pytest.approx(1836 / 3524)
    assert rows[(1024, 1, "global", None)]["hit_tokens"] == 1324
    assert rows[(0, 2, "local", "round_robin")]["prefill_tokens_saved"] == 812
    assert all(r["requests"] == 4 and r["input_tokens"] == 3524 for r in rows.values())
    assert report["capacity_for_fraction"]["fraction"] == 0.9
    assert report["working_set"][0] == {"start_s": 0.0, "window_tokens": 1536, "footprint_tokens": 1536}
    assert report["requests_per_min"] > 0
    text = capsys.readouterr().out
    assert "hit rate" in text and "0.5210" in text and "requests/min" in text


def test_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib (pip install matplotlib (tidekv's plot extra))")
    trace = write_trace(tmp_path / "t.jsonl", HAND)
    png = tmp_path / "hit.png"
    assert main(["trace", "analyze", str(trace), "--capacity", "0,512,1024,2048", "--plot", str(png),
                 "--no-progress"]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_refuses_before_running(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what `import matplotlib` meets when it is absent
    trace = write_trace(tmp_path / "t.jsonl", HAND)
    out = tmp_path / "out.json"
    assert main(["trace", "analyze", str(trace), "--plot", str(tmp_path / "x.png"), "--json", str(out)]) == 2
    assert "pip install matplotlib" in caplog.text
    assert not out.exists()


def test_a_malformed_line_is_named(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0]}\n\n{"timestamp": 1}\n')
    with pytest.raises(ConfigError, match=r"line 3"):
        load_trace(path)
    assert len(load_trace(path, max_requests=1)) == 1


def test_token_counts_are_decimal() -> None:
    assert [parse_token_count(t) for t in ("0", "512", "1M", "3m", "1.5K", "10M")] == [
        0, 512, 1_000_000, 3_000_000, 1500, 10_000_000]
    for bad in ("-1", "1.5", "3MB", "", "x"):
        with pytest.raises(ConfigError, match="token count"):
            parse_token_count(bad)


@pytest.mark.skipif(not CONVERSATION.exists(), reason=f"the FAST'25 conversation trace is not at {CONVERSATION}")
def test_the_bars_on_the_conversation_trace() -> None:
    requests = load_trace(CONVERSATION)
    report = analyze(requests, AnalyzeSettings(capacities_tokens=(0, 3_000_000, 1_000_000), instances=(1,),
                                               routings=()))
    rates = {r.capacity_tokens: round(r.hit_rate, 4) for r in report.results}
    assert rates == {0: 0.3736, 3_000_000: 0.1382, 1_000_000: 0.0542}
    assert report.requests == 12031
    assert report.requests_per_min >= 1_000_000
