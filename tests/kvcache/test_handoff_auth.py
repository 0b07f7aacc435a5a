"""The PD release channel with a secret (issue 17, item 1): a forged release would free blocks a
decode is still reading, so a hold table with a secret takes releases only on a connection whose
releaser proved the secret; releases on a connection that skipped or failed the proof are dropped
(the blocks free at their deadline), and a releaser refuses a hold table that does not prove the
secret."""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator

import pytest
from tidekv import auth, channel
from tidekv.auth import ClientHandshake
from tidekv.kvcache import handoff
from tidekv.kvcache.handoff import HoldRelease, HoldTable, Releaser, ReleaseReason

from tests.store import wire

SECRET = "pd-secret"


@pytest.fixture
def table() -> Iterator[HoldTable]:
    t = HoldTable("127.0.0.1", hold_timeout_s=60.0, secret=SECRET)
    yield t
    t.close()


def _connect(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=5.0)


def _release(rid: str) -> bytes:
    return channel.frame(channel.encode(channel.Envelope(handoff.PROTOCOL_VERSION, 0, HoldRelease(rid, ReleaseReason.PULLED))))


def test_a_releaser_with_the_secret_releases(table: HoldTable) -> None:
    releaser = Releaser(SECRET)
    try:
        table.hold("r")
        releaser.release(table.address, "r")
        assert table.wait(5.0) and table.released() == {"r"}
        table.hold("r2")  # the session is reused
        releaser.release(table.address, "r2")
        assert table.wait(5.0) and table.released() == {"r2"}
    finally:
        releaser.close()


@pytest.mark.parametrize("secret", [None, "another"])
def test_a_releaser_without_the_secret_frees_nothing_and_says_why(table: HoldTable, secret: str | None,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    releaser = Releaser(secret)
    try:
        table.hold("r")
        with caplog.at_level(logging.WARNING, logger="tidekv.kvcache.handoff"):
            releaser.release(table.address, "r")
            assert not table.wait(0.5), "an unauthenticated release must not free the blocks"
            releaser.close()
        assert table.released() == set() and table.is_held("r")
        expected = "requires a shared secret" if secret is None else "failed to prove the shared secret"
        assert any(expected in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
    finally:
        releaser.close()


def test_a_releaser_with_a_secret_refuses_a_hold_table_without_one(caplog: pytest.LogCaptureFixture) -> None:
    open_table = HoldTable("127.0.0.1", hold_timeout_s=60.0)
    releaser = Releaser(SECRET)
    try:
        open_table.hold("r")
        with caplog.at_level(logging.WARNING, logger="tidekv.kvcache.handoff"):
            releaser.release(open_table.address, "r")
            releaser.close()
        assert not open_table.wait(0.3)
        assert any("does not authenticate" in r.getMessage() for r in caplog.records)
    finally:
        open_table.close()


def test_releases_without_a_proof_or_with_a_wrong_one_are_dropped(table: HoldTable) -> None:
    table.hold("skipped")
    skipped = _connect(table.address)  # the magic, then a release where the Greeting belongs
    skipped.sendall(handoff.MAGIC + _release("skipped"))
    table.hold("forged")
    forged = _connect(table.address)  # greets, then sends a made-up proof and a release
    handshake = ClientHandshake(SECRET, "pd", table.address)
    forged.sendall(handoff.MAGIC + channel.frame(handshake.greeting()))
    wire.recv_frame(forged)  # the Challenge
    forged.sendall(channel.frame(auth.encode(auth.Proof(b"\0" * auth.MAC_BYTES))) + _release("forged"))
    refusal = channel.decode_reply(wire.recv_frame(forged))
    assert (refusal.request_id, refusal.error_kind) == (0, channel.ErrorKind.AUTH)
    table.hold("proved")
    proved = _connect(table.address)  # the same bytes after a real proof go through
    wire.authenticate(proved, SECRET, handoff.MAGIC, "pd")
    proved.sendall(_release("proved"))
    try:
        assert table.wait(5.0) and table.released() == {"proved"}
        assert not table.wait(0.3)
        assert table.is_held("skipped") and table.is_held("forged")
    finally:
        for sock in (skipped, forged, proved):
            sock.close()
