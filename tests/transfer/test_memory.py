"""Engine memory: allocate(huge=True) gives aligned, zeroed, writable memory; thp_enabled reads the host;
a forked child gets none of it."""

from __future__ import annotations

import os

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


@pytest.mark.parametrize("huge", [True, False], ids=["huge-private", "shared"])
def test_a_forked_child_does_not_get_the_engines_memory(make_engine: MakeEngine, huge: bool) -> None:
    """A child the process forks (a DataLoader worker, the master's fold) gets none of the
    engine's memory (MADV_DONTFORK): private pages would turn copy-on-write under every write
    into the segment while the child lives."""
    engine = make_engine()
    region = engine.allocate(4 * HUGE_PAGE, huge=huge)
    region.view()[:5] = b"hello"
    pid = os.fork()
    if pid == 0:  # the child: is any page of the region mapped here?
        with open("/proc/self/maps") as f:
            spans = [[int(a, 16) for a in line.split()[0].split("-")] for line in f]
        os._exit(1 if any(lo < region.address + region.length and region.address < hi for lo, hi in spans) else 0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the child has the region mapped"
    region.view()[:5] = b"still"  # the parent's memory is its own as before
    assert bytes(region.view()[:5]) == b"still"
    engine.unregister(region)
