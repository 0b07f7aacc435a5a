"""The exception hierarchy of tidekv: one root, and a child per layer, so the type says what failed.

- ``ConfigError``: a setting or argument (nothing was attempted);
- ``ChannelError``: a control channel (``tidekv.channel``) -- ``AuthenticationError`` and
  ``ProtocolVersionError`` are its handshake's and version check's, whichever channel;
- ``TransferError``: the transfer engine's data path (native code raises these: the mapping from
  native error kinds is in ``native/common/bindings_errors.cpp``, in that one place); its
  handshake failures are ``TransferAuthenticationError`` / ``TransferProtocolVersionError``,
  which are both a ``TransferError`` and the channel-level class;
- ``StoreError``: the store (``MasterUnavailableError`` and friends, per-object errors);
- ``WeightsError``: weight broadcast.

Batches, one convention: the error raised for a partly failed batch is its first failure, and
``failures`` lists every failed item as (item, error) -- a transfer batch's request index, a
store batch's key (``failed_keys`` is the same as a dict). Neighbours: every module raises from here.
"""

from __future__ import annotations

import builtins
from typing import Any


class TidekvError(Exception):
    """Root of every error tidekv raises on purpose.

    Attributes:
        failures: for a partly failed batch, every failed item as (item, error): the request's
            index in a transfer batch, the key in a store batch; empty otherwise.
    """

    def __init__(self, *args: object) -> None:
        super().__init__(*args)
        self.failures: list[tuple[Any, TidekvError]] = []

    @property
    def failed_keys(self) -> dict[Any, TidekvError]:
        """``failures`` as a dict (a store batch: key -> error)."""
        return dict(self.failures)


class ConfigError(TidekvError, ValueError):
    """A setting or argument is invalid; the message names it, its value and what is allowed."""


class ChannelError(TidekvError):
    """A control channel (``tidekv.channel``: store, weights, PD releases) failed: a peer refused
    a request as malformed or failed on it, or sent something unreadable."""


class ProtocolVersionError(ChannelError):
    """A peer speaks another protocol version; the message names both."""

    def __init__(self, message: str, *, peer: str | None = None) -> None:
        super().__init__(message)
        self.peer = peer


class AuthenticationError(ChannelError):
    """A peer refused our shared secret, or asked for one we do not have (any channel's handshake,
    or the transfer engine's)."""

    def __init__(self, message: str, *, peer: str | None = None) -> None:
        super().__init__(message)
        self.peer = peer


class TransferError(TidekvError):
    """A transfer request failed.

    Attributes:
        peer: name ("host:port") of the peer the request went to, when known.
        op: "READ" or "WRITE", when known.
        remote_addr, length: the byte range at the peer, when known.
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


class EngineClosedError(TransferError):
    """The engine (or store) was closed; create a new one. Requests of a batch that was still
    running when its engine closed fail with it too."""


class TransferProtocolVersionError(TransferError, ProtocolVersionError):
    """A transfer engine peer speaks another protocol version (its handshake or descriptor)."""


class TransferAuthenticationError(TransferError, AuthenticationError):
    """A transfer engine peer refused our shared secret, or asked for one we do not have."""


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


class DiskCorruptError(StoreError):
    """A record read from a store holder's disk failed its checksum or did not name the object asked
    for: the read is a miss, its bytes never returned."""


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
            ``tidekv.store.client.master_client``).
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


class RpcError(StoreError, ChannelError):
    """The master refused a request as malformed (a bug or a version skew), or answered garbage."""


class TensorFormatError(StoreError):
    """The object under a key is not a tensor this tidekv can read (not written by ``put_tensor``,
    a newer format version, or a shard set whose shards disagree); the message says which."""


class ChannelFullError(StoreError):
    """A ``TensorChannel`` put found no room within its bound (at once, or within its timeout);
    ``appended`` counts the tensors of the call that were appended before the refusal."""

    appended: int = 0


class TensorMismatchError(ConfigError):
    """``get_tensor_into`` was given a tensor of another dtype, shape or layout than the stored
    one (the message names both); when the sizes agreed, the bytes were read before the check."""


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
