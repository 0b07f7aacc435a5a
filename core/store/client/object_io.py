"""Moving objects' bytes where the master says: the store client's put and read protocol.

Put is two-phase: put_start (the master places replicas) -> write every replica -> put_end
(the object becomes visible). A failed write revokes the put, so readers never see partial
objects; keys whose writes failed because a holder is gone are put once more with that holder
avoided. A put of one small object also asks for a spare (``protocol.Spare``): a slot reserved
for the next put of the same size, which then writes first and publishes with one request
(``PutBind``): two round trips instead of three, on the path every small put of a pool takes. A read asks for locations and a read lease, reads one replica (the next one if a holder
is gone), and refuses the bytes if the lease ran out before the read finished.

Memory is given as spans (an object's (address, length) pieces, in order) for writes and as
pieces (address, length, offset in the object) for reads; ``Store`` shapes its callers' buffers
into them. Neighbours: ``client`` (the API), ``master_client`` (the master),
``tidekv.transfer`` (the data path).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tidekv.errors import (
    ConfigError,
    LeaseExpiredError,
    MasterUnavailableError,
    OutOfSpaceError,
    PeerUnavailableError,
    SegmentNotRegisteredError,
    StoreError,
    TransferError,
    TransferTimeoutError,
)
from tidekv.hostaddr import HOST_VARIABLE, is_loopback
from tidekv.store.client.master_client import MasterClient
from tidekv.store.wire import protocol as p
from tidekv.store.wire.keys import Buffer, buffer_span, show_key
from tidekv.store.wire.protocol import Pin, Status
from tidekv.transfer.batch import TransferOp, TransferRequest, TransferState
from tidekv.transfer.engine import TransferEngine

if TYPE_CHECKING:
    from tidekv.store.client.disk_reads import DiskReader
from tidekv.values import parse_host_port

logger = logging.getLogger(__name__)

Parts = Sequence[Buffer]
"""A list of buffers whose concatenation is one object (the zero-copy calls take it for a buffer)."""

Span = list[tuple[int, int]]
"""One object's memory as (address, length) pieces, in order."""

Pieces = list[tuple[int, int, int]]
"""Memory to read an object into, as (address, length, offset in the object) pieces."""

Failures = dict[bytes, StoreError | TransferError]

Publish = Callable[[list[bytes], list[int]], list[int]]
"""Publishes written puts, given their keys and tokens; returns a ``Status`` per key as ``PutEnd``
answers (a channel's producer sends ``ChannelPublish`` instead, which also appends them)."""


def span_of(buffer: Buffer | Parts) -> Span:
    """A buffer, or a list of them (parts), as (address, length) pieces."""
    if isinstance(buffer, list):
        return [buffer_span(part) for part in buffer]
    return [buffer_span(buffer)]


def in_order(span: Span) -> Pieces:
    """A span as pieces: each one where the previous one ended in the object."""
    out: Pieces = []
    offset = 0
    for address, length in span:
        out.append((address, length, offset))
        offset += length
    return out


def trim(parts: Span, size: int) -> Span:
    """The first ``size`` bytes of ``parts`` (which hold at least that many)."""
    out: Span = []
    for address, length in parts:
        if size <= 0:
            break
        out.append((address, min(length, size)))
        size -= length
    return out


def batch_error(op: str, failures: Failures) -> Exception:
    """One error for a batch's failed keys: the first key's, with ``failures`` naming them all
    (``errors``' batch convention)."""
    first_key, first = next(iter(failures.items()))
    if len(failures) == 1:
        first.failures = list(failures.items())
        return first
    err = type(first)(f"{op} failed for {len(failures)} keys; first {show_key(first_key)}: {first}")
    err.failures = list(failures.items())
    return err


SPARE_USE_FRACTION = 0.25
"""A spare is used only within this fraction of its ``valid_s`` (counted from before the request
that got it was sent), so the master, which reclaims it at ``valid_s``, never has."""


