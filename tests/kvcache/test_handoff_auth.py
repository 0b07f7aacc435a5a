"""The PD release channel with a secret (issue 17, item 1): a forged release would free blocks a
decode is still reading, so a hold table with a secret takes only releases sealed by a session
whose releaser proved the secret; unsealed, forged and replayed ones are dropped (the blocks free
at their deadline), and a releaser refuses a hold table that does not prove the secret."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import zmq
from tidekv.auth import ClientHandshake
from tidekv.kvcache import handoff
from tidekv.kvcache.contract import PROTOCOL_VERSION
from tidekv.kvcache.handoff import HoldRelease, HoldTable, Releaser, ReleaseReason

SECRET = "pd-secret"


@pytest.fixture
def table() -> Iterator[HoldTable]:
    t = HoldTable("127.0.0.1", hold_timeout_s=60.0, secret=SECRET)
    yield t
    t.close()


def _dealer(address: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{address}")
    return sock


def _release(rid: str) -> bytes:
    return handoff._encode(HoldRelease(PROTOCOL_VERSION, rid, ReleaseReason.PULLED))


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


def test_plain_forged_and_replayed_releases_are_dropped(table: HoldTable) -> None:
    sock = _dealer(table.address)
    try:
        table.hold("plain")
        sock.send(_release("plain"))  # no session at all
        handshake = ClientHandshake(SECRET, "pd", table.address)
        sock.send(handshake.greeting())
        assert sock.poll(5000)
        handshake.challenged(sock.recv())
        sealer = handshake.sealer
        assert sealer is not None
        old, new = sealer.seal(_release("replayed")), sealer.seal(_release("fresh"))
        table.hold("fresh")
        sock.send(new)
        assert table.wait(5.0) and table.released() == {"fresh"}
        table.hold("replayed")
        sock.send(old)  # an older sequence number than one already taken: a replay
        forged = bytearray(sealer.seal(_release("forged")))
        forged[-3] ^= 1  # one bit of the body changed after sealing
        table.hold("forged")
        sock.send(bytes(forged))
        assert not table.wait(0.5)
        assert {r for r in ("plain", "replayed", "forged") if table.is_held(r)} == {"plain", "replayed", "forged"}
    finally:
        sock.close()
