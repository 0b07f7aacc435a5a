"""Decode-side time to first token with pulled KV vs recomputed, and the KV hand-off time per
request of TidekvConnector vs vLLM's built-in ExampleConnector, on real vLLM (CPU, the tiny
random Llama of integration/tiny_model.py), ~2k-token prompts, all in one run.

Definitions (each engine in its own process, in-process engine core, one request at a time):
- TTFT: wall time of ``generate(max_tokens=1)`` for one prompt on one engine.
- recompute: an engine without a connector computes the whole prompt.
- local hit: the same engine again on the same prompt (its prefix cache holds every full block).
- floor of a decode request: the decode engine itself, right after the request, on a local hit
  that computes as many tokens as the request did (vLLM caches whole blocks, so a request that
  computed k tokens after n cached ones is matched by the first ``n // block_size * block_size
  + k`` tokens of its prompt): what the request costs once its KV is local. tidekv's sync pull
  leaves only the last token to compute; ExampleConnector (whole blocks) up to a block of them.
- export: what the connector costs the prefill, i.e. the time the prefill engine spends in the
  connector's hooks during the request (both connectors are timed by the same thin wrapper,
  ``Timed<Name>`` below): tidekv holds blocks in place; ExampleConnector writes safetensors
  files per layer. (Measured inside the engine because the alternative, the prefill's TTFT
  with the connector minus without, is two ~40 ms timings whose noise dwarfs a 1 ms export.)
- import: the same for the decode side: the time its engine spends in the connector's hooks
  during the request (tidekv: a synchronous pull in ``start_load_kv``; ExampleConnector:
  reading the files and injecting them into the KV cache).
- hand-off (connectors) = export + import: what handing the KV over costs inside the
  connectors, both sides.
- hand-off (end to end) = (decode TTFT - its floor) + export: also counts what vLLM itself does
  to admit an externally loaded request. The floor request runs the connector's hooks too
  (``floor_hooks_*``: ExampleConnector looks for files on every request), which this leaves in.

Other work on this 2-core machine stretches any timing, so every prompt is measured ``--repeat``
times (variants that share no block with each other), the engines of one connector run one
request after the other and are all held alive at once, TTFTs are the best of their samples
and connector times the median (the first sample, which warms the engines up and opens the
peer connection, is dropped). Raw samples go to ``--json``.

Warm-up: by default every measured request follows an untimed 64-token request on the same
engine, as on an engine that is busy serving. On this VM a process that sat idle for a few ms
runs its next millisecond several times slower (``benchmarks/idle_memory.py``: a 35 ms sleep
makes a 1 MiB copy of KV-sized blocks 4-5x slower), which would otherwise be charged to
whichever hook runs first. Every engine of
both connectors gets the same warm-up; ``--idle`` measures without it. With ``--idle`` a decode
engine sits idle before its measured request while another engine computes the prompt, so its
floor request follows the same: the plain engine first computes a fresh prompt of the same
length (otherwise the floor, right after the measured request, would run warm and charge the
whole wake-up to the connector).

Usage (from the repo root): .venv-vllm/bin/python -m benchmarks.vllm_pd [--prompts 4] [--repeat 4] [--tokens 2000]
           [--idle] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import select
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BLOCK_SIZE = 32
WARM_PROMPT = [257] + [ord("w")] * 63  # the warm-up request: <s> (BOS_ID of the tiny model), then bytes
REPLY_TIMEOUT_S = 300.0
DEBUG = bool(os.environ.get("TIDEKV_BENCH_DEBUG"))  # print per-hook and per-phase times of each request
_TIMED_BASES = {"TimedTidekvConnector": ("tidekv_vllm.connector", "TidekvConnector"),
                "TimedExampleConnector": ("vllm.distributed.kv_transfer.kv_connector.v1.example_connector",
                                          "ExampleConnector")}
_HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta", "request_finished",
          "update_connector_output", "bind_connector_metadata", "clear_connector_metadata", "handle_preemptions",
          "start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save", "get_finished",
          "get_transfer_results", "get_block_ids_with_load_errors", "get_kv_connector_stats",
          "build_connector_worker_meta", "take_events", "on_new_request")
connector_s = 0.0  # seconds spent in connector hooks in this process (engine core and worker)
hook_s: dict[str, float] = {}  # the same, per hook
_depth = 0


def _timed(fn: Any) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        global connector_s, _depth
        _depth += 1
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _depth -= 1
            if _depth == 0:  # a hook calling another hook counts once
                dt = time.perf_counter() - t0
                connector_s += dt
                hook_s[fn.__name__] = hook_s.get(fn.__name__, 0.0) + dt
    return wrapper


def _phase(fn: Any, name: str, into: dict[str, float]) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            into[name] = into.get(name, 0.0) + time.perf_counter() - t0
            into[name + "_calls"] = into.get(name + "_calls", 0) + 1
    return wrapper


def __getattr__(name: str) -> Any:
    """``Timed<Connector>`` (vLLM's kv_connector_module_path = this module): the connector with
    the wall time of each hook added to ``connector_s``. Built on first use so that the parent
    process never imports vLLM."""
    if name not in _TIMED_BASES:
        raise AttributeError(name)
    import importlib

    module, cls_name = _TIMED_BASES[name]
    base = getattr(importlib.import_module(module), cls_name)
    cls = type(name, (base,), {h: _timed(getattr(base, h)) for h in _HOOKS if hasattr(base, h)})
    globals()[name] = cls
    return cls


def child(spec: dict[str, Any], reply_fd: int) -> None:
    """An engine that answers one JSON command per stdin line on ``reply_fd``."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    # The module the Timed connectors live in, as vLLM imports it (this file is __main__ here).
    from benchmarks import vllm_pd as timed  # noqa: PLW0406

    llm = LLM(model=spec["model"], dtype="float32", enforce_eager=True, max_model_len=2304, max_num_seqs=4,
              block_size=BLOCK_SIZE, seed=0, kv_transfer_config=spec.get("kv"))
    phase_s: dict[str, float] = {}  # DEBUG: where a request's time goes in the engine core
    if DEBUG:
        core = llm.llm_engine.engine_core.engine_core
        for owner, attr in ((core.scheduler, "schedule"), (core.scheduler, "update_from_output"),
                            (core.model_executor, "execute_model"), (core.model_executor, "sample_tokens")):
            setattr(owner, attr, _phase(getattr(owner, attr), attr, phase_s))
    reply = os.fdopen(reply_fd, "w")
    reply.write(json.dumps({"ready": True}) + "\n")
    reply.flush()
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "exit":
            break
        if cmd.get("warm"):
            # An untimed short request first, as if the engine were busy serving: on this VM a
            # process that sat idle for a few ms runs its next ms several times slower.
            llm.generate([TokensPrompt(prompt_token_ids=WARM_PROMPT)], SamplingParams(temperature=0.0, max_tokens=1),
                         use_tqdm=False)
        p = cmd.get("params")
        sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True,
                            extra_args=None if p is None else {"kv_transfer_params": p})
        c0, h0 = timed.connector_s, dict(timed.hook_s)
        phase_s.clear()
        t0 = time.perf_counter()
        res = llm.generate([TokensPrompt(prompt_token_ids=cmd["prompt"])], sp, use_tqdm=False)[0]
        ttft = time.perf_counter() - t0
        hooks = {k: v - h0.get(k, 0.0) for k, v in timed.hook_s.items() if v - h0.get(k, 0.0) > 0}
        reply.write(json.dumps({"ttft_s": ttft, "connector_s": timed.connector_s - c0, "hooks_s": hooks,
                                "phases_s": phase_s,
                                "params": res.kv_transfer_params,
                                "num_cached_tokens": res.num_cached_tokens or 0}) + "\n")
        reply.flush()


