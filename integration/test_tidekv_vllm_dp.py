"""TidekvConnector on real vLLM with data parallelism (``--data-parallel-size 2``: two engine
cores on one host, each with a worker of its own).

- With ``engine_port`` set, each DP engine's ranks take ports of their own (``engine_port +
  dp_rank * tensor_parallel_size + tp_rank``): before, the second engine failed to start with
  "cannot listen on ...: Address already in use".
- The engines share the store: a prompt DP rank 0 computed and saved into its own segment is
  loaded by DP rank 1 (vLLM routes by its ``X-data-parallel-rank`` header), as external
  prefix-cache hits of every full block, with the tokens of an engine without the connector.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

from conftest import MAX_TOKENS, tidekv_config, tidekv_up, wait_placed
from harness import OpenAIServer, PhaseResult, free_port

DP = 2
STORE_HITS = "vllm:external_prefix_cache_hits_total"


def _free_ports(n: int) -> int:
    """The first of ``n`` consecutive ports nothing listens on now."""
    while True:
        first = free_port()
        try:
            for port in range(first + 1, first + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return first


def test_dp_engines_take_ports_of_their_own_and_share_the_store(tiny_model: str, prompts: list[str],
                                                                baseline: PhaseResult, tmp_path: Path) -> None:
    from tidekv.proxy.store_policy import StoreCard, StoreLocator

    port = _free_ports(DP)
    with tidekv_up("16MiB") as master, OpenAIServer(
            tiny_model, kv_transfer_config=tidekv_config(master=master, engine_port=port, store_segment_size=32 << 20),
            log_path=tmp_path / "server.log", extra_args=["--data-parallel-size", str(DP)]) as server:
        log = server.log()
        for dp in range(DP):
            assert f"transfer engine 127.0.0.1:{port + dp} started" in log, dp

        # DP rank 0 computes the prompt and saves it into its own segment; as a prefill it names
        # its store card, by which the test waits for every full block to be there.
        prompt, expected = prompts[2], baseline.completions[2]
        first = server.complete(prompt, MAX_TOKENS, headers={"X-data-parallel-rank": "0"},
                                kv_transfer_params={"do_remote_decode": True})
        assert first["choices"][0]["text"] == expected.text
        card = StoreCard.from_params(first["kv_transfer_params"])
        assert card is not None and card.engines == (f"127.0.0.1:{port}",), first["kv_transfer_params"]
        full_blocks = (len(expected.prompt_token_ids) - 1) // 32
        locator = StoreLocator(master)
        try:
            assert wait_placed(locator, card, expected.prompt_token_ids) == len(expected.prompt_token_ids) // 32
        finally:
            locator.close()

        # DP rank 1 has never seen it: it loads every full block but the last token's from rank 0's segment.
        hits = server.metric(STORE_HITS)
        again = server.complete(prompt, MAX_TOKENS, headers={"X-data-parallel-rank": "1"})
        assert again["choices"][0]["text"] == expected.text
        deadline = time.monotonic() + 10  # vLLM publishes an engine's counters a moment after the answer
        while server.metric(STORE_HITS) - hits < full_blocks * 32 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert server.metric(STORE_HITS) - hits == full_blocks * 32
