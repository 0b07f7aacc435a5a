"""MasterService: the store master's state and the meaning of every RPC. No I/O here.

It owns the segment table (who contributes which memory, who is alive) and the object table
(what lives where), answers decoded requests, and runs housekeeping on a timer: dead clients,
unfinished puts, retired bytes, watermark eviction. ``server`` feeds it from TCP connections and serves
its metrics over HTTP. Single-threaded: call it from one thread (the server's event loop).

A client silent for ``client_ttl_s`` is dead, but a paused or partitioned holder is not gone: its
segments mounted with an incarnation are suspended for ``suspend_grace_s`` (their objects unreadable,
their bytes reserved, leases honoured). The same process re-mounting (same client, engine, range and
incarnation secret) gets back every object whose key was not re-put, upserted, removed or evicted
meanwhile, and the reply counts both; any other mount of that memory, or the end of the grace,
drops them for good. Never silent: the holder learns which it was from ``MountResult``.

With tenants (``MasterConfig.tenants_file``) every request of a tenant's connection has its names
moved into the tenant's namespace on the way in (its session's ``Namespace.enter``) and out of it
on the way back (``Namespace.leave``); what lies between sees plain internal names, and
``tenancy`` (a ``tenants.Tenancy``) places, evicts and counts per tenant.
"""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable, Container, Iterable
from typing import Any

from tidekv.config import MasterConfig
from tidekv.errors import (
    AuthenticationError,
    ConfigError,
    MasterNotReadyError,
    ProtocolVersionError,
    SegmentNotRegisteredError,
    TidekvError,
)
from tidekv.metrics import Registry
from tidekv.store.allocator import RANGE_SHIFT, OffsetAllocator, align, carve, used_range
from tidekv.store.master import journal as j
from tidekv.store.master import mount_check
from tidekv.store.master import tenants as t
from tidekv.store.master.channels import ChannelTable, PendingWait, Wait
from tidekv.store.master.listing import KeyListings, Tiers
from tidekv.store.master.metrics import index_gauges
from tidekv.store.master.objects import ObjectTable
from tidekv.store.master.segments import SegmentTable, SuspendedSegment
from tidekv.store.master.session import Session
from tidekv.store.master.tasks import TaskBook, TaskKind
from tidekv.store.wire import names
from tidekv.store.wire import protocol as p

logger = logging.getLogger(__name__)


class _LimitError(Exception):
    """A request beyond a per-client limit (answered with ``ErrorKind.LIMIT``)."""


MAX_INCARNATION_CHARS = 128
"""Longest incarnation a MountSegment may carry."""


SPARE_SHARE = 64
"""A spare is reserved only while the pool's free bytes are at least this many times its size."""


