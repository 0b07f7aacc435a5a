"""TidekvConnector on real vLLM with tensor parallelism (tensor_parallel_size=2: two CPU worker
processes, each holding one of the tiny model's two KV heads). Greedy float32 tokens must equal
those of a TP=2 engine without the connector.

- PD over shm and tcp: every rank pulls its slice of each block from the matching prefill rank
  (a rank pulling another rank's heads would change the tokens). The prefill also saves to the
  store, each rank into its own segment, and its store card (what `tidekv proxy --policy store`
  routes by) names every rank's namespace and engine: the proxy sees each prompt's blocks held
  on every rank.
- A TP=1 decode given a TP=2 prefill's params refuses the pull (naming both sizes) and the
  load-failure policy recomputes.
- Store reuse by a fresh TP=2 engine: every rank's blocks were saved under its own keys and are
  loaded back (reported as cached, no rank missing any); a TP=1 engine on the same store shares
  no key with them.
- Pipeline parallelism is refused at start-up with a ConfigError naming it.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import pytest

from conftest import MAX_TOKENS, VllmRunner, prefill_params, tidekv_config, tidekv_up, wait_placed
from harness import HarnessError, HeldPhase, Phase, PhaseResult
from tidekv.kvcache import contract

TP = 2
PHASE_TIMEOUT_S = 300.0


def tp_env() -> dict[str, str]:
    """vLLM's CPU backend binds each worker's OpenMP threads to a NUMA node of its own by default
    and refuses more workers than nodes (this VM has one): bind rank r to CPU r by hand."""
    cpus = sorted(os.sched_getaffinity(0))
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(str(cpus[r % len(cpus)]) for r in range(TP))}


def tp_phase(model: str, prompts: list[Any], **fields: Any) -> Phase:
    fields.setdefault("max_tokens", MAX_TOKENS)
    return Phase(model=model, prompts=prompts, llm_kwargs={"tensor_parallel_size": TP}, env=tp_env(), **fields)


@pytest.fixture(scope="module")
def baseline_tp(vllm: VllmRunner, tiny_model: str, prompts: list[str]) -> PhaseResult:
    """Greedy tokens of a TP=2 engine without the connector."""
    return vllm.run(tp_phase(tiny_model, prompts), timeout_s=PHASE_TIMEOUT_S)


def test_tp_pd_pulls_every_rank_from_its_prefill_rank(vllm: VllmRunner, tiny_model: str, prompts: list[str],
                                                      baseline_tp: PhaseResult, baseline: PhaseResult) -> None:
    from tidekv.proxy.store_policy import StoreCard, StoreLocator

    n = len(prompts)
    # One TP=2 prefill computes each prompt four times over: one copy for each decode below. It
    # saves to the store too, each rank into a segment of its own.
    recompute = {**tidekv_config(), "kv_load_failure_policy": "recompute"}
    with contextlib.ExitStack() as stack:
        master = stack.enter_context(tidekv_up("16MiB"))
        saving = tidekv_config(hold_timeout_s=600, master=master, store_segment_size=32 << 20)
        pre = stack.enter_context(HeldPhase(tp_phase(tiny_model, prompts * 4, max_tokens=1, hold=True,
                                                     kv_transfer_config=saving, kv_transfer_params=prefill_params(4 * n)),
                                            timeout_s=PHASE_TIMEOUT_S))
        params = [c.kv_transfer_params for c in pre.completions]
        copies = [params[i * n : (i + 1) * n] for i in range(4)]
        handoffs = [contract.from_params(p) for p in params]
        assert all(h.tp_size == TP and len({r.engine for r in h.ranks}) == TP for h in handoffs), params[0]
        cards = {StoreCard.from_params(p) for p in params}
        assert len(cards) == 1, cards
        [card] = cards
        assert card is not None and card.engines == tuple(r.engine for r in handoffs[0].ranks)
        assert len(set(card.namespaces)) == TP, "each rank keys its slices under its own namespace"
        locator = StoreLocator(master)
        try:
            for c in pre.completions[:n]:
                assert wait_placed(locator, card, c.prompt_token_ids) == len(c.prompt_token_ids) // 32 > 0
        finally:
            locator.close()
        for transport, copy in (("auto", copies[0]), ("tcp", copies[1])):
            dec = vllm.run(tp_phase(tiny_model, prompts, kv_transfer_config=tidekv_config(transport=transport),
                                    kv_transfer_params=copy), timeout_s=PHASE_TIMEOUT_S)
            assert dec.token_ids == baseline_tp.token_ids, transport
            assert "pulling KV from" not in dec.log and "refusing to pull" not in dec.log

        # Proof that the decode uses what each rank pulled: prompt 0 pointed at other (unwritten)
        # blocks changes its tokens; prompt 1 with the ranks swapped (each decode rank would pull
        # the other rank's KV heads) is refused by the layout check and recomputed; prompt 2 as given.
        tampered = [dict(p) for p in copies[2]]
        tampered[0]["block_ids"] = [b + 1000 for b in tampered[0]["block_ids"]]
        tampered[1]["ranks"] = tampered[1]["ranks"][::-1]
        dec = vllm.run(tp_phase(tiny_model, prompts, kv_transfer_config=recompute, kv_transfer_params=tampered),
                       timeout_s=PHASE_TIMEOUT_S)
        assert dec.token_ids[0] != baseline_tp.token_ids[0]
        assert "KV layouts differ" in dec.log and dec.token_ids[1] == baseline_tp.token_ids[1]
        assert dec.token_ids[2] == baseline_tp.token_ids[2]

        tp1 = vllm.run(Phase(model=tiny_model, prompts=prompts, max_tokens=MAX_TOKENS, kv_transfer_config=recompute,
                             kv_transfer_params=copies[3]))
    assert "runs tensor_parallel_size=2, this decode runs tensor_parallel_size=1: PD needs equal sizes" in tp1.log
    assert tp1.token_ids == baseline.token_ids


def test_tp_store_reuse_by_a_fresh_tp_engine(vllm: VllmRunner, tiny_model: str, prompts: list[str],
                                             baseline_tp: PhaseResult, baseline: PhaseResult) -> None:
    with tidekv_up() as master:
        config = tidekv_config(master=master)
        a = vllm.run(tp_phase(tiny_model, prompts, kv_transfer_config=config), timeout_s=PHASE_TIMEOUT_S)
        b = vllm.run(tp_phase(tiny_model, prompts, kv_transfer_config=config), timeout_s=PHASE_TIMEOUT_S)
        one = vllm.run(Phase(model=tiny_model, prompts=prompts, max_tokens=MAX_TOKENS, kv_transfer_config=config))
    assert a.token_ids == baseline_tp.token_ids
    assert b.token_ids == baseline_tp.token_ids
    for ca, cb in zip(a.completions, b.completions):
        assert (ca.num_cached_tokens or 0) == 0
        assert cb.num_cached_tokens == (len(cb.prompt_token_ids) - 1) // 32 * 32, cb.num_cached_tokens
    assert "not in the store" not in b.log and "from the store failed" not in b.log  # every rank loaded its share
    assert one.token_ids == baseline.token_ids
    assert all((c.num_cached_tokens or 0) == 0 for c in one.completions), "a TP=1 engine shares no key with TP=2"


def test_pipeline_parallelism_is_refused_at_start_up(vllm: VllmRunner, tiny_model: str, prompts: list[str]) -> None:
    phase = Phase(model=tiny_model, prompts=prompts[:1], max_tokens=2, kv_transfer_config=tidekv_config(),
                  llm_kwargs={"pipeline_parallel_size": 2}, env=tp_env())
    with pytest.raises(HarnessError, match=r"ConfigError: pipeline_parallel_size=2 is not supported by the tidekv KV "
                                           r"connector \(allowed: 1"):
        vllm.run(phase, timeout_s=PHASE_TIMEOUT_S)
