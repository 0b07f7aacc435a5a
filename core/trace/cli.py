"""``tidekv trace analyze|replay``: the command line of the FAST'25 trace tools (``analyze``,
``replay``): flags, output files, exit codes."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import TypeVar

from tidekv.errors import ConfigError
from tidekv.trace.cache import Routing
from tidekv.trace.format import TraceRequest, load_trace, parse_token_count
from tidekv.trace.sample import sample

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


def _disk_capacity(text: str) -> int:
    return parse_token_count(text, "--disk-capacity")


def _load(args: argparse.Namespace) -> list[TraceRequest]:
    """The trace's first ``--max-requests``, then ``--until-s`` and ``--sample-conversations``."""
    requests = load_trace(args.trace, max_requests=args.max_requests)
    if args.sample_conversations != 1 or args.until_s is not None:
        requests = sample(requests, keep_one_in=args.sample_conversations, until_s=args.until_s)
    return requests


def _add_slice_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-requests", type=int, default=None, help="only the first N requests of the file")
    p.add_argument("--until-s", type=float, default=None,
                   help="only the requests within this many seconds of trace time of the first (default: all)")
    p.add_argument("--sample-conversations", type=int, default=1, metavar="K",
                   help="keep one conversation in K, each with all its requests (a conversation: the requests "
                        "sharing their second hash id; a stable hash decides; default 1: all)")


def _run_analyze(args: argparse.Namespace) -> int:
    from tidekv.report import require_matplotlib
    from tidekv.trace.analyze import AnalyzeSettings, analyze, plot, report_text, write_json

    if args.plot:
        require_matplotlib()
    settings = AnalyzeSettings(capacities_tokens=args.capacity, disk_capacities_tokens=args.disk_capacity,
                               instances=args.instances, routings=args.routing,
                               fraction=args.fraction, window_s=args.window_s)
    started = time.perf_counter()
    requests = _load(args)
    read_s = time.perf_counter() - started
    report = analyze(requests, settings, trace_name=args.trace, show_progress=not args.no_progress)
    print(report_text(report))
    print(f"read {len(requests)} requests in {read_s:.2f} s")
    if args.json:
        write_json(args.json, report)
    if args.plot:
        plot(args.plot, report)
    return 0


