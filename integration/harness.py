"""Runs real vLLM for the integration tests: one offline engine phase per subprocess, or the
OpenAI-compatible server as a subprocess.

vLLM keeps process-global state (the KV-transfer group, plugin registries), so two `LLM`
objects never share a process: every phase (baseline, producer, consumer, ...) is a fresh
`python harness.py SPEC OUT` child that writes its results as JSON. The parent side of this
module imports nothing from vLLM. Neighbours: `tiny_model.py` builds the model these run;
`conftest.py` turns them into fixtures.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tidekv.bench.ports import free_port

HARNESS = Path(__file__).resolve()
LOG_TAIL_CHARS = 20_000

# A prompt is text (tokenized by the model's tokenizer) or a list of token ids, used as is.
Prompt = str | list[int]


class HarnessError(RuntimeError):
    """A vLLM subprocess failed, timed out, or answered wrongly; the message ends with its log."""


@dataclasses.dataclass(frozen=True, slots=True)
class Phase:
    """One engine run: build `LLM(...)`, generate greedily for all prompts at once, exit."""

    model: str
    """Model directory (see tiny_model.py)."""
    prompts: list[Prompt]
    max_tokens: int = 8
    """Tokens generated per prompt; EOS is ignored so every prompt yields exactly this many."""
    max_model_len: int = 2304
    kv_transfer_config: dict[str, Any] | None = None
    """Passed to `LLM(kv_transfer_config=...)` as a dict; None runs without a connector."""
    kv_transfer_params: list[dict[str, Any] | None] | None = None
    """Per prompt, sent as `SamplingParams(extra_args={"kv_transfer_params": ...})`."""
    multiprocessing: bool = False
    """False (default) runs the engine core in the phase's own process (~3 s start); True uses
    vLLM's default engine-core and worker subprocesses (~30 s start), which also exercises
    pickling of connector metadata and plugin loading in child processes."""
    llm_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Extra `LLM(...)` keyword arguments; they override the defaults in `_engine_kwargs`."""
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    """Extra environment for the phase process (e.g. PYTHONPATH for an out-of-tree connector)."""
    hold: bool = False
    """Keep the engine alive after generating, until the parent closes the child's stdin (a
    prefill instance whose KV a decode phase still has to pull). Use `HeldPhase`."""


@dataclasses.dataclass(frozen=True, slots=True)
class Completion:
    """What vLLM returned for one prompt."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    num_cached_tokens: int | None
    """Prompt tokens served from the prefix cache or a KV connector instead of being computed."""
    kv_transfer_params: dict[str, Any] | None
    finish_reason: str | None


@dataclasses.dataclass(frozen=True, slots=True)
class PhaseResult:
    completions: list[Completion]
    init_s: float
    """Time to construct `LLM(...)`."""
    generate_s: float
    """Wall time of the one `LLM.generate` call."""
    wall_s: float
    """Whole subprocess, including Python and vLLM imports."""
    log: str
    """The phase's combined stdout and stderr."""

    @property
    def token_ids(self) -> list[list[int]]:
        return [c.token_ids for c in self.completions]


