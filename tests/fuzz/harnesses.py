"""Fuzz harnesses for every parser of bytes from the network (issue 17, item 4), one class each.

A harness takes one input (``one(data)``: any bytes) and drives it into a real parser: the
master's connection (framing, magic, the auth handshake, then requests), the auth messages
themselves, the weights publisher's and the PD hold table's ``tidekv.channel`` servers (raw TCP
from a hostile peer, before and after the handshake), the PD contract, the proxy's request
parsing; ``engine_harnesses`` holds the two that go through the native module into a live
transfer engine. ``one`` raises when a property breaks (an exception the parser must not raise,
a reply nobody can decode, a release taken from a connection that did not prove the secret).

Inputs are read through ``fuzzing.Source`` (a plain byte reader), so the same harness runs under
atheris (``benchmarks/fuzz.py``: coverage-guided, hours) and under pytest (``test_harnesses``:
seeds and random mutations, seconds), without atheris installed. ``HARNESSES`` names them all.

Neighbours: ``fuzzing`` (the kit), ``test_parsers`` (hypothesis properties of the master's
messages and the descriptor decoder).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
from collections.abc import Iterator
from typing import Any

import msgspec
from tidekv import auth, channel
from tidekv.auth import ClientHandshake, ServerHandshake
from tidekv.channel import FRAME_HEADER
from tidekv.errors import AuthenticationError, ConfigError, ProtocolVersionError

from tests.fuzz.engine_harnesses import EngineFrames, EngineHandshake
from tests.fuzz.fuzzing import (  # noqa: F401 - the kit, re-exported for the driver and the tests
    KNOWN_BUGS,
    SECRET,
    Hang,
    Harness,
    Source,
    Tally,
    mutations,
    run_one,
    signature,
)
from tests.store.wire import authenticate, recv_frame

# ---- the master's connection: magic, auth handshake, framing, requests -----------------------


class _FakeTransport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.out = bytearray()
        self.closed = False

    def write(self, data: Any) -> None:
        if not self.closed:
            self.out += data

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 40000) if name == "peername" else default

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def _frames(data: bytes) -> list[bytes]:
    from tidekv.store.wire import protocol as p

    out, at = [], 0
    while at < len(data):
        size = int.from_bytes(data[at: at + p.FRAME_HEADER], "little")
        assert at + p.FRAME_HEADER + size <= len(data), "the master wrote a torn frame"
        out.append(data[at + p.FRAME_HEADER: at + p.FRAME_HEADER + size])
        at += p.FRAME_HEADER + size
    return out


class MasterFrames(Harness):
    """Bytes into a master connection (``store.master.connection.MasterConnection``), as the event loop delivers
    them, in chunks: raw; after the magic; after a real greeting; after a whole (right-secret)
    handshake. Every byte the master writes back must be whole frames: the Challenge, then
    replies a client decodes; on a secured master nothing but ``auth`` errors unless the
    handshake was completed; the buffered-bytes books return to zero when the connection ends."""

    name = "master_frames"
    _REBUILD_EVERY = 5000

    def setup(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._count = 0
        self._build()

    def _build(self) -> None:
        from tidekv.config import MasterConfig
        from tidekv.store.master.server import MasterServer

        self._servers = {s: MasterServer(MasterConfig(port=0, metrics_port=-1, busy_poll_us=0, max_batch_keys=1000,
                                                      secret=s)) for s in (None, SECRET)}

    def one(self, data: bytes) -> None:
        self._count += 1
        if self._count % self._REBUILD_EVERY == 0:
            self._build()  # the fuzzed mounts and puts pile up in the service otherwise
        self._loop.run_until_complete(self._one(data))

    async def _one(self, data: bytes) -> None:
        from tidekv.store.master.connection import MasterConnection
        from tidekv.store.wire import protocol as p

        src = Source(data)
        flags = src.byte()
        secret = SECRET if flags & 1 else None
        mode = (flags >> 1) % 4
        self.note(("raw", "after the magic", "after a greeting", "after a whole handshake")[mode] + (", secured" if secret else ""))
        server = self._servers[secret]
        transport = _FakeTransport()
        conn = MasterConnection(server)
        conn.connection_made(transport)
        is_authenticated = False
        if mode >= 1:
            self._feed(conn, transport, p.MAGIC)
        if mode >= 2:
            client = ClientHandshake(secret if mode == 3 else None, "master", "fuzz")
            self._feed(conn, transport, p.frame(client.greeting()))
            if mode == 3:
                challenge = _frames(bytes(transport.out))[0]
                self._feed(conn, transport, p.frame(client.challenged(challenge)))
                is_authenticated = True
        while src.at < len(data) and not transport.closed:
            self._feed(conn, transport, src.take(1 + src.byte() * 64))
        conn.connection_lost(None)
        assert server._buffered == 0 and conn not in server._partial, "buffered-bytes books not back to zero"
        frames = _frames(bytes(transport.out))
        if frames and isinstance(auth.decode_any(frames[0]), auth.Challenge):
            frames.pop(0)  # the answer to a greeting (ours, or one the input made)
        elif mode >= 2:
            raise AssertionError(f"the master answered a greeting with {frames[:1]!r}, not a Challenge")
        for raw in frames:
            reply = p.decode_reply(raw)
            if secret is not None and not is_authenticated:
                assert reply.error_kind == p.ErrorKind.AUTH, f"a secured master answered {reply} before a proof"
            assert reply.error_kind != "internal", reply.error

    @staticmethod
    def _feed(conn: Any, transport: _FakeTransport, chunk: bytes) -> None:
        if transport.closed or not chunk:
            return
        conn._read[: len(chunk)] = chunk
        conn.buffer_updated(len(chunk))

    def seeds(self) -> list[bytes]:
        from tidekv.store.wire import protocol as p

        hello = p.frame(p.encode(p.Envelope(p.PROTOCOL_VERSION, 1, p.Hello("c", 1))))
        get = p.frame(p.encode(p.Envelope(p.PROTOCOL_VERSION, 2, p.Get([b"k"]))))
        return [b"\x06" + b"\x10" + hello + b"\x08" + get, b"\x07" + hello, b"\x00" + p.MAGIC, b"\x04" + get]


# ---- the auth messages ----------------------------------------------------------------------


class AuthMessages(Harness):
    """``tidekv.auth`` fed anything a peer could send: only AuthenticationError may come out, a
    secured side never accepts a proof it did not see made, a real proof altered anywhere never
    passes, and a recorded handshake (its Greeting and Proof) replayed to a fresh server
    handshake never passes, whatever channel it was made for (the stream's one Proof is the
    whole of a connection's authentication: ``tidekv.channel``)."""

    name = "auth_messages"
    _LABELS = ("master", "weights", "pd")

    def one(self, data: bytes) -> None:
        src = Source(data)
        flags = src.byte()
        secret = SECRET if flags & 1 else None
        mode = (flags >> 1) % 6
        self.note(("greeted", "proved", "challenged", "decoded", "altered proof", "replayed proof")[mode]
                  + (", secured" if secret and mode < 3 else ""))
        try:
            if mode == 0:
                challenge = ServerHandshake(secret, "master", "fuzz").greeted(src.rest())
                auth.decode(challenge, auth.Challenge, "fuzz")
            elif mode == 1:
                server = ServerHandshake(secret, "master", "fuzz")
                server.greeted(ClientHandshake(secret, "master", "fuzz").greeting())
                server.proved(src.rest())
                assert secret is None, "a secured server accepted a proof it never saw made"
            elif mode == 2:
                ClientHandshake(secret, "master", "fuzz").challenged(src.rest())
                assert secret is None, "a client with a secret accepted a challenge nobody proved"
            elif mode == 3:
                auth.decode_any(src.rest())
                auth.decode(data[1:], (auth.Greeting, auth.Challenge, auth.Proof)[flags % 3], "fuzz")
            elif mode == 4:
                self._altered(src)
            else:
                self._replayed(src)
        except AuthenticationError:
            pass

    def _altered(self, src: Source) -> None:
        """A real handshake whose Proof is changed (bytes flipped, cut or extended, replaced)."""
        label = self._LABELS[src.byte() % 3]
        client, server = ClientHandshake(SECRET, label, "fuzz"), ServerHandshake(SECRET, label, "fuzz")
        real = auth.decode(client.challenged(server.greeted(client.greeting())), auth.Proof, "fuzz")
        assert isinstance(real, auth.Proof)
        how = src.byte() % 3
        if how == 0:
            mac = bytearray(real.mac)
            for _ in range(1 + src.byte() % 4):
                mac[src.byte() % len(mac)] ^= src.byte()
            forged = bytes(mac)
        elif how == 1:
            forged = real.mac[: src.byte() % (len(real.mac) + 1)] + src.take(src.byte() % 64)
        else:
            forged = src.rest()
        if forged == real.mac:
            return
        server.proved(auth.encode(auth.Proof(forged)))
        raise AssertionError(f"an altered proof passed ({real.mac.hex()} -> {forged.hex()})")

    def _replayed(self, src: Source) -> None:
        """A recorded Greeting and Proof (of one channel and tenant-less) shown to a new server
        handshake of the same or another channel: its fresh nonce makes the old proof worthless."""
        made_for, shown_to = self._LABELS[src.byte() % 3], self._LABELS[src.byte() % 3]
        client, first = ClientHandshake(SECRET, made_for, "fuzz"), ServerHandshake(SECRET, made_for, "fuzz")
        greeting = client.greeting()
        proof = client.challenged(first.greeted(greeting))
        first.proved(proof)  # the recorded connection itself was genuine
        replay = ServerHandshake(SECRET, shown_to, "fuzz")
        replay.greeted(greeting if src.byte() & 1 else ClientHandshake(SECRET, shown_to, "fuzz").greeting())
        replay.proved(proof)
        raise AssertionError(f"a {made_for} proof replayed to a new {shown_to} handshake passed")

    def seeds(self) -> list[bytes]:
        greeting = ClientHandshake(SECRET, "x", "y").greeting()
        return [b"\x00" + greeting, b"\x01" + greeting, b"\x06" + os.urandom(40), b"\x08\x01\x00\x03\x05\x07",
                b"\x08\x02\x01\x20" + os.urandom(8), b"\x08\x00\x02" + os.urandom(32), b"\x0a\x00\x01\x01",
                b"\x0a\x02\x02\x00"]


# ---- the channels of the weights publisher and the PD hold table ----------------------------


def _read_until_closed(sock: socket.socket, deadline_s: float, what: str) -> tuple[bytes, bool]:
    """Everything the server writes until it closes (our side shut down writing): the bytes, and
    whether it reset the connection (it closed with our bytes unread: its last frames may be lost)."""
    out = bytearray()
    end = time.monotonic() + deadline_s
    while True:
        left = end - time.monotonic()
        if left <= 0:
            raise Hang(f"{what} kept a connection open {deadline_s} s after the peer finished sending")
        sock.settimeout(left)
        try:
            chunk = sock.recv(1 << 16)
        except TimeoutError:
            continue  # the deadline check above raises
        except ConnectionResetError:
            return bytes(out), True
        if not chunk:
            return bytes(out), False
        out += chunk


def _split_frames(data: bytes, is_reset: bool) -> list[bytes]:
    """The frames a channel server wrote; a torn last one only when the connection was reset."""
    out, at = [], 0
    while at < len(data):
        size = int.from_bytes(data[at: at + FRAME_HEADER], "little")
        if at + FRAME_HEADER + size > len(data):
            assert is_reset, f"the server wrote a torn frame: {data[at:]!r}"
            break
        out.append(data[at + FRAME_HEADER: at + FRAME_HEADER + size])
        at += FRAME_HEADER + size
    return out


def _frames_in(stream: bytes, at: int, limit: int) -> Iterator[tuple[bytes, int]]:
    """The frames of ``stream`` from ``at`` (each with where the next starts) as a channel server
    reads them: it stops at a torn one or one longer than ``limit`` (and closes)."""
    while at + FRAME_HEADER <= len(stream):
        size = int.from_bytes(stream[at: at + FRAME_HEADER], "little")
        if size > limit or at + FRAME_HEADER + size > len(stream):
            return
        at += FRAME_HEADER + size
        yield stream[at - size: at], at


class _ChannelPeer(Harness):
    """A hostile peer of a ``tidekv.channel`` server, one TCP connection per input: the input's
    bytes go raw; after the magic; after a real greeting (its Challenge read); after a made-up
    (short, long, wrong) Proof; or after a whole, right-secret handshake (``tests.store.wire``).
    What follows the prefix is the input's bytes as they are, cut into frames by the harness, or
    made into envelopes by it (any version and request id, any body bytes). Then this end shuts
    down writing and reads until the server closes, which it must within ``DEADLINE_S``.

    Every frame the server wrote is whole and decodes as a ``Reply`` (after a Challenge, when the
    input greeted), none says ``internal``, a request-id-0 reply is only a refusal (``auth``, which
    closes the connection, or ``malformed``: bad magic, or a frame that is not even an envelope);
    a secured server answers nothing but such a refusal to a connection we did not prove. Every
    ``_CHECK_EVERY`` inputs and at the end, a well-behaved client of each server (with and without
    a secret) is still answered. Subclasses name the server and the spec."""

    DEADLINE_S = 5.0
    _CHECK_EVERY = 100
    MODES = ("raw", "after the magic", "after a greeting", "after a made-up proof", "after a whole handshake")
    TAILS = ("bytes", "frames", "envelopes")

    @property
    def spec(self) -> channel.Spec:
        raise NotImplementedError

    def setup(self) -> None:
        self._count = 0
        self._build()

    def _build(self) -> None:
        raise NotImplementedError

    def _address(self, secret: str | None) -> str:
        raise NotImplementedError

    def _check_alive(self) -> None:
        raise NotImplementedError

    def one(self, data: bytes) -> None:
        src, flags, secret = self.start_input(data)
        mode = (flags >> 1) % len(self.MODES)
        tail = src.byte() % len(self.TAILS)
        self.note(f"{self.MODES[mode]}, {self.TAILS[tail]}" + (", secured" if secret else ""))
        address = self._address(secret)
        self._forget(secret)
        host, port = address.rsplit(":", 1)
        sent = bytearray()
        try:
            sock = socket.create_connection((host, int(port)), timeout=self.DEADLINE_S)
        except TimeoutError:
            raise Hang(f"the {self.spec.server_name} {address} accepted no connection in {self.DEADLINE_S} s") from None
        try:
            try:
                sent += self._prefix(sock, mode, secret, src)
            except TimeoutError:
                raise Hang(f"the {self.spec.server_name} {address} did not answer a greeting") from None
            body = self._tail(tail, src)
            sent += body
            try:
                sock.sendall(body)
                sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass  # it hung up first (a refused handshake, an oversized frame): read what it said
            out, is_reset = _read_until_closed(sock, self.DEADLINE_S, f"the {self.spec.server_name} {address}")
        finally:
            sock.close()
        frames = _split_frames(out, is_reset)
        if mode < 2 and frames and isinstance(auth.decode_any(frames[0]), auth.Challenge):
            frames.pop(0)  # the answer to a greeting the input made
        replies = [channel.decode_reply(f) for f in frames]
        for reply in replies:
            assert reply.error_kind != channel.ErrorKind.INTERNAL, reply
            if reply.request_id == 0:  # no request's answer: a refusal of the connection or of a non-envelope
                assert reply.error_kind in (channel.ErrorKind.AUTH, channel.ErrorKind.MALFORMED), reply
        for reply in replies[:-1]:
            assert reply.error_kind != channel.ErrorKind.AUTH, f"the server went on after refusing a proof: {replies}"
        is_proved = secret is None or mode == 4
        if not is_proved:
            assert all(r.request_id == 0 for r in replies), f"a secured server answered {replies} before a proof"
        self._after(bytes(sent), secret, is_proved)

    def _forget(self, secret: str | None) -> None:
        """Clears what an earlier input left in the server's state (one that failed a check)."""

    def _after(self, sent: bytes, secret: str | None, is_proved: bool) -> None:
        """Checks the server's state after a connection that sent ``sent`` ended."""

    def _prefix(self, sock: socket.socket, mode: int, secret: str | None, src: Source) -> bytes:
        """What goes before the input's own bytes (the Challenge, when greeted, is read here)."""
        spec = self.spec
        if mode == 0:
            return b""
        if mode == 1:
            sock.sendall(spec.magic)
            return spec.magic
        if mode == 4:
            sent = _Recorder(sock)
            authenticate(sent, secret, spec.magic, spec.label)  # type: ignore[arg-type]
            return bytes(sent.sent)
        greeting = spec.magic + channel.frame(ClientHandshake(None, spec.label, "fuzz").greeting())
        sock.sendall(greeting)
        recv_frame(sock)
        if mode == 2:
            return greeting
        proof = channel.frame(auth.encode(auth.Proof(src.take(src.byte() % 65))))
        sock.sendall(proof)
        return greeting + proof

    def _tail(self, tail: int, src: Source) -> bytes:
        if tail == 0:
            return src.rest()
        out = bytearray()
        while src.at < len(src.data):
            size = src.byte()
            if tail == 1:
                out += channel.frame(src.take(size))
                continue
            version = self.spec.version if src.byte() & 1 else src.wide_int()
            request_id = src.wide_int()
            out += channel.frame(channel.encode(channel.Envelope(version, request_id, msgspec.Raw(src.take(size)))))
        return bytes(out)

    def _seeds(self, bodies: list[bytes]) -> list[bytes]:
        """Inputs for each mode and tail around real request ``bodies`` (encoded)."""
        def envelope(body: bytes, request_id: int) -> bytes:  # the ``_tail`` layout: size, version, id, body
            return bytes([len(body), 1, 0, 128 + request_id]) + body

        spec = self.spec
        real = b"".join(channel.frame(channel.encode(channel.Envelope(spec.version, i, msgspec.Raw(b))))
                        for i, b in enumerate(bodies, 1))
        enveloped = b"".join(envelope(b, i) for i, b in enumerate(bodies))
        greeting = channel.frame(ClientHandshake(None, spec.label, "fuzz").greeting())
        proof = channel.frame(auth.encode(auth.Proof(b"p" * 32)))
        return [
            b"\x08\x00" + real, b"\x09\x02" + enveloped, b"\x08\x01" + bytes([len(bodies[0])]) + bodies[0],
            b"\x00\x00" + spec.magic + greeting + proof + real, b"\x01\x00" + spec.magic + greeting + proof + real,
            b"\x02\x00" + greeting + b"\xff\xff\xff\xff", b"\x04\x00" + proof + real, b"\x05\x00" + proof + real,
            b"\x06\x00\x20" + b"m" * 32 + real, b"\x07\x02\x05" + b"short" + enveloped,
            b"\x08\x00" + (16 << 20 | 1).to_bytes(FRAME_HEADER, "little") + b"x" * 16,
            b"\x08\x02" + bytes([len(bodies[0]), 0, 0, 128 + 99, 0, 129]) + bodies[0]]  # version 99


class _Recorder:
    """A socket that keeps what was sent through it (the harness's model of the stream)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self.sent = bytearray()

    def sendall(self, data: bytes) -> None:
        self._sock.sendall(data)
        self.sent += data

    def recv(self, n: int) -> bytes:
        return self._sock.recv(n)


class WeightsControl(_ChannelPeer):
    """The weights publisher's channel (``Publisher`` on ``weights.protocol.SPEC``), with and
    without the engine's secret, as ``_ChannelPeer`` describes: it answers everything it reads
    with a Reply a subscriber decodes, nothing before a proof when secured, and keeps answering
    a real subscriber's ``Versions``."""

    name = "weights_control"
    _REBUILD_EVERY = 20000

    @property
    def spec(self) -> channel.Spec:
        from tidekv.weights import protocol as p

        return p.SPEC

    def setup(self) -> None:
        self._pubs: dict[str | None, Any] = {}
        super().setup()

    def _build(self) -> None:
        import torch
        from tidekv.config import TransferConfig
        from tidekv.transfer import TransferEngine
        from tidekv.weights.publisher import Publisher

        self.close()
        for secret in (None, SECRET):
            engine = TransferEngine(config=TransferConfig(secret=secret))
            pub = Publisher({"w": torch.arange(64, dtype=torch.float32)}, engine=engine)
            pub.publish(1)
            self._pubs[secret] = (pub, engine)

    def close(self) -> None:
        for pub, engine in self._pubs.values():
            pub.close()
            engine.close()
        self._pubs = {}

    def one(self, data: bytes) -> None:
        if self._count and self._count % self._REBUILD_EVERY == 0:
            self._build()  # the fuzzed leases pile up otherwise
        super().one(data)

    def _address(self, secret: str | None) -> str:
        return self._pubs[secret][0].address

    def _check_alive(self) -> None:
        from tidekv.weights import protocol as p

        for secret, (pub, _) in self._pubs.items():
            client = channel.Client(pub.address, p.SPEC, self.DEADLINE_S, secret=secret)
            try:
                assert client.call(p.Versions()) == [1], f"the publisher {pub.address} lost its version"
            finally:
                client.close()

    def report(self) -> dict[str, Any]:
        self._check_alive()
        return super().report()

    def seeds(self) -> list[bytes]:
        from tidekv.weights import protocol as p

        return self._seeds([channel.encode(b) for b in (p.Describe(None), p.Versions(), p.Join(1, "r", 4096),
                                                          p.Leave(1, True), p.Describe(7))])


class PdRelease(_ChannelPeer):
    """The PD hold table's channel (``HoldTable`` on ``kvcache.handoff.SPEC``), with and without a
    secret, as ``_ChannelPeer`` describes; and what the table records from a connection is
    exactly the releases the server should have taken from the bytes it was sent (a model of the
    stream: magic, greeting, proof, then envelopes of this protocol version) -- none at all from
    a connection to a secured table that we did not prove. A real releaser keeps being heard."""

    name = "pd_release"

    @property
    def spec(self) -> channel.Spec:
        from tidekv.kvcache import handoff

        return handoff.SPEC

    def _build(self) -> None:
        from tidekv.kvcache import handoff

        self._tables = {s: handoff.HoldTable("127.0.0.1", 600.0, s) for s in (None, SECRET)}
        self._envelopes = msgspec.msgpack.Decoder(channel.Envelope[handoff.HoldRelease])  # type: ignore[name-defined]

    def close(self) -> None:
        for t in self._tables.values():
            t.close()

    def _address(self, secret: str | None) -> str:
        return self._tables[secret].address

    def _forget(self, secret: str | None) -> None:
        table = self._tables[secret]
        with table._cond:
            table._releases.clear()

    def _after(self, sent: bytes, secret: str | None, is_proved: bool) -> None:
        table = self._tables[secret]
        with table._cond:
            recorded = {r: release for r, (_, release) in table._releases.items()}
            table._releases.clear()
        expected = self._accepted(sent) if is_proved else {}
        assert recorded == expected, f"recorded {recorded}, the stream held {expected}"

    def _accepted(self, stream: bytes) -> dict[str, Any]:
        """The releases a hold table that takes any proof takes from ``stream``."""
        spec = self.spec
        if not stream.startswith(spec.magic):
            return {}
        handshake = _frames_in(stream, len(spec.magic), channel.MAX_HANDSHAKE_FRAME)
        try:
            greeting, _ = next(handshake)
            ServerHandshake(None, spec.label, "model").greeted(greeting)
            proof, at = next(handshake)
            auth.decode(proof, auth.Proof, "model")
        except (StopIteration, AuthenticationError):
            return {}
        out: dict[str, Any] = {}
        for raw, _ in _frames_in(stream, at, 16 << 20):  # the server's max_message_bytes
            try:
                envelope = self._envelopes.decode(raw)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue
            if envelope.protocol_version == spec.version:
                out.setdefault(envelope.body.request_id, envelope.body)
        return out

    def _check_alive(self) -> None:
        from tidekv.kvcache import handoff

        for secret, table in self._tables.items():
            client = channel.Client(table.address, handoff.SPEC, self.DEADLINE_S, secret=secret)
            try:
                client.call(handoff.HoldRelease("alive", handoff.ReleaseReason.PULLED))  # answered once recorded
            finally:
                client.close()
            with table._cond:
                assert "alive" in table._releases, f"the hold table {table.address} stopped recording releases"
                table._releases.clear()

    def report(self) -> dict[str, Any]:
        self._check_alive()
        return super().report()

    def seeds(self) -> list[bytes]:
        from tidekv.kvcache import handoff

        reasons = list(handoff.ReleaseReason)
        return self._seeds([channel.encode(handoff.HoldRelease(f"req-{i}", reason, "d" if i else ""))
                            for i, reason in enumerate(reasons)])


# ---- the PD contract ------------------------------------------------------------------------


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON a peer sends (and NaN breaks the round-trip check)")


def _handoff_params() -> dict[str, Any]:
    from tidekv.kvcache import contract

    rank = contract.RankEndpoint("127.0.0.1:1", {"layers": []}, "127.0.0.1:2")
    return contract.to_params(contract.KVHandoff(request_id="r", engine_id="e", block_ids=[1, 2], num_tokens=30,
                                                 block_size=16, tp_size=1, ranks=[rank]))


class PdContract(Harness):
    """``contract.from_params`` fed any JSON (as ``kv_transfer_params`` arrive), and real params
    with one field replaced: ProtocolVersionError or ConfigError only; what it accepts survives a
    round trip through ``to_params``."""

    name = "pd_contract"

    def one(self, data: bytes) -> None:
        from tidekv.kvcache import contract

        src = Source(data)
        mode, which = src.byte() % 3, src.byte()
        self.note(("any JSON", "real params, one field replaced", "real params, protocol_version replaced")[mode])
        try:
            value = json.loads(src.rest(), parse_constant=_no_constant)
        except (ValueError, RecursionError):  # the engine's JSON parser, not the contract, refuses those
            return
        if mode == 0:
            if not isinstance(value, dict):
                return
            params = value
        else:
            params = _handoff_params()
            names = sorted(params) + ["ranks.0", "ranks.0.engine", "ranks.0.layout", "ranks.0.confirm_address"]
            name = names[which % len(names)] if mode == 1 else "protocol_version"
            if name == "ranks.0":
                params["ranks"] = [value]
            elif name.startswith("ranks.0."):
                params["ranks"] = [dict(params["ranks"][0], **{name[len("ranks.0."):]: value})]
            else:
                params[name] = value
        try:
            handoff = contract.from_params(params)
        except (ProtocolVersionError, ConfigError):
            return
        assert contract.from_params(contract.to_params(handoff)) == handoff

    def seeds(self) -> list[bytes]:
        params = json.dumps(_handoff_params()).encode()
        return [b"\x00\x00" + params, b"\x01\x03" + b'"x"', b"\x02\x00" + b"2", b"\x01\x09" + b"[1,2]"]


# ---- the proxy's request parsing ------------------------------------------------------------


def _nodes(tree: Any) -> Iterator[tuple[Any, Any]]:
    """(container, key) of every value inside a JSON tree."""
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else ()
    for key, value in items:
        yield tree, key
        yield from _nodes(value)


class _Request:
    def __init__(self, body: bytes) -> None:
        self._body = body

    async def read(self) -> bytes:
        return self._body


class ProxyRequest(Harness):
    """A client's request body through everything the proxy does with it before (and after) the
    backends: JSON parsing (``_client_json``: a 400 ProxyError for bad bodies), routing (prefix
    and store policies), the prefill and decode requests built from it, the token ids and
    /tokenize request, the prefill's kv_transfer_params (a store card, blocks to release), and a
    backend's error body. Nothing else may come out; the requests built stay JSON."""

    name = "proxy_request"

    def setup(self) -> None:
        from tidekv.proxy.routing import ProxyConfig, Router, RoutingPolicy

        urls = ("http://127.0.0.1:1", "http://127.0.0.1:2")
        self._prefix = Router(ProxyConfig(prefill_urls=urls, decode_urls=urls[:1], policy=RoutingPolicy.PREFIX,
                                          prefix_chunk_chars=8, prefix_capacity=1024))
        self._store = Router(ProxyConfig(prefill_urls=urls, decode_urls=urls[:1], policy=RoutingPolicy.STORE,
                                         master="127.0.0.1:9"))

    def one(self, data: bytes) -> None:
        from tidekv.proxy import server
        from tidekv.proxy.routing import ProxyError, decode_request, prefill_request
        from tidekv.proxy.store_policy import prompt_token_ids, tokenize_request

        self.note("raw body" if data[:1] == b"{" else "real request, one value replaced")
        if data[:1] == b"{":
            server._error_detail(data)
        else:  # a real request with one of its values (any node of the JSON tree) replaced
            src = Source(data)
            template = json.loads(self.seeds()[src.byte() % 3])
            nodes = list(_nodes(template))
            holder, key = nodes[src.byte() % len(nodes)]
            try:
                holder[key] = json.loads(src.rest(), parse_constant=_no_constant)
            except (ValueError, RecursionError):
                return
            data = json.dumps(template).encode()
        coro = server._client_json(_Request(data))
        try:
            coro.send(None)
        except StopIteration as done:
            body = done.value
        except ProxyError as exc:
            assert exc.status == 400, exc
            return
        else:
            raise AssertionError("_client_json awaited something")
        self._prefix.pick_prefill(body)
        first = prefill_request(body)
        assert first["max_tokens"] == 1 and first["stream"] is False
        kv = body.get("kv_transfer_params")
        kv = kv if isinstance(kv, dict) else None
        second = decode_request(body, kv)
        json.dumps(first), json.dumps(second)
        tokens = prompt_token_ids(body)
        assert tokens is None or all(type(t) is int for t in tokens)
        tokenize_request(body)
        if kv is not None:
            server._held_blocks(kv)
            self._store.learn(self._store.config.prefill_urls[0], kv)

    def seeds(self) -> list[bytes]:
        return [json.dumps({"model": "m", "prompt": "hello world, again", "max_tokens": 5}).encode(),
                json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}).encode(),
                json.dumps({"prompt": [[1, 2, 3]], "kv_transfer_params": _handoff_params()}).encode(), b"{}"]


HARNESSES: dict[str, type[Harness]] = {h.name: h for h in (
    MasterFrames, AuthMessages, WeightsControl, PdRelease, PdContract, ProxyRequest, EngineHandshake, EngineFrames)}
