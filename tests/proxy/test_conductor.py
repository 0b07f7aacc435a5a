"""The conductor policy: its estimator and choice (tidekv.proxy.conductor) worked by hand, the
two failures seen in benchmarks/trace_replay.py on a slower machine replayed from its recorded
numbers (shedding with nothing in flight forever; a deep decode queue the prefill-only estimate
did not see), and the proxy routing and shedding with it in front of fake backends whose
prefills and decodes take known times."""

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
    """A conductor whose instance i answered 1000 tokens at ``per_token_s[i]`` at time 0."""
    conductor = Conductor(len(per_token_s))
    for i, rate in enumerate(per_token_s):
        ticket = conductor.sent(i, 1000)
        conductor.answered(ticket, 1000 * rate, 0.0)
        conductor.finished(ticket)
    return conductor


def test_without_observations_or_length_the_store_rule_decides() -> None:
    conductor = Conductor(2)
    assert conductor.choose(500, [0, 0], 0.0) == Decision((0, 1), (), by_store=True, reason="no prefill answer observed yet")
    conductor.models[0].observe(100, 0.1)
    assert conductor.choose(None, [0, 0], 0.0).by_store
    # instance 1 has no answer of its own: it borrows the fit of all (equal estimates: a tie)
    decision = conductor.choose(500, [0, 0], 0.0)
    assert [e.ttft_s for e in decision.estimates] == pytest.approx([0.5, 0.5])
    assert decision.candidates == (0, 1) and decision.by_store


def test_queued_work_and_cached_prefix_by_hand() -> None:
    conductor = calibrated([1e-3, 1e-3])  # 1 ms per token on both
    ticket = conductor.sent(0, 2000)  # 2000 tokens in flight on instance 0
    # 1000-token prompt, none cached: 0 -> (2000 + 1000) ms, 1 -> 1000 ms
    decision = conductor.choose(1000, [0, 0], 0.0)
    assert [round(e.ttft_s, 6) for e in decision.estimates] == [3.0, 1.0]
    assert decision.candidates == (1,) and not decision.by_store
    # instance 0 holds 900 leading tokens: 2000 + 100 = 2.1 s; instance 1 holds 0 -> 1 s
    assert conductor.choose(1000, [900, 0], 0.0).candidates == (1,)
    conductor.answered(ticket, 2.0, 0.0)
    assert conductor.queued_tokens == [0, 0]
    # with the queue gone the held prefix wins: 0.1 s vs 1 s
    decision = conductor.choose(1000, [900, 0], 0.0)
    assert decision.candidates == (0,)
    assert decision.estimates[0].uncached_tokens == 100


def test_a_faster_instance_wins_and_a_failed_prefill_teaches_nothing() -> None:
    conductor = calibrated([2e-3, 1e-3])
    assert conductor.choose(1000, [0, 0], 0.0).candidates == (1,)
    ticket = conductor.sent(1, 1000)
    conductor.answered(ticket, None, 0.0)
    assert conductor.models[1].samples == 1 and conductor.queued_tokens == [0, 0]
    ticket = conductor.sent(1, 1000)
    conductor.answered(ticket, 1.0, 0.0)  # observed: 1000 tokens of work ahead incl. its own took 1 s
    assert conductor.models[1].samples == 2


def test_a_starved_instance_drifts_back_to_the_fleet_fit() -> None:
    conductor = Conductor(2)
    ticket = conductor.sent(1, 1000)
    conductor.answered(ticket, 10.0, 0.0)  # instance 1 once looked very slow (10 ms per token)
    for _ in range(3):
        conductor.answered(conductor.sent(0, 1000), 1.0, 0.0)  # instance 0: 1 ms per token
    blocker = conductor.sent(0, 3000)  # 3000 tokens queued on 0: 4 s for a 1000-token prompt there
    assert conductor.choose(1000, [0, 0], 0.0).candidates == (0,)  # 1 is still judged on its one slow answer
    for _ in range(150):
        conductor.answered(conductor.sent(0, 1000), 4.0, 0.0)  # 3000 queued + its own 1000: 1 ms per token
    decision = conductor.choose(1000, [0, 0], 0.0)
    assert decision.candidates == (1,)  # its old answer has aged away: the fleet's 1 ms per token
    assert conductor.models[1].weight < 0.1  # 0.98 ** 153
    conductor.answered(blocker, None, 0.0)


def test_over_the_slo_the_request_is_shed() -> None:
    conductor = calibrated([1e-3, 1e-3])
    conductor.ttft_slo_s = 0.5
    assert not conductor.choose(400, [0, 0], 0.0).reject
    decision = conductor.choose(800, [0, 0], 0.0)
    assert decision.reject and "800 ms" in decision.reason and "500 ms" in decision.reason
    assert not conductor.choose(800, [0, 400], 0.0).reject  # instance 1 holds half: 400 ms


