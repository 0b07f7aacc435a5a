"""Replication: the leader streams its journal to the standbys and answers a request only once
every in-sync standby confirmed the changes it made.

A standby connects with ``REPLICA_MAGIC``, authenticates, sends ``Follow``, gets a snapshot
``Batch`` then numbered ``Batch``es, applies each to its ``journal.Mirror`` and answers
``Ack(seq)``. A batch commits once every counted standby (and at least ``min_standbys``) acked it;
a reply waits for the batches its request made or read. A standby caught up joins the in-sync
set in etcd (eligible to lead); one that leaves or lags ``sync_timeout_s`` is removed from it
*before* anything commits without it.
Neighbours: ``journal`` (ops, Mirror), ``cluster`` (roles), ``server`` (I/O).
Design notes: docs/store-design.md#tidekvstorehareplication
"""

from __future__ import annotations

import asyncio
import collections
import errno
import logging
import os
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import BinaryIO

import msgspec
from tidekv.auth import ClientHandshake
from tidekv.errors import AuthenticationError, ProtocolVersionError
from tidekv.store.master.journal import Mirror, Op
from tidekv.store.wire import protocol as p

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 2.0
"""How long a standby waits for its connection to the leader (and its TLS handshake)."""
STOP_POLL_S = 0.05
"""How often a standby waiting for that connection looks whether it was told to stop."""
REPLICA_MAGIC = b"tkvR"
"""First bytes a standby sends (a store client sends ``protocol.MAGIC``)."""


class Follow(msgspec.Struct, tag="follow", array_like=True):
    protocol_version: int
    master_id: str


class Batch(msgspec.Struct, array_like=True):
    seq: int
    ops: list[Op]
    is_snapshot: bool = False


class Ack(msgspec.Struct, array_like=True):
    seq: int


_encoder = msgspec.msgpack.Encoder()
_follow = msgspec.msgpack.Decoder(Follow)
_batch = msgspec.msgpack.Decoder(Batch)
_ack = msgspec.msgpack.Decoder(Ack)


def decode_follow(data: bytes) -> Follow:
    follow = _follow.decode(data)
    if follow.protocol_version != p.PROTOCOL_VERSION:
        raise ProtocolVersionError(f"standby {follow.master_id} speaks store protocol v{follow.protocol_version}, "
                                   f"this leader v{p.PROTOCOL_VERSION}; run one tidekv version on every master")
    return follow


@dataclass(eq=False)
class _Standby:
    master_id: str
    transport: asyncio.Transport
    snapshot_seq: int
    acked: int = -1
    is_counted: bool = False
    join_seq: int = 0
    is_insync: bool = False
    is_gone: bool = False
    buf: bytearray = field(default_factory=bytearray)


