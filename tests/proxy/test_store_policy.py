"""``--policy store``: the prefill instance whose store segment holds the most leading KV blocks
of the prompt, asked of a real master; fake prefill/decode backends over loopback HTTP."""

from __future__ import annotations

import logging
import time

import pytest

from tests.proxy.conftest import MakeBackend, StartProxy
from tests.proxy.fakes import FakeBackend, Mode, handoff_params, http_request
from tests.store.conftest import connect, spawn_master  # noqa: F401 (fixtures)
from tests.store.conftest import Connect, SpawnMaster
from tidekv.errors import ConfigError
from tidekv.kvcache.contract import PROTOCOL_VERSION
from tidekv.proxy import ProxyConfig, Router, RoutingPolicy
from tidekv.proxy.store_policy import (
    STORE_TIMEOUT_S,
    StoreCard,
    held_by_instance,
    leading_held,
    prompt_token_ids,
    tokenize_request,
)

MIB = 1 << 20
NS = "kv/test-namespace"
BLOCK = 4
PROMPT = "shared system prompt: be brief. "  # 32 bytes = 32 tokens of the fake tokenizer = 8 blocks


def card(*engines: str, namespace: str = NS) -> StoreCard:
    """The card of an instance with a rank per engine, rank r's keys in ``namespace/r``."""
    return StoreCard(tuple(f"{namespace}/{r}" for r in range(len(engines))), BLOCK, engines)


# ---- pieces -------------------------------------------------------------------------------


@pytest.mark.parametrize("engines", [("127.0.0.1:7",), ("127.0.0.1:7", "127.0.0.1:8")])
def test_store_card_is_read_from_a_prefills_params_or_not_at_all(engines: tuple[str, ...]) -> None:
    ours = card(*engines)
    assert StoreCard.from_params(handoff_params("r", "e", ours)) == ours
    saves_nothing = handoff_params("r", "e")
    for bad in (saves_nothing,
                {**handoff_params("r", "e", ours), "protocol_version": PROTOCOL_VERSION + 1},  # another tidekv
                {**handoff_params("r", "e", ours), "block_size": "4"},  # malformed
                {"prefix_namespace": NS, "block_size": BLOCK, "remote_engine": "e"}):  # unversioned
        assert StoreCard.from_params(bad) is None, bad


def test_a_store_card_has_a_namespace_and_an_engine_per_rank() -> None:
    with pytest.raises(ConfigError, match="one namespace and one engine per rank, not 1 and 2"):
        StoreCard((NS,), BLOCK, ("e0", "e1"))
    with pytest.raises(ConfigError, match="not 0 and 0"):
        StoreCard((), BLOCK, ())


def test_block_keys_follow_the_connectors_block_keys() -> None:
    from tidekv.kvcache import prefix

    tokens = list(range(10))  # two full blocks, a partial third has no key
    keys = card("e0", "e1").block_keys(tokens)
    assert keys == [prefix.block_keys(f"{NS}/{r}", tokens, BLOCK) for r in range(2)]
    assert [len(ks) for ks in keys] == [2, 2] and not set(keys[0]) & set(keys[1])


def test_leading_held_counts_until_the_first_block_not_on_the_engine() -> None:
    assert leading_held([["a", "b"], ["a"], ["b"], ["a"]], "a") == 2
    assert leading_held([["b"], ["a"]], "a") == 0
    assert leading_held([], "a") == 0


def test_held_by_instance_asks_once_for_every_instances_keys() -> None:
    tokens = list(range(12))  # three blocks
    cards = {0: [card("e0")], 2: [card("e2")], 3: [card("e3", namespace="kv/other")]}
    [keys] = cards[0][0].block_keys(tokens)
    placed = {keys[0]: ["e0", "e2"], keys[1]: ["e2"], keys[2]: ["e2"]}
    calls: list[list[str]] = []

    def locate(asked: list[str]) -> list[list[str]]:
        calls.append(asked)
        return [placed.get(k, []) for k in asked]

    assert held_by_instance(cards, tokens, locate) == {0: 1, 2: 3, 3: 0}
    assert len(calls) == 1 and len(calls[0]) == 6, "one round trip; shared namespaces share keys"
    assert held_by_instance(cards, tokens, lambda asked: None) == {}  # the master cannot say
    assert held_by_instance(cards, tokens[:3], locate) == {}  # no full block: nothing to ask
    assert len(calls) == 1


