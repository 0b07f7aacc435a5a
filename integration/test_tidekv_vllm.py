"""TidekvConnector on real vLLM (CPU, tiny random Llama): PD disaggregation, store-backed
prefix reuse, and failures. Each engine runs in its own process; greedy float32 decoding must
give exactly the tokens of a plain engine.

Proof that the decode really used pulled or loaded KV (not a recompute that happens to match):
pointing the decode at the wrong remote blocks changes its output, and a fresh engine reports
the store's tokens as cached (num_cached_tokens).
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import MAX_TOKENS, VllmRunner, prefill_params, tidekv_config, tidekv_up, wait_placed

EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"  # prompt tokens a connector supplied
from harness import HarnessError, HeldPhase, OpenAIServer, Phase, PhaseResult, free_port
from tidekv.kvcache import contract
from tidekv.kvcache.contract import PROTOCOL_VERSION, KVHandoff, RankEndpoint

def run_pd(vllm: VllmRunner, model: str, prompts: list[str], *, transport: str = "auto", load_mode: str = "sync",
           tamper: bool = False) -> tuple[PhaseResult, PhaseResult]:
    prefill = Phase(model=model, prompts=prompts, max_tokens=1, kv_transfer_config=tidekv_config(transport=transport),
                    kv_transfer_params=prefill_params(len(prompts)), hold=True)
    with HeldPhase(prefill) as pre:
        params = [c.kv_transfer_params for c in pre.completions]
        assert all(p and p["do_remote_prefill"] and contract.from_params(p).block_ids for p in params), params
        if tamper:
            params = copy.deepcopy(params)
            for p in params:
                p["block_ids"] = [b + 1000 for b in p["block_ids"]]  # other (unwritten) blocks
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
    for p in pre.completions:
        assert contract.from_params(p.kv_transfer_params).num_tokens >= len(p.prompt_token_ids) - 1


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


def unpullable_params(prompts: list[str]) -> list[dict[str, Any] | None]:
    """Per prompt, params this decode must refuse before touching any peer: another protocol
    version; a prefill of another tensor-parallel size; (the last prompt) no params at all."""
    def handoff(tp_size: int) -> dict[str, Any]:
        nowhere = RankEndpoint("127.0.0.1:1", {"fingerprint": "x", "block_size": 32, "layers": []}, "127.0.0.1:1")
        return contract.to_params(KVHandoff(request_id="p", engine_id="prefill-x", block_ids=list(range(70)),
                                            num_tokens=2240, block_size=32, tp_size=tp_size,
                                            ranks=[nowhere] * tp_size))
    return [{**handoff(1), "protocol_version": PROTOCOL_VERSION + 1}, handoff(2), None][: len(prompts)]


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_pd_decode_refuses_params_it_cannot_honour(vllm: VllmRunner, tiny_model: str, prompts: list[str],
                                                   baseline: PhaseResult, policy: str) -> None:
    """Another PD protocol version, or a prefill of another TP size, is refused (the log names
    both versions, or both sizes), never read: the load-failure policy recomputes or fails the
    request, and nothing is pulled from the (absent) peer the params name."""
    config = {**tidekv_config(), "kv_load_failure_policy": policy}
    dec = vllm.run(Phase(model=tiny_model, prompts=prompts, max_tokens=MAX_TOKENS, kv_transfer_config=config,
                         kv_transfer_params=unpullable_params(prompts)))
    assert f"carry protocol version {PROTOCOL_VERSION + 1}; this decode speaks tidekv PD protocol version " \
           f"{PROTOCOL_VERSION}" in dec.log
    assert "runs tensor_parallel_size=2, this decode runs tensor_parallel_size=1" in dec.log
    assert "pulling KV from 127.0.0.1:1" not in dec.log  # refused before any transfer
    assert dec.token_ids[2] == baseline.token_ids[2]
    if policy == "recompute":
        assert dec.token_ids == baseline.token_ids
    else:
        assert all(c.finish_reason != "length" or not c.token_ids for c in dec.completions[:2]), dec.completions


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


def test_store_reuse_of_a_block_aligned_prompt(vllm: VllmRunner, tiny_model: str) -> None:
    """A prompt of exactly 40 blocks: a fresh engine loads all 40 from the store and computes only
    the last token (vLLM samples from a forward), as LMCache does, not the last whole block; the
    answer equals a plain engine's."""
    import random

    rng = random.Random(7)
    prompt = [257] + [rng.randrange(97, 123) for _ in range(40 * 32 - 1)]  # <s> + 1,279 bytes
    plain = vllm.run(Phase(model=tiny_model, prompts=[prompt], max_tokens=MAX_TOKENS))
    with tidekv_up() as master:
        a = vllm.run(Phase(model=tiny_model, prompts=[prompt], max_tokens=MAX_TOKENS,
                           kv_transfer_config=tidekv_config(master=master)))
        b = vllm.run(Phase(model=tiny_model, prompts=[prompt], max_tokens=MAX_TOKENS,
                           kv_transfer_config=tidekv_config(master=master)))
    assert a.token_ids == plain.token_ids and b.token_ids == plain.token_ids
    assert (a.completions[0].num_cached_tokens or 0) == 0
    assert b.completions[0].num_cached_tokens == len(prompt) - 1, b.completions[0].num_cached_tokens


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


