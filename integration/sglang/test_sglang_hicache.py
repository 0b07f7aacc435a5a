"""The tidekv HiCache backend against SGLang's real interfaces: built by SGLang's own
``StorageBackendFactory`` from the dynamic config, driven on real SGLang host pools
(``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost`` on CPU), with a ``tidekv up`` pool in a
child process. Pages are compared byte for byte.
"""

from __future__ import annotations

import hashlib
import random
import threading
from pathlib import Path
from typing import Any

import pytest

import sglang_rig
from sglang_rig import PoolShape, host_indices, page_bytes, page_hashes

SHAPES = {
    "mha-bf16-page_first": PoolShape(),
    "mha-fp16-page_first_direct": PoolShape(dtype="float16", layout="page_first_direct", heads=4, head_dim=32),
    "mla-bf16-page_first": PoolShape(is_mla=True),
}


def make_backend(master: str, *, tp_rank: int = 0, is_mla: bool = False, enable_metrics: bool = False,
                 **settings: Any) -> Any:
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    config = sglang_rig.storage_config(sglang_rig.tidekv_extra_config(master, **settings), tp_rank=tp_rank,
                                       tp_size=max(2, tp_rank + 1), is_mla=is_mla, enable_metrics=enable_metrics)
    return StorageBackendFactory.create_backend("dynamic", config, None)


@pytest.fixture
def backends() -> Any:
    made: list[Any] = []
    yield made
    for b in made:
        b.close()


def attach(backends: list[Any], master: str, shape: PoolShape, **kw: Any) -> tuple[Any, Any]:
    backend = make_backend(master, is_mla=shape.is_mla, **kw)
    backends.append(backend)
    pool = sglang_rig.make_host_pool(shape)
    backend.register_mem_pool_host(pool)
    return backend, pool


def test_factory_builds_the_backend_from_the_dynamic_config(master: str, backends: list[Any]) -> None:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

    from tidekv_sglang.hicache import TidekvHiCacheStorage

    backend = make_backend(master, segment_size="64MiB", replicas=1, extra_backend_tag="tenantA",
                           prefetch_threshold=256)  # SGLang's own key passes through
    backends.append(backend)
    assert type(backend) is TidekvHiCacheStorage and isinstance(backend, HiCacheStorage)
    assert backend.settings.master == master and backend.settings.segment_size == 64 << 20
    assert backend.page_keys.keys(["h"]) == ["tenantA_tidekv-test-tiny-llama_h_0_k", "tenantA_tidekv-test-tiny-llama_h_0_v"]


@pytest.mark.parametrize("settings, message", [
    ({"segmnet_size": 1}, "unknown tidekv HiCache setting(s) ['segmnet_size']"),
    ({"master": "no-port"}, "master='no-port' must be 'host:port' of a tidekv master"),
    ({"segment_size": "lots"}, "segment_size='lots' is not a size"),
    ({"replicas": 0}, "replicas=0 must be an integer 1..16"),
    ({"transport": "rdma"}, "transport='rdma' is invalid"),
])
def test_a_bad_config_is_rejected_with_a_clear_error(master: str, settings: dict[str, Any], message: str) -> None:
    from tidekv.errors import ConfigError

    settings = {"master": master, **settings}
    with pytest.raises(ConfigError) as err:
        make_backend(settings.pop("master"), **settings)
    assert message in str(err.value)


def test_no_master_anywhere_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    from tidekv.errors import ConfigError

    monkeypatch.delenv("TIDEKV_MASTER", raising=False)
    extra = sglang_rig.tidekv_extra_config("x:1")
    del extra["master"]
    with pytest.raises(ConfigError, match="no tidekv master"):
        StorageBackendFactory.create_backend("dynamic", sglang_rig.storage_config(extra), None)


def test_a_master_that_is_not_there_fails_start_up(monkeypatch: pytest.MonkeyPatch) -> None:
    from tidekv.errors import MasterUnavailableError

    monkeypatch.setenv("TIDEKV_STORE_RPC_TIMEOUT_S", "0.5")
    with pytest.raises(MasterUnavailableError):
        make_backend("127.0.0.1:1", rpc_timeout_s=0.3)


