"""The master against requests that are well-formed but hostile or absurd: each is refused with a
typed error and the master keeps serving (issue 17's findings: a mount at the top of the address
space broke every later stats and put; deep msgpack escaped the handler)."""

from __future__ import annotations

import pytest
from tidekv.store.master.session import Session
from tidekv.store.wire import protocol as p

from tests.store.rig import RpcFailed, ServiceRig


def test_a_segment_past_the_address_space_is_refused_and_nothing_breaks() -> None:
    rig = ServiceRig()
    rig.hello("c1")
    for base, capacity in ((2**64 - 4096, 1 << 20), (2**64 - 1, 2), (2, 2**64 - 1)):
        with pytest.raises(RpcFailed) as info:
            rig.call(p.MountSegment("c1", f"seg-{base}", "e", base, capacity))
        assert info.value.kind == "invalid" and "64-bit address space" in info.value.message
    rig.mount("c1", "good", 1 << 20)  # the master still mounts, puts and reports
    slot = rig.put("c1", b"k", 4096)
    assert slot is not None
    assert rig.call(p.StatsRequest()) is not None


def test_deeply_nested_msgpack_is_malformed_not_a_crash() -> None:
    rig = ServiceRig()
    deep = b"\x91" * 100_000 + b"\xc0"  # 100k nested one-element arrays around nil
    reply = p.decode_reply(rig.service.handle(deep))
    assert reply.error_kind == "malformed", reply
    rig.hello("c1")  # and it serves on


def test_a_handler_failure_is_an_internal_error_and_the_master_serves_on(monkeypatch: pytest.MonkeyPatch) -> None:
    rig = ServiceRig()
    rig.hello("c1")

    def broken(body: object, now: float) -> object:
        raise OverflowError("int too big to convert")

    monkeypatch.setitem(rig.service._handlers, p.StatsRequest, broken)
    with pytest.raises(RpcFailed) as info:
        rig.call(p.StatsRequest())
    assert info.value.kind == "internal" and "OverflowError" in info.value.message
    assert rig.heartbeat("c1") in (True, False)  # still serving


def test_a_request_naming_too_many_keys_is_refused_naming_the_limit() -> None:
    rig = ServiceRig(max_batch_keys=1000)
    rig.hello("c1")
    with pytest.raises(RpcFailed) as info:
        rig.call(p.Get([b"k%d" % i for i in range(1001)]))
    assert info.value.kind == "oversized" and "1001 keys" in info.value.message
    assert "limit of 1000 keys per request (max_batch_keys)" in info.value.message
    assert rig.call(p.Get([b"k%d" % i for i in range(1000)])) is not None  # at the limit: served
    assert rig.hello("c2")["max_batch_keys"] == 1000  # clients learn it and fail fast themselves


def test_a_connection_acts_for_the_client_it_said_hello_as_only() -> None:
    """No request can name another client: not a Disconnect (all its objects gone at once), not a
    Mount, a Heartbeat or a put in its name."""
    rig = ServiceRig()
    rig.hello("victim")
    rig.mount("victim", "seg", 1 << 20)
    rig.put("victim", b"k", 4096)
    attacker = Session()

    def on_attacker(body: object) -> p.Reply:
        return p.decode_reply(rig.service.handle(p.encode(p.Envelope(p.PROTOCOL_VERSION, 1, body)), attacker))

    reply = on_attacker(p.Disconnect("victim"))
    assert reply.error_kind == "invalid" and "has not said hello" in reply.error
    assert on_attacker(p.Hello("attacker", p.PROTOCOL_VERSION)).error_kind == ""
    for body in (p.Disconnect("victim"), p.Heartbeat("victim"), p.PutStart("victim", [b"x"], [8], 1, "", 0, False),
                 p.MountSegment("victim", "seg2", "e", 1 << 40, 1 << 20)):
        reply = on_attacker(body)
        assert reply.error_kind == "invalid" and "said hello as 'attacker'" in reply.error, (body, reply)
    reply = on_attacker(p.Hello("victim", p.PROTOCOL_VERSION))
    assert reply.error_kind == "invalid" and "cannot say hello as 'victim'" in reply.error
    assert rig.call(p.Exists([b"k"])) == [True]  # the victim's object is still there
    assert on_attacker(p.Exists([b"k"])).result == [True]  # requests that name no client are anyone's
