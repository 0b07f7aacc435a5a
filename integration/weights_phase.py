"""One vLLM engine that generates, takes weight updates through tidekv, and generates again --
the engine side of the RL weight-update tests. Runs as ``python weights_phase.py SPEC OUT``.

SPEC (JSON): ``model``, ``prompts``, ``max_tokens``, ``mode`` ("native": the weight-transfer
API with ``backend="tidekv"``; "extension": ``TidekvWorkerExtension`` through
``collective_rpc``), ``multiprocessing``, and ``steps``: a list of ``"generate"`` or
``{"update": version, "publisher": "host:port"}``. OUT gets one entry per step: the token ids
per prompt, ``{"version": v}`` for an update, or ``{"error": type, "message": ...}``.

Parent side: ``run_weights_phase(spec, timeout_s)`` (imports nothing from vLLM).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import HarnessError, _kill_group, _tail, phase_env

SCRIPT = Path(__file__).resolve()


def run_weights_phase(spec: dict[str, Any], timeout_s: float = 300.0) -> tuple[list[Any], str]:
    """Runs the engine of ``spec`` in a subprocess; returns (results per step, log)."""
    with tempfile.TemporaryDirectory(prefix="tidekv-weights-") as tmp:
        spec_path, out_path, log_path = Path(tmp, "spec.json"), Path(tmp, "out.json"), Path(tmp, "log.txt")
        spec_path.write_text(json.dumps(spec))
        with open(log_path, "wb") as log_file:
            proc = subprocess.Popen([sys.executable, str(SCRIPT), str(spec_path), str(out_path)],
                                    stdout=log_file, stderr=subprocess.STDOUT,
                                    env=phase_env(spec.get("multiprocessing", False)), start_new_session=True)
            try:
                rc = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                rc = None
        log = log_path.read_text(errors="replace")
        if rc != 0 or not out_path.exists():
            raise HarnessError(f"weights phase exited with {rc}; log:\n{_tail(log)}")
        return json.loads(out_path.read_text()), log


def _child_main(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    from tidekv_vllm.weights import update_weights
    from vllm import LLM, SamplingParams

    kwargs: dict[str, Any] = {"model": spec["model"], "dtype": "float32", "enforce_eager": True,
                              "max_model_len": 512, "max_num_seqs": 4, "block_size": 32, "seed": 0}
    if spec["mode"] == "native":
        kwargs["weight_transfer_config"] = {"backend": "tidekv"}
    else:
        kwargs["worker_extension_cls"] = "tidekv_vllm.weights.TidekvWorkerExtension"
    llm = LLM(**kwargs)
    sampling = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True)
    results: list[Any] = []
    for step in spec["steps"]:
        if step == "generate":
            outs = llm.generate(spec["prompts"], sampling, use_tqdm=False)
            results.append([list(o.outputs[0].token_ids) for o in outs])
            continue
        t0 = time.monotonic()
        try:
            if spec["mode"] == "native":
                update_weights(llm, step["publisher"], step["update"], wait_s=step.get("wait_s", 60.0))
                version = step["update"]
            else:
                version = llm.collective_rpc("tidekv_update_weights", args=(step["publisher"], step["update"]))[0]
                llm.reset_prefix_cache()
            results.append({"version": version, "seconds": time.monotonic() - t0})
        except Exception as exc:  # noqa: BLE001 - the test asserts on it; the engine must keep serving
            results.append({"error": type(exc).__name__, "message": str(exc)[-2000:]})
        print(f"step {step}: {results[-1]}", flush=True)
    Path(out_path).write_text(json.dumps(results))


if __name__ == "__main__":
    _child_main(sys.argv[1], sys.argv[2])
