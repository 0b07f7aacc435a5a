"""TidekvConnector on real vLLM (CPU, tiny random Llama): PD disaggregation, store-backed
prefix reuse, and failures. Each engine runs in its own process; greedy float32 decoding must
give exactly the tokens of a plain engine.

Proof that the decode really used pulled or loaded KV (not a recompute that happens to match):
pointing the decode at the wrong remote blocks changes its output, and a fresh engine reports
the store's tokens as cached (num_cached_tokens).
"""

from __future__ import annotations

import contextlib
import copy
import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import MAX_TOKENS, VllmRunner
from harness import HarnessError, HeldPhase, OpenAIServer, Phase, PhaseResult, free_port

CONNECTOR = "TidekvConnector"  # found through the vllm.general_plugins entry point: no module path


def tidekv_config(**extra: Any) -> dict[str, Any]:
    return {"kv_connector": CONNECTOR, "kv_role": "kv_both", "kv_connector_extra_config": extra}


def prefill_params(n: int) -> list[dict[str, Any] | None]:
    return [{"do_remote_decode": True} for _ in range(n)]


@contextlib.contextmanager
def tidekv_up(segment: str = "256MiB") -> Iterator[str]:
    """`tidekv up` (master + one storage segment) as a subprocess; yields the master address."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tidekv", "up", "--port", "0", "--metrics-port", "-1", "--segment-size", segment],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        assert proc.stdout is not None
        deadline, lines = time.monotonic() + 60, []
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            lines.append(line)
            m = re.search(r'"master": "([^"]+)"', line)
            if m:
                yield m.group(1)
                return
            if not line and proc.poll() is not None:
                break
        raise RuntimeError("tidekv up did not start:\n" + "".join(lines))
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()


def run_pd(vllm: VllmRunner, model: str, prompts: list[str], *, transport: str = "auto", load_mode: str = "sync",
           tamper: bool = False) -> tuple[PhaseResult, PhaseResult]:
    prefill = Phase(model=model, prompts=prompts, max_tokens=1, kv_transfer_config=tidekv_config(transport=transport),
                    kv_transfer_params=prefill_params(len(prompts)), hold=True)
    with HeldPhase(prefill) as pre:
        params = [c.kv_transfer_params for c in pre.completions]
        assert all(p and p["do_remote_prefill"] and p["remote_block_ids"] for p in params), params
        if tamper:
            params = copy.deepcopy(params)
            for p in params:
                p["remote_block_ids"] = [b + 1000 for b in p["remote_block_ids"]]  # other (unwritten) blocks
        dec = vllm.run(Phase(model=model, prompts=prompts, max_tokens=MAX_TOKENS,
                             kv_transfer_config=tidekv_config(transport=transport, load_mode=load_mode),
                             kv_transfer_params=params))
    return pre, dec


@pytest.mark.parametrize(("transport", "load_mode"), [("auto", "sync"), ("tcp", "sync"), ("auto", "async")])
def test_pd_offline_decode_matches_baseline(vllm: VllmRunner, tiny_model: str, prompts: list[str],
                                            baseline: PhaseResult, transport: str, load_mode: str) -> None:
    pre, dec = run_pd(vllm, tiny_model, prompts, transport=transport, load_mode=load_mode)
    assert dec.token_ids == baseline.token_ids
    assert all(c.finish_reason == "length" for c in dec.completions)
    for p, c in zip(pre.completions, prompts):
        assert p.kv_transfer_params["remote_num_tokens"] >= len(p.prompt_token_ids) - 1


def test_pd_decode_really_uses_the_pulled_kv(vllm: VllmRunner, tiny_model: str, prompts: list[str],
                                             baseline: PhaseResult) -> None:
    _, dec = run_pd(vllm, tiny_model, prompts, tamper=True)
    assert dec.token_ids != baseline.token_ids


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_pd_decode_from_a_killed_prefill(vllm: VllmRunner, tiny_model: str, prompts: list[str],
                                         baseline: PhaseResult, policy: str) -> None:
    prefill = Phase(model=tiny_model, prompts=prompts, max_tokens=1, kv_transfer_config=tidekv_config(),
                    kv_transfer_params=prefill_params(len(prompts)), hold=True)
    held = HeldPhase(prefill)
    pre = held.__enter__()
    held.kill()
    held.__exit__(None, None, None)
    config = {**tidekv_config(), "kv_load_failure_policy": policy}
    t0 = time.monotonic()
    dec = vllm.run(Phase(model=tiny_model, prompts=prompts, max_tokens=MAX_TOKENS, kv_transfer_config=config,
                         kv_transfer_params=[c.kv_transfer_params for c in pre.completions]), timeout_s=180)
    assert time.monotonic() - t0 < 180
    assert "pulling KV from" in dec.log
    if policy == "recompute":
        assert dec.token_ids == baseline.token_ids
    else:
        assert all(c.finish_reason != "length" or not c.token_ids for c in dec.completions), dec.completions


def test_store_reuse_across_instances(vllm: VllmRunner, tiny_model: str, prompts: list[str],
                                      baseline: PhaseResult) -> None:
    with tidekv_up() as master:
        a = vllm.run(Phase(model=tiny_model, prompts=prompts, max_tokens=MAX_TOKENS,
                           kv_transfer_config=tidekv_config(master=master)))
        b = vllm.run(Phase(model=tiny_model, prompts=prompts, max_tokens=MAX_TOKENS,
                           kv_transfer_config=tidekv_config(master=master)))
    assert a.token_ids == baseline.token_ids
    assert b.token_ids == baseline.token_ids
    for ca, cb in zip(a.completions, b.completions):
        full_blocks = (len(cb.prompt_token_ids) - 1) // 32 * 32
        assert (ca.num_cached_tokens or 0) == 0
        assert cb.num_cached_tokens == full_blocks, (cb.num_cached_tokens, full_blocks)


def test_store_down_engine_still_serves(vllm: VllmRunner, tiny_model: str, prompts: list[str],
                                        baseline: PhaseResult) -> None:
    dead = f"127.0.0.1:{free_port()}"
    res = vllm.run(Phase(model=tiny_model, prompts=prompts, max_tokens=MAX_TOKENS,
                         kv_transfer_config=tidekv_config(master=dead, store_timeout_s=0.5)))
    assert res.token_ids == baseline.token_ids
    assert "unreachable" in res.log and dead in res.log


def test_module_path_form_and_unknown_setting(vllm: VllmRunner, tiny_model: str, prompts: list[str],
                                              baseline: PhaseResult) -> None:
    config = {**tidekv_config(), "kv_connector_module_path": "tidekv_vllm.connector"}
    res = vllm.run(Phase(model=tiny_model, prompts=prompts[:1], max_tokens=MAX_TOKENS, kv_transfer_config=config))
    assert res.token_ids == baseline.token_ids[:1]
    with pytest.raises(HarnessError, match=r"unknown tidekv connector setting\(s\) \['mastr'\]"):
        vllm.run(Phase(model=tiny_model, prompts=prompts[:1], max_tokens=2,
                       kv_transfer_config=tidekv_config(mastr="127.0.0.1:1")))


def _stream_text(url: str, body: dict[str, Any]) -> str:
    import urllib.request

    req = urllib.request.Request(url, data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    text = []
    with urllib.request.urlopen(req, timeout=120) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                text.append(json.loads(line[6:])["choices"][0]["text"])
    return "".join(text)


def test_pd_online_through_the_proxy(tiny_model: str, prompts: list[str], baseline: PhaseResult,
                                     tmp_path: Path) -> None:
    import urllib.request

    with OpenAIServer(tiny_model, kv_transfer_config=tidekv_config(), log_path=tmp_path / "prefill.log") as prefill, \
            OpenAIServer(tiny_model, kv_transfer_config=tidekv_config(), log_path=tmp_path / "decode.log") as decode:
        port = free_port()
        proxy = subprocess.Popen(
            [sys.executable, "-m", "tidekv", "proxy", "--prefill", prefill.url, "--decode", decode.url,
             "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            assert proxy.stdout is not None
            assert "listening" in proxy.stdout.readline()
            url = f"http://127.0.0.1:{port}/v1/completions"
            for prompt, expected in zip(prompts, baseline.completions):
                body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                        "ignore_eos": True}
                req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                             headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=120) as resp:
                    answer = json.loads(resp.read())
                assert answer["choices"][0]["text"] == expected.text
                assert _stream_text(url, body) == expected.text
            assert "pulling KV from" not in decode.log()  # no pull failed (tidekv warns on each)
        except BaseException:
            print("----- prefill server log\n" + prefill.log()[-15000:])
            print("----- decode server log\n" + decode.log()[-15000:])
            raise
        finally:
            proxy.terminate()
            proxy.wait(timeout=15)


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    import urllib.request

    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        answer = json.loads(resp.read())
    assert isinstance(answer, dict)
    return answer


def test_proxy_store_policy_locates_what_a_real_prefill_saved(tiny_model: str, prompts: list[str],
                                                              tmp_path: Path) -> None:
    """What `tidekv proxy --policy store` relies on, on real vLLM: a prefill that saves to the store
    names its card in kv_transfer_params, its /tokenize gives the ids it computed, and the master
    places every full block of the prompt on that prefill's own engine. (The routing decision on top
    of this is tested against fake backends in tests/proxy/test_store_policy.py.)"""
    from tidekv.proxy.routing import prefill_request
    from tidekv.proxy.store_policy import StoreCard, StoreLocator, leading_held, tokenize_request

    with tidekv_up() as master, \
            OpenAIServer(tiny_model, kv_transfer_config=tidekv_config(master=master, store_segment_size=64 << 20),
                         log_path=tmp_path / "prefill.log") as prefill:
        locator = StoreLocator(master)
        try:
            for prompt in prompts:
                body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0}
                answer = _post(prefill.url + "/v1/completions", prefill_request(body))
                card = StoreCard.from_params(answer["kv_transfer_params"])
                assert card is not None and card.block_size == 32, answer["kv_transfer_params"]
                tokens = _post(prefill.url + "/tokenize", tokenize_request(body) or {})["tokens"]
                assert len(tokens) == answer["usage"]["prompt_tokens"]
                keys = card.first_chunk_keys(tokens)
                deadline = time.monotonic() + 30  # saves finish on a background thread
                held = -1
                while time.monotonic() < deadline:
                    located = locator.locate(keys) if keys else []
                    assert located is not None, "the master did not answer"
                    held = leading_held(located, card.engine)
                    if held == len(keys):
                        break
                    time.sleep(0.2)
                assert held == len(tokens) // 32, (held, len(tokens))
            unrelated = StoreCard(card.namespace, 32, card.engine).first_chunk_keys(list(range(64)))
            assert leading_held(locator.locate(unrelated) or [], card.engine) == 0
        except BaseException:
            print("----- prefill server log\n" + prefill.log()[-15000:])
            raise
        finally:
            locator.close()
