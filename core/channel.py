"""The control channel every Python control plane speaks: framed msgspec messages over TCP.

A client connects (TLS where configured), sends the channel's 4-byte ``magic``, runs the
``tidekv.auth`` handshake, then every message is a frame (4-byte little-endian length, msgpack):
an ``Envelope`` (protocol version, request id, body) answered by a ``Reply`` (request id, an
``ErrorKind`` and message, or the result) on the same connection, in order. Request id 0 is
one-way. A server that refuses a connection answers a ``Reply`` with id 0 saying why, and closes.
Each channel is a ``Spec``; ``Client``, ``Server`` and ``Backoff`` do the rest.

Neighbours: ``auth`` (the handshake), ``store.wire.protocol``, ``weights.protocol``,
``kvcache.handoff`` (the three specs); ``store.master.connection`` speaks the same wire.
Design notes: docs/channels.md#tidekvchannel
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import os
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import msgspec
from tidekv import eventloop
from tidekv.auth import ClientHandshake, ServerHandshake
from tidekv.errors import (
    AuthenticationError,
    ChannelError,
    ConfigError,
    ProtocolVersionError,
)
from tidekv.hostaddr import is_loopback
from tidekv.logs import WarnEvery
from tidekv.values import format_host_port, parse_host_port

logger = logging.getLogger(__name__)

FRAME_HEADER = 4
"""Bytes of the length prefix of every frame (unsigned, little-endian)."""
MAX_HANDSHAKE_FRAME = 4096
"""A handshake message is ~100 bytes; a longer frame before the proof is not a tidekv peer."""


def frame(payload: bytes) -> bytes:
    """Prefixes ``payload`` with its length."""
    return len(payload).to_bytes(FRAME_HEADER, "little") + payload


class ErrorKind(enum.StrEnum):
    """Why a server refused a whole request (``Reply.error_kind``); each channel uses the kinds
    that apply to it, and its ``Spec.refusal`` turns them into exceptions."""

    VERSION = "version"  # another protocol version
    INVALID = "invalid"  # an argument out of range
    OVERSIZED = "oversized"  # beyond the server's message size limit
    MALFORMED = "malformed"  # not a request
    INTERNAL = "internal"  # the server failed on this request (a bug; logged there); it keeps serving others
    AUTH = "auth"  # the connection failed authentication (request id 0); the server closes it
    NOT_READY = "not_ready"  # store: recovering, or not the leader (``Reply.leader`` names it if known)
    LIMIT = "limit"  # store: this client is at one of its limits
    UNPROVEN = "unproven"  # store: a mount whose engine did not vouch for its proof
    NOT_FOUND = "not_found"  # weights: no such version
    PENDING = "pending"  # weights: that version is not published yet


B = TypeVar("B")
T = TypeVar("T")


class Envelope(msgspec.Struct, Generic[B], array_like=True):
    """A request: the sender's protocol version, its id on the connection (0: one-way), the body."""

    protocol_version: int
    request_id: int
    body: B


class Reply(msgspec.Struct, array_like=True):
    """``error_kind`` set means the whole request failed (``error`` says why); else ``result``
    holds the answer."""

    request_id: int
    error_kind: str = ""
    error: str = ""
    result: object = None
    leader: str = ""  # with error_kind not_ready: the store's leader, when the master knows it


class TypedReply(msgspec.Struct, Generic[T], array_like=True):
    """A ``Reply`` as a client decodes it, its result typed by the request (no second conversion)."""

    request_id: int
    error_kind: str = ""
    error: str = ""
    result: T | None = None
    leader: str = ""


_encoder = msgspec.msgpack.Encoder()
encode = _encoder.encode
_reply_decoder = msgspec.msgpack.Decoder(Reply)


def decode_reply(data: bytes | memoryview) -> Reply:
    return _reply_decoder.decode(data)


def error_reply(request_id: int, kind: ErrorKind, message: str) -> bytes:
    """The encoded (unframed) refusal of request ``request_id``."""
    return encode(Reply(request_id, error_kind=kind, error=message))


