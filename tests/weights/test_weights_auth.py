"""The weights control channel with a secret (issue 17, item 1): the publisher's engine secret
guards its control channel too; a subscriber that does not prove it gets a typed error, and one
with the secret refuses a publisher that does not prove it."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
import torch
from tidekv import auth, channel
from tidekv.auth import ClientHandshake
from tidekv.config import TransferConfig, WeightsConfig
from tidekv.errors import AuthenticationError
from tidekv.transfer import TransferEngine
from tidekv.weights import Publisher, Subscriber
from tidekv.weights import protocol as p

from tests.store import wire
from tests.weights import procs

SECRET = "weights-secret"
CONFIG = WeightsConfig(chunk_bytes=64 << 10, rpc_timeout_s=5.0)


@pytest.fixture
def engines() -> Iterator[dict[str | None, TransferEngine]]:
    made = {s: TransferEngine(config=TransferConfig(secret=s)) for s in (SECRET, None, "another")}
    yield made
    for engine in made.values():
        engine.close()


def test_a_subscriber_with_the_secret_pulls(engines: dict[str | None, TransferEngine]) -> None:
    tensors = procs.make_tensors(2)
    with Publisher(tensors, config=CONFIG, engine=engines[SECRET]) as pub:
        pub.publish(2)
        subscriber_engine = TransferEngine(config=TransferConfig(secret=SECRET))
        try:
            with Subscriber(pub.address, config=CONFIG, engine=subscriber_engine) as sub:
                for _ in range(2):  # the second pull reuses the session
                    pulled = sub.pull(2)
                    assert all(torch.equal(pulled.tensors[n], t) for n, t in tensors.items())
        finally:
            subscriber_engine.close()


@pytest.mark.parametrize(("secret", "match"), [(None, "requires a shared secret"),
                                               ("another", "failed to prove the shared secret")])
def test_a_subscriber_without_the_secret_learns_nothing(engines: dict[str | None, TransferEngine],
                                                        secret: str | None, match: str) -> None:
    with Publisher(procs.make_tensors(1), config=CONFIG, engine=engines[SECRET]) as pub:
        pub.publish(1)
        with Subscriber(pub.address, config=CONFIG, engine=engines[secret]) as sub:
            with pytest.raises(AuthenticationError, match=match):
                sub.versions()
            with pytest.raises(AuthenticationError, match=match):
                sub.pull(1)
        # Raw requests after a proof of no secret: refused, naming the secret, and nothing answered.
        for request in (p.Versions(), p.Describe(None), p.Join(1, "127.0.0.1:1", 0), p.Leave(1, True)):
            host, port = pub.address.rsplit(":", 1)
            with socket.create_connection((host, int(port)), timeout=5.0) as sock:
                handshake = ClientHandshake(SECRET, "weights", pub.address)  # checks the publisher's proof ...
                sock.sendall(p.MAGIC + channel.frame(handshake.greeting()))
                handshake.challenged(wire.recv_frame(sock))
                sock.sendall(channel.frame(auth.encode(auth.Proof(bytes(auth.MAC_BYTES))))  # ... but proves nothing
                             + channel.frame(channel.encode(channel.Envelope(p.PROTOCOL_VERSION, 1, request))))
                reply = channel.decode_reply(wire.recv_frame(sock))
                assert (reply.request_id, reply.error_kind, reply.result) == (0, channel.ErrorKind.AUTH, None)
                assert "secret" in reply.error


def test_a_subscriber_with_a_secret_refuses_a_publisher_without_one(engines: dict[str | None, TransferEngine]) -> None:
    with Publisher(procs.make_tensors(1), config=CONFIG, engine=engines[None]) as pub:
        pub.publish(1)
        with Subscriber(pub.address, config=CONFIG, engine=engines[SECRET]) as sub, \
                pytest.raises(AuthenticationError, match="does not authenticate"):
            sub.pull(1)