@pytest.mark.parametrize("in_process", [False, True], ids=["mp", "in-process-pinned"])
def test_pd_online_through_the_proxy(tiny_model: str, prompts: list[str], baseline: PhaseResult,
                                     tmp_path: Path, in_process: bool) -> None:
    """Greedy answers through the proxy equal the baseline's, JSON and streamed, with the decode
    pulling every prompt's KV. ``in-process-pinned`` is the README's set-up for engines sharing a
    CPU host: each server's model in its engine-core process, each server on a core of its own."""
    pins = ({0}, {1}) if in_process else (None, None)
    with OpenAIServer(tiny_model, kv_transfer_config=tidekv_config(), log_path=tmp_path / "prefill.log",
                      in_process=in_process, cpus=pins[0]) as prefill, \
            OpenAIServer(tiny_model, kv_transfer_config=tidekv_config(), log_path=tmp_path / "decode.log",
                         in_process=in_process, cpus=pins[1]) as decode:
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
                pulled = decode.metric(EXTERNAL_HITS)
                assert _post_json(url, body)["choices"][0]["text"] == expected.text
                # The decode pulled all but the prompt's last token (the streamed run below finds
                # most of them in its own prefix cache instead).
                assert decode.metric(EXTERNAL_HITS) - pulled == len(expected.prompt_token_ids) - 1
                assert _stream_text(url, body) == expected.text
            assert "pulling KV from" not in decode.log()  # no pull failed (tidekv warns on each)
            # tidekv's connector stats, on vLLM's own /metrics: the decode's pulls, none failed
            assert decode.metric("vllm:tidekv_kv_blocks_total", flow="pull") > 0
            assert decode.metric("vllm:tidekv_kv_bytes_total", flow="pull") > 0
            assert decode.metric("vllm:tidekv_kv_failed_blocks_total") == 0
        except BaseException:
            print("----- prefill server log\n" + prefill.log()[-15000:])
            print("----- decode server log\n" + decode.log()[-15000:])
            raise
        finally:
            proxy.terminate()
            proxy.wait(timeout=15)



def _post_json(url: str, body: dict[str, Any]) -> dict[str, Any]:
    import urllib.request

    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        answer = json.loads(resp.read())
    assert isinstance(answer, dict), answer
    return answer


def _prompt_tokens(server: OpenAIServer) -> tuple[float, float]:
    """vLLM's counters of prompt tokens (all, and those taken from its own prefix cache)."""
    import urllib.request

    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    totals = {"vllm:prompt_tokens_total": 0.0, "vllm:prompt_tokens_cached_total": 0.0}
    for line in text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
    return totals["vllm:prompt_tokens_total"], totals["vllm:prompt_tokens_cached_total"]


