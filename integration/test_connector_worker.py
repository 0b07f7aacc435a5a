"""TidekvWorker's bookkeeping without an engine (needs vLLM's modules, no model): a finished
prefill request whose blocks are both held for a decode and being saved to the store is
reported to vLLM as finished sending exactly once, after both are done. (Reporting it twice
crashes vLLM's scheduler; reporting it early frees blocks that a decode or a save still reads.)"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import pytest

from tidekv.kvcache.handoff import Releaser
from tidekv.kvcache.settings import KVConnectorConfig


@pytest.fixture
def worker() -> Iterator[Any]:
    from tidekv_vllm.metadata import TidekvMetadata
    from tidekv_vllm.worker import TidekvWorker

    config = SimpleNamespace(cache_config=SimpleNamespace(block_size=16),
                             model_config=SimpleNamespace(model="tiny", dtype="float32"))
    w = TidekvWorker(config, KVConnectorConfig())  # no master: saves are injected below
    w.test_metadata = TidekvMetadata  # vLLM's modules are imported only once it is known to run here
    yield w
    w.shutdown()


def _finish(worker: Any, rid: str, *, held: bool, saving: bool) -> Future[None] | None:
    """A request that just finished on the prefill: vLLM binds its hold, then asks get_finished."""
    worker.bind(worker.test_metadata(holds=[rid] if held else []))
    save: Future[None] | None = None
    if saving:
        save = Future()
        worker._saves.submit(rid, save.result, 30)  # a save still running until the test ends it
    assert worker.get_finished({rid})[0] == set()  # held, or saving: not yet
    return save


def _sent_until(worker: Any, rid: str, timeout_s: float = 5.0) -> list[set[str]]:
    """Every non-empty finished-sending report until ``rid`` shows up (or the timeout)."""
    reports: list[set[str]] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not any(rid in r for r in reports):
        sending, _ = worker.get_finished(set())
        if sending:
            reports.append(sending)
        time.sleep(0.01)
    return reports


@pytest.mark.parametrize("saves_end_first", [True, False])
def test_held_and_saving_request_is_reported_once_after_both(worker: Any, saves_end_first: bool) -> None:
    releaser = Releaser()
    try:
        save = _finish(worker, "r", held=True, saving=True)
        assert save is not None
        if saves_end_first:
            save.set_result(None)
            assert worker.get_finished(set())[0] == set(), "still held for its decode"
            releaser.release(worker.holds.address, "r")
        else:
            releaser.release(worker.holds.address, "r")
            deadline = time.monotonic() + 5
            while worker.holds.is_held("r") and time.monotonic() < deadline:
                assert worker.get_finished(set())[0] == set(), "its save still runs"
                time.sleep(0.01)
            assert not worker.holds.is_held("r")
            save.set_result(None)
        assert _sent_until(worker, "r") == [{"r"}]
        assert [worker.get_finished(set())[0] for _ in range(3)] == [set()] * 3, "reported once"
    finally:
        releaser.close()


def test_held_only_and_saving_only_requests_are_reported_once(worker: Any) -> None:
    releaser = Releaser()
    try:
        _finish(worker, "held", held=True, saving=False)
        releaser.release(worker.holds.address, "held")
        assert _sent_until(worker, "held") == [{"held"}]
        save = _finish(worker, "saving", held=False, saving=True)
        assert save is not None
        save.set_result(None)
        assert _sent_until(worker, "saving") == [{"saving"}]
        assert worker.get_finished(set())[0] == set()
    finally:
        releaser.close()


def test_saving_request_is_reported_even_without_a_store_client(worker: Any) -> None:
    """A rank whose store client failed to connect still hands back a request the scheduler
    planned saves for (vLLM waits for every rank's report before freeing its blocks)."""
    from tidekv.kvcache.prefix_reuse import BlockJob

    meta = worker.test_metadata(saves=[BlockJob("s", [1, 2], [["kv/a", "kv/b"]])])
    worker.save(meta)
    assert worker.get_finished({"s"})[0] == {"s"}
    assert worker.get_finished(set())[0] == set()


def test_cpu_reservation_warning_names_the_setting_only_when_vllm_kept_no_core() -> None:
    from tidekv_vllm.worker import cpu_reservation_warning

    # 2 vCPUs, a connector: vLLM bound both cores to OpenMP (it wanted 2 reserved, could keep none)
    warning = cpu_reservation_warning("cpu", 2, 2, {})
    assert warning is not None and "VLLM_CPU_NUM_OF_RESERVED_CPU=1" in warning and "all 2 CPUs" in warning
    assert cpu_reservation_warning("cpu", 2, 2, {"VLLM_CPU_OMP_THREADS_BIND": "auto"}) is not None
    # a core was kept back, or the user chose: nothing to say
    assert cpu_reservation_warning("cpu", 1, 2, {}) is None
    assert cpu_reservation_warning("cpu", 2, 2, {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}) is None
    assert cpu_reservation_warning("cpu", 2, 2, {"VLLM_CPU_OMP_THREADS_BIND": "0-1"}) is None
    assert cpu_reservation_warning("cuda:0", 64, 64, {}) is None
