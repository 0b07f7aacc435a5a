"""Bad bytes on the wire: the engine drops the offending connection and keeps serving the rest.

Server side: a raw socket sends garbage, a bad or truncated handshake, or malformed data frames
to a target engine while a real initiator keeps using its own connection. Client side: a fake
server cuts a handshake or a READ reply short, or never answers; the initiator gets a typed
error within its io timeout.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from tests.conftest import MakeEngine, SpawnTarget
from tests.transfer import rawwire
from tests.transfer.harness import TargetProcess, initiator_config
from tests.transfer.reference import pattern
from tidekv import (
    PeerUnavailableError,
    TransferEngine,
    TransferError,
    TransferOp,
    TransferRequest,
    TransferTimeoutError,
)

pytestmark = pytest.mark.timeout(60)

WAIT_S = 10.0
SIZE = 64 << 10


def assert_serves(engine: TransferEngine, target: TargetProcess) -> None:
    remote = target.regions["mem"]
    buf = engine.register(bytearray(SIZE))
    try:
        engine.transfer([TransferRequest(TransferOp.READ, buf.addr(0), SIZE, target.name, remote.addr(0))]).wait(
            timeout_s=WAIT_S
        )
        assert buf.view() == pattern(1, SIZE)
    finally:
        engine.unregister(buf)


def hello(magic: int = rawwire.MAGIC, conn_type: int = rawwire.CONN_DATA) -> bytes:
    return rawwire.pack_hello(os.urandom(32), magic=magic, conn_type=conn_type)


GARBAGE = {
    "random-bytes": os.urandom(200),
    "http-request": b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"\0" * 64,
    "bad-magic-hello": hello(magic=0xDEADBEEF),
    "unknown-connection-type": hello(conn_type=9),
}


@pytest.mark.parametrize("garbage", GARBAGE.values(), ids=GARBAGE.keys())
def test_garbage_before_handshake_drops_only_that_connection(
    garbage: bytes, spawn_target: SpawnTarget, make_engine: MakeEngine
) -> None:
    target = spawn_target({"mem": ("alloc", SIZE, 1)})
    engine = make_engine(initiator_config("tcp", connections_per_peer=1))
    engine.connect(target.name)
    assert_serves(engine, target)  # opens the one data connection that must survive
    with rawwire.connect(target.name) as sock:
        sock.sendall(garbage)
        assert rawwire.is_closed_by_peer(sock)
    target.wait_for_log("dropped connection from 127.0.0.1")
    assert_serves(engine, target)
    assert make_engine(initiator_config("tcp")).connect(target.name) == "tcp"
    stats = target.stats()
    assert stats["connections_refused"] == 1
    assert engine.stats()["connections_opened"] == 1


def test_stalled_handshake_does_not_block_other_peers(spawn_target: SpawnTarget, make_engine: MakeEngine) -> None:
    """A client that sends a third of a Hello and then nothing occupies only its own connection."""
    target = spawn_target({"mem": ("alloc", SIZE, 1)})
    with rawwire.connect(target.name) as stalled:
        stalled.sendall(hello()[:16])
        engine = make_engine(initiator_config("tcp"))
        engine.connect(target.name)
        assert_serves(engine, target)
    # Hanging up mid-Hello is a truncated handshake: dropped, counted, nothing else disturbed.
    target.wait_for_log("dropped connection from 127.0.0.1")
    assert_serves(engine, target)


BAD_FRAMES: dict[str, Callable[[int], bytes]] = {
    "bad-magic": lambda addr: rawwire.pack_request(rawwire.OP_READ, addr, 16, magic=0x12345678),
    "unknown-op": lambda addr: rawwire.pack_request(7, addr, 16),
    "slice-outside-its-request": lambda addr: rawwire.REQUEST.pack(rawwire.MAGIC, rawwire.OP_READ, addr + 64, 16, 0,
                                                                   addr, 32),
    "random-bytes": lambda addr: os.urandom(rawwire.REQUEST.size),
    "huge-unregistered-write": lambda addr: rawwire.pack_request(rawwire.OP_WRITE, 0x1000, 1 << 40),
}


@pytest.mark.parametrize("frame", BAD_FRAMES.values(), ids=BAD_FRAMES.keys())
def test_malformed_data_frame_drops_the_connection(
    frame: Callable[[int], bytes], spawn_target: SpawnTarget, make_engine: MakeEngine
) -> None:
    target = spawn_target({"mem": ("bytearray", SIZE, 1)})
    engine = make_engine(initiator_config("tcp", connections_per_peer=1))
    engine.connect(target.name)
    assert_serves(engine, target)
    sock, status = rawwire.handshake(target.name)
    with sock:
        assert status == rawwire.STATUS_OK
        sock.sendall(frame(target.regions["mem"].addr(0)))
        assert rawwire.is_closed_by_peer(sock)
    target.wait_for_log("dropped connection from 127.0.0.1")
    assert_serves(engine, target)
    assert target.read("mem", 0, SIZE) == pattern(1, SIZE)


def test_refused_frames_keep_the_connection_usable(spawn_target: SpawnTarget) -> None:
    """A well-formed request for unregistered memory is refused by status, not by hanging up;
    a refused WRITE's payload is skipped so the next frame parses."""
    target = spawn_target({"mem": ("bytearray", SIZE, 1)})
    remote = target.regions["mem"]
    sock, status = rawwire.handshake(target.name)
    with sock:
        assert status == rawwire.STATUS_OK
        rawwire.send_request(sock, rawwire.OP_READ, remote.addr(SIZE - 8), 16, tag=1)
        assert rawwire.recv_response(sock) == (rawwire.STATUS_NOT_REGISTERED, 0, 1, b"")
        rawwire.send_request(sock, rawwire.OP_WRITE, remote.addr(SIZE - 8), 16, tag=2, payload=b"x" * 16)
        assert rawwire.recv_response(sock) == (rawwire.STATUS_NOT_REGISTERED, 0, 2, b"")
        rawwire.send_request(sock, rawwire.OP_WRITE, remote.addr(8), 4, tag=3, payload=b"abcd")
        assert rawwire.recv_response(sock) == (rawwire.STATUS_OK, 0, 3, b"")
        rawwire.send_request(sock, rawwire.OP_READ, remote.addr(0), 16, tag=4)
        expected = bytearray(pattern(1, SIZE))
        expected[8:12] = b"abcd"
        assert rawwire.recv_response(sock) == (rawwire.STATUS_OK, 16, 4, bytes(expected[:16]))
    assert target.read("mem", 0, SIZE) == expected
    assert target.stats()["frames_refused"] == 2