def _run_replay(args: argparse.Namespace) -> int:
    from tidekv.proxy.routing import normalize_url
    from tidekv.report import require_matplotlib
    from tidekv.trace import replay_report
    from tidekv.trace.prompts import PromptSettings
    from tidekv.trace.replay import ReplaySettings, require_aiohttp, run

    require_aiohttp()
    if args.plot:
        require_matplotlib()
    settings = ReplaySettings(
        target=normalize_url(args.target), model=args.model, speedup=args.speedup,
        prompts=PromptSettings(scale_tokens=args.scale_tokens, block_tokens=args.block_tokens,
                               vocab_size=args.vocab_size, first_token=args.first_token,
                               max_input_tokens=args.max_input_tokens),
        timeout_s=args.timeout_s, ttft_slo_ms=args.ttft_slo_ms, tbt_slo_ms=args.tbt_slo_ms,
        metrics_urls=tuple(normalize_url(u) for u in args.metrics_url), ignore_eos=not args.no_ignore_eos,
        max_in_flight=args.max_in_flight)
    requests = _load(args)
    if not requests:
        raise ConfigError(f"trace {args.trace!r} has no requests")
    result = run(requests, settings, show_progress=not args.no_progress)
    summary = replay_report.summarize(result)
    print(replay_report.report_text(summary))
    if args.json:
        replay_report.write_json(args.json, result, summary)
    if args.plot:
        replay_report.plot(args.plot, result, summary)
    return 0 if summary["succeeded"] else 1


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
    a.add_argument("--disk-capacity", type=_csv(_disk_capacity, "--disk-capacity"), default=(), metavar="LIST",
                   help="disk tiers added to each bounded global capacity, tokens, decimal K/M/G (default: none): "
                        "blocks memory evicts go to the disk tier, an LRU whose least recent blocks leave the pool; a "
                        "hit may come from either tier (the report says how much came from disk)")
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
    _add_slice_flags(a)
    a.add_argument("--json", metavar="FILE", help="write the report as JSON ('-': stdout); its 'results' has one "
                   "object per capacity x instances x policy with capacity_tokens, instances, policy (global or "
                   "local), routing, hit_rate, requests, hit_tokens, prefill_tokens_saved, input_tokens")
    a.add_argument("--plot", metavar="FILE.png", help="plot hit rate vs capacity, global vs local (needs matplotlib)")
    a.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    a.set_defaults(func=_run_analyze)
    r = trace_sub.add_parser(
        "replay", formatter_class=argparse.RawDescriptionHelpFormatter,
        help="drive a live OpenAI-compatible deployment with a trace; TTFT, TBT, SLO attainment, goodput",
        description="""\
Sends each request of the trace at its time (timestamps / --speedup, from the first request)
as a streaming POST /v1/completions to --target (the tidekv proxy, or one vLLM server). The
prompt is token ids: each hash id becomes --block-tokens ids (equal ids give identical blocks,
different ids differ; make it a multiple of the engine's KV block size), cut to input_length
x --scale-tokens; max_tokens is output_length x --scale-tokens (with ignore_eos, so exactly
that many are generated). Measured: time to first token, time between tokens, end to end;
SLO attainment (a request meets the TTFT SLO when its first token came within --ttft-slo-ms,
the TBT SLO when its mean gap between tokens is within --tbt-slo-ms; failures miss both) and
goodput (requests meeting both per second). The deployment's prefix-cache hit rate is the
change in *prefix_cache_hits_total / *prefix_cache_queries_total (vLLM's /metrics) over the
run, read from the target and every --metrics-url. Every request has a deadline (--timeout-s);
failures are counted by kind (http_STATUS, timeout, connect, stream, bad_response).
Exit status 1 when no request succeeded.""",
        epilog="example (a slice of the conversation trace, 1/32 of its tokens, 4x faster):\n"
               "  tidekv trace replay conversation_trace.jsonl --target http://127.0.0.1:8000 --max-requests 200 "
               "--speedup 4 --scale-tokens 0.03125 --block-tokens 16 --metrics-url http://127.0.0.1:8100 "
               "--json replay.json --plot replay.png")
    r.add_argument("trace", help="the trace, JSON lines")
    r.add_argument("--target", required=True, metavar="URL", help="base URL of the deployment, e.g. http://127.0.0.1:8000")
    r.add_argument("--model", help="the model field (default: the first of the target's /v1/models)")
    r.add_argument("--speedup", type=float, default=1.0, help="trace time runs this many times faster (default 1)")
    _add_slice_flags(r)
    r.add_argument("--scale-tokens", type=float, default=1.0,
                   help="multiply input and output lengths by this, 0 < s <= 1 (default 1)")
    r.add_argument("--block-tokens", type=int, default=None,
                   help="prompt tokens per hash id (default 512 x --scale-tokens)")
    r.add_argument("--max-input-tokens", type=int, default=None,
                   help="cut prompts to this many tokens (the model's context; default: not cut)")
    r.add_argument("--vocab-size", type=int, default=1000, help="token ids are drawn from this many (default 1000)")
    r.add_argument("--first-token", type=int, default=100, help="the smallest token id used (default 100)")
    r.add_argument("--ttft-slo-ms", type=float, default=2000.0, help="TTFT SLO (default 2000)")
    r.add_argument("--tbt-slo-ms", type=float, default=200.0, help="TBT SLO, on a request's mean gap (default 200)")
    r.add_argument("--timeout-s", type=float, default=120.0, help="deadline of one request (default 120)")
    r.add_argument("--metrics-url", nargs="*", default=[], metavar="URL",
                   help="more base URLs whose /metrics count prefix-cache hits (e.g. the vLLM servers)")
    r.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos (for non-vLLM servers)")
    r.add_argument("--max-in-flight", type=int, default=1024, help="open requests at most (default 1024)")
    r.add_argument("--json", metavar="FILE", help="write the summary and every request as JSON ('-': stdout)")
    r.add_argument("--plot", metavar="FILE.png", help="plot TTFT over time and SLO attainment (needs matplotlib)")
    r.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    r.set_defaults(func=_run_replay)
