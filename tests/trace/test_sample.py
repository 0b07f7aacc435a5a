"""Slices of a trace that keep its reuse (tidekv.trace.sample): whole conversations kept or
dropped, a stable choice, the time window, and the ``--sample-conversations`` / ``--until-s``
flags of ``tidekv trace analyze`` worked by hand; on the conversation trace (when it is there),
the slice the replay benchmark uses keeps most of the trace's reuse where the first requests do not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.trace.test_analyze import CONVERSATION
from tests.trace.traces import request, write_trace
from tidekv.cli import main
from tidekv.errors import ConfigError
from tidekv.trace import load_trace
from tidekv.trace.cache import Routing, simulate_global, simulate_local
from tidekv.trace.sample import conversation_of, is_kept, sample


def conversations(n: int, turns: int) -> list:
    """``n`` conversations of ``turns`` turns each, interleaved; turn t of conversation c holds
    its previous turn's blocks and one more (block 0 shared by all)."""
    out = []
    for t in range(turns):
        for c in range(n):
            blocks = [0] + [1000 * (c + 1) + k for k in range(t + 1)]
            out.append(request(blocks, 512 * len(blocks), timestamp_ms=(t * n + c) * 1000.0))
    return out


def test_a_conversation_is_its_second_hash_id() -> None:
    assert conversation_of(request([0, 7, 8], 1500), 3) == (0, 7)
    assert conversation_of(request([0, 7], 1000), 9) == (0, 7)
    assert conversation_of(request([0], 300), 9) == (1, 9)  # one block: a conversation of its own
    assert conversation_of(request([], 10), 2) == (1, 2)


def test_whole_conversations_are_kept_or_dropped_the_same_in_any_order() -> None:
    trace = conversations(200, 3)
    kept = sample(trace, keep_one_in=4)
    ids = {r.hash_ids[1] for r in kept}
    assert ids and all(sum(r.hash_ids[1] == i for r in kept) == 3 for i in ids)  # every turn of a kept one
    assert 25 <= len(ids) <= 75  # about a quarter of 200
    assert [r for r in trace if r.hash_ids[1] in ids] == kept  # file order, nothing else
    assert sample(list(reversed(trace)), keep_one_in=4) == list(reversed(kept))  # decided by the id alone
    assert sample(trace, keep_one_in=1) == trace
    assert all(is_kept((0, i), 4) == (i in ids) for i in {r.hash_ids[1] for r in trace})


def test_reuse_within_kept_conversations_survives() -> None:
    # 3 turns: turn t hits t + 1 blocks of its t + 2 (turn 0 only block 0, after the first request)
    trace = conversations(200, 3)
    kept = sample(trace, keep_one_in=4)
    n = len(kept) // 3
    hit = simulate_global(kept, 0)
    # turn 0: block 0 (all but the first request); turn 1: 2 of 3 blocks; turn 2: 3 of 4
    assert hit.hit_tokens == 512 * ((n - 1) + 2 * n + 3 * n)
    assert hit.input_tokens == 512 * (2 + 3 + 4) * n


def test_the_window_counts_from_the_first_request() -> None:
    trace = [request([0, 1], 1000, 5000), request([0, 1, 2], 1500, 6000), request([0, 3], 1000, 7001)]
    assert sample(trace, until_s=2) == trace[:2]
    assert sample(trace, until_s=2.001) == trace
    assert sample([], keep_one_in=3) == []


@pytest.mark.parametrize("kwargs", [{"keep_one_in": 0}, {"keep_one_in": 1.5}, {"keep_one_in": True},
                                    {"until_s": 0}, {"until_s": -1.0}])
def test_bad_settings_are_refused_by_name(kwargs: dict) -> None:
    with pytest.raises(ConfigError, match=next(iter(kwargs))):
        sample([request([0, 1], 1000)], **kwargs)


def test_analyze_takes_the_slice_flags(tmp_path: Path) -> None:
    trace = conversations(40, 2)
    path = write_trace(tmp_path / "t.jsonl", trace)
    out = tmp_path / "out.json"
    assert main(["trace", "analyze", str(path), "--sample-conversations", "3", "--until-s", "60", "--capacity", "0",
                 "--instances", "2", "--json", str(out), "--no-progress"]) == 0
    expected = sample(load_trace(path), keep_one_in=3, until_s=60)
    report = json.loads(out.read_text())
    assert report["requests"] == len(expected) and 0 < len(expected) < 60
    rows = {(r["policy"], r["routing"]): r for r in report["results"]}
    assert rows[("global", None)]["hit_tokens"] == simulate_global(expected, 0).hit_tokens
    assert rows[("local", "round_robin")]["hit_tokens"] == simulate_local(expected, 0, 2, Routing.ROUND_ROBIN).hit_tokens


@pytest.mark.skipif(not CONVERSATION.exists(), reason=f"the conversation trace is not at {CONVERSATION}")
def test_the_benchmark_slice_keeps_the_traces_reuse() -> None:
    requests = load_trace(CONVERSATION)
    whole = simulate_global(requests, 0).hit_rate
    first = simulate_global(requests[:200], 0).hit_rate
    kept = sample(requests, keep_one_in=8)
    assert len(kept) == 1557
    assert round(whole, 4) == 0.3736 and round(first, 4) == 0.0593
    assert round(simulate_global(kept, 0).hit_rate, 4) == 0.3510
    assert round(simulate_local(kept, 0, 2, Routing.ROUND_ROBIN).hit_rate, 4) == 0.2497
