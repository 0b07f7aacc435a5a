"""MasterChannel: a client's request/reply channel to the master over one TCP connection.

Thread-safe (one call at a time). Frames as ``protocol`` describes them. The connection is made on
first use and again after any failure, and authenticated both ways (``tidekv.auth``: with a
secret, the master must prove it before anything is sent, and the client proves it in turn;
AuthenticationError when either fails, never retried); a call that times out drops its connection, so a late reply
can never be taken for the next call's (request ids are checked too). Errors come back typed, and
this is the one place a master's error reply becomes an exception: MasterUnavailableError when
the master cannot be reached or does not answer in time (saying whether the request may have
reached it), MasterNotReadyError when it answered that it does not serve (recovering, or not the
leader), ProtocolVersionError on version skew, ConfigError for a refused argument. Following a
leader and retrying are ``master_client``'s business, not this channel's.

Why not ZeroMQ (the convention elsewhere): its I/O threads put four thread hand-offs into every
round trip, ~40 µs of the ~60 µs one costs on a 2-vCPU VM, which is all of a small get's budget.
"""

from __future__ import annotations

import itertools
import logging
import os
import select
import socket
import ssl
import threading
import time
from typing import Any

import msgspec

from tidekv.config import DEFAULT_MAX_BATCH_KEYS, parse_host_port
from tidekv.auth import ClientHandshake
from tidekv.hostaddr import is_loopback
from tidekv.errors import (AuthenticationError, ConfigError, LimitExceededError, MasterNotReadyError, MasterUnavailableError,
                           ProtocolVersionError, RpcError)
from tidekv.store import protocol as p

logger = logging.getLogger(__name__)

_RECV_CHUNK = 1 << 16


