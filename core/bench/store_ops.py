"""Timed store operations of ``bench store``: what one row measures, the same way for every store.

A ``StoreOp`` is one row's operation (put, get, put_many_from, get_many_into, exists,
exists_many, put_tensor, get_tensor) on objects of ``size_bytes``, ``keys`` per call. ``time_op`` times it on any
``KVClient`` (tidekv's ``Store``, Mooncake's ``MooncakeDistributedStore``, each behind a thin
adapter) with the same keys, sizes, setup and cleanup, so their numbers compare:

- put rows write fresh keys (a put of an existing key is a no-op in both stores) and remove them,
  untimed, whenever ``POOL_CHUNK_BYTES`` have been written, so the pool never fills or evicts;
- get and exists rows first put their objects (untimed), then read or check them round-robin;
- every call's answer is checked (a missing object or a failed put raises), so a fast error is
  never reported as a fast operation.

Neighbours: ``timing`` (``measure``, ``Budget``) repeats the calls; ``store`` and
``mooncake_store`` run ``time_op`` inside their client processes.
"""

from __future__ import annotations

import enum
import itertools
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from tidekv.bench.timing import Budget, measure
from tidekv.errors import ConfigError, TidekvError

logger = logging.getLogger(__name__)

POOL_CHUNK_BYTES = 64 << 20
"""Put rows remove their keys (untimed) after writing this many bytes; get rows put at most this much."""
GET_OBJECTS = 64
"""Objects a single-key get row reads round-robin (fewer when they would pass POOL_CHUNK_BYTES)."""
EXISTS_OBJECTS = 1000
"""Objects a single-key exists row checks round-robin."""
_REMOVE_BATCH = 1000

Span = tuple[int, int]


class OpKind(enum.Enum):
    """The operation of a row."""

    PUT = "put"  #: bytes API, one key per call
    GET = "get"  #: bytes API, one key per call
    PUT_MANY_FROM = "put_many_from"  #: zero-copy batch from registered memory
    GET_MANY_INTO = "get_many_into"  #: zero-copy batch into registered memory
    EXISTS = "exists"  #: one key per call
    EXISTS_MANY = "exists_many"  #: a batch of keys per call
    PUT_TENSOR = "put_tensor"  #: a float32 CPU tensor, one key per call
    GET_TENSOR = "get_tensor"  #: into a new CPU tensor, one key per call


SINGLE_KEY = (OpKind.PUT, OpKind.GET, OpKind.EXISTS, OpKind.PUT_TENSOR, OpKind.GET_TENSOR)
TENSOR_OPS = (OpKind.PUT_TENSOR, OpKind.GET_TENSOR)


@dataclass(frozen=True, slots=True)
class StoreOp:
    """One row's operation: ``kind`` on objects of ``size_bytes``, ``keys`` per call."""

    kind: OpKind
    size_bytes: int
    """Bytes of each object (exists rows check objects of this size)."""
    keys: int = 1
    """Keys per call: 1 for single-key ops, the batch size otherwise."""

    def __post_init__(self) -> None:
        if self.size_bytes <= 0:
            raise ConfigError(f"size_bytes={self.size_bytes} must be > 0")
        if self.keys < 1:
            raise ConfigError(f"keys={self.keys} must be >= 1")
        if self.kind in SINGLE_KEY and self.keys != 1:
            raise ConfigError(f"{self.kind.value} takes one key per call, not {self.keys}")
        if self.kind in TENSOR_OPS and self.size_bytes % 4:
            raise ConfigError(f"{self.kind.value} moves float32 tensors: size {self.size_bytes} is not a multiple of 4")

    @property
    def bytes_per_call(self) -> int:
        """Payload bytes one call moves (0 for exists checks)."""
        if self.kind in (OpKind.EXISTS, OpKind.EXISTS_MANY):
            return 0
        return self.size_bytes * self.keys

    @property
    def buffer_bytes(self) -> int:
        """Registered client memory the op needs: one call's spans, side by side (none for the
        tensor rows, which pass tensors)."""
        return 0 if self.kind in TENSOR_OPS else self.size_bytes * self.keys


