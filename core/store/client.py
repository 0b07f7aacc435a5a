"""Store: the client of the tidekv KV-cache pool.

A Store contributes a segment of its own memory to the pool (``segment_size``; 0 = pure client)
and puts and gets objects by key. The master only says *where*: this client moves the bytes
itself through its TransferEngine (same-host peers: shared memory; others: tcp).

Put is two-phase: put_start (the master places replicas) -> write every replica -> put_end
(the object becomes visible). A failed write revokes the put, so readers never see partial
objects. Get asks for locations and a read lease, reads one replica (the next one if a holder is
gone), and refuses the bytes if the lease ran out before the read finished. The zero-copy calls
take a buffer or a list of buffers (parts): the object is then the parts' concatenation, written
by gathering them and read by scattering into them (one transfer request per part and replica).

Neighbours: ``membership`` (the segment, mounted and heartbeated; re-mounts after the master lost
this client), ``master_client`` (the master, followed across failovers), ``staging`` (scratch
memory for bytes objects), ``tidekv.transfer`` (the data path). Thread-safe.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any


from tidekv.config import MasterAddress, StoreConfig, TlsConfig, TransferConfig
from tidekv.errors import (
    ConfigError,
    LeaseExpiredError,
    MasterUnavailableError,
    ObjectLeasedError,
    ObjectNotFoundError,
    OutOfSpaceError,
    PeerUnavailableError,
    SegmentNotRegisteredError,
    StoreError,
    TidekvError,
    TransferError,
    TransferTimeoutError,
)
from tidekv.store import protocol as p
from tidekv.store import tenants
from tidekv.store.protocol import Pin, Status
from tidekv.store.keys import Buffer, Key, buffer_span, key_bytes, show_key
from tidekv.store.master_client import MasterClient
from tidekv.store.membership import Member
from tidekv.store.staging import StagingArea
from tidekv.transfer.batch import TransferOp, TransferRequest, TransferState
from tidekv.transfer.engine import TransferEngine
from tidekv.transfer.region import Region

logger = logging.getLogger(__name__)

Parts = Sequence[Buffer]
"""A list of buffers whose concatenation is one object (the zero-copy calls take it for a buffer)."""

Span = list[tuple[int, int]]
"""One object's memory as (address, length) pieces, in order."""

Pieces = list[tuple[int, int, int]]
"""Memory to read an object into, as (address, length, offset in the object) pieces."""


@dataclasses.dataclass(frozen=True, slots=True)
class ObjectInfo:
    """What the master knows of one complete object (``Store.lookup_many``)."""

    size_bytes: int
    """The object's size."""
    locations: tuple[p.Location, ...]
    """Its replicas: segment, holder engine, address and length of each."""


def _span(buffer: Buffer | Parts) -> Span:
    """A buffer, or a list of them (parts), as (address, length) pieces."""
    if isinstance(buffer, list):
        return [buffer_span(part) for part in buffer]
    return [buffer_span(buffer)]


def _in_order(span: Span) -> Pieces:
    """A span as pieces: each one where the previous one ended in the object."""
    out: Pieces = []
    offset = 0
    for address, length in span:
        out.append((address, length, offset))
        offset += length
    return out


