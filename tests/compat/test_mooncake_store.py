"""Contract of ``tidekv.compat.mooncake_store`` (``mooncake.store`` in the Mooncake drop-in):
Mooncake's signatures and return codes, one test per method its callers use (SGLang's mooncake
HiCache backend, vLLM's MooncakeStoreConnector, LMCache's ``mooncakestore://``), each against a
real tidekv master process on 127.0.0.1.

Codes are Mooncake's (mooncake-store/include/types.h): 0 ok, -200 no space, -600 invalid
parameters (a buffer too small), -704 not found, -706 has lease, -707 lease expired, -1011
unavailable in this mode. ``test_mooncake_shim``
checks that the installed ``mooncake.store`` is this module.
"""

from __future__ import annotations

import logging

import ctypes
import itertools
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.store.payload import payload
from tests.store.procs import MasterProcess, wait_until
from tidekv.compat.mooncake import TransferEngine
from tidekv.compat.mooncake_store import MooncakeDistributedStore, master_address
from tidekv.compat.mooncake_types import (
    BufferHandle,
    ErrorCode,
    MooncakeHostMemAllocator,
    ReplicateConfig,
    SoftPinAction,
    error_code,
)
from tidekv.errors import (
    ConfigError,
    LeaseExpiredError,
    MasterNotReadyError,
    ObjectLeasedError,
    ObjectNotFoundError,
    OutOfSpaceError,
    PeerUnavailableError,
    StoreError,
    TransferError,
)

MIB = 1 << 20
LEASE_S = 2.0  # long enough that a loaded machine does not outlive it between two calls
NOT_FOUND, HAS_LEASE, LEASE_EXPIRED, NO_SPACE, INVALID, UNAVAILABLE = -704, -706, -707, -200, -600, -1011

SpawnMaster = Callable[..., MasterProcess]
Open = Callable[..., MooncakeDistributedStore]


@pytest.fixture
def spawn_master(tmp_path: Path) -> Iterator[SpawnMaster]:
    started: list[MasterProcess] = []
    counter = itertools.count()

    def spawn(**config: object) -> MasterProcess:
        master = MasterProcess({"lease_ttl_s": LEASE_S, **config}, tmp_path / f"master-{next(counter)}.log")
        started.append(master)
        return master

    yield spawn
    for master in started:
        master.stop()


@pytest.fixture
def master(spawn_master: SpawnMaster) -> MasterProcess:
    return spawn_master()


@pytest.fixture
def open_store(monkeypatch: pytest.MonkeyPatch) -> Iterator[Open]:
    """``open_store(master, segment_bytes)``: a store set up as SGLang sets it up (8 positionals)."""
    monkeypatch.setenv("TIDEKV_STORE_HEARTBEAT_INTERVAL_S", "0.2")
    opened: list[MooncakeDistributedStore] = []

    def open_(master: MasterProcess, segment: int = 16 * MIB) -> MooncakeDistributedStore:
        store = MooncakeDistributedStore()
        assert store.setup("127.0.0.1", "P2PHANDSHAKE", segment, 16 * MIB, "tcp", "", master.address, None) == 0
        opened.append(store)
        return store

    yield open_
    for store in opened:
        store.close()


@pytest.fixture
def store(master: MasterProcess, open_store: Open) -> MooncakeDistributedStore:
    return open_store(master)


class Mem:
    """Host memory at a fixed address, registered with ``store`` (as SGLang's host KV pool is)."""

    def __init__(self, store: MooncakeDistributedStore, size: int) -> None:
        self.raw = ctypes.create_string_buffer(size)
        self.addr, self.size = ctypes.addressof(self.raw), size
        assert store.register_buffer(self.addr, size) == 0

    def write(self, offset: int, data: bytes) -> None:
        ctypes.memmove(self.addr + offset, data, len(data))

    def read(self, offset: int, length: int) -> bytes:
        return ctypes.string_at(self.addr + offset, length)