def test_connection_cut_mid_write_payload(spawn_target: SpawnTarget, make_engine: MakeEngine) -> None:
    target = spawn_target({"mem": ("bytearray", SIZE, 1)})
    remote = target.regions["mem"]
    sock, _ = rawwire.handshake(target.name)
    with sock:
        rawwire.send_request(sock, rawwire.OP_WRITE, remote.addr(0), SIZE, tag=0, payload=b"z" * 1000)
    line = target.wait_for_log("dropped connection from 127.0.0.1")
    assert "closed mid-frame" in line or "closed" in line, line
    engine = make_engine(initiator_config("tcp"))
    engine.connect(target.name)
    buf = engine.register(bytearray(b"q" * SIZE))
    engine.transfer([TransferRequest(TransferOp.WRITE, buf.addr(0), SIZE, target.name, remote.addr(0))]).wait(
        timeout_s=WAIT_S
    )
    assert target.read("mem", 0, SIZE) == b"q" * SIZE


# Client side: fake servers that break the protocol.


def run_fake(
    script: Callable[[socket.socket], None], make_engine: MakeEngine, **config: Any
) -> tuple[Any, rawwire.FakeServer]:
    server = rawwire.FakeServer(script)
    return make_engine(initiator_config("tcp", **config)), server


def test_handshake_reply_cut_short(make_engine: MakeEngine) -> None:
    def half_challenge(sock: socket.socket) -> None:
        rawwire.recv_exact(sock, rawwire.HELLO.size)
        sock.sendall(rawwire.CHALLENGE.pack(rawwire.MAGIC, rawwire.VERSION, 0, 0, bytes(32))[:20])

    engine, server = run_fake(half_challenge, make_engine)
    try:
        started = time.monotonic()
        with pytest.raises(PeerUnavailableError, match=server.name):
            engine.connect(server.name)
        assert time.monotonic() - started < WAIT_S
    finally:
        server.close()


