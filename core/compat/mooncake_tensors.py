"""Mooncake's tensor calls on the drop-in (``TensorMethods``, a base class of
``MooncakeDistributedStore``): ``put_tensor`` / ``get_tensor`` and their pub, upsert, batch,
``_from``, ``_into``, tensor-parallel (``_with_tp``) and unified (``_with_parallelism``) forms,
and safetensors import/export, each translated to ``tidekv.Store``'s tensor calls.

Conventions as in ``mooncake_store``: 0 or Mooncake's negative code per put, the tensor or None
per get, failures logged. Shard keys are Mooncake's ``<key>_tp_<rank>``. A unified
``TensorParallelism`` names at most one axis that cuts the tensor (``split_dim`` set, TP or EP);
its other axes scope the key (``<key>_dp_0``, ``<key>_pp_<stage_id>``, ``<key>_ep_<expert_id>``).
As Mooncake: plain single-axis TP writes take the rank's shard, multi-axis and
``writer_partition`` writes the whole tensor (the rank's shard is cut from it). Unlike Mooncake,
uneven splits are stored (``torch.tensor_split``) and a 0-d tensor comes back 0-d.
"""

from __future__ import annotations

import ctypes
import json
import logging
import struct
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from tidekv.compat.mooncake_types import ParallelAxis, ReadTarget, ReplicateConfig, TensorParallelism, error_code
from tidekv.compat.mooncake_types import placement as _placement
from tidekv.errors import ConfigError, ObjectNotFoundError, TidekvError
from tidekv.store.client.tensors import read_object, to_object

if TYPE_CHECKING:
    import torch
    from tidekv.store.client.store import Store

logger = logging.getLogger(__name__)


def _buffer(ptr: int, size: int) -> torch.Tensor:
    """``size`` bytes at ``ptr`` as a uint8 tensor sharing that memory."""
    import torch

    if size <= 0:
        raise ConfigError(f"buffer of {size} bytes")
    return torch.frombuffer((ctypes.c_uint8 * size).from_address(ptr), dtype=torch.uint8)


def _object_at(ptr: int, size: int, key: str) -> torch.Tensor:
    """The tensor in a serialized tensor object of ``size`` bytes at ``ptr`` (a view of it)."""
    return read_object(_buffer(ptr, size), key)[1]


def _serialize_into(tensor: torch.Tensor, ptr: int, size: int, key: str) -> torch.Tensor:
    """Writes ``tensor`` as a tensor object into the buffer at ``ptr``; returns the view of it there."""
    header, dense = to_object(tensor.contiguous())
    n = dense.numel() * dense.element_size()
    if len(header) + n > size:
        raise ConfigError(f"buffer of {size} bytes is too small for tensor {key!r} ({len(header) + n} bytes)")
    buf = _buffer(ptr, len(header) + n)
    ctypes.memmove(ptr, header, len(header))
    if n:
        buf[len(header):].copy_(dense.reshape(-1).view(buf.dtype))
    return read_object(buf, key)[1]


def _layout_axis(axes: Sequence[ParallelAxis]) -> ParallelAxis | None:
    cutting = [a for a in axes if a.split_dim is not None]
    if len(cutting) > 1:
        raise ConfigError(f"{len(cutting)} axes cut the tensor ({[a.kind for a in cutting]}); tidekv stores shards "
                          "cut along one dimension")
    return cutting[0] if cutting else None


def _scoped(key: str, axes: Sequence[ParallelAxis], layout: ParallelAxis | None) -> str:
    """The key of the shard set an axis list names: ``key`` plus its non-cutting coordinates."""
    for a in axes:
        if a is layout:
            continue
        if a.kind not in ("tp", "dp", "ep", "pp"):
            raise ConfigError(f"ParallelAxis.kind={a.kind!r}: expected tp, dp, ep or pp")
        coordinate = a.expert_id if a.kind == "ep" and a.expert_id is not None else \
            a.stage_id if a.kind == "pp" and a.stage_id is not None else a.rank
        key += f"_{a.kind}_{coordinate}"
    return key


