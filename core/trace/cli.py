"""``tidekv trace analyze|replay``: the command line of the FAST'25 trace tools (``analyze``,
``replay``): flags, output files, exit codes."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import TypeVar

from tidekv.errors import ConfigError
from tidekv.trace.cache import Routing
from tidekv.trace.format import load_trace, parse_token_count

T = TypeVar("T")


def _csv(kind: Callable[[str], T], what: str) -> Callable[[str], tuple[T, ...]]:
    """An argparse type for a comma-separated list of ``kind``."""

    def parse(text: str) -> tuple[T, ...]:
        items = [t for t in text.split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"{what}: give a comma-separated list")
        try:
            return tuple(kind(t.strip()) for t in items)
        except (ConfigError, ValueError) as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return parse


def _capacity(text: str) -> int:
    return parse_token_count(text, "--capacity")


def _run_analyze(args: argparse.Namespace) -> int:
    from tidekv.trace.analyze import AnalyzeSettings, analyze, plot, report_text, write_json
    from tidekv.bench.report import require_matplotlib

    if args.plot:
        require_matplotlib()
    settings = AnalyzeSettings(capacities_tokens=args.capacity, instances=args.instances, routings=args.routing,
                               fraction=args.fraction, window_s=args.window_s)
    started = time.perf_counter()
    requests = load_trace(args.trace, max_requests=args.max_requests)
    read_s = time.perf_counter() - started
    report = analyze(requests, settings, trace_name=args.trace, show_progress=not args.no_progress)
    print(report_text(report))
    print(f"read {len(requests)} requests in {read_s:.2f} s")
    if args.json:
        write_json(args.json, report)
    if args.plot:
        plot(args.plot, report)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    trace = sub.add_parser("trace", help="FAST'25 traces: capacity planning (analyze) and live replay (replay)",
                           description="Tools for Mooncake's FAST'25 traces (JSON lines: timestamp ms, input_length, "
                                       "output_length, hash_ids of 512-token blocks).")
    trace_sub = trace.add_subparsers(dest="trace_command", metavar="TOOL")
    trace_sub.required = True
    a = trace_sub.add_parser(
        "analyze", formatter_class=argparse.RawDescriptionHelpFormatter,
        help="prefix-cache hit rates of a global pool vs per-instance caches, offline",
        description="""\
Simulates, over the trace in file order, one global LRU prefix cache and per-instance local
caches, for each capacity and instance count. A request's hit is its longest run of leading
hash_ids present in the cache, worth min(hit_blocks * 512, input_length) tokens; then each of
its blocks is touched in order (present: most recent; absent: inserted as most recent), and the
least recent blocks are evicted while more than capacity / 512 are held. hit rate = sum of hit
tokens / sum of input_length. Each of N local caches holds capacity / N; requests are dealt
round robin, or by the proxy's prefix rule (the instance holding the longest leading run, ties
and misses taking turns). Also: prefill tokens saved, the working set per --window-s of trace
time, and the smallest global capacity reaching --fraction of the unbounded hit rate.""",
        epilog="example:\n  tidekv trace analyze conversation_trace.jsonl --capacity 0,1M,3M,10M --instances 1,8 "
               "--json out.json --plot hit_rate.png")
    a.add_argument("trace", help="the trace, JSON lines")
    a.add_argument("--capacity", type=_csv(_capacity, "--capacity"), default=(0, 1_000_000, 3_000_000, 10_000_000),
                   metavar="LIST", help="total capacities in tokens, decimal K/M/G, 0 = unbounded (default 0,1M,3M,10M)")
    a.add_argument("--instances", type=_csv(int, "--instances"), default=(1, 8), metavar="LIST",
                   help="instance counts for the local caches (default 1,8)")
    a.add_argument("--routing", type=_csv(Routing, "--routing"), default=(Routing.ROUND_ROBIN, Routing.PREFIX),
                   metavar="LIST", help="how requests are dealt to local caches: round_robin, prefix "
                                        "(default round_robin,prefix)")
    a.add_argument("--fraction", type=float, default=0.9,
                   help="report the global capacity reaching this fraction of the unbounded hit rate (default 0.9)")
    a.add_argument("--window-s", type=float, default=60.0, help="working-set window, s of trace time (default 60)")
    a.add_argument("--max-requests", type=int, default=None, help="only the first N requests")
    a.add_argument("--json", metavar="FILE", help="write the report as JSON ('-': stdout); its 'results' has one "
                   "object per capacity x instances x policy with capacity_tokens, instances, policy (global or "
                   "local), routing, hit_rate, requests, hit_tokens, prefill_tokens_saved, input_tokens")
    a.add_argument("--plot", metavar="FILE.png", help="plot hit rate vs capacity, global vs local (needs matplotlib)")
    a.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    a.set_defaults(func=_run_analyze)
