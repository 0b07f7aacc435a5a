"""Fixtures for the tests that run against the real SGLang package (``.venv-sglang``).

Run with ``integration/setup_sglang.sh && .venv-sglang/bin/python -m pytest integration/sglang``.
Under an interpreter without a usable SGLang every test here skips with the reason (or fails,
with ``--require-sglang``, which ``integration/conftest.py`` registers next to ``--require-vllm``).
Neighbours: ``sglang_rig`` (host pools, storage configs, the ``tidekv up`` pool).
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import sglang_rig

HERE = Path(__file__).resolve().parent
_POOLS = pytest.StashKey[list[sglang_rig.TidekvUp]]()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "sglang: runs against the real SGLang package (needs .venv-sglang)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(item.fspath).parents:
            item.add_marker(pytest.mark.sglang)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for pool in item.stash.get(_POOLS, []):
            report.sections.append((f"tidekv up ({pool.master}) log", pool.log_text()[-8000:]))


@functools.cache
def sglang_missing() -> str | None:
    """Why the SGLang package cannot be used under this interpreter, or None if it can."""
    how = "run integration/setup_sglang.sh, then .venv-sglang/bin/python -m pytest integration/sglang"
    for module in ("sglang", "torch", "tidekv_sglang"):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed for {sys.executable}; {how}"
    sglang_rig.stub_torchvision()
    try:
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: F401
        from sglang.srt.mem_cache.storage import StorageBackendFactory  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure is the reason to report
        return f"SGLang does not import under {sys.executable}: {type(exc).__name__}: {exc}; {how}"
    return None


@pytest.fixture(scope="session", autouse=True)
def _require_vllm() -> None:
    """Overrides integration/conftest.py's vLLM check by name: these tests do not run vLLM."""


@pytest.fixture(scope="session", autouse=True)
def _require_sglang(request: pytest.FixtureRequest) -> None:
    reason = sglang_missing()
    if reason and request.config.getoption("--require-sglang"):
        pytest.fail(reason, pytrace=False)
    if reason:
        pytest.skip(reason)


SpawnPool = Callable[..., sglang_rig.TidekvUp]


@pytest.fixture
def spawn_pool(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SpawnPool]:
    """Factory: ``spawn_pool(segment_size="256MiB")`` starts ``tidekv up`` on a free port; stopped at teardown."""
    started: list[sglang_rig.TidekvUp] = []
    request.node.stash[_POOLS] = started
    counter = itertools.count()

    def spawn(segment_size: str = "256MiB") -> sglang_rig.TidekvUp:
        pool = sglang_rig.TidekvUp(tmp_path / f"tidekv-up-{next(counter)}.log", segment_size).__enter__()
        started.append(pool)
        return pool

    yield spawn
    for pool in started:
        pool.__exit__()


@pytest.fixture
def master(spawn_pool: SpawnPool) -> str:
    """Address of a fresh ``tidekv up`` pool (master plus a 256 MiB segment)."""
    return spawn_pool().master