@pytest.mark.parametrize("name", SHAPES)
def test_set_get_round_trip_byte_for_byte(master: str, backends: list[Any], name: str) -> None:
    shape = SHAPES[name]
    writer, wpool = attach(backends, master, shape)
    reader, rpool = attach(backends, master, shape)
    pages, hashes = [3, 7, 1, 12, 30], page_hashes(5, seed=1)
    sglang_rig.fill_pages(wpool, pages, seed=5)
    assert writer.batch_set_v1(hashes, host_indices(wpool, pages)) == [True] * 5
    assert writer.batch_set_v1(hashes, host_indices(wpool, pages)) == [True] * 5  # already stored: no-op
    targets = [40, 41, 2, 50, 8]
    assert reader.batch_get_v1(hashes, host_indices(rpool, targets)) == [True] * 5
    for src, dst in zip(pages, targets):
        assert page_bytes(rpool, dst) == page_bytes(wpool, src)
    # The objects carry SGLang's key form: model prefix, hash, tp rank (MHA) or none (MLA), k / v.
    per_page = ["__k"] if shape.is_mla else ["_0_k", "_0_v"]
    expected = [f"tidekv-test-tiny-llama_{h}{s}" for h in hashes for s in per_page]
    assert writer.store.exists_many(expected) == [True] * len(expected)
    # Pages not in the store come back False and leave their slots alone.
    before = page_bytes(rpool, 60)
    assert reader.batch_get_v1(page_hashes(1, seed=99), host_indices(rpool, [60])) == [False]
    assert page_bytes(rpool, 60) == before


def test_batch_exists_counts_consecutive_hits(master: str, backends: list[Any]) -> None:
    backend, pool = attach(backends, master, PoolShape())
    hashes = page_hashes(8, seed=2)
    stored = [0, 1, 2, 3, 4, 6, 7]  # page 5 missing
    sglang_rig.fill_pages(pool, stored, seed=1)
    assert all(backend.batch_set_v1([hashes[i] for i in stored], host_indices(pool, stored)))
    assert backend.batch_exists(hashes) == 5
    assert backend.batch_exists(hashes[:3]) == 3
    assert backend.batch_exists(hashes[5:]) == 0
    assert backend.batch_exists([]) == 0
    assert backend.exists(hashes[6]) and not backend.exists(hashes[5])
    # A page counts only when all its objects are there: drop page 2's v object.
    backend.store.remove(backend.page_keys.keys([hashes[2]])[1], force=True)
    assert backend.batch_exists(hashes) == 2


def test_tp_ranks_store_separate_slices_and_mla_ranks_share_one(master: str, backends: list[Any]) -> None:
    hashes = page_hashes(2, seed=3)
    rank0, pool0 = attach(backends, master, PoolShape(), tp_rank=0)
    rank1, pool1 = attach(backends, master, PoolShape(), tp_rank=1)
    sglang_rig.fill_pages(pool0, [0, 1], seed=10)
    sglang_rig.fill_pages(pool1, [0, 1], seed=11)
    assert all(rank0.batch_set_v1(hashes, host_indices(pool0, [0, 1])))
    assert rank1.batch_exists(hashes) == 0  # rank 1's heads are not stored yet
    assert all(rank1.batch_set_v1(hashes, host_indices(pool1, [0, 1])))
    assert all(rank0.batch_get_v1(hashes, host_indices(pool0, [5, 6])))
    assert all(rank1.batch_get_v1(hashes, host_indices(pool1, [5, 6])))
    assert page_bytes(pool0, 5) == page_bytes(pool0, 0) != page_bytes(pool1, 5) == page_bytes(pool1, 0)
    mla0, mpool0 = attach(backends, master, PoolShape(is_mla=True), tp_rank=0)
    mla1, mpool1 = attach(backends, master, PoolShape(is_mla=True), tp_rank=1)
    sglang_rig.fill_pages(mpool0, [0, 1], seed=12)
    assert all(mla0.batch_set_v1(hashes, host_indices(mpool0, [0, 1])))
    assert mla1.batch_exists(hashes) == 2
    assert all(mla1.batch_get_v1(hashes, host_indices(mpool1, [3, 4])))
    assert page_bytes(mpool1, 3) == page_bytes(mpool0, 0)


def test_tensor_path_and_its_interop_with_zero_copy(master: str, backends: list[Any]) -> None:
    import torch

    backend, pool = attach(backends, master, PoolShape())
    hashes = page_hashes(3, seed=4)
    sglang_rig.fill_pages(pool, [0, 1, 2], seed=3)
    # SGLang's generic write-back: flat data pages.
    pages = [pool.get_data_page(p * pool.page_size, flat=True) for p in (0, 1)]
    assert backend.batch_set(hashes[:2], pages) is True
    assert backend.set(hashes[2], pool.get_data_page(2 * pool.page_size, flat=True)) is True
    # Read back through the zero-copy path: same bytes.
    assert backend.batch_get_v1(hashes, host_indices(pool, [10, 11, 12])) == [True] * 3
    for p in range(3):
        assert page_bytes(pool, 10 + p) == page_bytes(pool, p)
    # SGLang's generic prefetch: dummy flat pages, then set_from_flat_data_page.
    dummies = [pool.get_dummy_flat_data_page() for _ in range(3)]
    got = backend.batch_get(hashes + page_hashes(1, seed=77), dummies + [pool.get_dummy_flat_data_page()])
    assert got[3] is None and all(g is d for g, d in zip(got[:3], dummies))
    for p, d in enumerate(dummies):
        pool.set_from_flat_data_page((20 + p) * pool.page_size, d)
        assert page_bytes(pool, 20 + p) == page_bytes(pool, p)
    fresh = backend.get(hashes[0])
    assert isinstance(fresh, torch.Tensor) and fresh.numel() == PoolShape().page_bytes
    assert backend.get(page_hashes(1, seed=78)[0], pool.get_dummy_flat_data_page()) is None


