"""Transfer requests and the handle of a submitted batch.

One spelling: build a list of ``TransferRequest``, ``engine.transfer(requests)`` returns a
``TransferHandle``; ``handle.wait()`` makes it synchronous, ``handle.done()`` polls. A failed
request comes back from the native batch as a typed ``TransferError`` already (mapped once, in
``native/common/bindings_errors.cpp``).
Neighbours: ``engine.TransferEngine`` submits; the native Batch does the work.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from tidekv import errors

if TYPE_CHECKING:
    from tidekv import _native


class TransferOp(enum.IntEnum):
    """Direction of a request, seen from the initiator."""

    READ = 0  #: remote -> local
    WRITE = 1  #: local -> remote


class TransferState(enum.Enum):
    """State of one request of a batch."""

    PENDING = 0
    DONE = 1
    FAILED = 2


class TransferRequest(NamedTuple):
    """One one-sided copy between local registered memory and a peer's registered memory.

    Attributes:
        op: READ (peer -> local) or WRITE (local -> peer).
        local_addr: address in a region registered on this engine.
        length: bytes to move (> 0).
        peer: the peer engine's name, "host:port".
        remote_addr: address in a region registered on the peer.
    """

    op: TransferOp
    local_addr: int
    length: int
    peer: str
    remote_addr: int


@dataclass(frozen=True, slots=True)
class RequestStatus:
    """Outcome of one request; ``error`` is set when state is FAILED."""

    state: TransferState
    error: errors.TransferError | None = None


_DONE = RequestStatus(TransferState.DONE)


class TransferHandle:
    """A submitted batch. Thread-safe; the requests' memory must stay registered until it is done.

    ``wait()`` also runs the batch's own queued work on the calling thread, so a synchronous
    transfer does not pay for a thread hand-off.
    """

    __slots__ = ("_batch", "_requests")

    def __init__(self, batch: _native.Batch | None, requests: list[TransferRequest]) -> None:
        # batch None: it finished, every request successfully, before transfer() returned.
        self._batch = batch
        self._requests = requests

    def done(self) -> bool:
        """True when every request finished (successfully or not)."""
        return self._batch is None or self._batch.done()

    def wait(self, timeout_s: float | None = None) -> None:
        """Blocks until every request finished.

        Args:
            timeout_s: give up after this many seconds (None: no limit). The batch keeps running.

        Raises:
            TransferTimeoutError: not finished within timeout_s.
            TransferError (or a subclass): a request failed; ``failures`` lists all of them.
        """
        batch = self._batch
        if batch is None or batch.wait(-1.0 if timeout_s is None else timeout_s):
            return  # finished, every request succeeded
        if not batch.done():
            raise errors.TransferTimeoutError(
                f"batch of {len(self._requests)} requests not finished after {timeout_s} s"
            )
        raise self._first_failure()

    def statuses(self) -> list[RequestStatus]:
        """Per-request state, in the order the requests were given."""
        if self._batch is None:
            return [_DONE] * len(self._requests)
        out = []
        for result in self._batch.results():
            if result is True:
                out.append(_DONE)
            elif result is None:
                out.append(RequestStatus(TransferState.PENDING))
            else:
                out.append(RequestStatus(TransferState.FAILED, result))
        return out

    @property
    def bytes_done(self) -> int:
        """Bytes moved so far."""
        if self._batch is None:
            return sum(r.length for r in self._requests)
        return self._batch.bytes_done()

    def _first_failure(self) -> errors.TransferError:
        failures = [(i, s.error) for i, s in enumerate(self.statuses()) if s.error is not None]
        first = failures[0][1]
        first.failures = failures
        if len(failures) > 1:
            first.args = (f"{first.args[0]} (and {len(failures) - 1} more failed requests)",)
        return first