def _ms(phases: dict[str, float]) -> dict[str, float]:
    return {k: (v if k.endswith("_calls") else round(v * 1e3, 2)) for k, v in phases.items()}


class Engine:
    """One held engine process; ``generate`` sends a prompt and waits for its reply."""

    def __init__(self, name: str, spec: dict[str, Any], tmp: str, warm: bool = True) -> None:
        self.name = name
        self.warm = warm
        self.log_path = Path(tmp, name + ".log")
        spec_path = Path(tmp, name + ".spec.json")
        spec_path.write_text(json.dumps(spec))
        read_fd, write_fd = os.pipe()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "benchmarks.vllm_pd", "--child", str(spec_path), "--reply-fd", str(write_fd)],
                stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, pass_fds=(write_fd,), text=True)
        os.close(write_fd)
        self._replies = os.fdopen(read_fd)

    def _reply(self) -> dict[str, Any]:
        ready, _, _ = select.select([self._replies], [], [], REPLY_TIMEOUT_S)
        line = self._replies.readline() if ready else ""
        if not line:
            self.close()
            raise RuntimeError(f"engine {self.name} did not answer; log:\n{self.log_path.read_text()[-4000:]}")
        return json.loads(line)

    def wait_ready(self) -> Engine:
        self._reply()
        return self

    def generate(self, prompt: list[int], params: dict[str, Any] | None = None) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": "generate", "prompt": prompt, "params": params,
                                          "warm": self.warm}) + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def floor(self, prompt: list[int], measured: dict[str, Any]) -> dict[str, Any]:
        """A local hit on this engine that computes as many tokens as ``measured`` did."""
        cached = measured["num_cached_tokens"]
        computed = len(prompt) - cached
        aligned = cached // BLOCK_SIZE * BLOCK_SIZE
        out = self.generate(prompt[: aligned + computed])
        if out["num_cached_tokens"] != aligned:
            raise RuntimeError(f"engine {self.name}: floor request hit {out['num_cached_tokens']} tokens, "
                               f"expected {aligned}; log:\n{self.log_path.read_text()[-6000:]}")
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
        self._replies.close()


