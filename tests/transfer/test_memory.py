"""Huge-page memory: allocate(huge=True) gives aligned, zeroed, writable memory; thp_enabled reads the host."""

from __future__ import annotations

import pytest

from tests.conftest import MakeEngine
from tidekv.errors import ConfigError
from tidekv.transfer.memory import HUGE_PAGE, thp_enabled


def _anon_huge_kib() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    return 0


def test_allocate_huge_is_aligned_zeroed_and_writable(make_engine: MakeEngine) -> None:
    engine = make_engine()
    region = engine.allocate(HUGE_PAGE + 12345, huge=True)
    assert region.address % HUGE_PAGE == 0
    view = region.view()
    assert view[:4096] == bytes(4096) and view[-4096:] == bytes(4096)
    view[-1] = 9
    assert view[-1] == 9
    with pytest.raises(ConfigError, match="size"):
        engine.allocate(0, huge=True)
    engine.unregister(region)


def test_thp_enabled_matches_the_kernel_setting() -> None:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            expected = "[never]" not in f.read()
    except OSError:
        expected = False
    assert thp_enabled() is expected


def test_huge_pages_are_not_chosen_where_cross_memory_attach_is_forbidden(monkeypatch: pytest.MonkeyPatch) -> None:
    from tidekv.transfer import memory

    assert isinstance(memory.cross_memory_attach_allowed(), bool)
    monkeypatch.setattr(memory, "cross_memory_attach_allowed", lambda: False)  # as under a strict seccomp profile
    assert memory.huge_pages_shareable() is False


def test_allocate_huge_beyond_memory_is_a_clear_error(make_engine: MakeEngine) -> None:
    with open("/proc/sys/vm/overcommit_memory") as f:
        if f.read().strip() != "0":
            pytest.skip("needs the kernel's heuristic overcommit (vm.overcommit_memory=0) to refuse the mapping")
    engine = make_engine()
    with pytest.raises(ConfigError, match="cannot map 70368744177664 bytes"):
        engine.allocate(1 << 46, huge=True)
    region = engine.allocate(HUGE_PAGE, huge=True)  # the engine is still fine
    engine.unregister(region)