def test_an_instance_holds_a_block_only_if_every_rank_holds_its_slice_on_its_own_engine() -> None:
    tokens = list(range(16))  # four blocks
    cards = {0: [card("a0", "a1")], 1: [card("b0", "b1")]}
    [a0, a1], [b0, b1] = cards[0][0].block_keys(tokens), cards[1][0].block_keys(tokens)
    assert (a0, a1) == (b0, b1), "same model and ranks: same keys"
    placed = {k: ["a0", "b0"] for k in a0}  # rank 0's slices everywhere on both instances
    placed |= {a1[0]: ["a1"], a1[1]: ["a1", "b1"], a1[2]: ["a1"], a1[3]: ["b1"]}  # rank 1's: gaps
    placed[a0[3]] = ["a1", "b0"]  # a's rank 0 slice of block 3 on its rank 1's engine does not count

    held = held_by_instance(cards, tokens, lambda asked: [placed.get(k, []) for k in asked])
    assert held == {0: 3, 1: 0}, "rank 0 alone would say 4 and 4"


def test_an_instance_of_several_data_parallel_engines_holds_what_its_best_engine_holds() -> None:
    tokens = list(range(16))  # four blocks
    dp0, dp1 = card("d0r0", "d0r1"), card("d1r0", "d1r1")
    [r0, r1] = dp0.block_keys(tokens)
    placed = {r0[0]: ["d0r0"], r1[0]: ["d0r1"]}  # engine 0 holds block 0 on both ranks
    placed |= {r0[1]: ["d1r0"], r0[2]: ["d1r0"], r1[1]: ["d1r1"], r1[2]: ["d1r1"]}  # engine 1: blocks 1-2
    assert held_by_instance({0: [dp0, dp1]}, tokens, lambda asked: [placed.get(k, []) for k in asked]) == {0: 1}
    placed |= {r0[0]: ["d1r0"], r1[0]: ["d1r1"]}  # block 0 moves to engine 1 as well: 3 leading there
    assert held_by_instance({0: [dp0, dp1]}, tokens, lambda asked: [placed.get(k, []) for k in asked]) == {0: 3}


def test_the_router_keeps_a_card_per_engine_behind_a_url(monkeypatch: pytest.MonkeyPatch) -> None:
    from tidekv.proxy import routing

    router = Router(ProxyConfig(prefill_urls=("http://a:1",), decode_urls=("http://d:1",),
                                policy=RoutingPolicy.STORE, master="127.0.0.1:5"))
    dp0, dp1, dp0_again = card("e0"), card("e1"), card("e0", namespace="kv/reloaded")
    for answer in (dp0, dp1, dp0, dp0_again):
        router.learn("http://a:1", handoff_params("r", "a", answer))
    assert router.cards == {0: (dp0_again, dp1)}, "the latest of each engine, latest first"
    monkeypatch.setattr(routing, "MAX_CARDS", 2)
    router.learn("http://a:1", handoff_params("r", "a", card("e2")))
    assert router.cards == {0: (card("e2"), dp0_again)}, "past MAX_CARDS the oldest engine's goes"


def test_prompt_ids_and_tokenize_bodies() -> None:
    assert prompt_token_ids({"prompt": [1, 2, 3]}) == [1, 2, 3]
    assert prompt_token_ids({"prompt": [[4, 5], [6]]}) == [4, 5]
    assert prompt_token_ids({"prompt": "text"}) is None
    assert prompt_token_ids({"prompt": [True, 2]}) is None
    assert tokenize_request({"model": "m", "prompt": "hi", "max_tokens": 3}) == {"model": "m", "prompt": "hi"}
    assert tokenize_request({"model": "m", "prompt": ["a", "b"]}) == {"model": "m", "prompt": "a"}
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"k": 1},
            "temperature": 0}
    assert tokenize_request(chat) == {"model": "m", "messages": chat["messages"], "chat_template_kwargs": {"k": 1}}
    assert tokenize_request({"model": "m", "prompt": 7}) is None


