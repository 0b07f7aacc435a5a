"""`tidekv proxy --policy conductor` in front of real vLLM: two prefill servers saving into their
own store segments and a decode. Through the conductor the answers are the baseline's, every
answered prefill calibrates the cost model (the proxy's /metrics), and with a TTFT SLO below
any real prefill time the first request (no data yet) is served, requests on stale estimates go
as probes (counted), and the first one on fresh evidence is shed with 429 before it reaches a
prefill."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from conftest import MAX_TOKENS, tidekv_config, tidekv_up
from harness import OpenAIServer, PhaseResult, free_port


@contextmanager
def conductor_proxy(prefills: list[str], decode: str, master: str, *extra: str) -> Iterator[str]:
    port = free_port()
    proxy = subprocess.Popen([sys.executable, "-m", "tidekv", "proxy", "--prefill", *prefills, "--decode", decode,
                              "--policy", "conductor", "--master", master, "--port", str(port), *extra],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proxy.stdout is not None
        line = proxy.stdout.readline()
        assert "listening" in line, line + proxy.stdout.read()
        yield f"http://127.0.0.1:{port}"
    finally:
        proxy.terminate()
        proxy.wait(timeout=15)


def post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def metrics(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        return resp.read().decode()


def test_conductor_on_real_vllm(tiny_model: str, prompts: list[str], baseline: PhaseResult, tmp_path: Path) -> None:
    """Answers through the conductor are the baseline's; each answered prefill is one observation
    of the cost model; under an SLO no prefill can meet, requests are shed with 429 once the
    estimates are fresh (after at most a probe or two)."""
    # Engine cores run the model themselves (in_process): no worker process to import vLLM a third
    # time and busy-poll a core; the multiprocess path has test_pd_online_through_the_proxy[mp].
    segment = 64 << 20
    with tidekv_up() as master, \
            OpenAIServer(tiny_model, kv_transfer_config=tidekv_config(master=master, store_segment_size=segment),
                         log_path=tmp_path / "prefill0.log", in_process=True) as p0, \
            OpenAIServer(tiny_model, kv_transfer_config=tidekv_config(master=master, store_segment_size=segment),
                         log_path=tmp_path / "prefill1.log", in_process=True) as p1, \
            OpenAIServer(tiny_model, kv_transfer_config=tidekv_config(), log_path=tmp_path / "decode.log",
                         in_process=True) as dec:
        servers = {"prefill0": p0, "prefill1": p1, "decode": dec}
        try:
            with conductor_proxy([p0.url, p1.url], dec.url, master) as proxy:
                for i in (0, 1, 2, 0):
                    body = {"model": "tiny", "prompt": prompts[i], "max_tokens": MAX_TOKENS, "temperature": 0.0,
                            "ignore_eos": True}
                    status, answer = post(proxy + "/v1/completions", body)
                    assert status == 200, answer
                    assert answer["choices"][0]["text"] == baseline.completions[i].text
                text = metrics(proxy)
                observed = sum(float(v) for v in re.findall(r"^tidekv_proxy_prefill_observations_total\{[^}]*\} (\S+)",
                                                            text, re.M))
                assert observed == 4, text
                fixed = [float(v) for v in re.findall(r"^tidekv_proxy_prefill_cost_fixed_seconds\{[^}]*\} (\S+)",
                                                      text, re.M)]
                per_token = [float(v) for v in re.findall(
                    r"^tidekv_proxy_prefill_cost_per_token_seconds\{[^}]*\} (\S+)", text, re.M)]
                assert len(fixed) == len(per_token) == 2, text
                assert all(f + k * 1000 > 0 for f, k in zip(fixed, per_token)), text  # a prefill takes time
            # --probe-after-s 30: an answer stays fresh evidence for the whole check however slow
            # this machine answers (at the default 1 s, two prefills over 1 s apart made every
            # request a probe on a loaded CI machine, and nothing was shed).
            with conductor_proxy([p0.url, p1.url], dec.url, master, "--ttft-slo-ms", "0.001",
                                 "--probe-after-s", "30") as proxy:
                body = {"model": "tiny", "prompt": "the first of several prompts " * 8, "max_tokens": 2}
                assert post(proxy + "/v1/completions", body)[0] == 200  # no answer observed yet: served
                # Over the SLO, a request whose estimate is stale (the other prefill has no answer of
                # its own yet) goes as a probe; one on fresh evidence is shed.
                statuses = []
                for i in range(6):
                    status, answer = post(proxy + "/v1/completions", {**body, "prompt": f"and prompt {i} " * 8})
                    statuses.append(status)
                    if status == 429:
                        assert answer["error"]["type"] == "ttft_slo_exceeded", answer
                        break
                assert statuses[-1] == 429 and set(statuses[:-1]) <= {200}, statuses
                text = metrics(proxy)
                assert 'tidekv_proxy_rejected_total{reason="ttft_slo"} 1' in text, text
                assert f"tidekv_proxy_conductor_probes_total {len(statuses) - 1}" in text, (statuses, text)
                assert len(statuses) >= 2  # the second prefill, never observed, was probed first
        except BaseException:
            for name, server in servers.items():
                print(f"----- {name} server log\n" + server.log()[-8000:])
            raise
