"""What a trace replay found (``replay``): latency percentiles, SLO attainment, goodput, errors
by kind and the prefix-cache hit rate the deployment reported; as a table, JSON and plots.

A request meets the TTFT SLO when it succeeded and its first token came within ``ttft_slo_ms``,
the TBT SLO when it succeeded and the mean gap between its tokens is within ``tbt_slo_ms`` (one
token: no gap, met); attainment is the share of all requests sent (failures miss both), goodput
the requests meeting both per second of the replay. The hit rate is the change over the run of
the ``*prefix_cache_hits_total`` and ``*prefix_cache_queries_total`` counters (vLLM's, in
tokens; ``vllm:external_prefix_cache_*`` for a connector's) summed over the URLs read.
Neighbours: ``replay`` (the run), ``cli``.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tidekv.report import Column, format_table, require_matplotlib
from tidekv.trace.replay import ReplayRun, RequestResult

logger = logging.getLogger(__name__)

_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfINFaN]+)")


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100), linear between ranks; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def prefix_cache_counters(text: str) -> dict[str, dict[str, float]]:
    """From Prometheus text: per source (the metric name before ``prefix_cache``, e.g. "vllm:" or
    "vllm:external_"), the summed ``hits`` and ``queries`` over every label set."""
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None:
            continue
        name, value = match.group(1), float(match.group(3))
        for kind in ("hits", "queries"):
            for suffix in (f"prefix_cache_{kind}_total", f"prefix_cache_{kind}"):
                if name.endswith(suffix):
                    source = name[: -len(suffix)] + "prefix_cache"
                    out.setdefault(source, {"hits": 0.0, "queries": 0.0})[kind] += value
                    break
            else:
                continue
            break
    return out


def deployment_hit_rates(run: ReplayRun) -> list[dict[str, Any]]:
    """Per source, the hits and queries counted during the run and their ratio."""
    totals: dict[str, dict[str, float]] = {}
    for url, after_text in run.metrics_after.items():
        before = prefix_cache_counters(run.metrics_before.get(url, ""))
        for source, after in prefix_cache_counters(after_text).items():
            start = before.get(source, {"hits": 0.0, "queries": 0.0})
            t = totals.setdefault(source, {"hits": 0.0, "queries": 0.0})
            t["hits"] += after["hits"] - start["hits"]
            t["queries"] += after["queries"] - start["queries"]
    return [{"source": s, "hits": t["hits"], "queries": t["queries"],
             "hit_rate": t["hits"] / t["queries"] if t["queries"] > 0 else None} for s, t in sorted(totals.items())]


def _meets(r: RequestResult, ttft_slo_s: float, tbt_slo_s: float) -> tuple[bool, bool]:
    if not r.is_ok or r.ttft_s is None:
        return False, False
    tbt = r.mean_tbt_s
    return r.ttft_s <= ttft_slo_s, tbt is None or tbt <= tbt_slo_s


def summarize(run: ReplayRun) -> dict[str, Any]:
    """The run's numbers as one JSON-able object (see the module docstring)."""
    s = run.settings
    results = run.results
    ok = [r for r in results if r.is_ok]
    meets = [_meets(r, s.ttft_slo_ms / 1e3, s.tbt_slo_ms / 1e3) for r in results]
    both = sum(a and b for a, b in meets)
    n = len(results)
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    e2es = [r.e2e_s for r in ok if r.e2e_s is not None]
    gaps = [g for r in ok for g in r.gaps_s]

    def pcts(values: Sequence[float]) -> dict[str, float | None]:
        return {f"p{q}": (None if (v := percentile(values, q)) is None else v * 1e3) for q in (50, 90, 99)}

    return {
        "target": s.target, "model": run.model, "speedup": s.speedup, "scale_tokens": s.prompts.scale_tokens,
        "block_tokens": s.prompts.tokens_per_block, "requests": n, "succeeded": len(ok), "failed": n - len(ok),
        "errors": dict(Counter(r.error_key for r in results if r.error_key is not None)),
        "duration_s": run.duration_s,
        "input_tokens": sum(r.input_tokens for r in results), "output_tokens": sum(r.tokens for r in results),
        "ttft_ms": pcts(ttfts), "tbt_ms": pcts(gaps), "e2e_ms": pcts(e2es),
        "ttft_slo_ms": s.ttft_slo_ms, "tbt_slo_ms": s.tbt_slo_ms,
        "ttft_attainment": sum(a for a, _ in meets) / n if n else None,
        "tbt_attainment": sum(b for _, b in meets) / n if n else None,
        "slo_attainment": both / n if n else None,
        "goodput_rps": both / run.duration_s if run.duration_s > 0 else None,
        "throughput_rps": len(ok) / run.duration_s if run.duration_s > 0 else None,
        "deployment_hit_rates": deployment_hit_rates(run),
        "metrics_read_from": sorted(run.metrics_after),
    }