def test_concurrent_prefetch_and_write_back(master: str, backends: list[Any]) -> None:
    shape = PoolShape(pages=96)
    backend, pool = attach(backends, master, shape)
    hashes = page_hashes(48, seed=6)
    src_pages = list(range(48))  # pages 0..47 hold the data, 48..95 are prefetch targets
    sglang_rig.fill_pages(pool, src_pages, seed=8)
    expected = {h: hashlib.sha256(page_bytes(pool, p)).hexdigest() for h, p in zip(hashes, src_pages)}
    errors: list[str] = []
    stop = threading.Event()

    def writer(chunk: list[int]) -> None:
        for i in range(0, len(chunk), 4):
            part = chunk[i:i + 4]
            if not all(backend.batch_set_v1([hashes[p] for p in part], host_indices(pool, part))):
                errors.append(f"write of pages {part} failed")

    def prefetcher(worker: int) -> None:
        rng = random.Random(worker)
        targets = list(range(48 + worker * 24, 48 + (worker + 1) * 24))
        while not stop.is_set():
            start = rng.randrange(0, 40)
            want = hashes[start:start + 8]
            hits = backend.batch_exists(want)
            if not hits:
                continue
            got = backend.batch_get_v1(want[:hits], host_indices(pool, targets[:hits]))
            for h, ok, t in zip(want, got, targets):
                if ok and hashlib.sha256(page_bytes(pool, t)).hexdigest() != expected[h]:
                    errors.append(f"prefetched page {h[:8]} differs")

    writers = [threading.Thread(target=writer, args=(src_pages[i::2],)) for i in range(2)]
    readers = [threading.Thread(target=prefetcher, args=(w,)) for w in range(2)]
    for t in readers + writers:
        t.start()
    for t in writers:
        t.join(timeout=120)
    stop.set()
    for t in readers:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in readers + writers)
    assert errors == []
    assert backend.batch_exists(hashes) == 48
    assert all(backend.batch_get_v1(hashes[:24], host_indices(pool, list(range(48, 72)))))
    assert all(hashlib.sha256(page_bytes(pool, 48 + i)).hexdigest() == expected[hashes[i]] for i in range(24))


def test_two_processes_on_one_master_see_each_others_pages(master: str, backends: list[Any], tmp_path: Path) -> None:
    shape = PoolShape()
    spec = {"master": master, "segment_size": 32 << 20, "shape": {"pages": shape.pages}}
    peer = sglang_rig.LineChild("hicache_peer.py", spec, tmp_path / "peer.log")
    try:
        backend, pool = attach(backends, master, shape, segment_size=32 << 20)
        sglang_rig.swap_pages_with(peer, backend, pool)
    finally:
        peer.stop()


def test_stats_and_clear(master: str, backends: list[Any]) -> None:
    backend, pool = attach(backends, master, PoolShape(), enable_metrics=True)
    hashes = page_hashes(4, seed=30)
    sglang_rig.fill_pages(pool, [0, 1, 2, 3], seed=1)
    assert all(backend.batch_set_v1(hashes, host_indices(pool, [0, 1, 2, 3])))
    assert all(backend.batch_get_v1(hashes[:2], host_indices(pool, [4, 5])))
    stats = backend.get_stats()
    assert stats.backup_pgs == [4] and stats.prefetch_pgs == [2]
    assert stats.backup_bandwidth[0] > 0 and stats.prefetch_bandwidth[0] > 0
    assert backend.get_stats().backup_pgs == []  # drained
    backend.clear()
    assert backend.batch_exists(hashes) == 0


def test_layouts_without_one_span_per_component_are_refused(master: str, backends: list[Any]) -> None:
    from tidekv.errors import ConfigError

    backend = make_backend(master)
    backends.append(backend)
    with pytest.raises(ConfigError, match="--hicache-mem-layout layer_first"):
        backend.register_mem_pool_host(sglang_rig.make_host_pool(PoolShape(layout="layer_first")))


def test_unsupported_parallel_layouts_are_refused(master: str) -> None:
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    from tidekv.errors import ConfigError

    config = sglang_rig.storage_config(sglang_rig.tidekv_extra_config(master))
    config.should_split_heads, config.tp_lcm_size = True, 4
    with pytest.raises(ConfigError, match="tp_lcm_size"):
        StorageBackendFactory.create_backend("dynamic", config, None)
