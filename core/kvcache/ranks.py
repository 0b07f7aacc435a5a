"""The tensor-parallel ranks of one engine as the KV connectors see them: which parallel shapes
they support, every rank's store keys, and when a prompt's prefix counts as stored.

With tensor parallelism each rank holds its own slice of every block (its share of the KV
heads) in its own memory, behind its own transfer engine; the engine's block ids are the same
on every rank. PD moves rank r's slice from prefill rank r to decode rank r (``contract``
carries one endpoint per rank), so both sides must run the same TP size. The store keeps each
rank's slice under keys of that rank's namespace (``prefix.namespace`` commits to the rank and
the TP size), so engines of another TP size never share a key, and a prefix counts as stored
only as far as every rank's slices are: one rank's slice alone cannot serve the engine.
Neighbours: ``prefix`` (the key chain), ``layout`` (a rank's block), ``contract``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from tidekv.errors import ConfigError
from tidekv.kvcache import prefix
from tidekv.kvcache.layout import KVLayout

T = TypeVar("T")


def check_parallel(*, tensor_parallel_size: int, pipeline_parallel_size: int = 1,
                   decode_context_parallel_size: int = 1, prefill_context_parallel_size: int = 1) -> None:
    """Refuses, at start-up, an engine shape whose KV the connectors would move or key wrongly.

    Tensor parallelism is supported (each rank's blocks move and are stored on their own).
    Pipeline and context parallelism split the KV cache in other ways (layers across stages,
    tokens across ranks) that no test covers, so they are refused rather than risk wrong tokens.

    Raises:
        ConfigError: naming the setting, its value and what is allowed.
    """
    if tensor_parallel_size < 1:
        raise ConfigError(f"tensor_parallel_size={tensor_parallel_size} must be >= 1")
    unsupported = {
        "pipeline_parallel_size": (pipeline_parallel_size, "pipeline stages hold different layers"),
        "decode_context_parallel_size": (decode_context_parallel_size, "ranks hold different tokens of a block"),
        "prefill_context_parallel_size": (prefill_context_parallel_size, "ranks hold different tokens of a prompt"),
    }
    for name, (value, why) in unsupported.items():
        if value != 1:
            raise ConfigError(
                f"{name}={value} is not supported by the tidekv KV connector (allowed: 1; {why}, which its "
                "PD pulls and store keys do not model); use tensor parallelism (any tensor_parallel_size), "
                "or run without the connector")


def layout_tag(model_tag: str, tp_rank: int, tp_size: int) -> str:
    """What a rank's layout fingerprint commits to besides its tensors: the model and the rank,
    so that blocks never move between different ranks or TP sizes even when shapes agree."""
    return f"{model_tag}|tp{tp_rank}/{tp_size}"


def rank_port(port: int, tp_rank: int, tp_size: int = 1, dp_rank: int = 0, setting: str = "engine_port") -> int:
    """The port a rank listens on when the ranks of one host share a configured ``port``:
    ``port + dp_rank * tp_size + tp_rank`` (``dp_rank``: the engine's data-parallel rank on this
    host, each DP engine having ``tp_size`` ranks); 0 (any free port) stays 0. ``setting``: the
    port's setting, for the message (engine_port, hold_port).

    Raises:
        ConfigError: that port is past 65535.
    """
    if port == 0:
        return 0
    offset = dp_rank * tp_size + tp_rank
    if port + offset > 65535:
        which = f"data-parallel rank {dp_rank}, tensor-parallel rank {tp_rank}" if dp_rank else \
            f"tensor-parallel rank {tp_rank}"
        raise ConfigError(f"{setting}={port} leaves no port for {which} (a rank listens on {setting} + "
                          f"dp_rank * tensor_parallel_size + tp_rank, at most 65535); choose {setting} <= "
                          f"{65535 - offset}, or 0")
    return port + offset


def by_rank(reports: Mapping[int, T], tp_size: int) -> list[T]:
    """Every rank's start-up report (``reports``: tp rank -> report), rank 0 first.

    Raises:
        ConfigError: a rank is missing or unexpected (the engine would move or store only part
            of each block).
    """
    if sorted(reports) != list(range(tp_size)):
        raise ConfigError(
            f"the tidekv connector heard from tensor-parallel ranks {sorted(reports)} of an engine with "
            f"tensor_parallel_size={tp_size}; every rank's worker must report its KV cache (ranks 0..{tp_size - 1})")
    return [reports[r] for r in range(tp_size)]


@dataclass(frozen=True, slots=True)
class RankedKeys:
    """The store keys of one engine's blocks, on every tensor-parallel rank.

    Rank r keys its slice of block i of a prompt as ``prefix.block_keys(namespaces[r], ...)[i]``,
    one store object (``prefix.KEY_SCHEME``).
    """

    namespaces: tuple[str, ...]
    """Rank r's key namespace, rank 0 first."""
    layouts: tuple[KVLayout, ...]
    """Rank r's KV layout (what its namespace commits to)."""
    block_size: int

    @classmethod
    def of(cls, model_tag: str, layouts: Sequence[KVLayout], block_size: int) -> RankedKeys:
        """Keys of an engine whose rank r has ``layouts[r]``.

        Args:
            model_tag: the model and dtype (what else makes KV bytes incompatible).
            layouts: every rank's layout, rank 0 first.
            block_size: tokens per block.
        """
        if not layouts:
            raise ConfigError("RankedKeys needs the layout of at least one rank")
        tp_size = len(layouts)
        namespaces = tuple(prefix.namespace(model_tag, "", lay.fingerprint, block_size, r, tp_size)
                           for r, lay in enumerate(layouts))
        return cls(namespaces, tuple(layouts), block_size)

    @property
    def tp_size(self) -> int:
        return len(self.namespaces)

    def block_keys(self, token_ids: Sequence[int]) -> list[list[str]]:
        """Per rank, the key of every full block of ``token_ids`` (``[rank][block]``)."""
        return [prefix.block_keys(ns, token_ids, self.block_size) for ns in self.namespaces]

    def stored_blocks(self, token_ids: Sequence[int], first: int, limit: int,
                      exists_many: Callable[[list[str]], list[bool]]) -> int:
        """How many consecutive blocks from block ``first`` (below ``limit``) the store holds on
        on every rank: the run stops at the first block any rank lacks.

        Args:
            token_ids: the prompt.
            first: the first block asked about (those before it are computed already).
            limit: one past the last block asked about.
            exists_many: the store's presence check of many keys, in order (one call).

        Raises:
            Whatever ``exists_many`` raises (a store that cannot answer).
        """
        if limit <= first:
            return 0
        per_rank = [keys[first:limit] for keys in self.block_keys(token_ids)]
        blocks, ranks = len(per_rank[0]), len(per_rank)
        present = exists_many([per_rank[r][b] for b in range(blocks) for r in range(ranks)])  # block by block
        hits = 0
        while hits < blocks and all(present[hits * ranks : (hits + 1) * ranks]):
            hits += 1
        return hits
