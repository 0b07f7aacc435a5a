"""Shared fixtures: target engines in their own processes and initiator engines in this one.

A failed test gets each of its target processes' stderr (the target engine's log) appended to
its report. Neighbours: ``tests/transfer/harness.py`` (the process driver).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.transfer.harness import TargetProcess
from tidekv import TransferConfig, TransferEngine

_TARGETS = pytest.StashKey[list[TargetProcess]]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for target in item.stash.get(_TARGETS, []):
            report.sections.append((f"target {target.name} (pid {target.pid}) stderr", target.log_text()))


SpawnTarget = Callable[..., TargetProcess]
MakeEngine = Callable[..., TransferEngine]


@pytest.fixture
def spawn_target(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SpawnTarget]:
    """Factory: ``spawn_target(regions={name: (kind, size_bytes, seed)}, **config)`` starts a target.

    Each target runs a TransferEngine on 127.0.0.1 (port 0, or ``port=``) in a child process; all
    are stopped (or killed) at teardown.
    """
    started: list[TargetProcess] = []
    request.node.stash[_TARGETS] = started
    counter = itertools.count()

    def spawn(regions: dict[str, tuple[str, int, int]], *, prefix: Sequence[str] = (), port: int = 0,
              **config: Any) -> TargetProcess:
        target = TargetProcess(regions, config, tmp_path / f"target-{next(counter)}.log", prefix=prefix, port=port)
        started.append(target)
        return target

    yield spawn
    for target in started:
        target.stop()


@pytest.fixture
def make_engine() -> Iterator[MakeEngine]:
    """Factory: ``make_engine(config)`` returns an in-process engine on 127.0.0.1:0, closed at teardown."""
    engines: list[TransferEngine] = []

    def make(config: TransferConfig | None = None) -> TransferEngine:
        engine = TransferEngine(host="127.0.0.1", port=0, config=config or TransferConfig())
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()