class MasterService:
    def __init__(self, config: MasterConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self.master_id = uuid.uuid4().hex[:12]
        self.started = clock()
        self.not_serving = ""  # why requests are refused as not ready (recovering, standing by); "" = serving
        self.leader_hint = ""  # the leader's address, told to clients refused while standing by
        self.reply_seq = 0  # with a journal: the batch the last reply depends on (0: none)
        self.segments = SegmentTable()
        self.objects = ObjectTable(self.segments, config.max_key_bytes)
        self.channels = ChannelTable(self.objects)
        self.tasks = TaskBook(self.objects)
        self.objects.disks.write_through = config.disk_write_through
        self.objects.disks.promote = config.disk_promote
        self.metrics = Registry()
        self._requests = self.metrics.counter("tidekv_master_requests_total", "RPC requests by type", ["type"])
        self._items = self.metrics.counter("tidekv_master_request_items_total", "keys carried by RPC requests, by type",
                                          ["type"])
        self._item_counts = {kind: self._items.labels(type=kind) for kind in (
            "PutStart", "PutBind", "PutEnd", "Get", "Exists", "Locate", "Remove", "ListKeys")}
        self._failures = self.metrics.counter("tidekv_master_request_failures_total", "RPC requests refused, by reason",
                                             ["reason"])
        self._listings = KeyListings()
        self._limited = self.metrics.counter("tidekv_master_limit_refusals_total",
                                             "requests refused for a per-client limit, by limit", ["limit"])
        self._latency = self.metrics.histogram("tidekv_master_request_seconds", "time to handle one RPC, by type", ["type"])
        self._per_type: dict[str, tuple[Any, Any]] = {}  # kind -> its request counter and latency histogram
        self.verify_mounts = config.verify_mounts == "on" or (config.verify_mounts == "auto" and bool(config.secret))
        self._proven: tuple[str, str, str, int, int, bytes] | None = None  # the mount a check vouched for
        self._mount_checks = self.metrics.counter("tidekv_master_mount_checks_total",
                                                  "mounts checked with their engine (mount_proof), by outcome",
                                                  ["outcome"])
        self._lease_expiries = 0
        self.metrics.gauge("tidekv_lease_expiries_total", "reads that outlived their lease (reported by clients)",
                           lambda: {(): self._lease_expiries}, kind="counter")
        index_gauges(self.metrics, self.segments, self.objects, self._complete_keys)
        self.tenancy = (t.Tenancy(t.load(config.tenants_file, config.secret), config.secret, self.objects,
                                  self.segments, self.metrics) if config.tenants_file else None)
        self._session = Session()  # with tenants: the session of the request being handled
        self._final = False  # the request being handled waited its time: answer it as it is (PendingWait)
        self._waited_s = 0.0  # how long the request being handled has waited (PendingWait)
        self._handlers: dict[type, Callable[[Any, float], Any]] = {
            p.Hello: self._hello,
            p.MountSegment: self._mount,
            p.UnmountSegment: self._unmount,
            p.Heartbeat: self._heartbeat,
            p.Disconnect: self._disconnect,
            p.PutStart: self._put_start,
            p.PutBind: self._put_bind,
            p.PutEnd: self._put_end,
            p.PutRevoke: self._put_revoke,
            p.Get: self._get,
            p.Exists: self._exists,
            p.Locate: self._locate,
            p.Remove: self._remove,
            p.StatsRequest: self._stats,
            p.Repairs: self._repairs,
            p.Spills: self._spills,
            p.ChannelPush: self._channel_push,
            p.ChannelPublish: self._channel_publish,
            p.ChannelTake: self._channel_take,
            p.ChannelAck: lambda m, now: self.channels.ack(m.channel, m.seqs, m.consumer, now),
            p.ChannelInfo: lambda m, now: self.channels.info(m.channel, now),
            p.CreateTask: self._create_task,
            p.QueryTask: lambda m, now: self.tasks.query((m.id[0], m.id[1])) if len(m.id) == 2 else None,
        }

    def _channel_publish(self, m: p.ChannelPublish, now: float) -> tuple[list[int], list[int], list[int]]:
        ended = self._put_end(p.PutEnd(m.client_id, m.keys, m.tokens), now)
        published = [i for i, status in enumerate(ended) if status == p.Status.OK]
        statuses, seqs = self.channels.push(m.channel, [m.keys[i] for i in published], m.max_items, m.max_bytes)
        appended, at = [int(p.Status.NOT_FOUND)] * len(m.keys), [-1] * len(m.keys)
        for i, status, seq in zip(published, statuses, seqs):
            appended[i], at[i] = status, seq
        return ended, appended, at

    def _channel_push(self, m: p.ChannelPush, now: float) -> tuple[list[int], list[int]]:
        statuses, seqs = self.channels.push(m.channel, m.keys, m.max_items, m.max_bytes)
        if m.wait_s > 0 and not self._final and statuses and all(s == p.Status.FULL for s in statuses):
            raise Wait(m.channel, m.wait_s)
        return statuses, seqs

    def _channel_take(self, m: p.ChannelTake, now: float) -> tuple[float, list[p.ChannelItem]]:
        if m.acks:  # (handled again after a wait, they are acked already: a no-op)
            self.channels.ack(m.channel, m.acks, m.consumer, now)
        items = self.channels.take(m.channel, m.consumer, m.max_items, m.visibility_s, self.config.lease_ttl_s, now)
        if not items and m.wait_s > 0 and not self._final:
            raise Wait(m.channel, m.wait_s)
        # The lease as the client counts it, from when it sent the request: it waited here first.
        lease_s = self.config.lease_ttl_s
        return lease_s + self._waited_s if lease_s > 0 else 0.0, items

    # ---- entry points -------------------------------------------------------------------

    def handle(self, data: bytes, session: Session | None = None, parked: PendingWait | None = None,
               final: bool = False) -> bytes | mount_check.PendingMount | PendingWait:
        """Decodes one request, applies it, and returns the encoded reply (never raises).

        ``session``: the connection it came on. A request naming a client must come on the
        connection that client said hello on, so no connection acts for another client.

        A mount that must be checked with its engine first (``verify_mounts``) is answered with a
        ``PendingMount`` and nothing changed: run it, then pass it to ``checked``. A channel's
        take or push that may wait and found nothing to do is answered with a ``PendingWait``;
        handled again, it is passed as ``parked`` (and ``final`` once its wait is over: answered
        as it is then).
        """
        started = time.perf_counter()
        self._final = final
        self._waited_s = 0.0 if parked is None else max(0.0, self.clock() - parked.since)
        if len(data) > self.config.max_message_bytes:
            self._failures.labels(reason="oversized").inc()
            head = p.probe_header(data)
            return self._error(head[1] if head else 0, p.ErrorKind.OVERSIZED,
                               f"request of {len(data)} bytes exceeds the master's limit of "
                               f"{self.config.max_message_bytes} bytes; split the batch")
        try:
            envelope = p.decode_request(data)
        except Exception as exc:  # noqa: BLE001 - any decode failure is the sender's fault
            head = p.probe_header(data)
            if head is not None and head[0] != p.PROTOCOL_VERSION:
                self._failures.labels(reason="version").inc()
                return self._error(head[1], p.ErrorKind.VERSION, self._version_message(head[0]))
            self._failures.labels(reason="malformed").inc()
            return self._error(head[1] if head else 0, p.ErrorKind.MALFORMED, f"malformed request: {exc}")
        if envelope.protocol_version != p.PROTOCOL_VERSION:
            self._failures.labels(reason="version").inc()
            return self._error(envelope.request_id, p.ErrorKind.VERSION, self._version_message(envelope.protocol_version))
        body = envelope.body
        kind = type(body).__name__
        keys = getattr(body, "keys", None)
        if keys is not None and len(keys) > self.config.max_batch_keys:
            self._failures.labels(reason="oversized").inc()
            return self._error(envelope.request_id, p.ErrorKind.OVERSIZED,
                               f"{kind} request of {len(keys)} keys exceeds the master's limit of "
                               f"{self.config.max_batch_keys} keys per request (max_batch_keys); split the batch")
        if self.not_serving:
            self._failures.labels(reason="not_ready").inc()
            return p.encode(p.Reply(envelope.request_id, error_kind=p.ErrorKind.NOT_READY,
                                    error=f"master {self.master_id} {self.not_serving}", leader=self.leader_hint))
        if self.tenancy is not None:
            # (a request on no connection - in-process callers - acts for the default tenant)
            self._session = session if session is not None else Session()
            refusal = self._session.namespace.enter(body)
            if refusal:
                self._failures.labels(reason="invalid").inc()
                return self._error(envelope.request_id, p.ErrorKind.INVALID, refusal)
            self.tenancy.counted(self._session.tenant, kind)
        client_id = getattr(body, "client_id", None)
        if session is not None and client_id is not None:
            refusal = session.refusal(body, client_id)
            if refusal:
                self._failures.labels(reason="invalid").inc()
                return self._error(envelope.request_id, p.ErrorKind.INVALID, session.namespace.text(refusal))
        if session is not None and type(body) is p.MountSegment:
            refusal = session.engine_refusal(body.engine)
            if refusal:
                self._failures.labels(reason="loopback_engine").inc()
                logger.warning("refused the mount of segment %r by client %s: %s", body.name, body.client_id, refusal)
                return self._error(envelope.request_id, p.ErrorKind.INVALID, refusal)
        log = self.objects.journal
        if log is not None:
            before = len(log.ops)
            keys = getattr(body, "keys", None)
            self.reply_seq = log.depends(keys) if keys else 0
        try:
            if type(body) is p.ListKeys:
                result = self._list_keys(body, session if session is not None else Session())
            else:
                result = self._handlers[type(body)](body, self.clock())
        except ProtocolVersionError as exc:
            self._failures.labels(reason="version").inc()
            return self._error(envelope.request_id, p.ErrorKind.VERSION, str(exc))
        except ConfigError as exc:
            self._failures.labels(reason="invalid").inc()
            return self._error(envelope.request_id, p.ErrorKind.INVALID,
                               session.namespace.text(str(exc)) if session is not None else str(exc))
        except _LimitError as exc:
            self._failures.labels(reason="limit").inc()
            return self._error(envelope.request_id, p.ErrorKind.LIMIT,
                               session.namespace.text(str(exc)) if session is not None else str(exc))
        except MasterNotReadyError as exc:
            self._failures.labels(reason="not_ready").inc()
            return self._error(envelope.request_id, p.ErrorKind.NOT_READY, str(exc))
        except mount_check.Unproven as exc:
            return mount_check.PendingMount(data, envelope.request_id, session, exc)
        except Wait as exc:
            return parked if parked is not None else PendingWait(data, session, exc.channel, exc.wait_s, self.clock())
        except Exception as exc:  # noqa: BLE001 - one request's failure must not take the master down
            return self._internal(envelope.request_id, kind, exc)
        finally:
            self.objects.objects.settle()  # records the request unpacked are packed again
        if session is not None and isinstance(body, p.Hello):
            session.client_id = body.client_id
        if log is not None and len(log.ops) > before:
            self.reply_seq = log.seq  # it changed something: its reply waits for this batch
        if self.tenancy is not None:
            result = self._session.namespace.leave(body, result)
        counted = self._per_type.get(kind)
        if counted is None:
            counted = self._per_type[kind] = (self._requests.labels(type=kind), self._latency.labels(type=kind))
        counted[0].inc()
        counted[1].observe(time.perf_counter() - started)
        try:
            return p.encode(p.Reply(envelope.request_id, result=result))
        except Exception as exc:  # noqa: BLE001 - e.g. a number beyond u64 in the reply
            return self._internal(envelope.request_id, kind, exc)

    def checked(self, pending: mount_check.PendingMount, error: BaseException | None) -> bytes:
        """The reply to a mount once its check ran (``error``: what the check raised, None when
        the engine vouched for it): the mount applied, or refused with ``ErrorKind.UNPROVEN``."""
        u = pending.unproven
        if error is None:
            self._mount_checks.labels(outcome="vouched").inc()
            self._proven = u.key
            try:
                reply = self.handle(pending.data, pending.session)
            finally:
                self._proven = None
            if isinstance(reply, bytes):
                return reply
            return self._internal(pending.request_id, "MountSegment", RuntimeError("the check did not stick"))
        segment, engine = names.plain(u.segment), u.engine
        if isinstance(error, (AuthenticationError, SegmentNotRegisteredError)):
            self._mount_checks.labels(outcome="refused").inc()
            why = f"engine {engine} does not vouch that [{u.base:#x}, +{u.capacity}) is the mounting process's own: {error}"
        elif isinstance(error, TidekvError):
            self._mount_checks.labels(outcome="unreachable").inc()
            why = (f"the master could not ask engine {engine} to vouch for the memory ({type(error).__name__}: {error}); "
                   "it must reach every holder's engine, or run with verify_mounts off")
        else:
            return self._internal(pending.request_id, "MountSegment", error)  # type: ignore[arg-type]
        self._failures.labels(reason="unproven").inc()
        logger.warning("refused the mount of segment %r by client %s: %s", segment, names.plain(u.client_id), why)
        return self._error(pending.request_id, p.ErrorKind.UNPROVEN, f"mount of segment {segment!r} refused: {why}")

    def _internal(self, request_id: int, kind: str, exc: Exception) -> bytes:
        self._failures.labels(reason="internal").inc()
        logger.error("master failed on a %s request: %s: %s", kind, type(exc).__name__, exc,
                     exc_info=logger.isEnabledFor(logging.DEBUG))
        return self._error(request_id, p.ErrorKind.INTERNAL, f"the master failed on this {kind} request "
                           f"({type(exc).__name__}: {exc}); it keeps serving others")

    def tick(self) -> None:
        """Housekeeping; call every ``config.tick_s``."""
        try:
            self._housekeeping(self.clock())
        finally:
            self.objects.objects.settle()

    def _housekeeping(self, now: float) -> None:
        dead = self.segments.dead_clients(now, self.config.client_ttl_s)
        for client_id in dead:
            self._lapsed(client_id, now)
        self.objects.reclaim_stale_puts(now, self.config.put_timeout_s, set(dead))
        expired = self.segments.expired_suspensions(now)
        if expired:
            self._drop_suspended(expired, f"its holder did not come back within {self.config.suspend_grace_s:.0f} s")
        self.objects.free_retired(now)
        self.objects.repairs.expire(now)
        self.objects.disks.tick(now, self.config.disk_grace_s)
        cap = self.segments.capacity
        self.objects.disks.promote_ok = bool(cap) and self.segments.used < self.config.disk_spill_at * cap
        self.channels.tick(now)
        self.tasks.tick()
        high, low = self.config.high_watermark, self.config.high_watermark - self.config.eviction_ratio
        if self.tenancy is not None:
            self.tenancy.evict(now, high, low)
            return
        cap = self.segments.capacity
        if cap and self.segments.used > high * cap:
            self.objects.evict(int(self.segments.used - low * cap), now)

    # ---- handlers -----------------------------------------------------------------------

    def _hello(self, m: p.Hello, now: float) -> dict[str, Any]:
        if m.protocol_version != p.PROTOCOL_VERSION:
            raise ProtocolVersionError(self._version_message(m.protocol_version))
        self.segments.add_client(m.client_id, now)
        logger.info("client %s connected", m.client_id)
        return {"master_id": self.master_id, "max_message_bytes": self.config.max_message_bytes,
                "max_batch_keys": self.config.max_batch_keys,
                "lease_ttl_s": self.config.lease_ttl_s}

    def _mount(self, m: p.MountSegment, now: float) -> p.MountResult:
        if len(m.incarnation) > MAX_INCARNATION_CHARS:
            raise ConfigError(f"segment {m.name!r}: incarnation of {len(m.incarnation)} characters; "
                              f"at most {MAX_INCARNATION_CHARS}")
        self.segments.check_mount(m.client_id, m.name, m.base, m.capacity)
        self.segments.check_memory(m.client_id, m.name, m.engine, m.base, m.capacity)
        if self.verify_mounts:
            unproven = mount_check.Unproven(m.engine, self._engine_secret(), m.client_id, m.name, m.base, m.capacity,
                                            m.proof)
            if self._proven != unproven.key:
                raise unproven
        held = self.segments.suspended.get(m.name)
        if held is not None:
            if held.matches(m.client_id, m.engine, m.base, m.capacity, m.incarnation):
                return self._resume(m.client_id, held)
            self._drop_suspended([m.name], "it was mounted again by another incarnation of its holder")
        stale = self.segments.suspended_overlapping(m.engine, m.base, m.capacity, m.name)
        if stale:
            self._drop_suspended(stale, f"segment {m.name} was mounted on the same memory of engine {m.engine}")
        is_new = self.segments.mount(m.client_id, m.name, m.engine, m.base, m.capacity, m.incarnation)
        if is_new and self.objects.journal is not None:
            self.objects.journal.add(j.MountOp(m.client_id, m.name, m.engine, m.base, m.capacity, m.incarnation))
        return p.MountResult(p.MountOutcome.NEW if is_new else p.MountOutcome.KEPT)

    def _resume(self, client_id: str, held: SuspendedSegment) -> p.MountResult:
        name = held.segment.name
        self.segments.resume(client_id, name)
        restored = self.objects.resume_segment(name)
        superseded = max(0, held.objects - restored)
        if self.objects.journal is not None:
            self.objects.journal.add_everything(j.ResumeOp(name))
        logger.warning("client %s came back for its suspended segment %s: %d objects restored, %d superseded "
                       "while it was away (replaced, removed, evicted, or copied elsewhere)", client_id, name, restored,
                       superseded)
        return p.MountResult(p.MountOutcome.RESUMED, restored, superseded)

    def _unmount(self, m: p.UnmountSegment, now: float) -> bool:
        if self.segments.unmount(m.client_id, m.name):
            self._dropped([m.name])
            return True
        return False

    def _heartbeat(self, m: p.Heartbeat, now: float) -> bool:
        """Returns True when the client must hello and re-mount (this master does not know it, or
        not all of its segments)."""
        if m.lease_expired:
            self._lease_expiries += m.lease_expired
        if not self.segments.touch(m.client_id, now):
            return True
        mine = self.segments.clients[m.client_id].segments
        return any(name not in mine for name in m.segments)

    def _disconnect(self, m: p.Disconnect, now: float) -> None:
        self._forget_client(m.client_id)
        suspended = self.segments.suspended_of(m.client_id)
        if suspended:
            self._drop_suspended(suspended, "its holder disconnected")
        logger.info("client %s disconnected", m.client_id)

    def _put_start(self, m: p.PutStart, now: float) -> list[p.PutSlot]:
        self._check_batch(m.keys, m.sizes)
        if m.promote:
            self._check_batch(m.keys, m.promote)
            self.segments.touch(m.client_id, now)
            promote = self.objects.promote_start
            return [promote(m.client_id, k, t, m.preferred_segment, now) for k, t in zip(m.keys, m.promote)]
        if not self.segments.segments and now - self.started < self.config.client_ttl_s:
            # A master that just started (a restart without --state-dir) has no segment until
            # the holders' next heartbeats re-mount theirs: "not yet", not "out of space".
            raise MasterNotReadyError(f"master {self.master_id} started {now - self.started:.1f} s ago and no holder "
                                      "has mounted a segment yet; holders re-mount within a heartbeat")
        pending = self.objects.pending_by.get(m.client_id, 0)
        if pending + len(m.keys) > self.config.max_pending_puts:
            self._limited.labels(limit="max_pending_puts").inc()
            raise _LimitError(f"client {m.client_id!r} has {pending} puts started and not ended; {len(m.keys)} more "
                              f"would pass max_pending_puts={self.config.max_pending_puts}: end or revoke some first")
        self.segments.touch(m.client_id, now)
        self._item_counts["PutStart"].inc(len(m.keys))
        put = self.objects.put_start
        avoid = frozenset(m.avoid) if m.avoid else None
        if self.tenancy is None:
            slots = [put(m.client_id, key, size, m.replicas, m.preferred_segment, m.pin, m.upsert, now, avoid=avoid)
                     for key, size in zip(m.keys, m.sizes)]
            pool = None
        else:
            tenant = names.tenant_of(m.client_id)
            pool = self.tenancy.pool(tenant)
            slots = [put(m.client_id, key, size, m.replicas, m.preferred_segment, m.pin, m.upsert, now, pool, avoid)
                     for key, size in zip(m.keys, m.sizes)]
            self.tenancy.refused(tenant, slots)
        if self.objects.disks.disks:
            for slot in slots:
                if slot.status == p.Status.OUT_OF_SPACE and not slot.detail:
                    slot.detail = self.objects.disks.why_full()
        if m.spare and len(m.keys) == 1 and slots[0].status == p.Status.OK:
            slots[0].spare = self._spare(m.client_id, m.keys[0], m.sizes[0], m.replicas, m.preferred_segment, now,
                                         pool)
        return slots

    def _put_bind(self, m: p.PutBind, now: float) -> p.PutSlot:
        """A put in one request: the writer's spare becomes the object (``ObjectTable.put_bind``)."""
        if len(m.keys) != 1:
            raise ConfigError(f"put_bind names {len(m.keys)} keys; it publishes exactly one")
        self.segments.touch(m.client_id, now)
        self._item_counts["PutBind"].inc(1)
        key = m.keys[0]
        status = self.objects.put_bind(m.client_id, m.token, key, m.size, m.pin, m.upsert, now)
        slot = p.PutSlot(status)
        if status == p.Status.EXISTS:  # the spare is unused: the writer keeps it
            slot.spare = self._spare_slot(m.token)
        elif status == p.Status.OK and m.spare:
            want = self.objects.want(key)
            pool = self.tenancy.pool(names.tenant_of(m.client_id)) if self.tenancy is not None else None
            slot.spare = self._spare(m.client_id, key, m.size, want, m.preferred_segment, now, pool)
        return slot

    def _spare(self, writer: str, key: bytes, size: int, replicas: int, preferred: str, now: float,
               pool: Container[str] | None) -> p.Spare | None:
        """A new spare for ``writer``'s next put like ``key``'s, unless the pool has no room for it
        without evicting (a reservation must not cost anyone's objects) or it is beyond
        ``max_spare_bytes``. The writer's previous spare goes either way: one that asks uses none."""
        self.objects.drop_spare(writer)
        if size > self.config.max_spare_bytes or self.objects.pending_by.get(writer, 0) >= self.config.max_pending_puts:
            return None
        # Only in a pool with room to spare: never within one eviction round of the watermark,
        # and never more than a sliver of what is free, so a reservation makes no object go
        # (and no put fail for want of room).
        need = align(size) * replicas
        used, capacity = self.segments.used, self.segments.capacity
        if used + need > (self.config.high_watermark - self.config.eviction_ratio) * capacity \
                or need * SPARE_SHARE > capacity - used:
            return None
        slot = self.objects.reserve(writer, key, size, replicas, preferred, now, pool)
        if slot.status != p.Status.OK:
            return None
        return p.Spare(slot.token, size, slot.locations, self.config.put_timeout_s)

    def _spare_slot(self, token: int) -> p.Spare | None:
        spare = self.objects.pending.get(token)
        meta = self.objects.objects.get(spare) if spare is not None else None
        if meta is None or meta.put is None:
            return None
        return p.Spare(token, meta.size, self.objects.locations(meta), self.config.put_timeout_s)

    def _put_end(self, m: p.PutEnd, now: float) -> list[int]:
        self._check_batch(m.keys, m.tokens)
        self._item_counts["PutEnd"].inc(len(m.keys))
        return [self.objects.put_end(k, t, now) for k, t in zip(m.keys, m.tokens)]

    def _put_revoke(self, m: p.PutRevoke, now: float) -> list[int]:
        self._check_batch(m.keys, m.tokens)
        return [self.objects.put_revoke(k, t, m.client_id) for k, t in zip(m.keys, m.tokens)]

    def _get(self, m: p.Get, now: float) -> tuple[float, list[p.GetResult]]:
        self._item_counts["Get"].inc(len(m.keys))
        lease = self.config.lease_ttl_s
        get = self.objects.get
        return lease, [get(k, lease, now) for k in m.keys]

    def _exists(self, m: p.Exists, now: float) -> list[bool]:
        self._item_counts["Exists"].inc(len(m.keys))
        exists = self.objects.exists
        return [exists(k) for k in m.keys]

    def _locate(self, m: p.Locate, now: float) -> list[list[str]]:
        self._item_counts["Locate"].inc(len(m.keys))
        engines = self.objects.engines
        return [engines(k) for k in m.keys]

    def _remove(self, m: p.Remove, now: float) -> list[int]:
        self._item_counts["Remove"].inc(len(m.keys))
        return [self.objects.remove(k, m.force, now) for k in m.keys]

    def _repairs(self, m: p.Repairs, now: float) -> list[p.RepairTask]:
        """A holder's finished repairs, and new ones for its segments (``repairs``)."""
        book = self.objects.repairs
        for r in m.done:
            book.finish(r.key, r.token, r.ok, m.client_id, now)
        info = self.segments.clients.get(m.client_id)
        if info is None:
            return []
        info.last_seen = now
        mine = [self.segments.segments[n] for n in sorted(info.segments) if n in self.segments.segments]
        may_hold = self.tenancy.may_hold if self.tenancy is not None else None
        return book.take(m.client_id, mine, may_hold, min(max(m.max_bytes, 0), self.config.max_message_bytes),
                         self.config.max_batch_keys, now, self.config.put_timeout_s)

    def _spills(self, m: p.Spills, now: float) -> p.SpillWork:
        """A holder's disks and finished spills, and its next spills (``disks``)."""
        info = self.segments.clients.get(m.client_id)
        if info is None:
            return p.SpillWork()
        info.last_seen = now
        mine = [(n, self.segments.segments[n].base) for n in sorted(info.segments) if n in self.segments.segments]
        cap = self.segments.capacity
        pressure = bool(cap) and self.segments.used >= self.config.disk_spill_at * cap
        return self.objects.disks.spills(m, mine, pressure, min(max(m.max_bytes, 0), self.config.max_message_bytes),
                                         now, max(4 * self.config.lease_ttl_s, 10.0))

    def _create_task(self, m: p.CreateTask, now: float) -> list[int]:
        if len(m.keys) != 1 or m.kind not in (TaskKind.COPY, TaskKind.MOVE):
            raise ConfigError(f"CreateTask names {len(m.keys)} keys and kind {m.kind}: expected one key, kind 0 or 1")
        return list(self.tasks.create(TaskKind(m.kind), m.keys[0], m.targets, m.source))

    def _stats(self, m: p.StatsRequest, now: float) -> dict[str, Any]:
        if self.tenancy is not None and self._session.tenant:
            return self.tenancy.stats(self._session.namespace, self.master_id)
        return self.stats()

    def _list_keys(self, m: p.ListKeys, session: Session) -> tuple[list[bytes], bool]:
        """A page of ``session``'s key listing (``listing``)."""
        if not 1 <= m.limit <= self.config.max_batch_keys:
            raise ConfigError(f"ListKeys limit={m.limit} is out of range; allowed 1..{self.config.max_batch_keys} "
                              "(max_batch_keys)")
        owns = session.namespace.owns if self.tenancy is not None else None
        disk = self.objects.disks.entries
        listed = Tiers(self.objects.objects, disk) if disk else self.objects.objects
        page, is_last = self._listings.page(session, m.start, m.limit, listed, owns)
        self._item_counts["ListKeys"].inc(len(page))
        return page, is_last

    # ---- helpers ------------------------------------------------------------------------

    def _complete_keys(self) -> int:
        # Every pending put lives in `objects` except pending upserts, which live in `upserts`.
        return len(self.objects.objects) - (len(self.objects.pending) - len(self.objects.upserts))

    def stats(self) -> dict[str, Any]:
        c = self.objects.counters
        r = self.objects.repairs.counters
        spares = self.objects.live_spares()
        spare_bytes: dict[str, int] = {}
        for meta in spares:
            for seg, _ in meta.replica_pairs():
                spare_bytes[seg] = spare_bytes.get(seg, 0) + align(meta.size)
        return {
            "master_id": self.master_id,
            "keys": self._complete_keys(),
            "pending_puts": len(self.objects.pending) - len(spares),
            "spares": len(spares),  # slots reserved for clients' next puts (``protocol.Spare``)
            "spare_bytes": sum(spare_bytes.values()),
            "clients": len(self.segments.clients),
            "segments": {
                s.name: {"engine": s.engine, "capacity": s.capacity, "used": s.used, "spare": spare_bytes.get(s.name, 0)}
                for s in self.segments.segments.values()
            },
            "suspended_segments": {
                name: {"engine": s.segment.engine, "capacity": s.segment.capacity, "used": s.segment.used,
                       "grace_left_s": max(0.0, s.until - self.clock())}
                for name, s in self.segments.suspended.items()
            },
            "suspended_keys": len(self.objects.suspended),
            "capacity_bytes": self.segments.capacity,
            "used_bytes": self.segments.used,
            "evictions": c.evictions,
            "evicted_bytes": c.evicted_bytes,
            "puts_reclaimed": c.puts_reclaimed,
            "objects_lost": c.objects_lost,
            "objects_restored": c.objects_restored,
            "objects_superseded": c.objects_superseded,
            "suspended_objects_dropped": c.suspended_lost,
            "lease_expiries": self._lease_expiries,
            "repairs": {"under_way": len(self.objects.repairs.under_way), "done": r.done, "failed": r.failed,
                        "stale": r.stale, "started": r.started},
            "disk": self.objects.disks.stats(),
        }

    def _engine_secret(self) -> str | None:
        """The secret the engines of the requesting client's tenant hold."""
        return self.tenancy.engine_secret(self._session.tenant) if self.tenancy is not None else self.config.secret

    def tenant_secrets(self) -> dict[str, str | None] | None:
        """For ``tidekv.auth.ServerHandshake``: each tenant's own secret (None: the master's)."""
        return self.tenancy.secrets() if self.tenancy is not None else None

    def _forget_client(self, client_id: str) -> None:
        self.objects.disks.lapsed(client_id, self.clock())
        names = self.segments.remove_client(client_id)
        self._dropped(names)
        self.objects.reclaim_stale_puts(self.clock(), self.config.put_timeout_s, {client_id})

    def _lapsed(self, client_id: str, now: float) -> None:
        """A client missed its heartbeats: its puts are reclaimed (by the caller) and its segments
        suspended (or, without an incarnation or a grace, unmounted)."""
        self.objects.disks.lapsed(client_id, now)
        grace = self.config.suspend_grace_s
        if grace > 0:
            suspended, dropped = self.segments.suspend_client(client_id, now + grace)
        else:
            suspended, dropped = [], self.segments.remove_client(client_id)
        self._dropped(dropped)
        if dropped:
            logger.warning("client %s silent for over %.1f s: segment(s) %s unmounted", client_id,
                           self.config.client_ttl_s, ", ".join(dropped))
        if not suspended:
            return
        if self.objects.journal is not None:
            self.objects.journal.add_everything(j.SuspendOp(suspended, grace))
        held_on = self.objects.suspend_segments(set(suspended), now)
        for name in suspended:
            self.segments.suspended[name].objects = held_on[name]
            logger.warning("client %s silent for over %.1f s: segment %s suspended with %d objects (unreadable "
                           "until the same holder re-mounts it; dropped in %.0f s otherwise)", client_id,
                           self.config.client_ttl_s, name, held_on[name], grace)

    def _drop_suspended(self, names: list[str], why: str) -> None:
        """Drops suspended segments for good, and every object held only there."""
        lost = self.objects.counters.objects_lost
        for name in names:
            logger.warning("suspended segment %s dropped with the objects it held: %s", name, why)
        self.segments.drop_suspended(names)
        self._dropped(names)
        self.objects.counters.suspended_lost += self.objects.counters.objects_lost - lost

    def _dropped(self, names: list[str]) -> None:
        if names and self.objects.journal is not None:
            self.objects.journal.add_everything(j.UnmountOp(list(names)))
        self.objects.drop_segments(set(names))

    # ---- journal ------------------------------------------------------------------------

    def enable_journal(self, track_keys: bool = False) -> None:
        """From now on every change of the index is kept as an op until ``take_ops``; with
        ``track_keys`` each reply also says which batch it depends on (``reply_seq``)."""
        self.objects.journal = j.OpLog(track_keys)

    def take_ops(self) -> tuple[int, list[j.Op]]:
        """(seq, ops) of the changes made since the last call ((0, []): none, or no journal)."""
        log = self.objects.journal
        return log.take() if log is not None else (0, [])

    def snapshot(self, columns: bool = False) -> Iterable[j.Op]:
        """Ops that rebuild the whole index (``journal.Mirror``); with ``columns``, a journal's
        snapshot (packed objects in column parts, made as it is iterated: ``ObjectTable.snapshot``)."""
        mounts: list[j.Op] = [j.MountOp(s.client_id, s.name, s.engine, s.base, s.capacity, s.incarnation)
                              for s in self.segments.segments.values()]
        now = self.clock()
        for name, held in self.segments.suspended.items():
            seg = held.segment
            mounts += [j.MountOp(seg.client_id, name, seg.engine, seg.base, seg.capacity, seg.incarnation),
                       j.SuspendOp([name], max(0.0, held.until - now))]
        ops = itertools.chain(mounts, self.objects.snapshot(columns), self.channels.snapshot(), self.tasks.snapshot())
        return ops if columns else list(ops)

    def restore(self, mirror: j.Mirror) -> None:
        """Makes this (empty) master serve the index in ``mirror``: segments with their bytes in
        use re-reserved, objects, pending puts; clients count as alive from now."""
        assert not self.segments.segments and not self.objects.objects, "restore into an empty master"
        now = self.clock()
        base = mirror.base
        if base is not None and (mirror.suspended or base.shard_count != self.objects.objects.shard_count):
            mirror.materialize()  # held replicas, another shard count: the path of ops
        allocators = self._allocators(mirror)
        if allocators is None:
            logger.warning("the journal's snapshot and its objects disagree on the bytes in use; rebuilding every "
                           "segment's allocator from every replica")
            mirror.materialize()
            allocators = self._allocators(mirror)
            assert allocators is not None
        for name, op in mirror.segments.items():
            self.segments.restore(op.client_id, name, op.engine, op.base, op.capacity, allocators[name], now,
                                  op.incarnation)
        for name, (op, until) in mirror.suspended.items():
            self.segments.restore(op.client_id, name, op.engine, op.base, op.capacity, allocators[name], now,
                                  op.incarnation, suspended_until=until)
        short = self.objects.restore(mirror, now)
        self.objects.disks.restore(mirror, now)
        self.objects.repairs.restore(list(mirror.repairs.values()), now, self.config.put_timeout_s, short)
        self.channels.restore(mirror)
        self.tasks.restore(mirror.tasks)
        if self.objects.quotas is not None:  # repairs under way count against their objects' tenants too
            self.objects.usage = self.objects.count_usage()

    @staticmethod
    def _allocators(mirror: j.Mirror) -> dict[str, OffsetAllocator] | None:
        """Each segment's allocator with the bytes in use in ``mirror`` re-reserved: from the
        replicas of its ops, and, for a base (a journal snapshot's columns), from the free ranges
        the snapshot saved, less what left the base since, plus what joined it. None when those
        disagree with the replicas (a range in use twice)."""
        used: dict[str, list[int]] = {name: [] for name in (*mirror.segments, *mirror.suspended)}
        held = itertools.chain(
            mirror.objects.values(), mirror.pending.values(),
            (j.RetireOp(size, replicas) for _, size, replicas in mirror.retired),  # kept for leases
            (j.RetireOp(r.size, [r.segment, r.offset]) for r in mirror.repairs.values()))  # their bytes
        shift = RANGE_SHIFT  # used_range inline: ten million objects
        for op in held:
            flat, size = op.replicas, op.size
            if len(flat) == 2:  # one replica: the common case, kept cheap for a million objects
                used[flat[0]].append(flat[1] << shift | size)  # type: ignore[index, operator]
                continue
            for i in range(0, len(flat), 2):
                used[flat[i]].append(used_range(flat[i + 1], size))  # type: ignore[index, arg-type]
        out = {}
        for name, op in itertools.chain(mirror.segments.items(), ((n, m) for n, (m, _) in mirror.suspended.items())):
            gone, new = Counter(mirror.base_gone.get(name, ())), Counter(mirror.base_new.get(name, ()))
            gone, new = gone - new, new - gone  # a range that left and came back (or came and left) cancels
            taken = used[name] + list(new.elements())
            saved = mirror.base_free.get(name)
            if saved is None:  # none of the base's bytes are there
                if gone:
                    logger.warning("segment %s: base objects left it, but the snapshot saved no free ranges there",
                                   names.plain(name))
                    return None
                out[name] = OffsetAllocator.with_used(op.capacity, taken)
                continue
            free = [saved.free[i] << shift | saved.free[i + 1] for i in range(0, len(saved.free), 2)]
            try:
                if saved.capacity != op.capacity:
                    raise ValueError(f"capacity {saved.capacity} in the snapshot, {op.capacity} mounted")
                out[name] = OffsetAllocator.with_free(op.capacity, carve(free + list(gone.elements()), taken))
            except (ValueError, ConfigError) as exc:
                logger.warning("segment %s: %s", names.plain(name), exc)
                return None
        return out

    @staticmethod
    def _check_batch(keys: list[bytes], other: list[int]) -> None:
        if len(keys) != len(other):
            raise ConfigError(f"batch has {len(keys)} keys but {len(other)} sizes/tokens")

    @staticmethod
    def _version_message(theirs: int) -> str:
        return (
            f"client speaks tidekv store protocol v{theirs}, this master speaks v{p.PROTOCOL_VERSION}; "
            "run the same tidekv version on clients and master"
        )

    @staticmethod
    def _error(request_id: int, kind: str, message: str) -> bytes:
        return p.encode(p.Reply(request_id, error_kind=kind, error=message))

