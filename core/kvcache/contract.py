"""The PD contract: what a prefill instance returns in an engine's ``kv_transfer_params`` and a
decode instance reads to pull the prompt's KV (the proxy passes it on and reads its store card).

One versioned msgspec struct, ``KVHandoff``, encoded into the plain dict the engine carries
(``to_params``) and decoded from it (``from_params``). The dict keeps vLLM's own flags
``do_remote_prefill`` / ``do_remote_decode`` at the top level, because vLLM reads them, and may
gain keys the engine adds (vLLM adds ``remote_prefill_cached_tokens``): decoding ignores keys it
does not know. A dict of another ``protocol_version`` is refused with an error naming both
versions before any other field is read, so a decode never mis-reads a prefill of another
tidekv; what then happens to the request is the engine's load-failure policy (recompute or fail).

The request a prefill instance gets (``remote_decode_params()``) is the engines' convention,
not ours, and is not versioned. Neighbours: ``handoff`` (which blocks move; hold and release),
``layout`` (the per-rank layouts named here), ``ranks`` (the tensor-parallel checks), the vLLM
plugin (builds and reads the contract), ``tidekv.proxy`` (passes it on).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from tidekv.errors import ConfigError, ProtocolVersionError

PROTOCOL_VERSION = 3
"""Version of ``KVHandoff`` and of the hold channel (``handoff.SPEC``). Bump it on any change a peer
of the previous version would mis-read. 2: releases are versioned and say why (a failed decode
frees the blocks at once, not only a pull). 3: the hold channel is ``tidekv.channel`` (was ZeroMQ)."""


class RankEndpoint(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where one tensor-parallel rank of the prefill holds the request's blocks."""

    engine: str
    """Name ("host:port") of the transfer engine that registered this rank's KV cache."""
    layout: dict[str, Any]
    """This rank's ``KVLayout.to_wire()``: where each block of each layer lies."""
    confirm_address: str
    """"host:port" of this rank's hold table: where the request's hold is released (by the decode
    rank that pulled, or by whoever saw the decode fail; ``handoff.HoldRelease``)."""


class KVHandoff(msgspec.Struct, frozen=True, kw_only=True):
    """A finished prefill's held blocks, as the decode needs them to pull the prompt's KV.

    Block ids are the engine's (the same on every rank); rank r's bytes are on ``ranks[r]``.
    """

    request_id: str
    """The prefill's id of the request (the hold the decode releases)."""
    engine_id: str
    """The prefill instance's engine id (vLLM's ``kv_transfer_config.engine_id``)."""
    block_ids: list[int]
    """The blocks held, in the request's block order."""
    num_tokens: int
    """Prompt tokens the prefill computed into those blocks."""
    block_size: int
    """Tokens per block."""
    tp_size: int
    """The prefill's tensor-parallel size: a decode must run the same (each rank pulls its own)."""
    ranks: list[RankEndpoint]
    """One endpoint per tensor-parallel rank, rank 0 first."""
    prefix_namespaces: list[str] | None = None
    """Every rank's store-key namespace, rank 0 first, when the prefill saves prompt blocks to the
    store (the proxy's store policy routes by them: rank r's saves sit in ``ranks[r].engine``'s
    segment), else None."""
    protocol_version: int = PROTOCOL_VERSION
    do_remote_prefill: bool = True
    """vLLM's flag: "this request's prompt KV is at a remote prefill". The decode clears it once pulled."""
    do_remote_decode: bool = False

    def __post_init__(self) -> None:
        # ValueError here becomes msgspec.ValidationError when decoding: from_params reports it.
        if self.tp_size < 1 or len(self.ranks) != self.tp_size:
            raise ValueError(f"tp_size={self.tp_size} with {len(self.ranks)} rank endpoints; expected one per rank")
        if self.prefix_namespaces is not None and len(self.prefix_namespaces) != self.tp_size:
            raise ValueError(f"tp_size={self.tp_size} with {len(self.prefix_namespaces)} prefix namespaces; "
                             "expected one per rank")
        if self.block_size < 1:
            raise ValueError(f"block_size={self.block_size} must be >= 1")
        if self.num_tokens < 0:
            raise ValueError(f"num_tokens={self.num_tokens} must be >= 0")


def remote_decode_params() -> dict[str, Any]:
    """The ``kv_transfer_params`` of a request sent to a prefill instance: "compute the prompt,
    hold its KV for a remote decode" (a new dict each call; the engine may modify it)."""
    return {"do_remote_decode": True, "do_remote_prefill": False}


def wants_remote_decode(params: Mapping[str, Any] | None) -> bool:
    """Whether a request's params ask this (prefill) instance to hold its KV for a decode."""
    return bool(params and params.get("do_remote_decode"))


def is_handoff(params: Mapping[str, Any] | None) -> bool:
    """Whether a request's params say its prompt KV is at a remote prefill (a pull is due).
    True also for params this decode cannot read: ``from_params`` then says why."""
    return bool(params and params.get("do_remote_prefill"))


def to_params(handoff: KVHandoff) -> dict[str, Any]:
    """The contract as the JSON-able dict the engine carries in ``kv_transfer_params``."""
    out: dict[str, Any] = msgspec.to_builtins(handoff)
    return out


def from_params(params: Mapping[str, Any]) -> KVHandoff:
    """Reads the contract out of a request's ``kv_transfer_params``.

    Raises:
        ProtocolVersionError: the params are of another protocol version (or carry none: an
            older tidekv, or another connector's params); the message names both versions.
        ConfigError: the params are of this version but malformed (a field missing or of the
            wrong type); the message names the field.
    """
    version = params.get("protocol_version")
    if version != PROTOCOL_VERSION:
        theirs = "no protocol_version (an older tidekv, or another connector)" if version is None \
            else f"protocol version {version!r}"
        raise ProtocolVersionError(
            f"kv_transfer_params of request {params.get('request_id', '?')!r} carry {theirs}; this decode "
            f"speaks tidekv PD protocol version {PROTOCOL_VERSION}: run the same tidekv release on prefill "
            "and decode instances")
    try:
        return msgspec.convert(dict(params), KVHandoff)
    except (msgspec.ValidationError, UnicodeEncodeError) as exc:  # e.g. a key with a lone surrogate
        raise ConfigError(f"malformed tidekv kv_transfer_params (protocol version {PROTOCOL_VERSION}): {exc}; "
                          "pass the prefill's kv_transfer_params to the decode unchanged") from None


def check_pullable(handoff: KVHandoff, *, tp_size: int, block_size: int) -> None:
    """Raises ConfigError unless a decode of ``tp_size`` ranks and ``block_size`` tokens per block
    can pull ``handoff``'s blocks (rank r pulls the blocks of prefill rank r)."""
    if handoff.tp_size != tp_size:
        raise ConfigError(
            f"prefill {handoff.engine_id!r} runs tensor_parallel_size={handoff.tp_size}, this decode runs "
            f"tensor_parallel_size={tp_size}: PD needs equal sizes (each decode rank pulls the blocks of the "
            "matching prefill rank); start both with the same --tensor-parallel-size")
    if handoff.block_size != block_size:
        raise ConfigError(
            f"prefill {handoff.engine_id!r} runs block_size={handoff.block_size}, this decode runs "
            f"block_size={block_size}: PD needs equal block sizes; start both with the same --block-size")
