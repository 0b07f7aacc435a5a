"""The conductor policy: its estimator and choice (tidekv.proxy.conductor) worked by hand, and
the proxy routing and shedding with it in front of fake backends whose prefills take known times."""

from __future__ import annotations

import re

import pytest

from tests.proxy.conftest import MakeBackend, StartProxy
from tests.proxy.fakes import http_request
from tidekv.errors import ConfigError
from tidekv.proxy import ProxyConfig, Router, RoutingPolicy
from tidekv.proxy.conductor import FORGET, Conductor, CostModel, Decision


def test_cost_model_fits_fixed_and_per_token_time() -> None:
    model = CostModel()
    assert not model.is_calibrated and model.coefficients() == (0.0, 0.0)
    model.observe(1000, 0.05 + 1000 * 2e-4)
    assert model.coefficients() == pytest.approx((0.0, 0.25 / 1000))  # one work size: all per token
    for tokens in (100, 4000, 2000):
        model.observe(tokens, 0.05 + tokens * 2e-4)
    assert model.coefficients() == pytest.approx((0.05, 2e-4))
    assert model.predict(3000) == pytest.approx(0.65)


def test_cost_model_follows_a_slower_machine() -> None:
    model = CostModel()
    for i in range(50):
        model.observe(100 + i * 10, (100 + i * 10) * 1e-4)
    for i in range(200):
        model.observe(100 + (i % 50) * 10, (100 + (i % 50) * 10) * 4e-4)
    assert model.coefficients()[1] == pytest.approx(4e-4, rel=0.05)


def test_cost_model_never_goes_negative() -> None:
    model = CostModel()
    model.observe(100, 0.5)
    model.observe(1000, 0.1)  # more work answered sooner: noise, a flat model
    # the weighted mean time (the older answer weighs FORGET)
    assert model.coefficients() == pytest.approx(((0.5 * FORGET + 0.1) / (FORGET + 1), 0.0))


def calibrated(per_token_s: list[float]) -> Conductor:
    conductor = Conductor(len(per_token_s))
    for i, rate in enumerate(per_token_s):
        conductor.models[i].observe(1000, 1000 * rate)
    return conductor


def test_without_observations_or_length_the_store_rule_decides() -> None:
    conductor = Conductor(2)
    assert conductor.choose(500, [0, 0]) == Decision((0, 1), (), by_store=True, reason="no prefill answer observed yet")
    conductor.models[0].observe(100, 0.1)
    assert conductor.choose(None, [0, 0]).by_store
    # instance 1 has no answer of its own: it borrows the fit of all (equal estimates: a tie)
    decision = conductor.choose(500, [0, 0])
    assert [e.ttft_s for e in decision.estimates] == pytest.approx([0.5, 0.5])
    assert decision.candidates == (0, 1) and decision.by_store


def test_queued_work_and_cached_prefix_by_hand() -> None:
    conductor = calibrated([1e-3, 1e-3])  # 1 ms per token on both
    ticket = conductor.sent(0, 2000)  # 2000 tokens in flight on instance 0
    # 1000-token prompt, none cached: 0 -> (2000 + 1000) ms, 1 -> 1000 ms
    decision = conductor.choose(1000, [0, 0])
    assert [round(e.ttft_s, 6) for e in decision.estimates] == [3.0, 1.0]
    assert decision.candidates == (1,) and not decision.by_store
    # instance 0 holds 900 leading tokens: 2000 + 100 = 2.1 s; instance 1 holds 0 -> 1 s
    assert conductor.choose(1000, [900, 0]).candidates == (1,)
    conductor.answered(ticket, 2.0)
    assert conductor.queued_tokens == [0, 0]
    # with the queue gone the held prefix wins: 0.1 s vs 1 s
    decision = conductor.choose(1000, [900, 0])
    assert decision.candidates == (0,)
    assert decision.estimates[0].uncached_tokens == 100


def test_a_faster_instance_wins_and_a_failed_prefill_teaches_nothing() -> None:
    conductor = calibrated([2e-3, 1e-3])
    assert conductor.choose(1000, [0, 0]).candidates == (1,)
    ticket = conductor.sent(1, 1000)
    conductor.answered(ticket, None)
    assert conductor.models[1].samples == 1 and conductor.queued_tokens == [0, 0]
    ticket = conductor.sent(1, 1000)
    conductor.answered(ticket, 1.0)  # observed: 1000 tokens of work ahead incl. its own took 1 s
    assert conductor.models[1].samples == 2


def test_a_starved_instance_drifts_back_to_the_fleet_fit() -> None:
    conductor = Conductor(2)
    ticket = conductor.sent(1, 1000)
    conductor.answered(ticket, 10.0)  # instance 1 once looked very slow (10 ms per token)
    for _ in range(3):
        conductor.answered(conductor.sent(0, 1000), 1.0)  # instance 0: 1 ms per token
    blocker = conductor.sent(0, 3000)  # 3000 tokens queued on 0: 4 s for a 1000-token prompt there
    assert conductor.choose(1000, [0, 0]).candidates == (0,)  # 1 is still judged on its one slow answer
    for _ in range(150):
        conductor.answered(conductor.sent(0, 1000), 4.0)  # 3000 queued + its own 1000: 1 ms per token
    decision = conductor.choose(1000, [0, 0])
    assert decision.candidates == (1,)  # its old answer has aged away: the fleet's 1 ms per token
    assert conductor.models[1].weight < 0.1  # 0.98 ** 153
    conductor.answered(blocker, None)