@functools.lru_cache(maxsize=4096)
def _on_loopback(engine: str) -> bool:
    """Whether engine "host:port" is on a loopback address (asked per location read: cached)."""
    return is_loopback(parse_host_port(engine, "engine")[0])


@dataclass(frozen=True, slots=True)
class _HeldSpare:
    spare: p.Spare
    replicas: int
    preferred: str
    usable_until: float  # monotonic
    channel: object  # the master connection it came over: another connection may be another master


_HOLDER_GONE = (PeerUnavailableError, TransferTimeoutError, SegmentNotRegisteredError)
"""Write failures that mean the holder is gone (or restarted) rather than that the put is wrong."""


class ObjectIO:
    """Puts and reads objects for one store client.

    Args:
        rpc: the master.
        engine: this client's transfer engine (it moves the bytes).
        client_id: this client, as the master knows it.
        default_replicas: replicas of a put that asks for none.
        on_lease_expired: told of each read that outlived its lease (the heartbeat reports them).
    """

    def __init__(self, rpc: MasterClient, engine: TransferEngine, client_id: str, default_replicas: int,
                 on_lease_expired: Callable[[], None]) -> None:
        self._rpc = rpc
        self._engine = engine
        self._client_id = client_id
        self._default_replicas = default_replicas
        self._on_lease_expired = on_lease_expired
        # The spare: at most one held, and at most one ticket (a put using a spare or asking for
        # one) out at a time, so the master, which drops a writer's spare when it reserves the
        # next, never drops one a thread of this client is about to write into.
        self._spare_lock = threading.Lock()
        self._spare: _HeldSpare | None = None
        self._spare_ticket = False
        self.disk_reader: DiskReader | None = None  # reads disk-only objects (the Store sets it)

    def put(self, keys: list[bytes], spans: list[Span], pin: Pin, replicas: int | None, upsert: bool,
            preferred_segment: str, avoid: tuple[str, ...] = (), publish: Publish | None = None) -> None:
        """Puts each key's span. Keys whose writes failed because a holder is gone (dead,
        stalled, restarted: the master has not noticed yet) are revoked and put once more with
        those holders' engines avoided, so a holder's death costs a retry, not a failed put.
        ``publish`` replaces the ``PutEnd`` request (called once per attempt, with the keys
        written).

        Raises:
            StoreError or TransferError (or a subclass): some keys failed (``err.failed_keys``).
        """
        copies = self._default_replicas if replicas is None else replicas
        if isinstance(copies, bool) or not isinstance(copies, int) or not 1 <= copies <= 16:
            raise ConfigError(f"replicas={replicas!r} is out of range; allowed 1..16")
        sizes = [sum(n for _, n in span) for span in spans]
        for key, n in zip(keys, sizes):
            if n <= 0:
                raise ConfigError(f"object {show_key(key)} is empty; tidekv stores objects of at least 1 byte")
        ask = False
        if len(keys) == 1 and not avoid and publish is None:
            held = self._take_spare(sizes[0], copies, preferred_segment)
            if held is not None and self._put_in_spare(keys[0], spans[0], held, pin, upsert, preferred_segment):
                return
            ask = self._take_ticket()
        request = p.PutStart(self._client_id, keys, sizes, copies, preferred_segment, int(pin), upsert, list(avoid),
                             spare=ask)
        sent = time.monotonic()
        slots: list[p.PutSlot] = []
        try:
            slots = self._rpc.call(request)
        except MasterUnavailableError as exc:
            if exc.is_request_sent:
                self._forget_unanswered_puts(keys)
            raise
        finally:
            if ask:
                self._settle(slots[0].spare if slots else None, copies, preferred_segment, sent)
        failures: Failures = {}
        writes: list[TransferRequest] = []
        owners: list[int] = []
        for i, (key, slot, span, n) in enumerate(zip(keys, slots, spans, sizes)):
            if slot.status == Status.OUT_OF_SPACE:
                failures[key] = OutOfSpaceError(f"no room for object {show_key(key)} ({n} bytes) even after eviction"
                                                + (f"; {slot.detail}" if slot.detail else ""), key=key)
            elif slot.status == Status.QUOTA:
                failures[key] = OutOfSpaceError(f"object {show_key(key)} ({n} bytes) is beyond this tenant's quota: "
                                                f"{slot.detail}", key=key)
            elif slot.status == Status.INVALID:
                failures[key] = ConfigError(f"master refused key {show_key(key)} (empty or too long) or size {n}")  # type: ignore[assignment]
            elif slot.status == Status.OK and (refused := self._unreachable(slot.locations)) is not None:
                failures[key] = refused
            elif slot.status == Status.OK:
                for loc in slot.locations:
                    offset = 0
                    for address, length in span:
                        writes.append(TransferRequest(TransferOp.WRITE, address, length, loc.engine, loc.addr + offset))
                        owners.append(i)
                        offset += length
        failed_writes = {i for i, key in enumerate(keys) if slots[i].status == Status.OK and key in failures}
        if writes:
            failed_writes |= self._run(writes, owners, keys, failures)
        ended = [(k, s.token) for i, (k, s) in enumerate(zip(keys, slots)) if s.status == Status.OK and i not in failed_writes]
        revoked = [(k, s.token) for i, (k, s) in enumerate(zip(keys, slots)) if s.status == Status.OK and i in failed_writes]
        if revoked:
            self._rpc.call(p.PutRevoke(self._client_id, [k for k, _ in revoked], [t for _, t in revoked]))
        again = [] if avoid else [i for i in sorted(failed_writes) if self._holder_gone(failures[keys[i]])]
        if again:
            lost = tuple(sorted({str(getattr(failures[keys[i]], "peer")) for i in again}))
            first = {keys[i]: failures.pop(keys[i]) for i in again}
            logger.info("store client %s: holder(s) %s unreachable; putting %d object(s) again elsewhere",
                        self._client_id, ", ".join(lost), len(again))
            try:
                self.put([keys[i] for i in again], [spans[i] for i in again], pin, replicas, upsert,
                         preferred_segment, lost, publish)
            except (StoreError, TransferError) as exc:
                # No room without those holders: the reason is the holder that is gone.
                failures.update({k: first[k] if isinstance(e, OutOfSpaceError) else e
                                 for k, e in (exc.failed_keys or {keys[again[0]]: exc}).items()})
        if ended:
            end_keys, tokens = [k for k, _ in ended], [t for _, t in ended]
            statuses = (publish(end_keys, tokens) if publish is not None
                        else self._rpc.call(p.PutEnd(self._client_id, end_keys, tokens)))
            for (key, _), status in zip(ended, statuses):
                if status != Status.OK:
                    failures[key] = StoreError(
                        f"put of {show_key(key)} was reclaimed by the master before it ended (too slow, or a replica "
                        "holder died); retry", key=key)
        if failures:
            raise batch_error("put", failures)

    def locate(self, keys: list[bytes]) -> tuple[float, list[p.GetResult]]:
        """Each key's locations under a read lease, and when that lease ends (monotonic clock)."""
        started = time.monotonic()
        lease_s, results = self._rpc.call(p.Get(keys))
        # lease_ttl_s = 0 on the master means "no leases": nothing to check the read against.
        deadline = started + lease_s if lease_s > 0 else float("inf")
        return deadline, results

    def read(self, keys: list[bytes], results: list[p.GetResult], pieces: list[Pieces | None],
             lease_deadline: float) -> None:
        """Reads every found object (``locate``) into its pieces, falling back to other replicas
        on failure.

        Raises:
            LeaseExpiredError: the read outlived its lease (``failed_keys``: every key read).
            StoreError or TransferError: no replica of some keys could be read (``failed_keys``).
        """
        pending = [i for i, s in enumerate(pieces) if s is not None]
        attempt = 0
        failures: Failures = {}
        on_disk = [i for i in pending if results[i].disk is not None and not results[i].locations]
        if on_disk:
            self._read_disk(keys, results, pieces, on_disk, failures)
            pending = [i for i in pending if results[i].locations]
        while pending:
            reads, owners, next_pending = [], [], []
            for i in pending:
                locs = self._ordered(results[i].locations)
                if attempt >= len(locs):
                    continue
                loc = locs[attempt]
                if (refused := self._unreachable([loc])) is not None:
                    if attempt + 1 < len(locs):
                        next_pending.append(i)
                    else:
                        failures[keys[i]] = refused
                    continue
                for address, length, offset in pieces[i]:  # type: ignore[union-attr]
                    reads.append(TransferRequest(TransferOp.READ, address, length, loc.engine, loc.addr + offset))
                    owners.append(i)
            if not reads:
                pending, attempt = next_pending, attempt + 1
                continue
            round_failures: Failures = {}
            failed = self._run(reads, owners, keys, round_failures)
            for i in sorted(failed):
                if attempt + 1 < len(results[i].locations):
                    next_pending.append(i)
                else:
                    failures[keys[i]] = round_failures[keys[i]]
            pending, attempt = next_pending, attempt + 1
        if time.monotonic() > lease_deadline:
            self._on_lease_expired()
            expired = LeaseExpiredError(
                f"read of {len(keys)} object(s) outlived its lease; the bytes may have been replaced - retry",
                key=keys[0] if len(keys) == 1 else None,
            )
            expired.failures = [(keys[i], expired) for i, s in enumerate(pieces) if s is not None]
            raise expired
        if failures:
            raise batch_error("get", failures)

    # ---- internals ----------------------------------------------------------------------

    def _read_disk(self, keys: list[bytes], results: list[p.GetResult], pieces: list[Pieces | None],
                   which: list[int], failures: Failures) -> None:
        """Reads the disk-only objects ``which`` through their holders (``disk_reads``)."""
        if self.disk_reader is None:
            for i in which:
                failures[keys[i]] = StoreError(f"object {show_key(keys[i])} is on a holder's disk only, and this "
                                               "client cannot read the disk tier")
            return
        errors = self.disk_reader.read([keys[i] for i in which], [results[i].disk for i in which],  # type: ignore[misc]
                                       [results[i].size for i in which], [pieces[i] for i in which])  # type: ignore[misc]
        for i, error in zip(which, errors, strict=True):
            if error is not None:
                failures[keys[i]] = error  # type: ignore[assignment]

    def _unreachable(self, locations: list[p.Location]) -> ConfigError | None:
        """A refusal of the first location whose engine is on loopback, another process's, while
        the master is on another host: such a holder mounted through the master's own loopback,
        so "127.0.0.1" names the master's host, not this one (here it may even reach another
        process's engine). A master refuses loopback mounts from elsewhere; this catches a
        holder on the master's host that connected to it through loopback."""
        if self._rpc.master_on_this_host is not False:
            return None
        for loc in locations:
            if loc.engine != self._engine.name and _on_loopback(loc.engine):
                return ConfigError(
                    f"the master ({self._rpc.address}, on another host) names engine {loc.engine} as a holder: "
                    f"loopback, which this host cannot reach; start that holder with its host's address "
                    f"(Store.connect(host=...), tidekv up --engine-host, or ${HOST_VARIABLE})")
        return None

    def _take_spare(self, size: int, replicas: int, preferred: str) -> _HeldSpare | None:
        """The held spare, with the ticket, when it fits a put of ``size`` bytes (one too old or
        of another shape is let go: the master drops it when it reserves the next)."""
        with self._spare_lock:
            held = self._spare
            if held is None or self._spare_ticket:
                return None
            self._spare = None
            if (held.spare.size, held.replicas, held.preferred) != (size, replicas, preferred) \
                    or time.monotonic() > held.usable_until:
                return None
            # A master that restarted without its journal knows nothing of the spare and may have
            # given its bytes to someone else: use it only over the connection it came on, still up.
            channel = self._rpc.channel
            if channel is not held.channel or channel is None or not channel.is_quiet():
                return None
            self._spare_ticket = True
            return held

    def _take_ticket(self) -> bool:
        """Whether this put may ask for a spare: no spare held and no ticket out."""
        with self._spare_lock:
            if self._spare is not None or self._spare_ticket:
                return False
            self._spare_ticket = True
            return True

    def _settle(self, spare: p.Spare | None, replicas: int, preferred: str, sent: float) -> None:
        """Gives the ticket back, keeping ``spare`` (asked for by a request sent at ``sent``)."""
        with self._spare_lock:
            self._spare_ticket = False
            if spare is not None:
                self._spare = _HeldSpare(spare, replicas, preferred, sent + spare.valid_s * SPARE_USE_FRACTION,
                                         self._rpc.channel)

    def _put_in_spare(self, key: bytes, span: Span, held: _HeldSpare, pin: Pin, upsert: bool, preferred: str) -> bool:
        """Puts ``key`` through the held spare: the bytes into it, then ``PutBind`` (which brings
        the next spare). False when the spare could not be used (a write failed, the master
        reclaimed it): the caller puts the key as usual.

        Raises:
            ConfigError: the master refused the key.
            MasterUnavailableError: no answer to the bind (it may have been applied: a put again
                is then a successful no-op).
        """
        spare, nxt, sent = held.spare, None, time.monotonic()
        try:
            if self._unreachable(spare.locations) is not None:
                return False
            writes = [TransferRequest(TransferOp.WRITE, address, length, loc.engine, loc.addr + offset)
                      for loc in spare.locations for address, length, offset in in_order(span)]
            if self._run(writes, [0] * len(writes), [key], {}):
                return False
            sent = time.monotonic()
            slot: p.PutSlot = self._rpc.call(p.PutBind(self._client_id, [key], spare.token, spare.size, int(pin),
                                                      upsert, preferred, spare=True))
            nxt = slot.spare
            if slot.status == Status.INVALID:
                raise ConfigError(f"master refused key {show_key(key)} (empty, too long or reserved)")
            return slot.status in (Status.OK, Status.EXISTS)
        finally:
            self._settle(nxt, held.replicas, held.preferred, sent)

    def _holder_gone(self, error: StoreError | TransferError) -> bool:
        """Whether a write failed because its holder (not this process) is gone or restarted."""
        return isinstance(error, _HOLDER_GONE) and bool(error.peer) and error.peer != self._engine.name

    def _forget_unanswered_puts(self, keys: list[bytes]) -> None:
        """A put_start got no answer but may have been applied: its puts would stay pending (and
        make others' puts of the keys no-ops) until reclaimed. Revoke them, best effort."""
        try:
            self._rpc.call(p.PutRevoke(self._client_id, keys, [0] * len(keys)))
        except StoreError as exc:
            logger.warning("store client %s: could not revoke %d put(s) whose start went unanswered (%s); the "
                           "master reclaims them after put_timeout_s", self._client_id, len(keys), exc)

    def _ordered(self, locations: list[p.Location]) -> list[p.Location]:
        """This client's own replica first."""
        if len(locations) < 2:
            return locations
        own = self._engine.name
        return sorted(locations, key=lambda loc: loc.engine != own)

    def _run(self, requests: list[TransferRequest], owners: list[int], keys: list[bytes],
             failures: Failures) -> set[int]:
        """Runs one transfer batch; returns indices (into keys) whose requests failed."""
        try:
            handle = self._engine.transfer(requests)
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
