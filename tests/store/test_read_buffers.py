"""``store.client.read_buffers``: a consumer's read memory is reused only once every tensor made
from it is gone, never after a read that did not end clean, and at most ``keep`` idle."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
import torch
from tidekv.config import TransferConfig
from tidekv.store.client.read_buffers import ReadBuffers
from tidekv.transfer import TransferEngine


@pytest.fixture
def engine() -> Iterator[TransferEngine]:
    e = TransferEngine(config=TransferConfig())
    yield e
    e.close()


def test_a_buffer_is_reused_only_after_its_last_tensor_is_gone(engine: TransferEngine) -> None:
    buffers = ReadBuffers(engine)
    view, address = buffers.take(3 << 20)
    whole = torch.frombuffer(view, dtype=torch.uint8)
    whole[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    kept = whole[:4].view(torch.int32)  # a view of a view: it alone keeps the buffer
    del view, whole
    gc.collect()
    busy, other = buffers.take(1 << 20)  # held: not idle when the last take below looks
    assert other != address, "in use while a tensor views it"
    assert kept.item() == int.from_bytes(bytes([1, 2, 3, 4]), "little")
    del kept
    gc.collect()
    assert buffers.idle >= 1
    _, again = buffers.take(3 << 20)
    assert again == address and busy, "reused once the last tensor went"


def test_a_spoiled_buffer_is_freed_not_reused(engine: TransferEngine) -> None:
    buffers = ReadBuffers(engine)
    view, address = buffers.take(1 << 20)
    buffers.spoil(address)
    regions = len(engine._regions)
    del view
    gc.collect()
    assert buffers.idle == 0 and len(engine._regions) == regions - 1, "unregistered (its late writes refused)"


def test_at_most_keep_idle_buffers(engine: TransferEngine) -> None:
    buffers = ReadBuffers(engine, keep=2)
    views = [buffers.take(1 << 20)[0] for _ in range(5)]
    regions = len(engine._regions)
    del views
    gc.collect()
    assert buffers.idle == 2 and len(engine._regions) == regions - 3
    buffers.close()
    assert buffers.idle == 0 and len(engine._regions) == regions - 5
