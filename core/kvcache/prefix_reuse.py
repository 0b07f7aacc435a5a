"""Store-backed prefix reuse, the engine-agnostic half of a KV connector's scheduler: how many
of a prompt's tokens the store can supply, which blocks a request loads before its first
forward, which full blocks it saves after each step, and whether its blocks must outlive it
until those saves end. Engine plugins translate their scheduler's calls into these and ship the
``BlockJob`` lists to their workers (``block_store``).

Rules: a stored prefix counts in whole blocks held by every TP rank; a fully stored prompt
reports all tokens but one (its last block still loaded whole); a block is saved once; a
``MasterUnavailableError`` turns reuse off through the ``StoreLink``, any other lookup failure
costs only this prompt a recompute (warned at most every 30 s).

Not thread-safe: one scheduler thread calls it. Neighbours: ``prefix`` and ``ranks`` (the keys),
``store_link`` (the master), ``block_store`` (the workers' half).
Design notes: docs/design-kvcache.md#tidekvkvcacheprefix_reuse
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tidekv.errors import MasterUnavailableError, TidekvError
from tidekv.kvcache.ranks import RankedKeys
from tidekv.kvcache.store_link import StoreLink
from tidekv.logs import WarnEvery

logger = logging.getLogger(__name__)

_WARN_EVERY_S = 30.0


@dataclass
class BlockJob:
    """Load (before the forward) or save (after it) these blocks under their store keys."""

    request_id: str
    blocks: list[int]
    keys: list[list[str]]
    """Per tensor-parallel rank, one block key per block (rank r moves its own slice)."""


@dataclass
class _Request:
    tokens: list[int]
    blocks: list[int]
    saved: int  # full blocks already in the store (saved or loaded) or computed before us
    had_saves: bool = False


@dataclass
class PrefixReuse:
    """Per-request prefix-reuse bookkeeping of one engine's scheduler.

    ``keys`` is None until every rank reported its layout (nothing is looked up or saved
    before); ``link`` is None when no store is configured.
    """

    block_size: int
    link: StoreLink | None
    load: bool = True
    """Whether prompts are looked up and loaded from the store."""
    save: bool = True
    """Whether computed blocks are saved to the store."""
    keys: RankedKeys | None = None
    _requests: dict[str, _Request] = field(default_factory=dict)
    _loads: dict[str, int] = field(default_factory=dict)  # request -> external tokens to load
    _warning: WarnEvery = field(default_factory=lambda: WarnEvery(_WARN_EVERY_S))

    @property
    def store(self) -> Any:
        """The store client while its master answers, else None (no lookups, no saves)."""
        return self.link.store if self.link is not None else None

    @property
    def is_saving(self) -> bool:
        """Whether blocks are saved now (a store is up and saving is on)."""
        return self.save and self.keys is not None and self.store is not None

    # ---- before allocation ----------------------------------------------------------------

    def matched_tokens(self, prompt: Sequence[int], num_computed_tokens: int) -> int:
        """Tokens of ``prompt`` beyond the ``num_computed_tokens`` the engine has that the store
        can supply (0 when none, or when the store cannot be asked). Side-effect free."""
        hit_blocks = self._stored_prefix_blocks(prompt, num_computed_tokens)
        tokens = min(hit_blocks * self.block_size, len(prompt) - 1) - num_computed_tokens
        return max(tokens, 0)

    def expect_load(self, request_id: str, num_external_tokens: int) -> None:
        """The engine allocated blocks for ``num_external_tokens`` store tokens of the request."""
        if num_external_tokens > 0:
            self._loads[request_id] = num_external_tokens

    def external_tokens(self, request_id: str) -> int:
        """The store tokens ``expect_load`` recorded for the request (0 if none)."""
        return self._loads.get(request_id, 0)

    # ---- per step -------------------------------------------------------------------------

    def start(self, request_id: str, tokens: Sequence[int], block_ids: Sequence[int],
              num_local_tokens: int) -> BlockJob | None:
        """A request is scheduled for the first time, with ``num_local_tokens`` computed on
        the engine (not counting the store's). Returns its load job, if it loads any blocks."""
        state = _Request(list(tokens), list(block_ids), num_local_tokens // self.block_size)
        self._requests[request_id] = state
        ext = self._loads.pop(request_id, 0)
        if not ext or self.keys is None:
            return None
        # Whole blocks: a load that ends one token short of a block-aligned prompt (see
        # matched_tokens) brings that last block too, and it is not saved again.
        first = num_local_tokens // self.block_size
        last = -(-(num_local_tokens + ext) // self.block_size)
        keys = [k[first:last] for k in self.keys.block_keys(state.tokens)]
        state.saved = last
        return BlockJob(request_id, state.blocks[first:last], keys)

    def extend(self, request_id: str, new_block_ids: Sequence[int], *, is_resumed: bool = False) -> None:
        """More blocks for a running request; ``is_resumed``: it was preempted and restarts with
        exactly these blocks (nothing of it is in them any more)."""
        state = self._requests.get(request_id)
        if state is None:
            return
        if is_resumed:
            state.blocks = list(new_block_ids)
            state.saved = 0
        else:
            state.blocks.extend(new_block_ids)

    def plan_save(self, request_id: str, computed_after_step: int) -> BlockJob | None:
        """The save job of the request's blocks that are full once this step's tokens are
        computed (``computed_after_step`` tokens), if any are new."""
        state = self._requests.get(request_id)
        if state is None or not self.is_saving:
            return None
        assert self.keys is not None
        full = min(computed_after_step, len(state.tokens), len(state.blocks) * self.block_size) // self.block_size
        if full <= state.saved:
            return None
        keys = [k[state.saved:full] for k in self.keys.block_keys(state.tokens)]
        job = BlockJob(request_id, state.blocks[state.saved:full], keys)
        state.saved = full
        state.had_saves = True
        return job

    def finish(self, request_id: str) -> bool:
        """The request finished: True when saves were planned for it, so its blocks must stay
        until the workers report them done. Forgets the request."""
        state = self._requests.pop(request_id, None)
        self._loads.pop(request_id, None)
        return state is not None and state.had_saves

    def forget(self, request_id: str) -> None:
        """Drops what is known of a request (it left without finishing here)."""
        self._requests.pop(request_id, None)
        self._loads.pop(request_id, None)

    # ---- internals ------------------------------------------------------------------------

    def _stored_prefix_blocks(self, prompt: Sequence[int], num_computed_tokens: int) -> int:
        """Full blocks of the prompt (from block 0) that are computed locally or found in the
        store on every rank; 0 when the store adds none."""
        store = self.store
        if store is None or not self.load or self.keys is None:
            return 0
        limit = len(prompt) // self.block_size
        first = num_computed_tokens // self.block_size
        try:
            # Leased: for the master's lease_ttl_s nothing evicts or removes the blocks the
            # loads planned on this answer will read (a load that still misses one is reported).
            hits = self.keys.stored_blocks(prompt, first, limit, store.exists_leased)
        except MasterUnavailableError as exc:
            if self.link is not None:
                self.link.lost(exc)  # reuse is off until the master answers again (the link says so)
            return 0
        except TidekvError as exc:
            held_back = self._warning.due()
            if held_back is not None:
                logger.warning("tidekv store lookup failed (%s): this prompt is recomputed (%d similar failures "
                               "not logged)", exc, held_back)
            return 0
        return first + hits if hits else 0
