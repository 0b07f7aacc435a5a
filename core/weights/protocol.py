"""Control messages between a weights publisher and its subscribers (msgspec over ZeroMQ; with a
secret, inside ``tidekv.auth`` sealed messages).

A pull is two round trips: ``Describe`` (which version, what tensors, how big) so the receiver
can size its staging buffer, then ``Join`` (here is my staging buffer) which returns the
``Plan``: where to read each chunk from (the publisher, or a parent receiver in the fan-out
tree) and a lease that keeps the version alive. ``Leave`` ends the lease. The bytes themselves
never pass through this channel: they move by one-sided reads of the transfer engine.
"""

from __future__ import annotations

import msgspec

PROTOCOL_VERSION = 1


class TensorSpec(msgspec.Struct, array_like=True, frozen=True):
    """One tensor of a version: where it sits in the flat buffer."""

    name: str
    dtype: str  #: torch dtype name without the "torch." prefix, e.g. "bfloat16"
    shape: list[int]
    offset: int  #: bytes from the start of the buffer (header included)
    nbytes: int


class Describe(msgspec.Struct, tag="describe"):
    protocol: int
    version: int | None  #: None = the latest


class Manifest(msgspec.Struct, tag="manifest"):
    version: int
    tensors: list[TensorSpec]
    total_bytes: int  #: buffer size, header included


class Join(msgspec.Struct, tag="join"):
    protocol: int
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
    protocol: int


class VersionList(msgspec.Struct, tag="version_list"):
    versions: list[int]


class Ok(msgspec.Struct, tag="ok"):
    pass


class Error(msgspec.Struct, tag="error"):
    kind: str  #: "version_not_found" | "version_pending" | "protocol" | "bad_request" | "auth" | "auth_session"
    message: str


Request = Describe | Join | Leave | Versions
Reply = Manifest | Plan | VersionList | Ok | Error

encoder = msgspec.msgpack.Encoder()
request_decoder = msgspec.msgpack.Decoder(Request)
reply_decoder = msgspec.msgpack.Decoder(Reply)
