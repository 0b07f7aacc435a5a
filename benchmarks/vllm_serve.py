"""Online serving on real vLLM: one server, PD through ``tidekv proxy``, and prefix reuse through
tidekv's store (and LMCache's, when its venv exists), under the same open-loop workload, all in
one run. The client is vLLM's own ``vllm bench serve`` (``benchmarks/vllm_bench_serve.py``).

Workload (the same prompts, in the same order and at the same Poisson arrival times, for every
column): ``--requests`` requests at ``--rate`` per second; each prompt is one of ``--prefixes``
shared prefixes of ``--prefix-tokens`` tokens plus a suffix of its own, ``--prompt-tokens`` in all,
and asks for ``--output-tokens`` tokens (EOS ignored). The model is the tiny random Llama of
``integration/tiny_model.py`` (byte-level tokenizer: one character, one token; vLLM's block size
32), float32 on CPU, every server multiprocess as deployed, ``--max-num-seqs 4``.

Columns:
- ``one``: one plain vLLM server (no connector), as vLLM runs by default: the model in a worker
  process of its own, on both cores.
- ``one-in-process``: the same server with the model in the engine-core process
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0 --distributed-executor-backend uni``).
- ``pd-mp``: a prefill and a decode server (TidekvConnector, ``kv_both``) behind ``tidekv proxy``,
  each bound to its own core by vLLM (``VLLM_CPU_OMP_THREADS_BIND=0`` / ``=1``), workers in
  processes of their own.
- ``pd``: the same, set up as the README advises on a CPU host: each engine in-process and pinned
  (CPU affinity) to a core of its own. vLLM's worker process busy-polls its shared-memory queue
  for 1 s after every step (``SpinCondition``, not configurable), so two mp engines on two cores
  keep both cores busy and every API server, the proxy and the client wait for them.
- ``store-save`` then ``store``: ``tidekv up``; a first server (TidekvConnector with the master)
  serves the workload and saves its blocks; it stops; a second, fresh server serves the same
  workload and loads what the first computed (``tokens_loaded``: vLLM's
  ``vllm:external_prefix_cache_hits_total`` on the second server). Both as ``one``.
- ``lmcache-save`` then ``lmcache``: the same with LMCache 0.5.6 in multiprocess mode
  (``lmcache server``, ``--chunk-size`` = the block size; vLLM's ``LMCacheMPConnector``), run from
  ``.venv-lmcache`` (``integration/setup_lmcache.sh``); skipped, saying so, when that venv is missing.

Every server gets three untimed warm-up requests (prompts sharing no block with the workload)
before its column. Probes, sequential, after each PD column: ``proxy_overhead`` sends short
prompts through the proxy and the same legs directly (prefill with ``max_tokens=1`` and
``do_remote_decode``, then decode with the returned ``kv_transfer_params``), alternating which
goes first; the overhead is the difference of the TTFT medians. ``breakdown`` does the same with
workload-length prompts and reports the prefill leg and the decode leg's TTFT separately, next
to a plain server's TTFT for fresh prompts of that length (measured after each ``one`` column).

Usage (from the repo root): .venv-vllm/bin/python -m benchmarks.vllm_serve [--requests 50] [--rate 1.5]
           [--columns one,one-in-process,pd-mp,pd,store,lmcache] [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from integration.harness import OpenAIServer, free_port

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]

BLOCK_SIZE = 32
LETTERS = "abcdefghijklmnopqrstuvwxyz "
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
LMCACHE_PYTHON = ROOT / ".venv-lmcache" / "bin" / "python"
TIDEKV = {"kv_connector": "TidekvConnector", "kv_role": "kv_both"}
COLUMNS = ("one", "one-in-process", "pd-mp", "pd-mp-pinned", "pd", "one-cold", "store", "lmcache")


def _text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(LETTERS) for _ in range(n))


def workload(args: argparse.Namespace, num_prefixes: int) -> list[str]:
    """The prompts, in arrival order. BOS is the first token, so a prompt of n characters is n + 1
    tokens; the prefix is ``prefix_tokens - 1`` characters so that it fills whole blocks."""
    rng = random.Random(args.seed)
    prefixes = [_text(rng, args.prefix_tokens - 1) for _ in range(num_prefixes)]
    suffix_len = args.prompt_tokens - args.prefix_tokens
    prompts = [prefixes[i % num_prefixes] + _text(rng, suffix_len) for i in range(args.requests)]
    rng.shuffle(prompts)
    return prompts


def fresh_prompts(tag: str, n: int, tokens: int) -> list[str]:
    """``n`` prompts of ``tokens`` tokens that share no block with the workload or with each other
    (each starts with an upper-case tag and its number; the workload has no upper case)."""
    rng = random.Random(tag)
    return [f"{tag.upper()}{i:04d}" + _text(rng, tokens - 1 - len(tag) - 4) for i in range(n)]


def run_client(args: argparse.Namespace, url: str, model_dir: str, dataset: Path, out_dir: Path,
               name: str) -> dict[str, Any]:
    """One ``vllm bench serve`` run against ``url``; returns its saved result."""
    result = out_dir / f"{name}.json"
    argv = [sys.executable, str(HERE.parent / "vllm_bench_serve.py"), "--backend", "vllm", "--base-url", url,
            "--endpoint", "/v1/completions", "--model", "tiny", "--tokenizer", model_dir,
            "--dataset-name", "custom", "--dataset-path", str(dataset), "--skip-chat-template",
            "--custom-output-len", str(args.output_tokens), "--num-prompts", str(args.requests),
            "--request-rate", str(args.rate), "--seed", str(args.seed), "--ignore-eos", "--temperature", "0",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
            "--goodput", f"ttft:{args.slo_ttft_ms}", f"tpot:{args.slo_tpot_ms}", "--disable-tqdm",
            "--save-result", "--save-detailed", "--result-dir", str(out_dir), "--result-filename", result.name]
    proc = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"})
    if proc.returncode != 0 or not result.exists():
        raise RuntimeError(f"vllm bench serve ({name}) failed with {proc.returncode}:\n{proc.stdout[-4000:]}\n"
                           f"{proc.stderr[-4000:]}")
    data = json.loads(result.read_text())
    if data.get("completed") != args.requests:
        raise RuntimeError(f"vllm bench serve ({name}): {data.get('completed')} of {args.requests} completed; "
                           f"errors: {[e for e in data.get('errors', []) if e][:3]}")
    return data


def summarize(data: dict[str, Any]) -> dict[str, Any]:
    """The counts, throughputs and latency statistics of a ``vllm bench serve`` result (not its
    per-request lists)."""
    keys = ("completed", "duration", "request_throughput", "request_goodput", "output_throughput")
    out = {k: data.get(k) for k in keys}
    out.update({k: v for k, v in data.items() if re.fullmatch(r"(mean|median|std|p\d+)_(ttft|tpot|itl|e2el)_ms", k)})
    out["ttfts_ms"] = [round(t * 1e3, 2) for t in data.get("ttfts", [])]  # per request, in arrival order
    return out


# ---- sequential probes (plain HTTP; TTFT is the time to the first SSE chunk)

def _post(url: str, body: dict[str, Any], timeout_s: float = 120.0) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return json.loads(resp.read())


def _stream_ttft(url: str, body: dict[str, Any], timeout_s: float = 120.0) -> tuple[float, float]:
    """POSTs a streaming completion; returns (seconds to the first chunk, seconds to the end)."""
    host, port = url.removeprefix("http://").split("/")[0].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"POST {url}/v1/completions -> {resp.status}: {resp.read()[:500]!r}")
    first = None
    for raw in resp:
        line = raw.strip()
        # The first chunk carries the first token (its text may be empty: the tiny model's byte
        # tokens can end inside a UTF-8 sequence).
        if first is None and line.startswith(b"data:") and line != b"data: [DONE]":
            first = time.perf_counter() - t0
    end = time.perf_counter() - t0
    conn.close()
    if first is None:
        raise RuntimeError(f"{url}: a stream without a chunk")
    return first, end


def _body(prompt: str, max_tokens: int) -> dict[str, Any]:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}


def direct_pd(prefill: str, decode: str, prompt: str, max_tokens: int) -> tuple[float, float]:
    """The proxy's two legs called directly: (prefill leg seconds, TTFT seconds of both legs)."""
    t0 = time.perf_counter()
    answer = _post(prefill + "/v1/completions",
                   {**_body(prompt, 1), "kv_transfer_params": {"do_remote_decode": True}})
    leg = time.perf_counter() - t0
    params = answer.get("kv_transfer_params")
    if not params:
        raise RuntimeError(f"the prefill answered without kv_transfer_params: {answer}")
    ttft, _ = _stream_ttft(decode, {**_body(prompt, max_tokens), "kv_transfer_params": params})
    return leg, leg + ttft


