"""Store-backed prefix reuse without any engine: the scheduler half (``prefix_reuse``: matched
tokens, load and save plans) and the workers' half (``block_store``: blocks to and from the
store; ``SaveQueue``), as the vLLM and TensorRT-LLM connectors drive them. Two instances share a
real master: one saves a prompt's blocks from its KV cache, the other finds them, loads them into
other block ids of its own cache, and gets the same bytes."""

from __future__ import annotations

import random
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.store.conftest import spawn_master  # noqa: F401 (fixture)
from tests.store.conftest import SpawnMaster
from tests.store.procs import wait_until
from tidekv.config import StoreConfig
from tidekv.errors import MasterUnavailableError
from tidekv.kvcache.block_store import SaveQueue, load_blocks, save_blocks
from tidekv.kvcache.layout import KVLayout
from tidekv.kvcache.prefix_reuse import BlockJob, PrefixReuse
from tidekv.kvcache.ranks import RankedKeys
from tidekv.store import Store
from tidekv.transfer import TransferEngine

BS = 4  # tokens per block
NUM_BLOCKS = 16


class _Link:
    """What PrefixReuse asks of a StoreLink: the client while up, and lost()."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.lost_with: list[BaseException] = []

    def lost(self, exc: BaseException) -> None:
        self.lost_with.append(exc)


class _Presence:
    """A store's presence check of a fixed set of keys (the scheduler's only store call)."""

    def __init__(self, keys: set[str]) -> None:
        self.keys = keys
        self.error: Exception | None = None

    def exists_leased(self, keys: list[str]) -> list[bool]:
        if self.error is not None:
            raise self.error
        return [k in self.keys for k in keys]


def _pool(seed: int) -> torch.Tensor:
    """A TensorRT-LLM-shaped KV pool: [blocks, layers, 2 (K and V), tokens * heads * dim]."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-1000, 1000, (NUM_BLOCKS, 2, 2, BS * 8), generator=g, dtype=torch.int16)


def _reuse(layout: KVLayout, store: Any, **kw: Any) -> PrefixReuse:
    reuse = PrefixReuse(BS, _Link(store), **kw)  # type: ignore[arg-type]
    reuse.keys = RankedKeys.of("model|int16|tp0/1", [layout], BS)
    return reuse


@pytest.fixture
def layout() -> KVLayout:
    return KVLayout.from_tensors({"pool": _pool(0)}, BS, "model|int16|tp0/1")


def test_matched_tokens_counts_whole_stored_blocks_and_leaves_the_last_token(layout: KVLayout) -> None:
    reuse = _reuse(layout, _Presence(set()))
    prompt = list(range(100, 122))  # 5 full blocks and 2 tokens
    assert reuse.keys is not None
    keys = reuse.keys.block_keys(prompt)[0]
    presence = reuse.link.store  # type: ignore[union-attr]
    assert reuse.matched_tokens(prompt, 0) == 0
    presence.keys = set(keys[:3])
    assert reuse.matched_tokens(prompt, 0) == 12
    assert reuse.matched_tokens(prompt, 4) == 8  # one block computed on the engine already
    assert reuse.matched_tokens(prompt, 12) == 0
    presence.keys = set(keys[:1] + keys[2:])  # a hole at block 1: the run stops there
    assert reuse.matched_tokens(prompt, 0) == 4
    presence.keys = set(keys)
    assert reuse.matched_tokens(prompt, 0) == 20
    aligned = prompt[:20]  # every block stored: all tokens but the last (the engine computes it)
    assert reuse.matched_tokens(aligned, 0) == 19
    reuse.keys = None  # no layout yet: nothing is looked up
    assert reuse.matched_tokens(prompt, 0) == 0


