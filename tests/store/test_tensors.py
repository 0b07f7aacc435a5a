"""Tensors through the store: every CPU dtype, 0-d to 5-d, non-contiguous inputs, ``_into`` with
its mismatch errors, and tensor-parallel shards written whole or per rank and read back under
the same or another split. The pool's memory is another process's (a holder); this process is a
pure client, so every byte crosses the transfer engine.
"""

from __future__ import annotations

import warnings

import pytest
from tidekv.errors import (
    ConfigError,
    ObjectNotFoundError,
    TensorFormatError,
    TensorMismatchError,
)
from tidekv.store import Store
from tidekv.store.client.tensors import TensorHeader, header_size, shard_key

from tests.store.conftest import Connect, SpawnAgent
from tests.store.procs import MasterProcess

torch = pytest.importorskip("torch", reason="the tensor calls need torch (a test dependency)")

SEGMENT = 64 << 20


@pytest.fixture
def store(master: MasterProcess, spawn_agent: SpawnAgent, connect: Connect) -> Store:
    spawn_agent(master.address, SEGMENT)
    return connect(master.address)


def _dtypes() -> list[torch.dtype]:
    """Every dtype torch makes dense CPU tensors of (quantized and sub-byte ones excluded)."""
    found = {v for v in vars(torch).values() if isinstance(v, torch.dtype)}
    warnings.filterwarnings("ignore", "ComplexHalf support is experimental")
    out = []
    for dtype in sorted(found, key=str):
        try:
            if torch.empty(4, dtype=dtype).is_quantized:
                continue
            torch.empty(4, dtype=dtype).view(torch.uint8)
        except (RuntimeError, TypeError, NotImplementedError):
            continue
        out.append(dtype)
    return out


