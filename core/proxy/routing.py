"""Routing of the PD proxy: its settings, the prefix memory, and which instance gets a request.

Decode instances take turns (round robin). Prefill instances take turns too, or with the
``prefix`` policy a prompt goes to the prefill instance that already served the longest prefix
of it: per prefill instance, a bounded LRU set of chained hashes of the prompt text in
fixed-size character chunks. That is the proxy's own memory — the tidekv store is asked nothing
and no tokenizer is needed, so one proxy fronts any model. With the ``store`` policy the master
is asked instead which instance's store segment holds the longest run of the prompt's KV blocks
(``store_policy``). The ``conductor`` policy estimates each prefill instance's time to first token
from its queued work and what it holds, and takes the smallest or sheds the request
(``conductor``). Also: how a client request is turned into the prefill and the decode
request. No I/O here. Neighbours: ``server`` (the HTTP side), ``store_policy``.
"""

from __future__ import annotations

import enum
import hashlib
import logging
import urllib.parse
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tidekv.config import PoolAddress
from tidekv.errors import ConfigError, TidekvError
from tidekv.kvcache.contract import remote_decode_params
from tidekv.proxy.conductor import PROBE_AFTER_S, Decision
from tidekv.proxy.store_policy import StoreCard

logger = logging.getLogger(__name__)

MAX_CARDS = 64
"""store policy: store cards kept per prefill instance (one per engine behind its URL: more than
its data-parallel engines only when engines restart on new ports)."""