class KVClient(Protocol):
    """What ``time_op`` needs from a store client; every method raises when the store reports failure.

    ``buffer_address``/``buffer_bytes`` describe registered memory of the client that spans of the
    zero-copy calls point into. Single-threaded: one call at a time.
    """

    buffer_address: int
    buffer_bytes: int

    def put(self, key: str, value: bytes) -> None: ...

    def get(self, key: str) -> int:
        """Returns the object's size."""
        ...

    def put_many_from(self, keys: Sequence[str], spans: Sequence[Span]) -> None: ...

    def get_many_into(self, keys: Sequence[str], spans: Sequence[Span]) -> None: ...

    def exists(self, key: str) -> bool: ...

    def exists_many(self, keys: Sequence[str]) -> list[bool]: ...

    def remove_many(self, keys: Sequence[str]) -> None:
        """Removes the keys even if a reader's lease is still on them."""
        ...

    def put_tensor(self, key: str, tensor: Any) -> None: ...

    def get_tensor(self, key: str) -> int:
        """Returns the tensor's size in bytes."""
        ...


class KeyMaker:
    """Fresh keys, unique across calls and processes: ``bench/<tag>/<pid>/<n>``."""

    def __init__(self, tag: str) -> None:
        self._prefix = f"bench/{tag}/{os.getpid()}/"
        self._counter = itertools.count()

    def __call__(self) -> str:
        return f"{self._prefix}{next(self._counter):012d}"

    def many(self, n: int) -> list[str]:
        return [self() for _ in range(n)]


