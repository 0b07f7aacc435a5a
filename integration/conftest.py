"""Fixtures for the real-vLLM integration tests: skip logic, the tiny model, prompts, a phase
runner and the no-connector baseline.

Run with the vLLM environment: `integration/setup_vllm.sh && .venv-vllm/bin/python -m pytest integration`.
Under any interpreter without a working vLLM every test here skips with the reason (or fails,
with --require-vllm). The main suite (`pytest`, testpaths = tests) never collects this folder.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import random
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness import Phase, PhaseResult, run_phase

REPO = Path(__file__).resolve().parents[1]
MAX_TOKENS = 12
# Prompt lengths in bytes; a prompt is len + 1 tokens (BOS). Each exceeds one 32-token block, as
# hash-of-prompt connectors need, and the last is the ~2k-token size the connector tests use.
PROMPT_BYTES = (70, 131, 2000)


def pytest_addoption(parser: pytest.Parser) -> None:
    # Both engines' options live here, the conftest pytest always loads for integration/, so either
    # flag works whether pytest is pointed at integration/ or at integration/sglang/.
    parser.addoption(
        "--require-vllm", action="store_true",
        help="fail instead of skipping when vLLM cannot run here (CI uses this so a broken setup cannot pass as skips)",
    )
    parser.addoption(
        "--require-sglang", action="store_true",
        help="fail instead of skipping when the SGLang package cannot be used here (see integration/setup_sglang.sh)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "vllm: runs real vLLM (needs .venv-vllm; see integration/README.md)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        # integration/sglang/ has its own conftest, markers and skip logic.
        if here in Path(item.fspath).parents and here / "sglang" not in Path(item.fspath).parents:
            item.add_marker(pytest.mark.vllm)
            item.add_marker(pytest.mark.slow)


@functools.cache
def vllm_missing() -> str | None:
    """Why vLLM cannot run under this interpreter, or None if it can."""
    how = "run integration/setup_vllm.sh, then .venv-vllm/bin/python -m pytest integration"
    if importlib.util.find_spec("vllm") is None:
        where = ".venv-vllm exists but is not this interpreter" if (REPO / ".venv-vllm/bin/python").exists() \
            else ".venv-vllm does not exist"
        return f"vllm is not installed for {sys.executable} ({where}); {how}"
    # Importing vLLM in a child keeps this process light and catches a broken install (such as
    # the CUDA torchvision that setup_vllm.sh removes) without crashing collection.
    probe = subprocess.run(
        [sys.executable, "-c", "import vllm, transformers.models.llama"],
        capture_output=True, text=True, timeout=180,
    )
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        return f"'import vllm, transformers.models.llama' fails under {sys.executable}: {last}; {how}"
    return None


@pytest.fixture(scope="session", autouse=True)
def _require_vllm(request: pytest.FixtureRequest) -> None:
    reason = vllm_missing()
    if reason and request.config.getoption("--require-vllm"):
        pytest.fail(reason, pytrace=False)
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Directory of the tiny random Llama (seed 0), built once per session (~5 s)."""
    from tiny_model import build

    return str(build(tmp_path_factory.mktemp("tiny-llama"), seed=0))


@pytest.fixture(scope="session")
def prompts() -> list[str]:
    """Distinct ASCII prompts of PROMPT_BYTES bytes (no shared prefix, so no prefix-cache hits)."""
    out = []
    for i, size in enumerate(PROMPT_BYTES):
        rng = random.Random(i)
        text = f"{i}: "
        while len(text) < size:
            text += "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) + " "
        out.append(text[:size])
    return out


class VllmRunner:
    """Runs phases and prints each one's summary and log, which pytest shows when a test fails."""

    def run(self, phase: Phase, timeout_s: float = 240.0) -> PhaseResult:
        result = run_phase(phase, timeout_s=timeout_s)
        role = (phase.kv_transfer_config or {}).get("kv_role", "no connector")
        print(f"\n===== phase ({role}, multiprocessing={phase.multiprocessing}): wall {result.wall_s:.1f} s, "
              f"init {result.init_s:.1f} s, generate {result.generate_s:.2f} s")
        for c in result.completions:
            print(f"  prompt {len(c.prompt_token_ids)} tokens, cached {c.num_cached_tokens}: {c.token_ids}")
        print(f"----- log\n{result.log[-8000:]}")
        return result


@pytest.fixture(scope="session")
def vllm() -> VllmRunner:
    return VllmRunner()


@pytest.fixture(scope="session")
def baseline(vllm: VllmRunner, tiny_model: str, prompts: list[str]) -> PhaseResult:
    """Greedy MAX_TOKENS tokens per prompt from a plain in-process engine, no connector."""
    return vllm.run(Phase(model=tiny_model, prompts=prompts, max_tokens=MAX_TOKENS))


# ---- TidekvConnector helpers shared by the test files ----------------------------------------

CONNECTOR = "TidekvConnector"  # found through the vllm.general_plugins entry point: no module path


def tidekv_config(**extra: Any) -> dict[str, Any]:
    return {"kv_connector": CONNECTOR, "kv_role": "kv_both", "kv_connector_extra_config": extra}


def prefill_params(n: int) -> list[dict[str, Any] | None]:
    return [{"do_remote_decode": True} for _ in range(n)]


def wait_placed(locator: Any, card: Any, tokens: list[int], timeout_s: float = 30.0) -> int:
    """Leading blocks of ``tokens`` on ``card``'s engines (every rank's slice on its own) once every
    full block is there (saves run on a background thread), or what is there at the timeout."""
    from tidekv.proxy.store_policy import held_by_instance

    held, deadline = -1, time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        held = held_by_instance({0: [card]}, tokens, locator.locate).get(0, 0)
        if held == len(tokens) // card.block_size:
            break
        time.sleep(0.2)
    return held


@contextlib.contextmanager
def tidekv_up(segment: str = "256MiB", port: int = 0) -> Iterator[str]:
    """`tidekv up` (master + one storage segment) as a subprocess on ``port`` (0: any free); yields
    the master address."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tidekv", "up", "--port", str(port), "--metrics-port", "-1", "--segment-size", segment],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        assert proc.stdout is not None
        deadline, lines = time.monotonic() + 60, []
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            lines.append(line)
            m = re.search(r'"master": "([^"]+)"', line)
            if m:
                yield m.group(1)
                return
            if not line and proc.poll() is not None:
                break
        raise RuntimeError("tidekv up did not start:\n" + "".join(lines))
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
