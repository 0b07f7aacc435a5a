"""Real vLLM on the tiny model, before any tidekv code is involved: greedy determinism,
disaggregated prefill through vLLM's own file connector (ExampleConnector), and the OpenAI
server. These pin down the behaviour the tidekv connector tests compare against.
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from harness import OpenAIServer, Phase, PhaseResult


def example_connector(role: str, store: Path) -> dict[str, Any]:
    return {
        "kv_connector": "ExampleConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"shared_storage_path": str(store)},
    }


def test_greedy_generation_is_deterministic(vllm, tiny_model, prompts, baseline):
    again = vllm.run(Phase(model=tiny_model, prompts=prompts, max_tokens=len(baseline.token_ids[0])))

    assert again.token_ids == baseline.token_ids
    assert len({tuple(t) for t in baseline.token_ids}) == len(prompts), "prompts should give different outputs"
    assert all(len(set(t)) > 1 for t in baseline.token_ids), "greedy output should not be one repeated token"


@pytest.fixture(scope="module")
def example_store(vllm, tiny_model, prompts, baseline, tmp_path_factory) -> tuple[Path, PhaseResult]:
    """Runs the prefill side: a kv_producer engine generates one token per prompt and the
    ExampleConnector writes each prompt's KV to one safetensors file per layer."""
    store = tmp_path_factory.mktemp("example-connector-kv")
    producer = vllm.run(Phase(
        model=tiny_model, prompts=prompts, max_tokens=1, kv_transfer_config=example_connector("kv_producer", store),
    ))
    files = sorted(store.rglob("*.safetensors"))
    assert len(files) == 2 * len(prompts), f"expected one file per prompt and layer, got {files}"
    assert [t[0] for t in producer.token_ids] == [t[0] for t in baseline.token_ids]
    return store, producer


def decode_phase(tiny_model: str, producer: PhaseResult, baseline: PhaseResult, store: Path, **kwargs: Any) -> Phase:
    """The decode side: each prompt plus the producer's token, asking for the rest of the baseline's tokens."""
    return Phase(
        model=tiny_model,
        prompts=[c.prompt_token_ids + c.token_ids for c in producer.completions],
        max_tokens=len(baseline.token_ids[0]) - 1,
        kv_transfer_config=example_connector("kv_consumer", store),
        **kwargs,
    )


def joined(producer: PhaseResult, consumer: PhaseResult) -> list[list[int]]:
    return [p + c for p, c in zip(producer.token_ids, consumer.token_ids)]


@pytest.mark.parametrize("multiprocessing", [False, True], ids=["in-process", "multiprocess"])
def test_disaggregated_prefill_matches_baseline(vllm, tiny_model, baseline, example_store, multiprocessing):
    store, producer = example_store

    consumer = vllm.run(decode_phase(tiny_model, producer, baseline, store, multiprocessing=multiprocessing))

    assert joined(producer, consumer) == baseline.token_ids
    for c in consumer.completions:
        # The connector serves the prompt's whole blocks; only the tail is computed locally.
        assert c.num_cached_tokens and c.num_cached_tokens >= len(c.prompt_token_ids) - 33, c


def test_corrupted_kv_changes_the_output(vllm, tiny_model, baseline, example_store, tmp_path):
    """Control: the consumer's output really comes from the loaded KV, not from recomputation."""
    from safetensors.torch import load_file, save_file

    store, producer = example_store
    zeroed = tmp_path / "zeroed"
    shutil.copytree(store, zeroed)
    for f in zeroed.rglob("*.safetensors"):
        save_file({k: v.zero_() for k, v in load_file(f).items()}, f)

    consumer = vllm.run(decode_phase(tiny_model, producer, baseline, zeroed))

    assert all(c.num_cached_tokens for c in consumer.completions)
    assert joined(producer, consumer) != baseline.token_ids


def test_openai_server_answers_completions(tiny_model, prompts, baseline, tmp_path):
    max_tokens = len(baseline.token_ids[0])
    server = OpenAIServer(tiny_model, log_path=tmp_path / "server.log")
    try:
        server.start(timeout_s=240)
        print(f"server healthy after {server.startup_s:.1f} s")
        reply = server.complete(prompts[0], max_tokens=max_tokens)
    finally:
        server.stop()
        print(f"----- server log\n{server.log()[-8000:]}")

    assert reply["usage"]["prompt_tokens"] == len(baseline.completions[0].prompt_token_ids)
    assert reply["usage"]["completion_tokens"] == max_tokens
    assert reply["choices"][0]["text"] == baseline.completions[0].text
    assert "kv_transfer_params" in reply