def test_over_the_slo_the_request_is_shed() -> None:
    conductor = calibrated([1e-3, 1e-3])
    conductor.ttft_slo_s = 0.5
    assert not conductor.choose(400, [0, 0]).reject
    decision = conductor.choose(800, [0, 0])
    assert decision.reject and "800 ms" in decision.reason and "500 ms" in decision.reason
    assert not conductor.choose(800, [0, 400]).reject  # instance 1 holds half: 400 ms


def test_ties_take_the_store_rule_among_the_tied() -> None:
    router = Router(ProxyConfig(prefill_urls=("http://a:1", "http://b:1", "http://c:1"), decode_urls=("http://d:1",),
                                policy=RoutingPolicy.CONDUCTOR))
    tied = Decision((1, 2), (), by_store=True)
    assert router.pick_prefill_conducted(tied, {0: 5, 2: 3}, []) == 2  # most held among the tied
    assert {router.pick_prefill_conducted(tied, {}, []) for _ in range(4)} == {1, 2}  # no holder: turns
    assert router.pick_prefill_conducted(Decision((0,), (), by_store=False), {2: 9}, []) == 0


def test_config_takes_the_slo_only_for_the_conductor() -> None:
    base = dict(prefill_urls=("http://a:1",), decode_urls=("http://d:1",))
    ProxyConfig(**base, policy=RoutingPolicy.CONDUCTOR, ttft_slo_ms=500, master="127.0.0.1:5")
    with pytest.raises(ConfigError, match="ttft_slo_ms"):
        ProxyConfig(**base, policy=RoutingPolicy.STORE, master="127.0.0.1:5", ttft_slo_ms=500)
    with pytest.raises(ConfigError, match="ttft_slo_ms"):
        ProxyConfig(**base, policy=RoutingPolicy.CONDUCTOR, ttft_slo_ms=-1)


def completion(prompt: str) -> dict[str, object]:
    return {"model": "tiny", "prompt": prompt, "max_tokens": 4}


def served_by(prefills: list, n_before: list[int]) -> list[int]:  # type: ignore[type-arg]
    return [len([r for r in p.received if r.path == "/v1/completions"]) - n for p, n in zip(prefills, n_before)]


def test_proxy_sends_work_to_the_faster_prefill(backend: MakeBackend, start_proxy: StartProxy) -> None:
    slow = backend("prefill", prefill_delay_s=0.25)
    fast = backend("prefill", prefill_delay_s=0.0)
    decode = backend("decode")
    url = start_proxy([slow, fast], [decode], policy=RoutingPolicy.CONDUCTOR)
    for i in range(4):  # warm-up: both get answers observed
        assert http_request(url + "/v1/completions", body=completion(f"warm {i} " * 20)).status == 200
    before = served_by([slow, fast], [0, 0])
    for i in range(5):
        assert http_request(url + "/v1/completions", body=completion(f"prompt {i} " * 20)).status == 200
    assert served_by([slow, fast], before) == [0, 5]
    metrics = http_request(url + "/metrics", method="GET").body.decode()
    assert f'tidekv_proxy_requests_total{{prefill="{fast.url}"}}' in metrics
    assert re.search(r'tidekv_proxy_prefill_observations_total\{prefill="[^"]+"\} [1-9]', metrics)
    # the prompt's length came from a prefill's /tokenize
    assert any(r.path == "/tokenize" for r in slow.received + fast.received)


def test_proxy_sheds_over_the_slo_with_429(backend: MakeBackend, start_proxy: StartProxy) -> None:
    prefill = backend("prefill", prefill_delay_s=0.3)
    decode = backend("decode")
    url = start_proxy([prefill], [decode], policy=RoutingPolicy.CONDUCTOR, ttft_slo_ms=100)
    assert http_request(url + "/v1/completions", body=completion("x" * 200)).status == 200  # no data yet: served
    answer = http_request(url + "/v1/completions", body=completion("y" * 200))
    assert answer.status == 429
    error = answer.json()["error"]
    assert error["type"] == "ttft_slo_exceeded" and error["code"] == 429 and "100 ms" in error["message"]
    assert len([r for r in prefill.received if r.path == "/v1/completions"]) == 1  # never reached the prefill
    metrics = http_request(url + "/metrics", method="GET").body.decode()
    assert 'tidekv_proxy_rejected_total{reason="ttft_slo"} 1' in metrics


def test_reusable_tokens_are_whole_blocks_and_never_the_last_token() -> None:
    from tidekv.proxy.conductor import reusable_tokens

    assert reusable_tokens(1000, 700, 32) == 672  # 21 whole blocks of 32
    assert reusable_tokens(1000, 700, None) == 700  # block size unknown: as counted
    assert reusable_tokens(640, 640, 32) == 639  # held whole: the last token is still computed
    assert reusable_tokens(640, 5000, None) == 639
    assert reusable_tokens(1000, 31, 32) == 0  # under one block: nothing
    assert reusable_tokens(0, 0, 32) == 0