def report_text(summary: dict[str, Any]) -> str:
    """The summary as a table of latencies and notes."""
    rows = [{"metric": name, **summary[key]} for name, key in (("TTFT", "ttft_ms"), ("TBT", "tbt_ms"),
                                                                ("end to end", "e2e_ms"))]
    columns = [Column("metric", "latency (ms)", align="<"), Column("p50", "p50", ".1f"), Column("p90", "p90", ".1f"),
               Column("p99", "p99", ".1f")]

    def share(v: float | None) -> str:
        return "-" if v is None else f"{v:.1%}"

    errors = ", ".join(f"{k} {v}" for k, v in sorted(summary["errors"].items())) or "none"
    hits = "; ".join(f"{h['source']} {h['hit_rate']:.4f} ({h['hits']:.0f} of {h['queries']:.0f} tokens)"
                     for h in summary["deployment_hit_rates"] if h["hit_rate"] is not None)
    notes = [
        "",
        f"requests {summary['requests']}: {summary['succeeded']} succeeded, {summary['failed']} failed "
        f"(errors: {errors}) in {summary['duration_s']:.1f} s",
        f"SLO attainment: TTFT <= {summary['ttft_slo_ms']:g} ms {share(summary['ttft_attainment'])}, "
        f"TBT <= {summary['tbt_slo_ms']:g} ms {share(summary['tbt_attainment'])}, both "
        f"{share(summary['slo_attainment'])}",
        f"goodput {summary['goodput_rps'] or 0:.3f} requests/s meeting both SLOs (throughput "
        f"{summary['throughput_rps'] or 0:.3f} requests/s)",
        f"prefix-cache hit rate reported by the deployment: {hits or 'none (no *prefix_cache_* counters in /metrics of ' + (', '.join(summary['metrics_read_from']) or 'any URL') + ')'}",
    ]
    return format_table(rows, columns, title=f"tidekv trace replay -> {summary['target']} (model {summary['model']}, "
                                             f"speedup {summary['speedup']:g}, scale {summary['scale_tokens']:g})",
                        notes=notes)


def write_json(path: str | Path, run: ReplayRun, summary: dict[str, Any]) -> None:
    """The summary and every request ("-": stdout)."""
    requests = [{"index": r.index, "scheduled_s": r.scheduled_s, "sent_s": r.sent_s, "input_tokens": r.input_tokens,
                 "max_tokens": r.max_tokens, "tokens": r.tokens, "ttft_s": r.ttft_s, "e2e_s": r.e2e_s,
                 "mean_tbt_s": r.mean_tbt_s, "error": r.error_key, "detail": r.detail or None} for r in run.results]
    text = json.dumps({"summary": summary, "requests": requests}, indent=1)
    if str(path) == "-":
        print(text)
        return
    Path(path).write_text(text + "\n", encoding="utf-8")
    logger.info("wrote %s", path)


def plot(path: str | Path, run: ReplayRun, summary: dict[str, Any]) -> None:
    """Two panels: TTFT of each request against its send time (failures on top, the SLO dashed),
    and SLO attainment per time window; saved as a PNG.

    Raises:
        ConfigError: matplotlib is not installed.
    """
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = run.settings
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True)
    ok = [r for r in run.results if r.is_ok and r.ttft_s is not None]
    failed = [r for r in run.results if not r.is_ok]
    top.scatter([r.sent_s for r in ok], [(r.ttft_s or 0) * 1e3 for r in ok], s=8, label="TTFT")
    ceiling = max([(r.ttft_s or 0) * 1e3 for r in ok] + [s.ttft_slo_ms]) * 1.05
    if failed:
        top.scatter([r.sent_s for r in failed], [ceiling] * len(failed), marker="x", color="red", s=14,
                    label=f"failed ({len(failed)})")
    top.axhline(s.ttft_slo_ms, color="grey", linestyle="--", label=f"TTFT SLO {s.ttft_slo_ms:g} ms")
    top.set_ylabel("TTFT (ms)")
    top.legend(fontsize=8, loc="upper left")
    top.grid(alpha=0.3)
    window = max(run.duration_s / 20, 1e-3)
    buckets: dict[int, list[tuple[bool, bool]]] = {}
    for r in run.results:
        buckets.setdefault(int(r.scheduled_s // window), []).append(_meets(r, s.ttft_slo_ms / 1e3, s.tbt_slo_ms / 1e3))
    xs = [(k + 0.5) * window for k in sorted(buckets)]
    for label, pick in (("TTFT", lambda m: m[0]), ("TBT", lambda m: m[1]), ("both", lambda m: m[0] and m[1])):
        bottom.plot(xs, [sum(pick(m) for m in buckets[k]) / len(buckets[k]) for k in sorted(buckets)], "o-",
                    label=label, linewidth=2.2 if label == "both" else 1, markersize=3)
    bottom.set_ylim(-0.02, 1.02)
    bottom.set_ylabel("SLO attainment")
    bottom.set_xlabel("time since the replay started (s)")
    bottom.legend(fontsize=8, loc="lower left")
    bottom.grid(alpha=0.3)
    top.set_title(f"replay of {summary['requests']} requests -> {s.target}: goodput {summary['goodput_rps'] or 0:.2f} "
                  f"req/s, attainment {summary['slo_attainment'] or 0:.0%}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    logger.info("wrote %s", path)
