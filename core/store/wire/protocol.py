"""Wire messages between store clients and the master: msgspec structs, msgpack-encoded.

On the wire: ``tidekv.channel`` (TCP or TLS, ``MAGIC``, the ``tidekv.auth`` handshake, then
length-prefixed msgpack frames, each request in an ``Envelope`` carrying ``PROTOCOL_VERSION``,
replies in order); the master answers a version mismatch with an error naming both versions (and
``Hello`` checks it once at connect). Batch
requests carry N keys and get N results in one round trip. Neighbours: ``master`` decodes and
dispatches these, ``rpc`` sends them from clients.
"""

from __future__ import annotations

import enum
from typing import Any, Union

import msgspec
from tidekv import channel
from tidekv.channel import FRAME_HEADER, ErrorKind, Reply, TypedReply, encode, frame, probe_header  # noqa: F401 - the store's wire names them
from tidekv.errors import (
    LimitExceededError,
    MasterNotReadyError,
    MasterUnavailableError,
    RpcError,
)

PROTOCOL_VERSION = 11
"""v2: the ``not_ready`` error kind (a recovering master, a standby), idempotent put_end, and the
replication stream between masters (``journal``). v3: ``MountSegment`` carries the holder's
incarnation and is answered with a ``MountResult``: a holder declared dead has its segment
suspended, not dropped, and gets its objects back by re-mounting (the journal's suspend/resume
ops). v4: every connection opens with the ``tidekv.auth`` handshake (and the ``auth`` error kind).
v5: ``ListKeys``. v6: tenants (``store.master.tenants``: the Greeting names one; ``Status.QUOTA`` and
``PutSlot.detail``), and re-replication (``Repairs``). v7: ``MountSegment.proof``
(``store.wire.mount_proof``) and the ``unproven`` error kind; ``PutStart.avoid``. v8: spare slots
(``PutStart.spare``, ``PutBind``, ``PutSlot.spare``): a small put in two round trips. v9: channels
(``ChannelPush``, ``ChannelTake``, ``ChannelAck``, ``ChannelInfo``, ``Status.FULL``), copy and move
tasks (``CreateTask``, ``QueryTask``). v10: the disk tier (``Spills``, ``GetResult.disk``). v11:
``ChannelPublish`` (end puts and append them to a channel in one request), and waits on the master
(``ChannelTake.wait_s``, ``ChannelPush.wait_s``): a take or a push answered when the channel
changes rather than polled."""

MAGIC = b"tkv\x07"
"""First bytes a client sends on a new connection (anything else is not a tidekv store client).
The handshake (``tidekv.auth``: Greeting, Challenge, Proof, each a frame) follows it, before
any request."""


class Status(enum.IntEnum):
    """Per-key outcome of a batch request."""

    OK = 0
    NOT_FOUND = 1
    EXISTS = 2  # immutable key already complete (or being written): put is a successful no-op
    OUT_OF_SPACE = 3
    LEASED = 4  # remove refused: a reader holds a lease
    STALE = 5  # put_end/put_revoke for a put the master already reclaimed
    INVALID = 6  # bad key or size
    QUOTA = 7  # put refused: beyond the tenant's quota even after evicting its own objects (``PutSlot.detail``)
    FULL = 8  # channel push refused: the queue would pass a bound the producer set


class Pin(enum.IntEnum):
    """How eviction treats an object."""

    NONE = 0
    SOFT = 1  # evicted only when nothing else can go
    HARD = 2  # never evicted; only remove() deletes it


class Location(msgspec.Struct, array_like=True, frozen=True):
    """One replica: bytes [addr, addr + length) of the transfer engine ``engine``'s segment."""

    segment: str
    engine: str
    addr: int
    length: int


# ---- requests -----------------------------------------------------------------------------


class Hello(msgspec.Struct, tag="hello", array_like=True):
    client_id: str
    protocol_version: int


