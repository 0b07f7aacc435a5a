"""Wire messages: every request and reply survives encode/decode; garbage is recognised."""

from __future__ import annotations

import msgspec
import pytest
from tidekv.store.wire import protocol as p

REQUESTS = [
    p.Hello("c1", p.PROTOCOL_VERSION),
    p.MountSegment("c1", "eng/seg", "127.0.0.1:1234", 0x7F0000000000, 1 << 30),
    p.UnmountSegment("c1", "eng/seg"),
    p.Heartbeat("c1", lease_expired=3),
    p.Disconnect("c1"),
    p.PutStart("c1", [b"a", b"\x00\xff" * 10], [1, 8 << 20], replicas=2, preferred_segment="s", pin=p.Pin.HARD,
               upsert=True),
    p.PutEnd("c1", [b"a"], [7]),
    p.PutRevoke("c1", [b"a", b"b"], [7, 8]),
    p.Get([b"a", b"b"]),
    p.Exists([b"a"]),
    p.Locate([b"a", b"b"]),
    p.Remove([b"a"], force=True),
    p.StatsRequest(),
]


@pytest.mark.parametrize("body", REQUESTS, ids=lambda b: type(b).__name__)
def test_request_round_trip(body: msgspec.Struct) -> None:
    envelope = p.Envelope(p.PROTOCOL_VERSION, 42, body)
    decoded = p.decode_request(p.encode(envelope))
    assert decoded == envelope
    assert type(decoded.body) is type(body)


def test_reply_round_trip_with_nested_results() -> None:
    slot = p.PutSlot(p.Status.OK, 9, [p.Location("seg", "127.0.0.1:1", 4096, 100)])
    reply = p.decode_reply(p.encode(p.Reply(5, result=[slot])))
    assert reply.request_id == 5 and not reply.error_kind
    assert msgspec.convert(reply.result, list[p.PutSlot]) == [slot]
    result = p.GetResult(p.Status.OK, 100, [p.Location("seg", "e", 1, 100)])
    reply = p.decode_reply(p.encode(p.Reply(6, result=[2.5, [result]])))
    lease, raw = reply.result
    assert lease == 2.5 and msgspec.convert(raw, list[p.GetResult]) == [result]
    error = p.decode_reply(p.encode(p.Reply(7, error_kind="invalid", error="bad")))
    assert (error.error_kind, error.error, error.result) == ("invalid", "bad", None)


def test_garbage_does_not_decode_and_has_no_header() -> None:
    for garbage in (b"", b"\xc1", b"hello world", bytes(range(256))):
        with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
            p.decode_request(garbage)
        assert p.probe_header(garbage) is None


def test_probe_header_reads_version_and_id_of_an_undecodable_request() -> None:
    data = msgspec.msgpack.encode([99, 12, ["future_request", "x"]])
    with pytest.raises(msgspec.ValidationError):
        p.decode_request(data)
    assert p.probe_header(data) == (99, 12)


def test_status_and_pin_values_are_stable() -> None:
    # These integers are on the wire: changing one is a protocol version bump.
    assert [s.value for s in p.Status] == list(range(9))  # QUOTA (7) came with v6, FULL (8) with v9
    assert (p.Pin.NONE, p.Pin.SOFT, p.Pin.HARD) == (0, 1, 2)


def test_client_replies_decode_typed_by_their_request() -> None:
    """The client decodes each reply straight into its request's result type (RESULT_TYPES)."""
    loc = p.Location("h:1/c", "h:1", 4096, 100)
    reply = p.decode_reply(p.encode(p.Reply(6, result=[2.5, [p.GetResult(p.Status.OK, 100, [loc])]])), p.Get)
    assert reply.result == (2.5, [p.GetResult(p.Status.OK, 100, [loc])])
    slots = p.decode_reply(p.encode(p.Reply(5, result=[p.PutSlot(p.Status.OK, 9, [loc])])), p.PutStart).result
    assert slots == [p.PutSlot(p.Status.OK, 9, [loc])]
    refused = p.decode_reply(p.encode(p.Reply(7, error_kind=p.ErrorKind.NOT_READY, error="standby", leader="h:2")),
                             p.Get)
    assert (refused.error_kind, refused.result, refused.leader) == ("not_ready", None, "h:2")
