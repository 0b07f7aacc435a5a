"""The proxy's ``conductor`` policy (Mooncake's Conductor, FAST'25 §5): per request, estimate each
prefill instance's time to first token and send the request to the smallest, or shed it early
when even the smallest misses the TTFT SLO.

An instance's estimate is the prefill time of its queued work (prompt tokens it has been sent
and not yet answered) plus the tokens this prompt would make it compute (the prompt minus the
longest prefix it holds), through a per-instance cost model ``time = fixed + per_token * tokens``
fitted online by least squares, with forgetting, to the instance's observed (tokens, seconds)
pairs: for each answered prefill, the work ahead of it and its own uncached tokens at the time
it was sent, and how long its answer took. Every answer, whichever instance gave it, ages every
instance's observations by ``FORGET``, and each instance's coefficients are blended with those
of the fit of all instances together (same model, same kind of machine), the fleet's counting as
``PRIOR_WEIGHT`` observations against the weight of the instance's own: an
instance not yet observed takes the fleet's fit, and one that looked slow once and was then
starved of requests drifts back to the fleet's instead of staying unchosen on stale evidence. What each instance holds comes from the
store (``store_policy``: leading blocks in its segment, when the proxy has a master) and from the
proxy's own memory of where prompts went (``routing.PrefixIndex``), whichever is longer.

When the prompt's token count is unknown, or no instance has been observed yet, the choice is
the store policy's (most leading blocks held; ties and no holder take turns); so are ties
between estimates (within ``TIE_S``). No I/O here and no clock: the server passes the times in.
One event loop, no lock. Neighbours: ``routing`` (the Router and its turn), ``server`` (calls
``choose``, ``sent`` and ``answered`` around each prefill request).
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
"""Weight kept by past observations at each new answer of any instance: fits follow the last ~50."""
PRIOR_WEIGHT = 1.0
"""How many observations' worth of the fleet's fit is blended into each instance's own."""


@dataclass
class CostModel:
    """Prefill seconds as ``fixed_s + per_token_s * tokens``, fitted to weighted observations."""

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
    """One instance's estimated TTFT for a request."""

    instance: int
    queued_tokens: int
    uncached_tokens: int
    ttft_s: float


@dataclass(frozen=True, slots=True)
class Decision:
    """What the conductor decided for one request.

    Attributes:
        candidates: the instances the Router takes its turn among (with ``by_store``, the store
            policy's rule decides among them instead); one instance when the estimates decided.
        estimates: per instance, in order; empty when data was missing.
        reject: the best estimate exceeds the SLO: answer 429 instead of prefilling.
        reason: why, in words (logged; the 429's message).
    """

    candidates: tuple[int, ...]
    estimates: tuple[Estimate, ...]
    by_store: bool
    reject: bool = False
    reason: str = ""

    @property
    def best_s(self) -> float | None:
        return min((e.ttft_s for e in self.estimates), default=None)


@dataclass
class _Ticket:
    instance: int
    work_tokens: int
    uncached_tokens: int


@dataclass
class Conductor:
    """The estimator's state: queued work and cost model of each prefill instance."""

    num_instances: int
    ttft_slo_s: float | None = None
    """Shed requests whose best estimate exceeds this; None: never shed."""
    queued_tokens: list[int] = field(default_factory=list)
    models: list[CostModel] = field(default_factory=list)
    _tickets: dict[int, _Ticket] = field(default_factory=dict)
    _next_ticket: int = 0

    def __post_init__(self) -> None:
        self.queued_tokens = [0] * self.num_instances
        self.models = [CostModel() for _ in range(self.num_instances)]

    def coefficients_of(self, instance: int) -> tuple[float, float] | None:
        """(fixed_s, per_token_s) of the instance: its own fit and the fleet's, weighted by the
        instance's observation weight and ``PRIOR_WEIGHT``; None before any observation."""
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

    def estimates(self, prompt_tokens: int, cached_tokens: Sequence[int]) -> list[Estimate] | None:
        """Each instance's TTFT for a prompt of ``prompt_tokens`` of which instance ``i`` holds
        ``cached_tokens[i]``; None when no instance has been observed yet."""
        out = []
        for i in range(self.num_instances):
            coefficients = self.coefficients_of(i)
            if coefficients is None:
                return None
            fixed_s, per_token_s = coefficients
            uncached = max(0, prompt_tokens - min(cached_tokens[i], prompt_tokens))
            out.append(Estimate(i, self.queued_tokens[i], uncached,
                                fixed_s + per_token_s * (self.queued_tokens[i] + uncached)))
        return out

    def choose(self, prompt_tokens: int | None, cached_tokens: Sequence[int]) -> Decision:
        """Decides where a request goes (see the module docstring for the rule).

        Args:
            prompt_tokens: the prompt's length in tokens; None when unknown (the store rule decides).
            cached_tokens: per instance, the leading tokens of the prompt it holds.
        """
        everyone = tuple(range(self.num_instances))
        if prompt_tokens is None:
            return Decision(everyone, (), by_store=True, reason="prompt length unknown")
        estimates = self.estimates(prompt_tokens, cached_tokens)
        if estimates is None:
            return Decision(everyone, (), by_store=True, reason="no prefill answer observed yet")
        best = min(e.ttft_s for e in estimates)
        tied = tuple(e.instance for e in estimates if e.ttft_s - best <= TIE_S)
        if self.ttft_slo_s is not None and best > self.ttft_slo_s:
            return Decision(tied, tuple(estimates), by_store=len(tied) > 1, reject=True,
                            reason=f"the best estimated TTFT is {best * 1e3:.0f} ms, over the SLO of "
                                   f"{self.ttft_slo_s * 1e3:.0f} ms (prefill queues "
                                   f"{[e.queued_tokens for e in estimates]} tokens)")
        return Decision(tied, tuple(estimates), by_store=len(tied) > 1,
                        reason=f"estimated TTFT {[round(e.ttft_s * 1e3) for e in estimates]} ms")

    def sent(self, instance: int, uncached_tokens: int) -> int:
        """Notes a prefill request sent to ``instance``; returns its ticket for ``answered``."""
        self._next_ticket += 1
        self._tickets[self._next_ticket] = _Ticket(instance, self.queued_tokens[instance] + uncached_tokens,
                                                   uncached_tokens)
        self.queued_tokens[instance] += uncached_tokens
        return self._next_ticket

    def answered(self, ticket: int, elapsed_s: float | None) -> None:
        """The prefill of ``ticket`` ended after ``elapsed_s`` (None: it failed, nothing learned)."""
        t = self._tickets.pop(ticket)
        self.queued_tokens[t.instance] -= t.uncached_tokens
        if elapsed_s is not None and math.isfinite(elapsed_s) and elapsed_s >= 0:
            for i, model in enumerate(self.models):
                if i != t.instance:
                    model.age(FORGET)  # (observe ages the answering instance's own)
            self.models[t.instance].observe(t.work_tokens, elapsed_s)


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