def phase_env(multiprocessing: bool, extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for a vLLM child: 1 GiB of CPU KV cache, engine core in or out of process, no hub."""
    env = dict(os.environ)
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocessing else "0"
    # Everything is local: a wrong model path should fail at once, not try the hub.
    for name, value in (("HF_HUB_OFFLINE", "1"), ("VLLM_NO_USAGE_STATS", "1"), ("TOKENIZERS_PARALLELISM", "false")):
        env.setdefault(name, value)
    env.update(extra or {})
    return env


def _tail(text: str) -> str:
    return text if len(text) <= LOG_TAIL_CHARS else "...\n" + text[-LOG_TAIL_CHARS:]


def run_phase(phase: Phase, timeout_s: float = 240.0, python: str = sys.executable) -> PhaseResult:
    """Runs `phase` in a fresh subprocess and returns what it generated.

    Args:
        phase: what to run.
        timeout_s: the child is killed after this long.
        python: interpreter with vLLM installed (default: the current one).

    Returns:
        The completions in prompt order, with timings and the child's log.

    Raises:
        HarnessError: the child exited non-zero, timed out or wrote no result; the message
            carries the tail of its log.
    """
    with tempfile.TemporaryDirectory(prefix="tidekv-phase-") as tmp:
        spec_path, out_path, log_path = Path(tmp, "spec.json"), Path(tmp, "out.json"), Path(tmp, "log.txt")
        spec_path.write_text(json.dumps(dataclasses.asdict(phase)))
        t0 = time.monotonic()
        with open(log_path, "wb") as log_file:
            proc = subprocess.Popen(
                [python, str(HARNESS), str(spec_path), str(out_path)],
                stdout=log_file, stderr=subprocess.STDOUT, env=phase_env(phase.multiprocessing, phase.env),
                start_new_session=True,
            )
            try:
                rc = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                rc = None
        wall_s = time.monotonic() - t0
        log = log_path.read_text(errors="replace")
        if rc is None:
            raise HarnessError(f"vLLM phase timed out after {timeout_s:.0f} s; log:\n{_tail(log)}")
        if rc != 0 or not out_path.exists():
            raise HarnessError(f"vLLM phase exited with {rc}; log:\n{_tail(log)}")
        out = json.loads(out_path.read_text())
    return PhaseResult(
        completions=[Completion(**c) for c in out["completions"]],
        init_s=out["init_s"], generate_s=out["generate_s"], wall_s=wall_s, log=log,
    )


class HeldPhase:
    """A phase whose engine stays alive after generating (``Phase(hold=True)``).

    Entering runs it until its results are written and returns them; the engine keeps serving
    (its KV cache stays registered) until leaving, or `kill()` (SIGKILL, to test a peer dying).
    """

    def __init__(self, phase: Phase, timeout_s: float = 240.0, python: str = sys.executable) -> None:
        assert phase.hold, "HeldPhase needs Phase(hold=True)"
        self.phase, self.timeout_s, self.python = phase, timeout_s, python
        self._tmp = tempfile.TemporaryDirectory(prefix="tidekv-held-")
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_path = Path(self._tmp.name, "log.txt")

    def log(self) -> str:
        return self._log_path.read_text(errors="replace") if self._log_path.exists() else ""

    def __enter__(self) -> PhaseResult:
        spec_path, out_path = Path(self._tmp.name, "spec.json"), Path(self._tmp.name, "out.json")
        spec_path.write_text(json.dumps(dataclasses.asdict(self.phase)))
        t0 = time.monotonic()
        with open(self._log_path, "wb") as log_file:
            self._proc = subprocess.Popen(
                [self.python, str(HARNESS), str(spec_path), str(out_path)], stdin=subprocess.PIPE,
                stdout=log_file, stderr=subprocess.STDOUT, env=phase_env(self.phase.multiprocessing, self.phase.env),
                start_new_session=True,
            )
        while not out_path.exists():
            if self._proc.poll() is not None:
                raise HarnessError(f"held vLLM phase exited with {self._proc.returncode}; log:\n{_tail(self.log())}")
            if time.monotonic() - t0 > self.timeout_s:
                self.kill()
                raise HarnessError(f"held vLLM phase gave no result within {self.timeout_s:.0f} s; log:\n{_tail(self.log())}")
            time.sleep(0.2)
        time.sleep(0.2)  # the file is written in one call; let the writer finish closing it
        out = json.loads(out_path.read_text())
        return PhaseResult(
            completions=[Completion(**c) for c in out["completions"]],
            init_s=out["init_s"], generate_s=out["generate_s"], wall_s=time.monotonic() - t0, log=self.log(),
        )

    def kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            _kill_group(self._proc)

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None and self._proc.poll() is None:
            assert self._proc.stdin is not None
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                _kill_group(self._proc)
        self._tmp.cleanup()


def _kill_group(proc: subprocess.Popen[Any]) -> None:
    """Kills the child and anything it started (vLLM's engine core and workers)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


# ---- child side: runs inside the phase subprocess -------------------------------------------


def _engine_kwargs(phase: Phase) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(
        model=phase.model, dtype="float32", enforce_eager=True, max_model_len=phase.max_model_len,
        max_num_seqs=4, block_size=32, seed=0,
    )
    if phase.kv_transfer_config is not None:
        kwargs["kv_transfer_config"] = phase.kv_transfer_config
    kwargs.update(phase.llm_kwargs)
    return kwargs


def _child_main(spec_path: str, out_path: str) -> None:
    phase = Phase(**json.loads(Path(spec_path).read_text()))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.monotonic()
    llm = LLM(**_engine_kwargs(phase))
    init_s = time.monotonic() - t0

    params = phase.kv_transfer_params or [None] * len(phase.prompts)
    if len(params) != len(phase.prompts):
        raise ValueError(f"kv_transfer_params has {len(params)} entries for {len(phase.prompts)} prompts")
    sampling = [
        SamplingParams(
            temperature=0.0, max_tokens=phase.max_tokens, ignore_eos=True,
            extra_args=None if p is None else {"kv_transfer_params": p},
        )
        for p in params
    ]
    prompts = [p if isinstance(p, str) else TokensPrompt(prompt_token_ids=p) for p in phase.prompts]
    t0 = time.monotonic()
    outputs = llm.generate(prompts, sampling, use_tqdm=False)
    generate_s = time.monotonic() - t0

    completions = [
        dataclasses.asdict(Completion(
            prompt_token_ids=list(o.prompt_token_ids or []),
            token_ids=list(o.outputs[0].token_ids),
            text=o.outputs[0].text,
            num_cached_tokens=o.num_cached_tokens,
            kv_transfer_params=o.kv_transfer_params,
            finish_reason=o.outputs[0].finish_reason,
        ))
        for o in outputs
    ]
    tmp_out = Path(out_path + ".tmp")
    tmp_out.write_text(json.dumps({"completions": completions, "init_s": init_s, "generate_s": generate_s}))
    tmp_out.rename(out_path)  # the parent of a held phase polls for the file: never show it half-written
    print(f"harness: init {init_s:.1f} s, generate {generate_s:.2f} s", flush=True)
    if phase.hold:
        sys.stdin.read()  # serve (hold the KV for a decode) until the parent closes stdin


# ---- HTTP, from here or from another host ---------------------------------------------------

_HTTP_CHILD = """\
import json, sys, urllib.error, urllib.request
url, body, headers, timeout_s = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), float(sys.argv[4])
req = urllib.request.Request(url, data=body.encode() if body else None, headers=headers)
try:
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        status, data = resp.status, resp.read()
except urllib.error.HTTPError as e:
    status, data = e.code, e.read()
sys.stdout.write(json.dumps({"status": status, "body": data.decode(errors="replace")}))
"""
"""What ``http`` runs on another host: one request; its status and body printed as JSON."""


def http(url: str, body: dict[str, Any] | None = None, *, timeout_s: float = 60.0,
         headers: dict[str, str] | None = None, via: Sequence[str] = (),
         python: str = sys.executable) -> tuple[int, str]:
    """GETs ``url`` (POSTs ``body`` as JSON when given) and returns the status and the body as text.

    Args:
        via: argv prefix that runs a command on another host (a ``tests/multihost`` rig host's
            ``command([])``): the request is made there, by a ``python -c`` child, for servers this
            process cannot reach. Empty: made here.

    Raises:
        OSError: no answer (refused, unreachable, or none within ``timeout_s``), as urllib raises.
    """
    data = None if body is None else json.dumps(body)
    all_headers = {**({"Content-Type": "application/json"} if body is not None else {}), **(headers or {})}
    if not via:
        req = urllib.request.Request(url, data=None if data is None else data.encode(), headers=all_headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                return resp.status, resp.read().decode(errors="replace")
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace")
    argv = [*via, python, "-I", "-c", _HTTP_CHILD, url, data or "", json.dumps(all_headers), str(timeout_s)]
    try:
        # The margin over the request's own timeout is for the child's start (a namespace, a Python).
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s + 30, check=False)
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"{url} from {' '.join(via)}: no answer within {timeout_s + 30:.0f} s") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        raise OSError(f"{url} from {' '.join(via)}: {last}")
    answer = json.loads(done.stdout)
    return int(answer["status"]), str(answer["body"])


# ---- OpenAI-compatible server ----------------------------------------------------------------


class OpenAIServer:
    """`python -m vllm.entrypoints.openai.api_server` as a subprocess on a free loopback port.

    The `vllm` console script cannot be used: in vllm-cpu it asks importlib.metadata for the
    distribution "vllm", which is named "vllm-cpu", and crashes.

    Use as a context manager: entering starts the server and waits for GET /health; leaving
    stops it (SIGTERM, then SIGKILL of its process group). `log()` returns its output so far.

    ``host`` is the address it listens on (``--host``, and ``url``'s). ``via`` is an argv prefix
    that runs it on another host (a ``tests/multihost`` rig host's ``command([])``), whose network
    this process may not reach: its requests (``http``, ``post``, ``metric``, the health check)
    are then made from that host too.
    """

    def __init__(
        self,
        model: str,
        *,
        served_model_name: str = "tiny",
        max_model_len: int = 2304,
        kv_transfer_config: dict[str, Any] | None = None,
        extra_args: list[str] | None = None,
        env: dict[str, str] | None = None,
        log_path: str | Path | None = None,
        python: str = sys.executable,
        cpus: set[int] | None = None,
        in_process: bool = False,
        host: str = "127.0.0.1",
        via: Sequence[str] = (),
    ) -> None:
        self.port = free_port()
        self._cpus = cpus  # CPU affinity of the server and every process it starts; None: inherited
        self.url = f"http://{host}:{self.port}"
        self.model_name = served_model_name
        self.via = list(via)
        self._python = python
        self._argv = [
            *self.via, python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            "--served-model-name", served_model_name, "--host", host, "--port", str(self.port),
            "--dtype", "float32", "--enforce-eager", "--max-model-len", str(max_model_len),
            "--max-num-seqs", "4", "--block-size", "32", "--seed", "0",
        ]
        if kv_transfer_config is not None:
            self._argv += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
        if in_process:
            # The model runs in the engine-core process instead of a worker process of its own
            # (which busy-polls vLLM's shared-memory queue for 1 s after every step): the README's
            # advice for engines that share a CPU host, pinned with ``cpus``.
            self._argv += ["--distributed-executor-backend", "uni"]
            env = {**(env or {}), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        self._argv += extra_args or []
        # The server always runs its engine core in a separate process; the env var only
        # matters for offline LLM, but keep the CPU KV cache small either way.
        self._env = phase_env(multiprocessing=True, extra=env)
        # A log file made here is removed by stop(); one the caller names is the caller's.
        self._own_log = log_path is None
        self._log_path = Path(log_path) if log_path else Path(tempfile.mkstemp(prefix="tidekv-vllm-server-", suffix=".log")[1])
        self._proc: subprocess.Popen[bytes] | None = None
        self.startup_s: float | None = None

    def log(self) -> str:
        return self._log_path.read_text(errors="replace") if self._log_path.exists() else ""

    def start(self, timeout_s: float = 240.0) -> None:
        """Starts the server and blocks until /health answers 200.

        Raises:
            HarnessError: the server exited or was not healthy within `timeout_s`.
        """
        t0 = time.monotonic()
        with open(self._log_path, "wb") as log_file:
            self._proc = subprocess.Popen(
                self._argv, stdout=log_file, stderr=subprocess.STDOUT, env=self._env, start_new_session=True,
                preexec_fn=None if self._cpus is None else lambda: os.sched_setaffinity(0, self._cpus or set()),
            )
        deadline = t0 + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                log = self.log()
                self.stop()
                raise HarnessError(f"vLLM server exited with {self._proc.returncode} before it was healthy; log:\n{_tail(log)}")
            with contextlib.suppress(OSError):
                if self.http("/health", timeout_s=2)[0] == 200:
                    self.startup_s = time.monotonic() - t0
                    return
            time.sleep(0.5)
        log = self.log()
        self.stop()
        raise HarnessError(f"vLLM server not healthy after {timeout_s:.0f} s; log:\n{_tail(log)}")

    def stop(self, grace_s: float = 20.0) -> None:
        """Stops the server: SIGTERM to its process group, SIGKILL after `grace_s`. Removes the
        log file unless the caller named it."""
        if self._proc is not None and self._proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGTERM)
            try:
                self._proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                _kill_group(self._proc)
        if self._own_log:
            self._log_path.unlink(missing_ok=True)

    def http(self, path: str, body: dict[str, Any] | None = None, timeout_s: float = 60.0,
             headers: dict[str, str] | None = None) -> tuple[int, str]:
        """``http()`` to this server's ``path``, made from the host it runs on."""
        return http(self.url + path, body, timeout_s=timeout_s, headers=headers, via=self.via, python=self._python)

    def post(self, path: str, body: dict[str, Any], timeout_s: float = 60.0,
             headers: dict[str, str] | None = None) -> dict[str, Any]:
        """POSTs JSON to the server (with ``headers`` besides the content type) and returns the
        decoded reply.

        Raises:
            HarnessError: non-2xx status or no answer within `timeout_s`.
        """
        try:
            status, text = self.http(path, body, timeout_s=timeout_s, headers=headers)
        except OSError as e:
            raise HarnessError(f"POST {path} failed: {e}; server log:\n{_tail(self.log())}") from e
        if not 200 <= status < 300:
            raise HarnessError(f"POST {path} -> {status}: {text}")
        answer: dict[str, Any] = json.loads(text)
        return answer

    def metric(self, name: str, **labels: str) -> float:
        """The sum of the series of Prometheus metric ``name`` in the server's /metrics that carry
        ``labels`` (every series without; 0 if none)."""
        status, text = self.http("/metrics", timeout_s=30)
        if status != 200:
            raise HarnessError(f"GET /metrics -> {status}: {text[:2000]}")
        wanted = [f'{k}="{v}"' for k, v in labels.items()]
        total = 0.0
        for line in text.splitlines():
            series, _, value = line.rpartition(" ")
            if series.split("{")[0] == name and all(w in series for w in wanted):
                total += float(value)
        return total

    def complete(self, prompt: Prompt, max_tokens: int = 8, headers: dict[str, str] | None = None,
                 **extra: Any) -> dict[str, Any]:
        """Greedy /v1/completions for one prompt; `extra` goes into the body (e.g. kv_transfer_params),
        `headers` into the request (e.g. vLLM's X-data-parallel-rank)."""
        body = {"model": self.model_name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True, **extra}
        return self.post("/v1/completions", body, headers=headers)

    def __enter__(self) -> OpenAIServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


if __name__ == "__main__":
    _child_main(sys.argv[1], sys.argv[2])
