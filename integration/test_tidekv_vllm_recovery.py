"""TidekvConnector on real vLLM when something fails or starts in the wrong order: a dead decode
behind the proxy (the prefill's KV blocks are freed at once), a store master that comes up after
the server (reuse turns itself on), and a bad --kv-transfer-config (refused before the model
loads). Each OpenAI server runs multiprocess, as deployed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from conftest import MAX_TOKENS, tidekv_config, tidekv_up
from harness import OpenAIServer, PhaseResult, free_port, phase_env

KV_USAGE = "vllm:kv_cache_usage_perc"
STORE_HITS = "vllm:external_prefix_cache_hits_total"  # prompt tokens the connector supplied


def _post(url: str, body: dict[str, Any], timeout_s: float = 120.0) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _wait_for(predicate: Any, timeout_s: float, interval_s: float = 0.05) -> float | None:
    """Seconds until ``predicate()`` holds, or None if it does not within ``timeout_s``."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if predicate():
            return time.monotonic() - started
        time.sleep(interval_s)
    return None


def test_dead_decode_frees_the_prefills_kv_within_a_second(tiny_model: str, prompts: list[str],
                                                           tmp_path: Path) -> None:
    """The proxy answers 502 for a decode nobody listens on, and the prefill's KV usage is back
    to zero within 1 s (not after hold_timeout_s, 120 s): the proxy released the hold. Control:
    a prefill request nobody releases keeps its blocks."""
    dead = f"http://127.0.0.1:{free_port()}"
    with OpenAIServer(tiny_model, kv_transfer_config=tidekv_config(), log_path=tmp_path / "prefill.log",
                      in_process=True) as prefill:
        port = free_port()
        proxy = subprocess.Popen(
            [sys.executable, "-m", "tidekv", "proxy", "--prefill", prefill.url, "--decode", dead, "--port", str(port)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            assert proxy.stdout is not None
            assert "listening" in proxy.stdout.readline()
            assert prefill.metric(KV_USAGE) == 0.0
            body = {"model": "tiny", "prompt": prompts[2], "max_tokens": MAX_TOKENS, "temperature": 0.0,
                    "ignore_eos": True}
            status, answer = _post(f"http://127.0.0.1:{port}/v1/completions", body)
            assert status == 502 and dead in answer["error"]["message"], answer
            freed_s = _wait_for(lambda: prefill.metric(KV_USAGE) == 0.0, timeout_s=1.0)
            assert freed_s is not None, f"KV usage still {prefill.metric(KV_USAGE)} 1 s after the 502"
            print(f"prefill KV usage back to 0 {freed_s:.2f} s after the 502")
            log = prefill.log()
            assert "freeing its held KV blocks now (decode_failed: proxy request" in log
            assert f"{dead} is unreachable" in log, "the prefill's log says what happened to the decode"

            # Control: the same prompt held for a decode that never comes keeps its blocks.
            status, held = _post(prefill.url + "/v1/completions",
                                 {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
            assert status == 200 and held["kv_transfer_params"]["block_ids"], held
            time.sleep(1.5)
            assert prefill.metric(KV_USAGE) > 0.0, "a hold nobody releases keeps the blocks"
        except BaseException:
            print("----- prefill server log\n" + prefill.log()[-15000:])
            raise
        finally:
            proxy.terminate()
            out, _ = proxy.communicate(timeout=15)
            print("----- proxy log\n" + out[-5000:])


def test_master_started_after_the_server_is_used_once_up(tiny_model: str, prompts: list[str],
                                                        baseline: PhaseResult, tmp_path: Path) -> None:
    """A server whose master ($TIDEKV_MASTER, no "master" in the extra config) is down at start
    serves by recomputing, says once that reuse is off, and once `tidekv up` runs there says
    once that reuse is on; then a prompt is saved and, once vLLM's own prefix cache is emptied,
    served from the store (vLLM counts the tokens as external prefix-cache hits)."""
    master = f"127.0.0.1:{free_port()}"
    env = {"TIDEKV_MASTER": master, "VLLM_SERVER_DEV_MODE": "1"}  # dev mode: POST /reset_prefix_cache
    config = tidekv_config(store_timeout_s=0.5)
    with OpenAIServer(tiny_model, kv_transfer_config=config, env=env, log_path=tmp_path / "server.log",
                      in_process=True) as server:
        try:
            log = server.log()
            assert f"store master {master}, load mode sync" in log and "tidekv connector: role kv_both, tp rank 0" \
                in log, "one start-up line per worker"
            first = server.complete(prompts[1], max_tokens=MAX_TOKENS)
            assert first["choices"][0]["text"] == baseline.completions[1].text, "served while the master is down"

            with tidekv_up(port=int(master.rsplit(":", 1)[1])):
                on = _wait_for(lambda: server.log().count(f"tidekv store at {master} answers again") >= 2, 30.0, 0.2)
                assert on is not None, "scheduler and worker both reconnected"
                answer = server.complete(prompts[2], max_tokens=MAX_TOKENS)  # saved now
                assert answer["choices"][0]["text"] == baseline.completions[2].text
                # The saves end before the request's blocks are freed; until then a reset fails.
                assert _wait_for(lambda: _post(server.url + "/reset_prefix_cache", {})[1].get("success") is True,
                                 30.0, 0.2) is not None
                hits = server.metric(STORE_HITS)
                again = server.complete(prompts[2], max_tokens=MAX_TOKENS)
                assert again["choices"][0]["text"] == baseline.completions[2].text
                full_blocks = (len(baseline.completions[2].prompt_token_ids) - 1) // 32 * 32
                assert _wait_for(lambda: server.metric(STORE_HITS) - hits == full_blocks, 10.0) is not None, \
                    (server.metric(STORE_HITS) - hits, full_blocks)
            log = server.log()
            assert log.count("prefix reuse is off") == 2, "once per component (scheduler, rank 0), not per request"
            assert log.count("prefix reuse is on") == 2
        except BaseException:
            print("----- server log\n" + server.log()[-15000:])
            raise


def _serve(tiny_model: str, kv_transfer_config: dict[str, Any]) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", tiny_model, "--port", str(free_port()),
         "--dtype", "float32", "--enforce-eager", "--kv-transfer-config", json.dumps(kv_transfer_config)],
        capture_output=True, text=True, timeout=180, env=phase_env(multiprocessing=True))
    return result, time.monotonic() - started


def test_bad_kv_transfer_config_is_refused_before_the_model_loads(tiny_model: str) -> None:
    """An unknown extra-config key, or a connector name close to ours, stops the server at once
    (exit 2, the ConfigError's text printed once), before the engine core starts or loads a model."""
    bad_key, took_s = _serve(tiny_model, tidekv_config(mastr="127.0.0.1:1"))
    out = bad_key.stdout + bad_key.stderr
    print(out[-5000:])
    assert bad_key.returncode == 2
    message = "unknown tidekv connector setting(s) ['mastr'] (did you mean 'master'?); allowed ["
    assert out.count(message) == 1, "printed once"
    assert "error: argument --kv-transfer-config: " + message in out
    assert "EngineCore" not in out and "Loading" not in out and "Engine core initialization failed" not in out
    assert took_s < 60

    misspelt, _ = _serve(tiny_model, {**tidekv_config(), "kv_connector": "TidekvConector"})
    out = misspelt.stdout + misspelt.stderr
    print(out[-5000:])
    assert misspelt.returncode == 2
    assert out.count("kv_connector 'TidekvConector' is not a registered KV connector (did you mean "
                     "'TidekvConnector'?)") == 1
    assert "EngineCore" not in out


@pytest.mark.parametrize(("argv", "expected"), [
    (["--kv-transfer-config", '{"kv_connector": "TidekvConnector"}'], {"kv_connector": "TidekvConnector"}),
    (['--kv_transfer_config={"kv_role": "kv_both"}'], {"kv_role": "kv_both"}),
    (["--kv-transfer-config", '{"a": 1}', "--kv-transfer-config.kv_connector_extra_config.master", "h:1",
      "--kv-transfer-config.kv_connector_extra_config.store_segment_size=8g"],
     {"kv_connector_extra_config": {"master": "h:1", "store_segment_size": 8_000_000_000}}),  # dotted keys win
    (["--kv-transfer-config", "{not json"], None),
    (["--model", "m"], None),
])
def test_kv_transfer_config_is_read_from_argv_as_vllm_reads_it(argv: list[str], expected: Any) -> None:
    from tidekv_vllm.command_line import kv_transfer_config_from_argv

    assert kv_transfer_config_from_argv(argv) == expected


def test_kv_transfer_config_from_a_config_file(tmp_path: Path) -> None:
    from tidekv_vllm.command_line import kv_transfer_config_from_argv

    path = tmp_path / "serve.yaml"
    path.write_text("kv-transfer-config:\n  kv_connector: TidekvConnector\n  kv_connector_extra_config:\n"
                    "    mastr: x\n")
    assert kv_transfer_config_from_argv(["--config", str(path)]) == {
        "kv_connector": "TidekvConnector", "kv_connector_extra_config": {"mastr": "x"}}
    assert kv_transfer_config_from_argv(["--config", str(path), "--kv-transfer-config", "{}"]) == {}, "flags win"
