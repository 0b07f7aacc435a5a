"""SGLang's own mooncake HiCache backend (``MooncakeStore``, unmodified) on tidekv through the
Mooncake drop-in: built by SGLang's ``StorageBackendFactory`` from its extra config, driven on
SGLang's real host pools (``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost`` on CPU) against a
``tidekv up`` pool in a child process. Pages are compared byte for byte.

``integration/setup_sglang.sh`` installs the drop-in (``plugins/mooncake``) into the SGLang venv;
without it these tests skip naming it. vLLM's ``MooncakeStoreConnector`` cannot run on CPU torch
(it creates ``torch.cuda.Event``s): its calls are covered by ``tests/compat/test_mooncake_store.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import sglang_rig
from sglang_rig import PoolShape, host_indices, page_bytes, page_hashes


def _shim_missing() -> str | None:
    try:
        import mooncake
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        return f"the Mooncake drop-in is not installed ({exc}); run integration/setup_sglang.sh"
    if not getattr(mooncake, "IS_TIDEKV_SHIM", False):
        return f"`mooncake` here is not tidekv's drop-in but {mooncake.__file__}; run integration/setup_sglang.sh"
    return None


pytestmark = pytest.mark.skipif(_shim_missing() is not None, reason=str(_shim_missing()))

SHAPES = {
    "mha-bf16-page_first": PoolShape(),
    "mha-fp16-page_first_direct": PoolShape(dtype="float16", layout="page_first_direct", heads=4, head_dim=32),
    "mla-bf16-page_first": PoolShape(is_mla=True),
}


@pytest.fixture
def backends(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("TIDEKV_STORE_FAILOVER_TIMEOUT_S", "1")  # a gone master fails in seconds, not 15
    made: list[Any] = []
    yield made
    for b in made:
        b.store.close()  # SGLang's close() is a no-op: it leaves the store to its destructor


def attach(backends: list[Any], master: str, shape: PoolShape, **extra: Any) -> tuple[Any, Any]:
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    pool = sglang_rig.make_host_pool(shape)
    config = sglang_rig.storage_config(sglang_rig.mooncake_extra_config(master, **extra), is_mla=shape.is_mla)
    backend = StorageBackendFactory.create_backend("mooncake", config, pool)
    backends.append(backend)
    backend.register_mem_pool_host(pool)
    return backend, pool


def test_factory_builds_sglangs_mooncake_store_on_the_drop_in(master: str, backends: list[Any]) -> None:
    from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStore

    from tidekv.compat.mooncake_store import MooncakeDistributedStore

    backend, _ = attach(backends, master, PoolShape())  # setup, its warm-up put / is_exist / get passed
    assert type(backend) is MooncakeStore and type(backend.store) is MooncakeDistributedStore
    assert backend.store.health_check() == 0


@pytest.mark.parametrize("name", SHAPES)
def test_zero_copy_set_get_round_trip_byte_for_byte(master: str, backends: list[Any], name: str) -> None:
    shape = SHAPES[name]
    writer, wpool = attach(backends, master, shape)
    reader, rpool = attach(backends, master, shape)
    pages, hashes = [3, 7, 1, 12, 30], page_hashes(5, seed=1)
    sglang_rig.fill_pages(wpool, pages, seed=5)
    assert writer.batch_set_v1(hashes, host_indices(wpool, pages)) == [True] * 5
    assert writer.batch_set_v1(hashes, host_indices(wpool, pages)) == [True] * 5  # already stored
    targets = [40, 41, 2, 50, 8]
    assert reader.batch_get_v1(hashes, host_indices(rpool, targets)) == [True] * 5
    for src, dst in zip(pages, targets):
        assert page_bytes(rpool, dst) == page_bytes(wpool, src)
    # SGLang's mooncake key form: model prefix, hash, tp rank (MHA) or nothing (MLA), k / v.
    per_page = ["__k"] if shape.is_mla else ["_0_k", "_0_v"]
    expected = [f"tidekv-test-tiny-llama_{h}{s}" for h in hashes for s in per_page]
    assert reader.store.batch_is_exist(expected) == [1] * len(expected)
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
    # exists() takes an object's key as it is stored (SGLang's mooncake backend adds nothing to it).
    assert backend.exists(f"tidekv-test-tiny-llama_{hashes[6]}_0_k")
    assert not backend.exists(f"tidekv-test-tiny-llama_{hashes[5]}_0_k")


def test_two_processes_read_each_others_pages(master: str, backends: list[Any], tmp_path: Path) -> None:
    shape = PoolShape()
    spec = {"backend": "mooncake", "master": master, "segment_size": 32 << 20, "shape": {"pages": shape.pages}}
    peer = sglang_rig.LineChild("hicache_peer.py", spec, tmp_path / "peer.log")
    try:
        backend, pool = attach(backends, master, shape, global_segment_size=32 << 20)
        sglang_rig.swap_pages_with(peer, backend, pool)
    finally:
        peer.stop()


def test_clear_removes_the_pages(master: str, backends: list[Any]) -> None:
    backend, pool = attach(backends, master, PoolShape())
    hashes = page_hashes(2, seed=30)
    sglang_rig.fill_pages(pool, [0, 1], seed=1)
    assert all(backend.batch_set_v1(hashes, host_indices(pool, [0, 1])))
    backend.clear()  # remove_all(): lists the keys and removes them
    assert backend.batch_exists(hashes) == 0


def test_a_master_that_goes_away_fails_gets_and_sets_without_raising(spawn_pool: Any, backends: list[Any]) -> None:
    pool_proc = spawn_pool()
    backend, pool = attach(backends, pool_proc.master, PoolShape())
    hashes = page_hashes(3, seed=40)
    sglang_rig.fill_pages(pool, [0, 1, 2], seed=3)
    assert all(backend.batch_set_v1(hashes, host_indices(pool, [0, 1, 2])))
    pool_proc.__exit__()  # the master and the pool's memory go away
    assert backend.batch_exists(hashes) == 0
    assert backend.batch_get_v1(hashes, host_indices(pool, [5, 6, 7])) == [False] * 3
    assert backend.batch_set_v1(page_hashes(2, seed=41), host_indices(pool, [0, 1])) == [False] * 2