class MountSegment(msgspec.Struct, tag="mount", array_like=True):
    client_id: str
    name: str
    engine: str
    base: int
    capacity: int
    incarnation: str = ""  # the holder's secret for its process's life (<= 128 chars): a segment
    # suspended after missed heartbeats comes back only to a mount quoting it; "" = never suspended
    proof: bytes = b""  # the engine's region proof of [base, +capacity) (``store.wire.mount_proof``)


class UnmountSegment(msgspec.Struct, tag="unmount", array_like=True):
    client_id: str
    name: str


class Heartbeat(msgspec.Struct, tag="heartbeat", array_like=True):
    client_id: str
    lease_expired: int = 0  # reads that outlived their lease since the last heartbeat
    segments: list[str] = []  # the segments this client has mounted (re-mounted if the master lacks one)


class Disconnect(msgspec.Struct, tag="disconnect", array_like=True):
    client_id: str


class PutStart(msgspec.Struct, tag="put_start", array_like=True):
    client_id: str
    keys: list[bytes]
    sizes: list[int]
    replicas: int = 1
    preferred_segment: str = ""
    pin: int = Pin.NONE
    upsert: bool = False
    avoid: list[str] = []  # engines to place no replica on (the writer's writes to them just failed)
    spare: bool = False  # one key: also reserve a ``Spare`` of its size for this writer's next put
    promote: list[int] = []  # per key, the version of its disk copy this holder brings back to memory
    # (``SpillWork.promote``): a slot in ``preferred_segment`` under that version's token, free bytes only


class PutBind(msgspec.Struct, tag="put_bind", array_like=True):
    """Publishes ``keys[0]`` (one key) as the bytes the writer already wrote into its spare
    ``token`` (of exactly ``size`` bytes): put_start and put_end in one round trip. Result: a
    ``PutSlot`` whose status is OK, EXISTS (a no-op put; the spare stays the writer's and comes
    back in ``spare``), STALE (the spare is gone: put as usual) or INVALID; with ``spare``, the
    writer's next spare comes back in ``PutSlot.spare``."""

    client_id: str
    keys: list[bytes]
    token: int
    size: int
    pin: int = Pin.NONE
    upsert: bool = False
    preferred_segment: str = ""
    spare: bool = False


class PutEnd(msgspec.Struct, tag="put_end", array_like=True):
    client_id: str
    keys: list[bytes]
    tokens: list[int]


class PutRevoke(msgspec.Struct, tag="put_revoke", array_like=True):
    client_id: str
    keys: list[bytes]
    tokens: list[int]  # 0: any put of the key this client has pending


class Get(msgspec.Struct, tag="get", array_like=True):
    keys: list[bytes]


class Exists(msgspec.Struct, tag="exists", array_like=True):
    keys: list[bytes]


class Locate(msgspec.Struct, tag="locate", array_like=True):
    keys: list[bytes]


class Remove(msgspec.Struct, tag="remove", array_like=True):
    keys: list[bytes]
    force: bool = False


class StatsRequest(msgspec.Struct, tag="stats", array_like=True):
    pass


class ListKeys(msgspec.Struct, tag="list_keys", array_like=True):
    """One page of the keys of complete objects, as a listing on this connection sees them.

    ``start``: begin a listing of the keys present now (ending this connection's previous one);
    else the next page of this connection's listing. A key removed meanwhile is skipped; one
    put meanwhile is not listed. Result: (keys, is_last)."""

    start: bool
    limit: int = 1024


class RepairResult(msgspec.Struct, array_like=True):
    """How a repair a holder was given ended: ``ok`` when the bytes are in place."""

    key: bytes
    token: int
    ok: bool


class Repairs(msgspec.Struct, tag="repairs", array_like=True):
    """A holder reports the repairs it finished and asks for new ones: copies of objects that
    lost replicas (a holder died or lapsed), to make into its own segment (``RepairTask``)."""

    client_id: str
    done: list[RepairResult] = []
    max_bytes: int = 64 << 20  # at most this many bytes of new tasks in the reply


DISK_BLOCK = 4096
"""A disk record is a header block then its data padded to whole blocks (``store.client.disk``)."""