class RoutingPolicy(enum.Enum):
    """How the proxy picks a prefill instance (decode instances always take turns)."""

    ROUND_ROBIN = "round_robin"  #: take turns
    PREFIX = "prefix"  #: the instance that already served the longest prefix of the prompt
    STORE = "store"  #: the instance whose store segment holds the most leading KV blocks (asks the master)
    CONDUCTOR = "conductor"  #: the smallest estimated TTFT (queued work + uncached prompt); sheds over the SLO


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    """Settings of one ``tidekv proxy``."""

    prefill_urls: tuple[str, ...]
    """Base URLs (``http://host:port``) of the prefill instances; at least one."""
    decode_urls: tuple[str, ...]
    """Base URLs of the decode instances; at least one."""
    host: str = "127.0.0.1"
    """Address the proxy listens on. Default 127.0.0.1."""
    port: int = 8000
    """Port the proxy listens on, 0 = any free. Default 8000."""
    policy: RoutingPolicy = RoutingPolicy.ROUND_ROBIN
    """Prefill routing policy. Default round robin."""
    timeout_s: float = 300.0
    """Longest a backend may stay silent (connecting, or between two bytes of its answer) before
    the request fails with 504. Default 300 s (0.1..86400)."""
    prefix_chunk_chars: int = 256
    """prefix policy: prompt text is hashed in chunks of this many characters. Default 256 (1..65536)."""
    prefix_capacity: int = 65536
    """prefix policy: chunk hashes remembered per prefill instance (LRU). Default 65536 (1..2**24)."""
    master: str = ""
    """store and conductor policies: the tidekv master (``host:port``) asked where a prompt's KV
    blocks are. Required by the store policy, optional for the conductor, refused by the others."""
    release_grace_s: float = 5.0
    """When a decode that had taken a request fails it silently (timeout, a stream cut before its
    first token, the client gone by then), the proxy hangs up (vLLM aborts the request and the
    decode's connector frees the prefill's blocks itself) and tells the prefill to free them this
    much later, for a decode too stuck to. Default 5 s (0..600): late enough that a pull in flight
    when the proxy hung up has ended. A decode that is unreachable or answers an error gets no
    grace: the prefill is told at once."""
    ttft_slo_ms: float = 0.0
    """conductor policy: answer 429 at once when every prefill instance's estimated TTFT exceeds
    this. Default 0: never shed (0..3600000). Refused by the other policies."""
    probe_after_s: float = PROBE_AFTER_S
    """conductor policy: how long an instance's last answer keeps its estimate trusted for
    shedding; a request whose estimate is older goes to it as a probe instead of a 429. Default
    1 s (0.01..3600)."""
    secret: str | None = field(default=None, repr=False)
    """Shared secret of the deployment: proved to the master (store policy) and to the prefills'
    hold tables (releases). ``tidekv proxy`` takes ``TIDEKV_SECRET`` / ``TIDEKV_SECRET_FILE``. Default None."""

    def __post_init__(self) -> None:
        for name in ("prefill_urls", "decode_urls"):
            urls = getattr(self, name)
            if not isinstance(urls, tuple) or not urls:
                raise ConfigError(f"{name}={urls!r} is invalid; give at least one base URL as a tuple")
            for url in urls:
                parsed = urllib.parse.urlsplit(url)
                if parsed.scheme not in ("http", "https") or not parsed.netloc or url.endswith("/"):
                    raise ConfigError(f"{name} entry {url!r} is invalid; expected http://host:port (no trailing /)")
        if not isinstance(self.policy, RoutingPolicy):
            raise ConfigError(f"policy={self.policy!r} is invalid; allowed {[p.value for p in RoutingPolicy]}")
        if self.policy is RoutingPolicy.STORE:
            try:
                PoolAddress.parse(self.master)
            except ConfigError:
                raise ConfigError(f"master={self.master!r} is invalid; the store policy needs the tidekv master "
                                  "as host:port (or etcd://HOST:PORT/CLUSTER)") from None
        elif self.master and self.policy is RoutingPolicy.CONDUCTOR:
            try:
                PoolAddress.parse(self.master)
            except ConfigError:
                raise ConfigError(f"master={self.master!r} is invalid; give the tidekv master as host:port "
                                  "(or etcd://HOST:PORT/CLUSTER), or none") from None
        elif self.master:
            raise ConfigError(f"master={self.master!r} is set but policy={self.policy.value!r} does not use it; "
                              "use policy 'store' or 'conductor'")
        if self.probe_after_s != PROBE_AFTER_S and self.policy is not RoutingPolicy.CONDUCTOR:
            raise ConfigError(f"probe_after_s={self.probe_after_s!r} is set but policy={self.policy.value!r} does "
                              "not use it; use policy 'conductor'")
        if self.ttft_slo_ms and self.policy is not RoutingPolicy.CONDUCTOR:
            raise ConfigError(f"ttft_slo_ms={self.ttft_slo_ms!r} is set but policy={self.policy.value!r} does not "
                              "use it; use policy 'conductor'")
        for name, low, high in (("port", 0, 65535), ("timeout_s", 0.1, 86400), ("release_grace_s", 0, 600),
                                ("prefix_chunk_chars", 1, 65536), ("prefix_capacity", 1, 1 << 24),
                                ("ttft_slo_ms", 0, 3_600_000), ("probe_after_s", 0.01, 3600)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
                raise ConfigError(f"{name}={value!r} is out of range; allowed {low}..{high}")


class ProxyError(TidekvError):
    """A request the proxy cannot serve; answered as ``{"error": {message, type, code}}``.

    Attributes:
        status: the HTTP status to answer with (400, 502, 504, or a backend's 4xx).
        error_type: the OpenAI-style error type.
        backend_url: the backend that failed, when one did.
    """

    def __init__(self, message: str, *, status: int, error_type: str, backend_url: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.error_type = error_type
        self.backend_url = backend_url

    def to_json(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.error_type, "code": self.status}}


def normalize_url(text: str) -> str:
    """``host:port`` or ``http://host:port/`` -> ``http://host:port`` (argparse type for backends)."""
    url = text.strip().rstrip("/")
    return url if "://" in url else f"http://{url}"


def prompt_text(body: dict[str, Any]) -> str:
    """The text the prefix policy hashes: the prompt, or the concatenated chat message contents.

    Token-id prompts become ``"1,2,3,"`` so that a prefix of the ids is a prefix of the text; of a
    batch of prompts the first one counts.
    """
    if "messages" in body:
        messages = body["messages"] if isinstance(body["messages"], list) else []
        return "".join(_content_text(m.get("content")) + "\x1e" for m in messages if isinstance(m, dict))
    prompt = body.get("prompt")
    while isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
        prompt = prompt[0]
    if isinstance(prompt, list):
        return "".join(f"{t}," for t in prompt)
    return prompt if isinstance(prompt, str) else ""


def _content_text(content: Any) -> str:
    if isinstance(content, list):  # OpenAI content parts; only text parts carry prompt text
        texts = (p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text")
        return "".join(t for t in texts if isinstance(t, str))  # a client may send anything as "text"
    return content if isinstance(content, str) else ""


class PrefixIndex:
    """Per prefill instance, a bounded LRU set of chained chunk hashes of the prompts sent there.

    Hash ``k`` covers the first ``k`` chunks, so finding it in an instance's set means that
    instance was sent that whole prefix (and, unless evicted, still holds its KV). Only full
    chunks are hashed: a prompt shorter than one chunk never matches.
    """

    def __init__(self, num_instances: int, chunk_chars: int, capacity: int) -> None:
        self.chunk_chars = chunk_chars
        self.capacity = capacity
        self._sets: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in range(num_instances)]

    def chain(self, text: str) -> list[bytes]:
        """Chained hashes of the full chunks of ``text``, shortest prefix first."""
        hashes: list[bytes] = []
        prev = b""
        for start in range(0, len(text) - self.chunk_chars + 1, self.chunk_chars):
            # surrogatepass: JSON may carry lone surrogates ("\ud800"), which plain UTF-8 refuses
            chunk = text[start:start + self.chunk_chars].encode("utf-8", "surrogatepass")
            prev = hashlib.blake2b(prev + chunk, digest_size=16).digest()
            hashes.append(prev)
        return hashes

    def matched(self, chain: list[bytes]) -> list[int]:
        """Per instance, how many leading chunks of ``chain`` it was sent."""
        out = []
        for s in self._sets:
            n = 0
            while n < len(chain) and chain[n] in s:
                n += 1
            out.append(n)
        return out

    def longest_match(self, chain: list[bytes]) -> tuple[int, list[int]]:
        """Returns (matched chunks, instances holding that many); (0, []) without a match."""
        for k in range(len(chain), 0, -1):
            holders = [i for i, s in enumerate(self._sets) if chain[k - 1] in s]
            if holders:
                return k, holders
        return 0, []

    def record(self, instance: int, chain: list[bytes]) -> None:
        """Remembers that ``instance`` was sent every prefix in ``chain``."""
        seen = self._sets[instance]
        for h in reversed(chain):  # the shortest prefixes, the most shared ones, are evicted last
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.capacity:
            seen.popitem(last=False)


class Router:
    """Picks the prefill and decode instance of each request (one event loop: no lock)."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self._next_prefill = 0
        self._next_decode = 0
        self.prefix_index = (PrefixIndex(len(config.prefill_urls), config.prefix_chunk_chars, config.prefix_capacity)
                             if config.policy in (RoutingPolicy.PREFIX, RoutingPolicy.CONDUCTOR) else None)
        self.cards: dict[int, tuple[StoreCard, ...]] = {}
        """store policy: what each prefill instance (by index) said about where it saves blocks, a
        card per engine it answered from (data-parallel engines behind one URL have one each),
        the latest first, at most ``MAX_CARDS``."""

    def pick_prefill(self, body: dict[str, Any]) -> str:
        """Chooses the prefill instance for a client request.

        Args:
            body: the client's request; the prefix policy reads its prompt or messages.

        Returns:
            The instance's base URL. Under the prefix policy the choice is remembered, so the
            next request sharing this prompt's prefix goes there too.
        """
        urls = self.config.prefill_urls
        if self.prefix_index is None or self.config.policy is not RoutingPolicy.PREFIX:
            return urls[self._take_prefill_turn(range(len(urls)))]
        chain = self.prefix_index.chain(prompt_text(body))
        matched, holders = self.prefix_index.longest_match(chain)
        choice = self._take_prefill_turn(holders or range(len(urls)))
        logger.debug("prefix policy: %d of %d chunks held by %s; chose %s",
                     matched, len(chain), [urls[i] for i in holders], urls[choice])
        self.prefix_index.record(choice, chain)
        return urls[choice]

    def learn(self, prefill_url: str, kv_params: dict[str, Any]) -> None:
        """store policy: notes the store card in a prefill instance's answer (the latest of each
        engine wins; the oldest engine's is dropped past ``MAX_CARDS``)."""
        if self.config.policy not in (RoutingPolicy.STORE, RoutingPolicy.CONDUCTOR):
            return
        card = StoreCard.from_params(kv_params)
        if card is not None:
            i = self.config.prefill_urls.index(prefill_url)
            others = [c for c in self.cards.get(i, ()) if c.engines != card.engines]
            self.cards[i] = (card, *others[:MAX_CARDS - 1])

    def pick_prefill_held(self, held: dict[int, int], among: Sequence[int] | None = None) -> str:
        """store policy: the instance holding the most leading blocks (``held``: instance index ->
        blocks); ties, and no instance holding any, take turns. ``among`` limits the choice to
        those instances (the conductor's tied ones)."""
        urls = self.config.prefill_urls
        pool = list(among) if among is not None else list(range(len(urls)))
        best = max((held.get(i, 0) for i in pool), default=0)
        candidates = [i for i in pool if held.get(i, 0) == best] if best > 0 else pool
        choice = self._take_prefill_turn(candidates)
        logger.debug("store policy: leading blocks held %s; chose %s", {urls[i]: n for i, n in held.items()},
                     urls[choice])
        return urls[choice]

    def pick_prefill_conducted(self, decision: Decision, held: dict[int, int], chain: list[bytes]) -> int:
        """conductor policy: the instance of ``decision`` (the store policy's rule among its tied
        candidates when it says ``by_store``); the prompt's ``chain`` is remembered there.

        Returns:
            The chosen instance's index.
        """
        if decision.by_store:
            choice = self.config.prefill_urls.index(self.pick_prefill_held(held, decision.candidates))
        else:
            choice = decision.candidates[0]
        logger.debug("conductor policy: %s; chose %s", decision.reason, self.config.prefill_urls[choice])
        if self.prefix_index is not None:
            self.prefix_index.record(choice, chain)
        return choice

    def next_decode(self) -> int:
        """The index of the decode instance ``pick_decode`` returns next (the conductor estimates its leg)."""
        return self._next_decode % len(self.config.decode_urls)

    def pick_decode(self) -> str:
        """The next decode instance's base URL (round robin)."""
        urls = self.config.decode_urls
        self._next_decode += 1
        return urls[(self._next_decode - 1) % len(urls)]

    def _take_prefill_turn(self, candidates: Sequence[int]) -> int:
        # The turn advances only when it decides, so a repeated prompt that matched does not
        # make the next unrelated prompt land on the same instance again.
        if len(candidates) == 1:
            return candidates[0]
        self._next_prefill += 1
        return candidates[(self._next_prefill - 1) % len(candidates)]


def prefill_request(body: dict[str, Any]) -> dict[str, Any]:
    """The copy of a client request sent to a prefill instance: one token, no stream, keep the KV.

    Args:
        body: the client's request (completions or chat); not modified.

    Returns:
        A new request with ``max_tokens=1`` (and ``max_completion_tokens=1`` for chat),
        ``stream=false``, no ``stream_options`` and ``kv_transfer_params`` asking the prefill to
        hold the prompt's KV for a remote decode (``tidekv.kvcache.contract.remote_decode_params``).
    """
    request = dict(body, max_tokens=1, stream=False, kv_transfer_params=remote_decode_params())
    if "messages" in body:
        request["max_completion_tokens"] = 1
    request.pop("stream_options", None)  # vLLM refuses stream_options without stream
    return request


def decode_request(body: dict[str, Any], kv_transfer_params: dict[str, Any] | None) -> dict[str, Any]:
    """The client request as sent to a decode instance, with the prefill's params when it gave some
    (passed on unchanged: the decode reads and version-checks the contract in them)."""
    request = {k: v for k, v in body.items() if k != "kv_transfer_params"}
    if kv_transfer_params is not None:
        request["kv_transfer_params"] = kv_transfer_params
    return request