def test_server_that_is_not_tidekv(make_engine: MakeEngine) -> None:
    def ssh_server(sock: socket.socket) -> None:
        sock.sendall(b"SSH-2.0-OpenSSH_9.6\r\n".ljust(rawwire.CHALLENGE.size, b"\0"))
        rawwire.is_closed_by_peer(sock, timeout_s=5)

    engine, server = run_fake(ssh_server, make_engine)
    try:
        with pytest.raises(PeerUnavailableError, match="not a tidekv"):
            engine.connect(server.name)
    finally:
        server.close()


def test_silent_server_times_out(make_engine: MakeEngine) -> None:
    gone = threading.Event()

    def silent(sock: socket.socket) -> None:
        gone.wait(WAIT_S)

    engine, server = run_fake(silent, make_engine, io_timeout_s=0.5)
    try:
        started = time.monotonic()
        with pytest.raises(TransferTimeoutError):
            engine.connect(server.name)
        assert time.monotonic() - started < 5
    finally:
        gone.set()
        server.close()


def fake_engine(reply: Callable[[socket.socket, int, int, int], None]) -> Callable[[socket.socket], None]:
    """A server that handshakes like a remote-host engine, then answers each data frame with ``reply``."""

    def script(sock: socket.socket) -> None:
        if rawwire.serve_handshake(sock) == rawwire.CONN_DATA:
            magic, op, addr, length, tag, *_ = rawwire.REQUEST.unpack(rawwire.recv_exact(sock, rawwire.REQUEST.size))
            assert (magic, op) == (rawwire.MAGIC, rawwire.OP_READ)
            reply(sock, addr, length, tag)

    return script


REPLIES: dict[str, tuple[Callable[[socket.socket, int, int, int], None], type[TransferError]]] = {
    "payload-cut-short": (
        lambda sock, addr, n, tag: sock.sendall(rawwire.RESPONSE.pack(rawwire.MAGIC, 0, n, tag, 0) + b"p" * (n // 2)),
        PeerUnavailableError,
    ),
    "header-cut-short": (
        lambda sock, addr, n, tag: sock.sendall(rawwire.RESPONSE.pack(rawwire.MAGIC, 0, n, tag, 0)[:10]),
        PeerUnavailableError,
    ),
    "bad-magic": (
        lambda sock, addr, n, tag: sock.sendall(rawwire.RESPONSE.pack(0xBAD, 0, n, tag, 0) + b"p" * n),
        TransferError,
    ),
    "wrong-tag": (
        lambda sock, addr, n, tag: sock.sendall(rawwire.RESPONSE.pack(rawwire.MAGIC, 0, n, tag + 1, 0) + b"p" * n),
        TransferError,
    ),
    "short-read-reply": (
        lambda sock, addr, n, tag: sock.sendall(
            rawwire.RESPONSE.pack(rawwire.MAGIC, 0, n - 1, tag, 0) + b"p" * (n - 1)
        ),
        TransferError,
    ),
}


@pytest.mark.parametrize("reply,error", REPLIES.values(), ids=REPLIES.keys())
def test_bad_read_reply(
    reply: Callable[[socket.socket, int, int, int], None], error: type[TransferError], make_engine: MakeEngine
) -> None:
    engine, server = run_fake(fake_engine(reply), make_engine, connections_per_peer=1)
    try:
        assert engine.connect(server.name) == "tcp"
        buf = engine.register(bytearray(4096))
        handle = engine.transfer([TransferRequest(TransferOp.READ, buf.addr(0), 4096, server.name, 0x7000_0000)])
        started = time.monotonic()
        with pytest.raises(error) as info:
            handle.wait(timeout_s=WAIT_S)
        assert time.monotonic() - started < WAIT_S
        assert info.value.peer == server.name and info.value.op == "READ"
    finally:
        server.close()
    assert not server.errors, server.errors
