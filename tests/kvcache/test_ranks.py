"""Tensor-parallel ranks: the supported engine shapes, every rank's handshake, per-rank store
keys, and "a prefix is stored only as far as every rank's blocks are"."""

from __future__ import annotations

import pytest

from tidekv.errors import ConfigError
from tidekv.kvcache import prefix, ranks
from tidekv.kvcache.layout import KVLayout, LayerLayout
from tidekv.kvcache.ranks import RankedKeys

BLOCK = 4
TOKENS = list(range(5 * BLOCK + 2))  # five full blocks and a partial one


def layout(fingerprint: str, runs_per_layer: int = 1) -> KVLayout:
    """A two-layer layout (addresses do not matter for keys)."""
    runs = tuple((i * 64, 64) for i in range(runs_per_layer))
    layers = tuple(LayerLayout(f"model.layers.{i}.attn", 1 << 20, 8, 64 * runs_per_layer, runs) for i in range(2))
    return KVLayout(layers, BLOCK, fingerprint)


class FakeStore:
    """A set of present keys, and a record of every exists_many call."""

    def __init__(self) -> None:
        self.keys: set[str] = set()
        self.calls = 0

    def put_blocks(self, keys: RankedKeys, rank: int, count: int, skip: int | None = None) -> None:
        """Stores rank ``rank``'s first ``count`` blocks, but for block ``skip``."""
        self.keys |= {k for i, k in enumerate(keys.block_keys(TOKENS)[rank][:count]) if i != skip}

    def exists_many(self, keys: list[str]) -> list[bool]:
        self.calls += 1
        return [k in self.keys for k in keys]


def test_tensor_parallelism_is_allowed_other_splits_are_refused_at_start_up() -> None:
    for tp in (1, 2, 8):
        ranks.check_parallel(tensor_parallel_size=tp)
    with pytest.raises(ConfigError, match=r"pipeline_parallel_size=2 is not supported .* \(allowed: 1; pipeline "
                                          r"stages hold different layers"):
        ranks.check_parallel(tensor_parallel_size=2, pipeline_parallel_size=2)
    with pytest.raises(ConfigError, match=r"decode_context_parallel_size=2 is not supported"):
        ranks.check_parallel(tensor_parallel_size=2, decode_context_parallel_size=2)
    with pytest.raises(ConfigError, match=r"prefill_context_parallel_size=4 is not supported"):
        ranks.check_parallel(tensor_parallel_size=1, prefill_context_parallel_size=4)
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=0 must be >= 1"):
        ranks.check_parallel(tensor_parallel_size=0)


def test_every_ranks_handshake_is_needed() -> None:
    assert ranks.by_rank({1: "b", 0: "a"}, 2) == ["a", "b"]
    with pytest.raises(ConfigError, match=r"heard from tensor-parallel ranks \[0\] of an engine with "
                                          r"tensor_parallel_size=2; every rank's worker must report"):
        ranks.by_rank({0: "a"}, 2)
    with pytest.raises(ConfigError, match=r"ranks \[0, 1\] .* tensor_parallel_size=1"):
        ranks.by_rank({0: "a", 1: "b"}, 1)


def test_ranks_of_one_host_listen_on_ports_of_their_own() -> None:
    assert [ranks.rank_port(5000, r) for r in range(4)] == [5000, 5001, 5002, 5003]
    assert [ranks.rank_port(0, r) for r in range(2)] == [0, 0]
    with pytest.raises(ConfigError, match=r"engine_port=65535 leaves no port for tensor-parallel rank 1 .* "
                                          r"choose engine_port <= 65534, or 0"):
        ranks.rank_port(65535, 1)


def test_data_parallel_engines_of_one_host_take_a_block_of_ports_each() -> None:
    ports = [ranks.rank_port(5000, tp, 2, dp) for dp in range(3) for tp in range(2)]
    assert ports == [5000, 5001, 5002, 5003, 5004, 5005]
    assert ranks.rank_port(0, 1, 2, 1) == 0
    with pytest.raises(ConfigError, match=r"engine_port=65534 leaves no port for data-parallel rank 1, "
                                          r"tensor-parallel rank 0 .* choose engine_port <= 65533, or 0"):
        ranks.rank_port(65534, 0, 2, 1)


def test_layout_tags_differ_by_rank_and_tp_size() -> None:
    tags = {ranks.layout_tag("m|float32", r, n) for n in (1, 2, 4) for r in range(n)}
    assert len(tags) == 7


