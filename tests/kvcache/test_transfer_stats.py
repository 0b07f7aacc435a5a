"""A worker's KV transfer totals: recorded from several threads, drained once, summed across workers."""

from __future__ import annotations

import threading

import pytest

from tidekv.kvcache.transfer_stats import TransferStats, merge, summary


def test_take_drains_the_totals_per_flow() -> None:
    stats = TransferStats()
    stats.record("pull", 4, 4096, 0.5)
    stats.record("pull", 2, 0, 0.1, failed_blocks=2)
    stats.record("save", 3, 3072, 0.25)
    report = stats.take()
    assert report == {"pull": {"blocks": 6, "bytes": 4096, "seconds": pytest.approx(0.6), "failed_blocks": 2},
                      "save": {"blocks": 3, "bytes": 3072, "seconds": 0.25, "failed_blocks": 0}}
    assert stats.take() == {}, "a second take starts from nothing"


def test_records_from_many_threads_all_count() -> None:
    stats = TransferStats()

    def saver() -> None:
        for _ in range(2000):
            stats.record("save", 1, 10, 0.0)

    threads = [threading.Thread(target=saver) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert stats.take()["save"]["blocks"] == 8000


def test_merge_sums_workers_and_summary_gives_rates() -> None:
    rank0 = {"load": {"blocks": 2, "bytes": 2_000_000_000, "seconds": 1.0, "failed_blocks": 0}}
    rank1 = {"load": {"blocks": 2, "bytes": 2_000_000_000, "seconds": 1.0, "failed_blocks": 1},
             "save": {"blocks": 1, "bytes": 0, "seconds": 0.0, "failed_blocks": 1}}
    total = merge(rank0, rank1)
    assert total["load"] == {"blocks": 4, "bytes": 4_000_000_000, "seconds": 2.0, "failed_blocks": 1}
    assert summary(total) == {"load_blocks": 4, "load_failed_blocks": 1, "load_GBps": 2.0,
                              "save_blocks": 1, "save_failed_blocks": 1}


def test_an_unknown_flow_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown KV transfer flow 'push'"):
        TransferStats().record("push", 1, 1, 0.0)  # type: ignore[arg-type]
