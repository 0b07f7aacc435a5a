"""The ``tidekv proxy`` subcommand: an OpenAI-compatible router for prefill/decode disaggregation.

Each ``POST /v1/completions`` or ``/v1/chat/completions`` goes to a prefill instance first, as a
copy with ``max_tokens=1``, ``stream=false`` and ``kv_transfer_params={"do_remote_decode": true}``.
The ``kv_transfer_params`` of its answer (filled in by ``TidekvConnector.request_finished``)
are then added to the original request, which goes to a decode instance; the decode pulls the
prompt's KV instead of recomputing it, and its answer (JSON or an SSE stream) is passed back
unchanged. Without params in the prefill's answer the decode still runs: it recomputes.

Routing: decode instances take turns (round robin). Prefill instances take turns too, or with
``--policy prefix`` a prompt goes to the prefill instance that already served the longest prefix
of it. That is the proxy's own memory of where prefixes went: per prefill instance, a bounded
LRU set of chained hashes of the prompt text in fixed-size character chunks. The tidekv store
is asked nothing, and the proxy needs no tokenizer, so one proxy fronts any model or engine.
With ``--policy store --master HOST:PORT`` the master is asked instead: the prompt goes to the
prefill instance whose store segment holds the longest run of its KV blocks (``store_policy``;
token ids from the instance's ``/tokenize``). ``--policy conductor`` estimates each prefill
instance's time to first token (queued prompt tokens plus the prompt's uncached ones, through a
cost model fitted to the instance's answers) and takes the smallest; with ``--ttft-slo-ms`` it
answers 429 at once when even the smallest is over the SLO (``conductor``). ``GET /metrics``
serves the proxy's counters in Prometheus text.

Failures answer in OpenAI's error shape and name the backend: unreachable or 5xx backends give
502, a backend silent for ``timeout_s`` gives 504, a backend's 4xx is passed on with its status.
When the decode leg fails after the prefill answered, the prefill holds the prompt's KV blocks
for a decode that will not pull them: the proxy releases them through the prefill's hold
tables (``tidekv.kvcache.handoff.Releaser``, addressed by the ranks in the prefill's
``kv_transfer_params``), at once when the decode never took the request or answered an error,
and ``release_grace_s`` after hanging up when it had taken it (see ``ProxyConfig``).
aiohttp (``pip install aiohttp``, tidekv's proxy extra) is imported only when a proxy starts. Everything runs
on one event loop, so the routing state needs no lock. Neighbours: ``plugins/vllm`` (the
connector that fills in ``kv_transfer_params``), ``cli`` (registers ``add_parser``), ``routing`` (who gets a request).
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from tidekv.errors import ConfigError, TidekvError
from tidekv.kvcache import contract
from tidekv.kvcache.contract import KVHandoff
from tidekv.kvcache.handoff import Releaser, ReleaseReason
from tidekv.logs import WarnEvery
from tidekv.metrics import CONTENT_TYPE, Registry
from tidekv.proxy.conductor import Conductor, cached_from_chars, reusable_tokens
from tidekv.proxy.routing import (
    ProxyConfig,
    ProxyError,
    Router,
    RoutingPolicy,
    decode_request,
    prefill_request,
    prompt_text,
)
from tidekv.proxy.store_policy import (
    STORE_TIMEOUT_S,
    StoreLocator,
    held_by_instance,
    prompt_token_ids,
    tokenize_request,
)
from tidekv.values import format_host_port

if TYPE_CHECKING:
    import aiohttp
    from aiohttp import web

logger = logging.getLogger(__name__)

COMPLETIONS_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"
_FORWARDED_HEADERS = ("Authorization", "X-Request-Id")
_MAX_BODY_BYTES = 64 << 20  # long prompts and inline images exceed aiohttp's 1 MiB default



class ProxyServer:
    """The proxy's HTTP server: ``await start()``, then ``await stop()``; one event loop."""

    def __init__(self, config: ProxyConfig) -> None:
        require_aiohttp()
        self.config = config
        self.router = Router(config)
        self.address: str | None = None
        """``http://host:port`` once started."""
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None
        self._missing_kv_warning = WarnEvery()
        self._locator = StoreLocator(config.master, config.secret) if config.master else None
        self.conductor = (Conductor(len(config.prefill_urls), config.ttft_slo_ms / 1e3 if config.ttft_slo_ms else None,
                                    num_decodes=len(config.decode_urls), probe_after_s=config.probe_after_s)
                          if config.policy is RoutingPolicy.CONDUCTOR else None)
        self.metrics = Registry()
        self._requests = self.metrics.counter("tidekv_proxy_requests_total",
                                              "Generation requests received, by prefill instance chosen", ["prefill"])
        self._rejected = self.metrics.counter("tidekv_proxy_rejected_total",
                                              "Requests answered 429 before any prefill, by reason", ["reason"])
        if self.conductor is not None:
            self._conductor_gauges(self.conductor)
        self._tokenize_warning = WarnEvery()
        self._tokenize_turn = 0
        self._releaser = Releaser(config.secret)
        self._pending_releases: set[asyncio.TimerHandle] = set()

    async def start(self) -> str:
        """Binds the socket and serves in the running loop until ``stop()``.

        Returns:
            The proxy's base URL, ``http://host:port`` (the real port when ``config.port`` is 0).

        Raises:
            ConfigError: the address cannot be bound (in use, or not local).
        """
        import aiohttp
        from aiohttp import web

        timeout = aiohttp.ClientTimeout(total=None, connect=self.config.timeout_s, sock_read=self.config.timeout_s)
        self._session = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=1024))
        app = web.Application(middlewares=[web.middleware(_errors_middleware)], client_max_size=_MAX_BODY_BYTES)
        app.router.add_post(COMPLETIONS_PATH, self._generate)
        app.router.add_post(CHAT_PATH, self._generate)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        family = socket.AF_INET6 if ":" in self.config.host else socket.AF_INET
        try:
            sock = socket.create_server((self.config.host, self.config.port), family=family)
        except OSError as exc:
            await self._session.close()
            raise ConfigError(f"cannot listen on {format_host_port(self.config.host, self.config.port)}: {exc}; "
                              "choose another --host/--port") from None
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        await web.SockSite(self._runner, sock).start()
        self.address = f"http://{format_host_port(self.config.host, sock.getsockname()[1])}"
        logger.info("proxy listening on %s: prefill %s, decode %s, policy %s, timeout %.1f s", self.address,
                    list(self.config.prefill_urls), list(self.config.decode_urls), self.config.policy.value,
                    self.config.timeout_s)
        return self.address

    async def stop(self) -> None:
        """Stops accepting, gives requests in flight a second to finish, closes backend connections."""
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()
        if self._locator is not None:
            self._locator.close()
        for timer in self._pending_releases:
            timer.cancel()  # the prefills' hold timeouts take over
        self._releaser.close()
        logger.info("proxy on %s stopped", self.address)

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        arrived_s = time.monotonic()
        body = await _client_json(request)
        headers = _forwarded_headers(request)
        if self.conductor is None:
            prefill_url, decode_url = await self._pick_prefill(body, headers), None
            return await self._prefill_then_decode(request, body, headers, prefill_url, decode_url, None)
        conductor = self.conductor
        prefill_url, decode_url, ticket = await self._pick_conducted(body, headers, conductor)

        def first_token() -> None:
            now_s = time.monotonic()
            conductor.first_token(ticket, now_s, now_s - arrived_s)

        try:
            return await self._prefill_then_decode(request, body, headers, prefill_url, decode_url,
                                                   (ticket, first_token))
        finally:
            conductor.finished(ticket)

    async def _prefill_then_decode(self, request: web.Request, body: dict[str, Any], headers: dict[str, str],
                                   prefill_url: str, decode_url: str | None,
                                   conducted: tuple[int, Callable[[], None]] | None) -> web.StreamResponse:
        """The two legs of one request; ``decode_url`` None: the decode's turn is taken after the
        prefill. ``conducted``: the conductor's ticket and what to call on the first token."""
        self._requests.labels(prefill=prefill_url).inc()
        started_s = time.monotonic()
        elapsed_s: float | None = None
        try:
            prefill = await self._call("prefill", prefill_url, "POST", request.path, prefill_request(body), headers)
            elapsed_s = time.monotonic() - started_s
        finally:
            if conducted is not None and self.conductor is not None:
                self.conductor.answered(conducted[0], elapsed_s, time.monotonic())
        kv_params = prefill.get("kv_transfer_params")
        if not isinstance(kv_params, dict):
            self._warn_missing_kv(prefill_url)
            kv_params = None
        else:
            self.router.learn(prefill_url, kv_params)
        if decode_url is None:
            decode_url = self.router.pick_decode()
        logger.debug("request %s: prefill %s, decode %s, kv_transfer_params %s",
                     headers["X-Request-Id"], prefill_url, decode_url, kv_params)
        held = _held_blocks(kv_params)

        def abandon(why: str, *, decode_took_it: bool) -> None:
            if held is not None:
                self._release(held, headers["X-Request-Id"], prefill_url, why, decode_took_it=decode_took_it)

        if conducted is not None and self.conductor is not None:
            self.conductor.decode_sent(conducted[0], time.monotonic())
        try:
            resp = await self._open("decode", decode_url, "POST", request.path, decode_request(body, kv_params),
                                    headers)
        except ProxyError as exc:
            # Unreachable, or an error answer: the decode has not got (or has ended) the request.
            # Silent (504): it may be running it; hanging up makes vLLM abort it there.
            abandon(str(exc), decode_took_it=exc.status == 504)
            raise
        try:
            if body.get("stream") is True:
                return await self._relay_stream(request, resp, decode_url, abandon,
                                                conducted[1] if conducted is not None else None)
            # A 200 answer without a stream comes when the decode has finished: it pulled.
            raw = await self._read("decode", decode_url, resp)
            return _passthrough(raw, resp)
        finally:
            resp.release()

    def _release(self, held: KVHandoff, request_id: str, prefill_url: str, why: str, *, decode_took_it: bool) -> None:
        """Tells the prefill to free the blocks it holds for a decode that failed: at once, or
        ``release_grace_s`` from now when the decode had taken the request (see ProxyConfig)."""
        detail = f"proxy request {request_id}: {why}"
        delay_s = self.config.release_grace_s if decode_took_it else 0.0
        logger.info("request %s: the decode leg failed (%s); prefill %s frees its KV blocks for request %s %s",
                    request_id, why, prefill_url, held.request_id, f"in {delay_s:g} s" if delay_s else "now")
        if delay_s <= 0:
            self._releaser.release_handoff(held, ReleaseReason.DECODE_FAILED, detail)
            return
        timers: list[asyncio.TimerHandle] = []

        def fire() -> None:
            self._pending_releases.difference_update(timers)
            self._releaser.release_handoff(held, ReleaseReason.DECODE_FAILED, detail)

        timers.append(asyncio.get_running_loop().call_later(delay_s, fire))
        self._pending_releases.update(timers)

    async def _pick_prefill(self, body: dict[str, Any], headers: dict[str, str]) -> str:
        """The prefill instance for a request under the policies other than the conductor."""
        if self._locator is None:
            return self.router.pick_prefill(body)
        _, held = await self._held(body, headers)
        return self.router.pick_prefill_held(held)

    async def _pick_conducted(self, body: dict[str, Any], headers: dict[str, str],
                              conductor: Conductor) -> tuple[str, str, int]:
        """conductor policy: estimates each instance's TTFT, sheds over the SLO (ProxyError 429).

        Returns:
            The prefill's URL, the decode's (its turn taken now: its leg is in the estimate) and
            the conductor's ticket.
        """
        urls = self.config.prefill_urls
        tokens, held = await self._held(body, headers)
        text = prompt_text(body)
        assert self.router.prefix_index is not None
        chain = self.router.prefix_index.chain(text)
        matched = self.router.prefix_index.matched(chain)
        cards = self.router.cards
        n_tokens = len(tokens) if tokens is not None else None
        block_size = next((c[0].block_size for c in cards.values()), None)  # one model: one block size
        cached = [reusable_tokens(n_tokens or 0, max(
                      held.get(i, 0) * (cards[i][0].block_size if i in cards else 0),
                      cached_from_chars(n_tokens or 0, matched[i] * self.router.prefix_index.chunk_chars, len(text))),
                      cards[i][0].block_size if i in cards else block_size)
                  for i in range(len(urls))]
        decode = self.router.next_decode()
        decision = conductor.choose(n_tokens, cached, time.monotonic(), decode)
        if decision.reject:
            self._rejected.labels(reason="ttft_slo").inc()
            raise ProxyError(f"request shed by the conductor policy: {decision.reason}; retry later or raise "
                             "--ttft-slo-ms", status=429, error_type="ttft_slo_exceeded")
        if decision.probe:
            logger.info("conductor policy: %s", decision.reason)
        choice = self.router.pick_prefill_conducted(decision, held, chain)
        decode_url = self.router.pick_decode()  # no await since next_decode(): the same one
        estimate = decision.estimates[choice] if decision.estimates else None
        uncached = estimate.uncached_tokens if estimate is not None else max(0, (n_tokens or 0) - cached[choice])
        ticket = conductor.sent(choice, uncached, decode, estimate.ttft_s if estimate is not None else None,
                                probe=decision.probe)
        return urls[choice], decode_url, ticket

    async def _held(self, body: dict[str, Any], headers: dict[str, str]) -> tuple[list[int] | None, dict[int, int]]:
        """The prompt's token ids (None: unknown) and, from the store, how many leading blocks each
        instance holds (empty without a master or cards)."""
        cards = dict(self.router.cards)
        tokens = prompt_token_ids(body)
        if cards and tokens is None:
            # Any instance that saves to the store tokenizes (same model); they take turns.
            self._tokenize_turn += 1
            tokenizer = sorted(cards)[self._tokenize_turn % len(cards)]
            tokens = await self._tokenize(self.config.prefill_urls[tokenizer], body, headers)
        elif tokens is None and self.conductor is not None:
            # The conductor needs the prompt's length even before any card is known: every
            # prefill can tokenize (same model); they take turns.
            self._tokenize_turn += 1
            url = self.config.prefill_urls[self._tokenize_turn % len(self.config.prefill_urls)]
            tokens = await self._tokenize(url, body, headers)
        if self._locator is None or not cards or not tokens:
            return tokens, {}
        # Hashing a long prompt's blocks and the master's round trip stay off the event loop.
        return tokens, await asyncio.to_thread(held_by_instance, cards, tokens, self._locator.locate)

    async def _tokenize(self, url: str, body: dict[str, Any], headers: dict[str, str]) -> list[int] | None:
        """The prompt's token ids from a prefill instance's ``/tokenize``; None (and a warning at
        most every 30 s) when it cannot say."""
        request = tokenize_request(body)
        if request is None:
            return None
        try:
            answer = await self._call("prefill", url, "POST", "/tokenize", request, headers, STORE_TIMEOUT_S)
        except ProxyError as exc:
            problem = str(exc)
        else:
            tokens = answer.get("tokens")
            if isinstance(tokens, list) and all(isinstance(t, int) for t in tokens):
                return tokens
            problem = f"{url}/tokenize answered without a list of token ids"
        if self._tokenize_warning.due() is not None:
            logger.warning("store policy: cannot tokenize the prompt (%s); routing round robin", problem)
        return None

    async def _relay_stream(self, request: web.Request, resp: aiohttp.ClientResponse, decode_url: str,
                            abandon: Callable[..., None],
                            first_chunk: Callable[[], None] | None = None) -> web.StreamResponse:
        """Passes the decode's stream on as it comes. A stream that breaks, or whose client
        leaves, before its first chunk ``abandon``s the request (vLLM streams the status line
        before it schedules the request, so the decode may not have pulled yet). ``first_chunk``
        is called when the first chunk (vLLM: the first token) arrives."""
        import aiohttp
        from aiohttp import web

        out = web.StreamResponse(headers={"Content-Type": resp.headers.get("Content-Type", "text/event-stream"),
                                          "Cache-Control": "no-cache"})
        relayed = 0
        try:
            await out.prepare(request)
        except ConnectionResetError:
            abandon("the client left before the stream started", decode_took_it=True)
            return out
        chunks = resp.content.iter_any().__aiter__()
        while True:
            try:
                chunk = await chunks.__anext__()
            except StopAsyncIteration:
                break
            except (TimeoutError, aiohttp.ClientError) as exc:
                # The status line is sent: the failure can only travel in the stream, as vLLM's own errors do.
                error = _backend_error("decode", decode_url, exc, self.config.timeout_s)
                logger.warning("stream from %s broke: %s", decode_url, error)
                if not relayed:
                    abandon(str(error), decode_took_it=True)
                await out.write(b"data: " + json.dumps(error.to_json()).encode() + b"\n\n")
                break
            if not relayed and first_chunk is not None:
                first_chunk()
            try:
                await out.write(chunk)
            except ConnectionResetError:
                # Returning releases resp mid-stream, which closes the connection: the decode aborts
                # the request instead of generating for nobody.
                logger.info("client left a stream from %s; aborting it there", decode_url)
                if not relayed:
                    abandon("the client left before the first token", decode_took_it=True)
                return out
            relayed += 1
        await out.write_eof()
        return out

    async def _health(self, request: web.Request) -> web.StreamResponse:
        """200 when every backend's /health answers 200, else 503; the body lists each backend."""
        from aiohttp import web

        roles = [("prefill", u) for u in self.config.prefill_urls] + [("decode", u) for u in self.config.decode_urls]
        results = await asyncio.gather(*(self._backend_health(role, url) for role, url in roles))
        healthy = all(r["healthy"] for r in results)
        body = {"status": "ok" if healthy else "degraded", "proxy": "ok", "backends": results}
        return web.json_response(body, status=200 if healthy else 503)

    async def _backend_health(self, role: str, url: str) -> dict[str, Any]:
        import aiohttp

        result: dict[str, Any] = {"role": role, "url": url, "healthy": False, "status": None}
        timeout_s = min(self.config.timeout_s, 5.0)
        try:
            async with self._client.get(url + "/health", timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                result.update(status=resp.status, healthy=resp.status == 200)
        except (TimeoutError, aiohttp.ClientError) as exc:
            result["error"] = str(_backend_error(role, url, exc, timeout_s))
        return result

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        from aiohttp import web

        return web.Response(body=self.metrics.render().encode(), headers={"Content-Type": CONTENT_TYPE})

    def _conductor_gauges(self, conductor: Conductor) -> None:
        urls = self.config.prefill_urls

        def per_instance(value: Callable[[int], float]) -> Callable[[], dict[tuple[tuple[str, str], ...], float]]:
            return lambda: {(("prefill", url),): value(i) for i, url in enumerate(urls)}

        def coefficient(i: int, which: int) -> float:
            coefficients = conductor.coefficients_of(i)
            return coefficients[which] if coefficients is not None else 0.0

        self.metrics.gauge("tidekv_proxy_prefill_queued_tokens", "conductor: prompt tokens sent to a prefill "
                           "instance and not yet answered", per_instance(lambda i: conductor.queued_tokens[i]))
        self.metrics.gauge("tidekv_proxy_prefill_cost_fixed_seconds", "conductor: the cost model's fixed time per "
                           "prefill", per_instance(lambda i: coefficient(i, 0)))
        self.metrics.gauge("tidekv_proxy_prefill_cost_per_token_seconds", "conductor: the cost model's time per "
                           "queued or uncached token", per_instance(lambda i: coefficient(i, 1)))
        self.metrics.gauge("tidekv_proxy_prefill_observations_total", "conductor: prefill answers the cost model "
                           "learned from", per_instance(lambda i: conductor.models[i].samples), kind="counter")
        decodes = self.config.decode_urls

        def per_decode(value: Callable[[int], float]) -> Callable[[], dict[tuple[tuple[str, str], ...], float]]:
            return lambda: {(("decode", url),): value(d) for d, url in enumerate(decodes)}

        self.metrics.gauge("tidekv_proxy_decode_in_flight", "conductor: requests sent to a decode instance and not "
                           "finished", per_decode(lambda d: conductor.decode_in_flight[d]))
        self.metrics.gauge("tidekv_proxy_decode_leg_seconds", "conductor: the estimated time from handing a request "
                           "to the decode to its first token, at its present load", per_decode(conductor.decode_leg_s))
        self.metrics.gauge("tidekv_proxy_decode_observations_total", "conductor: first tokens the decode leg's model "
                           "learned from", per_decode(lambda d: conductor.decode_models[d].samples), kind="counter")
        c = conductor.calibration

        def total(value: Callable[[], float]) -> Callable[[], dict[tuple[tuple[str, str], ...], float]]:
            return lambda: {(): float(value())}

        for name, text, value in (
                ("observed_total", "admitted requests whose estimated and observed TTFT are both known", lambda: c.observed),
                ("estimated_ttft_seconds_sum", "sum of the estimated TTFT of those requests", lambda: c.estimated_s_sum),
                ("observed_ttft_seconds_sum", "sum of their TTFT seen by the proxy (request in to first token out)",
                 lambda: c.observed_s_sum),
                ("ttft_abs_error_seconds_sum", "sum of |observed - estimated| TTFT", lambda: c.abs_error_s_sum),
                ("probes_total", "requests over the SLO by a stale estimate, sent to renew it", lambda: c.probes),
                ("probes_met_slo_total", "probes whose observed TTFT met the SLO", lambda: c.probes_met_slo)):
            # a sum of seconds keeps its name and is typed a gauge: a Prometheus counter's name ends in _total
            self.metrics.gauge(f"tidekv_proxy_conductor_{name}", f"conductor: {text}", total(value),
                               kind="counter" if name.endswith("_total") else "gauge")

    async def _models(self, request: web.Request) -> web.StreamResponse:
        url = self.router.pick_decode()
        resp = await self._open("decode", url, "GET", "/v1/models", None, _forwarded_headers(request))
        try:
            return _passthrough(await self._read("decode", url, resp), resp)
        finally:
            resp.release()

    @property
    def _client(self) -> aiohttp.ClientSession:
        assert self._session is not None, "ProxyServer.start() was not called"
        return self._session

    async def _call(self, role: str, url: str, method: str, path: str, body: dict[str, Any] | None,
                    headers: dict[str, str], timeout_s: float | None = None) -> dict[str, Any]:
        """One backend request whose answer must be a JSON object (within ``timeout_s`` if given)."""
        resp = await self._open(role, url, method, path, body, headers, timeout_s)
        try:
            raw = await self._read(role, url, resp)
        finally:
            resp.release()
        try:
            answer = json.loads(raw)
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            raise ProxyError(f"{role} backend {url} answered {path} with something other than a JSON object: "
                             f"{raw[:200]!r}", status=502, error_type="bad_gateway", backend_url=url)
        return answer

    async def _open(self, role: str, url: str, method: str, path: str, body: dict[str, Any] | None,
                    headers: dict[str, str], timeout_s: float | None = None) -> aiohttp.ClientResponse:
        """Sends a request; returns the response (status 200, body unread) or raises ProxyError."""
        import aiohttp

        # (timeout=None would lift the session's timeouts: pass one only when asked to)
        extra = {} if timeout_s is None else {"timeout": aiohttp.ClientTimeout(total=timeout_s)}
        try:
            resp = await self._client.request(method, url + path, json=body, headers=headers, **extra)
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise _backend_error(role, url, exc, timeout_s or self.config.timeout_s) from exc
        if resp.status == 200:
            return resp
        try:
            detail = _error_detail(await self._read(role, url, resp))
        finally:
            resp.release()
        # A 4xx is about the client's request (e.g. a prompt over max_model_len): pass it on.
        status = resp.status if 400 <= resp.status < 500 else 502
        raise ProxyError(f"{role} backend {url} answered {method} {path} with HTTP {resp.status}: {detail}",
                         status=status, error_type="invalid_request_error" if status < 500 else "bad_gateway",
                         backend_url=url)

    async def _read(self, role: str, url: str, resp: aiohttp.ClientResponse) -> bytes:
        import aiohttp

        try:
            return await resp.read()
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise _backend_error(role, url, exc, self.config.timeout_s) from exc

    def _warn_missing_kv(self, prefill_url: str) -> None:
        suppressed = self._missing_kv_warning.due()
        if suppressed is None:
            return
        logger.warning("prefill backend %s answered without kv_transfer_params (is its kv_transfer_config a "
                       "TidekvConnector with kv_role kv_producer or kv_both?); the decode recomputes the prompt "
                       "(%d similar warnings suppressed)", prefill_url, suppressed)


def _held_blocks(kv_params: dict[str, Any] | None) -> KVHandoff | None:
    """The prefill's hand-off in its answer's params (what to release if the decode fails), or
    None when there is none this proxy can read (then the prefill's hold timeout frees them)."""
    if kv_params is None:
        return None
    try:
        return contract.from_params(kv_params)
    except TidekvError as exc:
        logger.debug("cannot read the prefill's kv_transfer_params (%s); a failed decode leaves its blocks to the "
                     "prefill's hold timeout", exc)
        return None


def require_aiohttp() -> None:
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        raise TidekvError("tidekv proxy needs aiohttp, which is not installed; pip install aiohttp "
                          "(tidekv's proxy extra)") from None


async def _errors_middleware(request: web.Request,
                             handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    from aiohttp import web

    try:
        return await handler(request)
    except ProxyError as exc:
        logger.warning("%s %s -> %d: %s", request.method, request.path, exc.status, exc)
        return web.json_response(exc.to_json(), status=exc.status)


async def _client_json(request: web.Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.read())
    except (ValueError, RecursionError) as exc:  # RecursionError: arrays or objects nested ~1000 deep
        raise ProxyError(f"request body is not valid JSON: {exc}", status=400,
                         error_type="invalid_request_error") from None
    if not isinstance(body, dict):
        raise ProxyError(f"request body must be a JSON object, got {type(body).__name__}", status=400,
                         error_type="invalid_request_error")
    return body


def _forwarded_headers(request: web.Request) -> dict[str, str]:
    """Headers both backends get; one request id for both, so their logs line up."""
    headers = {name: request.headers[name] for name in _FORWARDED_HEADERS if name in request.headers}
    headers.setdefault("X-Request-Id", uuid.uuid4().hex)
    return headers


def _passthrough(raw: bytes, resp: aiohttp.ClientResponse) -> web.Response:
    from aiohttp import web

    return web.Response(body=raw, status=resp.status,
                        headers={"Content-Type": resp.headers.get("Content-Type", "application/json")})


def _backend_error(role: str, url: str, exc: BaseException, timeout_s: float) -> ProxyError:
    if isinstance(exc, TimeoutError):
        return ProxyError(f"{role} backend {url} was silent for {timeout_s:g} s (timeout_s); it may be overloaded "
                          "or hung", status=504, error_type="gateway_timeout", backend_url=url)
    return ProxyError(f"{role} backend {url} is unreachable or broke the connection: {type(exc).__name__}: {exc}",
                      status=502, error_type="bad_gateway", backend_url=url)


def _error_detail(raw: bytes) -> str:
    try:
        answer = json.loads(raw)
        message = answer.get("error", {}).get("message") or answer.get("message")
        if isinstance(message, str):
            return message
    except (ValueError, AttributeError, RecursionError):
        pass
    return raw[:500].decode(errors="replace")