def disk_footprint(size: int) -> int:
    """Bytes a disk record of ``size`` data bytes occupies (header and padding included)."""
    return DISK_BLOCK + (size + DISK_BLOCK - 1) // DISK_BLOCK * DISK_BLOCK


class DiskInfo(msgspec.Struct, array_like=True):
    """One disk a holder contributes (``store.master.disks``): ``name`` is the disk file's own
    id, so a restarted holder names it again; ``address`` its disk server (``store.client.disk_server``)."""

    name: str
    engine: str
    address: str
    capacity: int


class SpillDone(msgspec.Struct, array_like=True):
    """An object (version ``token``) a holder's disk holds: the record at ``offset`` of ``disk``."""

    key: bytes
    token: int
    disk: str
    offset: int
    size: int
    crc: int


class Spills(msgspec.Struct, tag="spills", array_like=True):
    """A holder with a disk tier reports and asks for work, about once a heartbeat: its disks
    (registered when the master lacks them), the spills it finished (``done``; with ``report``,
    everything its disks hold, sent after the master asked for it) and the keys whose spill
    failed, and asks for up to ``max_bytes`` of new spills (``SpillWork``)."""

    client_id: str
    disks: list[DiskInfo] = []
    done: list[SpillDone] = []
    failed: list[bytes] = []
    report: bool = False
    max_bytes: int = 64 << 20
    unmount: bool = False  # the holder leaves the tier: ``disks`` and every record on them are dropped


class ChannelPush(msgspec.Struct, tag="chan_push", array_like=True):
    """A producer appends complete objects to channel ``channel`` (``master.channels``), each only
    if the queue then holds at most ``max_items`` items and ``max_bytes`` bytes."""

    channel: str
    keys: list[bytes]
    max_items: int
    max_bytes: int
    wait_s: float = 0.0  # when the bounds refuse every key: wait up to this long for room (an ack)


class ChannelPublish(msgspec.Struct, tag="chan_publish", array_like=True):
    """A producer's ``PutEnd`` and ``ChannelPush`` in one request (one round trip less per put):
    the puts are ended, then the keys published are appended as the push would append them.
    Result per key: its end's Status, its append's Status (NOT_FOUND where the end failed) and seq."""

    client_id: str
    keys: list[bytes]
    tokens: list[int]
    channel: str
    max_items: int
    max_bytes: int


class ChannelTake(msgspec.Struct, tag="chan_take", array_like=True):
    """A consumer takes up to ``max_items`` ready items, hidden from other consumers for
    ``visibility_s``, having first acked ``acks`` (as ChannelAck would: one round trip for both).
    With ``wait_s``, a take that finds none is answered when items come, or empty after that long."""

    channel: str
    consumer: str
    max_items: int
    visibility_s: float
    acks: list[int] = []
    wait_s: float = 0.0


class ChannelAck(msgspec.Struct, tag="chan_ack", array_like=True):
    """A consumer is done with items: they and their objects leave the pool (their bytes at once
    when ``consumer`` holds them and nobody else leased them since)."""

    channel: str
    seqs: list[int]
    consumer: str = ""


class ChannelInfo(msgspec.Struct, tag="chan_info", array_like=True):
    channel: str


class CreateTask(msgspec.Struct, tag="create_task", array_like=True):
    """A copy (``kind`` 0: replicas of ``keys[0]`` on ``targets``) or move (1: from ``source`` to
    the one target) task (``master.tasks``); answered with its id."""

    kind: int
    keys: list[bytes]  # one key (a list, so that tenants' namespaces apply as to every request)
    targets: list[str]
    source: str = ""


class QueryTask(msgspec.Struct, tag="query_task", array_like=True):
    """A task's state, or None for an id this master does not know."""

    id: list[int]


class ChannelItem(msgspec.Struct, array_like=True):
    """One item a take hands out: its sequence number, its object and where its replicas are
    (under a read lease, as ``Get`` gives)."""

    seq: int
    key: bytes
    size: int
    locations: list[Location] = []


