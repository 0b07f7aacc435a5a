"""The FAST'25 conversation trace replayed against real vLLM (CPU) under each of the proxy's
routing policies, and against one server with no connector, all in one run (issue 20, item 4).

Workload (the same for every column): a slice of the trace that keeps its prefix reuse, chosen
by ``tidekv trace``'s own flags: one conversation in ``--sample-conversations`` (8), each with
all its requests, over the whole hour of the trace (``--until-s`` to cut it), at the trace's
timestamps divided by ``--speedup`` (30). (The first N requests, the slice before, have almost
no reuse: conversations come back minutes later; ``tidekv.trace.sample`` says more.) The
slice's hit rates as ``tidekv trace analyze`` simulates them (one unbounded global pool; two
unbounded local caches, round robin and by prefix) are printed and kept in the JSON. Replayed
by ``tidekv trace replay`` with ``--scale-tokens`` (1/16: a trace block of 512 tokens becomes 32
tokens, vLLM's block size here), prompts cut to ``--max-input-tokens``, token ids from 100..249
(the tiny model's byte vocabulary), max_tokens = output_length x scale, EOS ignored. The model
is the tiny random Llama of ``integration/tiny_model.py`` (float32, ``--max-num-seqs 4``, block
size 32), each engine in-process (the README's advice for engines sharing a CPU host).

Columns:
- ``one``: one vLLM server, no connector (pinned to no core).
- ``round_robin``, ``prefix``, ``store``, ``conductor``: a fresh ``tidekv up`` (master and
  pool), two prefill servers (TidekvConnector ``kv_both`` saving to the store, each with a
  segment; pinned to core 0 and core 1) and a decode server (``kv_both``, unpinned), behind
  ``tidekv proxy --policy P`` (``--master`` for store and conductor; the conductor sheds at
  ``--ttft-slo-ms``). Everything is restarted for every column, so each starts cold.
- ``small_pool``, ``small_pool_disk``: policy ``store``, but the pool is only ``tidekv up``'s
  segment of ``--small-pool`` bytes (the prefills hold none), too small for the slice's KV;
  ``small_pool_disk`` adds the disk tier to that same segment (``--disk-paths`` in a temporary
  directory of the run, 4 GiB, ``--disk-write-through all``).

Each column gets two untimed warm-up requests per server (token ids no trace prompt uses) before
the replay. Reported per column: goodput (requests/s meeting both SLOs), SLO attainment (TTFT,
TBT, both), TTFT p50/p90, errors by kind (``http_429``: shed by the conductor), the prefill
servers' prefix-cache hit rates as vLLM counts them (``vllm:prefix_cache_*``: their own
GPU-cache hits; ``vllm:external_prefix_cache_*``: tokens loaded from the store), over the
replay, and the requests the proxy sent each prefill. For the conductor, its gauges are read from
the proxy's /metrics every second (``conductor_gauges`` in the JSON: queued tokens, cost-model
coefficients, decode leg and in-flight count, sheds, probes) and its estimated TTFT is compared
with the one the proxy observed (``conductor_final``; a line under the table). ``--repeats N``
runs the columns N times in turn, to see the noise.

Usage (from the repo root): .venv-vllm/bin/python -m benchmarks.trace_replay [--sample-conversations 8]
           [--speedup 30] [--columns one,round_robin,prefix,store,conductor] [--repeats 1] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks.vllm_serve import server, spawn
from integration.harness import free_port

ROOT = Path(__file__).resolve().parents[1]

TRACE = ROOT.parent / "shared" / "data" / "fast25" / "conversation_trace.jsonl"
COLUMNS = ("one", "round_robin", "prefix", "store", "conductor", "small_pool", "small_pool_disk")
TIDEKV = {"kv_connector": "TidekvConnector", "kv_role": "kv_both"}
VOCAB = ["--vocab-size", "150", "--first-token", "100"]
SEGMENT_BYTES = 512 << 20
# tidekv's own processes (pool, proxy, replay client) run from the main venv when there is one:
# they need no vLLM, and the vLLM venv's editable install may predate a package the CLI imports.
CLI_PYTHON = str(ROOT / ".venv" / "bin" / "python") if (ROOT / ".venv" / "bin" / "python").exists() else sys.executable


def warm(url: str, n: int = 2) -> None:
    """Untimed requests whose token ids (20..99) no replayed prompt uses."""
    for i in range(n):
        body = {"model": "tiny", "prompt": [20 + (i + k) % 80 for k in range(600)], "max_tokens": 4,
                "ignore_eos": True}
        req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            resp.read()


def slice_flags(args: argparse.Namespace) -> list[str]:
    """The ``tidekv trace`` flags choosing the slice (the same for analyze and replay)."""
    flags = ["--sample-conversations", str(args.sample_conversations)]
    if args.requests is not None:
        flags += ["--max-requests", str(args.requests)]
    if args.until_s is not None:
        flags += ["--until-s", str(args.until_s)]
    return flags


def analyze_slice(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """The slice's hit rates as ``tidekv trace analyze`` simulates them: unbounded, one global
    pool and two local caches (round robin, prefix rule)."""
    argv = [CLI_PYTHON, "-m", "tidekv", "trace", "analyze", str(args.trace), *slice_flags(args), "--capacity", "0",
            "--instances", "2", "--routing", "round_robin,prefix", "--no-progress", "--json", str(out)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"tidekv trace analyze failed ({done.returncode}):\n{done.stderr[-4000:]}")
    report = json.loads(out.read_text())
    rates = {(r["policy"], r["routing"]): r["hit_rate"] for r in report["results"]}
    return {"requests": report["requests"], "input_tokens": report["input_tokens"],
            "hit_rate_global": rates[("global", None)], "hit_rate_2_local_round_robin": rates[("local", "round_robin")],
            "hit_rate_2_local_prefix": rates[("local", "prefix")]}


def proxy_counts(url: str) -> dict[str, float]:
    """The proxy's requests per prefill (by port) and its rejections, from its /metrics."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    counts: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r'tidekv_proxy_requests_total\{prefill="[^"]*:(\d+)"\} ([0-9.e+]+)', line)
        if m:
            counts[m.group(1)] = float(m.group(2))
        m = re.match(r'tidekv_proxy_rejected_total\{[^}]*\} ([0-9.e+]+)', line)
        if m:
            counts["rejected"] = counts.get("rejected", 0.0) + float(m.group(1))
    return counts


