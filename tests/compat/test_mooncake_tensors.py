"""Mooncake's tensor calls on the drop-in, and the same test bodies against Mooncake's own wheel.

Each side-by-side test runs twice: on tidekv's drop-in (``MooncakeApi.SHIM``: its
``MooncakeDistributedStore`` over a tidekv master behind Mooncake's flags) and on Mooncake's wheel
(``MooncakeApi.MOONCAKE``: its store and ``mooncake_master``), so a semantic difference shows as
a test that passes on one and not the other. Where the two differ on purpose (0-d tensors,
uneven splits, dtypes Mooncake refuses), the test says so and checks each side's behaviour.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from tidekv.bench.mooncake_store import MooncakeApi, MooncakeMaster, _setup
from tidekv.compat import mooncake_types
from tidekv.compat.mooncake_store import MooncakeDistributedStore
from tidekv.errors import ConfigError

torch = pytest.importorskip("torch", reason="the tensor calls need torch (a test dependency)")

SHIM, MOONCAKE = MooncakeApi.SHIM, MooncakeApi.MOONCAKE
INVALID = -600
SHIM_STORE_MODULE = Path(__file__).parents[2] / "plugins" / "mooncake" / "mooncake" / "store.py"


def _real_store_module() -> object:
    """Mooncake's wheel's ``mooncake.store`` (skips, naming what is missing, when it cannot load)."""
    from tidekv.bench import mooncake_store

    try:
        mooncake_store.check_available()
    except ConfigError as exc:
        pytest.skip(f"Mooncake's wheel is not usable here: {exc}")
    import mooncake.store

    return mooncake.store


@pytest.fixture(params=[SHIM, MOONCAKE], ids=["tidekv", "mooncake"])
def api(request: pytest.FixtureRequest) -> MooncakeApi:
    if request.param == MOONCAKE:
        _real_store_module()
    return request.param


@contextlib.contextmanager
def _opened(api: MooncakeApi, tmp_path: Path, segment: int) -> Iterator[object]:
    """A master of ``api`` and a store set up on it with a segment (and local buffer) of ``segment`` bytes."""
    master = MooncakeMaster(tmp_path, api)
    try:
        s = _setup(api, master.address, segment, segment)
        try:
            yield s
        finally:
            s.close()
    finally:
        master.stop()


@pytest.fixture
def store(api: MooncakeApi, tmp_path: Path) -> Iterator[object]:
    with _opened(api, tmp_path, 128 << 20) as s:
        yield s


def _types(api: MooncakeApi) -> object:
    return mooncake_types if api == SHIM else _real_store_module()


def _axis(api: MooncakeApi, kind: str, rank: int, size: int, split_dim: int | None = None) -> object:
    axis = _types(api).ParallelAxis()
    axis.kind, axis.rank, axis.size = kind, rank, size
    if split_dim is not None:
        axis.split_dim = split_dim
    return axis


def _parallelism(api: MooncakeApi, *axes: object) -> object:
    p = _types(api).TensorParallelism()
    p.axes = list(axes)
    return p


def _target(api: MooncakeApi, mode: str, parallelism: object = None) -> object:
    t = _types(api).ReadTarget()
    t.mode = mode
    if parallelism is not None:
        t.parallelism = parallelism
    return t


# ---- the API surface ----------------------------------------------------------------------

def test_the_drop_in_has_every_public_method_of_mooncakes_store() -> None:
    real = _real_store_module()
    theirs = {n for n in dir(real.MooncakeDistributedStore) if not n.startswith("_")}
    ours = {n for n in dir(MooncakeDistributedStore) if not n.startswith("_")}
    assert not theirs - ours, f"missing on the drop-in: {sorted(theirs - ours)}"


def test_the_shim_module_exports_the_names_callers_import() -> None:
    needed = {"MooncakeDistributedStore", "ReplicateConfig", "SoftPinAction", "ParallelAxis", "TensorParallelism",
              "ReadTarget", "MooncakeHostMemAllocator", "bind_to_numa_node", "QueryTaskResponse", "TaskStatus",
              "TaskType", "ReplicaStatus"}
    assert needed <= {n for n in dir(_real_store_module()) if not n.startswith("_")}  # they are Mooncake's names
    spec = importlib.util.spec_from_file_location("shim_store", SHIM_STORE_MODULE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert needed <= set(dir(module))
    config = module.ReplicateConfig()
    assert {n for n in dir(_real_store_module().ReplicateConfig()) if not n.startswith("_")} <= set(dir(config))


# ---- side by side -------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "int64", "uint8", "bool", "float8_e4m3fn"])
def test_put_and_get_tensor_round_trip(store: object, dtype: str) -> None:
    t = (torch.arange(60) % 7).reshape(3, 4, 5).to(getattr(torch, dtype))
    assert store.put_tensor("t", t) == 0
    got = store.get_tensor("t")
    assert got.dtype == t.dtype and got.shape == t.shape and torch.equal(got, t)


def test_shapes_and_non_contiguous_inputs(store: object) -> None:
    base = torch.arange(120, dtype=torch.float32).reshape(2, 3, 4, 5)
    for i, t in enumerate([torch.arange(3.0), base, base.reshape(1, 2, 3, 4, 5), base.transpose(1, 3), base[:, 1:]]):
        assert store.put_tensor(f"s{i}", t) == 0
        assert torch.equal(store.get_tensor(f"s{i}"), t), i


def test_missing_existing_and_upserted_tensors(store: object) -> None:
    assert store.get_tensor("absent") is None
    assert store.put_tensor("k", torch.ones(3)) == 0
    assert store.put_tensor("k", torch.zeros(5)) == 0  # an existing key keeps its value
    assert torch.equal(store.get_tensor("k"), torch.ones(3))
    assert store.upsert_tensor("k", torch.zeros(5)) == 0
    assert torch.equal(store.get_tensor("k"), torch.zeros(5))
    config = _types(store_api(store)).ReplicateConfig()
    assert store.pub_tensor("p", torch.ones(2), config) == 0
    assert store.upsert_pub_tensor("p", torch.ones(4), config) == 0
    assert torch.equal(store.get_tensor("p"), torch.ones(4))


def test_batch_tensor_calls(store: object) -> None:
    tensors = [torch.full((4,), float(i)) for i in range(3)]
    assert store.batch_put_tensor(["a", "b", "c"], tensors) == [0, 0, 0]
    got = store.batch_get_tensor(["a", "absent", "c"])
    assert torch.equal(got[0], tensors[0]) and got[1] is None and torch.equal(got[2], tensors[2])
    assert store.batch_upsert_tensor(["a"], [torch.zeros(2)]) == [0]
    assert store.batch_pub_tensor(["d"], [torch.ones(1)], _types(store_api(store)).ReplicateConfig()) == [0]
    assert torch.equal(store.batch_get_tensor(["a", "d"])[0], torch.zeros(2))


def test_get_tensor_into_and_put_tensor_from_a_registered_buffer(store: object) -> None:
    t = torch.arange(1000, dtype=torch.float32)
    assert store.put_tensor("src", t) == 0
    buf = torch.zeros(1 << 16, dtype=torch.uint8)
    assert store.register_buffer(buf.data_ptr(), buf.numel()) == 0
    try:
        got = store.get_tensor_into("src", buf.data_ptr(), buf.numel())
        assert torch.equal(got, t)
        assert buf.data_ptr() <= got.data_ptr() < buf.data_ptr() + buf.numel()  # in the caller's buffer
        assert store.get_tensor_into("src", buf.data_ptr(), 100) is None  # too small
        assert store.get_tensor_into("absent", buf.data_ptr(), buf.numel()) is None
        size = got.data_ptr() - buf.data_ptr() + t.numel() * 4  # the serialized object's length
        assert store.put_tensor_from("copy", buf.data_ptr(), size) == 0
        assert torch.equal(store.get_tensor("copy"), t)
        assert store.upsert_tensor_from("copy", buf.data_ptr(), size) == 0
        buf[:64] = 0  # no header any more
        assert store.put_tensor_from("bad", buf.data_ptr(), size) == INVALID
        assert store.get_tensor("bad") is None
    finally:
        assert store.unregister_buffer(buf.data_ptr()) == 0


def test_tensor_parallel_shards(store: object) -> None:
    whole = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    assert store.put_tensor_with_tp("w", whole, tp_rank=0, tp_size=2, split_dim=1) == 0
    assert [store.is_exist(k) for k in ("w", "w_tp_0", "w_tp_1")] == [0, 1, 1]
    for rank, piece in enumerate(torch.chunk(whole, 2, 1)):
        assert torch.equal(store.get_tensor_with_tp("w", tp_rank=rank, tp_size=2, split_dim=1), piece)
    batch = store.batch_get_tensor_with_tp(["w", "absent"], tp_rank=1, tp_size=2)
    assert batch[1] is None
    assert store.batch_put_tensor_with_tp(["x"], [whole], tp_size=2) == [0]
    assert torch.equal(store.get_tensor("x_tp_1"), whole[2:])


def test_unified_parallelism_writes_and_reads(store: object) -> None:
    api = store_api(store)
    whole = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    tp1 = _parallelism(api, _axis(api, "tp", 1, 2, split_dim=1))
    assert store.put_tensor_with_parallelism("q", whole[:, 2:], tp1) == 0  # plain TP: the rank's shard in
    assert store.is_exist("q_tp_1") == 1 and store.is_exist("q") == 0
    assert torch.equal(store.get_tensor_with_parallelism("q", _target(api, "shard", tp1)), whole[:, 2:])
    dp_tp = _parallelism(api, _axis(api, "dp", 0, 2), _axis(api, "tp", 1, 2, split_dim=1))
    assert store.put_tensor_with_parallelism("p", whole, dp_tp) == 0  # multi-axis: the whole tensor in
    assert torch.equal(store.get_tensor_with_parallelism("p", _target(api, "shard", dp_tp)), whole[:, 2:])
    assert store.get_tensor_with_parallelism("p", _target(api, "as_stored")) is None
    assert store.put_tensor_with_parallelism("full", whole) == 0
    assert torch.equal(store.get_tensor_with_parallelism("full"), whole)


def store_api(store: object) -> MooncakeApi:
    return SHIM if isinstance(store, MooncakeDistributedStore) else MOONCAKE


# ---- tidekv only (where Mooncake differs or cannot run here) ------------------------------

@pytest.fixture
def shim(tmp_path: Path) -> Iterator[MooncakeDistributedStore]:
    with _opened(SHIM, tmp_path, 64 << 20) as s:
        yield s  # type: ignore[misc]


def test_what_the_drop_in_stores_that_mooncake_refuses(shim: MooncakeDistributedStore) -> None:
    # Mooncake returns a 0-d tensor as shape (1,), refuses complex dtypes and uneven splits (-600).
    scalar = torch.tensor(3.5)
    assert shim.put_tensor("scalar", scalar) == 0 and shim.get_tensor("scalar").shape == ()
    assert shim.put_tensor("c", torch.ones(2, dtype=torch.complex64)) == 0
    assert shim.get_tensor("c").dtype == torch.complex64
    whole = torch.arange(10.0).reshape(5, 2)
    assert shim.put_tensor_with_tp("u", whole, tp_size=2) == 0
    assert torch.equal(shim.get_tensor_with_tp("u", tp_rank=0, tp_size=2), whole[:3])
    assert torch.equal(shim.get_tensor_with_parallelism("u", _target(SHIM, "full")), whole)


def test_writer_partition_and_zero_copy_parallel_forms(shim: MooncakeDistributedStore) -> None:
    whole = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert shim.put_tensor_with_parallelism("r", whole, writer_partition={"rank": 1, "size": 2, "split_dim": 1}) == 0
    assert torch.equal(shim.get_tensor("r_tp_1"), whole[:, 2:]) and shim.is_exist("r_tp_0") == 0
    assert shim.put_tensor_with_parallelism("r", whole, writer_partition=(1, 2)) == INVALID
    both = _parallelism(SHIM, _axis(SHIM, "tp", 0, 2, 0), _axis(SHIM, "ep", 0, 2, 1))
    assert shim.put_tensor_with_parallelism("r2", whole, both) == INVALID  # two cutting axes
    buf = torch.zeros(4096, dtype=torch.uint8)
    assert shim.register_buffer(buf.data_ptr(), buf.numel()) == 0
    assert shim.put_tensor_with_tp("w", whole, tp_size=3, split_dim=1) == 0
    got = shim.get_tensor_with_tp_into("w", buf.data_ptr(), buf.numel(), tp_rank=2, tp_size=3, split_dim=1)
    assert torch.equal(got, whole[:, 3:]) and buf.data_ptr() <= got.data_ptr() < buf.data_ptr() + 4096
    got = shim.get_tensor_with_parallelism_into("w", buf.data_ptr(), buf.numel(), _target(SHIM, "full"))
    assert torch.equal(got, whole)
    size = got.data_ptr() - buf.data_ptr() + whole.numel() * 4
    assert shim.put_tensor_with_tp_from("v", buf.data_ptr(), size, tp_size=2) == 0
    assert torch.equal(shim.get_tensor_with_tp("v", 1, 2), whole[2:])
    tp0 = _parallelism(SHIM, _axis(SHIM, "tp", 0, 2, 0))
    assert shim.batch_put_tensor_with_parallelism_from(["f"], [buf.data_ptr()], [size], [tp0]) == [0]
    assert torch.equal(shim.get_tensor("f_tp_0"), whole)  # plain TP: what is given is the shard


def test_get_tensor_into_cuda_fills_a_tensor_or_names_the_mismatch(shim: MooncakeDistributedStore) -> None:
    # Mooncake's non-CUDA wheel answers -600 ("CUDA IPC tensor read requires a dummy client");
    # tidekv reads into any tensor a transport reaches (host memory here).
    t = torch.arange(6, dtype=torch.int32)
    assert shim.put_tensor("t", t) == 0
    out = torch.zeros(6, dtype=torch.int32)
    assert shim.get_tensor_into_cuda("t", out) == 0 and torch.equal(out, t)
    assert shim.batch_get_tensor_into_cuda(["t", "absent"], [torch.zeros(3, dtype=torch.int32), out]) == [INVALID,
                                                                                                           -704]


def test_safetensors_export_and_import(shim: MooncakeDistributedStore, tmp_path: Path) -> None:
    t = torch.arange(10, dtype=torch.bfloat16).reshape(2, 5)
    assert shim.put_tensor("weights", t) == 0
    path = str(tmp_path / "w.safetensors")
    assert shim.save_tensor_to_safetensor("weights", path) == 0
    raw = Path(path).read_bytes()
    header_len = int.from_bytes(raw[:8], "little")
    assert b'"BF16"' in raw[8:8 + header_len]  # the safetensors format: length, JSON header, data
    assert shim.remove("weights", force=True) == 0  # the get above leased it
    assert torch.equal(shim.load_tensor_from_safetensor("weights", path), t)
    assert torch.equal(shim.get_tensor("weights"), t)
    assert torch.equal(shim.load_tensor_from_safetensor("other", path), t)  # not in the file: its first
    assert shim.save_tensor_to_safetensor("absent", str(tmp_path / "x")) == -704


def test_ctypes_buffers_work_as_well_as_tensors(shim: MooncakeDistributedStore) -> None:
    raw = ctypes.create_string_buffer(8192)
    ptr = ctypes.addressof(raw)
    assert shim.register_buffer(ptr, 8192) == 0
    assert shim.put_tensor("x", torch.ones(7, dtype=torch.float64)) == 0
    assert torch.equal(shim.get_tensor_into("x", ptr, 8192), torch.ones(7, dtype=torch.float64))


# ---- sessions, metadata puts, pools, replicas (side by side) ------------------------------

def test_get_session_reads_ranges_of_several_objects(store: object) -> None:
    assert store.put("a", bytes(range(100))) == 0 and store.put("b", bytes(range(100, 200))) == 0
    assert store.batch_get_session_start(["a", "b", "absent"]) == [0, 0, -704]
    dst = ctypes.create_string_buffer(64)
    ptr = ctypes.addressof(dst)
    assert store.register_buffer(ptr, 64) == 0
    got = store.batch_get_into_multi_buffer_ranges(["a", "b"], [[ptr, ptr + 8], [ptr + 16]], [[4, 2], [3]],
                                                   [[10, 50], [0]])
    assert got == [6, 3]
    assert dst.raw[:4] == bytes(range(10, 14)) and dst.raw[8:10] == bytes([50, 51]) and dst.raw[16:19] == b"def"
    assert store.batch_get_session_end(["a", "b"]) == 0
    assert store.unregister_buffer(ptr) == 0


def test_put_session_writes_ranges_then_publishes_at_the_end(store: object) -> None:
    src = ctypes.create_string_buffer(b"0123456789abcdef", 16)
    ptr = ctypes.addressof(src)
    assert store.register_buffer(ptr, 16) == 0
    assert store.batch_put_session_start(["s1", "s2"], [8, 4]) == [0, 0]
    assert store.batch_put_from_multi_buffer_ranges(["s1", "s2"], [[ptr, ptr + 10], [ptr + 12]], [[4, 4], [4]],
                                                    [[4, 0], [0]]) == [8, 4]
    assert store.is_exist("s1") == 0  # not visible before the end
    assert store.batch_put_session_end(["s1", "s2"]) == [0, 0]
    assert store.get("s1") == b"abcd0123" and store.get("s2") == b"cdef"
    assert store.batch_put_session_start(["s3"], [4]) == [0]
    assert store.batch_put_session_revoke(["s3"]) == [0]
    assert store.is_exist("s3") == 0
    assert store.unregister_buffer(ptr) == 0


def test_put_from_with_metadata_and_upsert_parts(store: object) -> None:
    data = ctypes.create_string_buffer(b"payload!", 8)
    meta = ctypes.create_string_buffer(b"hd", 2)
    for buf, n in ((data, 8), (meta, 2)):
        assert store.register_buffer(ctypes.addressof(buf), n) == 0
    assert store.put_from_with_metadata("m", ctypes.addressof(data), ctypes.addressof(meta), 8, 2) == 0
    assert store.get("m") == b"hdpayload!"  # metadata first, as Mooncake lays it out
    assert store.upsert_parts("u", b"ab", b"cd") == 0 and store.get("u") == b"abcd"
    assert store.upsert_parts("u", b"x") == 0 and store.get("u") == b"x"


def test_batch_replica_clear_and_the_memory_pool(store: object) -> None:
    assert store.put("r", b"bytes") == 0
    assert store.batch_replica_clear(["r"], "") == ["r"]
    assert store.is_exist("r") == 0
    assert store.get_offload_rpc_read_count() == 0


def test_what_the_drop_in_does_not_offer_says_so(shim: MooncakeDistributedStore,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    unavailable = -1011
    assert shim.init_all("tcp", "", 1 << 20) == unavailable
    assert shim.unmount_local_disk_segment() == -600, "set up without enable_ssd_offload: no disk tier to unmount"
    assert shim.query_task((0, 0)) == (None, -1400)  # as Mooncake answers an unknown task
    assert "not offered by tidekv" in caplog.text
    ptr = shim.alloc_from_mem_pool(4096)
    assert ptr != 0
    ctypes.memmove(ptr, b"pooled", 6)
    assert shim.put_from("pooled", ptr, 6) == 0 and shim.get("pooled") == b"pooled"  # registered: zero-copy works
    assert shim.batch_put_session_start(["dup", "dup"], [4, 4]) == [0, -600]
    assert shim.batch_put_session_end(["dup", "never-started"]) == [0, -600]


def test_copy_and_move_tasks_are_made_by_the_target_holders(shim: MooncakeDistributedStore, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIDEKV_STORE_HEARTBEAT_INTERVAL_S", "0.2")  # holders ask for copies about once a beat
    other = MooncakeDistributedStore()
    master = shim._store._pool.address  # the same master
    assert other.setup("127.0.0.1", "P2PHANDSHAKE", 64 << 20, 16 << 20, "tcp", "", master) == 0
    try:
        here, there = shim.get_hostname(), other.get_hostname()
        config = mooncake_types.ReplicateConfig()
        config.preferred_segment = here
        for key in ("c", "m"):
            assert shim.put(key, key.encode() * 1000, config) == 0
        copy, rc = shim.create_copy_task("c", [there])
        move, rc2 = shim.create_move_task("m", here, there)
        assert rc == rc2 == 0 and copy != (0, 0)
        for task in (copy, move):
            deadline = time.monotonic() + 20
            while (state := shim.query_task(task))[0].status != mooncake_types.TaskStatus.SUCCESS:
                assert state[0].status != mooncake_types.TaskStatus.FAILED, state[0].message
                assert time.monotonic() < deadline, "the task did not finish within 20 s"
                time.sleep(0.1)
        assert {d.get_memory_descriptor().buffer_descriptor.transport_endpoint
                for d in shim.get_replica_desc("c")} == {shim.get_hostname().split("/")[0],
                                                         other.get_hostname().split("/")[0]}
        assert [d.get_memory_descriptor().buffer_descriptor.transport_endpoint for d in shim.get_replica_desc("m")] \
            == [other.get_hostname().split("/")[0]]
        assert other.get("m") == b"m" * 1000 and shim.query_task(move)[0].type == mooncake_types.TaskType.REPLICA_MOVE
        assert shim.create_copy_task("c", [there]) == ((0, 0), -600)  # it holds one already
        assert shim.create_move_task("absent", here, there) == ((0, 0), -600)
    finally:
        other.close()


def test_more_segments_allocated_or_mapped_from_a_file(shim: MooncakeDistributedStore, tmp_path: Path) -> None:
    got = shim.allocate_and_mount_segment(8 << 20)
    assert got["ret"] == 0 and got["allocated_size"] == 8 << 20 and len(got["segment_ids"]) == 1
    path = Path("/dev/shm") / f"tidekv-test-{tmp_path.name}"
    path.write_bytes(bytes(8 << 20))
    try:
        mapped = shim.mount_segment(str(path), 4 << 20, offset=4096)
        assert mapped["ret"] == 0
        config = mooncake_types.ReplicateConfig()
        for i, segment in enumerate(got["segment_ids"] + mapped["segment_ids"]):
            config.preferred_segment = segment
            assert shim.put(f"on-{i}", b"x" * 5000, config) == 0
            assert shim.get(f"on-{i}") == b"x" * 5000
            assert shim.batch_get_replica_desc([f"on-{i}"])  # found
        assert b"x" * 5000 in path.read_bytes()  # the object's bytes are in the file
        assert shim.mount_segment(str(tmp_path / "absent"), 4096)["ret"] == -600
        assert shim.mount_segment(str(path), 64 << 20)["ret"] == -600  # the file is smaller
        assert shim.unmount_segment(mapped["segment_ids"]) == 0
        assert shim.get("on-1") == b""  # its objects left with it
        assert shim.unmount_and_free_segment(got["segment_ids"] + ["not-mine"]) == -600
        assert shim.get("on-0") == b"" and shim.put("after", b"y" * 100) == 0
    finally:
        path.unlink()