class MasterChannel:
    def __init__(self, address: str, client_id: str, timeout_s: float, busy_poll_us: int = 0,
                 secret: str | None = None, tls: ssl.SSLContext | None = None, tenant: str = "") -> None:
        self._host, self._port = parse_host_port(address, "master")
        self.address = address
        self._secret = secret
        self._tenant = tenant
        self._tls = tls
        self.client_id = client_id
        self.timeout_s = timeout_s
        self._spin_s = busy_poll_us * 1e-6
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._sock: socket.socket | None = None
        self._poller = select.poll()
        self._buf = bytearray(_RECV_CHUNK)
        self._closed = False
        self.max_message_bytes: int | None = None  # learned from the master's hello reply
        # Likewise; before (or without) a hello, the master's default: a client that never says
        # hello (lookups) still splits its batches.
        self.max_batch_keys: int | None = DEFAULT_MAX_BATCH_KEYS
        self.master_on_this_host: bool | None = None
        """Whether the master shares this process's network (reached on loopback, or on this
        socket's own address); None until connected."""

    def call(self, body: msgspec.Struct, timeout_s: float | None = None) -> Any:
        """Sends one request and returns its result.

        Raises:
            MasterUnavailableError: the master cannot be reached or gives no reply within the timeout.
            ProtocolVersionError: the master speaks another protocol version.
            ConfigError: the master refused an argument.
            RpcError: the master found the request malformed.
        """
        keys = getattr(body, "keys", None)
        if self.max_batch_keys is not None and keys is not None and len(keys) > self.max_batch_keys:
            # More keys than the master takes in one request: in parts, each within its limit.
            parts = p.split_request(body, self.max_batch_keys)
            return p.merge_results(body, [self.call(part, timeout_s) for part in parts])
        limit = self.timeout_s if timeout_s is None else timeout_s
        with self._lock:
            if self._closed:
                raise MasterUnavailableError("store client is closed")
            request_id = next(self._ids)
            data = p.encode(p.Envelope(p.PROTOCOL_VERSION, request_id, body))
            if self.max_message_bytes is not None and len(data) > self.max_message_bytes:
                raise ConfigError(
                    f"{type(body).__name__} request of {len(data)} bytes exceeds master {self.address}'s limit of "
                    f"{self.max_message_bytes} bytes; split the batch"
                )
            deadline = time.monotonic() + limit
            sent = False
            try:
                sock = self._sock or self._connect(deadline)
                sent = True
                self._send(sock, p.frame(data), deadline)
                reply = p.decode_reply(self._receive(sock, deadline), type(body))
            except TimeoutError:
                self._drop()
                raise MasterUnavailableError(
                    f"master {self.address} did not answer {type(body).__name__} within {limit:.1f} s; "
                    "is `tidekv master` running there?", is_request_sent=sent) from None
            except OSError as exc:
                self._drop()
                raise MasterUnavailableError(f"lost the connection to master {self.address}: {exc}",
                                             is_request_sent=sent) from None
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                self._drop()
                raise RpcError(f"master {self.address} sent an unreadable reply: {exc}") from None
            if reply.error_kind == p.ErrorKind.AUTH:
                self._drop()
                raise AuthenticationError(f"master {self.address} refused this client: {reply.error}",
                                          peer=self.address)
            if reply.request_id != request_id:
                self._drop()
                raise RpcError(f"master {self.address} answered request {reply.request_id}, expected {request_id}")
        if reply.error_kind:
            raise self._refused(body, reply)
        return reply.result

    def _refused(self, body: msgspec.Struct, reply: p.Reply | p.TypedReply[object]) -> Exception:
        if reply.error_kind == p.ErrorKind.NOT_READY:
            return MasterNotReadyError(f"master {self.address} refused {type(body).__name__}: {reply.error}",
                                       leader=reply.leader)
        if reply.error_kind == p.ErrorKind.VERSION:
            return ProtocolVersionError(reply.error)
        if reply.error_kind in (p.ErrorKind.INVALID, p.ErrorKind.OVERSIZED):
            return ConfigError(reply.error)
        if reply.error_kind == p.ErrorKind.UNPROVEN:
            return AuthenticationError(f"master {self.address} refused {type(body).__name__}: {reply.error}",
                                       peer=self.address)
        if reply.error_kind == p.ErrorKind.LIMIT:
            return LimitExceededError(f"master {self.address} refused {type(body).__name__}: {reply.error}")
        return RpcError(f"master {self.address} refused {type(body).__name__}: {reply.error}")

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._drop()

    def is_quiet(self) -> bool:
        """Whether the connection is up with nothing to read: a master that went away (closed,
        restarted) makes it readable, and so does a reply another thread awaits - either way,
        no proof the master is the one it was. Never blocks."""
        sock = self._sock
        if sock is None or self._closed:
            return False
        try:
            return not select.select([sock], [], [], 0)[0]
        except (OSError, ValueError):  # closed by another thread meanwhile
            return False

    # ---- the connection -----------------------------------------------------------------

    def _connect(self, deadline: float) -> socket.socket:
        try:
            sock = socket.create_connection((self._host, self._port), timeout=max(deadline - time.monotonic(), 0.001))
        except (TimeoutError, socket.timeout):
            raise TimeoutError from None
        except OSError as exc:
            raise MasterUnavailableError(
                f"cannot reach master {self.address}: {exc.strerror or exc}; is `tidekv master` running there?",
                is_request_sent=False) from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        local, peer = sock.getsockname()[0], sock.getpeername()[0]
        self.master_on_this_host = local == peer or is_loopback(peer)
        if self._tls is not None:
            sock = self._tls.wrap_socket(sock, server_hostname=self._host, do_handshake_on_connect=False)
        self._poller.register(sock, select.POLLIN)
        try:
            if isinstance(sock, ssl.SSLSocket):
                self._tls_handshake(sock, deadline)
            auth = ClientHandshake(self._secret, "master", self.address, self._tenant)
            self._send(sock, p.MAGIC + p.frame(auth.greeting()), deadline)
            reply = self._receive(sock, deadline)
            try:
                proof = auth.challenged(reply)
            except AuthenticationError:
                refusal = _refusal(reply)  # an older master, or one refusing us outright
                if refusal is not None:
                    raise refusal from None
                raise
            # The proof goes out with the first request; a master that rejects it answers that
            # request with an ``auth`` error and closes.
            self._send(sock, p.frame(proof), deadline)
        except BaseException:
            self._poller.unregister(sock)
            sock.close()
            raise
        self._sock = sock
        return sock

    def _tls_handshake(self, sock: ssl.SSLSocket, deadline: float) -> None:
        while True:
            try:
                sock.do_handshake()
                return
            except ssl.SSLWantReadError:
                self._wait(sock, select.POLLIN, deadline)
            except ssl.SSLWantWriteError:
                self._wait(sock, select.POLLOUT, deadline)
            except ssl.SSLError as exc:
                raise MasterUnavailableError(
                    f"TLS with master {self.address} failed: {exc.reason or exc}; does it serve TLS "
                    "(--tls-cert-file), and does TIDEKV_TLS_CA_FILE hold the CA that signed its certificate?",
                    is_request_sent=False) from None

    def _drop(self) -> None:
        if self._sock is not None:
            self._poller.unregister(self._sock)
            self._sock.close()
            self._sock = None

    def _wait(self, sock: socket.socket, events: int, deadline: float) -> None:
        self._poller.modify(sock, events)
        left = deadline - time.monotonic()
        if left <= 0 or not self._poller.poll(left * 1000 + 1):
            if time.monotonic() >= deadline:
                raise TimeoutError

    def _send(self, sock: socket.socket, data: bytes, deadline: float) -> None:
        view = memoryview(data)
        while view:
            try:
                view = view[sock.send(view):]
            except (BlockingIOError, ssl.SSLWantWriteError):
                self._wait(sock, select.POLLOUT, deadline)
            except ssl.SSLWantReadError:  # TLS: renegotiation wants a read first
                self._wait(sock, select.POLLIN, deadline)

    def _receive(self, sock: socket.socket, deadline: float) -> bytes:
        """One whole frame's payload. Spins up to busy_poll_us for the first bytes, then sleeps."""
        buf = self._buf
        have = 0
        need = p.FRAME_HEADER
        spin_until = time.perf_counter() + self._spin_s
        while True:
            try:
                n = sock.recv_into(memoryview(buf)[have:])
            except (BlockingIOError, ssl.SSLWantReadError):
                if have == 0 and time.perf_counter() < spin_until:
                    # Spin, but hand the core to anything runnable: on a small host the master
                    # and the holder we wait for may be queued behind this very spin.
                    os.sched_yield()
                    continue
                self._wait(sock, select.POLLIN, deadline)
                continue
            if n == 0:
                raise ConnectionResetError("the master closed the connection")
            have += n
            if need == p.FRAME_HEADER and have >= p.FRAME_HEADER:
                need = p.FRAME_HEADER + int.from_bytes(buf[: p.FRAME_HEADER], "little")
                if need > len(buf):
                    buf = bytearray(buf[:have]) + bytearray(need - have)
            if have >= need:
                if have > need:
                    raise ConnectionError(f"the master sent {have - need} bytes beyond its reply")
                return bytes(buf[p.FRAME_HEADER: need])


def _refusal(data: bytes) -> Exception | None:
    """The error a master sent instead of its Challenge, when ``data`` is such a reply."""
    try:
        reply = p.decode_reply(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    if reply.error_kind == p.ErrorKind.VERSION:
        return ProtocolVersionError(reply.error)
    return AuthenticationError(reply.error) if reply.error_kind else None
