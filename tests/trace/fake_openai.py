"""A fake OpenAI-compatible streaming server for the replay tests: token-id completions streamed
one token per event, a prefix cache over full blocks of the prompt counted in vLLM's metric
names, and a way to make chosen requests fail (by the hash id their first block spells, as
``tidekv.trace.prompts`` writes it)."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

HANG_S = 30.0


@dataclass
class FakeOpenAI:
    block_tokens: int = 16
    prefill_delay_s: float = 0.05
    token_interval_s: float = 0.01
    failures: dict[int, str] = field(default_factory=dict)
    """first block's hash id -> "http_500", "http_429", "hang", "break", "error_event", "garbage"."""
    hits: int = 500
    queries: int = 1000
    """prefix-cache counters in tokens (they start above 0: the replay must count the change)."""
    received: list[tuple[float, dict[str, Any]]] = field(default_factory=list)
    url: str = ""
    _seen: set[tuple[int, ...]] = field(default_factory=set)
    _runner: web.AppRunner | None = None
    _release: asyncio.Event | None = None

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.2)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self.url

    async def stop(self) -> None:
        if self._release is not None:
            self._release.set()  # a hanging handler ends before the loop does
            await asyncio.sleep(0.05)
        if self._runner is not None:
            await self._runner.cleanup()

    @staticmethod
    def hash_id(prompt: list[int], first_token: int = 100, vocab: int = 1000) -> int:
        a, b, c = (t - first_token for t in prompt[:3])
        return (a * vocab + b) * vocab + c

    def _account(self, prompt: list[int]) -> None:
        blocks = [tuple(prompt[: (k + 1) * self.block_tokens]) for k in range(len(prompt) // self.block_tokens)]
        held = 0
        while held < len(blocks) and blocks[held] in self._seen:
            held += 1
        self.hits += held * self.block_tokens
        self.queries += len(prompt)
        self._seen.update(blocks)

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append((time.monotonic(), body))
        failure = self.failures.get(self.hash_id(body["prompt"]))
        if failure in ("http_500", "http_429"):
            status = int(failure[5:])
            return web.json_response({"error": {"message": "no", "type": "x", "code": status}}, status=status)
        if failure == "hang":
            self._release = asyncio.Event()
            try:
                await asyncio.wait_for(self._release.wait(), HANG_S)
            except asyncio.TimeoutError:
                pass
        self._account(body["prompt"])
        await asyncio.sleep(self.prefill_delay_s)
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for i in range(body["max_tokens"]):
            if failure == "break" and i == 2:
                assert request.transport is not None
                request.transport.close()
                return out
            if failure == "error_event" and i == 1:
                await out.write(b'data: {"error": {"message": "engine died", "code": 500}}\n\n')
                break
            if failure == "garbage" and i == 1:
                await out.write(b"data: not json\n\n")
                break
            await out.write(f"data: {json.dumps({'choices': [{'index': 0, 'text': 't'}]})}\n\n".encode())
            await asyncio.sleep(self.token_interval_s)
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "tiny"}]})

    async def _metrics(self, request: web.Request) -> web.Response:
        text = ("# TYPE vllm:prefix_cache_queries_total counter\n"
                f'vllm:prefix_cache_queries_total{{engine="0",model_name="tiny"}} {float(self.queries)}\n'
                "# TYPE vllm:prefix_cache_hits_total counter\n"
                f'vllm:prefix_cache_hits_total{{engine="0",model_name="tiny"}} {float(self.hits)}\n')
        return web.Response(text=text)
