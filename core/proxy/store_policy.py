"""The proxy's ``store`` routing policy: send a prompt to the prefill instance whose own store
segment holds the longest run of the prompt's leading KV blocks, as the tidekv master says.

Each instance's card (namespaces, block size, ranks' engines) is learnt from the PD contract of
its first answer; the prompt's block keys are derived as the connector does and located with one
``Locate`` (no lease). An instance holds a block only if every rank of it does. Instances without
a card, a master that is down, or a prompt no instance holds fall back to round robin; routing
never fails a request.

Neighbours: ``routing`` (the Router that takes the turn), ``server`` (the HTTP calls).
Design notes: docs/design-proxy.md#tidekvproxystore_policy
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tidekv.channel import Backoff, DownUntil
from tidekv.errors import ConfigError, TidekvError
from tidekv.kvcache import contract, prefix
from tidekv.logs import WarnEvery

logger = logging.getLogger(__name__)

STORE_TIMEOUT_S = 2.0
"""Longest the proxy waits for the master's answer, or for a prefill's /tokenize, before routing round robin."""
STORE_RETRY_S = 10.0
"""The longest the proxy routes round robin without asking, after the master failed to answer (it
asks again after 1 s, then backs off: ``channel.Backoff``)."""
_CHAT_TOKENIZE_FIELDS = ("messages", "add_generation_prompt", "continue_final_message", "chat_template",
                         "chat_template_kwargs", "tools", "add_special_tokens")


@dataclass(frozen=True, slots=True)
class StoreCard:
    """Where one prefill instance saves KV blocks: per tensor-parallel rank (rank 0 first) its key
    namespace and the transfer engine whose store segment holds what that rank saves; and the
    block size."""

    namespaces: tuple[str, ...]
    block_size: int
    engines: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.namespaces or len(self.namespaces) != len(self.engines):
            raise ConfigError(f"a store card needs one namespace and one engine per rank, not "
                              f"{len(self.namespaces)} and {len(self.engines)}")

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> StoreCard | None:
        """The card in a prefill's ``kv_transfer_params``; None if it does not save to the store,
        or its contract is of another protocol version or malformed (the decode refuses those)."""
        try:
            handoff = contract.from_params(params)
        except TidekvError as exc:
            logger.debug("store policy: no store card in a prefill's kv_transfer_params: %s", exc)
            return None
        engines = tuple(r.engine for r in handoff.ranks)
        if not handoff.prefix_namespaces or not all(handoff.prefix_namespaces) or not all(engines):
            return None
        return cls(tuple(handoff.prefix_namespaces), handoff.block_size, engines)

    def block_keys(self, token_ids: Sequence[int]) -> list[list[str]]:
        """Per rank, the store key of each full block of ``token_ids``, in order."""
        return [prefix.block_keys(ns, token_ids, self.block_size) for ns in self.namespaces]


def leading_held(engines_per_key: Sequence[Sequence[str]], engine: str) -> int:
    """How many leading keys have a replica on ``engine`` (the run stops at the first that has not)."""
    n = 0
    for engines in engines_per_key:
        if engine not in engines:
            break
        n += 1
    return n


def held_by_instance(cards: Mapping[int, Sequence[StoreCard]], token_ids: Sequence[int],
                     locate: Callable[[list[str]], list[list[str]] | None]) -> dict[int, int]:
    """Per instance (the keys of ``cards``), how many leading blocks of the prompt it holds: every
    rank's slice of each on that rank's engine, in the best of the instance's engines (one card
    each: data-parallel engines behind one URL). One ``locate`` call for every instance's keys;
    empty if ``locate`` cannot say."""
    by_namespaces: dict[tuple[str, ...], list[list[str]]] = {}  # instances of one model share them: hash once
    keys_of = {}
    for i, some in cards.items():
        for j, card in enumerate(some):
            if card.namespaces not in by_namespaces:
                by_namespaces[card.namespaces] = card.block_keys(token_ids)
            keys_of[(i, j)] = by_namespaces[card.namespaces]
    keys = sorted({k for per_rank in keys_of.values() for ks in per_rank for k in ks})
    located = locate(keys) if keys else None
    if located is None:
        return {}
    where = dict(zip(keys, located))
    held: dict[int, int] = {}
    for (i, j), per_rank in keys_of.items():
        n = min(leading_held([where[k] for k in ks], engine) for ks, engine in zip(per_rank, cards[i][j].engines))
        held[i] = max(held.get(i, 0), n)
    return held


def prompt_token_ids(body: dict[str, Any]) -> list[int] | None:
    """The token ids of a completions prompt given as ids (the first prompt of a batch); None for text."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    return None


def tokenize_request(body: dict[str, Any]) -> dict[str, Any] | None:
    """The body of a vLLM ``POST /tokenize`` for a client's request; None if it has no prompt text."""
    request: dict[str, Any] = {"model": body["model"]} if "model" in body else {}
    if "messages" in body:
        request.update({k: body[k] for k in _CHAT_TOKENIZE_FIELDS if k in body})
        return request
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        return None
    request["prompt"] = prompt
    return request


class StoreLocator:
    """Asks the master which engines hold keys; backs off after a failure. Thread-safe (the
    master client locks), blocking: the proxy calls it from a worker thread. One attempt per
    lookup (routing must not wait out a failover), the leader followed on the next."""

    def __init__(self, master: str, secret: str | None = None) -> None:
        from tidekv.config import TlsConfig
        from tidekv.store.client.pool import Pool

        self._client = Pool(master, f"tidekv-proxy-{uuid.uuid4().hex[:8]}", timeout_s=STORE_TIMEOUT_S,
                                    secret=secret, tls=TlsConfig.from_env())
        self._down = DownUntil(Backoff(initial_s=1.0, max_s=STORE_RETRY_S))
        self._warning = WarnEvery()

    def locate(self, keys: list[str]) -> list[list[str]] | None:
        """Engines holding each key; None while the master is unreachable (a warning says so)."""
        if not keys or not self._down.due():
            return None
        try:
            found = self._client.locate_many(keys)
        except TidekvError as exc:
            delay = self._down.failed()
            if self._warning.due() is not None:
                logger.warning("store policy: master %s did not answer (%s); routing round robin for %.0f s",
                               self._client.address, exc, delay)
            return None
        self._down.ok()
        return found

    def close(self) -> None:
        self._client.close()
