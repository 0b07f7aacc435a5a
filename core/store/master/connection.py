"""One connection to the master: its framing, its handshake, and replies held until replicated. Nothing else.

A client connection first proves the deployment's secret (``auth``), when there is one, then
sends frames (``protocol``); each whole frame is handed to the ``MasterService`` and answered in
order. On a leader, a reply that changed the index waits in the connection's queue until every
in-sync standby has confirmed the change (``MasterServer.committed`` releases it). A standby
following the leader connects with ``replication.REPLICA_MAGIC`` instead: what it sends are
acknowledgements. A connection that misbehaves (bad magic, oversized or stalled frames, a failed
proof) is turned away with a reply saying why and closed.

Neighbours: ``server`` (MasterServer: the listener, the loop's housekeeping, the set of
connections), ``master`` (MasterService: what a request does).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import TYPE_CHECKING

from tidekv.auth import ServerHandshake
from tidekv.errors import AuthenticationError
from tidekv.store.ha.replication import REPLICA_MAGIC, decode_follow
from tidekv.store.master.channels import PendingWait
from tidekv.store.master.mount_check import PendingMount
from tidekv.store.master.service import MasterService
from tidekv.store.master.session import Session
from tidekv.store.wire import protocol as p

if TYPE_CHECKING:
    from tidekv.store.master.server import MasterServer

logger = logging.getLogger(__name__)

_READ_BYTES = 64 << 10
"""What one read of a connection takes at most."""
_TURN_AWAY_GRACE_S = 2.0
"""A connection refused with a reply is closed at the latest this long after the reply."""
_MAX_HANDSHAKE_FRAME = 4096
"""A handshake message is ~100 bytes; a longer frame before the proof is not a tidekv peer."""


class MasterConnection(asyncio.BufferedProtocol):
    """One client connection: checks the magic, then answers each whole frame in order.

    Reads land in a buffer of its own (``get_buffer``): the plain ``Protocol`` path has asyncio
    allocate 256 KiB per read, which glibc serves with mmap, mremap and munmap (three system
    calls per read: 6 per put on a lone master, 18 per put on a leader with two standbys)."""

    def __init__(self, server: MasterServer) -> None:
        self._server = server
        self._buf = bytearray()
        self._held = 0  # len(self._buf) as the server counts it (max_buffered_bytes)
        self._session = Session()  # the client this connection said hello as
        self._read = memoryview(bytearray(_READ_BYTES))
        self._greeted = False
        self._auth: ServerHandshake | None = None  # until the peer has proved the secret (connection_made)
        self._is_turned_away = False  # refused: what it sends is discarded until it closes
        self._is_standby = False  # a standby following this leader (replication.REPLICA_MAGIC)
        self._follows = False  # the standby's Follow was accepted: what comes now are acks
        self._queue: collections.deque[tuple[int, bytes]] = collections.deque()  # replies waiting for replication
        self._checking: PendingMount | None = None  # a mount waiting for its engine to vouch for it
        self._parked: PendingWait | None = None  # a channel's take or push waiting for its channel
        self._parked_timer: asyncio.TimerHandle | None = None  # when its wait is over
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  (asyncio's Transport or uvloop's)
        if not self._server.admit():
            transport.abort()
            return
        self._server._connections.add(transport)
        peer = transport.get_extra_info("peername")
        self._session.peer_host = peer[0] if isinstance(peer, tuple) else None
        self._auth = ServerHandshake(self._server.config.secret, "master",
                                     f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer),
                                     self._server.service.tenant_secrets())

    def connection_lost(self, exc: Exception | None) -> None:
        self._hold(0)
        if self._transport is not None:
            self._server._connections.discard(self._transport)
            if self._is_standby and self._server.replicator is not None:
                self._server.replicator.lost(self._transport)
        self._server._waiting.discard(self)
        self._queue.clear()
        self._unpark()

    def flush(self, committed: int) -> bool:
        """Sends the replies replication has caught up with; True when none is left waiting."""
        assert self._transport is not None
        queue = self._queue
        while queue and queue[0][0] <= committed:
            self._transport.write(queue.popleft()[1])
        return not queue

    # A client that does not read its replies stops being read from (its requests wait in the
    # kernel), so the master's memory does not grow with replies nobody collects.
    def pause_writing(self) -> None:
        assert self._transport is not None
        self._transport.pause_reading()

    def resume_writing(self) -> None:
        assert self._transport is not None
        self._transport.resume_reading()

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._read

    def buffer_updated(self, nbytes: int) -> None:
        if self._is_turned_away:
            return  # discarded until the connection closes (_turn_away)
        self._received(self._read[:nbytes])
        if self._transport is not None and not self._transport.is_closing():
            self._hold(len(self._buf))

    def _hold(self, held: int) -> None:
        """Accounts for the unfinished frame this connection holds (``held`` bytes)."""
        server = self._server
        server._buffered += held - self._held
        self._held = held
        if not held or self._parked is not None:  # (frames behind a parked request are not stalled)
            server._partial.pop(self, None)
            if not held:
                return
        else:
            server._partial[self] = time.monotonic()  # bytes came: the timeout counts from the last ones
        if server._buffered > server.config.max_buffered_bytes:
            self._refuse(f"holds {held} bytes of unfinished requests while the master holds "
                         f"{server._buffered} over all connections (max_buffered_bytes "
                         f"{server.config.max_buffered_bytes})")

    def _received(self, data: memoryview) -> None:
        buf = self._buf
        if self._is_standby and self._auth is None:
            self._from_standby(data)
            return
        buf += data
        if not self._greeted:
            if len(buf) < len(p.MAGIC):
                return
            if buf[: len(REPLICA_MAGIC)] == REPLICA_MAGIC:
                self._is_standby = True
            elif buf[: len(p.MAGIC)] != p.MAGIC:
                self._refuse(f"sent {bytes(buf[:8])!r}, not a tidekv store client's greeting (an older tidekv, "
                             "or another service?)")
                return
            del buf[: len(p.MAGIC)]
            self._greeted = True
        if self._auth is not None:
            if not self._authenticate():
                return
            if self._is_standby:
                rest, self._buf = bytes(buf), bytearray()
                self._from_standby(rest)
                return
        assert self._transport is not None
        server = self._server
        if server.role is not None and not server.role.check_lease():
            return  # stepped down: this connection is closed
        if self._checking is not None or self._parked is not None:
            return  # its frames wait until the mount being checked or the request parked is answered (in order)
        service = server.service
        handle = service.handle
        start, end = 0, len(buf)
        replies: list[tuple[bytes, int]] = []
        while end - start >= p.FRAME_HEADER:
            size = int.from_bytes(buf[start: start + p.FRAME_HEADER], "little")
            if size > self._server._max_frame:
                self._refuse(f"sent a frame of {size} bytes, beyond any request the master accepts")
                return
            if end - start - p.FRAME_HEADER < size:
                break
            payload = bytes(buf[start + p.FRAME_HEADER: start + p.FRAME_HEADER + size])
            start += p.FRAME_HEADER + size
            reply = handle(payload, self._session)
            if type(reply) is PendingWait:  # a take or push that waits for its channel
                del buf[:start]
                self._answer(replies)
                self._park(reply)
                return
            if type(reply) is not bytes:  # a mount its engine must vouch for first (mount_proof)
                del buf[:start]
                self._answer(replies)
                self._check(reply)
                return
            replies.append((p.frame(reply), service.reply_seq))
        del buf[:start]
        self._answer(replies)
        server.wake()

    def _answer(self, replies: list[tuple[bytes, int]]) -> None:
        """Persists what the requests changed and sends their replies (once replicated)."""
        if not replies:
            return
        assert self._transport is not None
        server = self._server
        server._persist()
        if server.role is not None and not server.role.check_lease():
            return  # the lease may have passed while these were handled: no answer goes out
        replicator = server.replicator
        if replicator is None:
            self._transport.write(b"".join(r for r, _ in replies) if len(replies) > 1 else replies[0][0])
        else:
            self._send_when_committed(replies, replicator.commit_seq)
        server._handled()

    def _check(self, pending: PendingMount) -> None:
        """Runs a mount's check off the loop; this connection's later frames wait for its reply."""
        assert self._transport is not None
        self._checking = pending
        self._transport.pause_reading()
        service = self._server.service
        future = asyncio.get_running_loop().run_in_executor(self._server.mount_checks, pending.run)
        future.add_done_callback(lambda f: self._checked(pending, service, f))

    def _checked(self, pending: PendingMount, service: MasterService, future: asyncio.Future[None]) -> None:
        self._checking = None
        transport = self._transport
        if future.cancelled() or transport is None or transport.is_closing() or self._server.service is not service:
            return  # the connection went, or this master stopped leading meanwhile
        reply = service.checked(pending, future.exception())
        self._answer([(p.frame(reply), service.reply_seq)])
        transport.resume_reading()
        if self._buf:
            self._received(memoryview(b""))  # frames that came while it was checked
        else:
            self._server.wake()

    def _park(self, pending: PendingWait) -> None:
        """Parks a channel request that waits (``PendingWait``) until its channel changes or its
        time is up; this connection's later frames wait for its reply. It is still read from,
        so a client that goes away meanwhile is noticed (``connection_lost``)."""
        assert self._transport is not None
        self._parked = pending
        self._server.park(self, pending.channel)
        self._parked_timer = asyncio.get_running_loop().call_later(pending.wait_s, self.retry, True)
        self._server._persist()  # what the request changed before it waited (a take's acks)

    def retry(self, final: bool) -> None:
        """Handles the parked request again (its channel changed; ``final``: its time is up) and
        answers it, unless it still has nothing to do and time left."""
        pending = self._parked
        transport = self._transport
        if pending is None or transport is None or transport.is_closing():
            return
        service = self._server.service
        reply = service.handle(pending.data, pending.session, pending, final)
        if type(reply) is not bytes:
            return  # still nothing to do: parked on (``final`` always answers)
        self._unpark()
        self._answer([(p.frame(reply), service.reply_seq)])
        if self._buf:
            self._received(memoryview(b""))  # frames that came while it was parked
            if not transport.is_closing():
                self._hold(len(self._buf))
        self._server.wake()  # what it changed (a push appended, a take's acks made room)

    def _unpark(self) -> None:
        """Forgets the parked request (answered, or its connection gone)."""
        if self._parked is None:
            return
        self._server.unpark(self, self._parked.channel)
        self._parked = None
        if self._parked_timer is not None:
            self._parked_timer.cancel()
            self._parked_timer = None

    def _authenticate(self) -> bool:
        """Runs the handshake (``tidekv.auth``) on the frames buffered so far: Greeting, then
        Proof. True once the peer has proved the secret (any peer, without one); a failed proof
        gets an ``auth`` error reply and the connection is closed."""
        assert self._transport is not None and self._auth is not None
        buf = self._buf
        while len(buf) >= p.FRAME_HEADER:
            size = int.from_bytes(buf[: p.FRAME_HEADER], "little")
            if size > _MAX_HANDSHAKE_FRAME:
                self._refuse(f"sent a handshake frame of {size} bytes")
                return False
            if len(buf) < p.FRAME_HEADER + size:
                return False
            payload = bytes(buf[p.FRAME_HEADER: p.FRAME_HEADER + size])
            del buf[: p.FRAME_HEADER + size]
            try:
                if not self._auth.client_nonce:
                    self._transport.write(p.frame(self._auth.greeted(payload)))
                    continue
                self._auth.proved(payload)
                if self._auth.tenant and self._is_standby:
                    raise AuthenticationError(f"{self._auth.peer} follows as a standby but names tenant "
                                              f"{self._auth.tenant!r}; standbys act for the master",
                                              peer=self._auth.peer)
            except AuthenticationError as exc:
                self._server.auth_failures.inc()
                self._turn_away(p.frame(p.encode(p.Reply(0, error_kind=p.ErrorKind.AUTH, error=str(exc)))),
                                f"failed authentication: {exc}")
                return False
            self._session = Session(self._auth.tenant, self._session.peer_host)
            self._auth = None
            return True
        return False

    def _turn_away(self, reply: bytes, why: str) -> None:
        """Sends ``reply`` and ends the connection gracefully: what the peer sends meanwhile is
        discarded (closing with it unread would reset the connection, and could destroy the reply
        before the peer read it), and the connection is closed after a grace period at most."""
        assert self._transport is not None
        peer = self._transport.get_extra_info("peername")
        logger.warning("closing the connection from %s: it %s", peer, why)
        self._buf.clear()
        self._hold(0)
        self._is_turned_away = True
        self._transport.write(reply)
        if self._transport.can_write_eof():
            self._transport.write_eof()
        asyncio.get_running_loop().call_later(_TURN_AWAY_GRACE_S, self._transport.close)

    def _send_when_committed(self, replies: list[tuple[bytes, int]], committed: int) -> None:
        """Writes the replies whose changes (or what they read) are committed, in order; queues the rest."""
        assert self._transport is not None
        queue = self._queue
        ready = 0
        if not queue:
            while ready < len(replies) and replies[ready][1] <= committed:
                ready += 1
            if ready:
                self._transport.write(b"".join(r for r, _ in replies[:ready]))
        for data, seq in replies[ready:]:
            queue.append((seq, data))
        if queue:
            self._server._waiting.add(self)

    def _from_standby(self, data: bytes | memoryview) -> None:
        """A standby's first frame is Follow; later ones are its acks."""
        assert self._transport is not None
        replicator = self._server.replicator
        if replicator is None:
            self._refuse("is a standby, but this master does not lead")
            return
        if not self._follows:
            buf = self._buf
            buf += data
            if len(buf) < p.FRAME_HEADER:
                return
            size = int.from_bytes(buf[: p.FRAME_HEADER], "little")
            if len(buf) < p.FRAME_HEADER + size:
                return
            try:
                follow = decode_follow(bytes(buf[p.FRAME_HEADER: p.FRAME_HEADER + size]))
            except Exception as exc:  # noqa: BLE001 - a standby we cannot serve is refused with its reason
                self._refuse(f"sent a follow request this leader refuses: {exc}")
                return
            rest = bytes(buf[p.FRAME_HEADER + size:])
            self._buf = bytearray()
            self._follows = True
            self._server._publish()  # the snapshot must not hold changes a later batch brings again
            replicator.attach(self._transport, follow, self._server.service.snapshot())
            if rest:
                replicator.received(self._transport, rest)
            return
        replicator.received(self._transport, data)

    def _refuse(self, why: str) -> None:
        assert self._transport is not None
        peer = self._transport.get_extra_info("peername")
        logger.warning("closed the connection from %s: it %s", peer, why)
        self._buf.clear()
        self._hold(0)
        self._transport.close()