GAUGE = re.compile(r'^(tidekv_proxy_(?:prefill_queued_tokens|prefill_cost_\w+|decode_\w+|rejected_total|conductor_\w+))'
                   r'(?:\{[^}]*"[^"]*:(\d+)"\}|\{[^}]*\})? (\S+)$')


def conductor_gauges(text: str) -> dict[str, Any]:
    """The conductor's gauges in a /metrics text: name -> value, or name -> {port: value} for
    the per-instance ones."""
    out: dict[str, Any] = {}
    for line in text.splitlines():
        m = GAUGE.match(line)
        if m is None:
            continue
        name, port, value = m.group(1).removeprefix("tidekv_proxy_"), m.group(2), float(m.group(3))
        if port is None:
            out[name] = out.get(name, 0.0) + value
        else:
            out.setdefault(name, {})[port] = value
    return out


class GaugeRecorder:
    """Reads the proxy's /metrics every ``interval_s`` while the replay runs (the conductor's
    queued tokens, cost coefficients, decode leg, sheds and probes over time)."""

    def __init__(self, url: str, interval_s: float = 1.0) -> None:
        self.url, self.interval_s, self.samples = url, interval_s, []  # type: list[dict[str, Any]]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._t0 = time.monotonic()

    def __enter__(self) -> GaugeRecorder:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                with urllib.request.urlopen(self.url + "/metrics", timeout=5) as resp:
                    text = resp.read().decode()
            except OSError:
                continue
            self.samples.append({"t_s": round(time.monotonic() - self._t0, 2), **conductor_gauges(text)})


def replay(args: argparse.Namespace, target: str, metrics_urls: list[str], out: Path) -> dict[str, Any]:
    argv = [CLI_PYTHON, "-m", "tidekv", "trace", "replay", str(args.trace), "--target", target, "--model", "tiny",
            *slice_flags(args), "--speedup", str(args.speedup), "--scale-tokens",
            str(args.scale_tokens), "--block-tokens", "32", "--max-input-tokens", str(args.max_input_tokens), *VOCAB,
            "--ttft-slo-ms", str(args.ttft_slo_ms), "--tbt-slo-ms", str(args.tbt_slo_ms), "--timeout-s", "60",
            "--json", str(out), "--no-progress"]
    if metrics_urls:
        argv += ["--metrics-url", *metrics_urls]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=3600 / args.speedup * 3 + 300)
    print(done.stdout, flush=True)
    if not out.exists():
        raise RuntimeError(f"tidekv trace replay failed ({done.returncode}):\n{done.stderr[-4000:]}")
    summary: dict[str, Any] = json.loads(out.read_text())["summary"]
    return summary


