"""``tidekv trace replay`` against a fake OpenAI-compatible streaming server started here: arrival
times, synthesized prompts, measurements, errors by kind, the deployment's hit rate."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("aiohttp", reason="tidekv trace replay needs aiohttp (pip install aiohttp (tidekv's proxy extra))")

from tests.proxy.fakes import LoopThread  # noqa: E402
from tests.trace.fake_openai import FakeOpenAI  # noqa: E402
from tests.trace.traces import request, write_trace  # noqa: E402
from tidekv.cli import main  # noqa: E402
from tidekv.trace.prompts import PromptSettings, PromptSynthesizer  # noqa: E402
from tidekv.trace.replay_report import percentile, prefix_cache_counters  # noqa: E402


@pytest.fixture
def fake() -> Iterator[FakeOpenAI]:
    rig = LoopThread()
    server = FakeOpenAI(failures={900: "http_500", 901: "hang", 902: "break", 903: "error_event", 904: "garbage",
                                  905: "http_429"})
    rig.call(server.start())
    yield server
    rig.call(server.stop())
    rig.close()


def test_equal_hash_ids_give_identical_blocks_and_different_ones_differ() -> None:
    synth = PromptSynthesizer(PromptSettings(scale_tokens=1 / 32))
    assert synth.settings.tokens_per_block == 16
    a = synth.prompt(request([1, 2, 3], 1536))
    b = synth.prompt(request([1, 2, 4], 1500))
    assert len(a) == 48 and len(b) == 47  # 1500 / 32 = 46.875
    assert a[:32] == b[:32] and a[32:35] != b[32:35]  # block 3 (ids 3 and 4) spells its id first
    assert len({synth.block(i) for i in range(3000)}) == 3000
    assert synth.output_tokens(request([1], 10, output_length=320)) == 10
    assert synth.output_tokens(request([1], 10, output_length=3)) == 1
    capped = PromptSynthesizer(PromptSettings(scale_tokens=1 / 32, max_input_tokens=20))
    assert capped.prompt(request([1, 2, 3], 1536)) == a[:20]
    assert PromptSynthesizer(PromptSettings(block_tokens=64)).prompt(request([7, 8], 900))[:64] == list(
        PromptSynthesizer(PromptSettings(block_tokens=64)).block(7))


def test_replay_measures_and_counts_every_failure(fake: FakeOpenAI, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    trace = [
        request([1, 2, 3], 1536, 0, 320),
        request([1, 2, 4], 1500, 400, 320),
        request([1, 2, 3], 1536, 800, 320),
        *(request([i], 512, 1000 + 10 * (i - 900), 320) for i in range(900, 906)),
    ]
    path = write_trace(tmp_path / "t.jsonl", trace)
    out, png = tmp_path / "replay.json", tmp_path / "replay.png"
    started = time.monotonic()
    code = main(["trace", "replay", str(path), "--target", fake.url, "--speedup", "2", "--scale-tokens", "0.03125",
                 "--timeout-s", "1.5", "--ttft-slo-ms", "5000", "--tbt-slo-ms", "1000", "--json", str(out),
                 "--plot", str(png), "--no-progress"])
    assert code == 0
    assert time.monotonic() - started < 10  # the hanging request was given up at its deadline
    report = json.loads(out.read_text())
    summary = report["summary"]
    assert summary["requests"] == 9 and summary["succeeded"] == 3
    assert summary["errors"] == {"http_500": 1, "http_429": 1, "timeout": 1, "stream": 2, "bad_response": 1}
    # arrivals at (timestamp / 2): 0, 0.2, 0.4 s
    arrivals = {json.dumps(body["prompt"][:48]): t for t, body in fake.received[:3]}
    first = min(t for t, _ in fake.received)
    times = sorted(t - first for t, _ in fake.received[:3])
    assert times == pytest.approx([0.0, 0.2, 0.4], abs=0.1)
    assert len(arrivals) == 2  # requests 0 and 2 sent the same prompt
    bodies = [b for _, b in fake.received]
    assert all(b["max_tokens"] == 10 and b["stream"] is True and b["ignore_eos"] is True and b["model"] == "tiny"
               for b in bodies)
    ok = [r for r in report["requests"] if r["error"] is None]
    assert [r["tokens"] for r in ok] == [10, 10, 10]
    assert all(r["ttft_s"] >= 0.05 and r["mean_tbt_s"] >= 0.009 and r["e2e_s"] > r["ttft_s"] for r in ok)
    assert summary["slo_attainment"] == pytest.approx(3 / 9)
    assert summary["goodput_rps"] == pytest.approx(3 / summary["duration_s"])
    # the fake's prefix cache over 16-token blocks: 48 (no hit), 47 (2 blocks: 32), 48 (48), and the three
    # whose streams failed after their prefill, 16 each (no hit); counted from the fake's start values
    (hits,) = summary["deployment_hit_rates"]
    assert (hits["source"], hits["hits"], hits["queries"]) == ("vllm:prefix_cache", 80, 143 + 48)
    assert hits["hit_rate"] == pytest.approx(80 / 191)
    text = capsys.readouterr().out
    assert "SLO attainment" in text and "goodput" in text and "0.4188" in text and "http_429 1" in text
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_an_unreachable_target_is_counted_not_hung(tmp_path: Path) -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    path = write_trace(tmp_path / "t.jsonl", [request([1], 512, 0), request([2], 512, 10)])
    out = tmp_path / "r.json"
    assert main(["trace", "replay", str(path), "--target", f"http://127.0.0.1:{port}", "--model", "m",
                 "--scale-tokens", "0.03125", "--timeout-s", "2", "--json", str(out), "--no-progress"]) == 1
    assert json.loads(out.read_text())["summary"]["errors"] == {"connect": 2}


def test_prometheus_counters_and_percentiles() -> None:
    text = ('# HELP x\nvllm:prefix_cache_hits_total{engine="0"} 5.0\nvllm:prefix_cache_hits_total{engine="1"} 7\n'
            'vllm:prefix_cache_queries_total 20\nvllm:external_prefix_cache_hits_total 1\n'
            'vllm:external_prefix_cache_queries_total 4\nother_total 3\n')
    assert prefix_cache_counters(text) == {"vllm:prefix_cache": {"hits": 12.0, "queries": 20.0},
                                           "vllm:external_prefix_cache": {"hits": 1.0, "queries": 4.0}}
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([5], 99) == 5 and percentile([], 50) is None
