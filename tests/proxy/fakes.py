"""Fake vLLM backends for the proxy tests: small aiohttp apps on 127.0.0.1 that record requests.

``LoopThread`` runs one asyncio loop in a daemon thread; the fakes and in-process proxies live
on it while the test drives them over real HTTP from its own thread (``http_request``).
Neighbours: ``conftest`` wraps these in fixtures; ``tidekv.proxy`` is what they are pointed at.
"""

from __future__ import annotations

import asyncio
import enum
import http.client
import json
import threading
import urllib.parse
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

from aiohttp import web

from tidekv.kvcache import contract
from tidekv.kvcache.contract import KVHandoff, RankEndpoint
from tidekv.proxy.store_policy import StoreCard

T = TypeVar("T")
CALL_TIMEOUT_S = 10.0
HANG_S = 30.0  # longer than any proxy timeout the tests set; teardown cancels it


def handoff_params(request_id: str, engine: str, card: StoreCard | None = None,
                   hold_address: str = "127.0.0.1:1") -> dict[str, Any]:
    """The PD contract a prefill answers with, its one rank's engine named ``engine`` (or, with a
    card, a rank per engine of the card) and its hold table at ``hold_address``."""
    engines = card.engines if card else (engine,)
    handoff = KVHandoff(request_id=request_id, engine_id=engine, block_ids=[0, 1], num_tokens=20,
                        block_size=card.block_size if card else 16, tp_size=len(engines),
                        ranks=[RankEndpoint(e, {}, hold_address) for e in engines],
                        prefix_namespaces=list(card.namespaces) if card else None)
    return contract.to_params(handoff)


def engine_of(params: dict[str, Any]) -> str:
    """Rank 0's transfer engine in the contract a decode received."""
    return contract.from_params(params).ranks[0].engine


class Mode(enum.Enum):
    """How a fake backend answers generation requests."""

    OK = "ok"
    NO_KV = "no_kv"  #: a prefill that answers without kv_transfer_params
    HANG = "hang"  #: accepts the request, never answers
    FAIL = "fail"  #: HTTP 500 with an OpenAI-style error
    REJECT = "reject"  #: HTTP 400 with an OpenAI-style error (the client's fault)
    STALL_STREAM = "stall_stream"  #: a decode stream that sends one chunk, then goes silent
    MUTE_STREAM = "mute_stream"  #: a decode stream that sends its status line, then nothing


