"""The FAST'25 trace format (Mooncake's published traces): one JSON object per line with
``timestamp`` (ms from the trace's start), ``input_length`` and ``output_length`` (tokens) and
``hash_ids``, one id per 512-token block of the prompt, equal ids meaning an identical prefix up to
and including that block. Also the parser of token counts ("3M") the trace tools take.
Neighbours: ``cache`` and ``replay`` consume what ``load_trace`` returns.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import msgspec

from tidekv.errors import ConfigError

logger = logging.getLogger(__name__)

TRACE_BLOCK_TOKENS = 512
"""Tokens per ``hash_ids`` block in the FAST'25 traces."""

_TOKEN_UNITS = {"": 1, "k": 1_000, "m": 1_000_000, "g": 1_000_000_000}


class _Line(msgspec.Struct):
    timestamp: float
    input_length: int
    output_length: int
    hash_ids: list[int]


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace."""

    timestamp_ms: float
    """Arrival time, ms from the trace's start."""
    input_length: int
    """Prompt tokens."""
    output_length: int
    """Generated tokens."""
    hash_ids: tuple[int, ...]
    """One id per 512-token block of the prompt (the last block may be partial)."""


def load_trace(path: str | Path, *, max_requests: int | None = None) -> list[TraceRequest]:
    """Reads a FAST'25 trace, in file order.

    Args:
        path: a JSON-lines file; blank lines are skipped.
        max_requests: stop after this many requests (None: all).

    Returns:
        The requests in file order.

    Raises:
        ConfigError: the file cannot be read, or a line is not a trace request (the message names
            the file, the line and what is wrong).
    """
    decoder = msgspec.json.Decoder(_Line)
    requests: list[TraceRequest] = []
    try:
        f = open(path, "rb")
    except OSError as exc:
        raise ConfigError(f"trace {str(path)!r} cannot be read: {exc}") from None
    with f:
        for number, line in enumerate(f, 1):
            if max_requests is not None and len(requests) >= max_requests:
                break
            if not line.strip():
                continue
            try:
                item = decoder.decode(line)
            except msgspec.DecodeError as exc:
                raise ConfigError(f"trace {str(path)!r} line {number} is not a FAST'25 request ({exc}); expected "
                                  '{"timestamp": ms, "input_length": n, "output_length": n, "hash_ids": [...]}') from None
            if item.input_length < 0 or item.output_length < 0:
                raise ConfigError(f"trace {str(path)!r} line {number}: negative input_length or output_length")
            requests.append(TraceRequest(item.timestamp, item.input_length, item.output_length, tuple(item.hash_ids)))
    logger.debug("read %d requests from trace %s", len(requests), path)
    return requests


def parse_token_count(text: str, what: str = "token count") -> int:
    """A token count such as "0", "512", "100K", "1M", "1.5m": decimal units (K = 1000), since
    tokens are counted, not addressed.

    Raises:
        ConfigError: naming ``what`` and the text when it is not a non-negative count.
    """
    body = text.strip().lower()
    number = body.rstrip("kmg")
    unit = body[len(number):]
    try:
        if unit in _TOKEN_UNITS and number and not number.startswith(("-", "+")):
            value = float(number) * _TOKEN_UNITS[unit]
            if value == int(value):
                return int(value)
    except ValueError:
        pass
    raise ConfigError(f"{what}={text!r} is not a token count; use a whole number, optionally with K, M or G "
                      "(decimal: 1M = 1,000,000 tokens), e.g. 0, 512, 3M")
