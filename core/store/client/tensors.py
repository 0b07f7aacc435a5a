"""Tensors as store objects: ``Store.put_tensor`` / ``get_tensor``, their batch and ``_into``
forms, and tensor-parallel shards (``TensorCalls``, a base class of ``Store``).

A tensor is one object: a header (``TensorHeader``: format version, dtype by name, shape,
strides, and for a shard its place in the whole), padded to a multiple of 64 bytes, then the
tensor's bytes as they lie in memory. A write gathers [header, tensor memory] with no copy when
the tensor is dense (contiguous, or a permutation of contiguous such as a transpose: its strides
are kept); other views are made contiguous first. A read allocates a uint8 tensor per object,
reads all of them in one lookup and one transfer batch, and returns views of their data. Caller
memory is registered with the engine for the duration of the call unless it already is.

Shards use Mooncake's names, ``<key>_tp_<rank>``: ``put_tensor_shards`` splits a tensor along a
dimension (``torch.tensor_split``: piece sizes differ by at most one) and stores every piece;
``get_tensor_shard`` reads one rank's piece -- only that object when the stored split matches the
asked one, else the whole tensor rebuilt and split again; ``get_tensor_full`` rebuilds the whole.

torch is imported on first use, so ``import tidekv`` does not need it.
Neighbours: ``store`` (the Store these methods belong to), ``tidekv.compat.mooncake_store``
(Mooncake's tensor calls over these).
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tidekv.errors import ConfigError, ObjectNotFoundError, TensorFormatError, TensorMismatchError
from tidekv.store.wire.keys import Key, key_bytes, show_key
from tidekv.store.wire.protocol import Pin
from tidekv.transfer.memory import advise_huge

if TYPE_CHECKING:
    import torch
    from tidekv.store.client.store import Store
    from tidekv.store.client.tensor_channel import TensorChannel
    from tidekv.transfer.region import Region

MAGIC = b"TKVT"
VERSION = 1
_FIXED = struct.Struct("<4sBBHQ16siHHII")
"""magic, version, ndim, header bytes, data bytes, dtype name, split dim, rank, count, flags, reserved."""
_ALIGN = 64
_SHARD = 1  # flag: the object is one shard of a split tensor
_HUGE_READ_BYTES = 8 << 20
"""Reads of objects this large go into memory advised onto huge pages (see ``advise_huge``)."""
SHARD_SEPARATOR = "_tp_"
"""A shard's key is ``<key>_tp_<rank>``, as Mooncake names tensor-parallel shards."""