def one_column(args: argparse.Namespace, name: str, model: str, logs: Path, out: Path) -> dict[str, Any]:
    if name == "one":
        with server(model, logs, name, mode="in-process") as one:
            warm(one.url)
            return replay(args, one.url, [], out)
    up = [CLI_PYTHON, "-m", "tidekv", "up", "--port", "0", "--metrics-port", "-1", "--segment-size", "1GiB"]
    segment = SEGMENT_BYTES
    policy = name
    if name.startswith("small_pool"):
        up[-1], segment, policy = str(args.small_pool), 0, "store"
        if name == "small_pool_disk":
            disk = tempfile.mkdtemp(prefix="tidekv-disk-", dir=logs.parent)  # removed with the run's directory
            up += ["--disk-paths", disk, "--disk-size", "4GiB", "--disk-write-through", "all"]
    with spawn(up, r'"master": "([^"]+)"', "tidekv up") as (_, m):
        master = m.group(1)
        kv_p = {**TIDEKV, "kv_connector_extra_config": {"master": master, "store_segment_size": segment}}
        kv_d = {**TIDEKV, "kv_connector_extra_config": {"master": None}}
        with server(model, logs, f"{name}-p0", kv=kv_p, mode="in-process", cpus={0}) as p0, \
                server(model, logs, f"{name}-p1", kv=kv_p, mode="in-process", cpus={1}) as p1, \
                server(model, logs, f"{name}-d", kv=kv_d, mode="in-process") as d:
            for s in (p0, p1, d):
                warm(s.url)
            port = free_port()
            argv = [CLI_PYTHON, "-m", "tidekv", "proxy", "--prefill", p0.url, p1.url, "--decode", d.url,
                    "--port", str(port), "--policy", policy]
            if policy in ("store", "conductor"):
                argv += ["--master", master]
            if name == "conductor":
                argv += ["--ttft-slo-ms", str(args.ttft_slo_ms)]
            with spawn(argv, "listening", "tidekv proxy"):
                proxy = f"http://127.0.0.1:{port}"
                with GaugeRecorder(proxy) as gauges:
                    summary = replay(args, proxy, [p0.url, p1.url], out)
                counts = proxy_counts(proxy)
                summary["proxy_prefill_requests"] = [counts.get(str(p.port), 0.0) for p in (p0, p1)]
                summary["proxy_rejected"] = counts.get("rejected", 0.0)
                if name == "conductor":
                    with urllib.request.urlopen(proxy + "/metrics", timeout=30) as resp:
                        summary["conductor_final"] = conductor_gauges(resp.read().decode())
                    summary["conductor_gauges"] = gauges.samples
                return summary


def row(name: str, s: dict[str, Any]) -> dict[str, Any]:
    rates = {h["source"]: h["hit_rate"] for h in s["deployment_hit_rates"]}
    return {"column": name, "goodput_rps": s["goodput_rps"], "slo_attainment": s["slo_attainment"],
            "ttft_attainment": s["ttft_attainment"], "tbt_attainment": s["tbt_attainment"],
            "ttft_p50_ms": s["ttft_ms"]["p50"], "ttft_p90_ms": s["ttft_ms"]["p90"], "errors": s["errors"],
            "local_hit_rate": rates.get("vllm:prefix_cache"), "store_hit_rate": rates.get("vllm:external_prefix_cache"),
            "duration_s": s["duration_s"], "prefill_requests": s.get("proxy_prefill_requests"),
            "conductor": calibration(s.get("conductor_final"))}


def calibration(final: dict[str, Any] | None) -> dict[str, Any] | None:
    """The conductor's estimates against what the proxy observed, from its last /metrics."""
    if not final:
        return None
    n = final.get("conductor_observed_total", 0.0)
    return {"observed": n, "probes": final.get("conductor_probes_total", 0.0),
            "probes_met_slo": final.get("conductor_probes_met_slo_total", 0.0),
            "mean_estimated_ttft_ms": final.get("conductor_estimated_ttft_seconds_sum", 0.0) / n * 1e3 if n else None,
            "mean_observed_ttft_ms": final.get("conductor_observed_ttft_seconds_sum", 0.0) / n * 1e3 if n else None,
            "mean_abs_error_ms": final.get("conductor_ttft_abs_error_seconds_sum", 0.0) / n * 1e3 if n else None}