class Replicator:
    """The leader's side. Runs on the server's event loop; ``record_insync(members)`` is a
    blocking etcd write, run in a worker thread; ``on_commit(seq)`` is told each new commit."""

    def __init__(self, leader_id: str, sync_timeout_s: float, record_insync: Callable[[list[str]], bool],
                 on_commit: Callable[[int], None], min_standbys: int = 1) -> None:
        self.leader_id = leader_id
        self.sync_timeout_s = sync_timeout_s
        self.min_standbys = min_standbys
        self._record = record_insync
        self._on_commit = on_commit
        self.seq = 0
        self.commit_seq = 0
        self._standbys: dict[asyncio.Transport, _Standby] = {}
        self._sent: collections.deque[tuple[int, float]] = collections.deque()  # uncommitted (seq, sent at)
        self._writing = False  # an in-sync write to etcd is under way

    @property
    def insync(self) -> list[str]:
        return [self.leader_id] + [s.master_id for s in self._standbys.values() if s.is_insync]

    def attach(self, transport: asyncio.Transport, follow: Follow, snapshot: list[Op]) -> None:
        standby = _Standby(follow.master_id, transport, self.seq)
        self._standbys[transport] = standby
        transport.write(p.frame(_encoder.encode(Batch(self.seq, snapshot, True))))
        logger.info("standby %s follows (snapshot of %d ops at seq %d)", follow.master_id, len(snapshot), self.seq)

    def publish(self, seq: int, ops: list[Op]) -> None:
        """Sends batch ``seq`` of changes (the service numbers them: the next after the last)."""
        assert seq == self.seq + 1, (seq, self.seq)
        self.seq = seq
        data = p.frame(_encoder.encode(Batch(self.seq, ops)))
        for standby in self._standbys.values():
            standby.transport.write(data)
        self._sent.append((self.seq, time.monotonic()))
        self._advance()

    def received(self, transport: asyncio.Transport, data: bytes | memoryview) -> None:
        """Bytes from a standby: its acks."""
        standby = self._standbys.get(transport)
        if standby is None:
            return
        buf = standby.buf
        buf += data
        start = 0
        while len(buf) - start >= p.FRAME_HEADER:
            size = int.from_bytes(buf[start: start + p.FRAME_HEADER], "little")
            if len(buf) - start - p.FRAME_HEADER < size:
                break
            ack = _ack.decode(bytes(buf[start + p.FRAME_HEADER: start + p.FRAME_HEADER + size]))
            start += p.FRAME_HEADER + size
            standby.acked = max(standby.acked, ack.seq)
        del buf[:start]
        if not standby.is_counted and standby.acked >= standby.snapshot_seq:
            standby.is_counted = True
            standby.join_seq = self.seq
        self._advance()

    def lost(self, transport: asyncio.Transport) -> None:
        standby = self._standbys.get(transport)
        if standby is None:
            return
        logger.warning("standby %s disconnected", standby.master_id)
        if standby.is_counted:
            standby.is_gone = True  # still counted until etcd no longer lists it
            self.check()
        else:
            del self._standbys[transport]

    def check(self) -> None:
        """Drops counted standbys that left or stay ``sync_timeout_s`` behind (also periodic)."""
        if self._writing:
            return
        late = [s for s in self._standbys.values() if s.is_counted and s.is_gone]
        if self._sent and time.monotonic() - self._sent[0][1] >= self.sync_timeout_s:
            oldest_seq = self._sent[0][0]
            late += [s for s in self._standbys.values() if s.is_counted and not s.is_gone and s.acked < oldest_seq]
        if late:
            self._write_insync(drop=late)

    def close(self) -> None:
        for transport in list(self._standbys):
            transport.close()
        self._standbys.clear()

    # ---- internals ----------------------------------------------------------------------

    def _advance(self) -> None:
        counted = [s.acked for s in self._standbys.values() if s.is_counted and not s.is_gone]
        if len(counted) < self.min_standbys:
            commit = self.commit_seq  # too few standbys hold the changes: they wait for one to attach
        else:
            counted += [s.acked for s in self._standbys.values() if s.is_counted and s.is_gone]
            commit = min(counted) if counted else self.seq
        if commit > self.commit_seq:
            self.commit_seq = min(commit, self.seq)
            while self._sent and self._sent[0][0] <= self.commit_seq:
                self._sent.popleft()
            self._on_commit(self.commit_seq)
        if not self._writing:
            joining = [s for s in self._standbys.values()
                       if s.is_counted and not s.is_insync and s.acked >= s.join_seq]
            if joining:
                self._write_insync(add=joining)

    def _write_insync(self, add: list[_Standby] = (), drop: list[_Standby] = ()) -> None:  # type: ignore[assignment]
        dropped = {s.master_id for s in drop}
        members = list(dict.fromkeys([m for m in self.insync if m not in dropped] + [s.master_id for s in add]))
        self._writing = True
        loop = asyncio.get_running_loop()

        def done(future: asyncio.Future[bool]) -> None:
            self._writing = False
            ok = not future.cancelled() and future.exception() is None and future.result()
            if not ok:
                logger.warning("could not record the in-sync set %s in etcd; retrying", members)
                return
            for s in add:
                s.is_insync = True
                logger.info("standby %s is in sync (eligible to lead)", s.master_id)
            for s in drop:
                logger.warning("standby %s fell %.1f s behind or left: no longer in sync", s.master_id,
                               self.sync_timeout_s)
                self._standbys.pop(s.transport, None)
                s.transport.close()
            self._advance()

        loop.run_in_executor(None, self._record, members).add_done_callback(done)


def _read_frame(reader: BinaryIO) -> bytes | None:
    """One whole frame's payload from a blocking reader; None when the connection ended."""
    head = reader.read(p.FRAME_HEADER)
    if len(head) < p.FRAME_HEADER:
        return None
    size = int.from_bytes(head, "little")
    body = reader.read(size)
    return body if len(body) == size else None