def start(engines: dict[str, dict[str, Any]], tmp: str, warm: bool) -> dict[str, Engine]:
    started = {name: Engine(name, spec, tmp, warm) for name, spec in engines.items()}
    try:
        return {name: e.wait_ready() for name, e in started.items()}
    except BaseException:
        for e in started.values():
            e.close()
        raise


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=4, help="distinct prompts")
    ap.add_argument("--repeat", type=int, default=4, help="variants of each prompt measured (samples = prompts x repeat)")
    ap.add_argument("--tokens", type=int, default=2000, help="prompt length in tokens")
    ap.add_argument("--idle", action="store_true",
                    help="no warm-up request before each measured one: engines that sat idle between requests")
    ap.add_argument("--json", help="write the result rows (and every raw sample) here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--reply-fd", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(json.loads(Path(args.child).read_text()), args.reply_fd)
        return 0
    from integration.tiny_model import BOS_ID, build

    raw: dict[str, list[float]] = {k: [] for k in (
        "recompute", "local_hit", "tidekv_prefill", "tidekv_export", "tidekv_decode", "tidekv_floor",
        "tidekv_cached", "tidekv_import", "example_producer", "example_export", "example_consumer", "example_floor",
        "example_cached", "example_import", "tidekv_floor_hooks", "example_floor_hooks")}
    with tempfile.TemporaryDirectory(prefix="tidekv-vllm-bench-") as tmp:
        model = str(build(Path(tmp, "model"), seed=0))
        import random

        # The tiny model's tokenizer is byte-level (token id == byte), <s> first. Variant r of a
        # prompt differs in its first byte, so no two samples share a block.
        letters = "abcdefghijklmnopqrstuvwxyz "

        def text(seed: int, n: int) -> list[int]:
            rng = random.Random(seed)
            return [ord(rng.choice(letters)) for _ in range(n)]

        prompts = []
        for i in range(args.prompts):
            body = text(100 + i, args.tokens - 2)
            prompts += [[BOS_ID, ord("A") + r % 26, ord("a") + r // 26] + body[1:] for r in range(args.repeat)]
        # --idle: before a floor request the plain engine computes one of these (each its own
        # first block), as the prefill did before the measured request.
        fillers = iter([[BOS_ID, ord("#"), i % 256] + text(1000 + i, args.tokens - 3)
                        for i in range(2 * len(prompts))])
        base = {"model": model}
        here = {"kv_connector_module_path": "benchmarks.vllm_pd"}  # the Timed<Connector> wrappers
        tide = {**here, "kv_connector": "TimedTidekvConnector", "kv_role": "kv_both", "kv_connector_extra_config": {}}
        store_dir = str(Path(tmp, "example"))
        os.makedirs(store_dir)
        ex = {**here, "kv_connector": "TimedExampleConnector", "kv_connector_extra_config": {"shared_storage_path": store_dir}}

        engines = start({"plain": base, "tidekv-prefill": {**base, "kv": tide},
                         "tidekv-decode": {**base, "kv": tide}}, tmp, not args.idle)
        try:
            plain, pre, dec = engines["plain"], engines["tidekv-prefill"], engines["tidekv-decode"]
            for prompt in prompts:
                raw["recompute"].append(plain.generate(prompt)["ttft_s"])
                raw["local_hit"].append(plain.generate(prompt)["ttft_s"])
                p = pre.generate(prompt, {"do_remote_decode": True})
                raw["tidekv_prefill"].append(p["ttft_s"])
                raw["tidekv_export"].append(p["connector_s"])
                if DEBUG:
                    print("prefill hooks ms", {k: round(v * 1e3, 2) for k, v in p["hooks_s"].items()}, flush=True)
                # Without the prefill's hit count in the params, the decode reports its own.
                p["params"].pop("remote_prefill_cached_tokens", None)
                d = dec.generate(prompt, p["params"])
                raw["tidekv_decode"].append(d["ttft_s"])
                raw["tidekv_import"].append(d["connector_s"])
                if DEBUG:
                    print("decode hooks ms", {k: round(v * 1e3, 2) for k, v in d["hooks_s"].items()}, flush=True)
                    print("decode phases ms", _ms(d["phases_s"]), flush=True)
                raw["tidekv_cached"].append(d["num_cached_tokens"])
                if args.idle:
                    plain.generate(next(fillers))
                f = dec.floor(prompt, d)
                if DEBUG:
                    print("floor  phases ms", _ms(f["phases_s"]), "hooks", round(f["connector_s"] * 1e3, 2), flush=True)
                raw["tidekv_floor"].append(f["ttft_s"])
                raw["tidekv_floor_hooks"].append(f["connector_s"])
            for name in ("tidekv-prefill", "tidekv-decode"):
                engines.pop(name).close()
            engines.update(start({"example-producer": {**base, "kv": {**ex, "kv_role": "kv_producer"}},
                                  "example-consumer": {**base, "kv": {**ex, "kv_role": "kv_consumer"}}}, tmp,
                                 not args.idle))
            producer, consumer = engines["example-producer"], engines["example-consumer"]
            for prompt in prompts:
                e = producer.generate(prompt)
                raw["example_producer"].append(e["ttft_s"])
                raw["example_export"].append(e["connector_s"])
                c = consumer.generate(prompt)
                raw["example_consumer"].append(c["ttft_s"])
                raw["example_import"].append(c["connector_s"])
                raw["example_cached"].append(c["num_cached_tokens"])
                if args.idle:
                    plain.generate(next(fillers))
                if DEBUG:
                    print("example consumer phases ms", _ms(c["phases_s"]), "hooks", round(c["connector_s"] * 1e3, 2))
                f = consumer.floor(prompt, c)
                if DEBUG:
                    print("example floor    phases ms", _ms(f["phases_s"]), "hooks", round(f["connector_s"] * 1e3, 2),
                          flush=True)
                raw["example_floor"].append(f["ttft_s"])
                raw["example_floor_hooks"].append(f["connector_s"])
        finally:
            for e in engines.values():
                e.close()

    def best(key: str) -> float:
        return min(raw[key][1:] if len(raw[key]) > 1 else raw[key])

    def med(key: str) -> float:
        return statistics.median(raw[key][1:] if len(raw[key]) > 1 else raw[key])

    rows = {
        "ttft_recompute_ms": best("recompute") * 1e3,
        "ttft_local_hit_ms": best("local_hit") * 1e3,
        "ttft_tidekv_pulled_ms": best("tidekv_decode") * 1e3,
        "ttft_tidekv_floor_ms": best("tidekv_floor") * 1e3,
        "ttft_example_loaded_ms": best("example_consumer") * 1e3,
        "ttft_example_floor_ms": best("example_floor") * 1e3,
        "tokens_computed_tidekv": args.tokens - med("tidekv_cached"),
        "tokens_computed_example": args.tokens - med("example_cached"),
        "export_tidekv_ms": med("tidekv_export") * 1e3,
        "export_example_ms": med("example_export") * 1e3,
        "import_tidekv_ms": med("tidekv_import") * 1e3,
        "import_example_ms": med("example_import") * 1e3,
        "floor_hooks_tidekv_ms": med("tidekv_floor_hooks") * 1e3,
        "floor_hooks_example_ms": med("example_floor_hooks") * 1e3,
    }
    rows["handoff_connectors_tidekv_ms"] = rows["export_tidekv_ms"] + rows["import_tidekv_ms"]
    rows["handoff_connectors_example_ms"] = rows["export_example_ms"] + rows["import_example_ms"]
    rows["handoff_connectors_speedup"] = rows["handoff_connectors_example_ms"] / max(rows["handoff_connectors_tidekv_ms"], 1e-6)
    rows["handoff_tidekv_ms"] = rows["ttft_tidekv_pulled_ms"] - rows["ttft_tidekv_floor_ms"] + rows["export_tidekv_ms"]
    rows["handoff_example_ms"] = (rows["ttft_example_loaded_ms"] - rows["ttft_example_floor_ms"]
                                  + rows["export_example_ms"])
    rows["handoff_speedup_vs_example"] = rows["handoff_example_ms"] / max(rows["handoff_tidekv_ms"], 1e-6)
    rows["samples"] = len(prompts) - 1
    rows["warm_up"] = 0 if args.idle else 1
    rows["prompt_tokens"] = args.tokens
    for k, v in rows.items():
        print(f"{k:32s} {v:10.2f}")
    print("bars: hand-off >= 5x faster than ExampleConnector: in the connectors",
          "PASS" if rows["handoff_connectors_speedup"] >= 5 else "FAIL",
          "/ end to end", "PASS" if rows["handoff_speedup_vs_example"] >= 5 else "FAIL",
          "| pulled TTFT < recompute TTFT:", "PASS" if rows["ttft_tidekv_pulled_ms"] < rows["ttft_recompute_ms"] else "FAIL")
    if args.json:
        Path(args.json).write_text(json.dumps({**rows, "raw": raw}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
