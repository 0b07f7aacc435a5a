"""``tidekv proxy``: the command line of the PD proxy (``server``): flags, start-up and shutdown."""

from __future__ import annotations

import argparse
import asyncio
import signal

from tidekv import eventloop
from tidekv.config import secret_from_env
from tidekv.proxy.routing import ProxyConfig, RoutingPolicy, normalize_url
from tidekv.proxy.server import ProxyServer, require_aiohttp


async def _serve(config: ProxyConfig) -> None:
    server = ProxyServer(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    address = await server.start()
    print(f"tidekv proxy listening on {address}", flush=True)
    try:
        await stop.wait()
    finally:
        await server.stop()


def _run(args: argparse.Namespace) -> int:
    require_aiohttp()
    config = ProxyConfig(
        prefill_urls=tuple(args.prefill), decode_urls=tuple(args.decode), host=args.host, port=args.port,
        policy=RoutingPolicy(args.policy), timeout_s=args.timeout_s, prefix_chunk_chars=args.prefix_chunk_chars,
        prefix_capacity=args.prefix_capacity, master=args.master or "", release_grace_s=args.release_grace_s,
        ttft_slo_ms=args.ttft_slo_ms, probe_after_s=args.probe_after_s, secret=secret_from_env())
    eventloop.run(_serve(config))
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    d = ProxyConfig(prefill_urls=("http://p:1",), decode_urls=("http://d:1",))
    parser = sub.add_parser(
        "proxy",
        help="OpenAI-compatible router for prefill/decode disaggregation (needs aiohttp: the proxy extra)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="""\
Serve POST /v1/completions and /v1/chat/completions (streaming or not), GET /health and
GET /v1/models. Each request is sent to a prefill instance with max_tokens=1 and
kv_transfer_params={"do_remote_decode": true}; the kv_transfer_params of its answer are
added to the original request, which a decode instance then serves (pulling the KV through
tidekv instead of recomputing it). Backends are vLLM servers whose --kv-transfer-config
uses TidekvConnector (prefill: kv_producer or kv_both; decode: kv_consumer or kv_both).

Errors use OpenAI's shape {"error": {"message", "type", "code"}} and name the backend:
502 when a backend is unreachable or fails, 504 when it is silent for --timeout-s,
a backend's 4xx is passed on, 400 for a body that is not a JSON object.
GET /health answers 200 when every backend's /health does, else 503; its body lists
each backend's status.

--policy prefix sends a prompt to the prefill instance that already served the longest
prefix of it. This is the proxy's own memory of where prefixes went (per prefill
instance, an LRU set of chained hashes of --prefix-chunk-chars character chunks of the
prompt, or of the concatenated chat message contents); the tidekv store is asked nothing,
and no tokenizer is needed, so the proxy works for any model. Ties and prompts with no
remembered prefix go round robin.

--policy store --master HOST:PORT asks the tidekv master instead: the prompt goes to the
prefill instance whose own store segment holds the longest run of the prompt's leading KV
blocks. Prefill instances that save to the store (kv_connector_extra_config "master", and
"store_segment_size" > 0 so that they hold a segment) name their key namespaces (one per
tensor-parallel rank) in their answers; the proxy learns them from each instance's first
answer (from each of its engines' with data parallelism), gets the prompt's token ids from the
instance's POST /tokenize (token-id prompts are used as given) and asks the master where each
block's first chunk lives (one round trip, no lease). An instance holds a block when every
rank's slice of it lies in that rank's own segment. Instances not yet heard from, a master
that does not answer, and prompts nobody holds go round robin.

--policy conductor [--master HOST:PORT] [--ttft-slo-ms MS] estimates each prefill
instance's time to first token: its queued work (prompt tokens sent to it and not yet
answered) plus the prompt tokens it would compute (the prompt minus the longest prefix it
holds: from the master as --policy store asks, and from the proxy's own prefix memory as
--policy prefix keeps it), through a cost model per instance (fixed + per-token seconds)
fitted online to its observed prefill times. The prompt's length comes from a prefill's
POST /tokenize (token-id prompts are counted as given). The request goes to the smallest
estimate; ties, an unknown prompt length, and a proxy that has seen no prefill answer yet
choose as --policy store does. When even the smallest estimate exceeds --ttft-slo-ms the
request is answered 429 at once, {"error": {"type": "ttft_slo_exceeded", ...}} saying why
(load shedding), and counted in GET /metrics as tidekv_proxy_rejected_total{reason="ttft_slo"}.
Decode instances always go round robin.""",
        epilog="examples:\n  tidekv proxy --prefill http://10.0.0.1:8100 --decode http://10.0.0.2:8200 "
               "http://10.0.0.3:8200 --port 8000 --policy prefix\n"
               "  tidekv proxy --prefill http://10.0.0.1:8100 http://10.0.0.4:8100 --decode http://10.0.0.2:8200 "
               "--policy store --master 10.0.0.9:50051\n"
               "  tidekv proxy --prefill http://10.0.0.1:8100 http://10.0.0.4:8100 --decode http://10.0.0.2:8200 "
               "--policy conductor --ttft-slo-ms 2000",
    )
    parser.add_argument("--prefill", nargs="+", required=True, type=normalize_url, metavar="URL",
                        help="base URL(s) of the prefill instances, e.g. http://10.0.0.1:8100")
    parser.add_argument("--decode", nargs="+", required=True, type=normalize_url, metavar="URL",
                        help="base URL(s) of the decode instances")
    parser.add_argument("--host", default=d.host, help=f"address to listen on (default {d.host})")
    parser.add_argument("--port", type=int, default=d.port,
                        help=f"port to listen on, 0 = any free; the address is printed (default {d.port})")
    parser.add_argument("--policy", choices=[p.value for p in RoutingPolicy], default=d.policy.value,
                        help="prefill routing: round_robin, prefix, store or conductor (see above) "
                             "(default round_robin)")
    parser.add_argument("--master", metavar="HOST:PORT",
                        help="store policy (required) and conductor policy (optional): the tidekv master to ask "
                             "where a prompt's KV blocks are")
    parser.add_argument("--ttft-slo-ms", type=float, default=d.ttft_slo_ms,
                        help="conductor policy: answer 429 when every prefill's estimated TTFT exceeds this "
                             "(default 0: never shed)")
    parser.add_argument("--probe-after-s", type=float, default=d.probe_after_s,
                        help="conductor policy: a prefill's estimate is trusted for shedding this long after its "
                             "last answer (or while it has work in flight); older, the request is sent to it as a "
                             f"probe instead (default {d.probe_after_s:g})")
    parser.add_argument("--timeout-s", type=float, default=d.timeout_s,
                        help=f"a backend silent this long (connecting, or mid-answer) fails the request with "
                             f"504 (default {d.timeout_s:g})")
    parser.add_argument("--release-grace-s", type=float, default=d.release_grace_s,
                        help=f"a decode that took a request and then failed it silently (timeout, a stream cut "
                             f"before its first token) has its prefill's KV blocks released this long after the "
                             f"proxy hangs up; an unreachable or erroring decode's at once (default "
                             f"{d.release_grace_s:g})")
    parser.add_argument("--prefix-chunk-chars", type=int, default=d.prefix_chunk_chars,
                        help=f"prefix policy: characters per hashed chunk (default {d.prefix_chunk_chars})")
    parser.add_argument("--prefix-capacity", type=int, default=d.prefix_capacity,
                        help=f"prefix policy: chunk hashes remembered per prefill instance, LRU "
                             f"(default {d.prefix_capacity})")
    parser.set_defaults(func=_run)
