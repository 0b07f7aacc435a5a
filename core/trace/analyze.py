"""``tidekv trace analyze``: how much a global KV pool would save on a trace, and how much memory
it needs. For each capacity and instance count it simulates one global pool and per-instance
local caches (``cache``), then reports hit rates, prefill tokens saved, the working set over
time and the capacity reaching a fraction of the unbounded hit rate, as a table, JSON and a
plot. Neighbours: ``cache`` (the simulation), ``cli`` (the flags).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tidekv.report import Column, format_table, progress, require_matplotlib
from tidekv.trace.cache import (
    CacheKind,
    CacheResult,
    Routing,
    WorkingSetPoint,
    capacity_for_fraction,
    simulate_global,
    simulate_local,
    simulate_two_tier,
    unique_blocks,
    working_set,
)
from tidekv.trace.format import TraceRequest

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class AnalyzeSettings:
    """What ``analyze`` simulates."""

    capacities_tokens: tuple[int, ...] = (0, 1_000_000, 3_000_000, 10_000_000)
    """Total cache capacities, tokens; 0 = unbounded."""
    instances: tuple[int, ...] = (1, 8)
    """Instance counts (each local cache holds capacity // instances)."""
    routings: tuple[Routing, ...] = (Routing.ROUND_ROBIN, Routing.PREFIX)
    """How requests are dealt to local caches."""
    fraction: float = 0.9
    """Report the global capacity reaching this fraction of the unbounded hit rate (0 < f <= 1)."""
    window_s: float = 60.0
    """Working-set window, seconds of trace time."""
    disk_capacities_tokens: tuple[int, ...] = ()
    """Disk tiers to add to each bounded global capacity (``simulate_two_tier``), tokens."""

    def __post_init__(self) -> None:
        from tidekv.errors import ConfigError

        if not self.capacities_tokens or any(c < 0 for c in self.capacities_tokens):
            raise ConfigError(f"capacities={self.capacities_tokens!r} is invalid; give token counts >= 0")
        if not self.instances or any(n < 1 for n in self.instances):
            raise ConfigError(f"instances={self.instances!r} is invalid; give counts >= 1")
        if not 0 < self.fraction <= 1:
            raise ConfigError(f"fraction={self.fraction!r} is out of range; allowed (0, 1]")
        if any(d <= 0 for d in self.disk_capacities_tokens):
            raise ConfigError(f"disk capacities={self.disk_capacities_tokens!r} are invalid; give token counts > 0")
        if not self.window_s > 0:
            raise ConfigError(f"window_s={self.window_s!r} is out of range; allowed > 0")


@dataclass
class AnalyzeReport:
    """Everything ``analyze`` found."""

    trace: str
    requests: int
    input_tokens: int
    results: list[CacheResult]
    unique_blocks: int
    working_set: list[WorkingSetPoint]
    fraction: float
    fraction_capacity_tokens: int
    fraction_hit_rate: float
    simulated_requests: int = 0
    elapsed_s: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def requests_per_min(self) -> float:
        return self.simulated_requests / self.elapsed_s * 60 if self.elapsed_s > 0 else math.inf

    def rows(self) -> list[dict[str, Any]]:
        """One object per capacity x instance count x policy (x routing, for local caches)."""
        return [{"capacity_tokens": r.capacity_tokens, "instances": r.instances, "policy": r.kind.value,
                 "routing": r.routing.value if r.routing else None, "hit_rate": r.hit_rate,
                 "requests": r.requests, "hit_tokens": r.hit_tokens, "prefill_tokens_saved": r.hit_tokens,
                 "input_tokens": r.input_tokens, "disk_capacity_tokens": r.disk_capacity_tokens,
                 "disk_hit_tokens": r.disk_hit_tokens} for r in self.results]

    def to_json(self) -> dict[str, Any]:
        return {
            "trace": self.trace, "requests": self.requests, "input_tokens": self.input_tokens,
            "block_tokens": 512, "results": self.rows(),
            "unique_blocks": self.unique_blocks, "unbounded_footprint_tokens": self.unique_blocks * 512,
            "working_set": [{"start_s": p.start_s, "window_tokens": p.window_tokens,
                             "footprint_tokens": p.footprint_tokens} for p in self.working_set],
            "capacity_for_fraction": {"fraction": self.fraction, "capacity_tokens": self.fraction_capacity_tokens,
                                      "hit_rate": self.fraction_hit_rate},
            "simulated_requests": self.simulated_requests, "elapsed_s": self.elapsed_s,
            "requests_per_min": self.requests_per_min,
        }


def analyze(requests: Sequence[TraceRequest], settings: AnalyzeSettings, *, trace_name: str = "",
            show_progress: bool = False) -> AnalyzeReport:
    """Simulates every configuration of ``settings`` over ``requests`` (see ``cache``)."""
    n = len(requests)
    locals_per_capacity = len(settings.instances) * len(settings.routings)
    bisection_steps = math.ceil(math.log2(unique_blocks(requests) + 1)) + 1
    bounded = [c for c in settings.capacities_tokens if c]
    total = n * (len(settings.capacities_tokens) * (1 + locals_per_capacity) + bisection_steps
                 + len(bounded) * len(settings.disk_capacities_tokens))
    bar = progress(total, "trace analyze", enabled=show_progress)
    bar.unit, bar.unit_scale = "req", True
    simulated = 0

    def advance(k: int) -> None:
        nonlocal simulated
        simulated += k
        bar.update(k)

    started = time.perf_counter()
    results: list[CacheResult] = []
    for capacity in settings.capacities_tokens:
        pool = simulate_global(requests, capacity, progress=advance)
        for instances in settings.instances:
            results.append(CacheResult(capacity, instances, CacheKind.GLOBAL, None, pool.requests,
                                       pool.hit_tokens, pool.input_tokens))
            for routing in settings.routings:
                results.append(simulate_local(requests, capacity, instances, routing, progress=advance))
        for disk in settings.disk_capacities_tokens if capacity else ():
            tiered = simulate_two_tier(requests, capacity, disk, progress=advance)
            results += [dataclasses.replace(tiered, instances=instances) for instances in settings.instances]
    fraction_capacity, fraction_rate = capacity_for_fraction(requests, settings.fraction, advance)
    points = working_set(requests, settings.window_s)
    elapsed = time.perf_counter() - started
    bar.close()
    return AnalyzeReport(trace_name, n, sum(r.input_length for r in requests), results, unique_blocks(requests),
                         points, settings.fraction, fraction_capacity, fraction_rate, simulated, elapsed)


def format_tokens(tokens: int) -> str:
    """3000000 -> "3M", 1500 -> "1.5K", 0 -> "unbounded" (for capacities)."""
    if tokens == 0:
        return "unbounded"
    for unit, scale in (("G", 10**9), ("M", 10**6), ("K", 10**3)):
        if tokens >= scale:
            return f"{tokens / scale:.4g}{unit}"
    return str(tokens)


def report_text(report: AnalyzeReport) -> str:
    """The table and its notes."""
    rows = report.rows()
    for row in rows:
        row["capacity"] = format_tokens(row["capacity_tokens"])
        row["per_cache"] = (format_tokens(row["capacity_tokens"] // (row["instances"] if row["policy"] == "local" else 1))
                            if row["capacity_tokens"] else "unbounded")
        row["saved"] = format_tokens(row["prefill_tokens_saved"]) if row["prefill_tokens_saved"] else "0"
        row["disk"] = format_tokens(row["disk_capacity_tokens"]) if row["disk_capacity_tokens"] else "-"
        row["disk_share"] = row["disk_hit_tokens"] / row["hit_tokens"] if row["disk_capacity_tokens"] and \
            row["hit_tokens"] else None
    columns = [Column("capacity", "capacity"), Column("disk", "+ disk"), Column("instances", "instances"),
               Column("policy", "policy", align="<"), Column("routing", "routing", align="<"),
               Column("per_cache", "per cache"), Column("hit_rate", "hit rate", ".4f"),
               Column("saved", "prefill tokens saved"), Column("disk_share", "of which from disk", ".2f")]
    window = report.working_set
    peak = max((p.window_tokens for p in window), default=0)
    mean = sum(p.window_tokens for p in window) / len(window) if window else 0
    notes = [
        "",
        f"requests {report.requests}, prompt tokens {format_tokens(report.input_tokens) if report.input_tokens else 0} "
        "(capacities in tokens, decimal: 1M = 1,000,000; 512-token blocks; local caches hold capacity / instances)",
        f"working set per window: peak {format_tokens(peak) if peak else 0}, mean "
        f"{format_tokens(int(mean)) if mean >= 1 else 0} tokens over {len(window)} windows; all distinct blocks "
        f"{format_tokens(report.unique_blocks * 512) if report.unique_blocks else 0} tokens (an unbounded cache)",
        f"global capacity for {report.fraction:.0%} of the unbounded hit rate: "
        f"{format_tokens(report.fraction_capacity_tokens) if report.fraction_capacity_tokens else 0} tokens "
        f"(hit rate {report.fraction_hit_rate:.4f})",
        f"simulated {report.simulated_requests} requests in {report.elapsed_s:.2f} s: "
        f"{report.requests_per_min / 1e6:.2f}M requests/min",
    ]
    return format_table(rows, columns, title=f"tidekv trace analyze {report.trace}", notes=notes)


def write_json(path: str | Path, report: AnalyzeReport) -> None:
    """Writes the report as one JSON object ("-": stdout); its ``results`` has one object per row."""
    text = json.dumps(report.to_json(), indent=1)
    if str(path) == "-":
        print(text)
        return
    Path(path).write_text(text + "\n", encoding="utf-8")
    logger.info("wrote %s", path)


def plot(path: str | Path, report: AnalyzeReport) -> None:
    """Hit rate against capacity: the global pool and each local configuration, the unbounded
    global hit rate as a dashed line; saved as a PNG.

    Raises:
        ConfigError: matplotlib is not installed.
    """
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    bounded = sorted({r.capacity_tokens for r in report.results if r.capacity_tokens})
    series: dict[str, list[tuple[int, float]]] = {}
    unbounded: dict[str, float] = {}
    for r in report.results:
        if r.kind is CacheKind.GLOBAL:
            if r.instances != report.results[0].instances:
                continue  # the same pool whatever the instance count
            label = "global pool"
        elif r.instances == 1:
            continue  # one local cache is the global pool
        else:
            label = f"local x{r.instances} ({r.routing.value if r.routing else ''})"
        if r.capacity_tokens:
            series.setdefault(label, []).append((r.capacity_tokens, r.hit_rate))
        else:
            unbounded[label] = r.hit_rate
    for label, points in series.items():
        xs, ys = zip(*sorted(points))
        ax.plot([x / 1e6 for x in xs], ys, "o-" if label == "global pool" else "s--", label=label,
                linewidth=2.5 if label == "global pool" else 1.2)
    if "global pool" in unbounded:
        ax.axhline(unbounded["global pool"], color="grey", linestyle=":",
                   label=f"global, unbounded ({unbounded['global pool']:.3f})")
    if bounded:
        ax.set_xlabel("total cache capacity (M tokens)")
    ax.set_ylabel("prefix-cache hit rate (tokens)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"{Path(report.trace).name or 'trace'}: {report.requests} requests")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    logger.info("wrote %s", path)