def _keep_alive(sock: socket.socket, within_s: float) -> None:
    """TCP keep-alive probes that end a connection to a silent peer within about ``within_s``:
    a follow connection otherwise outlives a leader whose host vanished (no FIN ever comes)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    if hasattr(socket, "TCP_KEEPIDLE"):  # Linux; elsewhere the system's (long) defaults apply
        interval = max(1, int(within_s / 4))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, interval)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, interval)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)


class FollowSession:
    """The standby's side: one connection to the leader, applying batches to a Mirror (in the
    calling thread, blocking) until the connection ends or ``stop()``."""

    def __init__(self, leader: str, master_id: str, lease_ttl_s: float, clock: Callable[[], float],
                 secret: str | None = None, tls: ssl.SSLContext | None = None) -> None:
        from tidekv.config import parse_host_port

        self.leader = leader
        self._secret = secret
        self._tls = tls
        self._address = parse_host_port(leader, "leader")
        self.master_id = master_id
        self.mirror: Mirror | None = None  # None until the snapshot arrived
        self._lease_ttl_s = lease_ttl_s
        self._clock = clock
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._stopped = False

    def run(self) -> None:
        try:
            sock = self._connect()
        except OSError as exc:
            logger.debug("standby %s: cannot reach leader %s: %s", self.master_id, self.leader, exc)
            return
        if sock is None:
            return
        if self._tls is not None:
            try:
                sock = self._tls.wrap_socket(sock, server_hostname=self._address[0])
            except (ssl.SSLError, OSError) as exc:
                sock.close()
                logger.warning("standby %s: TLS with leader %s failed: %s", self.master_id, self.leader, exc)
                return
        with self._lock:
            if self._stopped:
                sock.close()
                return
            self._sock = sock
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _keep_alive(sock, self._lease_ttl_s)
        try:
            reader = sock.makefile("rb")
            auth = ClientHandshake(self._secret, "master", self.leader)
            sock.sendall(REPLICA_MAGIC + p.frame(auth.greeting()))
            challenge = _read_frame(reader)
            if challenge is None:
                return
            proof = auth.challenged(challenge)
            sock.sendall(p.frame(proof) + p.frame(_encoder.encode(Follow(p.PROTOCOL_VERSION, self.master_id))))
            while (body := _read_frame(reader)) is not None:
                batch = _batch.decode(body)
                # Acked before it is applied: the leader waits one wake-up less, and a standby
                # that dies before applying it is no candidate; one that lives applies it
                # before it could campaign (the election stops this loop between batches).
                sock.sendall(p.frame(_encoder.encode(Ack(batch.seq))))
                now = self._clock()
                if batch.is_snapshot:
                    mirror = Mirror(self._lease_ttl_s)
                    mirror.apply(batch.ops, now)
                    self.mirror = mirror
                    logger.info("standby %s: snapshot of %d objects from leader %s", self.master_id,
                                len(mirror.objects), self.leader)
                elif self.mirror is not None:
                    self.mirror.apply(batch.ops, now)
                    self.mirror.forget_expired(now)
        except AuthenticationError as exc:
            logger.warning("standby %s: refusing leader %s: %s", self.master_id, self.leader, exc)
        except (OSError, ValueError, msgspec.DecodeError) as exc:
            logger.debug("standby %s: connection to leader %s ended: %s", self.master_id, self.leader, exc)
        finally:
            with self._lock:
                self._sock = None
            sock.close()

    def _connect(self) -> socket.socket | None:
        """A socket connected to the leader within CONNECT_TIMEOUT_S (OSError otherwise), or None
        once ``stop()`` was called: a leader whose host was cut off answers no SYN, and a standby
        must not stay waiting on it after etcd named another. A TLS handshake that follows takes
        at most CONNECT_TIMEOUT_S too."""
        family, kind, proto, _, address = socket.getaddrinfo(*self._address, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setblocking(False)
            error = sock.connect_ex(address)
            deadline = time.monotonic() + CONNECT_TIMEOUT_S
            while error in (errno.EINPROGRESS, errno.EALREADY, errno.EWOULDBLOCK):
                if self._stopped:
                    sock.close()
                    return None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no connection within {CONNECT_TIMEOUT_S:.0f} s")
                if select.select([], [sock], [], STOP_POLL_S)[1]:
                    error = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if error:
                raise OSError(error, os.strerror(error))
            sock.settimeout(CONNECT_TIMEOUT_S)  # the TLS handshake's; reads then block (run)
            return sock
        except BaseException:
            sock.close()
            raise

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            if self._sock is not None:
                try:
                    self._sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