def probe_pd(proxy: str, prefill: str, decode: str, prompts: list[str], max_tokens: int) -> dict[str, Any]:
    """Pairs of (through the proxy, direct), alternating which goes first, each on its own prompt."""
    via, direct, legs = [], [], []
    for i in range(0, len(prompts) - 1, 2):
        first_proxy = (i // 2) % 2 == 0
        for through_proxy in (first_proxy, not first_proxy):
            prompt = prompts[i] if through_proxy else prompts[i + 1]
            if through_proxy:
                via.append(_stream_ttft(proxy, _body(prompt, max_tokens))[0])
            else:
                leg, ttft = direct_pd(prefill, decode, prompt, max_tokens)
                legs.append(leg)
                direct.append(ttft)
    med = statistics.median
    return {"pairs": len(via), "proxy_ttft_p50_ms": med(via) * 1e3, "direct_ttft_p50_ms": med(direct) * 1e3,
            "overhead_p50_ms": (med(via) - med(direct)) * 1e3, "prefill_leg_p50_ms": med(legs) * 1e3,
            "decode_leg_ttft_p50_ms": (med([d - p for d, p in zip(direct, legs)])) * 1e3,
            "samples_ms": {"proxy": [v * 1e3 for v in via], "direct": [d * 1e3 for d in direct],
                           "prefill_leg": [p * 1e3 for p in legs]}}


def probe_plain(url: str, prompts: list[str], max_tokens: int) -> dict[str, Any]:
    ttfts = [_stream_ttft(url, _body(p, max_tokens))[0] for p in prompts]
    return {"samples": len(ttfts), "ttft_p50_ms": statistics.median(ttfts) * 1e3,
            "samples_ms": [t * 1e3 for t in ttfts]}


def warm(url: str, tag: str, length: int, max_tokens: int) -> None:
    for prompt in fresh_prompts(tag, 3, length):
        _stream_ttft(url, _body(prompt, max_tokens))


# ---- the proxy alone, against stub backends

def stub_main(port: int, params: dict[str, Any]) -> None:
    """A stand-in for a prefill and a decode instance that answers at once: a prefill request
    (``do_remote_decode``) with ``params`` as its kv_transfer_params, anything else with a stream
    of ``max_tokens`` one-token chunks."""
    from aiohttp import web

    def chunk(text: str) -> bytes:
        return b"data: " + json.dumps({"id": "cmpl-stub", "object": "text_completion", "model": "tiny",
                                        "choices": [{"index": 0, "text": text, "finish_reason": None}]}).encode() + b"\n\n"

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if (body.get("kv_transfer_params") or {}).get("do_remote_decode"):
            return web.json_response({"id": "cmpl-stub", "object": "text_completion", "model": "tiny",
                                      "choices": [{"index": 0, "text": "a", "finish_reason": "length"}],
                                      "kv_transfer_params": params})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(int(body.get("max_tokens", 1))):
            await resp.write(chunk("a"))
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", health)
    web.run_app(app, host="127.0.0.1", port=port, print=lambda *_: print("stub listening", flush=True))


def probe_proxy_alone(params: dict[str, Any], pairs: int, max_tokens: int) -> dict[str, Any]:
    """The proxy's own added latency: stub backends that answer at once, ``pairs`` requests
    through the proxy against the same two legs called directly (alternating which goes first)."""
    stub_port, proxy_port = free_port(), free_port()
    stub_argv = [sys.executable, "-m", "benchmarks.vllm_serve", "--stub", str(stub_port), json.dumps(params)]
    with spawn(stub_argv, "stub listening", "stub"):
        stub = f"http://127.0.0.1:{stub_port}"
        with spawn([sys.executable, "-m", "tidekv", "proxy", "--prefill", stub, "--decode", stub,
                    "--port", str(proxy_port)], "listening", "tidekv proxy"):
            proxy = f"http://127.0.0.1:{proxy_port}"
            prompt = fresh_prompts("s", 1, 1280)[0]
            via, direct, via_end, direct_end = [], [], [], []
            for i in range(pairs + 20):  # the first 20 pairs warm both paths up and are dropped
                for through_proxy in ((True, False) if i % 2 else (False, True)):
                    if through_proxy:
                        ttft, end = _stream_ttft(proxy, _body(prompt, max_tokens))
                    else:
                        t0 = time.perf_counter()
                        answer = _post(stub + "/v1/completions",
                                       {**_body(prompt, 1), "kv_transfer_params": {"do_remote_decode": True}})
                        leg = time.perf_counter() - t0
                        ttft, end = _stream_ttft(stub, {**_body(prompt, max_tokens),
                                                        "kv_transfer_params": answer["kv_transfer_params"]})
                        ttft, end = ttft + leg, end + leg
                    if i >= 20:
                        (via if through_proxy else direct).append(ttft)
                        (via_end if through_proxy else direct_end).append(end)
    med = statistics.median
    return {"pairs": pairs, "proxy_ttft_p50_ms": med(via) * 1e3, "direct_ttft_p50_ms": med(direct) * 1e3,
            "overhead_ttft_p50_ms": (med(via) - med(direct)) * 1e3,
            "overhead_end_p50_ms": (med(via_end) - med(direct_end)) * 1e3}


def server_means(srv: OpenAIServer, before: dict[str, float] | None = None) -> dict[str, float]:
    """vLLM's own per-request histograms on ``srv`` (sum and count; means since ``before``, in ms)."""
    names = ("vllm:time_to_first_token_seconds", "vllm:request_queue_time_seconds",
             "vllm:request_prefill_time_seconds")
    now = {f"{n}_{part}": srv.metric(f"{n}_{part}") for n in names for part in ("sum", "count")}
    if before is None:
        return now
    out = {}
    for n in names:
        count = now[f"{n}_count"] - before[f"{n}_count"]
        if count:
            out[n.removeprefix("vllm:").removesuffix("_seconds") + "_mean_ms"] = \
                (now[f"{n}_sum"] - before[f"{n}_sum"]) / count * 1e3
    return out


# ---- processes

@contextlib.contextmanager
def spawn(argv: list[str], ready: str, name: str, timeout_s: float = 90.0,
          env: dict[str, str] | None = None) -> Iterator[tuple[subprocess.Popen[str], re.Match[str]]]:
    """Starts ``argv``; yields once a line of its output matches ``ready``; stops it afterwards."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})}, start_new_session=True)
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        match = None
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                break
            lines.append(line)
            match = re.search(ready, line)
            if match:
                break
        if match is None:
            raise RuntimeError(f"{name} did not start:\n{''.join(lines)[-4000:]}")
        # Keep draining its output so that a chatty process never blocks on a full pipe.
        threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()  # type: ignore[union-attr]
        yield proc, match
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 15)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()


def server(model: str, log_dir: Path, name: str, *, kv: dict[str, Any] | None = None, mode: str = "mp",
           cpus: set[int] | None = None, bind: str | None = None, python: str = sys.executable,
           reserve_as_plain: bool = True) -> OpenAIServer:
    """An OpenAI server. ``mode`` "mp" is vLLM's default on CPU: the model runs in a worker process
    of its own, which busy-polls vLLM's shared-memory queue for 1 s after every step. "in-process"
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0 --distributed-executor-backend uni``) runs it in the
    engine-core process, which sleeps when idle. ``cpus``: the server's CPU affinity (every process
    it starts inherits it); ``bind``: ``VLLM_CPU_OMP_THREADS_BIND`` (mp mode only); ``reserve_as_plain``:
    a server with a connector keeps back the cores a plain one does (``--vllm-default-reservation``)."""
    env = {} if bind is None else {"VLLM_CPU_OMP_THREADS_BIND": bind}
    if kv is not None and bind is None and reserve_as_plain:
        # With any kv_transfer_config vLLM keeps one core more back from its OpenMP threads; on
        # 2 vCPUs that is more than it has, so it keeps none (tidekv_vllm.worker.
        # cpu_reservation_warning). Keep back what a plain server does, as the README advises.
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "1"
    return OpenAIServer(model, kv_transfer_config=kv, env=env, log_path=log_dir / f"{name}.log", python=python,
                        cpus=cpus, in_process=mode == "in-process")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=50)
    ap.add_argument("--rate", type=float, default=1.5, help="requests per second (Poisson arrivals)")
    ap.add_argument("--prefixes", type=int, default=10, help="distinct shared prefixes")
    ap.add_argument("--prompt-tokens", type=int, default=1280)
    ap.add_argument("--prefix-tokens", type=int, default=1024)
    ap.add_argument("--output-tokens", type=int, default=24)
    ap.add_argument("--slo-ttft-ms", type=float, default=500.0, help="goodput: a request meets its SLO under this TTFT")
    ap.add_argument("--slo-tpot-ms", type=float, default=50.0, help="... and under this TPOT")
    ap.add_argument("--probes", type=int, default=20, help="prompts per sequential probe (half through the proxy)")
    ap.add_argument("--columns", default=",".join(COLUMNS), help=f"any of {', '.join(COLUMNS)}")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep-logs", help="copy every server's log into this directory")
    ap.add_argument("--proxy-pairs", type=int, default=200, help="requests each way for the proxy's own overhead")
    ap.add_argument("--json", help="write the summary (and every probe sample) here")
    ap.add_argument("--vllm-default-reservation", action="store_true",
                    help="leave VLLM_CPU_NUM_OF_RESERVED_CPU unset for the store and LMCache servers (vLLM then keeps "
                         "no core back on a 2-vCPU host; by default they keep one, as a plain server does)")
    ap.add_argument("--stub", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.stub:
        stub_main(int(args.stub[0]), json.loads(args.stub[1]))
        return 0
    if args.prompt_tokens <= args.prefix_tokens or args.prefix_tokens % BLOCK_SIZE:
        ap.error(f"--prefix-tokens must be a multiple of {BLOCK_SIZE} and below --prompt-tokens")
    columns = args.columns.split(",")
    unknown = set(columns) - set(COLUMNS)
    if unknown:
        ap.error(f"unknown column(s) {sorted(unknown)}; choose from {', '.join(COLUMNS)}")
    from integration.tiny_model import build

    results: dict[str, Any] = {"config": vars(args), "columns": {}, "probes": {}, "notes": []}
    with tempfile.TemporaryDirectory(prefix="tidekv-vllm-serve-") as tmp_name:
        tmp = Path(tmp_name)
        model = str(build(tmp / "model", seed=0))
        dataset, cold = tmp / "workload.jsonl", tmp / "cold.jsonl"
        dataset.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in workload(args, args.prefixes)))
        cold.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in workload(args, args.requests)))
        logs = tmp / "logs"
        logs.mkdir()
        n_tok, out_tok = args.prompt_tokens, args.output_tokens
        handoff: dict[str, Any] | None = None

        def column(name: str, url: str, **servers: OpenAIServer) -> None:
            """Runs the workload against ``url`` (the cold one for ``one-cold`` and the reuse columns);
            records vLLM's own means on each of ``servers``."""
            data = dataset if name in ("one", "one-in-process", "pd-mp", "pd-mp-pinned", "pd") else cold
            print(f"== {name}: {args.requests} requests at {args.rate}/s against {url} ({data.stem} workload)", flush=True)
            before = {role: server_means(srv) for role, srv in servers.items()}
            results["columns"][name] = summarize(run_client(args, url, model, data, tmp, name))
            results["columns"][name]["servers"] = {role: server_means(srv, before[role])
                                                   for role, srv in servers.items()}

        try:
            for name, mode in (("one", "mp"), ("one-in-process", "in-process"), ("one-cold", "mp")):
                if name in columns:
                    with server(model, logs, name, mode=mode) as one:
                        warm(one.url, "w", n_tok, out_tok)
                        column(name, one.url, server=one)
                        results["probes"][f"{name}_fresh_ttft"] = probe_plain(
                            one.url, fresh_prompts("f", args.probes // 2, n_tok), 1)
            for name, mode in (("pd-mp", "mp"), ("pd-mp-pinned", "mp"), ("pd", "in-process")):
                if name not in columns:
                    continue
                # Each engine on a core of its own: vLLM's OMP binding in mp mode (and the whole
                # server's CPU affinity: pinned), the process's CPU affinity in-process (the API
                # server shares its engine's core).
                pin: dict[str, Any] = {"bind": "0"} if mode == "mp" else {"cpus": {0}}
                pin_d: dict[str, Any] = {"bind": "1"} if mode == "mp" else {"cpus": {1}}
                if name == "pd-mp-pinned":
                    pin["cpus"], pin_d["cpus"] = {0}, {1}
                with server(model, logs, f"{name}-prefill", kv=TIDEKV, mode=mode, **pin) as prefill, \
                        server(model, logs, f"{name}-decode", kv=TIDEKV, mode=mode, **pin_d) as decode:
                    port = free_port()
                    with spawn([sys.executable, "-m", "tidekv", "proxy", "--prefill", prefill.url, "--decode",
                                decode.url, "--port", str(port)], "listening", "tidekv proxy"):
                        proxy = f"http://127.0.0.1:{port}"
                        warm(proxy, "w", n_tok, out_tok)
                        column(name, proxy, prefill=prefill, decode=decode)
                        results["probes"][f"{name}_proxy_overhead"] = probe_pd(
                            proxy, prefill.url, decode.url, fresh_prompts("o", args.probes, 96), 2)
                        results["probes"][f"{name}_breakdown"] = probe_pd(
                            proxy, prefill.url, decode.url, fresh_prompts("b", args.probes, n_tok), 2)
                        # A real prefill's answer, for the stub prefill below (its hold just times out).
                        handoff = _post(prefill.url + "/v1/completions", {
                            **_body(fresh_prompts("h", 1, n_tok)[0], 1),
                            "kv_transfer_params": {"do_remote_decode": True}})["kv_transfer_params"]
            if handoff is not None:
                print(f"== the proxy alone: {args.proxy_pairs} pairs against stub backends", flush=True)
                results["probes"]["proxy_alone"] = probe_proxy_alone(handoff, args.proxy_pairs, out_tok)
            reserve = not args.vllm_default_reservation
            if "store" in columns:
                with spawn([sys.executable, "-m", "tidekv", "up", "--port", "0", "--metrics-port", "-1",
                            "--segment-size", "2GiB"], r'"master": "([^"]+)"', "tidekv up") as (_, m):
                    kv = {**TIDEKV, "kv_connector_extra_config": {"master": m.group(1)}}
                    reuse_column(args, column, results, "store",
                                 lambda n: server(model, logs, n, kv=kv, reserve_as_plain=reserve), n_tok)
            if "lmcache" in columns:
                if not LMCACHE_PYTHON.exists():
                    note = f"lmcache column skipped: {LMCACHE_PYTHON} missing (run integration/setup_lmcache.sh)"
                    print("== " + note)
                    results["notes"].append(note)
                else:
                    lm_port, lm_http = free_port(), free_port()
                    with spawn([str(LMCACHE_PYTHON), "-m", "lmcache.cli.main", "server", "--host", "127.0.0.1",
                                "--port", str(lm_port), "--http-host", "127.0.0.1", "--http-port", str(lm_http),
                                "--l1-size-gb", "2", "--eviction-policy", "LRU", "--supported-transfer-mode", "auto",
                                "--chunk-size", str(BLOCK_SIZE)],
                               r"Uvicorn running on", "lmcache server", timeout_s=180,
                               env={"LMCACHE_TRACK_USAGE": "false"}):
                        kv = {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
                              "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1",
                                                            "lmcache.mp.port": lm_port}}
                        reuse_column(args, column, results, "lmcache",
                                     lambda n: server(model, logs, n, kv=kv, python=str(LMCACHE_PYTHON),
                                                      reserve_as_plain=reserve), n_tok)
        finally:
            if args.keep_logs:
                Path(args.keep_logs).mkdir(parents=True, exist_ok=True)
                for log in logs.iterdir():
                    (Path(args.keep_logs) / log.name).write_bytes(log.read_bytes())
    report(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


def reuse_column(args: argparse.Namespace, column: Any, results: dict[str, Any], name: str, make: Any,
                 n_tok: int) -> None:
    """``<name>-save`` on a first server, which then stops; ``<name>`` on a fresh second one."""
    with make(f"{name}-save") as first:
        warm(first.url, "w", n_tok, args.output_tokens)
        column(f"{name}-save", first.url, server=first)
    # Let the last saves land: the connector saves after the forward, on a thread of its own.
    time.sleep(2.0)
    with make(name) as second:
        warm(second.url, "v", n_tok, args.output_tokens)
        before = second.metric(EXTERNAL_HITS)
        column(name, second.url, server=second)
        loaded = second.metric(EXTERNAL_HITS) - before
        results["columns"][name]["tokens_loaded"] = loaded
        results["columns"][name]["tokens_loaded_per_request"] = loaded / args.requests


def report(results: dict[str, Any]) -> None:
    cols = results["columns"]
    if cols:
        print(f"\n{'column':<16}{'TTFT p50':>10}{'p90':>9}{'p99':>9}{'TPOT p50':>10}{'p90':>8}{'p99':>8}"
              f"{'goodput/s':>11}{'loaded/req':>12}   (ms; goodput: requests/s within the SLO)")
        for name, c in cols.items():
            loaded = c.get("tokens_loaded_per_request")
            print(f"{name:<16}{c['p50_ttft_ms']:>10.1f}{c['p90_ttft_ms']:>9.1f}{c['p99_ttft_ms']:>9.1f}"
                  f"{c['p50_tpot_ms']:>10.1f}{c['p90_tpot_ms']:>8.1f}{c['p99_tpot_ms']:>8.1f}"
                  f"{c['request_goodput'] or 0:>11.2f}{'' if loaded is None else f'{loaded:.0f}':>12}")
    probes = results["probes"]
    fresh = {n: probes[f"{n}_fresh_ttft"]["ttft_p50_ms"] for n in ("one", "one-in-process") if f"{n}_fresh_ttft" in probes}
    for name in ("pd-mp", "pd-mp-pinned", "pd"):
        if f"{name}_proxy_overhead" in probes:
            p = probes[f"{name}_proxy_overhead"]
            print(f"\n{name}: proxy overhead ({p['pairs']} pairs of short prompts): TTFT p50 {p['proxy_ttft_p50_ms']:.1f} ms "
                  f"through the proxy vs {p['direct_ttft_p50_ms']:.1f} ms direct: {p['overhead_p50_ms']:+.2f} ms")
        if f"{name}_breakdown" in probes:
            b = probes[f"{name}_breakdown"]
            print(f"{name}: sequential TTFT p50, workload-length prompts: prefill leg {b['prefill_leg_p50_ms']:.1f} ms "
                  f"+ decode leg {b['decode_leg_ttft_p50_ms']:.1f} ms = {b['direct_ttft_p50_ms']:.1f} ms direct, "
                  f"{b['proxy_ttft_p50_ms']:.1f} ms through the proxy; one server, fresh prompts: "
                  + ", ".join(f"{v:.1f} ms ({n})" for n, v in fresh.items()))
    if "proxy_alone" in probes:
        p = probes["proxy_alone"]
        print(f"the proxy alone ({p['pairs']} pairs, stub backends): TTFT p50 {p['proxy_ttft_p50_ms']:.2f} ms through it "
              f"vs {p['direct_ttft_p50_ms']:.2f} ms direct: {p['overhead_ttft_p50_ms']:+.2f} ms to the first token, "
              f"{p['overhead_end_p50_ms']:+.2f} ms to the end")
    for name, c in cols.items():
        for role, means in c.get("servers", {}).items():
            print(f"{name} {role}: vLLM's own means: " + ", ".join(f"{k.removesuffix('_mean_ms')} {v:.1f} ms"
                                                                 for k, v in means.items()))
    ratios = [("pd", "one"), ("pd", "one-in-process"), ("pd-mp", "one"), ("pd-mp-pinned", "one"), ("store", "one-cold"),
              ("lmcache", "one-cold"), ("store", "store-save"), ("store", "lmcache")]
    for name, base in ratios:
        if name in cols and base in cols:
            print(f"TTFT p50 {name} / {base}: {cols[name]['p50_ttft_ms'] / cols[base]['p50_ttft_ms']:.2f}")
    for note in results["notes"]:
        print("note: " + note)


if __name__ == "__main__":
    sys.exit(main())