# ---- error codes --------------------------------------------------------------------------


@pytest.mark.parametrize(("error", "code"), [
    (ObjectNotFoundError("x"), NOT_FOUND), (ObjectLeasedError("x"), HAS_LEASE), (LeaseExpiredError("x"), LEASE_EXPIRED),
    (OutOfSpaceError("x"), NO_SPACE), (ConfigError("x"), INVALID), (MasterNotReadyError("x"), -900),
    (PeerUnavailableError("x"), -800), (TransferError("x"), -800), (StoreError("x"), -1),
])
def test_tidekv_errors_map_to_mooncakes_codes(error: Exception, code: int) -> None:
    assert error_code(error) == code == error_code(type(error))


def test_master_addresses_in_mooncakes_forms(monkeypatch: pytest.MonkeyPatch) -> None:
    assert master_address("10.0.0.5:50051") == "10.0.0.5:50051"
    assert master_address("etcd://h1:2379;h2:2379") == "etcd://h1:2379,h2:2379/mooncake_cluster"
    monkeypatch.setenv("MC_STORE_CLUSTER_ID", "c7")
    assert master_address("etcd://h1:2379") == "etcd://h1:2379/c7"
    with pytest.raises(ConfigError, match="redis"):
        master_address("redis://h:6379")
    pool = "g0=h1:50051;g1=etcd://h9:2379/g1"  # tidekv's own: a pool sharded over master groups
    assert master_address(pool) == pool


# ---- setup ------------------------------------------------------------------------------------


def test_setup_takes_sglangs_eight_positionals_and_refuses_its_extras_by_name(master: MasterProcess) -> None:
    store = MooncakeDistributedStore()
    kwargs = {"tenant_id": "t1", "enable_client_http_server": True}
    # SGLang's loop: drop each keyword the TypeError names, retry.
    while True:
        try:
            code = store.setup("127.0.0.1", "P2PHANDSHAKE", 8 * MIB, 16 * MIB, "rdma", "", master.address, None, **kwargs)
            break
        except TypeError as exc:
            named = [k for k in kwargs if k in str(exc)]
            assert named, exc
            for k in named:
                kwargs.pop(k)
    try:
        assert code == 0 and kwargs == {}
        assert store.put("warmup", bytes(4096)) == 0 and store.is_exist("warmup") == 1
        assert store.get("warmup") == bytes(4096)
        with pytest.raises(TypeError, match="tenant_id"):
            MooncakeDistributedStore().setup("127.0.0.1", "P2PHANDSHAKE", 0, 0, "tcp", "", master.address,
                                             tenant_id="t1")
        with pytest.raises(TypeError, match="bogus"):
            MooncakeDistributedStore().setup("127.0.0.1", "P2PHANDSHAKE", 0, 0, "tcp", "", master.address, bogus=1)
        assert store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 0, "tcp", "", master.address) == INVALID  # already set up
    finally:
        store.close()


def test_setup_shares_a_mooncake_engines_tidekv_engine(master: MasterProcess) -> None:
    te = TransferEngine()
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "") == 0
    store = MooncakeDistributedStore()
    try:
        assert store.setup("127.0.0.1", "P2PHANDSHAKE", 4 * MIB, MIB, "rdma", "", master.address, te.get_engine()) == 0
        assert store.get_hostname().startswith(f"127.0.0.1:{te.get_rpc_port()}/")
        assert store.put("k", b"v") == 0 and store.get("k") == b"v"
    finally:
        store.close()


def test_setup_fails_with_a_code_when_no_master_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIDEKV_STORE_FAILOVER_TIMEOUT_S", "0")
    store = MooncakeDistributedStore()
    assert store.setup("127.0.0.1", "P2PHANDSHAKE", 0, MIB, "tcp", "", "127.0.0.1:1") == -900
    assert store.setup("127.0.0.1", "P2PHANDSHAKE", "lots", MIB, "tcp", "", "127.0.0.1:1") == INVALID
    assert store.health_check() == 1 and store.put("k", b"v") == -1 and store.get("k") == b""