def test_proxy_store_policy_on_real_vllm(tiny_model: str, prompts: list[str], baseline: PhaseResult,
                                         tmp_path: Path) -> None:
    """`tidekv proxy --policy store` in front of two real prefill servers, each saving into its own
    store segment, and a decode: once a prompt's blocks sit in one prefill's segment, the prompt goes
    back to that prefill (where round robin would send it to the other), and the answer is still the
    baseline's. Also the pieces on real vLLM: each prefill names its card, its /tokenize gives the
    ids it computed, and the master places every full block on the engine the card names."""
    from tidekv.proxy.routing import prefill_request
    from tidekv.proxy.store_policy import StoreCard, StoreLocator, tokenize_request

    # Engine cores run the model themselves (in_process): no worker process to import vLLM a third
    # time and busy-poll a core; the multiprocess path has test_pd_online_through_the_proxy[mp].
    segment = 64 << 20  # each prefill's own share of the pool, where its saves go
    with tidekv_up() as master, \
            OpenAIServer(tiny_model, kv_transfer_config=tidekv_config(master=master, store_segment_size=segment),
                         log_path=tmp_path / "prefill0.log", in_process=True) as p0, \
            OpenAIServer(tiny_model, kv_transfer_config=tidekv_config(master=master, store_segment_size=segment),
                         log_path=tmp_path / "prefill1.log", in_process=True) as p1, \
            OpenAIServer(tiny_model, kv_transfer_config=tidekv_config(), log_path=tmp_path / "decode.log",
                         in_process=True) as dec:
        servers = {"prefill0": p0, "prefill1": p1, "decode": dec}
        locator = StoreLocator(master)
        port = free_port()
        proxy = subprocess.Popen(
            [sys.executable, "-m", "tidekv", "proxy", "--prefill", p0.url, p1.url, "--decode", dec.url,
             "--policy", "store", "--master", master, "--port", str(port)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            assert proxy.stdout is not None
            assert "listening" in proxy.stdout.readline()

            def through_proxy(i: int) -> str:
                body = {"model": "tiny", "prompt": prompts[i], "max_tokens": MAX_TOKENS, "temperature": 0.0,
                        "ignore_eos": True}
                return str(_post_json(f"http://127.0.0.1:{port}/v1/completions", body)["choices"][0]["text"])

            # Each prefill's card, from a prefill request of its own (a prompt used nowhere else).
            cards = []
            for server in (p0, p1):
                params = server.post("/v1/completions", prefill_request(
                    {"model": "tiny", "prompt": f"card of {server.url} " * 8}))["kv_transfer_params"]
                card = StoreCard.from_params(params)
                assert card is not None and card.block_size == 32, params
                cards.append(card)
            assert cards[0].engines != cards[1].engines and cards[0].namespaces == cards[1].namespaces

            # Nothing learned yet: the first two requests take turns (prefill0, then prefill1).
            assert through_proxy(1) == baseline.completions[1].text
            assert through_proxy(2) == baseline.completions[2].text
            tokens = {i: p0.post("/tokenize", tokenize_request({"model": "tiny", "prompt": prompts[i]}) or {})["tokens"]
                      for i in (1, 2)}
            assert wait_placed(locator, cards[0], tokens[1]) == len(tokens[1]) // 32 > 0
            assert wait_placed(locator, cards[1], tokens[2]) == len(tokens[2]) // 32 > 0
            # tidekv's connector stats on each prefill's /metrics: its saves to the store
            for server in (p0, p1):
                deadline = time.monotonic() + 30
                while server.metric("vllm:tidekv_kv_bytes_total", flow="save") <= 0:
                    assert time.monotonic() < deadline, "no save in the prefill's vllm:tidekv_kv_bytes_total"
                    time.sleep(0.2)
                assert server.metric("vllm:tidekv_kv_failed_blocks_total", flow="save") == 0

            # Round robin would now send prompt 2 to prefill0 and prompt 1 to prefill1: the store
            # policy sends each back to the prefill that holds its blocks (whose own prefix cache hits).
            def served(server: OpenAIServer, before: tuple[float, float], n: int) -> tuple[float, float]:
                # vLLM counts a request's prompt tokens as it finishes: wait for the count to move.
                now, deadline = _prompt_tokens(server), time.monotonic() + 10
                while now[0] - before[0] < n and time.monotonic() < deadline:
                    time.sleep(0.1)
                    now = _prompt_tokens(server)
                return now

            before = (_prompt_tokens(p0), _prompt_tokens(p1))
            assert through_proxy(2) == baseline.completions[2].text
            mid = (_prompt_tokens(p0), served(p1, before[1], len(tokens[2])))
            assert mid[1][0] - before[1][0] == len(tokens[2]), "prompt 2 went back to prefill1"
            assert mid[1][1] > before[1][1], "prefill1's own prefix cache served it"
            assert mid[0] == before[0]
            assert through_proxy(1) == baseline.completions[1].text
            after = (served(p0, mid[0], len(tokens[1])), _prompt_tokens(p1))
            assert after[0][0] - mid[0][0] == len(tokens[1]), "prompt 1 went back to prefill0"
            assert after[1] == mid[1]
        except BaseException:
            for name, server in servers.items():
                print(f"----- {name} server log\n" + server.log()[-8000:])
            raise
        finally:
            locator.close()
            proxy.terminate()
            proxy.wait(timeout=15)
