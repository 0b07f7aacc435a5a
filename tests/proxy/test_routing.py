"""Routing without a network: request rewriting, prompt text, the prefix index, config checks."""

from __future__ import annotations

from typing import Any

import pytest

from tidekv.errors import ConfigError
from tidekv.proxy import (
    PrefixIndex,
    ProxyConfig,
    Router,
    RoutingPolicy,
    decode_request,
    normalize_url,
    prefill_request,
    prompt_text,
)

P = ("http://p0:1", "http://p1:1")
D = ("http://d0:1", "http://d1:1")


def _config(**fields: Any) -> ProxyConfig:
    return ProxyConfig(prefill_urls=P, decode_urls=D, **fields)


def test_prefill_request_asks_for_one_token_and_remote_decode() -> None:
    body = {"model": "m", "prompt": "hi", "max_tokens": 50, "stream": True, "stream_options": {"include_usage": True}}
    sent = prefill_request(body)
    assert sent["max_tokens"] == 1 and sent["stream"] is False and "stream_options" not in sent
    assert sent["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False}
    assert "max_completion_tokens" not in sent
    assert body["max_tokens"] == 50 and body["stream"] is True, "the client's request must not change"
    chat = prefill_request({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 9})
    assert chat["max_completion_tokens"] == 1 and chat["max_tokens"] == 1


def test_decode_request_carries_the_prefill_params_or_none() -> None:
    body = {"prompt": "hi", "max_tokens": 50, "kv_transfer_params": {"from": "client"}}
    assert decode_request(body, {"remote_engine": "p0"}) == {"prompt": "hi", "max_tokens": 50,
                                                            "kv_transfer_params": {"remote_engine": "p0"}}
    assert decode_request(body, None) == {"prompt": "hi", "max_tokens": 50}


@pytest.mark.parametrize(("body", "text"), [
    ({"prompt": "abc"}, "abc"),
    ({"prompt": ["abc", "def"]}, "abc"),
    ({"prompt": [1, 22, 3]}, "1,22,3,"),
    ({"prompt": [[1, 2], [3]]}, "1,2,"),
    ({"messages": [{"role": "system", "content": "sys"},
                   {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"}, {"type": "text",
                                                                                                     "text": "b"}]}]},
     "sys\x1eab\x1e"),
    ({"prompt": None}, ""),
    ({"messages": "nonsense"}, ""),
])
def test_prompt_text(body: dict[str, Any], text: str) -> None:
    assert prompt_text(body) == text


def test_prefix_index_finds_the_longest_chained_prefix() -> None:
    index = PrefixIndex(num_instances=2, chunk_chars=4, capacity=100)
    assert index.chain("abc") == [], "a partial chunk is not hashed"
    long, other = index.chain("aaaabbbbcccc"), index.chain("aaaabbbbxxxx")
    assert len(long) == 3 and long[:2] == other[:2] and long[2] != other[2]
    assert index.chain("zzzzbbbb")[1] != long[1], "a chunk's hash depends on everything before it"
    index.record(0, long[:2])
    index.record(1, long)
    assert index.longest_match(long) == (3, [1])
    assert index.longest_match(other) == (2, [0, 1])
    assert index.longest_match(index.chain("qqqq")) == (0, [])


def test_prefix_index_is_a_bounded_lru() -> None:
    index = PrefixIndex(num_instances=1, chunk_chars=1, capacity=3)
    first, second = index.chain("abc"), index.chain("xyz")
    index.record(0, first)
    index.record(0, second)
    assert index.longest_match(first) == (0, [])
    assert index.longest_match(second) == (3, [0])
    index.record(0, index.chain("xyzw"))  # 4 hashes, capacity 3: the longest prefix goes first
    assert index.longest_match(index.chain("xyzw")) == (3, [0])


def test_round_robin_alternates_prefill_and_decode() -> None:
    router = Router(_config())
    assert [router.pick_prefill({"prompt": "same"}) for _ in range(4)] == [P[0], P[1], P[0], P[1]]
    assert [router.pick_decode() for _ in range(3)] == [D[0], D[1], D[0]]


def test_prefix_policy_sticks_to_the_holder_and_spreads_the_rest() -> None:
    router = Router(_config(policy=RoutingPolicy.PREFIX, prefix_chunk_chars=8))
    shared = "s" * 64
    first = router.pick_prefill({"prompt": shared + "question one"})
    assert router.pick_prefill({"prompt": shared + "question two"}) == first
    assert router.pick_prefill({"messages": [{"content": "u" * 64}]}) != first
    assert router.pick_prefill({"prompt": shared}) == first
    assert {router.pick_prefill({"prompt": c * 64}) for c in "xy"} == set(P)
    assert {router.pick_prefill({"prompt": "short"}) for _ in range(2)} == set(P), "no full chunk: round robin"


def test_normalize_url() -> None:
    assert normalize_url("10.0.0.1:8100") == "http://10.0.0.1:8100"
    assert normalize_url("https://h:1/") == "https://h:1"


@pytest.mark.parametrize(("fields", "needle"), [
    ({"prefill_urls": ()}, "prefill_urls"),
    ({"decode_urls": ("ftp://x:1",)}, "decode_urls"),
    ({"timeout_s": 0}, "timeout_s"),
    ({"port": 70000}, "port"),
    ({"prefix_chunk_chars": 0}, "prefix_chunk_chars"),
    ({"policy": "prefix"}, "policy"),
    ({"policy": RoutingPolicy.CONDUCTOR, "probe_after_s": 0}, "probe_after_s"),
    ({"probe_after_s": 5.0}, "probe_after_s=5.0 is set but policy='round_robin'"),
])
def test_config_rejects_bad_values_naming_the_field(fields: dict[str, Any], needle: str) -> None:
    values: dict[str, Any] = {"prefill_urls": P, "decode_urls": D, **fields}
    with pytest.raises(ConfigError, match=needle):
        ProxyConfig(**values)
