"""``tidekv trace replay``: drive a live OpenAI-compatible deployment (the tidekv proxy, or one
vLLM server) with a trace, and measure what its users would see.

Each request is sent at its trace time (``timestamp`` divided by ``speedup``, from the first
request's) as a streaming ``POST /v1/completions`` with a token-id prompt (``prompts``) and
``max_tokens`` from ``output_length``; the time to the first streamed token (TTFT), the gaps
between tokens (TBT) and the end-to-end latency are recorded. A request never holds the run up:
each has a deadline (``timeout_s``, connect to last byte), and every failure is recorded by kind
(HTTP status, timeout, connect, broken or erroring stream, unreadable answer). The deployment's
Prometheus ``/metrics`` are read before and after, for the prefix-cache hit rate it reports.
aiohttp is imported only when a replay starts. Neighbours: ``prompts`` (what is sent),
``replay_report`` (the summary, table and plots).
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tidekv.errors import ConfigError
from tidekv.trace.format import TraceRequest
from tidekv.trace.prompts import PromptSettings, PromptSynthesizer

if TYPE_CHECKING:
    import aiohttp

logger = logging.getLogger(__name__)

_ERROR_TEXT_BYTES = 300


class ErrorKind(enum.Enum):
    """Why a replayed request failed."""

    HTTP = "http"  #: a status other than 200 (the status is recorded too)
    TIMEOUT = "timeout"  #: no answer, or a stalled stream, within timeout_s
    CONNECT = "connect"  #: the target could not be reached
    STREAM = "stream"  #: the stream broke, carried an error event, or ended without a token
    BAD_RESPONSE = "bad_response"  #: an event that is not JSON


@dataclass(frozen=True, slots=True)
class ReplaySettings:
    """What ``tidekv trace replay`` sends, where, and what counts as meeting the SLOs."""

    target: str
    """Base URL of the deployment (``http://host:port``)."""
    model: str | None = None
    """The ``model`` field of each request; None: the first of the target's GET /v1/models."""
    speedup: float = 1.0
    """Trace time runs this many times faster (0 < s <= 10000). Default 1."""
    prompts: PromptSettings = field(default_factory=PromptSettings)
    timeout_s: float = 120.0
    """Deadline of one request, from sending to its last byte (0.1..86400). Default 120 s."""
    ttft_slo_ms: float = 2000.0
    """A request meets the TTFT SLO when its first token came within this. Default 2000 ms."""
    tbt_slo_ms: float = 200.0
    """A request meets the TBT SLO when its mean gap between tokens is within this. Default 200 ms."""
    metrics_urls: tuple[str, ...] = ()
    """More base URLs whose /metrics report prefix-cache hits (vLLM servers behind a proxy); the
    target's own /metrics is always read."""
    ignore_eos: bool = True
    """Ask for exactly max_tokens (vLLM's ``ignore_eos``). Default True."""
    max_in_flight: int = 1024
    """At most this many requests open at once (1..65536); later ones wait (and are late). Default 1024."""

    def __post_init__(self) -> None:
        if not self.target.startswith(("http://", "https://")) or self.target.endswith("/"):
            raise ConfigError(f"target={self.target!r} is invalid; expected http://host:port (no trailing /)")
        for name, low, high in (("speedup", 1e-6, 10000), ("timeout_s", 0.1, 86400), ("ttft_slo_ms", 0, 1e7),
                                ("tbt_slo_ms", 0, 1e7), ("max_in_flight", 1, 65536)):
            value = getattr(self, name)
            if not low <= value <= high:
                raise ConfigError(f"{name}={value!r} is out of range; allowed {low:g}..{high:g}")


@dataclass
class RequestResult:
    """One replayed request. Times are seconds from the replay's start."""

    index: int
    scheduled_s: float
    input_tokens: int
    max_tokens: int
    sent_s: float = 0.0
    ttft_s: float | None = None
    e2e_s: float | None = None
    tokens: int = 0
    """Streamed events carrying a token."""
    gaps_s: list[float] = field(default_factory=list)
    """Time between consecutive tokens."""
    error: ErrorKind | None = None
    status: int | None = None
    detail: str = ""

    @property
    def is_ok(self) -> bool:
        return self.error is None

    @property
    def error_key(self) -> str | None:
        """"http_503", "timeout", ...; None when it succeeded."""
        if self.error is None:
            return None
        return f"http_{self.status}" if self.error is ErrorKind.HTTP else self.error.value

    @property
    def mean_tbt_s(self) -> float | None:
        return sum(self.gaps_s) / len(self.gaps_s) if self.gaps_s else None


@dataclass
class ReplayRun:
    """Everything a replay recorded."""

    settings: ReplaySettings
    model: str
    results: list[RequestResult]
    duration_s: float
    metrics_before: dict[str, str]
    metrics_after: dict[str, str]
    """Per URL, the /metrics text (URLs that did not answer are left out)."""


def require_aiohttp() -> None:
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        raise ConfigError("tidekv trace replay needs aiohttp, which is not installed; pip install aiohttp "
                          "(tidekv's proxy extra)") from None


async def replay(requests: Sequence[TraceRequest], settings: ReplaySettings, *, show_progress: bool = False) -> ReplayRun:
    """Replays ``requests`` against ``settings.target``; returns once every request has ended.

    Raises:
        ConfigError: aiohttp is missing, or no model was given and the target's /v1/models
            cannot say one.
    """
    require_aiohttp()
    import aiohttp

    from tidekv.report import progress

    synth = PromptSynthesizer(settings.prompts)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=settings.timeout_s, sock_read=settings.timeout_s)
    async with aiohttp.ClientSession(timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=settings.max_in_flight)) as session:
        model = settings.model or await _first_model(session, settings.target)
        urls = (settings.target, *settings.metrics_urls)
        before = await _scrape(session, urls)
        bar = progress(len(requests), "trace replay", enabled=show_progress)
        bar.unit = "req"
        first_ms = requests[0].timestamp_ms if requests else 0.0
        loop = asyncio.get_running_loop()
        start = loop.time()

        async def one(index: int, request: TraceRequest) -> RequestResult:
            at = (request.timestamp_ms - first_ms) / 1000.0 / settings.speedup
            result = RequestResult(index, at, synth.input_tokens(request), synth.output_tokens(request))
            await asyncio.sleep(max(0.0, start + at - loop.time()))
            body = {"model": model, "prompt": synth.prompt(request), "max_tokens": result.max_tokens, "stream": True,
                    "temperature": 0.0}
            if settings.ignore_eos:
                body["ignore_eos"] = True
            result.sent_s = loop.time() - start
            try:
                await asyncio.wait_for(_stream(session, settings.target, body, result, loop, start),
                                       settings.timeout_s)
            except asyncio.TimeoutError:
                _fail(result, ErrorKind.TIMEOUT, f"no complete answer within {settings.timeout_s:g} s (timeout_s)")
            bar.update(1)
            return result

        results = await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
        duration = loop.time() - start
        bar.close()
        after = await _scrape(session, urls)
    return ReplayRun(settings, model, list(results), duration, before, after)