def time_op(client: KVClient, op: StoreOp, budget: Budget, keys: KeyMaker) -> list[float]:
    """Times ``op`` on ``client`` under ``budget``; returns each timed call's latency (seconds).

    Setup (putting what gets and exists read) and cleanup (removing what was put) are untimed;
    the client's store holds none of this call's objects afterwards.

    Raises:
        ConfigError: the client's registered buffer is smaller than the op needs.
        TidekvError (or the client's own errors): a call failed or answered wrongly.
    """
    if op.buffer_bytes > client.buffer_bytes:
        raise ConfigError(f"{op.kind.value} of {op.keys} x {op.size_bytes} bytes needs {op.buffer_bytes} bytes of "
                          f"registered buffer; the client has {client.buffer_bytes}")
    base = client.buffer_address
    spans = [(base + i * op.size_bytes, op.size_bytes) for i in range(op.keys)]
    if op.kind == OpKind.PUT:
        value = bytes(range(256)) * (op.size_bytes // 256) + bytes(op.size_bytes % 256)
        return _time_fresh(client, lambda: [keys()], lambda ks: client.put(ks[0], value), op, budget)
    if op.kind == OpKind.PUT_TENSOR:
        tensor = _tensor(op.size_bytes)
        return _time_fresh(client, lambda: [keys()], lambda ks: client.put_tensor(ks[0], tensor), op, budget)
    if op.kind == OpKind.GET_TENSOR:
        stored = keys.many(max(1, min(GET_OBJECTS, POOL_CHUNK_BYTES // op.size_bytes)))
        tensor = _tensor(op.size_bytes)
        for key in stored:
            client.put_tensor(key, tensor)
        try:
            return measure(_reader(client, op, stored, []), budget)
        finally:
            _remove(client, stored)
    if op.kind == OpKind.PUT_MANY_FROM:
        return _time_fresh(client, lambda: keys.many(op.keys), lambda ks: client.put_many_from(ks, spans), op, budget)
    count = {OpKind.GET: max(1, min(GET_OBJECTS, POOL_CHUNK_BYTES // op.size_bytes)),
             OpKind.GET_MANY_INTO: op.keys, OpKind.EXISTS: EXISTS_OBJECTS, OpKind.EXISTS_MANY: op.keys}[op.kind]
    stored = keys.many(count)
    slots = client.buffer_bytes // op.size_bytes  # the objects' bytes do not matter, only where they come from
    object_spans = [(base + (i % slots) * op.size_bytes, op.size_bytes) for i in range(count)]
    for lo in range(0, count, _REMOVE_BATCH):
        client.put_many_from(stored[lo:lo + _REMOVE_BATCH], object_spans[lo:lo + _REMOVE_BATCH])
    try:
        return measure(_reader(client, op, stored, spans), budget)
    finally:
        _remove(client, stored)


def _reader(client: KVClient, op: StoreOp, stored: list[str], spans: list[Span]) -> Callable[[], None]:
    """The timed call of a row that reads objects already stored."""
    cycle = itertools.cycle(stored)
    size = op.size_bytes
    if op.kind == OpKind.GET:
        def step() -> None:
            key = next(cycle)
            got = client.get(key)
            if got != size:
                raise TidekvError(f"get of {key!r} returned {got} bytes, expected {size}")
    elif op.kind == OpKind.GET_TENSOR:
        def step() -> None:
            key = next(cycle)
            got = client.get_tensor(key)
            if got != size:
                raise TidekvError(f"get_tensor of {key!r} returned {got} bytes, expected {size}")
    elif op.kind == OpKind.GET_MANY_INTO:
        def step() -> None:
            client.get_many_into(stored, spans)
    elif op.kind == OpKind.EXISTS:
        def step() -> None:
            key = next(cycle)
            if not client.exists(key):
                raise TidekvError(f"exists({key!r}) is False for an object that was put")
    else:
        def step() -> None:
            found = client.exists_many(stored)
            if not all(found):
                raise TidekvError(f"exists_many found {sum(found)} of {len(stored)} objects that were put")
    return step


def _time_fresh(client: KVClient, new_keys: Callable[[], list[str]], put: Callable[[list[str]], None],
                op: StoreOp, budget: Budget) -> list[float]:
    """Times puts of fresh keys, removing them (untimed) every POOL_CHUNK_BYTES."""
    chunk = max(1, POOL_CHUNK_BYTES // op.bytes_per_call)
    written: list[str] = []

    def step() -> None:
        ks = new_keys()
        put(ks)
        written.extend(ks)

    def flush() -> None:
        _remove(client, written)
        written.clear()

    try:
        warmup_end = time.perf_counter() + budget.warmup_time_s
        for _ in range(budget.warmup_iterations):
            step()
            if len(written) >= chunk * op.keys:
                flush()
            if time.perf_counter() >= warmup_end:
                break
        flush()
        samples: list[float] = []
        total = 0.0
        while len(samples) < budget.max_iterations:
            room = min(chunk, budget.max_iterations - len(samples))
            part = Budget(min_time_s=max(0.0, budget.min_time_s - total),
                          min_iterations=max(1, min(room, budget.min_iterations - len(samples))),
                          max_iterations=room, warmup_iterations=0)
            got = measure(step, part)
            flush()
            samples += got
            total += sum(got)
            if total >= budget.min_time_s and len(samples) >= budget.min_iterations:
                break
        return samples
    finally:
        flush()


def torch_available() -> bool:
    """Whether the tensor rows can run (they need torch)."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def _tensor(size_bytes: int) -> Any:
    """A float32 CPU tensor of ``size_bytes`` (rounded down to whole elements), its pages touched.

    Raises:
        ConfigError: torch is not installed.
    """
    if not torch_available():
        raise ConfigError("the put_tensor/get_tensor rows need torch: pip install torch")
    import torch

    return torch.full((max(1, size_bytes // 4),), 1.5, dtype=torch.float32)


def _remove(client: KVClient, keys: Sequence[str]) -> None:
    for lo in range(0, len(keys), _REMOVE_BATCH):
        client.remove_many(keys[lo:lo + _REMOVE_BATCH])