def _random(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A tensor whose bytes are random (NaN patterns and all): compared bytewise."""
    t = torch.empty(shape, dtype=dtype)
    if t.numel():
        g = torch.Generator().manual_seed(seed)
        flat = t.view(-1).view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)
        flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=g))
    return t


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def test_every_dtype_round_trips_byte_exact(store: Store) -> None:
    dtypes = _dtypes()
    assert {torch.bfloat16, torch.float8_e4m3fn, torch.bool, torch.complex64, torch.uint16} <= set(dtypes)
    tensors = [_random((3, 5), d, i) for i, d in enumerate(dtypes)]
    keys = [f"dtype-{d}" for d in dtypes]
    store.put_tensors(keys, tensors)
    for key, t, got in zip(keys, tensors, store.get_tensors(keys)):
        assert got.dtype == t.dtype and got.shape == t.shape, key
        assert _bytes(got) == _bytes(t), f"{key}: bytes differ"


@pytest.mark.parametrize("shape", [(), (0,), (7,), (2, 3), (2, 0, 3), (2, 3, 4), (1, 2, 3, 4), (2, 1, 3, 1, 5)])
def test_shapes_from_0d_to_5d(store: Store, shape: tuple[int, ...]) -> None:
    t = _random(shape, torch.float32, len(shape))
    store.put_tensor("shape", t)
    got = store.get_tensor("shape")
    assert got.shape == t.shape and got.dim() == len(shape)
    assert _bytes(got) == _bytes(t)


def test_non_contiguous_inputs_keep_values_and_dense_layouts_keep_strides(store: Store) -> None:
    base = _random((6, 8, 4), torch.bfloat16, 3)
    cases = {"transposed": base.transpose(0, 2), "permuted": base.permute(1, 2, 0), "sliced": base[:, 1:7:2, ::3],
             "expanded": torch.arange(4.0).expand(3, 4)}
    store.put_tensors(list(cases), list(cases.values()))
    for (name, t), got in zip(cases.items(), store.get_tensors(list(cases))):
        assert got.shape == t.shape and _bytes(got) == _bytes(t), name
    assert store.get_tensor("transposed").stride() == cases["transposed"].stride()  # dense: stored in place
    assert store.get_tensor("sliced").is_contiguous()  # not dense: made contiguous


def test_batch_get_gives_none_for_missing_keys_and_put_keeps_existing_values(store: Store) -> None:
    store.put_tensor("kept", torch.ones(3))
    store.put_tensor("kept", torch.zeros(5))
    got = store.get_tensors(["kept", "absent"])
    assert torch.equal(got[0], torch.ones(3)) and got[1] is None
    store.put_tensors(["kept"], [torch.zeros(5)], upsert=True)
    assert torch.equal(store.get_tensor("kept"), torch.zeros(5))
    with pytest.raises(ObjectNotFoundError):
        store.get_tensor("absent")


def test_get_tensor_into_fills_the_callers_tensor_registered_or_not(store: Store) -> None:
    src = _random((64, 128), torch.float16, 5)
    store.put_tensor("into", src)
    plain = torch.empty(64, 128, dtype=torch.float16)
    assert store.get_tensor_into("into", plain) is plain and _bytes(plain) == _bytes(src)
    registered = torch.zeros(2, 64, 128, dtype=torch.float16)
    region = store.register(registered)
    try:
        out = store.get_tensors_into(["into", "absent"], [registered[1], registered[0]])
        assert out[1] is None and _bytes(registered[1]) == _bytes(src) and not registered[0].any()
        store.put_tensor("from-registered", registered[1])  # caller memory inside a registered region
        assert _bytes(store.get_tensor("from-registered")) == _bytes(src)
    finally:
        store.unregister(region)


def test_get_tensor_into_refuses_a_mismatch_by_name(store: Store) -> None:
    store.put_tensor("m", torch.arange(12, dtype=torch.int32).reshape(3, 4))
    wrong_shape = torch.full((4, 4), 7, dtype=torch.int32)
    with pytest.raises(TensorMismatchError, match="cannot be a torch.int32 tensor of shape") as err:
        store.get_tensor_into("m", wrong_shape)
    assert err.value.failed_keys and torch.equal(wrong_shape, torch.full((4, 4), 7, dtype=torch.int32))  # untouched
    with pytest.raises(TensorMismatchError, match="holds int32 .*torch.float32"):
        store.get_tensor_into("m", torch.empty(3, 4, dtype=torch.float32))  # same size, other dtype
    with pytest.raises(TensorMismatchError, match="strides"):
        store.get_tensor_into("m", torch.empty(4, 3, dtype=torch.int32).t())  # same shape, other layout
    with pytest.raises(TensorMismatchError, match="dense"):
        store.get_tensor_into("m", torch.empty(3, 8, dtype=torch.int32)[:, ::2])


def test_an_object_that_is_not_a_tensor_is_refused(store: Store) -> None:
    store.put("bytes", b"x" * 100)
    with pytest.raises(TensorFormatError, match="not b'TKVT'"):
        store.get_tensor("bytes")
    header = TensorHeader("float32", (2,), (1,))
    newer = bytearray(header.encode(8) + b"\0" * 8)
    newer[4] = 9  # a format version from the future
    store.put("newer", bytes(newer))
    with pytest.raises(TensorFormatError, match="version 9"):
        store.get_tensor("newer")
    assert header_size(0) == 64 and header_size(8) == 256


def test_shards_written_whole_are_read_per_rank_and_rebuilt(store: Store) -> None:
    whole = _random((5, 7), torch.bfloat16, 9)
    store.put_tensor_shards("w", whole, shards=3, dim=1)  # 7 columns: 3, 2, 2
    assert store.exists_many([shard_key("w", r) for r in range(4)]) == [True, True, True, False]
    pieces = torch.tensor_split(whole, 3, 1)
    for rank in range(3):
        assert _bytes(store.get_tensor_shard("w", rank, 3, dim=1)) == _bytes(pieces[rank])
    assert _bytes(store.get_tensor_full("w")) == _bytes(whole)
    for rank, piece in enumerate(torch.tensor_split(whole, 2, 1)):  # another split: cut from the whole
        got = store.get_tensor_shard("w", rank, 2, dim=-1)
        assert got.shape == piece.shape and _bytes(got) == _bytes(piece)


def test_shards_written_per_rank_are_rebuilt(store: Store) -> None:
    whole = torch.arange(24.0).reshape(4, 6)
    for rank, piece in enumerate(torch.tensor_split(whole, 2, 0)):
        store.put_tensor_shard("r", piece, rank, 2, dim=0)
    assert torch.equal(store.get_tensor_full("r"), whole)
    assert torch.equal(store.get_tensor_shard("r", 1, 2), whole[2:])
    store.put_tensor_shards("gap", whole, shards=3, dim=0, ranks=[0, 2])
    with pytest.raises(ObjectNotFoundError, match="shard 1 is missing"):
        store.get_tensor_full("gap")
    with pytest.raises(ObjectNotFoundError, match="no shard 0"):
        store.get_tensor_full("absent")
    with pytest.raises(ConfigError, match="rank=2"):
        store.put_tensor_shard("r", whole, 2, 2)
    with pytest.raises(ConfigError, match="dim=2"):
        store.put_tensor_shards("r", whole, 2, dim=2)

