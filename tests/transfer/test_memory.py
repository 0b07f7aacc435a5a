"""Huge-page memory: allocate(huge=True) and promote_to_huge_pages keep every byte where it was."""

from __future__ import annotations

import ctypes
import mmap

import pytest

from tests.conftest import MakeEngine
from tidekv.errors import ConfigError
from tidekv.transfer import promote_to_huge_pages
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


def test_promote_keeps_contents_and_reports_whole_huge_pages() -> None:
    size = 3 * HUGE_PAGE
    buf = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = memoryview(buf)
    pattern = bytes(range(251)) * (len(buf) // 251) + bytes(len(buf) % 251)
    view[:] = pattern
    address = ctypes.addressof(ctypes.c_char.from_buffer(buf)) + 4096  # deliberately not 2 MiB aligned
    before = _anon_huge_kib()
    promoted = promote_to_huge_pages(address, size)
    assert promoted % HUGE_PAGE == 0 and 0 <= promoted <= size - HUGE_PAGE + 4096
    assert view[:] == pattern, "promotion must not change a byte"
    if promoted:
        assert _anon_huge_kib() - before >= promoted // 1024 // 2, "the kernel reports the collapsed huge pages"
    elif thp_enabled():
        pytest.skip("THP is on but MADV_COLLAPSE failed (kernel < 6.1 or no free huge pages); contents checked")
    del view
    buf.close()


def test_promote_ignores_ranges_without_a_whole_huge_page() -> None:
    buf = mmap.mmap(-1, HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    address = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    assert promote_to_huge_pages(address + 1, HUGE_PAGE - 1) == 0
    assert promote_to_huge_pages(address, 0) == 0