def _partition(writer_partition: Any) -> tuple[int, int, int]:
    """``writer_partition`` as (rank, size, split_dim): a 3-sequence, a dict or an object."""
    if isinstance(writer_partition, dict):
        values = [writer_partition.get(n) for n in ("rank", "size", "split_dim")]
    elif isinstance(writer_partition, (tuple, list)):
        values = list(writer_partition) if len(writer_partition) == 3 else [None]
    else:
        values = [getattr(writer_partition, n, None) for n in ("rank", "size", "split_dim")]
    if any(v is None for v in values):
        raise ConfigError(f"writer_partition {writer_partition!r} must provide rank, size and split_dim")
    rank, size, dim = (int(v) for v in values)
    return rank, size, dim


def write(store: Store, key: str, tensor: Any, parallelism: TensorParallelism | None, writer_partition: Any,
          upsert: bool, placement: dict[str, Any]) -> None:
    """One unified tensor write (see the module docstring for what each form stores)."""
    if parallelism is not None and writer_partition is not None:
        raise ConfigError("pass parallelism or writer_partition, not both")
    if writer_partition is not None:
        rank, size, dim = _partition(writer_partition)
        store.put_tensor_shards(key, tensor, size, dim, ranks=[rank], upsert=upsert, **placement)
        return
    axes = list(parallelism.axes) if parallelism is not None else []
    layout = _layout_axis(axes)
    base = _scoped(key, axes, layout)
    if layout is None:
        store.put_tensors([base], [tensor], upsert=upsert, **placement)
    elif len(axes) == 1:
        store.put_tensor_shard(base, tensor, layout.rank, layout.size, layout.split_dim, upsert=upsert, **placement)
    else:
        store.put_tensor_shards(base, tensor, layout.size, layout.split_dim, ranks=[layout.rank], upsert=upsert,
                                **placement)


def read(store: Store, key: str, target: ReadTarget | None) -> torch.Tensor | None:
    """One unified tensor read; None when what it needs is missing."""
    mode = "as_stored" if target is None else target.mode
    axes = list(target.parallelism.axes) if target is not None and target.parallelism is not None else []
    layout = _layout_axis(axes)
    base = _scoped(key, axes, layout)
    try:
        if mode == "as_stored":
            return store.get_tensors([key])[0]
        if mode == "shard":
            if target is None or target.parallelism is None:
                raise ConfigError("ReadTarget(mode='shard') needs its parallelism")
            if layout is None:
                return store.get_tensors([base])[0]
            return store.get_tensor_shard(base, layout.rank, layout.size, layout.split_dim)
        if mode == "full":
            whole = store.get_tensors([base])[0]
            return whole if whole is not None else store.get_tensor_full(base)
    except ObjectNotFoundError:
        return None
    raise ConfigError(f"ReadTarget.mode={mode!r}: expected as_stored, shard or full")


_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                       "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "U16": "uint16", "U32": "uint32",
                       "U64": "uint64", "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
                       "C64": "complex64"}
"""safetensors' dtype names -> torch's."""


