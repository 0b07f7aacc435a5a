"""The connection handshake: protocol versions and the shared secret, from both ends.

A raw Python socket plays the peer an engine would never be (another version, no secret); a
``rawwire.FakeServer`` plays a server of another version. Refusals must be typed errors whose
message names both versions, or the secret, and the refusing engine keeps serving.
"""

from __future__ import annotations

import os
import socket
import struct

import pytest

from tests.conftest import MakeEngine, SpawnTarget
from tests.transfer import rawwire
from tests.transfer.harness import TRANSPORTS, TargetProcess, initiator_config
from tests.transfer.reference import pattern
from tidekv import ProtocolVersionError, TransferConfig, TransferEngine, TransferOp, TransferRequest
from tidekv.errors import AuthenticationError

pytestmark = pytest.mark.timeout(60)

WAIT_S = 10.0
SIZE = 64 << 10


def assert_serves(engine: TransferEngine, target: TargetProcess, region: str = "mem") -> None:
    """A fresh READ of the whole region returns the bytes the target was filled with."""
    remote = target.regions[region]
    buf = engine.register(bytearray(remote.length))
    try:
        engine.transfer(
            [TransferRequest(TransferOp.READ, buf.addr(0), remote.length, target.name, remote.addr(0))]
        ).wait(timeout_s=WAIT_S)
        assert buf.view() == pattern(1, remote.length)
    finally:
        engine.unregister(buf)


@pytest.mark.parametrize("version", [99, 0, rawwire.VERSION + 1])
def test_server_refuses_hello_of_another_version(
    version: int, spawn_target: SpawnTarget, make_engine: MakeEngine
) -> None:
    target = spawn_target({"mem": ("alloc", SIZE, 1)})
    with rawwire.connect(target.name) as sock:
        rawwire.send_hello(sock, version=version)
        challenge = rawwire.recv_challenge(sock)
        assert challenge.magic == rawwire.MAGIC
        assert challenge.status == rawwire.STATUS_VERSION_MISMATCH
        assert challenge.version == rawwire.VERSION
        assert rawwire.is_closed_by_peer(sock)
    line = target.wait_for_log(f"speaks tidekv transfer protocol v{version}")
    assert f"this engine speaks v{rawwire.VERSION}" in line, line
    assert target.stats()["connections_refused"] == 1
    engine = make_engine(initiator_config("tcp"))
    engine.connect(target.name)
    assert_serves(engine, target)


@pytest.mark.parametrize("status", [rawwire.STATUS_VERSION_MISMATCH, rawwire.STATUS_OK])
def test_client_refuses_server_of_another_version(status: int, make_engine: MakeEngine) -> None:
    """The server answers our Hello with the next version (saying mismatch, or not saying it)."""
    hellos: list[tuple[int, int]] = []

    def newer_server(sock: socket.socket) -> None:
        magic, version, *_ = rawwire.HELLO.unpack(rawwire.recv_exact(sock, rawwire.HELLO.size))
        hellos.append((magic, version))
        sock.sendall(rawwire.CHALLENGE.pack(rawwire.MAGIC, rawwire.VERSION + 1, status, 0, os.urandom(32)))

    server = rawwire.FakeServer(newer_server)
    try:
        engine = make_engine(initiator_config("tcp"))
        with pytest.raises(ProtocolVersionError) as info:
            engine.connect(server.name)
        message = str(info.value)
        newer = f"v{rawwire.VERSION + 1}"
        assert newer in message and f"v{engine.protocol_version}" in message, message
        assert server.name in message
        assert hellos == [(rawwire.MAGIC, engine.protocol_version)]
        # A transfer() that meets the server first refuses it the same way, before sending anything.
        buf = engine.register(bytearray(16))
        with pytest.raises(ProtocolVersionError, match=newer):
            engine.transfer([TransferRequest(TransferOp.READ, buf.addr(0), 16, server.name, 0x10000)])
        assert len(hellos) == 2
    finally:
        server.close()
    assert not server.errors


def test_client_refuses_descriptor_of_another_version(make_engine: MakeEngine) -> None:
    other = rawwire.VERSION + 1
    server = rawwire.FakeServer(lambda sock: rawwire.serve_handshake(sock, descriptor_version=other))
    try:
        engine = make_engine(initiator_config("tcp"))
        with pytest.raises(ProtocolVersionError) as info:
            engine.connect(server.name)
        assert f"v{other}" in str(info.value) and f"v{engine.protocol_version}" in str(info.value), info.value
    finally:
        server.close()
    assert not server.errors


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_shared_secret(transport: str, spawn_target: SpawnTarget, make_engine: MakeEngine) -> None:
    target = spawn_target({"mem": ("alloc", SIZE, 1)}, secret="s3cret")
    with pytest.raises(AuthenticationError, match="secret"):
        make_engine(initiator_config(transport)).connect(target.name)
    with pytest.raises(AuthenticationError, match="secret"):
        make_engine(initiator_config(transport, secret="wrong")).connect(target.name)
    target.wait_for_log("missing or wrong shared secret")
    engine = make_engine(initiator_config(transport, secret="s3cret"))
    assert engine.connect(target.name) == transport
    assert_serves(engine, target)
    # A transfer that meets the peer first (no connect()) is refused the same way.
    stranger = make_engine(initiator_config(transport, secret="wrong"))
    buf = stranger.register(bytearray(16))
    with pytest.raises(AuthenticationError):
        stranger.transfer(
            [TransferRequest(TransferOp.READ, buf.addr(0), 16, target.name, target.regions["mem"].addr(0))]
        )
    assert bytes(buf.view()) == bytes(16)


