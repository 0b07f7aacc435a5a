"""The master's per-object record: objects of one size share that size's int (memory per object)."""

from __future__ import annotations

import pytest
from tidekv.store.master import objects
from tidekv.store.master.objects import ObjectMeta


def test_objects_of_one_size_share_its_int(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(objects, "_SIZES", {})
    a = ObjectMeta(int("70001"), ("seg", 0), None, 0, 1)  # int(): two distinct int objects of one value
    b = ObjectMeta(int("70001"), ("seg", 70016), None, 0, 2)
    assert a.size == b.size == 70001 and a.size is b.size


def test_the_shared_sizes_are_bounded_and_start_afresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(objects, "_SIZES", {})
    monkeypatch.setattr(objects, "_MAX_SIZES", 3)
    for size in (10_001, 10_002, 10_003):
        ObjectMeta(size, ("seg", 0), None, 0, 1)
    assert len(objects._SIZES) == 3
    a = ObjectMeta(int("70003"), ("seg", 0), None, 0, 1)  # a fourth size: the table starts afresh
    b = ObjectMeta(int("70003"), ("seg", 70016), None, 0, 2)
    assert a.size == b.size == 70003 and a.size is b.size
    assert list(objects._SIZES) == [70003]