class Refused(Exception):
    """Raised by a ``Server`` handler to refuse a request with ``kind`` (the client raises what
    its ``Spec.refusal`` makes of it)."""

    def __init__(self, kind: ErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def default_refusal(kind: str, message: str, peer: str, failed: type[Exception] = ChannelError) -> Exception:
    """The exception for a refusal any channel may get (``failed``: for the kinds that say the
    request was malformed or failed there)."""
    if kind == ErrorKind.VERSION:
        return ProtocolVersionError(message)
    if kind in (ErrorKind.AUTH, ErrorKind.UNPROVEN):
        return AuthenticationError(message, peer=peer)
    if kind in (ErrorKind.INVALID, ErrorKind.OVERSIZED):
        return ConfigError(message)
    return failed(message)


@dataclass(frozen=True)
class Spec:
    """What makes a channel: shared by its client and server ends."""

    label: str
    """The auth label ("master", "weights", "pd") and what logs call the channel."""
    magic: bytes
    """The 4 bytes a client sends first."""
    version: int
    """The protocol version in every Envelope; bumped where the bytes change."""
    body: Any
    """The request types (a tagged msgspec union)."""
    server_name: str
    """How errors name the server ("master", "weights publisher", "hold table")."""
    unavailable: Callable[[str, bool], Exception]
    """The exception for a server that cannot be reached or does not answer: (message, whether
    the request may have reached it)."""
    failed: type[Exception] = ChannelError
    """The exception for a request the server found malformed or failed on, or an unreadable reply."""
    results: Mapping[type, object] = field(default_factory=dict)
    """The result type of each request type's reply (others: any msgpack value)."""
    refusal: Callable[[str, str, str, str], Exception | None] = lambda kind, message, peer, leader: None
    """A channel's own exception for a refusal (kind, message, peer, leader), or None for ``default_refusal``."""
    hint: str = ""
    """Appended to "cannot reach" messages (e.g. "is `tidekv master` running there?")."""


@dataclass(frozen=True, slots=True)
class Backoff:
    """Delays between reconnection attempts: ``initial_s``, times ``factor`` each time, at most
    ``max_s``. The one retry policy of tidekv's clients."""

    initial_s: float = 0.5
    """Delay before the first retry. Default 0.5 s."""
    factor: float = 2.0
    """Growth per failed attempt. Default 2."""
    max_s: float = 10.0
    """Longest delay: a server that comes back is used again at most this long after. Default 10 s."""

    def __post_init__(self) -> None:
        if not 0 < self.initial_s <= self.max_s:
            raise ConfigError(f"initial_s={self.initial_s!r} must be > 0 and <= max_s={self.max_s!r}")
        if self.factor < 1:
            raise ConfigError(f"factor={self.factor!r} must be >= 1")

    def delay_s(self, failures: int) -> float:
        """The wait before the attempt that follows ``failures`` failed ones (0: the first retry)."""
        return min(self.max_s, self.initial_s * self.factor ** min(failures, 64))


class DownUntil:
    """Per-peer "do not try again before" times under a ``Backoff``: ``failed(peer)`` after a
    failure, ``ok(peer)`` after a success, ``due(peer)`` before an attempt. Not thread-safe."""

    def __init__(self, backoff: Backoff | None = None) -> None:
        self.backoff = backoff if backoff is not None else Backoff()
        self._failures: dict[object, int] = {}
        self._until: dict[object, float] = {}

    def due(self, peer: object = None) -> bool:
        return time.monotonic() >= self._until.get(peer, 0.0)

    def failed(self, peer: object = None) -> float:
        """Records a failure; returns the seconds until the next attempt is due."""
        failures = self._failures.get(peer, 0)
        delay = self.backoff.delay_s(failures)
        self._failures[peer] = failures + 1
        self._until[peer] = time.monotonic() + delay
        return delay

    def ok(self, peer: object = None) -> None:
        self._failures.pop(peer, None)
        self._until.pop(peer, None)


_RECV_CHUNK = 1 << 16


class Client:
    """Request/reply with one server over one connection. Thread-safe (one call at a time).

    The connection is made on first use and again after any failure, and authenticated both ways
    (with a secret, the server must prove it before anything is sent). A call that times out
    drops its connection, so a late reply can never be taken for the next call's (request ids are
    checked too). A connection the server closed while idle (it restarted) is replaced before the
    next request goes out, unless ``reconnect_idle`` is off.

    Args:
        address: the server's "host:port".
        spec: the channel.
        timeout_s: default per-call deadline (connecting included).
        secret, tenant: for the handshake (``tidekv.auth``).
        tls: a client TLS context, or None for plain TCP.
        busy_poll_us: spin this long for a reply before sleeping (the store's small gets).
        reconnect_idle: replace a connection the server closed while idle before the next request
            (False where a new connection needs a first request of its own, like the store's hello).
    """

    def __init__(self, address: str, spec: Spec, timeout_s: float, *, secret: str | None = None,
                 tls: ssl.SSLContext | None = None, tenant: str = "", busy_poll_us: int = 0,
                 reconnect_idle: bool = True) -> None:
        self._host, self._port = parse_host_port(address, spec.server_name)
        self.address = address
        self.spec = spec
        self.timeout_s = timeout_s
        self._secret = secret
        self._tenant = tenant
        self._tls = tls
        self._spin_s = busy_poll_us * 1e-6
        self._reconnect_idle = reconnect_idle
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._sock: socket.socket | None = None
        self._poller = select.poll()
        self._buf = bytearray(_RECV_CHUNK)
        self._closed = False
        self._decoders: dict[type, msgspec.msgpack.Decoder[Any]] = {
            t: msgspec.msgpack.Decoder(TypedReply[r]) for t, r in spec.results.items()}  # type: ignore[valid-type]
        self.max_message_bytes: int | None = None
        """Requests longer than this are refused here, before they are sent (None: no limit)."""
        self.server_on_this_host: bool | None = None
        """Whether the server shares this process's network (reached on loopback, or on this
        socket's own address); None until connected."""

    def call(self, body: msgspec.Struct, timeout_s: float | None = None) -> Any:
        """Sends one request and returns its result.

        Raises:
            the spec's ``unavailable`` error: the server cannot be reached or gives no reply in time.
            AuthenticationError: either side did not prove the shared secret.
            whatever the spec's ``refusal`` (else ``default_refusal``) makes of a refusal.
        """
        limit = self.timeout_s if timeout_s is None else timeout_s
        with self._lock:
            request_id = next(self._ids)
            sent = self._exchange(body, request_id, limit, expect_reply=True)
        assert sent is not None
        if sent.error_kind:
            raise self._refused(body, sent)
        return sent.result

    def send(self, body: msgspec.Struct, timeout_s: float | None = None) -> None:
        """Sends a one-way message (no reply). Raises as ``call`` does for the connection."""
        limit = self.timeout_s if timeout_s is None else timeout_s
        with self._lock:
            self._exchange(body, 0, limit, expect_reply=False)

    def _exchange(self, body: msgspec.Struct, request_id: int, limit: float, *,
                  expect_reply: bool) -> TypedReply[Any] | Reply | None:
        spec = self.spec
        name = type(body).__name__
        if self._closed:
            raise spec.unavailable(f"the {spec.label} client of {self.address} is closed", False)
        data = encode(Envelope(spec.version, request_id, body))
        if self.max_message_bytes is not None and len(data) > self.max_message_bytes:
            raise ConfigError(f"{name} request of {len(data)} bytes exceeds {spec.server_name} {self.address}'s "
                              f"limit of {self.max_message_bytes} bytes; split the batch")
        deadline = time.monotonic() + limit
        sent = False
        try:
            if self._reconnect_idle and self._sock is not None and not self._is_quiet(self._sock):
                self._drop()  # closed by the server while idle (or a stray byte): a fresh connection
            sock = self._sock or self._connect(deadline)
            sent = True
            self._send(sock, frame(data), deadline)
            if not expect_reply:
                return None
            raw = self._receive(sock, deadline)
            decoder = self._decoders.get(type(body))
            reply = decoder.decode(raw) if decoder is not None else _reply_decoder.decode(raw)
        except TimeoutError:
            self._drop()
            raise spec.unavailable(f"{spec.server_name} {self.address} did not answer {name} within {limit:.1f} s"
                                   + (f"; {spec.hint}" if spec.hint else ""), sent) from None
        except OSError as exc:
            self._drop()
            raise spec.unavailable(f"lost the connection to {spec.server_name} {self.address}: {exc}", sent) from None
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self._drop()
            raise spec.failed(f"{spec.server_name} {self.address} sent an unreadable reply: {exc}") from None
        if reply.error_kind == ErrorKind.AUTH:
            self._drop()
            raise AuthenticationError(f"{spec.server_name} {self.address} refused this client: {reply.error}",
                                      peer=self.address)
        if reply.request_id != request_id:
            self._drop()
            raise spec.failed(f"{spec.server_name} {self.address} answered request {reply.request_id}, "
                               f"expected {request_id}")
        return reply

    def _refused(self, body: msgspec.Struct, reply: TypedReply[Any] | Reply) -> Exception:
        message = f"{self.spec.server_name} {self.address} refused {type(body).__name__}: {reply.error}"
        if reply.error_kind == ErrorKind.VERSION:
            message = reply.error  # names both versions already
        own = self.spec.refusal(reply.error_kind, message, self.address, reply.leader)
        return own if own is not None else default_refusal(reply.error_kind, message, self.address, self.spec.failed)

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._drop()

    def is_quiet(self) -> bool:
        """Whether the connection is up with nothing to read: a server that went away (closed,
        restarted) makes it readable, and so does a reply another thread awaits -- either way,
        no proof the server is the one it was. Never blocks."""
        sock = self._sock
        return sock is not None and not self._closed and self._is_quiet(sock)

    @staticmethod
    def _is_quiet(sock: socket.socket) -> bool:
        try:
            return not select.select([sock], [], [], 0)[0]
        except (OSError, ValueError):  # closed by another thread meanwhile
            return False

    # ---- the connection -----------------------------------------------------------------

    def _connect(self, deadline: float) -> socket.socket:
        spec = self.spec
        try:
            sock = socket.create_connection((self._host, self._port), timeout=max(deadline - time.monotonic(), 0.001))
        except TimeoutError:
            raise TimeoutError from None
        except OSError as exc:
            raise spec.unavailable(f"cannot reach {spec.server_name} {self.address}: {exc.strerror or exc}"
                                   + (f"; {spec.hint}" if spec.hint else ""), False) from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        local, peer = sock.getsockname()[0], sock.getpeername()[0]
        self.server_on_this_host = local == peer or is_loopback(peer)
        if self._tls is not None:
            sock = self._tls.wrap_socket(sock, server_hostname=self._host, do_handshake_on_connect=False)
        self._poller.register(sock, select.POLLIN)
        try:
            if isinstance(sock, ssl.SSLSocket):
                self._tls_handshake(sock, deadline)
            auth = ClientHandshake(self._secret, spec.label, self.address, self._tenant)
            self._send(sock, spec.magic + frame(auth.greeting()), deadline)
            reply = self._receive(sock, deadline)
            try:
                proof = auth.challenged(reply)
            except AuthenticationError:
                refusal = _refusal(reply, self.address)  # an older server, or one refusing us outright
                if refusal is not None:
                    raise refusal from None
                raise
            # The proof goes out with the first request; a server that rejects it answers that
            # request with an ``auth`` error and closes.
            self._send(sock, frame(proof), deadline)
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
                raise self.spec.unavailable(
                    f"TLS with {self.spec.server_name} {self.address} failed: {exc.reason or exc}; does it serve "
                    "TLS (--tls-cert-file), and does TIDEKV_TLS_CA_FILE hold the CA that signed its certificate?",
                    False) from None

    def _drop(self) -> None:
        if self._sock is not None:
            self._poller.unregister(self._sock)
            self._sock.close()
            self._sock = None

    def _wait(self, sock: socket.socket, events: int, deadline: float) -> None:
        self._poller.modify(sock, events)
        left = deadline - time.monotonic()
        if (left <= 0 or not self._poller.poll(left * 1000 + 1)) and time.monotonic() >= deadline:
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
        need = FRAME_HEADER
        spin_until = time.perf_counter() + self._spin_s
        while True:
            try:
                n = sock.recv_into(memoryview(buf)[have:])
            except (BlockingIOError, ssl.SSLWantReadError):
                if have == 0 and time.perf_counter() < spin_until:
                    # Spin, but hand the core to anything runnable: on a small host the server
                    # and the peer we wait for may be queued behind this very spin.
                    os.sched_yield()
                    continue
                self._wait(sock, select.POLLIN, deadline)
                continue
            if n == 0:
                raise ConnectionResetError(f"the {self.spec.server_name} closed the connection")
            have += n
            if need == FRAME_HEADER and have >= FRAME_HEADER:
                need = FRAME_HEADER + int.from_bytes(buf[:FRAME_HEADER], "little")
                if need > len(buf):
                    buf = bytearray(buf[:have]) + bytearray(need - have)
            if have >= need:
                if have > need:
                    raise ConnectionError(f"the {self.spec.server_name} sent {have - need} bytes beyond its reply")
                return bytes(buf[FRAME_HEADER:need])


def _refusal(data: bytes, peer: str) -> Exception | None:
    """The error a server sent instead of its Challenge, when ``data`` is such a reply."""
    try:
        reply = _reply_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    if not reply.error_kind:
        return None
    return ProtocolVersionError(reply.error) if reply.error_kind == ErrorKind.VERSION else AuthenticationError(
        reply.error, peer=peer)


@dataclass(frozen=True)
class Peer:
    """The client a ``Server`` handler answers: its address and the tenant it proved."""

    address: str
    tenant: str = ""


class Server:
    """Serves one channel on a thread of its own (an asyncio loop): accepts connections, checks the
    magic, runs the handshake, then hands each request's body to ``handler(body, peer)`` and
    answers its result (or the ``Refused`` it raised). Handlers run on that thread, one at a time:
    they must be quick. Stop it with ``close()``.

    Args:
        spec: the channel.
        host, port: where to listen (port 0: a free one); ``address`` is what to advertise.
        handler: answers one request.
        secret: the shared secret peers must prove, or None.
        tick: called on the server's thread every ``tick_s`` (housekeeping), or None.
        tls: a server TLS context, or None.
        max_message_bytes: longer frames close the connection.

    Raises:
        ConfigError: the port cannot be bound.
    """

    def __init__(self, spec: Spec, host: str, port: int, handler: Callable[[Any, Peer], Any], *,
                 secret: str | None = None, tls: ssl.SSLContext | None = None,
                 max_message_bytes: int = 16 << 20, tick: Callable[[], None] | None = None,
                 tick_s: float = 0.1) -> None:
        self.spec = spec
        self._refused = WarnEvery()
        self._handler = handler
        self._secret = secret
        self._tls = tls
        self._max_message = max_message_bytes
        self._decoder = msgspec.msgpack.Decoder(Envelope[spec.body])  # type: ignore[name-defined]
        self._loop = eventloop.new_event_loop()
        self._writers: set[asyncio.StreamWriter] = set()
        try:
            self._server = self._loop.run_until_complete(
                asyncio.start_server(self._serve, host, port, ssl=tls, reuse_address=True))
        except OSError as exc:
            self._loop.close()
            raise ConfigError(f"the {spec.label} channel cannot listen on {format_host_port(host, port)}: "
                              f"{exc.strerror or exc}") from None
        port = self._server.sockets[0].getsockname()[1]
        self.address = format_host_port(host, port)
        if tick is not None:
            self._loop.call_soon(self._tick, tick, tick_s)
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"tidekv-{spec.label}-{port}", daemon=True)
        self._thread.start()

    def _tick(self, tick: Callable[[], None], tick_s: float) -> None:
        try:
            tick()
        except Exception:
            logger.exception("%s channel %s: housekeeping failed", self.spec.label, self.address)
        self._loop.call_later(tick_s, self._tick, tick, tick_s)

    def close(self) -> None:
        """Stops listening and closes every connection. Idempotent."""
        if not self._thread.is_alive():
            return

        async def stop() -> None:
            self._server.close()
            for writer in list(self._writers):
                writer.close()
            await asyncio.sleep(0)

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(timeout=5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peername = writer.get_extra_info("peername")
        peer = format_host_port(peername[0], peername[1]) if isinstance(peername, tuple) else str(peername)
        self._writers.add(writer)
        try:
            await self._converse(reader, writer, peer)
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
            pass  # the peer went away
        except Exception:
            logger.exception("%s channel %s: the connection from %s failed", self.spec.label, self.address, peer)
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _converse(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: str) -> None:
        spec = self.spec
        magic = await reader.readexactly(len(spec.magic))
        if magic != spec.magic:
            logger.warning("%s channel %s: %s sent %r, not a tidekv %s client's greeting; closed", spec.label,
                           self.address, peer, magic, spec.label)
            writer.write(frame(error_reply(0, ErrorKind.MALFORMED, f"not a tidekv {spec.label} channel client")))
            return
        handshake = ServerHandshake(self._secret, spec.label, peer)
        try:
            writer.write(frame(handshake.greeted(await self._frame(reader, MAX_HANDSHAKE_FRAME))))
            handshake.proved(await self._frame(reader, MAX_HANDSHAKE_FRAME))
        except AuthenticationError as exc:
            logger.warning("%s channel %s: %s failed authentication: %s", spec.label, self.address, peer, exc)
            writer.write(frame(error_reply(0, ErrorKind.AUTH, str(exc))))
            await writer.drain()
            return
        client = Peer(peer, handshake.tenant)
        while True:
            data = await self._frame(reader, self._max_message)
            reply = self._answer(data, client)
            if reply is not None:
                writer.write(frame(reply))
                await writer.drain()

    def _answer(self, data: bytes, peer: Peer) -> bytes | None:
        """The encoded reply to one request; None for a one-way message (whose refusal is logged)."""
        try:
            envelope = self._decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            head = probe_header(data)
            if head is not None and head[0] != self.spec.version:
                return self._refuse(head[1], ErrorKind.VERSION, self._version_message(head[0]), peer)
            if head is None:  # not even an envelope: whatever the sender meant, it is told (as request 0)
                self._refuse(0, ErrorKind.MALFORMED, f"not a {self.spec.label} request: {exc}", peer)
                return error_reply(0, ErrorKind.MALFORMED, f"not a {self.spec.label} request: {exc}")
            return self._refuse(head[1], ErrorKind.MALFORMED, f"not a {self.spec.label} request: {exc}", peer)
        request_id = envelope.request_id
        if envelope.protocol_version != self.spec.version:
            return self._refuse(request_id, ErrorKind.VERSION, self._version_message(envelope.protocol_version), peer)
        try:
            result = self._handler(envelope.body, peer)
        except Refused as exc:
            return self._refuse(request_id, exc.kind, str(exc), peer)
        except Exception as exc:
            logger.exception("%s channel %s: %s failed", self.spec.label, self.address, type(envelope.body).__name__)
            return self._refuse(request_id, ErrorKind.INTERNAL, f"the {self.spec.server_name} failed on the "
                                f"request: {exc}", peer)
        return encode(Reply(request_id, result=result)) if request_id else None

    def _refuse(self, request_id: int, kind: ErrorKind, message: str, peer: Peer) -> bytes | None:
        if request_id:
            return error_reply(request_id, kind, message)
        held_back = self._refused.due()
        if held_back is not None:
            logger.warning("%s channel %s dropped a message from %s: %s (%d similar not logged)", self.spec.label,
                           self.address, peer.address, message, held_back)
        return None

    def _version_message(self, version: int) -> str:
        return (f"{self.spec.label} protocol version {version} is not supported; the {self.spec.server_name} at "
                f"{self.address} speaks version {self.spec.version}: run the same tidekv release on both sides")

    @staticmethod
    async def _frame(reader: asyncio.StreamReader, limit: int) -> bytes:
        size = int.from_bytes(await reader.readexactly(FRAME_HEADER), "little")
        if size > limit:
            raise ConnectionError(f"a frame of {size} bytes, beyond the {limit} accepted")
        return await reader.readexactly(size)


_probe = msgspec.msgpack.Decoder(tuple)


def probe_header(data: bytes | memoryview) -> tuple[int, int] | None:
    """(protocol_version, request_id) of an envelope that failed to decode, when that much is readable."""
    try:
        head = _probe.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):  # deep nesting: no header either
        return None
    if len(head) >= 2 and type(head[0]) is int and type(head[1]) is int and 0 <= head[1] < 2**64:
        return head[0], head[1]  # (not bools: a reply must carry an int request id)
    return None