def load_safetensors(path: str) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file (8-byte header length, JSON header, data), in file order."""
    import torch

    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = bytearray(f.read())
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype = _SAFETENSORS_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise ConfigError(f"{path}: tensor {name!r} has dtype {entry['dtype']}, which tidekv does not read")
        start, end = entry["data_offsets"]
        flat = torch.frombuffer(data, dtype=torch.uint8, offset=start, count=end - start) if end > start else \
            torch.empty(0, dtype=torch.uint8)
        out[name] = flat.view(getattr(torch, dtype)).reshape(entry["shape"]).clone()
    return out


def save_safetensors(path: str, tensors: dict[str, torch.Tensor]) -> None:
    """Writes tensors as a safetensors file."""
    names = {v: k for k, v in _SAFETENSORS_DTYPES.items()}
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in names:
            raise ConfigError(f"tensor {name!r} of {t.dtype} has no safetensors dtype")
        c = t.contiguous()
        raw = ctypes.string_at(c.data_ptr(), c.numel() * c.element_size()) if c.numel() else b""
        header[name] = {"dtype": names[dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)) + encoded)
        for raw in blobs:
            f.write(raw)


class TensorMethods:
    """Mooncake's tensor methods; mixed into ``MooncakeDistributedStore``, whose ``_call`` /
    ``_code`` (a tidekv call, or Mooncake's code for the error it raised) they use."""

    _call: Callable[[str, Callable[[Store], Any]], Any]
    _code: Callable[[str, Callable[[Store], Any]], int]
    _one: Callable[[str, Callable[[Store], Any]], Any]
    _per_key: Callable[[str, Sequence[str], Callable[[Store], Any]], list[int]]

    # ---- whole tensors ------------------------------------------------------------------

    def put_tensor(self, key: str, tensor: Any) -> int:
        return self.pub_tensor(key, tensor)

    def pub_tensor(self, key: str, tensor: Any, config: ReplicateConfig | None = None) -> int:
        """Stores a tensor with ``config``'s placement; a key that exists keeps its value."""
        return self.batch_pub_tensor([key], [tensor], config)[0]

    def upsert_tensor(self, key: str, tensor: Any) -> int:
        return self.upsert_pub_tensor(key, tensor)

    def upsert_pub_tensor(self, key: str, tensor: Any, config: ReplicateConfig | None = None) -> int:
        return self.batch_upsert_pub_tensor([key], [tensor], config)[0]

    def batch_put_tensor(self, keys: list[str], tensors_list: list[Any]) -> list[int]:
        return self.batch_pub_tensor(keys, tensors_list)

    def batch_upsert_tensor(self, keys: list[str], tensors_list: list[Any]) -> list[int]:
        return self.batch_upsert_pub_tensor(keys, tensors_list)

    def batch_pub_tensor(self, keys: list[str], tensors_list: list[Any],
                         config: ReplicateConfig | None = None) -> list[int]:
        """Per key 0 or a negative code; one put batch."""
        return self._per_key("batch_put_tensor", keys, lambda s: s.put_tensors(keys, tensors_list,
                                                                                **_placement(config)))

    def batch_upsert_pub_tensor(self, keys: list[str], tensors_list: list[Any],
                                config: ReplicateConfig | None = None) -> list[int]:
        return self._per_key("batch_upsert_tensor", keys, lambda s: s.put_tensors(keys, tensors_list, upsert=True,
                                                                                   **_placement(config)))

    def get_tensor(self, key: str) -> Any:
        """The tensor, or None (missing, not a tensor, or the read failed)."""
        return self.batch_get_tensor([key])[0]

    def batch_get_tensor(self, keys: list[str]) -> list[Any]:
        out = self._call("batch_get_tensor", lambda s: s.get_tensors(keys))
        return [None] * len(keys) if isinstance(out, int) else out

    def get_tensor_into(self, key: str, buffer_ptr: int, size: int) -> Any:
        """Reads the tensor object into registered memory; the tensor there, or None."""
        return self.batch_get_tensor_into([key], [buffer_ptr], [size])[0]

    def batch_get_tensor_into(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]) -> list[Any]:
        return [self._one(f"get_tensor_into({k!r})", lambda s, k=k, p=p, n=n: _read_raw(s, k, p, n))
                for k, p, n in _zip3(keys, buffer_ptrs, sizes)]

    def get_tensor_into_cuda(self, key: str, tensor: Any) -> int:
        """Reads a tensor's payload into ``tensor`` (a CUDA tensor where a GPU transport exists,
        host memory too); 0 or a negative code (-600 for a dtype or shape mismatch)."""
        return self.batch_get_tensor_into_cuda([key], [tensor])[0]

    def batch_get_tensor_into_cuda(self, keys: list[str], tensors_list: list[Any]) -> list[int]:
        def run(store: Store, key: str, tensor: Any) -> int:
            store.get_tensor_into(key, tensor)
            return 0
        return [self._code("get_tensor_into_cuda", lambda s, k=k, t=t: run(s, k, t))
                for k, t in zip(keys, tensors_list, strict=True)]

    def put_tensor_from(self, key: str, buffer_ptr: int, size: int) -> int:
        """Stores a serialized tensor object (what ``get_tensor_into`` leaves in a buffer) from
        registered memory as it is; -600 when the bytes are not one."""
        return self.batch_put_tensor_from([key], [buffer_ptr], [size])[0]

    def batch_put_tensor_from(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]) -> list[int]:
        return self._raw_puts("batch_put_tensor_from", keys, buffer_ptrs, sizes, upsert=False)

    def upsert_tensor_from(self, key: str, buffer_ptr: int, size: int) -> int:
        return self.batch_upsert_tensor_from([key], [buffer_ptr], [size])[0]

    def batch_upsert_tensor_from(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]) -> list[int]:
        return self._raw_puts("batch_upsert_tensor_from", keys, buffer_ptrs, sizes, upsert=True)

    # ---- tensor parallelism (Mooncake's compatibility wrappers) ---------------------------

    def put_tensor_with_tp(self, key: str, tensor: Any, tp_rank: int = 0, tp_size: int = 1,
                           split_dim: int = 0) -> int:
        """Splits a whole tensor into ``tp_size`` shards under ``<key>_tp_<rank>`` (every rank's:
        ``tp_rank`` is not used, as in Mooncake); ``tp_size`` 1 stores it whole under ``key``."""
        return self.pub_tensor_with_tp(key, tensor, None, tp_rank, tp_size, split_dim)

    def pub_tensor_with_tp(self, key: str, tensor: Any, config: ReplicateConfig | None = None, tp_rank: int = 0,
                           tp_size: int = 1, split_dim: int = 0) -> int:
        if tp_size == 1:
            return self.pub_tensor(key, tensor, config)
        return self._code("put_tensor_with_tp", lambda s: s.put_tensor_shards(key, tensor, tp_size, split_dim,
                                                                               **_placement(config)))

    def batch_put_tensor_with_tp(self, base_keys: list[str], tensors_list: list[Any], tp_rank: int = 0,
                                 tp_size: int = 1, split_dim: int = 0) -> list[int]:
        return self.batch_pub_tensor_with_tp(base_keys, tensors_list, None, tp_rank, tp_size, split_dim)

    def batch_pub_tensor_with_tp(self, base_keys: list[str], tensors_list: list[Any],
                                 config: ReplicateConfig | None = None, tp_rank: int = 0, tp_size: int = 1,
                                 split_dim: int = 0) -> list[int]:
        return [self.pub_tensor_with_tp(k, t, config, tp_rank, tp_size, split_dim)
                for k, t in zip(base_keys, tensors_list, strict=True)]

    def get_tensor_with_tp(self, key: str, tp_rank: int = 0, tp_size: int = 1, split_dim: int = 0) -> Any:
        """Rank ``tp_rank``'s shard (of ``tp_size``, along ``split_dim``), or None."""
        if tp_size == 1:
            return self.get_tensor(key)
        return self._one("get_tensor_with_tp", lambda s: s.get_tensor_shard(key, tp_rank, tp_size, split_dim))

    def batch_get_tensor_with_tp(self, base_keys: list[str], tp_rank: int = 0, tp_size: int = 1) -> list[Any]:
        return [self.get_tensor_with_tp(k, tp_rank, tp_size) for k in base_keys]

    def get_tensor_with_tp_into(self, key: str, buffer_ptr: int, size: int, tp_rank: int = 0, tp_size: int = 1,
                                split_dim: int = 0) -> Any:
        """As ``get_tensor_with_tp``, the shard's object read into registered memory."""
        if tp_size == 1:
            return self.get_tensor_into(key, buffer_ptr, size)
        target = ReadTarget()
        target.mode, target.parallelism = "shard", _tp(tp_rank, tp_size, split_dim)
        return self.get_tensor_with_parallelism_into(key, buffer_ptr, size, target)

    def batch_get_tensor_with_tp_into(self, base_keys: list[str], buffer_ptrs: list[int], sizes: list[int],
                                      tp_rank: int = 0, tp_size: int = 1) -> list[Any]:
        return [self.get_tensor_with_tp_into(k, p, n, tp_rank, tp_size) for k, p, n in _zip3(base_keys, buffer_ptrs,
                                                                                              sizes)]

    def put_tensor_with_tp_from(self, key: str, buffer_ptr: int, size: int, tp_rank: int = 0, tp_size: int = 1,
                                split_dim: int = 0) -> int:
        """``put_tensor_with_tp`` of the whole tensor serialized at ``buffer_ptr``."""
        return self._code("put_tensor_with_tp_from", lambda s: _tp_from(s, key, buffer_ptr, size, tp_size, split_dim))

    def batch_put_tensor_with_tp_from(self, base_keys: list[str], buffer_ptrs: list[int], sizes: list[int],
                                      tp_rank: int = 0, tp_size: int = 1, split_dim: int = 0) -> list[int]:
        return [self.put_tensor_with_tp_from(k, p, n, tp_rank, tp_size, split_dim)
                for k, p, n in _zip3(base_keys, buffer_ptrs, sizes)]

    # ---- unified parallel tensor I/O ----------------------------------------------------

    def put_tensor_with_parallelism(self, key: str, tensor: Any, parallelism: TensorParallelism | None = None,
                                    config: ReplicateConfig | None = None, writer_partition: Any = None) -> int:
        return self._code("put_tensor_with_parallelism", lambda s: write(s, key, tensor, parallelism,
                                                                          writer_partition, False, _placement(config)))

    def upsert_tensor_with_parallelism(self, key: str, tensor: Any, parallelism: TensorParallelism | None = None,
                                       config: ReplicateConfig | None = None, writer_partition: Any = None) -> int:
        return self._code("upsert_tensor_with_parallelism", lambda s: write(
            s, key, tensor, parallelism, writer_partition, True, _placement(config)))

    def batch_put_tensor_with_parallelism(self, keys: list[str], tensors_list: list[Any], parallelisms: Any = None,
                                          config: ReplicateConfig | None = None,
                                          writer_partitions: Any = None) -> list[int]:
        return [self.put_tensor_with_parallelism(k, t, p, config, w)
                for k, t, p, w in zip(keys, tensors_list, *_per_item(len(keys), parallelisms, writer_partitions))]

    def batch_upsert_tensor_with_parallelism(self, keys: list[str], tensors_list: list[Any], parallelisms: Any = None,
                                             config: ReplicateConfig | None = None,
                                             writer_partitions: Any = None) -> list[int]:
        return [self.upsert_tensor_with_parallelism(k, t, p, config, w)
                for k, t, p, w in zip(keys, tensors_list, *_per_item(len(keys), parallelisms, writer_partitions))]

    def put_tensor_with_parallelism_from(self, key: str, buffer_ptr: int, size: int, parallelism: Any = None,
                                         config: ReplicateConfig | None = None, writer_partition: Any = None) -> int:
        return self._code("put_tensor_with_parallelism_from", lambda s: write(
            s, key, _object_at(buffer_ptr, size, key), parallelism, writer_partition, False, _placement(config)))

    def upsert_tensor_with_parallelism_from(self, key: str, buffer_ptr: int, size: int, parallelism: Any = None,
                                            config: ReplicateConfig | None = None, writer_partition: Any = None) -> int:
        return self._code("upsert_tensor_with_parallelism_from", lambda s: write(
            s, key, _object_at(buffer_ptr, size, key), parallelism, writer_partition, True, _placement(config)))

    def batch_put_tensor_with_parallelism_from(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int],
                                               parallelisms: Any = None, config: ReplicateConfig | None = None,
                                               writer_partitions: Any = None) -> list[int]:
        return [self.put_tensor_with_parallelism_from(k, b, n, p, config, w) for (k, b, n), p, w in
                zip(_zip3(keys, buffer_ptrs, sizes), *_per_item(len(keys), parallelisms, writer_partitions))]

    def batch_upsert_tensor_with_parallelism_from(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int],
                                                  parallelisms: Any = None, config: ReplicateConfig | None = None,
                                                  writer_partitions: Any = None) -> list[int]:
        return [self.upsert_tensor_with_parallelism_from(k, b, n, p, config, w) for (k, b, n), p, w in
                zip(_zip3(keys, buffer_ptrs, sizes), *_per_item(len(keys), parallelisms, writer_partitions))]

    def get_tensor_with_parallelism(self, key: str, target: ReadTarget | None = None) -> Any:
        """What ``target`` asks for (the object under ``key``, a shard, or the whole), or None."""
        return self._one("get_tensor_with_parallelism", lambda s: read(s, key, target))

    def batch_get_tensor_with_parallelism(self, keys: list[str], targets: Any = None) -> list[Any]:
        return [self.get_tensor_with_parallelism(k, t) for k, t in zip(keys, *_per_item(len(keys), targets))]

    def get_tensor_with_parallelism_into(self, key: str, buffer_ptr: int, size: int,
                                         target: ReadTarget | None = None) -> Any:
        """As ``get_tensor_with_parallelism``, into registered memory: the stored object read
        there directly when it is the answer, else the answer serialized there."""
        def run(store: Store) -> Any:
            if target is None or target.mode == "as_stored":
                return _read_raw(store, key, buffer_ptr, size)
            got = read(store, key, target)
            return None if got is None else _serialize_into(got, buffer_ptr, size, key)
        return self._one("get_tensor_with_parallelism_into", run)

    def batch_get_tensor_with_parallelism_into(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int],
                                               targets: Any = None) -> list[Any]:
        return [self.get_tensor_with_parallelism_into(k, p, n, t)
                for (k, p, n), t in zip(_zip3(keys, buffer_ptrs, sizes), *_per_item(len(keys), targets))]

    # ---- safetensors --------------------------------------------------------------------

    def load_tensor_from_safetensor(self, key: str | None = None, file_name: str = "") -> Any:
        """Stores the tensor named ``key`` of a safetensors file under ``key`` (the file's name
        when None; the file's first tensor, with a warning, when it has no ``key``); returns it,
        or None."""
        def run(store: Store) -> Any:
            tensors = load_safetensors(file_name)
            name = file_name if key is None else key
            if name not in tensors:
                if not tensors:
                    raise ConfigError(f"{file_name} holds no tensor")
                logger.warning("mooncake store compat: %s has no tensor %r; storing its first, %r", file_name, name,
                               next(iter(tensors)))
            tensor = tensors.get(name, next(iter(tensors.values())))
            store.put_tensors([name], [tensor], upsert=True)
            return tensor
        return self._one("load_tensor_from_safetensor", run)

    def save_tensor_to_safetensor(self, key: str, file_name: str | None = None) -> int:
        """Writes the tensor under ``key`` to a safetensors file (named ``key`` when None)."""
        return self._code("save_tensor_to_safetensor", lambda s: save_safetensors(file_name or key,
                                                                                  {key: s.get_tensor(key)}))

    # ---- internals ----------------------------------------------------------------------

    def _raw_puts(self, op: str, keys: list[str], ptrs: list[int], sizes: list[int], upsert: bool) -> list[int]:
        triples = _zip3(keys, ptrs, sizes)
        checked: list[int] = []
        for key, ptr, size in triples:
            try:
                _object_at(ptr, size, key)
                checked.append(0)
            except TidekvError as exc:
                logger.error("mooncake store compat: %s(%r): %s", op, key, exc)
                checked.append(error_code(exc))
        good = [i for i, c in enumerate(checked) if c == 0]
        done = self._per_key(op, [keys[i] for i in good], lambda s: s.put_many_from(
            [keys[i] for i in good], [(ptrs[i], sizes[i]) for i in good], upsert=upsert)) if good else []
        for i, code in zip(good, done):
            checked[i] = code
        return checked