def header_size(ndim: int) -> int:
    """Bytes before a tensor's data: the fixed part and shape, strides and whole shape, rounded up
    to 64 so the data is aligned for every dtype."""
    return -(-(_FIXED.size + 24 * ndim) // _ALIGN) * _ALIGN


def shard_key(key: Key, rank: int) -> bytes:
    """The key of shard ``rank`` of the tensor under ``key``."""
    return key_bytes(key) + f"{SHARD_SEPARATOR}{rank}".encode()


@dataclass(frozen=True)
class TensorHeader:
    """What an object says of the tensor it holds."""

    dtype: str
    """torch's name of the dtype, e.g. "bfloat16"."""
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    """In elements, over the object's data (a dense layout: contiguous or permuted)."""
    split_dim: int = -1
    """For a shard: the dimension the whole was split along; -1 for a whole tensor."""
    rank: int = 0
    count: int = 1
    """For a shard: its rank and the number of shards."""
    whole_shape: tuple[int, ...] = ()
    """For a shard: the whole tensor's shape (-1 along ``split_dim`` when the writer held only its
    shard); else the shape."""

    @property
    def size(self) -> int:
        """The header's length in bytes (where the data starts)."""
        return header_size(len(self.shape))

    def data_bytes(self, element_size: int) -> int:
        return math.prod(self.shape) * element_size

    def encode(self, data_bytes: int) -> bytes:
        ndim = len(self.shape)
        fixed = _FIXED.pack(MAGIC, VERSION, ndim, self.size, data_bytes, self.dtype.encode(), self.split_dim,
                            self.rank, self.count, _SHARD if self.split_dim >= 0 else 0, 0)
        dims = struct.pack(f"<{3 * ndim}q", *self.shape, *self.strides, *(self.whole_shape or self.shape))
        return (fixed + dims).ljust(self.size, b"\0")

    @classmethod
    def decode(cls, raw: bytes | memoryview, object_size: int, key: Key) -> tuple[TensorHeader, int]:
        """The header at the start of an object of ``object_size`` bytes, and its data's length.

        Raises:
            TensorFormatError: not a tensor object, a newer format, or inconsistent.
        """
        def bad(why: str) -> TensorFormatError:
            return TensorFormatError(f"object {show_key(key)} is not a tensor this tidekv reads: {why}", key=key)

        if len(raw) < _FIXED.size:
            raise bad(f"{len(raw)} bytes are too few for a header")
        magic, version, ndim, size, data, dtype, split_dim, rank, count, flags, _ = _FIXED.unpack_from(raw)
        if magic != MAGIC:
            raise bad(f"it starts with {bytes(magic)!r}, not {MAGIC!r} (was it written by put_tensor?)")
        if version > VERSION:
            raise bad(f"format version {version}, this tidekv reads up to {VERSION}; upgrade it")
        if size != header_size(ndim) or size + data != object_size or len(raw) < size:
            raise bad(f"header of {size} bytes with {data} data bytes in an object of {object_size}")
        dims = struct.unpack_from(f"<{3 * ndim}q", raw, _FIXED.size)
        header = cls(dtype.rstrip(b"\0").decode("ascii", "replace"), dims[:ndim], dims[ndim:2 * ndim],
                     split_dim if flags & _SHARD else -1, rank, count, dims[2 * ndim:])
        return header, data


def torch_module() -> Any:
    """torch, imported now (the tensor calls' one import of it)."""
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - torch is a test dependency
        raise ConfigError("the tensor calls need torch: pip install torch") from exc
    return torch


_DTYPES: dict[str, torch.dtype] = {}
"""torch's dtypes by the names headers carry, as they are met."""


def _dtype(header: TensorHeader, key: Key) -> torch.dtype:
    dtype = _DTYPES.get(header.dtype)
    if dtype is not None:
        return dtype
    torch = torch_module()
    dtype = getattr(torch, header.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise TensorFormatError(f"object {show_key(key)} holds dtype {header.dtype!r}, which this torch "
                                f"({torch.__version__}) does not have", key=key)
    _DTYPES[header.dtype] = dtype
    return dtype


def _is_dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill ``numel * element_size`` bytes from its data pointer in some
    order of its dimensions (contiguous, transposed, permuted)."""
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _dense(t: Any) -> torch.Tensor:
    """``t`` itself when it is dense, else a contiguous copy.

    Raises:
        ConfigError: not a tensor, or a sparse or quantized one.
    """
    torch = torch_module()
    if not isinstance(t, torch.Tensor):
        raise ConfigError(f"expected a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided or t.is_quantized:
        raise ConfigError(f"tensors of layout {t.layout} (quantized: {t.is_quantized}) cannot be stored; "
                          "store a dense tensor")
    t = t.detach()
    return t if t.numel() > 0 and _is_dense(t) else t.contiguous()


def _header_of(t: torch.Tensor, split_dim: int = -1, rank: int = 0, count: int = 1,
               whole: tuple[int, ...] = ()) -> TensorHeader:
    return TensorHeader(str(t.dtype).removeprefix("torch."), tuple(t.shape), tuple(t.stride()), split_dim, rank,
                        count, whole)


def _view(buf: torch.Tensor, header: TensorHeader, key: Key) -> torch.Tensor:
    """The tensor in ``buf`` (a whole object read into uint8 memory)."""
    dtype = _dtype(header, key)
    element = dtype.itemsize
    n = header.data_bytes(element)
    if n == 0:
        return torch_module().empty(header.shape, dtype=dtype)
    if buf.numel() - header.size != n or any(s < 0 for s in header.strides) or \
            (sum((d - 1) * s for d, s in zip(header.shape, header.strides)) + 1) * element > n:
        raise TensorFormatError(f"object {show_key(key)}: shape {header.shape} and strides {header.strides} of "
                                f"{header.dtype} do not fit its {buf.numel() - header.size} data bytes", key=key)
    flat = buf[header.size:]
    if dtype != flat.dtype:
        flat = flat.view(dtype)
    if header.strides != _contiguous_strides(header.shape):
        return flat.as_strided(header.shape, header.strides)
    return flat if len(header.shape) == 1 else flat.view(header.shape)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides, in elements, of a contiguous tensor of ``shape``."""
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= max(d, 1)
    return tuple(reversed(strides))


class TensorCalls:
    """The tensor methods of ``Store`` (mixed in; they use its batch calls and engine)."""

    # ---- whole tensors ------------------------------------------------------------------

    def put_tensor(self: Store, key: Key, tensor: Any, *, pin: Pin = Pin.NONE, replicas: int | None = None,
                   preferred_segment: str | None = None) -> None:
        """Stores a torch tensor (any dtype, 0-d and up, CPU, or GPU memory where a GPU transport
        exists) with its dtype, shape and strides; a key that exists keeps its value.

        Raises:
            ConfigError: not a dense-able tensor; else as ``Store.put``.
        """
        self.put_tensors([key], [tensor], pin=pin, replicas=replicas, preferred_segment=preferred_segment)

    def put_tensors(self: Store, keys: Sequence[Key], tensors: Sequence[Any], *, upsert: bool = False,
                    pin: Pin = Pin.NONE, replicas: int | None = None, preferred_segment: str | None = None) -> None:
        """Batch ``put_tensor`` (``upsert=True`` replaces existing values): one put batch, the
        tensors' memory written in place. Failures as ``Store.put_many`` (``err.failed_keys``)."""
        if len(keys) != len(tensors):
            raise ConfigError(f"put_tensors got {len(keys)} keys but {len(tensors)} tensors")
        dense = [_dense(t) for t in tensors]
        _put_with_headers(self, list(keys), dense, [_header_of(t) for t in dense], upsert=upsert, pin=pin,
                          replicas=replicas, preferred_segment=preferred_segment)

    def get_tensor(self: Store, key: Key) -> torch.Tensor:
        """The tensor under ``key``, in new CPU memory.

        Raises:
            ObjectNotFoundError: no object under ``key``.
            TensorFormatError: the object is not a tensor; else as ``Store.get``.
        """
        out = self.get_tensors([key])[0]
        if out is None:
            raise ObjectNotFoundError(f"no tensor under key {show_key(key)}", key=key)
        return out

    def get_tensors(self: Store, keys: Sequence[Key]) -> list[torch.Tensor | None]:
        """Batch ``get_tensor``: None for keys without an object; one lookup, one transfer batch."""
        return [None if t is None else t[1] for t in read_whole(self, keys)]

    def get_tensor_into(self: Store, key: Key, tensor: Any) -> Any:
        """Reads the tensor under ``key`` into ``tensor`` (registered or not, CPU or GPU memory
        where a GPU transport exists) with no extra copy; returns ``tensor``.

        Raises:
            ObjectNotFoundError: no object under ``key``.
            TensorMismatchError: ``tensor``'s dtype, shape or strides differ from the stored ones.
        """
        out = self.get_tensors_into([key], [tensor])[0]
        if out is None:
            raise ObjectNotFoundError(f"no tensor under key {show_key(key)}", key=key)
        return out

    def get_tensors_into(self: Store, keys: Sequence[Key], tensors: Sequence[Any]) -> list[Any]:
        """Batch ``get_tensor_into``: per key its tensor, or None for keys without an object.

        Raises:
            TensorMismatchError: some objects' sizes differ from their tensors' (nothing was read,
                ``err.failed_keys`` names them) or, after the read, their dtype, shape or strides.
        """
        if len(keys) != len(tensors):
            raise ConfigError(f"get_tensors_into got {len(keys)} keys but {len(tensors)} tensors")
        for t in tensors:
            if _dense(t).data_ptr() != t.data_ptr() and t.numel() > 0:
                raise TensorMismatchError("get_tensor_into needs a dense tensor (contiguous or permuted) to "
                                          "read into; this one is a strided view")
        bkeys = [key_bytes(k) for k in keys]
        sizes = [header_size(t.dim()) for t in tensors]
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        pending: dict[bytes, list[int]] = {}
        for i, k in enumerate(bkeys):
            pending.setdefault(k, []).append(i)
        with self._staging.borrow(max(sum(sizes), 1)) as area, _registered(self, tensors):
            def allocate(key: bytes, size: int) -> list[tuple[int, int]]:
                i = pending[key].pop(0)
                t = tensors[i]
                n = t.numel() * t.element_size()
                if size != sizes[i] + n:
                    raise TensorMismatchError(f"object {show_key(key)} of {size} bytes cannot be a "
                                              f"{t.dtype} tensor of shape {tuple(t.shape)} ({sizes[i] + n} bytes)")
                parts = [(area.address + offsets[i], sizes[i])]
                return parts + [(t.data_ptr(), n)] if n else parts
            found = self.get_many_allocated(bkeys, allocate)
            view = area.view()
            out: list[Any] = []
            for i, (key, got) in enumerate(zip(bkeys, found)):
                if got is None:
                    out.append(None)
                    continue
                t = tensors[i]
                header, _ = TensorHeader.decode(view[offsets[i]:offsets[i] + sizes[i]], sum(n for _, n in got), key)
                if (header.dtype, header.shape) != (str(t.dtype).removeprefix("torch."), tuple(t.shape)) or \
                        not _same_layout(header.shape, header.strides, tuple(t.stride())):
                    raise TensorMismatchError(
                        f"object {show_key(key)} holds {header.dtype} {header.shape} strides {header.strides}; the "
                        f"tensor given is {t.dtype} {tuple(t.shape)} strides {tuple(t.stride())} (its bytes were "
                        "overwritten)")
                out.append(t)
        return out

    def tensor_channel(self: Store, name: str, **options: Any) -> TensorChannel:
        """A stream of tensors between producers and consumers on this pool (see
        ``tidekv.store.client.tensor_channel.TensorChannel`` for ``options``)."""
        from tidekv.store.client.tensor_channel import TensorChannel

        return TensorChannel(self, name, **options)

    # ---- shards -------------------------------------------------------------------------

    def put_tensor_shards(self: Store, key: Key, tensor: Any, shards: int, dim: int = 0, *,
                          ranks: Sequence[int] | None = None, upsert: bool = False, pin: Pin = Pin.NONE,
                          replicas: int | None = None, preferred_segment: str | None = None) -> None:
        """Splits a whole tensor along ``dim`` into ``shards`` pieces and stores them (all, or
        only ``ranks``) under ``<key>_tp_<rank>``, each knowing its place in the whole."""
        whole = _dense(tensor)
        dim = _check_split(whole, shards, dim)
        pieces = torch_module().tensor_split(whole, shards, dim)
        ranks = range(shards) if ranks is None else ranks
        dense = [_dense(pieces[_check_rank(r, shards)]) for r in ranks]
        headers = [_header_of(t, dim, r, shards, tuple(whole.shape)) for r, t in zip(ranks, dense)]
        _put_with_headers(self, [shard_key(key, r) for r in ranks], dense, headers, upsert=upsert, pin=pin,
                          replicas=replicas, preferred_segment=preferred_segment)

    def put_tensor_shard(self: Store, key: Key, shard: Any, rank: int, shards: int, dim: int = 0, *,
                         upsert: bool = False, pin: Pin = Pin.NONE, replicas: int | None = None,
                         preferred_segment: str | None = None) -> None:
        """Stores this rank's piece of a tensor split along ``dim`` into ``shards`` (the writer
        holds only its piece, as a tensor-parallel rank does) under ``<key>_tp_<rank>``."""
        piece = _dense(shard)
        dim = _check_split(piece, shards, dim)
        whole = tuple(-1 if d == dim else n for d, n in enumerate(piece.shape))
        header = _header_of(piece, dim, _check_rank(rank, shards), shards, whole)
        _put_with_headers(self, [shard_key(key, rank)], [piece], [header], upsert=upsert, pin=pin,
                          replicas=replicas, preferred_segment=preferred_segment)

    def get_tensor_shard(self: Store, key: Key, rank: int, shards: int, dim: int = 0) -> torch.Tensor:
        """Piece ``rank`` of the tensor under ``key`` split along ``dim`` into ``shards``: its own
        object when stored with that split, else cut from the whole (any stored split).

        Raises:
            ObjectNotFoundError: a shard the answer needs is missing.
            TensorFormatError: the shards disagree (dtype, dimension, count).
        """
        _check_rank(rank, shards)
        found = read_whole(self, [shard_key(key, rank)])[0]
        if found is not None:
            header, t = found
            if header.count == shards and header.split_dim == _norm_dim(dim, t.dim()) and header.rank == rank:
                return t
        whole = self.get_tensor_full(key)
        return torch_module().tensor_split(whole, shards, _check_split(whole, shards, dim))[rank]

    def get_tensor_full(self: Store, key: Key) -> torch.Tensor:
        """The whole tensor rebuilt from the shards under ``<key>_tp_<rank>`` (one batch after the
        first shard says how many there are).

        Raises:
            ObjectNotFoundError: a shard is missing (the message names it).
            TensorFormatError: the shards disagree.
        """
        first = read_whole(self, [shard_key(key, 0)])[0]
        if first is None:
            raise ObjectNotFoundError(f"no shard 0 of tensor {show_key(key)} (key {show_key(shard_key(key, 0))})",
                                      key=key)
        header, t0 = first
        rest = read_whole(self, [shard_key(key, r) for r in range(1, header.count)])
        pieces = [t0]
        for r, got in enumerate(rest, start=1):
            if got is None:
                raise ObjectNotFoundError(f"tensor {show_key(key)} has {header.count} shards but shard {r} is "
                                          "missing", key=shard_key(key, r))
            h, t = got
            if (h.dtype, h.count, h.split_dim, h.rank) != (header.dtype, header.count, header.split_dim, r):
                raise TensorFormatError(f"shard {r} of tensor {show_key(key)} ({h.dtype}, rank {h.rank} of {h.count} "
                                        f"along {h.split_dim}) disagrees with shard 0 ({header.dtype}, {header.count} "
                                        f"along {header.split_dim})", key=key)
            pieces.append(t)
        if header.split_dim < 0:
            raise TensorFormatError(f"{show_key(shard_key(key, 0))} is a whole tensor, not a shard", key=key)
        return torch_module().cat(pieces, header.split_dim)


def _same_layout(shape: tuple[int, ...], a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    """Whether two strides lay a tensor of ``shape`` out alike (size-1 dimensions' strides aside)."""
    return math.prod(shape) <= 1 or all(x == y for n, x, y in zip(shape, a, b) if n != 1)


def _norm_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def _check_split(t: torch.Tensor, shards: int, dim: int) -> int:
    if shards < 1 or shards > 0xFFFF:
        raise ConfigError(f"shards={shards}: expected 1 to 65535")
    if t.dim() == 0 or not -t.dim() <= dim < t.dim():
        raise ConfigError(f"dim={dim} is not a dimension of a tensor of shape {tuple(t.shape)}")
    return _norm_dim(dim, t.dim())


def _check_rank(rank: int, shards: int) -> int:
    if not 0 <= rank < shards:
        raise ConfigError(f"rank={rank} is not in [0, {shards})")
    return rank


@contextlib.contextmanager
def _registered(store: Store, tensors: Sequence[torch.Tensor]) -> Iterator[None]:
    """Registers each tensor's memory with the store's engine for the block, unless a registered
    region already holds it."""
    regions: list[Region] = []
    try:
        for t in tensors:
            n = t.numel() * t.element_size()
            if n and store.engine.region_of(t.data_ptr(), n) is None:
                regions.append(store.engine.register((t.data_ptr(), n), str(t.device)))
        yield
    finally:
        for region in regions:
            store.engine.unregister(region)


@contextlib.contextmanager
def tensor_spans(store: Store, tensors: Sequence[Any], headers: list[TensorHeader] | None = None
                 ) -> Iterator[list[list[tuple[int, int]]]]:
    """Each tensor as the span of its object, [header, its memory] (the headers in staging
    memory, the tensors registered), valid for the block: what a put writes. Without
    ``headers``, the tensors are made dense and described as they are; with them, the tensors
    are dense already."""
    if headers is None:
        tensors = [_dense(t) for t in tensors]
        headers = [_header_of(t) for t in tensors]
    encoded = [h.encode(t.numel() * t.element_size()) for h, t in zip(headers, tensors)]
    with store._staging.borrow(max(sum(map(len, encoded)), 1)) as area, _registered(store, tensors):
        view, offset, spans = area.view(), 0, []
        for raw, t in zip(encoded, tensors):
            view[offset:offset + len(raw)] = raw
            n = t.numel() * t.element_size()
            spans.append([(area.address + offset, len(raw))] + ([(t.data_ptr(), n)] if n else []))
            offset += len(raw)
        yield spans


def _put_with_headers(store: Store, keys: list[Key], tensors: list[torch.Tensor], headers: list[TensorHeader],
                      **put: Any) -> None:
    """Puts each tensor as [header, its memory]."""
    with tensor_spans(store, tensors, headers) as spans:
        store.put_many_from(keys, spans, **put)


def read_whole(store: Store, keys: Sequence[Key]) -> list[tuple[TensorHeader, torch.Tensor] | None]:
    """Reads whole tensor objects into new uint8 tensors (registered for the read); per key
    (header, the tensor viewing its data) or None."""
    torch = torch_module()
    regions: list[Region] = []

    def allocate(key: bytes, size: int) -> torch.Tensor:
        buf = torch.empty(size, dtype=torch.uint8)
        if size >= _HUGE_READ_BYTES:
            advise_huge(buf.data_ptr(), size)
        regions.append(store.engine.register(buf))
        return buf

    try:
        found = store.get_many_allocated(keys, allocate)
    finally:
        for region in regions:
            store.engine.unregister(region)
    out: list[tuple[TensorHeader, torch.Tensor] | None] = []
    for key, buf in zip(keys, found):
        if buf is None:
            out.append(None)
            continue
        out.append(read_object(buf, key))
    return out


def read_object(buf: torch.Tensor, key: Key,
                raw: bytes | memoryview | None = None) -> tuple[TensorHeader, torch.Tensor]:
    """The header of the tensor object in uint8 memory ``buf`` (exactly the object) and the
    tensor, a view of ``buf``. ``raw``: the same memory as a buffer, where the caller has one
    (read from it, not copied).

    Raises:
        TensorFormatError: ``buf`` does not hold a tensor object.
    """
    if raw is None:
        raw = ctypes.string_at(buf.data_ptr(), min(buf.numel(), header_size(255)))
    header, _ = TensorHeader.decode(raw, buf.numel(), key)
    return header, _view(buf, header, key)


def to_object(tensor: Any) -> tuple[bytes, torch.Tensor]:
    """A tensor as an object's two parts: its header and the dense tensor whose memory follows."""
    dense = _dense(tensor)
    return _header_of(dense).encode(dense.numel() * dense.element_size()), dense