def test_after_a_slow_spell_with_nothing_in_flight_it_probes_and_recovers() -> None:
    """Run D's second repeat (docs/guides/traces.md): after a slow spell every estimate was over
    the 250 ms SLO; from then on every request was shed (750 in a row, 55 s), each 429 saying the
    prefill queues were [0, 0] and the estimate 320-329 ms: nothing in flight, so no answer to
    learn from. Replayed: 600-token prompts answered in 320 ms during the spell, then the machine
    answers them in 100 ms again. The old conductor shed every later request; this one sheds
    while its evidence is fresh, then probes, and admits again within a few seconds."""
    conductor = Conductor(2, ttft_slo_s=0.25)
    for k in range(50):  # the slow spell: 5 s of answers on both instances
        ticket = conductor.sent(k % 2, 600)
        conductor.answered(ticket, 0.32, k * 0.1)
        conductor.finished(ticket)
    assert conductor.choose(600, [0, 0], 4.95).reject  # fresh evidence, over the SLO: shed
    fast_again_s = 5.0
    admitted_at, shed, probes = None, 0, 0
    for step in range(600):  # a request every 50 ms; probes answer in 100 ms
        now_s = fast_again_s + step * 0.05
        decision = conductor.choose(600, [0, 0], now_s)
        if decision.reject:
            shed += 1
            continue
        probes += decision.probe
        if not decision.probe:
            admitted_at = now_s
            break
        ticket = conductor.sent(decision.candidates[0], 600, probe=True)
        conductor.answered(ticket, 0.10, now_s + 0.10)
        conductor.finished(ticket)
    assert admitted_at is not None and admitted_at - fast_again_s < 6.0, (shed, probes)
    assert probes >= 1 and conductor.calibration.probes == probes
    assert conductor.queued_tokens == [0, 0]


def test_a_request_in_flight_keeps_the_estimate_fresh() -> None:
    conductor = calibrated([1e-3, 1e-3])
    conductor.ttft_slo_s = 0.5
    a, b = conductor.sent(0, 1000), conductor.sent(1, 1000)  # answers are on their way from both
    decision = conductor.choose(800, [0, 0], 100.0)  # long after the last answer
    assert decision.reject and not decision.probe
    conductor.answered(a, None, 100.0)  # failed: no answer, nothing in flight on 0, evidence old
    decision = conductor.choose(800, [0, 0], 100.0)
    assert decision.probe and decision.candidates == (0,) and not decision.reject
    conductor.finished(a)
    conductor.finished(b)


def test_probe_after_s_is_how_long_an_answer_keeps_a_shed_trusted() -> None:
    for window_s, at_s, expect_shed in ((1.0, 0.9, True), (1.0, 1.5, False), (30.0, 20.0, True), (30.0, 31.0, False)):
        conductor = calibrated([1e-3, 1e-3])  # both answered at t = 0
        conductor.ttft_slo_s, conductor.probe_after_s = 0.5, window_s
        decision = conductor.choose(800, [0, 0], at_s)
        assert decision.reject == expect_shed and decision.probe != expect_shed, (window_s, at_s, decision)


def decode_calibrated(first_token_s: dict[int, float], prefill_s: float = 0.05) -> Conductor:
    """One prefill answering 500 tokens in ``prefill_s``; the decode's first token after
    ``first_token_s[n]`` when it had n requests in flight (all at time 0)."""
    conductor = Conductor(1, ttft_slo_s=0.25)
    for in_flight, seconds in first_token_s.items():
        ballast = [conductor.sent(0, 0) for _ in range(in_flight)]
        for t in ballast:
            conductor.answered(t, None, 0.0)
            conductor.decode_sent(t, 0.0)
        ticket = conductor.sent(0, 500)
        conductor.answered(ticket, prefill_s, 0.0)
        conductor.decode_sent(ticket, 0.0)
        conductor.first_token(ticket, seconds, prefill_s + seconds)
        for t in [ticket, *ballast]:
            conductor.finished(t)
    return conductor


