"""A master with a secret (issue 17, item 1): a peer that does not prove the secret can do
nothing, whatever it sends; a client with a secret refuses a master that does not prove it; one
variable (TIDEKV_SECRET) secures engines and master alike."""

from __future__ import annotations

import os
import socket
import time
import typing

import msgspec
import pytest
from tidekv import auth
from tidekv.auth import ClientHandshake
from tidekv.config import MasterConfig, StoreConfig, TransferConfig
from tidekv.errors import AuthenticationError
from tidekv.store.client.store import Store
from tidekv.store.ha.replication import REPLICA_MAGIC, FollowSession
from tidekv.store.master.server import MasterServer
from tidekv.store.wire import protocol as p

from tests.store import wire
from tests.store.conftest import SpawnMaster

SECRET = "s3cret-of-the-pool"
CONFIG = StoreConfig(staging_size_bytes=1 << 20, rpc_timeout_s=5.0, failover_timeout_s=0.0)


def _store(address: str, secret: str | None, segment_size: int = 1 << 20) -> Store:
    return Store.connect(address, segment_size, config=CONFIG, transfer_config=TransferConfig(secret=secret))


def _example(kind: type) -> msgspec.Struct:
    """A well-formed request of each type, naming the victim's client and keys."""
    examples: dict[type, msgspec.Struct] = {
        p.Hello: p.Hello("attacker", p.PROTOCOL_VERSION),
        p.MountSegment: p.MountSegment("victim", "fake", "127.0.0.1:1", 1 << 20, 1 << 40),
        p.UnmountSegment: p.UnmountSegment("victim", "seg"),
        p.Heartbeat: p.Heartbeat("victim"),
        p.Disconnect: p.Disconnect("victim"),
        p.PutStart: p.PutStart("attacker", [b"k"], [4096], upsert=True),
        p.PutBind: p.PutBind("victim", [b"k"], 1, 4096),
        p.PutEnd: p.PutEnd("victim", [b"k"], [1]),
        p.PutRevoke: p.PutRevoke("victim", [b"k"], [0]),
        p.Get: p.Get([b"k"]),
        p.Exists: p.Exists([b"k"]),
        p.Locate: p.Locate([b"k"]),
        p.Remove: p.Remove([b"k"], force=True),
        p.StatsRequest: p.StatsRequest(),
        p.ListKeys: p.ListKeys(True),
        p.Repairs: p.Repairs("victim", [p.RepairResult(b"k", 1, True)]),
        p.ChannelPush: p.ChannelPush("c", [b"k"], 10, 1 << 20),
        p.ChannelPublish: p.ChannelPublish("victim", [b"k"], [1], "c", 10, 1 << 20),
        p.ChannelTake: p.ChannelTake("c", "me", 10, 5.0),
        p.ChannelAck: p.ChannelAck("c", [0]),
        p.ChannelInfo: p.ChannelInfo("c"),
        p.CreateTask: p.CreateTask(0, [b"k"], ["seg"]),
        p.QueryTask: p.QueryTask([1, 2]),
        p.Spills: p.Spills("victim", [p.DiskInfo("d", "e:1", "e:2", 1 << 20)]),
    }
    return examples[kind]


REQUEST_TYPES = typing.get_args(p.Body)


def _refused(sock: socket.socket) -> p.Reply:
    """The master's reply on a connection it must refuse, and that it closed it."""
    reply = p.decode_reply(wire.recv_frame(sock))
    assert reply.error_kind == p.ErrorKind.AUTH and reply.request_id == 0, reply
    sock.settimeout(5)
    assert sock.recv(1) == b"", "the master ends a connection that failed authentication (after its reply)"
    return reply


