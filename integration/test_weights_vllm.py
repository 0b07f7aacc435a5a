"""RL weight updates on real vLLM through tidekv: an engine started with weights A, a trainer
process publishing weights B, the engine updated -- greedy output equal to a fresh engine
loaded with B; a trainer killed mid-update leaves the engine serving A."""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import VllmRunner
from harness import Phase
from weights_phase import run_weights_phase
from weights_trainer import trainer_main

PROMPTS = ["The quick brown fox jumps over the lazy dog and keeps on running far away",
           "0123456789 abcdefghij klmnopqrst uvwxyz, once more with feeling"]
TOKENS = 12
CTX = multiprocessing.get_context("spawn")


@pytest.fixture(scope="module")
def model_b(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tiny_model import build

    return str(build(tmp_path_factory.mktemp("tiny-llama-b"), seed=1))


@pytest.fixture(scope="module")
def expected(vllm: VllmRunner, tiny_model: str, model_b: str) -> dict[str, list[list[int]]]:
    out = {}
    for key, model in (("a", tiny_model), ("b", model_b)):
        out[key] = vllm.run(Phase(model=model, prompts=PROMPTS, max_tokens=TOKENS, max_model_len=512)).token_ids
    assert out["a"] != out["b"], "the two models must answer differently for the test to mean anything"
    return out


class Trainer:
    def __init__(self, model_dir: str, version: int, die: bool = False) -> None:
        self.conn, child = CTX.Pipe()
        self.proc = CTX.Process(target=trainer_main, args=(child, model_dir, version, die), daemon=True)
        self.proc.start()
        assert self.conn.poll(120), "trainer did not start"
        self.address = self.conn.recv()[1]

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send("stop")
            except OSError:
                pass
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


@pytest.fixture
def trainers() -> Iterator[Any]:
    started: list[Trainer] = []

    def start(model_dir: str, version: int, die: bool = False) -> Trainer:
        t = Trainer(model_dir, version, die)
        started.append(t)
        return t

    yield start
    for t in started:
        t.stop()


def _spec(model: str, mode: str, steps: list[Any], multiprocessing: bool = False) -> dict[str, Any]:
    return {"model": model, "prompts": PROMPTS, "max_tokens": TOKENS, "mode": mode, "steps": steps,
            "multiprocessing": multiprocessing}


def test_native_weight_transfer_api_updates_to_the_trainers_weights(
        tiny_model: str, model_b: str, expected: dict[str, Any], trainers: Any) -> None:
    trainer = trainers(model_b, 1)
    steps = ["generate", {"update": 1, "publisher": trainer.address}, "generate"]
    results, log = run_weights_phase(_spec(tiny_model, "native", steps))
    print(log[-6000:])
    assert results[0] == expected["a"]
    assert results[1].get("version") == 1, results[1]
    assert results[2] == expected["b"]
    assert "Creating weight transfer engine: TidekvWeightTransferEngine" in log


def test_worker_extension_in_multiprocess_engine(
        tiny_model: str, model_b: str, expected: dict[str, Any], trainers: Any) -> None:
    trainer = trainers(model_b, 1)
    steps = ["generate", {"update": 1, "publisher": trainer.address}, "generate"]
    results, log = run_weights_phase(_spec(tiny_model, "extension", steps, multiprocessing=True), timeout_s=400)
    print(log[-6000:])
    assert results[0] == expected["a"]
    assert results[1].get("version") == 1, results[1]
    assert results[2] == expected["b"]


def test_trainer_killed_mid_update_leaves_the_old_weights_serving(
        tiny_model: str, model_b: str, expected: dict[str, Any], trainers: Any) -> None:
    dying = trainers(model_b, 1, die=True)
    healthy = trainers(model_b, 2)
    steps = ["generate", {"update": 1, "publisher": dying.address}, "generate",
             {"update": 2, "publisher": healthy.address}, "generate"]
    results, log = run_weights_phase(_spec(tiny_model, "native", steps))
    print(log[-6000:])
    assert results[0] == expected["a"]
    assert results[1].get("error") in ("PublisherUnavailableError", "VersionChangedError"), results[1]
    dying.proc.join(10)
    assert dying.proc.exitcode is not None and dying.proc.exitcode < 0  # it really died mid-update
    assert results[2] == expected["a"]  # still the old weights, whole
    assert results[3].get("version") == 2, results[3]  # and the next update works
    assert results[4] == expected["b"]