def test_store_policy_needs_a_master_and_only_it_takes_one() -> None:
    urls = {"prefill_urls": ("http://p:1",), "decode_urls": ("http://d:1",)}
    with pytest.raises(ConfigError, match="needs the tidekv master"):
        ProxyConfig(**urls, policy=RoutingPolicy.STORE)
    with pytest.raises(ConfigError, match="host:port"):
        ProxyConfig(**urls, policy=RoutingPolicy.STORE, master="nohost")
    with pytest.raises(ConfigError, match="does not use it"):
        ProxyConfig(**urls, policy=RoutingPolicy.PREFIX, master="127.0.0.1:5")
    assert ProxyConfig(**urls, policy=RoutingPolicy.STORE, master="127.0.0.1:5").master == "127.0.0.1:5"


def test_router_prefers_the_most_held_blocks_and_takes_turns_otherwise() -> None:
    router = Router(ProxyConfig(prefill_urls=("http://a:1", "http://b:1", "http://c:1"), decode_urls=("http://d:1",),
                                policy=RoutingPolicy.STORE, master="127.0.0.1:5"))
    router.learn("http://b:1", handoff_params("r", "b", card("eb")))
    router.learn("http://c:1", handoff_params("r", "ec"))  # saves nothing: no card
    assert router.cards == {1: (card("eb"),)}
    assert [router.pick_prefill_held({0: 1, 1: 5, 2: 2}) for _ in range(3)] == ["http://b:1"] * 3
    assert {router.pick_prefill_held({0: 3, 1: 3, 2: 0}) for _ in range(2)} == {"http://a:1", "http://b:1"}
    assert {router.pick_prefill_held({0: 0, 1: 0}) for _ in range(3)} == {"http://a:1", "http://b:1", "http://c:1"}


# ---- through the proxy, with a real master -------------------------------------------------


def _send(proxy: str, prefills: list[FakeBackend], body: dict[str, object]) -> str:
    before = [len(p.bodies()) for p in prefills]
    answer = http_request(proxy + "/v1/completions", body=body)
    assert answer.status == 200, answer.body
    [name] = [p.name for p, n in zip(prefills, before)
              if any(b.get("kv_transfer_params") for b in p.bodies()[n:])]
    return name


def test_prompt_goes_to_the_prefill_whose_segment_holds_its_longest_prefix(
        backend: MakeBackend, start_proxy: StartProxy, spawn_master: SpawnMaster, connect: Connect,  # noqa: F811
        caplog: pytest.LogCaptureFixture) -> None:
    master = spawn_master()
    pools = [connect(master.address, 8 * MIB), connect(master.address, 8 * MIB)]  # each instance's segment
    prefills = [backend("prefill", card=card(pool.engine.name)) for pool in pools]
    proxy = start_proxy(prefills, [backend("decode")], policy=RoutingPolicy.STORE, master=master.address)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 5}

    # Nothing learned yet: turns, and each answer teaches the proxy that instance's card.
    assert {_send(proxy, prefills, body) for _ in range(2)} == {"prefill0", "prefill1"}
    # prefill1's pool holds the first 5 blocks of the prompt, prefill0's only the first 2.
    [keys] = card("any").block_keys(list(PROMPT.encode()))
    for key in keys[:5]:
        pools[1].put(key, b"kv" * 64)
    for key in keys[:2]:
        pools[0].put(key[:-1] + "1", b"x")  # a block's other chunks do not decide
    assert [_send(proxy, prefills, body) for _ in range(3)] == ["prefill1"] * 3
    tokenized = [b for b in prefills[0].bodies() if "prompt" in b and "max_tokens" not in b]
    tokenized += [b for b in prefills[1].bodies() if "prompt" in b and "max_tokens" not in b]
    assert tokenized and all(b == {"model": "tiny", "prompt": PROMPT} for b in tokenized), "instances with a card tokenize"

    # A longer prompt with the same start still matches; token-id prompts need no /tokenize.
    tokenize_calls = len(prefills[0].bodies())
    ids = list((PROMPT + "and then some more text").encode())
    assert _send(proxy, prefills, {"model": "tiny", "prompt": ids, "max_tokens": 5}) == "prefill1"
    assert len(prefills[0].bodies()) == tokenize_calls, "no /tokenize for a token-id prompt"

    # A prompt nobody holds goes round robin.
    assert {_send(proxy, prefills, {**body, "prompt": f"unrelated {i} " * 8}) for i in range(2)} == \
        {"prefill0", "prefill1"}

    # The master goes away: requests still succeed, round robin, with a warning.
    for pool in pools:
        pool.close()
    master.stop()
    with caplog.at_level(logging.WARNING, logger="tidekv.proxy.store_policy"):
        assert {_send(proxy, prefills, body) for _ in range(2)} == {"prefill0", "prefill1"}
    assert "did not answer" in caplog.text and "round robin" in caplog.text


