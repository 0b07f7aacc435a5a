"""Bytes in, same bytes out: single and batch operations through a real master and holder process.

The pool's memory lives in a holder process (a Store with a segment); the test process is a pure
client (segment 0) that writes and reads it through its own TransferEngine, and a second client
process reads what the first wrote.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.store.conftest import Connect, SpawnAgent
from tests.store.payload import digest, payload
from tests.store.procs import AgentProcess, MasterProcess
from tidekv import TransferConfig, TransferEngine
from tidekv.config import StoreConfig
from tidekv.errors import ConfigError, ObjectNotFoundError
from tidekv.store import Status, Store

MIB = 1 << 20
SEGMENT = 64 * MIB


def _sizes(seed: int) -> list[int]:
    rng = random.Random(seed)
    edges = [1, 2, 63, 64, 65, 4095, 4096, 4097, MIB, 8 * MIB - 1, 8 * MIB]
    return edges + [int(2 ** rng.uniform(0, 23)) for _ in range(12)]


@pytest.fixture
def holder(master: MasterProcess, spawn_agent: SpawnAgent) -> AgentProcess:
    return spawn_agent(master.address, SEGMENT)


@pytest.fixture
def client(master: MasterProcess, holder: AgentProcess, connect: Connect) -> Store:
    return connect(master.address)


def test_round_trips_of_random_sizes(client: Store, holder: AgentProcess, spawn_agent: SpawnAgent,
                                     master: MasterProcess) -> None:
    reader = spawn_agent(master.address)
    src, dst = bytearray(8 * MIB), bytearray(8 * MIB)
    src_region, dst_region = client.register(src), client.register(dst)
    try:
        for i, size in enumerate(_sizes(seed=1)):
            key = f"obj-{i}-{size}"
            data = payload(i, size)
            client.put(key, data)
            got = client.get(key)
            assert len(got) == size and got == data, f"{key}: bytes differ after a round trip"
            assert reader.call("get", key=key) == {"ok": True, "size": size, "digest": digest(data)}

            src[:size] = payload(i + 1000, size)
            client.put_from(f"zc-{key}", (src_region.address, size))
            assert client.get_into(f"zc-{key}", dst_region) == size
            assert dst[:size] == src[:size], f"zc-{key}: bytes differ after a zero-copy round trip"
            client.remove_many([key, f"zc-{key}"], force=True)  # keep the pool from filling
    finally:
        client.unregister(src_region)
        client.unregister(dst_region)
    assert client.stats()["keys"] == 0


def test_objects_larger_than_the_staging_area(master: MasterProcess, holder: AgentProcess, connect: Connect) -> None:
    st = connect(master.address, staging_size_bytes=MIB)
    data = payload(7, 3 * MIB + 5)
    st.put("big", data)
    assert st.get("big") == data
    assert st.get_many(["big", "big"]) == [data, data]


def test_zero_copy_put_from_and_get_into(client: Store, holder: AgentProcess) -> None:
    src = bytearray(payload(3, 2 * MIB))
    dst = bytearray(2 * MIB + 100)
    src_region, dst_region = client.register(src), client.register(dst)
    try:
        client.put_from("region", src_region)
        client.put_from("pair", (src_region.address + 10, 1000))
        client.put_from("buffer", src)  # a plain buffer the engine already knows
        assert client.get_into("region", dst_region) == len(src)
        assert dst[: len(src)] == src and dst[len(src) :] == bytes(100)
        assert client.get_into("pair", (dst_region.address, 1000)) == 1000
        assert dst[:1000] == src[10:1010]
        assert holder.call("get", key="buffer")["digest"] == digest(src)
        with pytest.raises(ConfigError, match="too small"):
            client.get_into("region", (dst_region.address, 100))
        with pytest.raises(ObjectNotFoundError):
            client.get_into("missing", dst_region)
    finally:
        client.unregister(src_region)
        client.unregister(dst_region)


def test_batch_operations(client: Store, holder: AgentProcess) -> None:
    rng = random.Random(5)
    keys = [f"batch-{i}" for i in range(40)]
    values = [payload(100 + i, rng.randint(1, 256 * 1024)) for i in range(40)]
    client.put_many(keys, values)
    probe = [keys[0], "nope-1", keys[17], b"batch-39", "nope-2"]
    assert client.get_many(probe) == [values[0], None, values[17], values[39], None]
    assert client.exists_many(probe) == [True, False, True, True, False]
    assert client.stats()["keys"] == 40
    assert client.remove_many([keys[1], "nope", keys[2]]) == [Status.OK, Status.NOT_FOUND, Status.OK]
    assert client.exists_many(keys[:3]) == [True, False, False]

    sources = [bytearray(payload(200 + i, 1000 * (i + 1))) for i in range(8)]
    targets = [bytearray(8000) for _ in range(8)]
    regions = [client.register(b) for b in sources + targets]
    try:
        client.put_many_from([f"zc-{i}" for i in range(8)], regions[:8])
        sizes = client.get_many_into([f"zc-{i}" for i in range(8)] + ["zc-none"], regions[8:] + [regions[8]])
        assert sizes == [1000 * (i + 1) for i in range(8)] + [None]
        for src, dst in zip(sources, targets):
            assert dst[: len(src)] == src
    finally:
        for r in regions:
            client.unregister(r)


def test_batch_put_reports_failed_keys_and_stores_the_rest(client: Store) -> None:
    bad1, bad2 = "a" * 5000, "b" * 5000  # over the master's max_key_bytes (4096)
    with pytest.raises(ConfigError, match="refused"):
        client.put_many(["good-1", bad1, "good-2"], [b"1", b"2", b"3"])
    assert client.get_many(["good-1", "good-2"]) == [b"1", b"3"]
    with pytest.raises(ConfigError) as info:
        client.put_many([bad1, "good-3", bad2], [b"1", b"2", b"3"])
    assert set(info.value.failed_keys) == {bad1.encode(), bad2.encode()}  # type: ignore[attr-defined]
    assert "2 keys" in str(info.value)
    assert client.get("good-3") == b"2"
    assert client.exists_many([bad1, bad2]) == [False, False]


def test_put_is_immutable_and_upsert_replaces(client: Store) -> None:
    client.put("k", b"first")
    client.put("k", b"second")  # a successful no-op
    assert client.get("k") == b"first"
    client.upsert("k", b"third, and longer")
    assert client.get("k") == b"third, and longer"
    client.upsert("fresh", b"x")
    assert client.get("fresh") == b"x"
    assert client.stats()["keys"] == 2


def test_str_and_bytes_keys_name_the_same_object(client: Store) -> None:
    client.put("ключ", b"v")
    assert client.get("ключ".encode()) == b"v"
    assert client.exists(bytearray("ключ".encode()))
    client.put(b"\x00\xff", b"bin")
    assert client.get(b"\x00\xff") == b"bin"


def test_missing_keys_and_empty_values_raise_typed_errors(client: Store) -> None:
    with pytest.raises(ObjectNotFoundError, match="nope"):
        client.get("nope")
    with pytest.raises(KeyError):  # ObjectNotFoundError is a KeyError too
        client.get("nope")
    with pytest.raises(ObjectNotFoundError):
        client.remove("nope")
    with pytest.raises(ConfigError, match="empty"):
        client.put("empty", b"")
    with pytest.raises(ConfigError, match="key must be str or bytes"):
        client.put(42, b"v")  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        client.put_many(["a", "b"], [b"1"])
    assert client.stats()["used_bytes"] == 0


def test_closing_a_holder_takes_its_objects_out_of_the_pool(master: MasterProcess, connect: Connect) -> None:
    a = connect(master.address, segment_size=4 * MIB)
    b = connect(master.address, segment_size=4 * MIB)
    a.put("on-a", b"a" * 100)
    assert b.get("on-a") == b"a" * 100
    on_a = b.stats()["segments"][a.segment_name]
    assert on_a["used"] - on_a["spare"] == 128, "its object (the rest is a's spare for its next put)"
    a.close()
    stats = b.stats()
    assert list(stats["segments"]) == [b.segment_name]
    assert not b.exists("on-a") and stats["objects_lost"] == 1


def test_one_store_shared_by_threads(client: Store) -> None:
    def work(t: int) -> None:
        rng = random.Random(t)
        for i in range(40):
            key = f"t{t}-{i}"
            data = payload(t * 1000 + i, rng.randint(1, 300_000))
            client.put(key, data)
            assert client.get(key) == data, key
            if i % 3 == 0:
                client.remove(key, force=True)

    with ThreadPoolExecutor(4) as pool:
        for f in [pool.submit(work, t) for t in range(4)]:
            f.result(timeout=60)
    assert client.stats()["keys"] == 4 * 26


def test_empty_batches_are_no_ops(client: Store) -> None:
    client.put_many([], [])
    assert client.get_many([]) == []
    assert client.exists_many([]) == []
    assert client.remove_many([]) == []


@pytest.mark.parametrize("replicas", [0, -1])
def test_bad_replica_count_is_a_config_error_naming_it(client: Store, replicas: int) -> None:
    with pytest.raises(ConfigError, match="replicas"):
        client.put("k", b"v", replicas=replicas)
    assert not client.exists("k")


def test_stores_sharing_one_engine_release_their_memory_on_close(master: MasterProcess) -> None:
    engine = TransferEngine(config=TransferConfig(max_regions=8))
    try:
        keeper = Store.connect(master.address, segment_size=MIB, engine=engine,
                               config=StoreConfig(staging_size_bytes=MIB))
        for i in range(10):  # each store registers a segment and a staging area on the shared engine
            st = Store.connect(master.address, segment_size=MIB, engine=engine,
                               config=StoreConfig(staging_size_bytes=MIB))
            st.put(f"k{i}", b"x" * 100)
            assert keeper.get(f"k{i}") == b"x" * 100
            st.close()
            assert not keeper.exists(f"k{i}"), "a closed store's segment leaves the pool"
        keeper.put("still-open", b"yes")
        assert keeper.get("still-open") == b"yes", "closing a store must not close a shared engine"
        keeper.close()
    finally:
        engine.close()


def test_zero_copy_parts_gather_on_put_and_scatter_on_get(client: Store, holder: AgentProcess) -> None:
    """A list of buffers is one object, their concatenation (layer-first KV pages)."""
    src = bytearray(payload(21, 3 * MIB))
    dst = bytearray(3 * MIB + 4096)
    src_region, dst_region = client.register(src), client.register(dst)
    base, out = src_region.address, dst_region.address
    try:
        parts = [(base + 2 * MIB, MIB), (base, 1000), (base + 5000, 1)]  # out of order, uneven
        client.put_many_from(["parts", "whole"], [parts, [(base, MIB)]])
        expected = bytes(src[2 * MIB : 3 * MIB] + src[:1000] + src[5000:5001])
        assert holder.call("get", key="parts")["digest"] == digest(expected)
        # Read back into other parts: the object fills them in order, the rest stays untouched.
        assert client.get_many_into(["parts"], [[(out, 10), (out + 100, MIB), (out + 2 * MIB, 4096)]]) == [len(expected)]
        got = bytes(dst[:10] + dst[100 : 100 + MIB] + dst[2 * MIB : 2 * MIB + len(expected) - 10 - MIB])
        assert got == expected
        assert dst[2 * MIB + len(expected) - 10 - MIB : 2 * MIB + 4096] == bytes(4096 - (len(expected) - 10 - MIB))
        assert client.get_into("whole", [(out, MIB // 2), (out + MIB, MIB // 2)]) == MIB
        assert dst[: MIB // 2] == src[: MIB // 2] and dst[MIB : MIB + MIB // 2] == src[MIB // 2 : MIB]
        with pytest.raises(ConfigError, match="too small") as info:
            client.get_many_into(["whole", "parts"], [[(out, MIB)], [(out, 10), (out + 100, 10)]])
        assert set(info.value.failed_keys) == {b"parts"}  # type: ignore[attr-defined]
    finally:
        client.unregister(src_region)
        client.unregister(dst_region)


def test_a_single_failed_key_of_a_batch_is_named(client: Store) -> None:
    with pytest.raises(ConfigError) as info:
        client.put_many(["fine", "c" * 5000], [b"1", b"2"])
    assert set(info.value.failed_keys) == {b"c" * 5000}  # type: ignore[attr-defined]


def test_preferred_segment_places_the_replica(master: MasterProcess, holder: AgentProcess, connect: Connect) -> None:
    own = connect(master.address, segment_size=4 * MIB)
    own.put("mine", b"m" * 100)
    own.put("theirs", b"t" * 100, preferred_segment=holder.segment)
    own.put_many(["theirs-2"], [b"z" * 100], preferred_segment=holder.segment)
    assert own.locate_many(["mine", "theirs", "theirs-2"]) == [[own.engine.name], [holder.engine], [holder.engine]]


def test_get_ranges_into_reads_byte_ranges_of_objects(client: Store, holder: AgentProcess) -> None:
    data = payload(31, MIB)
    client.put_many(["r1", "r2"], [data, data[:1000]])
    dst = bytearray(8192)
    region = client.register(dst)
    base = region.address
    try:
        sizes = client.get_ranges_into(["r1", "missing", "r2"], [
            [(MIB - 100, (base, 100)), (0, (base + 100, 10))],
            [(0, (base + 200, 10))],
            [(990, (base + 300, 10)), (5, (base + 400, 0))],
        ])
        assert sizes == [MIB, None, 1000]
        assert dst[:100] == data[MIB - 100 :] and dst[100:110] == data[:10] and dst[300:310] == data[990:1000]
        assert dst[200:210] == bytes(10)
        with pytest.raises(ConfigError, match="outside") as info:
            client.get_ranges_into(["r2", "r1"], [[(995, (base, 10))], [(0, (base, 10))]])
        assert set(info.value.failed_keys) == {b"r2"}  # type: ignore[attr-defined]
    finally:
        client.unregister(region)
