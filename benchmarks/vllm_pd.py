"""Decode-side time to first token with pulled KV vs recomputed, and the KV hand-off time per
request of TidekvConnector vs vLLM's built-in ExampleConnector, on real vLLM (CPU, the tiny
random Llama of integration/tiny_model.py), ~2k-token prompts, all in one run.

Definitions (each engine in its own process, in-process engine core, one request at a time):
- TTFT: wall time of ``generate(max_tokens=1)`` for one prompt on the decode engine.
- recompute: a decode engine without a connector computes the whole prompt.
- local hit: the same engine again on the same prompt (its prefix cache holds every full block):
  the floor any hand-off is measured against (the last token is always computed).
- hand-off = TTFT with the connector - local-hit TTFT (decode side) + what exporting costs the
  prefill (its generate time with the connector - without): tidekv holds blocks in place (no
  export); ExampleConnector writes safetensors files per layer and the consumer reads them.

Usage: .venv-vllm/bin/python benchmarks/vllm_pd.py [--prompts 4] [--tokens 2000] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[1] / "integration"))


def child(spec: dict[str, Any]) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
    from vllm import LLM, SamplingParams

    llm = LLM(model=spec["model"], dtype="float32", enforce_eager=True, max_model_len=2304, max_num_seqs=4,
              block_size=32, seed=0, kv_transfer_config=spec.get("kv"))
    out: dict[str, Any] = {"ttft_s": [], "params": [], "hit_s": []}
    params = spec.get("params") or [None] * len(spec["prompts"])
    for prompt, p in zip(spec["prompts"], params):
        sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True,
                            extra_args=None if p is None else {"kv_transfer_params": p})
        t0 = time.perf_counter()
        res = llm.generate([prompt], sp, use_tqdm=False)[0]
        out["ttft_s"].append(time.perf_counter() - t0)
        out["params"].append(res.kv_transfer_params)
        if spec.get("repeat"):
            t0 = time.perf_counter()
            llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), use_tqdm=False)
            out["hit_s"].append(time.perf_counter() - t0)
    Path(spec["out"]).write_text(json.dumps(out))
    if spec.get("hold"):
        sys.stdin.read()


def run(spec: dict[str, Any], tmp: str, name: str, hold: bool = False) -> tuple[dict[str, Any], Any]:
    spec = dict(spec, out=str(Path(tmp, name + ".json")), hold=hold)
    spec_path = Path(tmp, name + ".spec.json")
    spec_path.write_text(json.dumps(spec))
    log = open(Path(tmp, name + ".log"), "wb")
    proc = subprocess.Popen([sys.executable, str(HERE), "--child", str(spec_path)], stdin=subprocess.PIPE,
                            stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while not Path(spec["out"]).exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"{name} failed; log: {Path(tmp, name + '.log').read_text()[-4000:]}")
        time.sleep(0.2)
    time.sleep(0.2)
    result = json.loads(Path(spec["out"]).read_text())
    if not hold:
        proc.wait(timeout=60)
        return result, None
    return result, proc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8, help="prompts (the first one warms each engine up)")
    ap.add_argument("--tokens", type=int, default=2000, help="prompt length (bytes = tokens - 1)")
    ap.add_argument("--json", help="write the result rows here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(json.loads(Path(args.child).read_text()))
        return 0
    from tiny_model import build

    with tempfile.TemporaryDirectory(prefix="tidekv-vllm-bench-") as tmp:
        model = str(build(Path(tmp, "model"), seed=0))
        import random

        prompts = []
        for i in range(args.prompts):
            rng = random.Random(100 + i)
            prompts.append("".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(args.tokens - 1)))
        base = {"model": model, "prompts": prompts}
        tide = {"kv_connector": "TidekvConnector", "kv_role": "kv_both", "kv_connector_extra_config": {}}
        store_dir = str(Path(tmp, "example"))
        os.makedirs(store_dir)
        ex = {"kv_connector": "ExampleConnector", "kv_connector_extra_config": {"shared_storage_path": store_dir}}

        recompute, _ = run({**base, "repeat": True}, tmp, "recompute")
        prefill_plain = recompute["ttft_s"]  # a prefill without a connector: same engine, same work
        pre, holder = run({**base, "kv": tide, "params": [{"do_remote_decode": True}] * len(prompts)}, tmp,
                          "tidekv-prefill", hold=True)
        try:
            dec, _ = run({**base, "kv": tide, "params": pre["params"]}, tmp, "tidekv-decode")
        finally:
            holder.stdin.close()
            holder.wait(timeout=60)
        producer, _ = run({**base, "kv": {**ex, "kv_role": "kv_producer"}}, tmp, "example-producer")
        consumer, _ = run({**base, "kv": {**ex, "kv_role": "kv_consumer"}}, tmp, "example-consumer")

    def med(xs: list[float]) -> float:
        # The first request of each engine warms it up (and the first pull opens the peer connection).
        return statistics.median(xs[1:] if len(xs) > 1 else xs)

    hit = med(recompute["hit_s"])
    rows = {
        "ttft_recompute_ms": med(recompute["ttft_s"]) * 1e3,
        "ttft_local_hit_ms": hit * 1e3,
        "ttft_tidekv_pulled_ms": med(dec["ttft_s"]) * 1e3,
        "ttft_example_loaded_ms": med(consumer["ttft_s"]) * 1e3,
        "handoff_tidekv_ms": (med(dec["ttft_s"]) - hit + max(0.0, med(pre["ttft_s"]) - med(prefill_plain))) * 1e3,
        "handoff_example_ms": (med(consumer["ttft_s"]) - hit + max(0.0, med(producer["ttft_s"]) - med(prefill_plain))) * 1e3,
    }
    rows["handoff_speedup_vs_example"] = rows["handoff_example_ms"] / max(rows["handoff_tidekv_ms"], 1e-6)
    rows["prompt_tokens"] = args.tokens
    for k, v in rows.items():
        print(f"{k:32s} {v:10.2f}")
    print("bars: hand-off >= 5x faster than ExampleConnector:",
          "PASS" if rows["handoff_speedup_vs_example"] >= 5 else "FAIL",
          "| pulled TTFT < recompute TTFT:", "PASS" if rows["ttft_tidekv_pulled_ms"] < rows["ttft_recompute_ms"] else "FAIL")
    if args.json:
        Path(args.json).write_text(json.dumps(rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
