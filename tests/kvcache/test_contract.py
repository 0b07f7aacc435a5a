"""The PD contract (``KVHandoff`` in ``kv_transfer_params``): round trip through the JSON an
engine carries, refusal of other versions naming both, malformed params, TP/block-size checks."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tidekv.errors import ConfigError, ProtocolVersionError
from tidekv.kvcache import contract
from tidekv.kvcache.contract import PROTOCOL_VERSION, KVHandoff, RankEndpoint


def handoff(tp_size: int = 1, **kw: Any) -> KVHandoff:
    ranks = [RankEndpoint(f"127.0.0.1:{7000 + r}", {"fingerprint": f"f{r}", "block_size": 32, "layers": []},
                          f"127.0.0.1:{8000 + r}") for r in range(tp_size)]
    fields: dict[str, Any] = dict(request_id="req-1", engine_id="prefill-a", block_ids=[4, 5, 9], num_tokens=70,
                                  block_size=32, tp_size=tp_size, ranks=ranks)
    return KVHandoff(**(fields | kw))


def over_json(params: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(json.dumps(params))  # what the proxy and vLLM's server pass on
    return out


@pytest.mark.parametrize("tp_size", [1, 2])
def test_round_trip_through_the_json_an_engine_carries(tp_size: int) -> None:
    h = handoff(tp_size, prefix_namespaces=[f"kv/abc-{r}" for r in range(tp_size)])
    params = over_json(contract.to_params(h))
    assert params["protocol_version"] == PROTOCOL_VERSION
    # vLLM reads its own flags at the top level of the dict.
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert contract.is_handoff(params) and not contract.wants_remote_decode(params)
    assert contract.from_params(params) == h


def test_keys_the_engine_adds_are_ignored() -> None:
    params = contract.to_params(handoff()) | {"remote_prefill_cached_tokens": 32}  # vLLM adds this one
    assert contract.from_params(params) == handoff()


def test_the_request_to_a_prefill_asks_for_a_remote_decode() -> None:
    ask = contract.remote_decode_params()
    assert ask == {"do_remote_decode": True, "do_remote_prefill": False}
    assert contract.wants_remote_decode(ask) and not contract.is_handoff(ask)
    ask["do_remote_decode"] = False  # each call is a fresh dict: a caller's change stays its own
    assert contract.remote_decode_params()["do_remote_decode"] is True
    assert not contract.wants_remote_decode(None) and not contract.is_handoff(None) and not contract.is_handoff({})


@pytest.mark.parametrize("version", [PROTOCOL_VERSION + 1, 0, "1"])
def test_another_version_is_refused_naming_both(version: object) -> None:
    params = contract.to_params(handoff()) | {"protocol_version": version}
    with pytest.raises(ProtocolVersionError) as err:
        contract.from_params(params)
    assert f"protocol version {version!r}" in str(err.value)
    assert f"speaks tidekv PD protocol version {PROTOCOL_VERSION}" in str(err.value)
    assert "'req-1'" in str(err.value)


def test_params_without_a_version_are_refused() -> None:
    # The unversioned params of an older tidekv (or another connector's): never read as ours.
    old = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine": "127.0.0.1:7000",
           "remote_block_ids": [1, 2], "remote_request_id": "r", "remote_num_tokens": 64}
    assert contract.is_handoff(old)
    with pytest.raises(ProtocolVersionError, match=rf"no protocol_version .* speaks tidekv PD protocol version {PROTOCOL_VERSION}"):
        contract.from_params(old)


@pytest.mark.parametrize(("change", "field"), [
    ({"block_ids": "4,5"}, "block_ids"),
    ({"num_tokens": None}, "num_tokens"),
    ({"ranks": [{"engine": "e", "layout": {}}]}, "confirm_address"),
    ({"tp_size": 2}, "tp_size=2 with 1 rank endpoints"),
    ({"prefix_namespaces": ["kv/a", "kv/b"]}, "tp_size=1 with 2 prefix namespaces"),
    ({"block_size": 0}, "block_size=0"),
])
def test_malformed_params_are_a_config_error_naming_the_field(change: dict[str, Any], field: str) -> None:
    params = over_json(contract.to_params(handoff())) | change
    with pytest.raises(ConfigError, match="malformed tidekv kv_transfer_params") as err:
        contract.from_params(params)
    assert field in str(err.value)


def test_missing_field_is_named() -> None:
    params = contract.to_params(handoff())
    del params["engine_id"]
    with pytest.raises(ConfigError, match="engine_id"):
        contract.from_params(params)


def test_a_decode_pulls_only_with_the_prefills_tp_size_and_block_size() -> None:
    contract.check_pullable(handoff(2), tp_size=2, block_size=32)
    with pytest.raises(ConfigError, match=r"prefill 'prefill-a' runs tensor_parallel_size=2, this decode runs "
                                          r"tensor_parallel_size=1: PD needs equal sizes"):
        contract.check_pullable(handoff(2), tp_size=1, block_size=32)
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=1, this decode runs tensor_parallel_size=4"):
        contract.check_pullable(handoff(1), tp_size=4, block_size=32)
    with pytest.raises(ConfigError, match=r"block_size=32, this decode runs block_size=16"):
        contract.check_pullable(handoff(1), tp_size=1, block_size=16)