def _fail(result: RequestResult, kind: ErrorKind, detail: str, status: int | None = None) -> None:
    if result.error is None:
        result.error, result.status, result.detail = kind, status, detail[:_ERROR_TEXT_BYTES]


async def _stream(session: aiohttp.ClientSession, target: str, body: dict[str, Any], result: RequestResult,
                  loop: asyncio.AbstractEventLoop, start: float) -> None:
    """Sends one streaming completion and records its token times into ``result``."""
    import aiohttp

    last: float | None = None
    try:
        async with session.post(target + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                text = (await resp.content.read(_ERROR_TEXT_BYTES)).decode(errors="replace")
                _fail(result, ErrorKind.HTTP, text, resp.status)
                return
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                try:
                    event = json.loads(data)
                except ValueError:
                    _fail(result, ErrorKind.BAD_RESPONSE, f"an event that is not JSON: {data[:100]!r}")
                    return
                if not isinstance(event, dict):
                    _fail(result, ErrorKind.BAD_RESPONSE, f"an event that is not a JSON object: {data[:100]!r}")
                    return
                if "error" in event:
                    _fail(result, ErrorKind.STREAM, f"error event: {json.dumps(event['error'])}")
                    return
                if not event.get("choices"):
                    continue  # a usage-only event
                now = loop.time() - start
                if last is None:
                    result.ttft_s = now - result.sent_s
                else:
                    result.gaps_s.append(now - last)
                last = now
                result.tokens += 1
    except asyncio.TimeoutError:
        _fail(result, ErrorKind.TIMEOUT, "the target went silent (timeout_s)")
        return
    except aiohttp.ClientConnectorError as exc:
        _fail(result, ErrorKind.CONNECT, f"{type(exc).__name__}: {exc}")
        return
    except (aiohttp.ClientError, ConnectionError) as exc:
        _fail(result, ErrorKind.STREAM, f"the stream broke: {type(exc).__name__}: {exc}")
        return
    if last is None:
        _fail(result, ErrorKind.STREAM, "the stream ended without a token")
        return
    result.e2e_s = loop.time() - start - result.sent_s


async def _first_model(session: aiohttp.ClientSession, target: str) -> str:
    import aiohttp

    try:
        async with session.get(target + "/v1/models", timeout=aiohttp.ClientTimeout(total=10)) as resp:
            answer = await resp.json(content_type=None)
        model = answer["data"][0]["id"]
        if isinstance(model, str):
            return model
    except (asyncio.TimeoutError, aiohttp.ClientError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise ConfigError(f"cannot learn the model from {target}/v1/models ({type(exc).__name__}: {exc}); "
                          "pass --model") from None
    raise ConfigError(f"{target}/v1/models names no model; pass --model")


async def _scrape(session: aiohttp.ClientSession, urls: Sequence[str]) -> dict[str, str]:
    """Each URL's /metrics text; those that do not answer 200 within 5 s are left out."""
    import aiohttp

    async def one(url: str) -> tuple[str, str | None]:
        try:
            async with session.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=5)) as resp:
                return url, (await resp.text()) if resp.status == 200 else None
        except (asyncio.TimeoutError, aiohttp.ClientError, UnicodeDecodeError) as exc:
            logger.debug("no /metrics from %s: %s", url, exc)
            return url, None

    answers = await asyncio.gather(*(one(u) for u in dict.fromkeys(urls)))
    return {url: text for url, text in answers if text is not None}


def run(requests: Sequence[TraceRequest], settings: ReplaySettings, *, show_progress: bool = False) -> ReplayRun:
    """``replay`` in a fresh event loop (for the command line)."""
    return asyncio.run(replay(requests, settings, show_progress=show_progress))