Body = Union[
    Hello,
    MountSegment,
    UnmountSegment,
    Heartbeat,
    Disconnect,
    PutStart,
    PutBind,
    PutEnd,
    PutRevoke,
    Get,
    Exists,
    Locate,
    Remove,
    StatsRequest,
    ListKeys,
    Repairs,
    ChannelPush,
    ChannelPublish,
    ChannelTake,
    ChannelAck,
    ChannelInfo,
    CreateTask,
    QueryTask,
    Spills,
]


Envelope = channel.Envelope[Body]
"""A request as the master decodes it."""


# ---- replies ------------------------------------------------------------------------------


SPARE_MARK = b"\0\xffspare:"
"""Opens the master's key of a ``Spare`` (after its tenant's prefix): no client's put may name such a key."""


class Spare(msgspec.Struct, array_like=True):
    """A slot the master reserved for its writer's next put of exactly ``size`` bytes (the same
    replicas and preferred segment): the writer writes there, then ``PutBind`` publishes it.
    A writer has at most one: the next one reserved replaces it (its bytes freed), and the master
    reclaims it once it is ``valid_s`` old, so a writer uses it only well within that, and asks
    for a new one only when no thread of it holds the old."""

    token: int
    size: int
    locations: list[Location]
    valid_s: float


class PutSlot(msgspec.Struct, array_like=True):
    """Where a writer must write one key (status OK), with the token put_end must quote."""

    status: int
    token: int = 0
    locations: list[Location] = []
    detail: str = ""  # why, for a refusal that needs more than its status (QUOTA)
    spare: Spare | None = None  # the first slot of a PutStart (or a PutBind) that asked for one


class RepairTask(msgspec.Struct, array_like=True):
    """Copy ``size`` bytes of object ``key`` (version ``token``) from one of ``sources`` to
    ``target``, an address in the holder's own segment; then report it (``Repairs.done``)."""

    key: bytes
    token: int
    size: int
    target: int
    sources: list[Location]
    deadline_s: float  # the master gives up on it this long after handing it out


class SpillTask(msgspec.Struct, array_like=True):
    """Write object ``key`` (version ``token``, ``size`` bytes at ``source`` in the holder's own
    segment) to its disk ``disk``; then report it (``Spills.done`` or ``failed``)."""

    key: bytes
    token: int
    size: int
    source: int
    disk: str


class DiskDrop(msgspec.Struct, array_like=True):
    """Free the record of ``key`` (version ``token``) at ``offset`` of ``disk``."""

    disk: str
    offset: int
    key: bytes
    token: int


class PromoteTask(msgspec.Struct, array_like=True):
    """Bring the disk-only object ``key`` (version ``token``, the record at ``offset`` of ``disk``)
    back to memory: a ``PutStart`` with ``promote``, the record read into the slot, ``PutEnd``."""

    key: bytes
    token: int
    size: int
    disk: str
    offset: int
    crc: int


class SpillWork(msgspec.Struct, array_like=True):
    """The master's answer to ``Spills``: records to free first, then spills to make; ``report``:
    the master does not know what some of the named disks hold, send it all (``Spills.report``);
    ``promote``: disk hits to bring back to this holder's memory."""

    tasks: list[SpillTask] = []
    drops: list[DiskDrop] = []
    report: bool = False
    promote: list[PromoteTask] = []


class DiskCopy(msgspec.Struct, array_like=True):
    """Where a disk-only object is: the record at ``offset`` of disk ``disk`` of the holder whose
    engine is ``engine`` and disk server ``address``; ``crc``: its data's crc32."""

    engine: str
    address: str
    disk: str
    offset: int
    token: int
    crc: int


class GetResult(msgspec.Struct, array_like=True):
    status: int
    size: int = 0
    locations: list[Location] = []
    disk: DiskCopy | None = None  # a disk-only object (``locations`` empty): read it through its holder


class MountOutcome(enum.IntEnum):
    """What a MountSegment did."""

    NEW = 0  # a fresh, empty segment (the master had no record of it, or had dropped it)
    KEPT = 1  # already mounted by this client: unchanged
    RESUMED = 2  # suspended after missed heartbeats, mounted again with the objects still on it


