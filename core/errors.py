"""The exception hierarchy of tidekv: one root, a few meaningful children.

Native code raises these too: ``native/common/bindings_errors.cpp`` maps each native error kind
to a class here, in that one place, for raised exceptions and for each failed request of a batch
alike (every such failure is a ``TransferError`` naming peer, op and byte range). A caller
catches the same types whichever layer failed. Neighbours: every module raises from here.
"""

from __future__ import annotations

import builtins


class TidekvError(Exception):
    """Root of every error tidekv raises on purpose."""


class ConfigError(TidekvError, ValueError):
    """A setting or argument is invalid; the message names it, its value and what is allowed."""


class TransferError(TidekvError):
    """A transfer request failed.

    Attributes:
        peer: name ("host:port") of the peer the request went to, when known.
        op: "READ" or "WRITE", when known.
        remote_addr, length: the byte range at the peer, when known.
        failures: for a failed batch, every failed request as (index, TransferError).
    """

    def __init__(
        self,
        message: str,
        *,
        peer: str | None = None,
        op: str | None = None,
        remote_addr: int | None = None,
        length: int | None = None,
    ) -> None:
        super().__init__(message)
        self.peer = peer
        self.op = op
        self.remote_addr = remote_addr
        self.length = length
        self.failures: list[tuple[int, TransferError]] = []


class EngineClosedError(TransferError):
    """The engine (or store) was closed; create a new one. Requests of a batch that was still
    running when its engine closed fail with it too."""


class ProtocolVersionError(TransferError):
    """A peer (engine or master) speaks another protocol version; the message names both."""


class AuthenticationError(TransferError):
    """A peer refused our shared secret, or asked for one we do not have."""


class SegmentNotRegisteredError(TransferError):
    """An address range is not inside a registered region (locally, or at the peer)."""


class PeerUnavailableError(TransferError):
    """The peer cannot be reached, closed the connection, or died mid-transfer."""


class TransferTimeoutError(TransferError, builtins.TimeoutError):
    """A transfer (or a wait on one) ran past its deadline."""


class StoreError(TidekvError):
    """Base of the store's errors; ``key`` names the object when one is concerned."""

    def __init__(self, message: str, *, key: bytes | str | None = None) -> None:
        super().__init__(message)
        self.key = key


class ObjectNotFoundError(StoreError, KeyError):
    """No complete object under this key."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class OutOfSpaceError(StoreError):
    """No segment has room even after evicting everything evictable."""


class LimitExceededError(StoreError):
    """The master refused a request of this client: it is at one of its per-client limits (the
    message names it); nothing of the request was done."""


class LeaseExpiredError(StoreError):
    """The read lease ran out before the read finished; the bytes may have been overwritten."""


class ObjectLeasedError(StoreError):
    """remove() refused: a reader holds a lease on the object (pass force=True to override)."""


class MasterUnavailableError(StoreError):
    """No master answered: not reachable, or no reply within the RPC timeout (after the master
    client looked for the leader for ``failover_timeout_s``).

    Attributes:
        is_request_sent: False when the request certainly never reached a master (it was not
            applied); True when it may have been (a put_start then is not retried: see
            ``tidekv.store.master_client``).
    """

    def __init__(self, message: str, *, key: bytes | str | None = None, is_request_sent: bool = True) -> None:
        super().__init__(message, key=key)
        self.is_request_sent = is_request_sent


class MasterNotReadyError(MasterUnavailableError):
    """A master answered but does not serve yet: it is rebuilding its index after a restart, or
    it is a standby (or a deposed leader) and another master leads. Nothing was applied; the
    master client retries it until ``failover_timeout_s``."""

    def __init__(self, message: str, *, key: bytes | str | None = None, leader: str = "") -> None:
        super().__init__(message, key=key, is_request_sent=False)
        self.leader = leader


class RpcError(StoreError):
    """The master refused a request as malformed (a bug or a version skew)."""


class WeightsError(TidekvError):
    """Base of weight-broadcast errors (``tidekv.weights``)."""


class VersionNotFoundError(WeightsError, KeyError):
    """The publisher holds no such weights version (never published, or already freed)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "version not found"


class VersionPendingError(VersionNotFoundError):
    """The version asked for is newer than any the publisher has published yet."""


class PublisherUnavailableError(WeightsError):
    """The publisher did not answer, or died while its weights were being pulled."""


class VersionChangedError(WeightsError):
    """The bytes being pulled were replaced by another version mid-pull (a lease ran out)."""
