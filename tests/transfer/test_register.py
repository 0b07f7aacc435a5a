"""Registering memory: what is accepted, what is refused with which error, and unregistering.

These run in one process (no peer is needed to decide what may be registered); the last tests
use a second in-process engine as the peer to show that local ranges are checked at transfer().
"""

from __future__ import annotations

import ctypes
import mmap
from typing import Any

import numpy as np
import pytest

from tests.conftest import MakeEngine
from tidekv import ConfigError, SegmentNotRegisteredError, TransferConfig, TransferOp, TransferRequest
from tidekv.errors import EngineClosedError

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize(
    "obj",
    [
        bytearray(b"abc" * 1000),
        np.zeros((16, 32), dtype=np.float32),
        np.arange(1000, dtype=np.int64),
        mmap.mmap(-1, 1 << 16),
    ],
    ids=["bytearray", "numpy-2d-float32", "numpy-int64", "anonymous-mmap"],
)
def test_register_writable_buffers(obj: Any, make_engine: MakeEngine) -> None:
    engine = make_engine()
    region = engine.register(obj)
    view = memoryview(obj).cast("B")
    assert region.length == view.nbytes
    assert (region.location, region.is_shared) == ("cpu", False)
    region.view()[:4] = b"\x01\x02\x03\x04"
    assert view[:4] == b"\x01\x02\x03\x04", "the region must be the object's own memory, not a copy"
    engine.unregister(region)


def test_register_torch_cpu_tensor(make_engine: MakeEngine) -> None:
    torch = pytest.importorskip("torch")
    tensor = torch.zeros(64, 8, dtype=torch.float16)
    region = make_engine().register(tensor)
    assert (region.address, region.length) == (tensor.data_ptr(), tensor.numel() * 2)


def test_register_address_length_pair(make_engine: MakeEngine) -> None:
    engine = make_engine()
    backing = engine.allocate(1 << 16)
    other = make_engine()
    region = other.register((backing.address, 4096))
    assert (region.address, region.length) == (backing.address, 4096)


def _readonly_numpy() -> np.ndarray:
    a = np.zeros(64, dtype=np.uint8)
    a.setflags(write=False)
    return a


REFUSED = {
    "bytes": (lambda: b"read-only", "read-only"),
    "readonly-memoryview": (lambda: memoryview(bytearray(8)).toreadonly(), "read-only"),
    "readonly-numpy": (_readonly_numpy, "read-only"),
    "readonly-mmap": (lambda: mmap.mmap(-1, 4096, prot=mmap.PROT_READ), "read-only"),
    "empty-bytearray": (lambda: bytearray(), "empty"),
    "empty-numpy": (lambda: np.zeros(0, dtype=np.uint8), "empty"),
    "non-contiguous-numpy": (lambda: np.zeros((8, 8), dtype=np.uint8)[:, ::2], "contiguous"),
    "str": (lambda: "text", "cannot register str"),
    "int": (lambda: 42, "cannot register int"),
    "zero-address": (lambda: (0, 4096), "> 0"),
    "zero-length": (lambda: (0x10000, 0), "> 0"),
    "negative-length": (lambda: (0x10000, -1), "> 0"),
}


@pytest.mark.parametrize("make_obj,match", REFUSED.values(), ids=REFUSED.keys())
def test_register_refuses(make_obj: Any, match: str, make_engine: MakeEngine) -> None:
    with pytest.raises(ConfigError, match=match):
        make_engine().register(make_obj())


def test_register_refuses_other_locations(make_engine: MakeEngine) -> None:
    with pytest.raises(ConfigError, match="cuda:0"):
        make_engine().register(bytearray(64), location="cuda:0")


