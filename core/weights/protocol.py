"""Control messages between a weights publisher and its subscribers, on ``tidekv.channel``.

A pull is two round trips: ``Describe`` (which version, what tensors, how big) so the receiver
can size its staging buffer, then ``Join`` (here is my staging buffer) which returns the
``Plan``: where to read each chunk from (the publisher, or a parent receiver in the fan-out
tree) and a lease that keeps the version alive. ``Leave`` ends the lease. The bytes themselves
never pass through this channel: they move by one-sided reads of the transfer engine.
"""

from __future__ import annotations

import msgspec
from tidekv import channel
from tidekv.errors import (
    ChannelError,
    PublisherUnavailableError,
    VersionNotFoundError,
    VersionPendingError,
)

PROTOCOL_VERSION = 2
"""v2: on ``tidekv.channel`` (was ZeroMQ with sealed messages); refusals as ``channel.ErrorKind``."""
MAGIC = b"tkw\x02"
"""First bytes a subscriber sends on a new connection."""


class TensorSpec(msgspec.Struct, array_like=True, frozen=True):
    """One tensor of a version: where it sits in the flat buffer."""

    name: str
    dtype: str  #: torch dtype name without the "torch." prefix, e.g. "bfloat16"
    shape: list[int]
    offset: int  #: bytes from the start of the buffer (header included)
    nbytes: int


class Describe(msgspec.Struct, tag="describe"):
    version: int | None  #: None = the latest


class Manifest(msgspec.Struct, tag="manifest"):
    version: int
    tensors: list[TensorSpec]
    total_bytes: int  #: buffer size, header included


class Join(msgspec.Struct, tag="join"):
    version: int
    receiver: str  #: the receiver's transfer engine name
    staging_addr: int  #: where its copy (header first) lives, for its children to read


class Plan(msgspec.Struct, tag="plan"):
    lease: int
    chunk_bytes: int
    window: int
    stall_timeout_s: float
    publisher: str  #: the publisher's transfer engine name
    snapshot_addr: int  #: the version's header at the publisher (a snapshot's data follows it)
    sources: list[int]  #: where each tensor lives at the publisher when served in place; [] = in the snapshot
    parent: str | None  #: the receiver to read chunks from first; None = the publisher
    parent_addr: int


class Leave(msgspec.Struct, tag="leave"):
    lease: int
    ok: bool


class Versions(msgspec.Struct, tag="versions"):
    pass


Request = Describe | Join | Leave | Versions


def _refusal(kind: str, message: str, peer: str, leader: str) -> Exception | None:
    if kind == channel.ErrorKind.PENDING:
        return VersionPendingError(message)
    if kind == channel.ErrorKind.NOT_FOUND:
        return VersionNotFoundError(message)
    return None


SPEC = channel.Spec(
    label="weights", magic=MAGIC, version=PROTOCOL_VERSION, body=Request, server_name="weights publisher",
    unavailable=lambda message, sent: PublisherUnavailableError(message), failed=ChannelError,
    results={Describe: Manifest, Join: Plan, Versions: list[int], Leave: None}, refusal=_refusal)
"""The weights control channel: a subscriber asks, the publisher answers (Versions: the list of versions)."""