def report(rows: list[dict[str, Any]]) -> None:
    def f(v: Any, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    print("| column | goodput (req/s) | SLO attainment (both / TTFT / TBT) | TTFT p50 / p90 (ms) | prefill hit rate: "
          "own cache / from store | errors | requests per prefill |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        errors = ", ".join(f"{k} {v}" for k, v in sorted(r["errors"].items())) or "none"
        print(f"| {r['column']} | {f(r['goodput_rps'], '.2f')} | {f(r['slo_attainment'], '.1%')} / "
              f"{f(r['ttft_attainment'], '.1%')} / {f(r['tbt_attainment'], '.1%')} | {f(r['ttft_p50_ms'], '.0f')} / "
              f"{f(r['ttft_p90_ms'], '.0f')} | {f(r['local_hit_rate'], '.3f')} / {f(r['store_hit_rate'], '.3f')} | "
              f"{errors} | {' / '.join(f'{n:.0f}' for n in r['prefill_requests'] or []) or '-'} |")
    for r in rows:
        c = r.get("conductor")
        if c and c["observed"]:
            print(f"conductor ({r['column']}): TTFT estimated {c['mean_estimated_ttft_ms']:.0f} ms, observed at the "
                  f"proxy {c['mean_observed_ttft_ms']:.0f} ms (mean over {c['observed']:.0f}; mean |error| "
                  f"{c['mean_abs_error_ms']:.0f} ms); probes {c['probes']:.0f}, of them {c['probes_met_slo']:.0f} "
                  f"met the TTFT SLO")
    by: dict[str, list[float]] = {}
    for r in rows:
        by.setdefault(r["column"], []).append(r["goodput_rps"] or 0.0)
    if any(len(v) > 1 for v in by.values()):
        print("\ngoodput spread over repeats (max - min, req/s): " + ", ".join(
            f"{k} {max(v) - min(v):.2f} (mean {statistics.mean(v):.2f})" for k, v in by.items()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--requests", type=int, default=None, help="only the first N requests of the file (default: all)")
    ap.add_argument("--until-s", type=float, default=None, help="only the first S seconds of trace time (default: all)")
    ap.add_argument("--sample-conversations", type=int, default=8, metavar="K",
                    help="keep one conversation in K, with all its requests (default 8)")
    ap.add_argument("--speedup", type=float, default=30.0)
    ap.add_argument("--scale-tokens", type=float, default=1 / 16)
    ap.add_argument("--max-input-tokens", type=int, default=2048)
    ap.add_argument("--ttft-slo-ms", type=float, default=250.0)
    ap.add_argument("--tbt-slo-ms", type=float, default=50.0)
    ap.add_argument("--columns", default=",".join(COLUMNS), help=f"any of {', '.join(COLUMNS)}")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--small-pool", type=int, default=48 << 20,
                    help="bytes of the pool in the small_pool columns (default 48 MiB)")
    ap.add_argument("--keep-logs", help="copy every server's log and each replay's JSON (every request) here")
    ap.add_argument("--json", help="write every column's summary here")
    args = ap.parse_args()
    columns = args.columns.split(",")
    if set(columns) - set(COLUMNS):
        ap.error(f"unknown column(s) {sorted(set(columns) - set(COLUMNS))}; choose from {', '.join(COLUMNS)}")
    if not args.trace.exists():
        ap.error(f"the trace is not at {args.trace}; pass --trace")
    from integration.tiny_model import build

    rows: list[dict[str, Any]] = []
    summaries: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="tidekv-trace-replay-") as tmp_name:
        tmp = Path(tmp_name)
        model = str(build(tmp / "model", seed=0))
        logs = tmp / "logs"
        logs.mkdir()
        workload = analyze_slice(args, tmp / "analyze.json")
        print("slice (tidekv trace analyze, unbounded): " + json.dumps(workload), flush=True)
        try:
            for repeat in range(args.repeats):
                for name in columns:
                    print(f"== {name} (repeat {repeat + 1}/{args.repeats}) at {time.strftime('%H:%M:%S')}", flush=True)
                    s = one_column(args, name, model, logs, tmp / f"{name}-{repeat}.json")
                    summaries.append({"column": name, "repeat": repeat, **s})
                    rows.append(row(name, s))
        finally:
            if args.keep_logs:
                Path(args.keep_logs).mkdir(parents=True, exist_ok=True)
                for log in [*logs.iterdir(), *tmp.glob("*-*.json")]:  # and each replay's every request
                    (Path(args.keep_logs) / log.name).write_bytes(log.read_bytes())
    report(rows)
    if args.json:
        Path(args.json).write_text(json.dumps({"config": {k: str(v) for k, v in vars(args).items()},
                                               "slice": workload, "columns": summaries}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