def test_lookup_failures_turn_reuse_off_or_cost_one_prompt(layout: KVLayout) -> None:
    presence = _Presence(set())
    reuse = _reuse(layout, presence)
    presence.error = MasterUnavailableError("master 127.0.0.1:1 does not answer")
    assert reuse.matched_tokens(list(range(40)), 0) == 0
    assert reuse.link.lost_with == [presence.error]  # type: ignore[union-attr]
    from tidekv.errors import StoreError

    presence.error = StoreError("something else")
    assert reuse.matched_tokens(list(range(40)), 0) == 0
    assert len(reuse.link.lost_with) == 1  # type: ignore[union-attr]


def test_every_full_block_is_saved_exactly_once(layout: KVLayout) -> None:
    rng = random.Random(7)
    for trial in range(50):
        reuse = _reuse(layout, _Presence(set()))
        prompt = [rng.randrange(1000) for _ in range(rng.randrange(1, 60))]
        blocks = rng.sample(range(100), -(-len(prompt) // BS))
        local = rng.randrange(0, len(prompt)) // BS * BS  # computed on the engine before us
        ext = rng.choice([0, BS, 2 * BS]) if local + 2 * BS < len(prompt) else 0
        reuse.expect_load(f"r{trial}", ext)
        first = -(-(local + ext) // BS) + 1  # the engine allocates what the first step needs
        load = reuse.start(f"r{trial}", prompt, blocks[:first], local)
        reuse.extend(f"r{trial}", blocks[first:])  # and the rest as the request grows
        loaded = load.blocks if load is not None else []
        saved: list[int] = []
        computed = local + ext
        while computed < len(prompt) + 3:  # steps of random sizes, then decode steps
            computed += rng.randrange(1, 9)
            job = reuse.plan_save(f"r{trial}", computed)
            if job is not None:
                assert job.keys[0] == reuse.keys.block_keys(prompt)[0][blocks.index(job.blocks[0]):][:len(job.blocks)]  # type: ignore[union-attr]
                saved += job.blocks
        full = len(prompt) // BS
        assert sorted(saved + loaded + blocks[:local // BS]) == sorted(blocks[:max(full, local // BS + len(loaded))])
        assert len(saved) == len(set(saved))
        assert reuse.finish(f"r{trial}") == bool(saved)
        assert reuse.plan_save(f"r{trial}", 1000) is None  # forgotten


def test_a_resumed_request_saves_again_from_its_new_blocks(layout: KVLayout) -> None:
    reuse = _reuse(layout, _Presence(set()))
    prompt = list(range(16))
    reuse.start("r", prompt, [1, 2, 3, 4], 0)
    assert reuse.plan_save("r", 16).blocks == [1, 2, 3, 4]  # type: ignore[union-attr]
    reuse.extend("r", [9, 8, 7, 6], is_resumed=True)  # preempted: its old blocks are gone
    job = reuse.plan_save("r", 16)
    assert job is not None and job.blocks == [9, 8, 7, 6]


def test_nothing_is_saved_without_a_store_or_a_layout(layout: KVLayout) -> None:
    reuse = PrefixReuse(BS, None)
    reuse.start("r", list(range(16)), [1, 2, 3, 4], 0)
    assert reuse.plan_save("r", 16) is None and not reuse.finish("r")


@pytest.fixture
def master_address(spawn_master: SpawnMaster) -> str:
    return spawn_master().address


class _Instance:
    """One engine instance: a KV pool registered on its transfer engine, a store client on it."""

    def __init__(self, address: str, seed: int) -> None:
        self.pool = _pool(seed)
        self.layout = KVLayout.from_tensors({"pool": self.pool}, BS, "model|int16|tp0/1")
        self.engine = TransferEngine()
        for addr, length in self.layout.memory_ranges():
            self.engine.register((addr, length))
        self.store = Store.connect(address, segment_size=4 << 20, engine=self.engine,
                                   config=StoreConfig(rpc_timeout_s=5, staging_size_bytes=1 << 20))
        self.reuse = _reuse(self.layout, self.store)

    def close(self) -> None:
        self.store.close()
        self.engine.close()


@pytest.fixture
def two_instances(master_address: str) -> Iterator[tuple[_Instance, _Instance]]:
    a, b = _Instance(master_address, 1), _Instance(master_address, 2)
    yield a, b
    a.close()
    b.close()


def test_one_instance_loads_the_prefix_another_saved(two_instances: tuple[_Instance, _Instance]) -> None:
    a, b = two_instances
    prompt = list(range(500, 522))  # 5 full blocks and 2 tokens
    assert a.reuse.matched_tokens(prompt, 0) == 0
    assert a.reuse.start("a1", prompt, [3, 7, 1, 9, 12, 5], 0) is None
    for computed in (10, 22, 23):  # two prefill chunks, one decode step
        job = a.reuse.plan_save("a1", computed)
        if job is not None:
            save_blocks(a.store, a.layout, 0, job)
    assert a.reuse.finish("a1")

    assert b.reuse.matched_tokens(prompt, 0) == 20
    b.reuse.expect_load("b1", 20)
    load = b.reuse.start("b1", prompt, [0, 2, 4, 6, 8, 10], 0)
    assert load is not None and load.blocks == [0, 2, 4, 6, 8]
    assert load_blocks(b.store, b.layout, 0, [load]) == set()
    for mine, theirs in zip([0, 2, 4, 6, 8], [3, 7, 1, 9, 12]):
        assert torch.equal(b.pool[mine], a.pool[theirs])  # byte for byte
    assert b.reuse.plan_save("b1", 22) is None  # loaded blocks are not saved again
    assert b.reuse.matched_tokens(prompt[:12] + [0] * 10, 0) == 12  # diverges in block 3

    # A chunk the scheduler saw but that was evicted since: reported, its bytes unused.
    assert b.reuse.keys is not None
    b.store.remove(b.reuse.keys.block_keys(prompt)[0][2], force=True)  # our own read lease
    again = BlockJob("b2", [11, 13, 14], [b.reuse.keys.block_keys(prompt)[0][:3]])
    assert load_blocks(b.store, b.layout, 0, [again]) == {14}


def test_save_queue_frees_a_finished_request_only_after_its_saves() -> None:
    saves = SaveQueue()
    gate = threading.Event()
    order: list[str] = []
    saves.submit("a", lambda: (gate.wait(10), order.append("a1")))
    saves.submit("a", order.append, "a2")
    saves.mark_saved("b")
    assert saves.finished({"a", "b", "c"}) == {"b"}  # c had no saves: not ours to report
    assert saves.is_waiting("a") and not saves.is_waiting("b")
    assert saves.finished(set()) == set()
    gate.set()
    deadline = time.monotonic() + 10
    done: set[str] = set()
    while not done and time.monotonic() < deadline:
        done = saves.finished(set())
    assert done == {"a"} and order == ["a1", "a2"]
    assert saves.finished({"a"}) == set()  # reported once
    # Preempted: wait() returns once its save ended. Ordered by events, not a sleep: the save ends
    # only once this (the step) thread is blocked inside wait(), so a wait() that did not wait for
    # it would return first, and the order says so.
    step, seen = threading.get_ident(), []

    def save_p() -> None:
        wait_until(lambda: _inside(step, SaveQueue.wait), 10.0, "the step thread to wait for the save")
        seen.append("save ended")

    saves.submit("p", save_p)
    saves.wait("p")
    seen.append("wait returned")
    assert seen == ["save ended", "wait returned"], "wait() returned before the save ended"
    assert saves.finished({"p"}) == set()
    saves.shutdown()


def _inside(thread_id: int, fn: Any) -> bool:
    """Whether the thread ``thread_id`` is running ``fn`` now (``fn``'s frame is on its stack)."""
    frame = sys._current_frames().get(thread_id)
    while frame is not None:
        if frame.f_code is fn.__code__:
            return True
        frame = frame.f_back
    return False