@pytest.mark.parametrize("kind", REQUEST_TYPES, ids=lambda k: k.__name__)
def test_a_peer_without_the_secret_can_do_nothing(spawn_master: SpawnMaster, kind: type) -> None:
    master = spawn_master(secret=SECRET)
    victim = _store(master.address, SECRET)
    victim.put("k", b"v" * 4096)
    before = victim.stats()
    request = p.frame(p.encode(p.Envelope(p.PROTOCOL_VERSION, 7, _example(kind))))
    host, port = master.address.rsplit(":", 1)
    attempts = {
        "no greeting": lambda s: s.sendall(p.MAGIC + request),
        "no secret": lambda s: wire.authenticate(s, None),  # the master's challenge is answered without one
        "another secret": lambda s: _wrong_proof(s),
    }
    for what, attempt in attempts.items():
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            try:
                attempt(sock)
            except AuthenticationError as exc:  # our client side refuses first: send the request anyway
                assert "requires a shared secret" in str(exc), what
                sock.sendall(p.frame(auth.encode(auth.Proof(b""))))  # what a client without one would prove
            sock.sendall(request)
            reply = _refused(sock)
            assert "secret" in reply.error or "Greeting" in reply.error, (what, reply.error)
    started = time.perf_counter()
    assert victim.get("k") == b"v" * 4096, "the legitimate client's object is untouched"
    next_request_s = time.perf_counter() - started
    after = victim.stats()
    assert (after["keys"], after["clients"], after["segments"]) == (before["keys"], before["clients"], before["segments"])
    assert next_request_s < 1.0, f"the legitimate client's next request took {next_request_s:.3f} s"
    victim.close()


def _wrong_proof(sock: socket.socket) -> None:
    """Greets, then answers the challenge with a proof no one who knows the secret would send."""
    sock.sendall(p.MAGIC + p.frame(ClientHandshake(None, "master", "test").greeting()))
    wire.recv_frame(sock)
    sock.sendall(p.frame(auth.encode(auth.Proof(os.urandom(auth.MAC_BYTES)))))


def test_stores_connect_only_with_the_masters_secret(spawn_master: SpawnMaster) -> None:
    master = spawn_master(secret=SECRET)
    with _store(master.address, SECRET) as st:
        st.put("k", b"hello")
        assert st.get("k") == b"hello"
    with pytest.raises(AuthenticationError, match="requires a shared secret; set TIDEKV_SECRET"):
        _store(master.address, None)
    with pytest.raises(AuthenticationError, match="failed to prove the shared secret"):
        _store(master.address, "another")


def test_a_client_with_a_secret_refuses_a_master_without_one_before_any_request(spawn_master: SpawnMaster) -> None:
    impostor = spawn_master()  # no secret: anyone could run it on the master's address
    with pytest.raises(AuthenticationError, match="does not authenticate"):
        _store(impostor.address, SECRET)
    with _store(impostor.address, None, segment_size=0) as st:
        assert st.stats()["clients"] == 1, "the refused client never said hello there"


def test_the_secret_comes_from_one_variable_or_a_file(tmp_path: typing.Any) -> None:
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    env = {"TIDEKV_SECRET_FILE": str(path)}
    assert MasterConfig.from_env(env).secret == SECRET == TransferConfig.from_env(env).secret
    server = MasterServer(MasterConfig.from_env(env, port=0, metrics_port=-1)).start()
    try:
        with _store(server.address, TransferConfig.from_env(env).secret) as st:
            st.put("k", b"v")
            assert st.get("k") == b"v"
    finally:
        server.stop()


def test_a_standby_must_prove_the_secret_and_the_leader_too(spawn_master: SpawnMaster,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    master = spawn_master(secret=SECRET)
    host, port = master.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:  # a standby with a wrong secret
        handshake = ClientHandshake(None, "master", "leader")
        sock.sendall(REPLICA_MAGIC + p.frame(handshake.greeting()))
        wire.recv_frame(sock)
        sock.sendall(p.frame(auth.encode(auth.Proof(b""))))
        _refused(sock)
    # A standby with another secret refuses the leader (its proof does not verify) and gets no snapshot.
    session = FollowSession(master.address, "standby-x", 5.0, time.monotonic, secret="another")
    with caplog.at_level("WARNING", logger="tidekv.store.ha.replication"):
        session.run()
    assert session.mirror is None
    assert any("failed to prove the shared secret" in r.getMessage() for r in caplog.records)