def _read_raw(store: Store, key: str, ptr: int, size: int) -> Any:
    """The tensor object under ``key`` read into the buffer at ``ptr``; the tensor there, or None."""
    n = store.get_many_into([key], [(ptr, size)])[0]
    return None if n is None else _object_at(ptr, n, key)


def _tp(rank: int, size: int, split_dim: int) -> TensorParallelism:
    axis = ParallelAxis()
    axis.kind, axis.rank, axis.size, axis.split_dim = "tp", rank, size, split_dim
    parallelism = TensorParallelism()
    parallelism.axes = [axis]
    return parallelism


def _tp_from(store: Store, key: str, ptr: int, size: int, tp_size: int, split_dim: int) -> None:
    tensor = _object_at(ptr, size, key)
    if tp_size == 1:
        store.put_tensors([key], [tensor])
    else:
        store.put_tensor_shards(key, tensor, tp_size, split_dim)


def _zip3(keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> list[tuple[str, int, int]]:
    if not len(keys) == len(ptrs) == len(sizes):
        raise TypeError(f"{len(keys)} keys, {len(ptrs)} buffer pointers and {len(sizes)} sizes differ in length")
    return list(zip(keys, ptrs, sizes))


def _per_item(n: int, *lists: Any) -> list[list[Any]]:
    """Each optional per-item list (None: None for every item), checked to hold ``n`` items."""
    out = []
    for values in lists:
        if values is None:
            out.append([None] * n)
        elif len(values) != n:
            raise TypeError(f"{len(values)} per-item values for {n} keys")
        else:
            out.append(list(values))
    return out

