"""Timing of one benchmark measurement: how often to repeat an operation and how to summarize it.

A measurement repeats one operation (a transfer, a copy, a socket round trip) under a
``Budget`` and returns per-iteration latencies; ``summarize`` turns them into throughput and
percentiles. Neighbours: ``tidekv.report`` prints and plots the summaries; ``transfer``, ``baselines``
and ``mooncake_te`` measure with ``measure``. Every bench in ``tidekv.bench`` shares it, so all
rows of a run are timed the same way.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tidekv.errors import ConfigError

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Budget:
    """How long one measurement runs.

    A measurement runs up to ``warmup_iterations`` untimed (stopping early after
    ``warmup_time_s``, but never below one), then repeats until it has at least
    ``min_iterations`` samples and ``min_time_s`` seconds of samples, or ``max_iterations``.
    """

    min_time_s: float = 0.4
    """Seconds of timed iterations to collect at least. Default 0.4 (0..600)."""
    min_iterations: int = 5
    """Timed iterations to collect at least, however long they take. Default 5 (1..10^7)."""
    max_iterations: int = 20000
    """Timed iterations to stop at, however short they are. Default 20000 (>= min_iterations)."""
    warmup_iterations: int = 3
    """Untimed iterations first (page faults, connections, caches). Default 3 (0..10^6)."""
    warmup_time_s: float = 0.05
    """Warm-up stops after this many seconds even short of warmup_iterations. Default 0.05 (0..600)."""

    def __post_init__(self) -> None:
        if not 0 <= self.min_time_s <= 600:
            raise ConfigError(f"min_time_s={self.min_time_s!r} is out of range; allowed 0..600")
        if not 1 <= self.min_iterations <= 10**7:
            raise ConfigError(f"min_iterations={self.min_iterations!r} is out of range; allowed 1..10^7")
        if not self.min_iterations <= self.max_iterations <= 10**7:
            raise ConfigError(
                f"max_iterations={self.max_iterations!r} is out of range; allowed {self.min_iterations}..10^7"
            )
        if not 0 <= self.warmup_iterations <= 10**6:
            raise ConfigError(f"warmup_iterations={self.warmup_iterations!r} is out of range; allowed 0..10^6")
        if not 0 <= self.warmup_time_s <= 600:
            raise ConfigError(f"warmup_time_s={self.warmup_time_s!r} is out of range; allowed 0..600")

    @classmethod
    def fixed(cls, iterations: int, warmup_iterations: int = 3) -> Budget:
        """A budget of exactly ``iterations`` timed iterations."""
        return cls(min_time_s=0.0, min_iterations=iterations, max_iterations=iterations,
                   warmup_iterations=warmup_iterations, warmup_time_s=600.0)

    def split(self, rounds: int, index: int) -> Budget:
        """The budget of part ``index`` of ``rounds`` interleaved parts of a measurement (their samples pool).

        Iteration counts are shared out so the parts add up to this budget's (each part runs at least one).
        """
        if not 0 <= index < rounds:
            raise ConfigError(f"index={index} is out of range; allowed 0..{rounds - 1}")

        def share(total: int) -> int:
            return max(1, total // rounds + (index < total % rounds))

        least = share(self.min_iterations)
        return Budget(min_time_s=self.min_time_s / rounds, min_iterations=least,
                      max_iterations=max(least, share(self.max_iterations)),
                      warmup_iterations=self.warmup_iterations, warmup_time_s=self.warmup_time_s)


@dataclass(frozen=True, slots=True)
class Summary:
    """What one measurement found.

    Attributes:
        iterations: timed iterations.
        bytes_per_iteration: payload bytes one iteration moves.
        gbps: payload bytes over total timed seconds, in GB/s (10^9 bytes per second).
        p50_us, p99_us: median and 99th percentile of the per-iteration latency, microseconds.
    """

    iterations: int
    bytes_per_iteration: int
    gbps: float
    p50_us: float
    p99_us: float


def measure(step: Callable[[], object], budget: Budget) -> list[float]:
    """Runs ``step`` under ``budget`` and returns the latency of each timed call, in seconds.

    Raises:
        Whatever ``step`` raises; the measurement stops there.
    """
    clock = time.perf_counter
    warmup_end = clock() + budget.warmup_time_s
    for _ in range(budget.warmup_iterations):
        step()
        if clock() >= warmup_end:
            break
    samples: list[float] = []
    total = 0.0
    while len(samples) < budget.max_iterations:
        start = clock()
        step()
        elapsed = clock() - start
        samples.append(elapsed)
        total += elapsed
        if total >= budget.min_time_s and len(samples) >= budget.min_iterations:
            break
    return samples


def percentile(sorted_samples: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) of already sorted samples, nearest-rank.

    Raises:
        ConfigError: no samples, or q outside 0..100.
    """
    if not sorted_samples:
        raise ConfigError("percentile() of no samples")
    if not 0 <= q <= 100:
        raise ConfigError(f"percentile q={q!r} is out of range; allowed 0..100")
    rank = max(1, math.ceil(q / 100 * len(sorted_samples)))
    return sorted_samples[rank - 1]


def summarize(samples_s: Sequence[float], bytes_per_iteration: int) -> Summary:
    """Summarizes per-iteration latencies (seconds) of an operation moving ``bytes_per_iteration``.

    Raises:
        ConfigError: no samples.
    """
    ordered = sorted(samples_s)
    total_s = sum(ordered)
    if not ordered or total_s <= 0:
        raise ConfigError("summarize() needs at least one sample with a positive duration")
    return Summary(
        iterations=len(ordered),
        bytes_per_iteration=bytes_per_iteration,
        gbps=bytes_per_iteration * len(ordered) / total_s / 1e9,
        p50_us=percentile(ordered, 50) * 1e6,
        p99_us=percentile(ordered, 99) * 1e6,
    )
