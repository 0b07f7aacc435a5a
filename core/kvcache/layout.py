"""Where each block of a paged KV cache lives in memory, and which transfers move blocks.

An engine's KV cache is one tensor per layer with blocks on dimension 0 (vLLM's standardized
``[blocks, kv_heads, tokens, content]`` view). A block of one layer is one or more contiguous
byte runs, found from the tensor's strides — no layout is assumed contiguous. Two engines may
exchange blocks only when their layouts hash the same (same model, dtype, shapes and runs).
Neighbours: the vLLM plugin builds a ``KVLayout`` from its tensors; ``tidekv.transfer`` moves
the bytes described here.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tidekv.errors import ConfigError
from tidekv.transfer.batch import TransferOp, TransferRequest


def contiguous_runs(shape: Sequence[int], strides: Sequence[int], itemsize: int) -> list[tuple[int, int]]:
    """Byte runs (offset, length) covering a strided tensor, merged where they touch."""
    if any(n == 0 for n in shape):
        return []
    # Fold trailing dims that are contiguous with each other into one run.
    run_elems, dim = 1, len(shape)
    while dim > 0 and (shape[dim - 1] == 1 or strides[dim - 1] == run_elems):
        run_elems *= shape[dim - 1]
        dim -= 1
    runs: list[tuple[int, int]] = []
    outer = list(zip(shape[:dim], strides[:dim]))

    def walk(i: int, offset: int) -> None:
        if i == len(outer):
            start, length = offset * itemsize, run_elems * itemsize
            if runs and runs[-1][0] + runs[-1][1] == start:
                runs[-1] = (runs[-1][0], runs[-1][1] + length)
            else:
                runs.append((start, length))
            return
        n, stride = outer[i]
        for k in range(n):
            walk(i + 1, offset + k * stride)

    walk(0, 0)
    return runs


@dataclass(frozen=True, slots=True)
class LayerLayout:
    """One layer: block b's runs are at ``base + b * block_stride + offset`` for each run."""

    name: str
    base: int
    num_blocks: int
    block_stride: int
    runs: tuple[tuple[int, int], ...]

    @property
    def block_bytes(self) -> int:
        return sum(length for _, length in self.runs)

    @property
    def dense(self) -> bool:
        """A block is one run filling its whole stride, so consecutive blocks are one run too."""
        return self.runs == ((0, self.block_stride),)

    def check_blocks(self, first: int, count: int = 1) -> None:
        """Raises ConfigError unless blocks first .. first + count - 1 exist."""
        if not (0 <= first and first + count <= self.num_blocks):
            bad = first if not 0 <= first < self.num_blocks else first + count - 1
            raise ConfigError(f"block {bad} is out of range for layer {self.name} ({self.num_blocks} blocks)")

    def spans(self, block: int) -> list[tuple[int, int]]:
        self.check_blocks(block)
        start = self.base + block * self.block_stride
        return [(start + off, length) for off, length in self.runs]


def _location_of(tensor: Any) -> str:
    """"cpu" or "cuda:N" for a torch tensor (or anything with a torch-like ``device``)."""
    device = getattr(tensor, "device", None)
    kind = getattr(device, "type", "cpu")
    if kind == "cuda":
        return f"cuda:{device.index or 0}"
    if kind != "cpu":
        raise ConfigError(f"KV tensors on {device} cannot be moved: tidekv moves cpu and cuda memory")
    return "cpu"