class Store:
    """A connection to a tidekv master plus this process's share of the pool.

    Use ``Store.connect(...)``; close with ``close()`` or a ``with`` block.
    """

    def __init__(
        self,
        master: str | MasterAddress,
        config: StoreConfig,
        engine: TransferEngine,
        owns_engine: bool,
        tls: TlsConfig | None = None,
        tenant: str | None = None,
    ) -> None:
        self.config = config
        self.client_id = uuid.uuid4().hex[:16]
        self.engine = engine
        self._owns_engine = owns_engine
        self._rpc = MasterClient(master, self.client_id, timeout_s=config.rpc_timeout_s,
                                 failover_timeout_s=config.failover_timeout_s, busy_poll_us=config.rpc_busy_poll_us,
                                 register=True, secret=engine.config.secret, tls=tls, tenant=tenant)
        self._closed = threading.Event()
        self._member: Member | None = None
        self._staging: StagingArea | None = None
        try:
            # Memory first: the master declares a client dead after client_ttl_s of silence, and
            # a large segment can take longer than that to fault in.
            self._member = Member(self._rpc, engine, self.client_id, config)
            self._staging = StagingArea(engine, config.staging_size_bytes)
            self._rpc.connect()
            self._member.mount()
        except BaseException:
            self._rpc.close()
            if owns_engine:
                engine.close()
            else:
                self._release_memory()
            raise
        self._member.start()

    @property
    def segment_name(self) -> str:
        """This client's segment in the pool ("" for a pure client): ``preferred_segment`` names it."""
        return self._member.segment_name if self._member is not None else ""

    @classmethod
    def connect(
        cls,
        master: str | MasterAddress = "127.0.0.1:50051",
        segment_size: int | None = None,
        *,
        config: StoreConfig | None = None,
        engine: TransferEngine | None = None,
        transfer_config: TransferConfig | None = None,
        host: str = "127.0.0.1",
        tls: TlsConfig | None = None,
        tenant: str | None = None,
    ) -> Store:
        """Connects to the master at ``master`` and mounts a segment.

        Args:
            master: a lone master's "host:port", or "etcd://H:P[,H:P...]/CLUSTER" for the
                leader of a cluster of masters (followed across failovers).
            segment_size: bytes of this process's memory to contribute (0: pure client);
                overrides ``config.segment_size_bytes``.
            config: client settings (default ``StoreConfig.from_env()``).
            engine: an existing TransferEngine to share (default: a new one on ``host``).
            transfer_config: settings for the new engine.
            host: address the new engine listens on (peers must reach it there).
            tls: how to reach the master over TLS (default ``TlsConfig.from_env()``: plain TCP
                unless ``TIDEKV_TLS_ENABLE`` is set).
            tenant: the tenant to act for on a master with tenants (``tidekv.store.tenants``;
                its secret is the engine's, ``TIDEKV_SECRET``); default ``TIDEKV_TENANT``,
                "" for none.

        Raises:
            MasterUnavailableError: the master does not answer (or TLS with it failed).
            ProtocolVersionError: the master speaks another protocol version.
            AuthenticationError: the master and this store's engine do not share the secret.
        """
        cfg = config if config is not None else StoreConfig.from_env()
        if segment_size is not None:
            cfg = dataclasses.replace(cfg, segment_size_bytes=segment_size)
        owns = engine is None
        tls_config = tls if tls is not None else TlsConfig.from_env()
        tenant = tenants.tenant_from_env() if tenant is None else tenant and tenants.check_name(tenant)
        eng = engine if engine is not None else TransferEngine(host=host, config=transfer_config)
        return cls(master, cfg, eng, owns, tls_config, tenant)

    # ---- bytes API ----------------------------------------------------------------------

    def put(self, key: Key, data: bytes | bytearray | memoryview, *, pin: Pin = Pin.NONE, replicas: int | None = None,
            preferred_segment: str | None = None) -> None:
        """Stores ``data`` under ``key``. Putting an existing key is a successful no-op.

        ``preferred_segment`` names the segment to place the first replica in when it has room
        (a Store's ``segment_name``; default: this client's own when ``prefer_local_segment``).

        Raises:
            OutOfSpaceError: no room even after eviction.
            TransferError: the bytes could not be written (the put was revoked).
            MasterUnavailableError: the master does not answer.
        """
        self.put_many([key], [data], pin=pin, replicas=replicas, preferred_segment=preferred_segment)

    def upsert(self, key: Key, data: bytes | bytearray | memoryview, *, pin: Pin = Pin.NONE,
               replicas: int | None = None, preferred_segment: str | None = None) -> None:
        """Stores ``data`` under ``key``, replacing any existing value atomically."""
        self.put_many([key], [data], pin=pin, replicas=replicas, upsert=True, preferred_segment=preferred_segment)

    def put_many(
        self,
        keys: Sequence[Key],
        values: Sequence[bytes | bytearray | memoryview],
        *,
        pin: Pin = Pin.NONE,
        replicas: int | None = None,
        upsert: bool = False,
        preferred_segment: str | None = None,
    ) -> None:
        """Stores several objects in one master round trip per phase.

        Raises:
            StoreError or TransferError (or a subclass): some keys failed; ``err.failed_keys``
                maps each failed key (as bytes) to its error, the other keys were stored.
        """
        if len(keys) != len(values):
            raise ConfigError(f"put_many got {len(keys)} keys but {len(values)} values")
        views = [memoryview(v).cast("B") for v in values]
        total = sum(v.nbytes for v in views)
        with self._staging.borrow(max(total, 1)) as area:
            spans, offset = [], 0
            for v in views:
                area.view()[offset : offset + v.nbytes] = v
                spans.append([(area.address + offset, v.nbytes)])
                offset += v.nbytes
            self._put_spans([key_bytes(k) for k in keys], spans, pin, replicas, upsert, preferred_segment)

    def get(self, key: Key) -> bytes:
        """Returns the bytes stored under ``key``.

        Raises:
            ObjectNotFoundError: no complete object under ``key``.
            LeaseExpiredError: the read outlived its lease (retry).
            TransferError: no replica could be read.
        """
        out = self.get_many([key])[0]
        if out is None:
            raise ObjectNotFoundError(f"no object under key {show_key(key)}", key=key)
        return out

    def get_many(self, keys: Sequence[Key]) -> list[bytes | None]:
        """Returns each key's bytes, or None for keys that do not exist."""
        bkeys = [key_bytes(k) for k in keys]
        lease_deadline, results = self._locate(bkeys)
        total = sum(r.size for r in results if r.status == Status.OK)
        out: list[bytes | None] = [None] * len(bkeys)
        with self._staging.borrow(max(total, 1)) as area:
            spans: list[Pieces | None] = []
            offset = 0
            for r in results:
                spans.append([(area.address + offset, r.size, 0)] if r.status == Status.OK else None)
                offset += r.size if r.status == Status.OK else 0
            self._read(bkeys, results, spans, lease_deadline)
            view = area.view()
            for i, span in enumerate(spans):
                if span is not None:
                    start = span[0][0] - area.address
                    out[i] = bytes(view[start : start + span[0][1]])
        return out

    # ---- zero-copy API ------------------------------------------------------------------

    def register(self, buffer: Any) -> Region:
        """Registers memory for put_from/get_into (see TransferEngine.register)."""
        return self.engine.register(buffer)

    def unregister(self, region: Region) -> None:
        self.engine.unregister(region)

    def put_from(self, key: Key, buffer: Buffer | Parts, *, pin: Pin = Pin.NONE, replicas: int | None = None,
                 preferred_segment: str | None = None) -> None:
        """Stores the bytes of a registered buffer, or the concatenation of a list of them (no
        copy on this side)."""
        self._put_spans([key_bytes(key)], [_span(buffer)], pin, replicas, False, preferred_segment)

    def put_many_from(self, keys: Sequence[Key], buffers: Sequence[Buffer | Parts], *, pin: Pin = Pin.NONE,
                      replicas: int | None = None, upsert: bool = False, preferred_segment: str | None = None) -> None:
        """Batch put_from: one master round trip per phase, one transfer batch. Failures as for
        put_many (``err.failed_keys``)."""
        if len(keys) != len(buffers):
            raise ConfigError(f"put_many_from got {len(keys)} keys but {len(buffers)} buffers")
        self._put_spans([key_bytes(k) for k in keys], [_span(b) for b in buffers], pin, replicas, upsert,
                        preferred_segment)

    def get_into(self, key: Key, buffer: Buffer | Parts) -> int:
        """Reads the object into a registered buffer (or a list of them, filled in order);
        returns its size.

        Raises:
            ObjectNotFoundError, LeaseExpiredError, TransferError: as for get().
            ConfigError: the buffer is smaller than the object.
        """
        n = self.get_many_into([key], [buffer])[0]
        if n is None:
            raise ObjectNotFoundError(f"no object under key {show_key(key)}", key=key)
        return n

    def get_many_into(self, keys: Sequence[Key], buffers: Sequence[Buffer | Parts]) -> list[int | None]:
        """Batch get_into; returns each object's size, or None for keys that do not exist.

        Raises:
            ConfigError: some buffers are smaller than their objects (nothing was read;
                ``err.failed_keys`` names those keys).
            LeaseExpiredError, StoreError or TransferError: as for get(); ``err.failed_keys``
                names the keys whose bytes were not read.
        """
        if len(keys) != len(buffers):
            raise ConfigError(f"get_many_into got {len(keys)} keys but {len(buffers)} buffers")
        bkeys = [key_bytes(k) for k in keys]
        lease_deadline, results = self._locate(bkeys)
        spans: list[Pieces | None] = []
        too_small: dict[bytes, StoreError | TransferError] = {}
        for key, r, buf in zip(bkeys, results, buffers):
            if r.status != Status.OK:
                spans.append(None)
                continue
            parts = _span(buf)
            if len(parts) == 1:  # one buffer: no need to cut it into pieces
                address, length = parts[0]
                spans.append([(address, min(length, r.size), 0)])
            else:
                length = sum(n for _, n in parts)
                spans.append(_in_order(_trim(parts, r.size)))
            if length < r.size:
                too_small[key] = ConfigError(  # type: ignore[assignment]
                    f"buffer of {length} bytes is too small for object {show_key(key)} of {r.size} bytes")
        if too_small:
            raise self._batch_error("get", too_small)
        self._read(bkeys, results, spans, lease_deadline)
        return [r.size if r.status == Status.OK else None for r in results]

    def get_ranges_into(self, keys: Sequence[Key], ranges: Sequence[Sequence[tuple[int, Buffer]]]) -> list[int | None]:
        """Reads byte ranges of objects into registered buffers, in one lookup and one transfer
        batch: for key ``i``, each ``(offset, buffer)`` of ``ranges[i]`` receives the object's
        bytes ``[offset, offset + len(buffer))``. Returns each object's size, or None for keys
        that do not exist.

        Raises:
            ConfigError: some ranges pass their object's end (nothing was read;
                ``err.failed_keys`` names those keys).
            LeaseExpiredError, StoreError or TransferError: as for get_many_into.
        """
        if len(keys) != len(ranges):
            raise ConfigError(f"get_ranges_into got {len(keys)} keys but {len(ranges)} lists of ranges")
        bkeys = [key_bytes(k) for k in keys]
        lease_deadline, results = self._locate(bkeys)
        pieces: list[Pieces | None] = []
        outside: dict[bytes, StoreError | TransferError] = {}
        for key, r, key_ranges in zip(bkeys, results, ranges):
            if r.status != Status.OK:
                pieces.append(None)
                continue
            mine: Pieces = []
            for offset, buf in key_ranges:
                address, length = buffer_span(buf)
                if offset < 0 or offset + length > r.size:
                    outside[key] = ConfigError(  # type: ignore[assignment]
                        f"range [{offset}, +{length}) is outside object {show_key(key)} of {r.size} bytes")
                elif length > 0:
                    mine.append((address, length, offset))
            pieces.append(mine)
        if outside:
            raise self._batch_error("get", outside)
        self._read(bkeys, results, pieces, lease_deadline)
        return [r.size if r.status == Status.OK else None for r in results]

    # ---- metadata API -------------------------------------------------------------------

    def exists(self, key: Key) -> bool:
        return self.exists_many([key])[0]

    def exists_many(self, keys: Sequence[Key]) -> list[bool]:
        """Whether each key holds a complete object (one round trip; grants no lease)."""
        return self._rpc.exists_many(keys)

    def exists_leased(self, keys: Sequence[Key]) -> list[bool]:
        """Whether each key holds a complete object, taking a read lease on each that does (see
        ``lookup_many``): what a load planned on the answer needs."""
        return self._rpc.exists_leased(keys)

    def lookup_many(self, keys: Sequence[Key]) -> list[ObjectInfo | None]:
        """Each key's size and replicas (None: no complete object), in one round trip. Unlike
        exists_many this takes a read lease on every object found, as get does: for the master's
        lease_ttl_s, remove() without force and eviction leave them alone."""
        _, results = self._locate([key_bytes(k) for k in keys])
        return [ObjectInfo(r.size, tuple(r.locations)) if r.status == Status.OK else None for r in results]

    def locate_many(self, keys: Sequence[Key]) -> list[list[str]]:
        """Names of the transfer engines whose segments hold each key's replicas (empty: no
        complete object); one round trip, grants no lease."""
        return self._rpc.locate_many(keys)

    def remove(self, key: Key, *, force: bool = False) -> None:
        """Deletes an object.

        Raises:
            ObjectNotFoundError: no such object.
            ObjectLeasedError: a reader holds a lease (``force=True`` removes anyway).
        """
        status = self.remove_many([key], force=force)[0]
        if status == Status.NOT_FOUND:
            raise ObjectNotFoundError(f"no object under key {show_key(key)}", key=key)
        if status == Status.LEASED:
            raise ObjectLeasedError(f"object {show_key(key)} is leased by a reader; retry later or force=True", key=key)

    def remove_many(self, keys: Sequence[Key], *, force: bool = False) -> list[Status]:
        """Deletes objects; returns per key Status.OK, NOT_FOUND or LEASED."""
        return [Status(s) for s in self._rpc.call(p.Remove([key_bytes(k) for k in keys], force))]

    def keys(self, page_keys: int = 1024) -> Iterator[bytes]:
        """Every key of a complete object, as the master held them when the listing began (a key
        removed meanwhile is skipped, one put meanwhile is not listed), in pages of
        ``page_keys`` (at most the master's max_batch_keys). One listing at a time per Store:
        a second ``keys()`` started before the first is exhausted ends the first.

        Raises:
            MasterUnavailableError: the master did not answer.
            ConfigError: the listing was lost (the connection to the master changed, e.g. after a
                failover, or another listing of this Store started): list again.
        """
        start = True
        while True:
            page, is_last = self._rpc.call(p.ListKeys(start, page_keys))
            start = False
            yield from page
            if is_last:
                return

    def stats(self) -> dict[str, Any]:
        """The master's view of the pool (keys, segments, usage, evictions) and this engine's counters."""
        out = dict(self._rpc.call(p.StatsRequest()))
        out["transfer"] = self.engine.stats()
        return out

    # ---- lifecycle ----------------------------------------------------------------------

    def close(self) -> None:
        """Unmounts this client's segment (its objects leave the pool) and disconnects."""
        if self._closed.is_set():
            return
        self._closed.set()
        assert self._member is not None
        self._member.stop()
        try:
            self._rpc.call(p.Disconnect(self.client_id), timeout_s=min(self.config.rpc_timeout_s, 2.0),
                           failover_timeout_s=0)
        except StoreError as exc:
            logger.warning("store client %s: master not told of disconnect: %s", self.client_id, exc)
        self._rpc.close()
        if self._owns_engine:
            self.engine.close()
        else:
            self._release_memory()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals ----------------------------------------------------------------------

    def _release_memory(self) -> None:
        if self._staging is not None:
            self._staging.close()
            self._staging = None
        if self._member is not None:
            self._member.release()

    def _put_spans(self, keys: list[bytes], spans: list[Span], pin: Pin, replicas: int | None, upsert: bool,
                   preferred_segment: str | None = None, avoid: tuple[str, ...] = ()) -> None:
        """Puts each key's span. Keys whose writes failed because a holder is gone (dead,
        stalled, restarted: the master has not noticed yet) are revoked and put once more with
        those holders' engines avoided, so a holder's death costs a retry, not a failed put."""
        copies = self.config.replicas if replicas is None else replicas
        if isinstance(copies, bool) or not isinstance(copies, int) or not 1 <= copies <= 16:
            raise ConfigError(f"replicas={replicas!r} is out of range; allowed 1..16")
        sizes = [sum(n for _, n in span) for span in spans]
        for key, n in zip(keys, sizes):
            if n <= 0:
                raise ConfigError(f"object {show_key(key)} is empty; tidekv stores objects of at least 1 byte")
        if preferred_segment is None:
            preferred_segment = self.segment_name if self.config.prefer_local_segment else ""
        request = p.PutStart(self.client_id, keys, sizes, copies, preferred_segment, int(pin), upsert, list(avoid))
        try:
            slots: list[p.PutSlot] = self._rpc.call(request)
        except MasterUnavailableError as exc:
            if exc.is_request_sent:
                self._forget_unanswered_puts(keys)
            raise
        failures: dict[bytes, StoreError | TransferError] = {}
        writes: list[TransferRequest] = []
        owners: list[int] = []
        for i, (key, slot, span, n) in enumerate(zip(keys, slots, spans, sizes)):
            if slot.status == Status.OUT_OF_SPACE:
                failures[key] = OutOfSpaceError(f"no room for object {show_key(key)} ({n} bytes) even after eviction", key=key)
            elif slot.status == Status.QUOTA:
                failures[key] = OutOfSpaceError(f"object {show_key(key)} ({n} bytes) is beyond this tenant's quota: "
                                                f"{slot.detail}", key=key)
            elif slot.status == Status.INVALID:
                failures[key] = ConfigError(f"master refused key {show_key(key)} (empty or too long) or size {n}")  # type: ignore[assignment]
            elif slot.status == Status.OK:
                for loc in slot.locations:
                    offset = 0
                    for address, length in span:
                        writes.append(TransferRequest(TransferOp.WRITE, address, length, loc.engine, loc.addr + offset))
                        owners.append(i)
                        offset += length
        failed_writes: set[int] = set()
        if writes:
            failed_writes = self._run(writes, owners, keys, failures)
        ended = [(k, s.token) for i, (k, s) in enumerate(zip(keys, slots)) if s.status == Status.OK and i not in failed_writes]
        revoked = [(k, s.token) for i, (k, s) in enumerate(zip(keys, slots)) if s.status == Status.OK and i in failed_writes]
        if revoked:
            self._rpc.call(p.PutRevoke(self.client_id, [k for k, _ in revoked], [t for _, t in revoked]))
        again = [] if avoid else [i for i in sorted(failed_writes) if self._holder_gone(failures[keys[i]])]
        if again:
            lost = tuple(sorted({str(getattr(failures[keys[i]], "peer")) for i in again}))
            first = {keys[i]: failures.pop(keys[i]) for i in again}
            logger.info("store client %s: holder(s) %s unreachable; putting %d object(s) again elsewhere",
                        self.client_id, ", ".join(lost), len(again))
            try:
                self._put_spans([keys[i] for i in again], [spans[i] for i in again], pin, replicas, upsert,
                                preferred_segment, lost)
            except (StoreError, TransferError) as exc:
                # No room without those holders: the reason is the holder that is gone.
                failures.update({k: first[k] if isinstance(e, OutOfSpaceError) else e
                                 for k, e in (getattr(exc, "failed_keys", None) or {keys[again[0]]: exc}).items()})
        if ended:
            statuses = self._rpc.call(p.PutEnd(self.client_id, [k for k, _ in ended], [t for _, t in ended]))
            for (key, _), status in zip(ended, statuses):
                if status != Status.OK:
                    failures[key] = StoreError(
                        f"put of {show_key(key)} was reclaimed by the master before it ended (too slow, or a replica "
                        "holder died); retry", key=key)
        if failures:
            raise self._batch_error("put", failures)

    def _holder_gone(self, error: StoreError | TransferError) -> bool:
        """Whether a write failed because its holder (not this process) is gone or restarted."""
        return isinstance(error, _HOLDER_GONE) and bool(error.peer) and error.peer != self.engine.name

    def _forget_unanswered_puts(self, keys: list[bytes]) -> None:
        """A put_start got no answer but may have been applied: its puts would stay pending (and
        make others' puts of the keys no-ops) until reclaimed. Revoke them, best effort."""
        try:
            self._rpc.call(p.PutRevoke(self.client_id, keys, [0] * len(keys)))
        except StoreError as exc:
            logger.warning("store client %s: could not revoke %d put(s) whose start went unanswered (%s); the "
                           "master reclaims them after put_timeout_s", self.client_id, len(keys), exc)

    def _locate(self, keys: list[bytes]) -> tuple[float, list[p.GetResult]]:
        started = time.monotonic()
        lease_s, results = self._rpc.call(p.Get(keys))
        # lease_ttl_s = 0 on the master means "no leases": nothing to check the read against.
        deadline = started + lease_s if lease_s > 0 else float("inf")
        return deadline, results

    def _read(self, keys: list[bytes], results: list[p.GetResult], spans: list[Pieces | None],
              lease_deadline: float) -> None:
        """Reads every found object into its pieces, falling back to other replicas on failure."""
        pending = [i for i, s in enumerate(spans) if s is not None]
        attempt = 0
        failures: dict[bytes, StoreError | TransferError] = {}
        while pending:
            reads, owners, next_pending = [], [], []
            for i in pending:
                locs = self._ordered(results[i].locations)
                if attempt >= len(locs):
                    continue
                loc = locs[attempt]
                for address, length, offset in spans[i]:  # type: ignore[union-attr]
                    reads.append(TransferRequest(TransferOp.READ, address, length, loc.engine, loc.addr + offset))
                    owners.append(i)
            if not reads:
                break
            round_failures: dict[bytes, StoreError | TransferError] = {}
            failed = self._run(reads, owners, keys, round_failures)
            for i in sorted(failed):
                if attempt + 1 < len(results[i].locations):
                    next_pending.append(i)
                else:
                    failures[keys[i]] = round_failures[keys[i]]
            pending, attempt = next_pending, attempt + 1
        if time.monotonic() > lease_deadline:
            assert self._member is not None
            self._member.lease_expired += 1
            expired = LeaseExpiredError(
                f"read of {len(keys)} object(s) outlived its lease; the bytes may have been replaced - retry",
                key=keys[0] if len(keys) == 1 else None,
            )
            expired.failed_keys = {keys[i]: expired for i, s in enumerate(spans) if s is not None}  # type: ignore[attr-defined]
            raise expired
        if failures:
            raise self._batch_error("get", failures)

    def _ordered(self, locations: list[p.Location]) -> list[p.Location]:
        if len(locations) < 2:
            return locations
        own = self.engine.name
        return sorted(locations, key=lambda loc: loc.engine != own)

    def _run(self, requests: list[TransferRequest], owners: list[int], keys: list[bytes],
             failures: dict[bytes, StoreError | TransferError]) -> set[int]:
        """Runs one transfer batch; returns indices (into keys) whose requests failed."""
        try:
            handle = self.engine.transfer(requests)
        except (PeerUnavailableError, TransferError) as exc:
            # A peer could not even be reached for the handshake: every request to it fails.
            for i in owners:
                failures[keys[i]] = exc
            return set(owners)
        try:
            # No deadline here: the waiting thread then runs the batch's work itself (no hand-off
            # to a worker), and a stalled peer still fails after TransferConfig.io_timeout_s.
            handle.wait()
            return set()
        except TransferError:
            failed: set[int] = set()
            for owner, status in zip(owners, handle.statuses()):
                if status.state == TransferState.FAILED:
                    failed.add(owner)
                    assert status.error is not None
                    failures.setdefault(keys[owner], status.error)
            return failed

    @staticmethod
    def _batch_error(op: str, failures: dict[bytes, StoreError | TransferError]) -> Exception:
        first_key, first = next(iter(failures.items()))
        if len(failures) == 1:
            first.failed_keys = failures  # type: ignore[union-attr]
            return first
        err = type(first)(f"{op} failed for {len(failures)} keys; first {show_key(first_key)}: {first}")
        err.failed_keys = failures  # type: ignore[union-attr]
        return err


_HOLDER_GONE = (PeerUnavailableError, TransferTimeoutError, SegmentNotRegisteredError)
"""Write failures that mean the holder is gone (or restarted) rather than that the put is wrong."""


def _trim(parts: Span, size: int) -> Span:
    """The first ``size`` bytes of ``parts`` (which hold at least that many)."""
    out: Span = []
    for address, length in parts:
        if size <= 0:
            break
        out.append((address, min(length, size)))
        size -= length
    return out
