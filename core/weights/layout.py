"""Where each tensor of a weights version lives in one flat buffer, and the buffer's header.

A version is packed into one contiguous buffer: a 64-byte header, then every tensor at an
offset aligned to 64 bytes, in the order given. The same layout is used by the publisher's
snapshot and by each receiver's staging copy, so a chunk is the same byte range everywhere and
a receiver can serve what it holds to others.

Header (little-endian u64s): magic, version, chunks done, state. A receiver that serves others
bumps "chunks done" as chunks land; readers check "version" before and after they copy (a
seqlock: a buffer is only ever rewritten after its version field changes).

Neighbours: ``publisher`` packs, ``subscriber`` unpacks; ``protocol`` carries ``TensorSpec``.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from tidekv.errors import ConfigError
from tidekv.weights.protocol import TensorSpec

HEADER_BYTES = 64
ALIGN = 64
MAGIC = int.from_bytes(b"TIDEKVW1", "little")
_HEADER = struct.Struct("<4Q")

STATE_FILLING = 0
STATE_COMPLETE = 1
STATE_FAILED = 2


def _torch() -> Any:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency of every engine we serve
        raise ConfigError("tidekv.weights needs torch (pip install torch)") from None
    return torch


def named_tensors(tensors: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """Normalises a state dict / (name, tensor) pairs into a checked list.

    Raises:
        ConfigError: a name repeats, is empty, or a value is not a torch tensor.
    """
    torch = _torch()
    pairs = list(tensors.items()) if isinstance(tensors, Mapping) else list(tensors)
    seen: set[str] = set()
    for name, tensor in pairs:
        if not isinstance(name, str) or not name:
            raise ConfigError(f"tensor name {name!r} must be a non-empty string")
        if name in seen:
            raise ConfigError(f"tensor name {name!r} appears twice")
        if not isinstance(tensor, torch.Tensor):
            raise ConfigError(f"{name!r} is a {type(tensor).__name__}, expected a torch.Tensor")
        seen.add(name)
    if not pairs:
        raise ConfigError("no tensors to publish")
    return pairs


def plan_layout(pairs: list[tuple[str, Any]]) -> tuple[list[TensorSpec], int]:
    """Offsets for ``pairs`` (name, tensor); returns the specs and the buffer size (header included)."""
    specs: list[TensorSpec] = []
    offset = HEADER_BYTES
    for name, tensor in pairs:
        nbytes = tensor.numel() * tensor.element_size()
        specs.append(TensorSpec(name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape), offset, nbytes))
        offset += -(-max(nbytes, 1) // ALIGN) * ALIGN
    return specs, offset


def buffer_tensor(region_view: memoryview) -> Any:
    """A uint8 torch tensor over a whole registered buffer (no copy)."""
    return _torch().frombuffer(region_view, dtype=_torch().uint8)


def tensor_view(buffer: Any, spec: TensorSpec) -> Any:
    """The tensor ``spec`` describes, as a view into ``buffer`` (a uint8 tensor over the buffer)."""
    torch = _torch()
    dtype = getattr(torch, spec.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"tensor {spec.name!r} has dtype {spec.dtype!r}, unknown to this torch")
    raw = buffer[spec.offset : spec.offset + spec.nbytes]
    return raw.view(dtype).view(spec.shape) if spec.nbytes else torch.empty(spec.shape, dtype=dtype)


def pack(buffer: Any, specs: list[TensorSpec], pairs: list[tuple[str, Any]],
         progress: Callable[[int], None] | None = None, piece_bytes: int = 16 << 20) -> None:
    """Copies each tensor into its place in ``buffer`` (GPU tensors come down to host memory).

    ``progress(end)`` is called with the buffer offset below which every byte is in place, at
    least every ``piece_bytes`` (so readers can start on the first chunks while the rest is copied).
    """
    torch = _torch()
    for spec, (_, tensor) in zip(specs, pairs):
        if not spec.nbytes:
            continue
        src = tensor.detach()
        if src.device.type == "cpu" and src.is_contiguous():
            flat = src.reshape(-1).view(torch.uint8)
            dst = buffer[spec.offset : spec.offset + spec.nbytes]
            for start in range(0, spec.nbytes, piece_bytes):
                dst[start : start + piece_bytes].copy_(flat[start : start + piece_bytes])
                if progress is not None:
                    progress(spec.offset + min(start + piece_bytes, spec.nbytes))
        else:
            tensor_view(buffer, spec).copy_(src)
            if progress is not None:
                progress(spec.offset + spec.nbytes)


def unpack(buffer: Any, specs: list[TensorSpec]) -> Iterator[tuple[str, Any]]:
    """(name, view) for every tensor in ``buffer``."""
    for spec in specs:
        yield spec.name, tensor_view(buffer, spec)


def write_header(view: memoryview, version: int, chunks_done: int, state: int) -> None:
    """Writes the header; ``version`` first is what makes the seqlock safe for readers."""
    _HEADER.pack_into(view, 0, MAGIC, version, chunks_done, state)


def set_progress(view: memoryview, chunks_done: int, state: int) -> None:
    """Updates chunks done and state, leaving magic and version as they are."""
    struct.pack_into("<2Q", view, 16, chunks_done, state)


def read_header(raw: bytes | memoryview) -> tuple[int, int, int]:
    """(version, chunks done, state) of a header; raises ConfigError if the magic is wrong."""
    magic, version, done, state = _HEADER.unpack_from(raw, 0)
    if magic != MAGIC:
        raise ConfigError("not a tidekv weights buffer (bad header magic)")
    return version, done, state


def chunk_ranges(total_bytes: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """(offset, length) of each chunk of the data area [HEADER_BYTES, total_bytes)."""
    out = []
    offset = HEADER_BYTES
    while offset < total_bytes:
        length = min(chunk_bytes, total_bytes - offset)
        out.append((offset, length))
        offset += length
    return out