@dataclass(frozen=True, slots=True)
class KVLayout:
    """All layers of one engine's KV cache, plus what must match for two engines to exchange blocks."""

    layers: tuple[LayerLayout, ...]
    block_size: int  # tokens per block
    fingerprint: str  # model, dtype, shapes, runs: engines exchange blocks only when equal
    location: str = "cpu"  # where this engine's blocks are: "cpu" or "cuda:N" (not part of the fingerprint)

    @classmethod
    def from_tensors(cls, tensors: dict[str, Any], block_size: int, model_tag: str) -> KVLayout:
        """Builds the layout of per-layer tensors with blocks on dim 0 (torch tensors or alike).

        Args:
            tensors: layer name -> tensor (``data_ptr()``, ``shape``, ``stride()``, ``element_size()``).
            block_size: tokens per block.
            model_tag: what else must match across engines (model name, dtype, tp rank...).
        """
        layers = []
        locations = {_location_of(t) for t in tensors.values()}
        if len(locations) > 1:
            raise ConfigError(f"KV tensors are spread over {sorted(locations)}; one engine's cache must be on one device")
        for name in sorted(tensors, key=_layer_order):
            t = tensors[name]
            shape, strides, itemsize = tuple(t.shape), tuple(t.stride()), int(t.element_size())
            if len(shape) < 2:
                raise ConfigError(f"KV tensor of layer {name} has shape {shape}; expected blocks on dim 0")
            runs = tuple(contiguous_runs(shape[1:], strides[1:], itemsize))
            layers.append(LayerLayout(name, int(t.data_ptr()), shape[0], strides[0] * itemsize, runs))
        desc = {
            "model": model_tag,
            "block_size": block_size,
            "layers": [[lay.name, lay.block_bytes, [list(r) for r in lay.runs]] for lay in layers],
            "dtype": str(next(iter(tensors.values())).dtype) if tensors else "",
        }
        fingerprint = hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:16]
        return cls(tuple(layers), block_size, fingerprint, locations.pop() if locations else "cpu")

    def memory_ranges(self) -> list[tuple[int, int]]:
        """Disjoint (address, length) ranges covering every layer's blocks (for registration)."""
        spans = sorted((lay.base, lay.num_blocks * lay.block_stride) for lay in self.layers)
        merged: list[tuple[int, int]] = []
        for start, length in spans:
            if merged and start <= merged[-1][0] + merged[-1][1]:
                end = max(merged[-1][0] + merged[-1][1], start + length)
                merged[-1] = (merged[-1][0], end - merged[-1][0])
            else:
                merged.append((start, length))
        return merged

    def to_wire(self) -> dict[str, Any]:
        """What a peer needs to address our blocks (JSON-able)."""
        return {
            "fingerprint": self.fingerprint,
            "block_size": self.block_size,
            "layers": [[lay.name, lay.base, lay.num_blocks, lay.block_stride, [list(r) for r in lay.runs]]
                       for lay in self.layers],
        }

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> KVLayout:
        try:
            layers = tuple(
                LayerLayout(str(n), int(b), int(nb), int(s), tuple((int(o), int(ln)) for o, ln in runs))
                for n, b, nb, s, runs in data["layers"]
            )
            return cls(layers, int(data["block_size"]), str(data["fingerprint"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"malformed remote KV layout: {exc}") from None

    def check_compatible(self, other: KVLayout) -> None:
        """Raises ConfigError when blocks cannot be copied between the two layouts."""
        if self.fingerprint != other.fingerprint:
            raise ConfigError(
                f"KV layouts differ (fingerprint {self.fingerprint} here, {other.fingerprint} at the peer): "
                "both engines must run the same model, dtype, block size and tensor-parallel shape"
            )

    def block_requests(
        self, op: TransferOp, peer: str, remote: KVLayout, local_blocks: Sequence[int], remote_blocks: Sequence[int]
    ) -> list[TransferRequest]:
        """Requests copying remote block i <-> local block i for every layer (READ pulls remote into local).

        Runs that follow each other on both sides (consecutive blocks, usually) become one
        request: a 2k-token prompt is a few requests per layer, not one per block.
        """
        if len(local_blocks) != len(remote_blocks):
            raise ConfigError(f"{len(local_blocks)} local blocks but {len(remote_blocks)} remote blocks")
        out: list[TransferRequest] = []
        ends = [-1, -1]  # where the last request ends, locally and remotely

        def add(laddr: int, length: int, raddr: int) -> None:
            if laddr == ends[0] and raddr == ends[1]:
                out[-1] = out[-1]._replace(length=out[-1].length + length)
            else:
                out.append(TransferRequest(op, laddr, length, peer, raddr))
            ends[0], ends[1] = laddr + length, raddr + length

        groups = _consecutive(local_blocks, remote_blocks)
        for mine, theirs in zip(self.layers, remote.layers):
            for lb, rb, count in groups:
                mine.check_blocks(lb, count)
                theirs.check_blocks(rb, count)
                if mine.dense and theirs.dense and mine.block_stride == theirs.block_stride:
                    # whole blocks back to back on both sides: the group is one run per layer
                    add(mine.base + lb * mine.block_stride, count * mine.block_stride, theirs.base + rb * theirs.block_stride)
                    continue
                for i in range(count):
                    for (laddr, length), (raddr, _) in zip(mine.spans(lb + i), theirs.spans(rb + i)):
                        add(laddr, length, raddr)
        return out

    @property
    def block_bytes(self) -> int:
        """The bytes of one block, all layers."""
        return sum(lay.block_bytes for lay in self.layers)

    def block_spans(self, block: int) -> list[tuple[int, int]]:
        """Every (address, length) run of one block, all layers in order."""
        return [span for lay in self.layers for span in lay.spans(block)]


def _consecutive(local_blocks: Sequence[int], remote_blocks: Sequence[int]) -> list[tuple[int, int, int]]:
    """(local start, remote start, count) of the runs where both block lists count up by one."""
    groups: list[tuple[int, int, int]] = []
    for lb, rb in zip(local_blocks, remote_blocks):
        if groups:
            l0, r0, n = groups[-1]
            if lb == l0 + n and rb == r0 + n:
                groups[-1] = (l0, r0, n + 1)
                continue
        groups.append((lb, rb, 1))
    return groups


def _layer_order(name: str) -> tuple[int, str]:
    digits = [int(part) for part in name.replace(".", " ").split() if part.isdigit()]
    return (digits[0] if digits else -1, name)