class LoopThread:
    """An asyncio loop in a daemon thread; ``call(coro)`` runs a coroutine there and waits for it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="proxy-test-loop", daemon=True)
        self._thread.start()

    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float = CALL_TIMEOUT_S) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(CALL_TIMEOUT_S)
        if not self._thread.is_alive():
            self.loop.close()


@dataclass
class Received:
    method: str
    path: str
    body: dict[str, Any] | None
    headers: dict[str, str]


@dataclass
class FakeBackend:
    """A fake prefill or decode instance. ``received`` lists every request, oldest first."""

    name: str
    role: str  # "prefill" or "decode"
    mode: Mode = Mode.OK
    stream_chunks: int = 5
    chunk_interval_s: float = 0.0
    first_chunk_gate: threading.Event | None = None
    """decode streams: after the first chunk, wait (up to 5 s) until the test sets this."""
    received: list[Received] = field(default_factory=list)
    stream_aborted: threading.Event = field(default_factory=threading.Event)
    """decode streams: set when a write failed because the reader (the proxy) closed the connection."""
    tokenize_mode: Mode = Mode.OK
    """How POST /tokenize answers: OK, FAIL (HTTP 500) or HANG."""
    card: StoreCard | None = None
    """prefill: the store card its answers' contract names (each rank's namespace and engine, block size)."""
    hold_address: str = "127.0.0.1:1"
    """prefill: the hold table its answers' contract names (where the proxy releases a failed decode's blocks)."""
    prefill_delay_s: float = 0.0
    """prefill: how long it takes to answer a generation request (its "prefill time")."""
    first_chunk_delay_s: float = 0.0
    """decode streams: how long after the status line the first chunk (token) comes."""
    url: str = ""
    _runner: web.AppRunner | None = None

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/tokenize", self._tokenize)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.2)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def bodies(self) -> list[dict[str, Any]]:
        return [r.body for r in self.received if r.body is not None]

    def _record(self, request: web.Request, body: dict[str, Any] | None) -> None:
        headers = {k.lower(): v for k, v in request.headers.items()}
        self.received.append(Received(request.method, request.path, body, headers))

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self._record(request, body)
        n = len(self.received)
        if self.mode is Mode.HANG:
            await asyncio.sleep(HANG_S)
        if self.mode in (Mode.FAIL, Mode.REJECT):
            status = 500 if self.mode is Mode.FAIL else 400
            return web.json_response({"error": {"message": f"{self.name} says no", "type": "x", "code": status}},
                                     status=status)
        if self.role == "prefill":
            await asyncio.sleep(self.prefill_delay_s)
            answer: dict[str, Any] = {"id": f"{self.name}-{n}", "choices": [{"text": "p"}]}
            if self.mode is not Mode.NO_KV:
                answer["kv_transfer_params"] = handoff_params(f"{self.name}-{n}", self.name, self.card,
                                                              self.hold_address)
            return web.json_response(answer)
        if body.get("stream"):
            return await self._stream(request)
        return web.json_response({"id": f"{self.name}-{n}", "choices": [{"text": "decoded"}], "served_by": self.name})

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        if self.mode is Mode.MUTE_STREAM:
            await asyncio.sleep(HANG_S)
        await asyncio.sleep(self.first_chunk_delay_s)
        try:
            for i in range(self.stream_chunks):
                event = {"choices": [{"text": f"tok{i}"}], "served_by": self.name}
                await out.write(f"data: {json.dumps(event)}\n\n".encode())
                if i == 0 and self.mode is Mode.STALL_STREAM:
                    await asyncio.sleep(HANG_S)
                if i == 0 and self.first_chunk_gate is not None:
                    await asyncio.get_running_loop().run_in_executor(None, self.first_chunk_gate.wait, 5.0)
                await asyncio.sleep(self.chunk_interval_s)
            await out.write(b"data: [DONE]\n\n")
        except ConnectionResetError:
            # The proxy hung up (as it should when its client left): note it and end quietly, as a
            # real server does, instead of letting aiohttp log the reset as a handler error.
            self.stream_aborted.set()
            return out
        await out.write_eof()
        return out

    async def _tokenize(self, request: web.Request) -> web.Response:
        """Like vLLM's /tokenize for a byte-level tokenizer: a token per UTF-8 byte of the prompt
        (chat: of the message contents, one after the other)."""
        body = await request.json()
        self._record(request, body)
        if self.tokenize_mode is Mode.HANG:
            await asyncio.sleep(HANG_S)
        if self.tokenize_mode is Mode.FAIL:
            return web.json_response({"error": {"message": f"{self.name} says no", "type": "x", "code": 500}},
                                     status=500)
        text = body.get("prompt") if "prompt" in body else "".join(m["content"] for m in body["messages"])
        return web.json_response({"count": len(text.encode()), "tokens": list(text.encode())})

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({}, status=503 if self.mode is Mode.FAIL else 200)

    async def _models(self, request: web.Request) -> web.Response:
        self._record(request, None)
        return web.json_response({"object": "list", "data": [{"id": "tiny"}], "served_by": self.name})


@dataclass
class HttpAnswer:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def http_request(url: str, method: str = "POST", body: Any = None, timeout_s: float = CALL_TIMEOUT_S,
                 raw: bytes | None = None) -> HttpAnswer:
    """One HTTP request with a deadline; any status comes back as an answer (no exception)."""
    parsed = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parsed.hostname or "", parsed.port, timeout=timeout_s)
    try:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        conn.request(method, parsed.path, body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return HttpAnswer(resp.status, dict(resp.getheaders()), resp.read())
    finally:
        conn.close()


def sse_events(url: str, body: Any, timeout_s: float = CALL_TIMEOUT_S,
               on_first: threading.Event | None = None) -> tuple[int, dict[str, str], list[str]]:
    """POSTs a streaming request; returns (status, headers, the data: payloads in arrival order).

    ``on_first`` is set as soon as the first event arrives (before the rest are read).
    """
    parsed = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parsed.hostname or "", parsed.port, timeout=timeout_s)
    try:
        conn.request("POST", parsed.path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        events: list[str] = []
        for line in resp:
            text = line.decode().strip()
            if text.startswith("data: "):
                events.append(text[len("data: "):])
                if on_first is not None:
                    on_first.set()
        return resp.status, dict(resp.getheaders()), events
    finally:
        conn.close()