def test_each_rank_has_its_own_keys_and_other_tp_sizes_share_none() -> None:
    tp2 = RankedKeys.of("m|float32", [layout("f0"), layout("f1")], BLOCK)
    tp1 = RankedKeys.of("m|float32", [layout("f0")], BLOCK)
    assert tp2.tp_size == 2 and tp1.tp_size == 1
    assert len(set(tp2.namespaces) | set(tp1.namespaces)) == 3
    per_rank = tp2.block_keys(TOKENS)
    assert [len(k) for k in per_rank] == [5, 5]  # the partial block has no key
    assert not set(per_rank[0]) & set(per_rank[1])
    assert not set(tp1.block_keys(TOKENS)[0]) & (set(per_rank[0]) | set(per_rank[1]))
    # Even with equal layouts (the usual case: ranks have the same shapes), ranks never share keys.
    same = RankedKeys.of("m|float32", [layout("f"), layout("f")], BLOCK)
    assert not set(same.block_keys(TOKENS)[0]) & set(same.block_keys(TOKENS)[1])


def test_a_prefix_is_stored_only_as_far_as_every_ranks_blocks_are() -> None:
    keys = RankedKeys.of("m|float32", [layout("f0", runs_per_layer=2), layout("f1", runs_per_layer=2)], BLOCK)
    store = FakeStore()
    store.put_blocks(keys, rank=0, count=4)
    assert keys.stored_blocks(TOKENS, 0, 5, store.exists_many) == 0, "rank 1 holds nothing"
    store.put_blocks(keys, rank=1, count=2)
    assert keys.stored_blocks(TOKENS, 0, 5, store.exists_many) == 2
    assert keys.stored_blocks(TOKENS, 1, 5, store.exists_many) == 1, "counted from the first block asked about"
    assert keys.stored_blocks(TOKENS, 0, 1, store.exists_many) == 1, "no further than the limit"
    calls = store.calls
    assert keys.stored_blocks(TOKENS, 3, 3, store.exists_many) == 0
    assert store.calls == calls, "nothing to ask"
    store.keys.clear()
    store.put_blocks(keys, rank=0, count=4)
    store.put_blocks(keys, rank=1, count=4, skip=2)  # rank 1 lacks its third block (evicted)
    assert keys.stored_blocks(TOKENS, 0, 5, store.exists_many) == 2
    store.put_blocks(keys, rank=1, count=4)
    assert keys.stored_blocks(TOKENS, 0, 5, store.exists_many) == 4
    calls = store.calls
    keys.stored_blocks(TOKENS, 0, 5, store.exists_many)
    assert store.calls == calls + 1, "one store round trip for all ranks and blocks"


def test_one_rank_engine_keys_match_the_plain_prefix_keys() -> None:
    from tidekv.kvcache import prefix

    keys = RankedKeys.of("m|float32", [layout("f0")], BLOCK)
    assert keys.namespaces[0] == prefix.namespace("m|float32", "", "f0", BLOCK, 0, 1)
    assert keys.block_keys(TOKENS)[0] == prefix.block_keys(keys.namespaces[0], TOKENS, BLOCK)
    with pytest.raises(ConfigError, match="at least one rank"):
        RankedKeys.of("m", [], BLOCK)


def test_a_block_is_one_store_object_per_rank_however_many_runs_it_has() -> None:
    """32 layers with K and V as separate runs (64 runs a block): one key per block and rank,
    and the presence check asks for exactly those."""
    runs = ((0, 4096), (1 << 20, 4096))  # K, then V, far apart in each layer's tensor
    layers = tuple(LayerLayout(f"model.layers.{i}.attn", (i + 1) << 24, 8, 4096, runs) for i in range(32))
    lay = KVLayout(layers, BLOCK, "f32layers")
    assert len(lay.block_spans(0)) == 64 and lay.block_bytes == 64 * 4096
    keys = RankedKeys.of("m|bfloat16", [lay, lay], BLOCK)
    store = FakeStore()
    for rank in (0, 1):
        store.put_blocks(keys, rank=rank, count=5)
    asked: list[str] = []

    def exists_many(ks: list[str]) -> list[bool]:
        asked.extend(ks)
        return store.exists_many(ks)
    assert keys.stored_blocks(TOKENS, 0, 5, exists_many) == 5
    assert len(asked) == 5 * 2 == len(set(asked)), "one key per block and rank"
    assert all(k.startswith(f"kv{prefix.KEY_SCHEME}/") for k in asked), "the key scheme is in every key"
