"""``WarnEvery``: a repeated warning goes out at most once per interval, with the count held back."""

from __future__ import annotations

import time

from tidekv.logs import WarnEvery


def test_warn_every_lets_one_through_per_interval_and_counts_the_rest() -> None:
    gate = WarnEvery(0.2)
    assert gate.due() == 0  # the first one goes out
    assert [gate.due() for _ in range(3)] == [None] * 3
    time.sleep(0.25)
    assert gate.due() == 3  # the next one says how many were held back
    assert gate.due() is None
