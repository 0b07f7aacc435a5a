"""Slices of a trace that keep its prefix reuse: a window of trace time, and one conversation in
``k`` with every request of the kept conversations.

Reuse is between the turns of a conversation, minutes apart, so the first N requests hold little
of it; keeping whole conversations cuts the request rate by ``k`` and keeps what each request
reuses. A conversation is the requests sharing their second hash id (the first, 0, is the system
prompt every request starts with); a request of one block is a conversation of its own. Which
conversations are kept depends only on that id (a keyed hash, the same in every run and
process), not on the order of the file. No I/O. Neighbours: ``format`` (the requests), ``cli``
(``--until-s``, ``--conversations``).
Design notes: docs/design-trace.md#tidekvtracesample
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from tidekv.errors import ConfigError
from tidekv.trace.format import TraceRequest


def conversation_of(request: TraceRequest, index: int) -> tuple[int, int]:
    """The conversation a request belongs to: (0, its second hash id), or (1, its index in the
    file) for a request of fewer than two blocks."""
    return (0, request.hash_ids[1]) if len(request.hash_ids) >= 2 else (1, index)


def is_kept(conversation: tuple[int, int], keep_one_in: int) -> bool:
    """Whether ``conversation`` is among the one in ``keep_one_in`` kept (keyed hash, stable)."""
    if keep_one_in == 1:
        return True
    digest = hashlib.blake2b(f"{conversation[0]}:{conversation[1]}".encode(), digest_size=8,
                             person=b"tidekv-trace").digest()
    return int.from_bytes(digest, "little") % keep_one_in == 0


def sample(requests: Sequence[TraceRequest], *, keep_one_in: int = 1,
           until_s: float | None = None) -> list[TraceRequest]:
    """The requests before ``until_s`` of trace time (from the first request) whose conversation
    is kept, in file order, timestamps unchanged.

    Args:
        requests: a trace, in file order.
        keep_one_in: keep one conversation in this many (1: all).
        until_s: only requests this many seconds or less after the first; None: all.

    Raises:
        ConfigError: ``keep_one_in`` < 1 or ``until_s`` <= 0.
    """
    if isinstance(keep_one_in, bool) or not isinstance(keep_one_in, int) or keep_one_in < 1:
        raise ConfigError(f"keep_one_in={keep_one_in!r} is out of range; allowed whole numbers >= 1")
    if until_s is not None and not until_s > 0:
        raise ConfigError(f"until_s={until_s!r} is out of range; allowed > 0 or None")
    if not requests:
        return []
    start_ms = requests[0].timestamp_ms
    out = []
    for index, request in enumerate(requests):
        if until_s is not None and request.timestamp_ms - start_ms > until_s * 1000:
            continue
        if is_kept(conversation_of(request, index), keep_one_in):
            out.append(request)
    return out