def test_with_tensor_parallelism_the_prompt_goes_where_every_rank_holds_the_prefix(
        backend: MakeBackend, start_proxy: StartProxy, spawn_master: SpawnMaster, connect: Connect) -> None:  # noqa: F811
    master = spawn_master()
    pools = [[connect(master.address, 8 * MIB) for _rank in range(2)] for _instance in range(2)]
    # Two namespaces, so that each instance's blocks are its own (a key lives in one segment).
    cards = [card(*(pool.engine.name for pool in ranks), namespace=f"kv/{i}") for i, ranks in enumerate(pools)]
    prefills = [backend("prefill", card=c) for c in cards]
    proxy = start_proxy(prefills, [backend("decode")], policy=RoutingPolicy.STORE, master=master.address)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 5}
    assert {_send(proxy, prefills, body) for _ in range(2)} == {"prefill0", "prefill1"}  # cards learned

    tokens = list(PROMPT.encode())
    keys = [c.block_keys(tokens) for c in cards]  # [instance][rank][block]
    for rank in range(2):  # prefill0: both ranks hold the first 3 blocks
        for key in keys[0][rank][:3]:
            pools[0][rank].put(key, b"kv")
    for key in keys[1][0][:6]:  # prefill1: rank 0 holds 6 blocks, rank 1 only the first
        pools[1][0].put(key, b"kv")
    pools[1][1].put(keys[1][1][0], b"kv")
    assert [_send(proxy, prefills, body) for _ in range(3)] == ["prefill0"] * 3, "rank 0 alone says prefill1"

    for key in keys[1][1][1:6]:  # prefill1's rank 1 catches up: 6 blocks on every rank
        pools[1][1].put(key, b"kv")
    assert [_send(proxy, prefills, body) for _ in range(3)] == ["prefill1"] * 3


@pytest.mark.parametrize("mode", [Mode.FAIL, Mode.HANG])
def test_tokenize_failure_routes_round_robin_and_warns(mode: Mode, backend: MakeBackend, start_proxy: StartProxy,
                                                       spawn_master: SpawnMaster,  # noqa: F811
                                                       caplog: pytest.LogCaptureFixture) -> None:
    master = spawn_master()
    prefills = [backend("prefill", card=card("e0")), backend("prefill", card=card("e1"))]
    proxy = start_proxy(prefills, [backend("decode")], policy=RoutingPolicy.STORE, master=master.address)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 5}
    assert {_send(proxy, prefills, body) for _ in range(2)} == {"prefill0", "prefill1"}  # cards learned
    for prefill in prefills:
        prefill.tokenize_mode = mode
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="tidekv.proxy.server"):
        assert {_send(proxy, prefills, body) for _ in range(2)} == {"prefill0", "prefill1"}
    assert "cannot tokenize" in caplog.text
    assert ("HTTP 500" if mode is Mode.FAIL else "silent for 2 s") in caplog.text
    assert time.monotonic() - started < 2 * STORE_TIMEOUT_S + 3, "a hung /tokenize costs at most its own timeout"
