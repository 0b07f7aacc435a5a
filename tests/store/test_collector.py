"""The master keeps Python's cycle collector off its index: freezes on its timer, thaws hourly."""

from __future__ import annotations

import gc
from typing import Any

import pytest
from tidekv.store.master.collector import FrozenHeap


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_freezes_when_due_and_thaws_every_hour(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append("collect") or 0)
    monkeypatch.setattr(gc, "freeze", lambda: calls.append("freeze"))
    monkeypatch.setattr(gc, "unfreeze", lambda: calls.append("unfreeze"))
    clock = Clock()
    heap = FrozenHeap(freeze_every_s=10.0, thaw_every_s=3600.0, clock=clock)
    heap.tick()
    assert calls == ["collect", "freeze"], "the first tick freezes (what is not frozen is collected first)"
    calls.clear()
    clock.now += 9.0
    heap.tick()
    assert calls == [], "not due yet"
    clock.now += 1.0
    heap.tick()
    assert calls == ["collect", "freeze"]
    calls.clear()
    clock.now = 100.0 + 3600.0
    heap.tick()
    assert calls == ["unfreeze", "collect", "freeze"], "the hourly thaw is followed by one collection of everything"
    assert (heap.freezes, heap.thaws) == (3, 1)


def test_frozen_objects_go_with_their_last_reference_and_frozen_cycles_with_the_thaw() -> None:
    import weakref

    class Node:
        __slots__ = ("other", "__weakref__")

        def __init__(self) -> None:
            self.other: Any = None

    clock = Clock()
    heap = FrozenHeap(freeze_every_s=10.0, thaw_every_s=3600.0, clock=clock)
    index = [Node() for _ in range(1000)]
    a, b = Node(), Node()
    a.other, b.other = b, a  # a cycle, alive when frozen
    refs, cycle = [weakref.ref(n) for n in index], [weakref.ref(a), weakref.ref(b)]
    try:
        heap.tick()
        assert gc.get_freeze_count() >= 1002, "the survivors are frozen"
        del index[:]
        assert all(r() is None for r in refs), "a frozen object is freed when its last reference goes"
        del a, b
        gc.collect()
        assert all(r() is not None for r in cycle), "a frozen cycle is not collected (the trade-off)"
        clock.now += 3600.0
        heap.tick()
        assert all(r() is None for r in cycle), "the hourly thaw collects it"
    finally:
        gc.unfreeze()
