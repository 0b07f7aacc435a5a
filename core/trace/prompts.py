"""Prompts synthesized from a trace's ``hash_ids``, so that a replay gives an engine's prefix
cache the trace's sharing: equal hash ids become identical token blocks, different ones
differ. Prompts are token ids (OpenAI completions take them, and no tokenizer is needed); each
hash id becomes ``block_tokens`` ids, the first three spelling the id in base ``vocab_size``
(so two ids never share a block) and the rest drawn from a generator seeded by the id. The
prompt is cut to the (scaled) ``input_length``. No I/O. Neighbours: ``replay`` sends them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import lru_cache

from tidekv.errors import ConfigError
from tidekv.trace.format import TRACE_BLOCK_TOKENS, TraceRequest


@dataclass(frozen=True, slots=True)
class PromptSettings:
    """How trace requests become prompts."""

    scale_tokens: float = 1.0
    """Input and output lengths are multiplied by this (0 < s <= 1, to fit a small model). Default 1."""
    block_tokens: int | None = None
    """Tokens per hash id; None: 512 * scale_tokens, rounded. Make it a multiple of the engine's
    KV block size so shared blocks are cached whole."""
    vocab_size: int = 1000
    """Token ids are drawn from ``first_token .. first_token + vocab_size - 1``. Default 1000."""
    first_token: int = 100
    """The smallest token id used (clear of most special tokens). Default 100."""
    max_input_tokens: int | None = None
    """Prompts are cut to this many tokens (the model's context); None: not cut. Default None."""

    def __post_init__(self) -> None:
        if not 0 < self.scale_tokens <= 1:
            raise ConfigError(f"scale_tokens={self.scale_tokens!r} is out of range; allowed (0, 1]")
        if self.block_tokens is not None and not 4 <= self.block_tokens <= 65536:
            raise ConfigError(f"block_tokens={self.block_tokens!r} is out of range; allowed 4..65536")
        if self.max_input_tokens is not None and self.max_input_tokens < 1:
            raise ConfigError(f"max_input_tokens={self.max_input_tokens!r} is out of range; allowed >= 1 or None")
        if self.vocab_size < 16 or self.first_token < 0:
            raise ConfigError(f"vocab_size={self.vocab_size!r} / first_token={self.first_token!r} are out of range; "
                              "allowed vocab_size >= 16, first_token >= 0")
        if self.block_tokens is None and round(TRACE_BLOCK_TOKENS * self.scale_tokens) < 4:
            raise ConfigError(f"scale_tokens={self.scale_tokens!r} makes blocks of under 4 tokens; raise it or set "
                              "block_tokens")

    @property
    def tokens_per_block(self) -> int:
        return self.block_tokens if self.block_tokens is not None else round(TRACE_BLOCK_TOKENS * self.scale_tokens)


_FILLER_ID = -1


class PromptSynthesizer:
    """Turns trace requests into token-id prompts (blocks cached per hash id)."""

    def __init__(self, settings: PromptSettings) -> None:
        self.settings = settings
        self._block = lru_cache(maxsize=65536)(self._make_block)

    def _make_block(self, hash_id: int) -> tuple[int, ...]:
        s = self.settings
        v = s.vocab_size
        head = [s.first_token + (abs(hash_id) // v**k) % v for k in (2, 1, 0)]
        rng = random.Random(hash_id * 2654435761 + 97)
        tail = [s.first_token + rng.randrange(v) for _ in range(s.tokens_per_block - len(head))]
        return tuple(head + tail)

    def block(self, hash_id: int) -> tuple[int, ...]:
        """The tokens of one hash id."""
        return self._block(hash_id)

    def input_tokens(self, request: TraceRequest) -> int:
        """The scaled prompt length: at least 1, at most the request's blocks and max_input_tokens."""
        length = max(1, round(request.input_length * self.settings.scale_tokens))
        if request.hash_ids:
            length = min(length, len(request.hash_ids) * self.settings.tokens_per_block)
        cap = self.settings.max_input_tokens
        return min(length, cap) if cap is not None else length

    def output_tokens(self, request: TraceRequest) -> int:
        """The scaled ``output_length`` (at least 1): the request's ``max_tokens``."""
        return max(1, round(request.output_length * self.settings.scale_tokens))

    def prompt(self, request: TraceRequest) -> list[int]:
        """The request's prompt: its blocks in order, cut to ``input_tokens`` (a request without
        hash ids gets one filler block, the same for all such requests)."""
        n = self.input_tokens(request)
        tokens: list[int] = []
        for hash_id in request.hash_ids or (_FILLER_ID,):
            tokens.extend(self.block(hash_id))
            if len(tokens) >= n:
                break
        while len(tokens) < n:  # only for a request longer than its blocks
            tokens.extend(tokens[: n - len(tokens)])
        return tokens[:n]
