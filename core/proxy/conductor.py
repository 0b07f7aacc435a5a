"""The proxy's ``conductor`` policy (Mooncake's Conductor): per request, estimate the time to
first token through each prefill instance and send the request to the smallest, or shed it
(429) when even the smallest misses the TTFT SLO.

The estimate is a prefill leg (queued plus uncached tokens through a per-instance
``fixed + per_token * tokens`` model, fitted online with forgetting and blended with the
fleet's fit) and a decode leg (in-flight requests through a model of the same form; zero until
observed). A request over the SLO is shed only while its estimate is fresh (work in flight or an
answer within ``probe_after_s``); otherwise it goes as a probe that renews the models. Without a
token count or observations, and on ties within ``TIE_S``, the store policy's choice stands.

No I/O and no clock: the server passes the times in (``time.monotonic()``). One event loop, no
lock. Neighbours: ``routing`` (the Router and its turn), ``server`` (calls ``choose``, ``sent``,
``answered``, ``decode_sent``, ``first_token`` and ``finished`` around each request).
Design notes: docs/design-proxy.md#tidekvproxyconductor
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

TIE_S = 1e-3
"""Estimates this close to the best count as tied (then the store policy's rule picks)."""
FORGET = 0.98
"""Weight kept by past observations at each new observation of the same leg: fits follow the last ~50."""
HALF_LIFE_S = 3.0
"""Past observations also lose half their weight every this many seconds (a quiet spell ages them)."""
PRIOR_WEIGHT = 1.0
"""How many observations' worth of the fleet's fit is blended into each prefill instance's own."""
PROBE_AFTER_S = 1.0
"""Default ``probe_after_s``: an estimate is fresh this long after its leg's last observation (or
while one is on its way)."""


@dataclass
class CostModel:
    """Seconds as ``fixed_s + per_token_s * work``, fitted to weighted observations (work: prompt
    tokens for a prefill, requests in flight for a decode)."""

    forget: float = FORGET
    _w: float = 0.0
    _x: float = 0.0
    _y: float = 0.0
    _xx: float = 0.0
    _xy: float = 0.0
    samples: int = 0

    def observe(self, tokens: float, seconds: float) -> None:
        """Adds one observation: ``tokens`` of work took ``seconds``."""
        f = self.forget
        self._w, self._x, self._y = self._w * f + 1, self._x * f + tokens, self._y * f + seconds
        self._xx, self._xy = self._xx * f + tokens * tokens, self._xy * f + tokens * seconds
        self.samples += 1

    @property
    def is_calibrated(self) -> bool:
        return self.samples > 0

    def coefficients(self) -> tuple[float, float]:
        """(fixed_s, per_token_s), both >= 0. With one distinct work size, all of the time is
        per token (or fixed, for zero tokens)."""
        if not self._w:
            return 0.0, 0.0
        mean_x, mean_y = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mean_x * mean_x
        if var > 1e-9 * max(1.0, mean_x * mean_x):
            slope = (self._xy / self._w - mean_x * mean_y) / var
            fixed = mean_y - slope * mean_x
            if slope >= 0 and fixed >= 0:
                return fixed, slope
            if slope < 0:  # more work was not slower: noise; a flat model
                return mean_y, 0.0
            return 0.0, self._xy / self._xx  # through the origin
        if mean_x > 0:
            return 0.0, mean_y / mean_x
        return mean_y, 0.0

    def predict(self, tokens: float) -> float:
        fixed, per_token = self.coefficients()
        return fixed + per_token * tokens

    def age(self, factor: float) -> None:
        """Scales the weight of every observation so far by ``factor``."""
        self._w, self._x, self._y, self._xx, self._xy = (v * factor for v in (self._w, self._x, self._y, self._xx,
                                                                               self._xy))

    @property
    def weight(self) -> float:
        return self._w

    def merged(self, other: CostModel) -> CostModel:
        """A model fitted to both models' observations."""
        return CostModel(self.forget, self._w + other._w, self._x + other._x, self._y + other._y,
                         self._xx + other._xx, self._xy + other._xy, self.samples + other.samples)


@dataclass(frozen=True, slots=True)
class Estimate:
    """One instance's estimated TTFT for a request: ``ttft_s`` = prefill leg + ``decode_s``."""

    instance: int
    queued_tokens: int
    uncached_tokens: int
    ttft_s: float
    decode_s: float = 0.0
    fresh: bool = True
    """Both legs' models saw an observation within ``probe_after_s``, or have one on its way."""


@dataclass(frozen=True, slots=True)
class Decision:
    """What the conductor decided for one request.

    Attributes:
        candidates: the instances the Router takes its turn among (with ``by_store``, the store
            policy's rule decides among them instead); one instance when the estimates decided.
        estimates: per instance, in order; empty when data was missing.
        reject: the best estimate exceeds the SLO and is fresh: answer 429 instead of prefilling.
        probe: the best estimate exceeds the SLO but the candidate's is stale: send it anyway.
        reason: why, in words (logged; the 429's message).
    """

    candidates: tuple[int, ...]
    estimates: tuple[Estimate, ...]
    by_store: bool
    reject: bool = False
    reason: str = ""
    probe: bool = False

    @property
    def best_s(self) -> float | None:
        return min((e.ttft_s for e in self.estimates), default=None)


@dataclass
class _Ticket:
    instance: int
    decode: int
    work_tokens: int
    uncached_tokens: int
    estimate_s: float | None
    probe: bool
    prefilling: bool = True
    decode_work: int | None = None
    """Requests the decode had in flight when it got this one; None: not sent to the decode."""
    decode_sent_s: float = 0.0
    awaiting_first_token: bool = False


@dataclass
class Calibration:
    """How the estimates compared with what happened (the proxy's /metrics)."""

    observed: int = 0
    """Admitted requests whose first token the proxy saw, with an estimate made for them."""
    estimated_s_sum: float = 0.0
    observed_s_sum: float = 0.0
    abs_error_s_sum: float = 0.0
    probes: int = 0
    probes_met_slo: int = 0
    """Probes (requests the estimate would have shed) whose observed TTFT met the SLO."""


@dataclass
class Conductor:
    """The estimator's state: queued work and cost models of each prefill and decode instance."""

    num_instances: int
    ttft_slo_s: float | None = None
    """Shed requests whose best estimate (fresh) exceeds this; None: never shed."""
    num_decodes: int = 1
    probe_after_s: float = PROBE_AFTER_S
    """An estimate over the SLO is trusted (the request shed) only this long after its legs' last
    answers, or while they have work in flight; after that the request goes as a probe."""
    queued_tokens: list[int] = field(default_factory=list)
    models: list[CostModel] = field(default_factory=list)
    decode_models: list[CostModel] = field(default_factory=list)
    decode_in_flight: list[int] = field(default_factory=list)
    """Per decode: requests sent to it and not finished."""
    calibration: Calibration = field(default_factory=Calibration)
    _prefilling: list[int] = field(default_factory=list)
    _awaiting_first_token: list[int] = field(default_factory=list)
    _last_answer_s: list[float | None] = field(default_factory=list)
    _last_first_token_s: list[float | None] = field(default_factory=list)
    _last_observation_s: float | None = None
    _tickets: dict[int, _Ticket] = field(default_factory=dict)
    _next_ticket: int = 0

    def __post_init__(self) -> None:
        self.queued_tokens = [0] * self.num_instances
        self.models = [CostModel() for _ in range(self.num_instances)]
        self._prefilling = [0] * self.num_instances
        self._last_answer_s = [None] * self.num_instances
        self.decode_models = [CostModel() for _ in range(self.num_decodes)]
        self.decode_in_flight = [0] * self.num_decodes
        self._awaiting_first_token = [0] * self.num_decodes
        self._last_first_token_s = [None] * self.num_decodes

    def coefficients_of(self, instance: int) -> tuple[float, float] | None:
        """(fixed_s, per_token_s) of the prefill instance: its own fit and the fleet's, weighted by
        the instance's observation weight and ``PRIOR_WEIGHT``; None before any observation."""
        pooled = CostModel()
        for m in self.models:
            pooled = pooled.merged(m)
        if not pooled.is_calibrated or pooled.weight <= 0:
            return None
        own = self.models[instance]
        w = own.weight
        (f_own, k_own), (f_all, k_all) = own.coefficients(), pooled.coefficients()
        return ((w * f_own + PRIOR_WEIGHT * f_all) / (w + PRIOR_WEIGHT),
                (w * k_own + PRIOR_WEIGHT * k_all) / (w + PRIOR_WEIGHT))

    def decode_leg_s(self, decode: int) -> float:
        """The decode's estimated time from getting a request to its first token, at its present
        number of requests in flight; 0 before any observation."""
        model = self.decode_models[decode]
        return model.predict(self.decode_in_flight[decode]) if model.is_calibrated else 0.0

    def estimates(self, prompt_tokens: int, cached_tokens: Sequence[int], now_s: float,
                  decode: int = 0) -> list[Estimate] | None:
        """Each instance's TTFT for a prompt of ``prompt_tokens`` of which instance ``i`` holds
        ``cached_tokens[i]``, its decode leg on ``decode``; None when no prefill has been observed yet."""
        decode_s = self.decode_leg_s(decode)
        decode_fresh = (not self.decode_models[decode].is_calibrated or self._awaiting_first_token[decode] > 0
                        or _within(self._last_first_token_s[decode], now_s, self.probe_after_s))
        out = []
        for i in range(self.num_instances):
            coefficients = self.coefficients_of(i)
            if coefficients is None:
                return None
            fixed_s, per_token_s = coefficients
            uncached = max(0, prompt_tokens - min(cached_tokens[i], prompt_tokens))
            prefill_s = fixed_s + per_token_s * (self.queued_tokens[i] + uncached)
            fresh = decode_fresh and (self._prefilling[i] > 0
                                      or _within(self._last_answer_s[i], now_s, self.probe_after_s))
            out.append(Estimate(i, self.queued_tokens[i], uncached, prefill_s + decode_s, decode_s, fresh))
        return out

    def choose(self, prompt_tokens: int | None, cached_tokens: Sequence[int], now_s: float,
               decode: int = 0) -> Decision:
        """Decides where a request goes (see the module docstring for the rule).

        Args:
            prompt_tokens: the prompt's length in tokens; None when unknown (the store rule decides).
            cached_tokens: per instance, the leading tokens of the prompt it holds.
            now_s: the present time (monotonic seconds, as every time passed in).
            decode: the decode instance the request will go to.
        """
        everyone = tuple(range(self.num_instances))
        if prompt_tokens is None:
            return Decision(everyone, (), by_store=True, reason="prompt length unknown")
        estimates = self.estimates(prompt_tokens, cached_tokens, now_s, decode)
        if estimates is None:
            return Decision(everyone, (), by_store=True, reason="no prefill answer observed yet")
        best = min(e.ttft_s for e in estimates)
        tied = tuple(e.instance for e in estimates if e.ttft_s - best <= TIE_S)
        shown = [round(e.ttft_s * 1e3) for e in estimates]
        if self.ttft_slo_s is not None and best > self.ttft_slo_s:
            stale = [e for e in estimates if not e.fresh]
            if stale:
                probe = min(stale, key=lambda e: e.ttft_s)
                return Decision((probe.instance,), tuple(estimates), by_store=False, probe=True,
                                reason=f"estimated TTFT {shown} ms, over the SLO, but instance {probe.instance}'s "
                                       f"estimate is stale: a probe")
            return Decision(tied, tuple(estimates), by_store=len(tied) > 1, reject=True,
                            reason=f"the best estimated TTFT is {best * 1e3:.0f} ms, over the SLO of "
                                   f"{self.ttft_slo_s * 1e3:.0f} ms (prefill queues "
                                   f"{[e.queued_tokens for e in estimates]} tokens, decode leg "
                                   f"{estimates[0].decode_s * 1e3:.0f} ms at {self.decode_in_flight[decode]} "
                                   f"in flight)")
        return Decision(tied, tuple(estimates), by_store=len(tied) > 1, reason=f"estimated TTFT {shown} ms")

    def sent(self, instance: int, uncached_tokens: int, decode: int = 0, estimate_s: float | None = None,
             probe: bool = False) -> int:
        """Notes a request sent to prefill ``instance`` (and later to ``decode``), estimated at
        ``estimate_s``; returns its ticket for ``answered``, ``decode_sent``, ``first_token`` and
        ``finished``."""
        self._next_ticket += 1
        self._tickets[self._next_ticket] = _Ticket(instance, decode, self.queued_tokens[instance] + uncached_tokens,
                                                   uncached_tokens, estimate_s, probe)
        self.queued_tokens[instance] += uncached_tokens
        self._prefilling[instance] += 1
        if probe:
            self.calibration.probes += 1
        return self._next_ticket

    def answered(self, ticket: int, elapsed_s: float | None, now_s: float) -> None:
        """The prefill of ``ticket`` ended after ``elapsed_s`` (None: it failed, nothing learned)."""
        t = self._tickets[ticket]
        if not t.prefilling:
            return
        t.prefilling = False
        self.queued_tokens[t.instance] -= t.uncached_tokens
        self._prefilling[t.instance] -= 1
        if elapsed_s is not None and math.isfinite(elapsed_s) and elapsed_s >= 0:
            self._age_by_time(now_s)
            for i, model in enumerate(self.models):
                if i != t.instance:
                    model.age(FORGET)  # (observe ages the answering instance's own)
            self.models[t.instance].observe(t.work_tokens, elapsed_s)
            self._last_answer_s[t.instance] = now_s

    def decode_sent(self, ticket: int, now_s: float) -> None:
        """The request of ``ticket`` goes to its decode now."""
        t = self._tickets[ticket]
        t.decode_work, t.decode_sent_s, t.awaiting_first_token = self.decode_in_flight[t.decode], now_s, True
        self.decode_in_flight[t.decode] += 1
        self._awaiting_first_token[t.decode] += 1

    def first_token(self, ticket: int, now_s: float, ttft_s: float) -> None:
        """The decode of ``ticket`` streamed its first token at ``now_s``; the client's request
        came ``ttft_s`` before (the TTFT the proxy observed)."""
        t = self._tickets[ticket]
        if not t.awaiting_first_token or t.decode_work is None:
            return
        t.awaiting_first_token = False
        self._awaiting_first_token[t.decode] -= 1
        self._age_by_time(now_s)
        for d, model in enumerate(self.decode_models):
            if d != t.decode:
                model.age(FORGET)
        self.decode_models[t.decode].observe(t.decode_work, now_s - t.decode_sent_s)
        self._last_first_token_s[t.decode] = now_s
        c = self.calibration
        if t.estimate_s is not None:
            c.observed += 1
            c.estimated_s_sum += t.estimate_s
            c.observed_s_sum += ttft_s
            c.abs_error_s_sum += abs(ttft_s - t.estimate_s)
        if t.probe and self.ttft_slo_s is not None and ttft_s <= self.ttft_slo_s:
            c.probes_met_slo += 1

    def finished(self, ticket: int) -> None:
        """The request of ``ticket`` is over, answered or failed at any stage."""
        t = self._tickets.pop(ticket)
        if t.prefilling:
            self.queued_tokens[t.instance] -= t.uncached_tokens
            self._prefilling[t.instance] -= 1
        if t.decode_work is not None:
            self.decode_in_flight[t.decode] -= 1
        if t.awaiting_first_token:
            self._awaiting_first_token[t.decode] -= 1

    def _age_by_time(self, now_s: float) -> None:
        last, self._last_observation_s = self._last_observation_s, now_s
        if last is None or now_s <= last:
            return
        factor = 0.5 ** ((now_s - last) / HALF_LIFE_S)
        for model in (*self.models, *self.decode_models):
            model.age(factor)


def _within(then_s: float | None, now_s: float, window_s: float) -> bool:
    return then_s is not None and now_s - then_s <= window_s


def reusable_tokens(prompt_tokens: int, cached_tokens: int, block_size: int | None) -> int:
    """Of ``cached_tokens`` leading tokens held, those an engine like vLLM skips: whole blocks of
    ``block_size`` (None: unknown, not rounded) and never the prompt's last token, which it
    computes to sample from. (The proxy's prefix memory counts in characters; without this, a
    prompt held whole looked free, and a partial block's tokens were counted as held.)"""
    if block_size:
        cached_tokens = cached_tokens // block_size * block_size
    return max(0, min(cached_tokens, prompt_tokens - 1))


def cached_from_chars(prompt_tokens: int, matched_chars: int, prompt_chars: int) -> int:
    """Tokens of a prefix matched in characters (the proxy's own prefix memory), in proportion."""
    if prompt_chars <= 0:
        return 0
    return prompt_tokens * min(matched_chars, prompt_chars) // prompt_chars