def test_setup_from_a_config_dict_with_human_readable_sizes(spawn_master: SpawnMaster) -> None:
    master = spawn_master()
    store = MooncakeDistributedStore()
    config = {"local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE", "global_segment_size": "16MB",
              "local_buffer_size": "1mb", "protocol": "tcp", "master_server_address": master.address,
              "transfer_timeout": 5}  # a key setup does not read: logged, not fatal
    try:
        assert store.setup(config) == 0
        assert store.put("fits", bytes(15 * MIB)) == 0  # the only segment is 16 MiB
        assert store.put("too-big", bytes(17 * MIB)) == NO_SPACE
    finally:
        store.close()
    assert MooncakeDistributedStore().setup({**config, "global_segment_size": "sixteen"}) == INVALID
    missing = {**config, "enable_ssd_offload": True, "ssd_offload_path": "/nonexistent/ssd"}
    assert MooncakeDistributedStore().setup(missing) == INVALID, "an SSD offload directory that does not exist"


def test_setup_dict_falls_back_to_mooncake_variables(master: MasterProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOONCAKE_MASTER", master.address)
    monkeypatch.setenv("MOONCAKE_GLOBAL_SEGMENT_SIZE", "4mb")
    monkeypatch.setenv("MOONCAKE_LOCAL_HOSTNAME", "127.0.0.1")
    store = MooncakeDistributedStore()
    try:
        assert store.setup({"metadata_server": "P2PHANDSHAKE"}) == 0
        assert store.put("too-big", bytes(4 * MIB + 1)) == NO_SPACE
        assert store.put("fits", bytes(4 * MIB)) == 0
    finally:
        store.close()


def test_setup_dummy_attaches_to_the_pool_of_the_server(master: MasterProcess, open_store: Open) -> None:
    holder = open_store(master, 8 * MIB)
    dummy = MooncakeDistributedStore()
    try:
        assert dummy.setup_dummy(64 * MIB, 16 * MIB, master.address) == 0
        assert "/" not in dummy.get_hostname()  # no segment of its own
        assert dummy.put("k", b"from dummy") == 0
        assert holder.get("k") == b"from dummy"
        desc = holder.batch_get_replica_desc(["k"])["k"][0].get_memory_descriptor().buffer_descriptor
        assert holder.get_hostname().startswith(desc.transport_endpoint + "/")
    finally:
        dummy.close()


def test_close_returns_zero_and_takes_the_segment_out_of_the_pool(master: MasterProcess, open_store: Open) -> None:
    other = open_store(master, 4 * MIB)
    store = MooncakeDistributedStore()
    assert store.setup("127.0.0.1", "P2PHANDSHAKE", 4 * MIB, MIB, "tcp", "", master.address) == 0
    repl = ReplicateConfig()
    repl.preferred_segment = store.get_hostname()
    assert store.put("k", b"v", repl) == 0
    assert other.is_exist("k") == 1
    assert store.close() == 0 and store.close() == 0
    assert store.health_check() == 1 and store.is_exist("k") == -1
    assert other.is_exist("k") == 0


def test_health_check(store: MooncakeDistributedStore, master: MasterProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    assert store.health_check() == 0
    assert MooncakeDistributedStore().health_check() == 1


# ---- bytes objects ----------------------------------------------------------------------------


def test_put_returns_zero_also_for_an_existing_key_and_keeps_its_bytes(store: MooncakeDistributedStore) -> None:
    assert store.put("k", b"first") == 0
    assert store.put("k", b"second") == 0
    assert store.get("k") == b"first"
    assert store.put("empty", b"") == INVALID
    assert store.put("big", bytes(17 * MIB)) == NO_SPACE


def test_get_returns_the_bytes_or_empty_when_missing(store: MooncakeDistributedStore) -> None:
    data = payload(1, 3 * MIB)
    assert store.put("k", memoryview(data)) == 0
    assert store.get("k") == data
    assert store.get("missing") == b""


def test_put_parts_stores_the_concatenation(store: MooncakeDistributedStore) -> None:
    meta, data = bytes(range(28)), payload(2, 100_000)
    assert store.put_parts("k", meta, bytearray(data)) == 0
    assert store.get("k") == meta + data


def test_put_batch_and_get_batch(store: MooncakeDistributedStore) -> None:
    values = [payload(i, 1000 * (i + 1)) for i in range(5)]
    assert store.put_batch([f"k{i}" for i in range(5)], values) == 0
    assert store.get_batch(["k0", "nope", "k4"]) == [values[0], b"", values[4]]
    assert store.put_batch(["a", "b"], [b"1"]) == INVALID


def test_upsert_replaces_where_put_keeps(store: MooncakeDistributedStore) -> None:
    assert store.upsert("k", b"one") == 0
    assert store.upsert("k", b"two, longer") == 0
    assert store.get("k") == b"two, longer"
    assert store.put("k", b"three") == 0 and store.get("k") == b"two, longer"
    assert store.upsert("k", b"") == INVALID


def test_batch_get_buffer_gives_buffer_handles(store: MooncakeDistributedStore) -> None:
    assert store.put("k", b"meta+data") == 0
    handles = store.batch_get_buffer(["k", "missing"])
    assert handles[1] is None and isinstance(handles[0], BufferHandle)
    assert handles[0].size() == len(handles[0]) == 9 and handles[0].ptr() != 0
    assert bytes(memoryview(handles[0])) == b"meta+data"
    assert ctypes.string_at(handles[0].ptr(), 9) == b"meta+data"
    assert store.get_buffer("missing") is None and bytes(store.get_buffer("k")) == b"meta+data"  # type: ignore[arg-type]


# ---- metadata, leases, removal ----------------------------------------------------------------


def test_is_exist_is_one_or_zero_and_grants_a_lease(store: MooncakeDistributedStore) -> None:
    assert store.put("k", b"v") == 0
    assert store.is_exist("k") == 1 and store.is_exist("missing") == 0
    assert store.remove("k") == HAS_LEASE  # Mooncake's ExistKey leases the object
    wait_until(lambda: store.remove("k") == 0, LEASE_S + 5, "the lease is_exist took to lapse")
    assert store.is_exist("k") == 0


def test_batch_is_exist_is_one_zero_or_minus_one(master: MasterProcess, open_store: Open,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIDEKV_STORE_FAILOVER_TIMEOUT_S", "0")
    monkeypatch.setenv("TIDEKV_STORE_RPC_TIMEOUT_S", "1")
    store = open_store(master)
    assert store.put_batch(["a", "c"], [b"1", b"3"]) == 0
    assert store.batch_is_exist(["a", "b", "c"]) == [1, 0, 1]
    master.kill()
    assert store.batch_is_exist(["a", "b"]) == [-1, -1]
    assert store.is_exist("a") == -1


def test_get_size(store: MooncakeDistributedStore) -> None:
    assert store.put("k", bytes(12345)) == 0
    assert store.get_size("k") == 12345
    assert store.get_size("missing") == NOT_FOUND


def test_remove_is_zero_not_found_or_has_lease(store: MooncakeDistributedStore) -> None:
    assert store.put_batch(["a", "b"], [b"1", b"2"]) == 0
    assert store.remove("a") == 0 and store.remove("a") == NOT_FOUND
    assert store.get("b") == b"2"  # a get leases too
    assert store.remove("b") == HAS_LEASE and store.get("b") == b"2"
    assert store.remove("b", force=True) == 0 and store.is_exist("b") == 0
    assert store.put_batch(["c", "d"], [b"3", b"4"]) == 0 and store.is_exist("d") == 1
    assert store.batch_remove(["c", "d", "e"]) == [0, HAS_LEASE, NOT_FOUND]


def test_remove_all_removes_what_is_not_leased_and_force_the_rest(store: MooncakeDistributedStore,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    assert store.put_batch([f"k{i}" for i in range(2500)], [b"v"] * 2500) == 0  # more than one page
    assert store.put("leased", b"l") == 0 and store.get("leased") == b"l"  # a get leases it
    with caplog.at_level(logging.WARNING, logger="tidekv.compat.mooncake_store"):
        assert store.remove_all() == 2500
    assert "left 1 object(s) a reader holds a lease on" in caplog.text
    assert store.is_exist("k7") == 0 and store.get("leased") == b"l"
    assert store.remove_all(force=True) == 1  # vLLM's call: leases do not stop it
    assert store.remove_all() == 0


def test_remove_by_regex_removes_the_matching_keys(store: MooncakeDistributedStore) -> None:
    assert store.put_batch(["layer0/a", "layer0/b", "layer1/a", "other"], [b"1", b"2", b"3", b"4"]) == 0
    assert store.remove_by_regex(r"^layer0/") == 2
    assert store.remove_by_regex(r"/a$") == 1  # layer1/a; search, not a whole-key match
    assert [store.is_exist(k) for k in ("layer0/a", "layer0/b", "layer1/a", "other")] == [0, 0, 0, 1]
    assert store.remove_by_regex("(unclosed") == INVALID


def test_batch_get_replica_desc_describes_memory_replicas(master: MasterProcess, open_store: Open) -> None:
    a, b = open_store(master, 4 * MIB), open_store(master, 4 * MIB)
    repl = ReplicateConfig()
    repl.replica_num = 2
    assert a.put("two", bytes(1000), repl) == 0
    descs = b.batch_get_replica_desc(["two", "missing"])
    assert list(descs) == ["two"] and len(descs["two"]) == 2
    for d in descs["two"]:
        assert d.is_memory_replica() and not d.is_disk_replica() and not d.is_local_disk_replica()
        assert d.get_memory_descriptor().buffer_descriptor.size == 1000
    endpoints = {d.get_memory_descriptor().buffer_descriptor.transport_endpoint for d in descs["two"]}
    assert endpoints == {a.get_hostname().partition("/")[0], b.get_hostname().partition("/")[0]}
    assert b.remove("two") == HAS_LEASE  # GetReplicaList leases, as in Mooncake
    assert b.get_replica_desc("missing") == []


def test_get_hostname_names_this_clients_segment(master: MasterProcess, open_store: Open) -> None:
    a, b = open_store(master, 4 * MIB), open_store(master, 4 * MIB)
    assert a.get_hostname() != b.get_hostname() and a.get_hostname().startswith("127.0.0.1:")
    repl = ReplicateConfig()
    repl.preferred_segment = b.get_hostname()  # LMCache's "put it here"
    assert a.put("k", b"v", repl) == 0
    (desc,) = a.get_replica_desc("k")
    assert b.get_hostname() == desc.get_memory_descriptor().buffer_descriptor.transport_endpoint + "/" + \
        b.get_hostname().partition("/")[2]


# ---- registered memory and zero-copy ------------------------------------------------------


def test_register_and_unregister_buffer(store: MooncakeDistributedStore) -> None:
    mem = Mem(store, MIB)  # register_buffer == 0
    mem.write(0, b"abc")
    assert store.put_from("k", mem.addr, 3) == 0
    assert store.unregister_buffer(mem.addr) == 0
    assert store.unregister_buffer(mem.addr) == INVALID
    assert store.put_from("k2", mem.addr, 3) < 0  # no longer registered
    assert store.get("k") == b"abc"


def test_put_from_and_get_into(store: MooncakeDistributedStore) -> None:
    mem = Mem(store, 4 * MIB)
    data = payload(5, MIB)
    mem.write(0, data)
    assert store.put_from("k", mem.addr, MIB) == 0
    assert store.put_from("k", mem.addr + 1, 10) == 0  # exists: 0, bytes kept
    assert store.get_into("k", mem.addr + 2 * MIB, 2 * MIB) == MIB
    assert mem.read(2 * MIB, MIB) == data
    assert store.get_into("missing", mem.addr, MIB) == NOT_FOUND
    assert store.get_into("k", mem.addr, MIB - 1) == INVALID  # buffer too small
    assert store.put_from("empty", mem.addr, 0) == INVALID


def test_get_into_after_the_lease_ran_out_is_lease_expired(spawn_master: SpawnMaster, open_store: Open) -> None:
    master = spawn_master(lease_ttl_s=1e-6)  # every read outlives it
    store = open_store(master)
    mem = Mem(store, 2 * MIB)
    assert store.put_from("k", mem.addr, MIB) == 0
    assert store.get_into("k", mem.addr + MIB, MIB) == LEASE_EXPIRED
    assert store.batch_get_into(["k", "missing"], [mem.addr + MIB, mem.addr], [MIB, MIB]) == [LEASE_EXPIRED, NOT_FOUND]


def test_batch_put_from_is_zero_per_key_even_for_existing_keys(store: MooncakeDistributedStore) -> None:
    mem = Mem(store, MIB)
    mem.write(0, payload(6, 4096))
    assert store.batch_put_from(["a", "b"], [mem.addr, mem.addr + 1024], [1024, 1024]) == [0, 0]
    assert store.batch_put_from(["a", "c", "d", "e"], [mem.addr] * 4, [1024, 1024, 0, 17 * MIB]) == \
        [0, 0, INVALID, NO_SPACE]
    assert store.get("b") == mem.read(1024, 1024)
    assert store.batch_put_from(["x"], [mem.addr, mem.addr], [1]) == [INVALID]


def test_batch_put_from_honours_replicate_config(master: MasterProcess, open_store: Open) -> None:
    a, b = open_store(master, 4 * MIB), open_store(master, 4 * MIB)
    mem = Mem(a, 4 * MIB)
    mem.write(0, payload(7, 4 * MIB))
    two = ReplicateConfig()
    two.replica_num = 2
    there = ReplicateConfig()
    there.preferred_segment = b.get_hostname()
    pinned = ReplicateConfig()
    pinned.with_hard_pin = True
    pinned.preferred_segment = a.get_hostname()
    soft = ReplicateConfig()
    soft.soft_pin_action = SoftPinAction.ENABLE
    assert a.batch_put_from(["two"], [mem.addr], [1000], two) == [0]
    assert a.batch_put_from(["there"], [mem.addr], [1000], there) == [0]
    assert a.batch_put_from(["soft"], [mem.addr], [1000], soft) == [0]
    assert len(a.get_replica_desc("two")) == 2
    (desc,) = a.get_replica_desc("there")
    assert b.get_hostname().startswith(desc.get_memory_descriptor().buffer_descriptor.transport_endpoint + "/")
    bad = ReplicateConfig()
    bad.replica_num = 0
    assert a.batch_put_from(["bad"], [mem.addr], [10], bad) == [INVALID]
    # A hard pin is never evicted: with a's segment held by it, more puts there find no room.
    assert a.batch_put_from(["pinned"], [mem.addr], [3 * MIB + MIB // 2], pinned) == [0]
    full = ReplicateConfig()
    full.preferred_segment = a.get_hostname()
    assert b.close() == 0  # a's segment is the pool now
    assert a.batch_put_from(["more"], [mem.addr], [MIB], full) == [NO_SPACE]
    assert a.get_size("pinned") == 3 * MIB + MIB // 2


def test_batch_get_into_is_bytes_read_or_a_code_per_key(store: MooncakeDistributedStore) -> None:
    mem = Mem(store, 4 * MIB)
    mem.write(0, payload(8, 2 * MIB))
    assert store.batch_put_from(["a", "b"], [mem.addr, mem.addr + MIB], [MIB, 1000]) == [0, 0]
    out = mem.addr + 2 * MIB
    assert store.batch_get_into(["a", "missing", "b"], [out, out, out + MIB], [MIB, 10, 1000]) == [MIB, NOT_FOUND, 1000]
    assert mem.read(2 * MIB, MIB) == mem.read(0, MIB) and mem.read(3 * MIB, 1000) == mem.read(MIB, 1000)
    # One buffer too small: that key is -600, the others are still read.
    assert store.batch_get_into(["b", "a"], [out, out + MIB], [999, MIB]) == [INVALID, MIB]


def test_multi_buffer_forms_gather_and_scatter_layers(store: MooncakeDistributedStore) -> None:
    """SGLang's MLA layer_first / hybrid pools and vLLM's connector: one object from several buffers."""
    mem = Mem(store, 4 * MIB)
    layers = [payload(10 + i, 4096) for i in range(4)]
    for i, layer in enumerate(layers):
        mem.write(i * MIB, layer)  # one page per layer, far apart
    ptrs = [[mem.addr + i * MIB for i in range(4)], [mem.addr + 3 * MIB, mem.addr]]
    sizes = [[4096] * 4, [100, 200]]
    repl = ReplicateConfig()
    repl.preferred_segment = store.get_hostname()  # vLLM sets it
    assert store.batch_put_from_multi_buffers(["page", "small"], ptrs, sizes, repl) == [0, 0]
    assert store.get("page") == b"".join(layers)
    assert store.get("small") == layers[3][:100] + layers[0][:200]
    out = [[mem.addr + i * MIB + 8192 for i in range(4)], [mem.addr + 3 * MIB + 16384]]
    assert store.batch_get_into_multi_buffers(["page", "small"], out, [[4096] * 4, [300]]) == [4 * 4096, 300]
    assert [mem.read(i * MIB + 8192, 4096) for i in range(4)] == layers
    assert store.batch_get_into_multi_buffers(["page"], [out[0][:2]], [[4096, 4096]]) == [INVALID]
    assert store.batch_put_from_multi_buffers(["x"], [[mem.addr]], [[1, 2]]) == [INVALID]


def test_host_mem_allocator_memory_serves_as_a_registered_pool(store: MooncakeDistributedStore) -> None:
    allocator = MooncakeHostMemAllocator()
    ptr = allocator.alloc(2 * MIB)
    assert ptr != 0 and ptr % 4096 == 0
    assert ctypes.string_at(ptr, 4096) == bytes(4096)
    assert store.register_buffer(ptr, 2 * MIB) == 0
    ctypes.memmove(ptr, b"pool bytes", 10)
    assert store.batch_put_from(["k"], [ptr], [10]) == [0]
    assert store.batch_get_into(["k"], [ptr + MIB], [MIB]) == [10]
    assert ctypes.string_at(ptr + MIB, 10) == b"pool bytes"
    assert store.unregister_buffer(ptr) == 0
    assert allocator.free(ptr) == 0 and allocator.free(ptr) == INVALID
    assert allocator.alloc(-1) == 0


def test_replicate_config_is_constructible_bare_with_sglangs_fields() -> None:
    config = ReplicateConfig()
    assert config.replica_num == 1 and not config.with_hard_pin and config.preferred_segment == ""
    assert config.group_ids is None and config.session_ids is None
    config.group_ids, config.session_ids = ["g"], ["s"]
    with pytest.raises(AttributeError):
        config.no_such_field = 1  # type: ignore[attr-defined]


def test_every_code_returned_is_mooncakes() -> None:
    assert {int(c) for c in ErrorCode} == {0, -1, -200, -600, -704, -706, -707, -800, -900, -1011}


def test_get_into_ranges_reads_fragments_of_several_objects(store: MooncakeDistributedStore) -> None:
    mem = Mem(store, 4 * MIB)
    a, b = payload(40, MIB), payload(41, 4096)
    assert store.put_batch(["a", "b"], [a, b]) == 0
    out = store.get_into_ranges(
        [mem.addr, mem.addr + MIB],
        [["a", "b"], ["missing", "b"]],
        [[[0, 100], [200]], [[0], [0]]],  # dst offsets
        [[[MIB - 100, 0], [4000]], [[0], [10]]],  # src offsets
        [[[100, 50], [96]], [[10], [20]]],  # sizes
    )
    assert out == [[[100, 50], [96]], [[NOT_FOUND], [20]]]
    assert mem.read(0, 100) == a[MIB - 100 :] and mem.read(100, 50) == a[:50] and mem.read(200, 96) == b[4000:]
    assert mem.read(MIB, 20) == b[10:30]
    # A range past its object's end is -600; the other keys' ranges are still read.
    assert store.get_into_ranges([mem.addr], [["b", "a"]], [[[0], [10]]], [[[4090], [0]]], [[[10], [5]]]) == \
        [[[INVALID], [5]]]
    assert store.get_into_ranges([mem.addr], [["a"]], [[[0]]], [[[0, 1]]], [[[1]]]) == [[[INVALID]]]


def test_ssd_offload_keeps_evicted_objects_and_unmounts(spawn_master: SpawnMaster, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """setup(enable_ssd_offload=True, ssd_offload_path=...) is tidekv's disk tier: what the master
    evicts from a 1 MiB segment stays readable; a second client's reads of it are counted by the
    holder (get_offload_rpc_read_count); unmount_local_disk_segment takes the tier away."""
    master = spawn_master(disk_write_through="all")
    monkeypatch.setenv("MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES", "16MB")
    holder, reader = MooncakeDistributedStore(), MooncakeDistributedStore()
    assert holder.setup("127.0.0.1", "P2PHANDSHAKE", MIB, 4 * MIB, "tcp", "", master.address,
                        enable_ssd_offload=True, ssd_offload_path=str(tmp_path)) == 0
    assert reader.setup("127.0.0.1", "P2PHANDSHAKE", 0, 4 * MIB, "tcp", "", master.address) == 0
    try:
        assert list(tmp_path.glob("tidekv-*.disk")), "the tier's file is in ssd_offload_path"
        values = {f"k{i}": bytes([i]) * (64 << 10) for i in range(32)}
        for first in range(0, 32, 8):
            for i in range(first, first + 8):
                assert holder.put(f"k{i}", values[f"k{i}"]) == 0
            wait_until(lambda n=first + 8: holder._store.stats()["disk"]["keys"] == n, 10, "objects on disk")
        assert [reader.get(k) == v for k, v in values.items()] == [True] * 32
        assert holder.get_offload_rpc_read_count() > 0, "some objects were read from the holder's disk"
        on_disk = [d for k in values for d in holder.get_replica_desc(k) if d.is_local_disk_replica()]
        assert on_disk and all(not d.is_memory_replica() and d.get_disk_descriptor().object_size == 64 << 10
                               for d in on_disk)
        assert holder.unmount_local_disk_segment() == 0
        assert not list(tmp_path.glob("tidekv-*.disk")), "unmounted: the files are gone"
        assert sum(reader.is_exist(k) == 1 for k in values) < 32, "objects only the disk held left the pool"
    finally:
        reader.close()
        holder.close()


def test_nvme_of_and_dfs_replicas_are_not_dropped_silently(caplog: pytest.LogCaptureFixture,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from tidekv.compat import mooncake_types

    monkeypatch.setattr(mooncake_types, "_OTHER_TIERS", mooncake_types.WarnEvery(60.0))  # not held back
    config = ReplicateConfig()
    config.replica_num, config.dfs_replica_num = 2, 1
    with caplog.at_level(logging.WARNING):
        assert mooncake_types.placement(config)["replicas"] == 2
    assert "dfs_replica_num=1 are not served" in caplog.text and "disk tier" in caplog.text