def test_an_engine_with_a_secret_refuses_a_peer_without_one(spawn_target: SpawnTarget,
                                                          make_engine: MakeEngine) -> None:
    """Authentication goes both ways: our bytes go only to, and come only from, a peer that proves
    it holds the secret too."""
    open_target = spawn_target({"mem": ("alloc", SIZE, 1)})
    engine = make_engine(initiator_config("tcp", secret="s3cret"))
    with pytest.raises(AuthenticationError, match="does not require the shared secret this engine has"):
        engine.connect(open_target.name)
    buf = engine.register(bytearray(16))
    with pytest.raises(AuthenticationError):
        engine.transfer([TransferRequest(TransferOp.WRITE, buf.addr(0), 16, open_target.name,
                                         open_target.regions["mem"].addr(0))])


def test_an_impostor_that_accepts_any_proof_is_refused(make_engine: MakeEngine) -> None:
    """A server that asks for the secret but does not hold it (it welcomes whatever MAC comes) cannot
    prove itself in its Welcome: the engine refuses it before reading its descriptor."""
    def impostor(sock: socket.socket) -> None:
        rawwire.recv_exact(sock, rawwire.HELLO.size)
        sock.sendall(rawwire.CHALLENGE.pack(rawwire.MAGIC, rawwire.VERSION, rawwire.STATUS_OK, 1, os.urandom(32)))
        rawwire.recv_exact(sock, rawwire.AUTH.size)
        body = rawwire.descriptor()
        sock.sendall(rawwire.WELCOME.pack(rawwire.MAGIC, rawwire.STATUS_OK, len(body), 0, os.urandom(32)) + body)

    server = rawwire.FakeServer(impostor)
    try:
        engine = make_engine(initiator_config("tcp", secret="s3cret"))
        with pytest.raises(AuthenticationError, match="did not prove it holds the shared secret"):
            engine.connect(server.name)
    finally:
        server.close()


def test_secret_is_checked_on_data_connections(spawn_target: SpawnTarget) -> None:
    """A raw client that skips the secret gets no data; one that computes the HMAC gets the bytes."""
    target = spawn_target({"mem": ("bytearray", SIZE, 1)}, secret="s3cret")
    remote = target.regions["mem"]
    for secret in (None, "wrong"):
        sock, status = rawwire.handshake(target.name, secret=secret)
        with sock:
            assert status == rawwire.STATUS_AUTH_FAILED
            try:
                rawwire.send_request(sock, rawwire.OP_READ, remote.addr(0), 64, tag=0)
            except OSError:
                pass  # already closed by the server: as good as refused
            assert rawwire.is_closed_by_peer(sock)
    sock, status = rawwire.handshake(target.name, secret="s3cret")
    with sock:
        assert status == rawwire.STATUS_OK
        rawwire.send_request(sock, rawwire.OP_READ, remote.addr(100), 64, tag=5)
        assert rawwire.recv_response(sock) == (rawwire.STATUS_OK, 64, 5, pattern(1, SIZE)[100:164])


def test_a_data_connection_for_a_transport_the_engine_lacks_is_refused_by_name(spawn_target: SpawnTarget,
                                                                                make_engine: MakeEngine) -> None:
    """A Hello naming a transport wire id this engine does not serve (a foreign client, or the C
    API's endpoint greeting, which a plain engine's listener has no transport for) is refused
    with STATUS_REFUSED; the log names the id, and it counts as refused, not as a limit."""
    target = spawn_target({"mem": ("alloc", SIZE, 1)})
    unknown = 0x7463
    sock, status = rawwire.handshake(target.name, transport=unknown)
    with sock:
        assert status == rawwire.STATUS_REFUSED
        assert rawwire.is_closed_by_peer(sock)
    line = target.wait_for_log(f"transport wire id {unknown}")
    assert "does not serve" in line and "limit" not in line, line
    stats = target.stats()
    assert (stats["connections_refused"], stats["connections_limited"]) == (1, 0), stats
    engine = make_engine(initiator_config("tcp"))
    engine.connect(target.name)
    assert_serves(engine, target)


def test_a_region_proof_connection_is_answered_once_and_only_after_the_secret(make_engine: MakeEngine) -> None:
    """kRegionProof (common/region_proof.h) on the wire: with the secret, one RegionProof gets
    one verdict and the connection closes; without it the Welcome refuses and no verdict comes;
    a malformed proof is dropped and the engine goes on serving."""
    secret = "proof-secret"
    engine = make_engine(TransferConfig(secret=secret))
    region = engine.allocate(1 << 16)
    context = bytes(32)
    proof = engine.region_proof(region, context)
    verdict = struct.Struct("<II")

    def ask(mac: bytes, magic: int = rawwire.MAGIC) -> bytes:
        sock, status = rawwire.handshake(engine.name, secret, conn_type=rawwire.CONN_REGION_PROOF)
        assert status == rawwire.STATUS_OK
        with sock:
            sock.sendall(struct.pack("<IIQQ32s32s", magic, 0, region.address, region.length, context, mac))
            return sock.recv(64) + sock.recv(64)  # the verdict, then the close

    assert ask(proof) == verdict.pack(rawwire.MAGIC, rawwire.STATUS_OK)
    assert ask(bytes(32)) == verdict.pack(rawwire.MAGIC, rawwire.STATUS_AUTH_FAILED)
    assert ask(proof, magic=0x1234) == b"", "a malformed proof is dropped without a verdict"
    sock, status = rawwire.handshake(engine.name, None, conn_type=rawwire.CONN_REGION_PROOF)
    with sock:
        assert status == rawwire.STATUS_AUTH_FAILED
        assert sock.recv(64) == b""
    assert ask(proof) == verdict.pack(rawwire.MAGIC, rawwire.STATUS_OK), "the engine still serves"