class MountResult(msgspec.Struct, array_like=True):
    """``restored``: objects readable again from the resumed segment; ``superseded``: objects it
    held that were re-put, upserted, removed or evicted while it was suspended (their bytes are
    free again in the segment)."""

    outcome: int
    restored: int = 0
    superseded: int = 0


RESULT_TYPES: dict[type, object] = {
    Get: tuple[float, list[GetResult]],  # lease_ttl_s, one result per key
    PutStart: list[PutSlot],
    PutBind: PutSlot,
    PutEnd: list[int],  # Status per key
    PutRevoke: list[int],
    Remove: list[int],
    Exists: list[bool],
    Locate: list[list[str]],  # engines holding each key's replicas
    Heartbeat: bool,  # need_remount
    ListKeys: tuple[list[bytes], bool],  # a page of keys, whether it is the last
    MountSegment: MountResult,
    Repairs: list[RepairTask],
    Spills: SpillWork,
    ChannelPush: tuple[list[int], list[int]],  # Status per key, seq per key (-1 where not appended)
    ChannelPublish: tuple[list[int], list[int], list[int]],  # end Status, append Status, seq: per key
    ChannelTake: tuple[float, list[ChannelItem]],  # (lease seconds, as Get), the items
    ChannelAck: list[int],  # Status per seq
}
"""The result type of each request's reply (others: any msgpack value)."""

def split_request(body: msgspec.Struct, limit: int) -> list[msgspec.Struct]:
    """A request naming more than ``limit`` keys as several of at most ``limit`` each: every list
    field as long as ``keys`` is cut alike (a PutStart's sizes, a PutEnd's tokens)."""
    keys = body.keys  # type: ignore[attr-defined]
    parallel = [f for f in body.__struct_fields__
                if isinstance(getattr(body, f), list) and len(getattr(body, f)) == len(keys)]
    return [msgspec.structs.replace(body, **{f: getattr(body, f)[i:i + limit] for f in parallel})
            for i in range(0, len(keys), limit)]


def merge_results(body: msgspec.Struct, results: list[Any]) -> Any:
    """The result of a request from those of its ``split_request`` parts, in key order."""
    if isinstance(body, Get):  # (lease ttl, per-key results): the shortest lease holds for all
        return min(r[0] for r in results), [x for r in results for x in r[1]]
    if isinstance(results[0], tuple):  # several lists, each per key (ChannelPush, ChannelPublish)
        return tuple([x for r in results for x in r[i]] for i in range(len(results[0])))
    return [x for r in results for x in r]


_request_decoder = msgspec.msgpack.Decoder(Envelope)
_typed_decoders: dict[type, msgspec.msgpack.Decoder[TypedReply[object]]] = {
    request: msgspec.msgpack.Decoder(TypedReply[result]) for request, result in RESULT_TYPES.items()  # type: ignore[valid-type]
}


def decode_request(data: bytes | memoryview) -> Envelope:
    """Raises msgspec.DecodeError / ValidationError on garbage."""
    return _request_decoder.decode(data)


def decode_reply(data: bytes | memoryview, request: type | None = None) -> Reply | TypedReply[object]:
    """The reply to a request of type ``request``, its result typed per RESULT_TYPES."""
    decoder = _typed_decoders.get(request) if request is not None else None
    return decoder.decode(data) if decoder is not None else channel.decode_reply(data)


def _refusal(kind: str, message: str, peer: str, leader: str) -> Exception | None:
    if kind == ErrorKind.NOT_READY:
        return MasterNotReadyError(message, leader=leader)
    if kind == ErrorKind.LIMIT:
        return LimitExceededError(message)
    if kind in (ErrorKind.MALFORMED, ErrorKind.INTERNAL):
        return RpcError(message)
    return None


SPEC = channel.Spec(
    label="master", magic=MAGIC, version=PROTOCOL_VERSION, body=Body, server_name="master",
    unavailable=lambda message, sent: MasterUnavailableError(message, is_request_sent=sent),
    failed=RpcError, results=RESULT_TYPES, refusal=_refusal, hint="is `tidekv master` running there?")
"""The store's control channel (``tidekv.channel``): clients and the master."""