def test_overlapping_regions_are_refused(make_engine: MakeEngine) -> None:
    engine = make_engine()
    buf = bytearray(1 << 16)
    region = engine.register(buf)
    with pytest.raises(ConfigError, match="overlaps"):
        engine.register(buf)
    with pytest.raises(ConfigError, match="overlaps"):
        engine.register((region.address + 100, 10))
    with pytest.raises(ConfigError, match="overlaps"):
        engine.register((region.address - 10, 11))
    with pytest.raises(ConfigError, match="overlaps"):
        engine.register((region.address + region.length - 1, 4096))
    allocated = engine.allocate(8192)
    with pytest.raises(ConfigError, match="overlaps"):
        engine.register((allocated.address + 4096, 4096))
    engine.unregister(region)
    again = engine.register(buf)
    assert again.address == region.address


def test_adjacent_regions_are_allowed(make_engine: MakeEngine) -> None:
    engine = make_engine()
    buf = bytearray(8192)
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    first = engine.register((base, 4096))
    second = engine.register((base + 4096, 4096))
    assert (first.address + first.length) == second.address


def test_unregister_errors(make_engine: MakeEngine) -> None:
    engine = make_engine()
    region = engine.register(bytearray(64))
    engine.unregister(region)
    with pytest.raises(SegmentNotRegisteredError, match=hex(region.address)):
        engine.unregister(region)
    stranger = make_engine().allocate(4096)
    with pytest.raises(SegmentNotRegisteredError):
        engine.unregister(stranger)


def test_allocate(make_engine: MakeEngine) -> None:
    engine = make_engine()
    region = engine.allocate(3 * 4096 + 5)
    assert (region.length, region.is_shared, region.location) == (3 * 4096 + 5, True, "cpu")
    assert region.view()[:16] == bytes(16)
    region.view()[-1] = 7
    assert region.view()[-1] == 7
    for size in (0, -1):
        with pytest.raises(ConfigError, match="size"):
            engine.allocate(size)
    engine.unregister(region)


def test_region_addr_is_bounds_checked(make_engine: MakeEngine) -> None:
    region = make_engine().allocate(4096)
    assert region.addr(4096) == region.address + 4096
    for offset in (-1, 4097):
        with pytest.raises(ConfigError, match="outside"):
            region.addr(offset)


def test_region_table_capacity(make_engine: MakeEngine) -> None:
    engine = make_engine(TransferConfig(max_regions=2))
    buffers = [bytearray(64) for _ in range(3)]
    first = engine.register(buffers[0])
    engine.register(buffers[1])
    with pytest.raises(ConfigError, match="max_regions"):
        engine.register(buffers[2])
    engine.unregister(first)
    for _ in range(10):  # slots are reused
        engine.unregister(engine.register(buffers[2]))


def test_closed_engine_refuses_everything(make_engine: MakeEngine) -> None:
    engine = make_engine()
    region = engine.register(bytearray(64))
    name = engine.name
    engine.close()
    engine.close()
    for call in (
        lambda: engine.register(bytearray(64)),
        lambda: engine.allocate(64),
        lambda: engine.unregister(region),
        lambda: engine.connect(name),
        lambda: engine.transfer([TransferRequest(TransferOp.READ, region.address, 8, name, region.address)]),
    ):
        with pytest.raises(EngineClosedError, match=name):
            call()


def test_engine_port_errors(make_engine: MakeEngine) -> None:
    from tidekv import TransferEngine

    with pytest.raises(ConfigError, match="port"):
        TransferEngine(port=70000, config=TransferConfig())
    taken = make_engine()
    with pytest.raises(ConfigError, match="cannot listen"):
        TransferEngine(port=int(taken.name.rsplit(":", 1)[1]), config=TransferConfig())


def test_local_ranges_are_checked_at_transfer(make_engine: MakeEngine) -> None:
    engine, peer = make_engine(), make_engine()
    remote = peer.allocate(4096)
    local = engine.register(bytearray(4096))
    engine.connect(peer.name)
    read = TransferRequest(TransferOp.READ, local.addr(0), 4096, peer.name, remote.addr(0))
    engine.transfer([read]).wait(timeout_s=10)
    engine.unregister(local)
    with pytest.raises(SegmentNotRegisteredError, match="not inside a region registered on engine"):
        engine.transfer([read])