def test_the_decode_leg_is_in_the_estimate() -> None:
    """Run D's second repeat: the conductor's decode had up to 137 requests waiting (vLLM's log,
    'Waiting: 137 reqs') and client TTFTs of 15-29 s while the prefill queues were near empty;
    round robin's decode never had more than 3 waiting. Replayed: a first token 20 ms after
    the hand-off at 0-1 requests in flight, 1 s at 8. Prefill-only, the estimate was 50 ms."""
    conductor = decode_calibrated({0: 0.02, 1: 0.02, 8: 1.0})
    assert conductor.decode_leg_s(0) == pytest.approx(conductor.decode_models[0].predict(0))
    idle = conductor.choose(500, [0], 0.0)
    assert not idle.reject and idle.estimates[0].ttft_s < 0.25
    ballast = [conductor.sent(0, 0) for _ in range(8)]
    for t in ballast:
        conductor.answered(t, None, 0.0)
        conductor.decode_sent(t, 0.0)  # 8 in flight at the decode, awaiting their first token
    busy = conductor.choose(500, [0], 0.0)
    assert busy.estimates[0].decode_s == pytest.approx(conductor.decode_models[0].predict(8))
    assert busy.estimates[0].ttft_s == pytest.approx(0.05 + busy.estimates[0].decode_s)
    assert busy.estimates[0].ttft_s > 0.9 and busy.reject  # fresh: first tokens are on their way
    assert "decode leg" in busy.reason
    for t in ballast:
        conductor.finished(t)
    assert conductor.decode_in_flight == [0] and not conductor.choose(500, [0], 0.0).reject


def test_without_decode_observations_the_decode_leg_is_zero() -> None:
    conductor = calibrated([1e-4])
    assert conductor.decode_leg_s(0) == 0.0
    ticket = conductor.sent(0, 1000)
    conductor.decode_sent(ticket, 0.0)  # a non-streaming request: no first token seen
    conductor.finished(ticket)
    assert conductor.decode_leg_s(0) == 0.0 and conductor.decode_in_flight == [0]
    assert conductor.choose(1000, [0], 0.0).estimates[0].ttft_s == pytest.approx(0.1)


def test_calibration_counts_estimates_against_observations() -> None:
    conductor = calibrated([1e-4])
    conductor.ttft_slo_s = 0.25
    decision = conductor.choose(1000, [0], 0.0)
    ticket = conductor.sent(0, 1000, estimate_s=decision.estimates[0].ttft_s)
    conductor.answered(ticket, 0.1, 0.1)
    conductor.decode_sent(ticket, 0.1)
    conductor.first_token(ticket, 0.3, 0.3)
    conductor.first_token(ticket, 0.4, 0.4)  # only the first counts
    conductor.finished(ticket)
    c = conductor.calibration
    assert (c.observed, c.estimated_s_sum, c.observed_s_sum) == (1, pytest.approx(0.1), pytest.approx(0.3))
    assert c.abs_error_s_sum == pytest.approx(0.2)
    probe = conductor.sent(0, 10, estimate_s=0.3, probe=True)
    conductor.answered(probe, 0.05, 5.0)
    conductor.decode_sent(probe, 5.0)
    conductor.first_token(probe, 5.1, 0.2)
    conductor.finished(probe)
    assert (c.probes, c.probes_met_slo) == (1, 1)


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


def test_proxy_sheds_on_a_slow_decode_leg(backend: MakeBackend, start_proxy: StartProxy) -> None:
    """The prefill answers at once but the decode's first token comes 0.3 s after the hand-off:
    once the proxy has seen one, a request under a 100 ms SLO is shed (the prefill-only
    estimate said ~0 ms and sent it); /metrics shows the decode leg and the calibration."""
    prefill = backend("prefill")
    decode = backend("decode", first_chunk_delay_s=0.3)
    url = start_proxy([prefill], [decode], policy=RoutingPolicy.CONDUCTOR, ttft_slo_ms=100)
    body = {**completion("x" * 200), "stream": True}
    first = http_request(url + "/v1/completions", body=body)
    assert first.status == 200 and b"tok0" in first.body  # no data yet: served
    answer = http_request(url + "/v1/completions", body={**body, "prompt": "y" * 200})
    assert answer.status == 429, answer.body
    assert "decode leg" in answer.json()["error"]["message"]
    metrics = http_request(url + "/metrics", method="GET").body.decode()
    leg = float(re.search(r'tidekv_proxy_decode_leg_seconds\{decode="[^"]+"\} (\S+)', metrics).group(1))
    assert leg >= 0.25, metrics
    assert re.search(r"^tidekv_proxy_decode_in_flight\{[^}]*\} 0", metrics, re.MULTILINE), metrics
    assert re.search(r"^tidekv_proxy_conductor_observed_ttft_seconds_sum (\S+)", metrics, re.MULTILINE)
    assert "tidekv_proxy_conductor_probes_total 0.0" in metrics


def test_reusable_tokens_are_whole_blocks_and_never_the_last_token() -> None:
    from tidekv.proxy.conductor import reusable_tokens

    assert reusable_tokens(1000, 700, 32) == 672  # 21 whole blocks of 32
    assert reusable_tokens(1000, 700, None) == 700  # block size unknown: as counted
    assert reusable_tokens(640, 640, 32) == 639  # held whole: the last token is still computed
    assert reusable_tokens(640, 5000, None) == 639
    assert reusable_tokens(1000, 31, 32) == 0  # under one block: nothing
    assert reusable_tokens(0, 0, 32) == 0
