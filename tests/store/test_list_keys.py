"""``ListKeys``: a connection pages through the keys of complete objects as they were when its
listing began; every page is bounded work; at most MAX_LISTINGS connections list at once."""

from __future__ import annotations

import msgspec
import pytest
from tidekv.store.master import listing
from tidekv.store.master.session import Session
from tidekv.store.wire import protocol as p

from tests.store.rig import ServiceRig


def _page(rig: ServiceRig, session: Session, start: bool, limit: int = 1024) -> tuple[list[bytes], bool]:
    data = p.encode(p.Envelope(p.PROTOCOL_VERSION, 1, p.ListKeys(start, limit)))
    reply = p.decode_reply(rig.service.handle(data, session), p.ListKeys)
    if reply.error_kind:
        raise AssertionError(f"{reply.error_kind}: {reply.error}")
    return msgspec.convert(reply.result, tuple[list[bytes], bool])


def _all(rig: ServiceRig, session: Session, limit: int) -> list[bytes]:
    out, start = [], True
    while True:
        page, is_last = _page(rig, session, start, limit)
        assert len(page) <= limit
        out += page
        start = False
        if is_last:
            return out


def test_pages_cover_every_complete_key_once() -> None:
    rig = ServiceRig()
    rig.hello("c")
    rig.mount("c", "seg", 64 << 20)
    keys = {b"k%d" % i for i in range(2500)}
    for k in keys:
        rig.put("c", k, 16)
    rig.put_start("c", b"pending", 16)  # started, never ended: not listed
    session = Session()
    listed = _all(rig, session, 1000)
    assert len(listed) == len(keys) and set(listed) == keys
    assert session.listing is None, "an exhausted listing is let go"


def test_a_key_removed_meanwhile_is_skipped_and_one_put_meanwhile_is_not_listed() -> None:
    rig = ServiceRig()
    rig.hello("c")
    rig.mount("c", "seg", 64 << 20)
    for i in range(100):
        rig.put("c", b"k%d" % i, 16)
    session = Session()
    first, is_last = _page(rig, session, True, 10)
    assert len(first) == 10 and not is_last
    gone = {b"k%d" % i for i in range(100)} - set(first)
    removed = sorted(gone)[:30]
    for k in removed:
        rig.remove(k)
    rig.put("c", b"new", 16)
    rest = _all_continuing(rig, session)
    assert set(first) | set(rest) == {b"k%d" % i for i in range(100)} - set(removed)


def _all_continuing(rig: ServiceRig, session: Session) -> list[bytes]:
    out = []
    while True:
        page, is_last = _page(rig, session, False, 10)
        out += page
        if is_last:
            return out


def test_refusals_name_the_limit_and_the_missing_listing(monkeypatch: pytest.MonkeyPatch) -> None:
    rig = ServiceRig(max_batch_keys=100)
    session = Session()
    with pytest.raises(AssertionError, match=r"invalid: ListKeys limit=101 is out of range; allowed 1..100"):
        _page(rig, session, True, 101)
    with pytest.raises(AssertionError, match="without a listing on this connection"):
        _page(rig, session, False, 10)
    monkeypatch.setattr(listing, "MAX_LISTINGS", 2)
    rig.hello("c")
    rig.mount("c", "seg", 1 << 20)
    rig.put("c", b"k", 16)
    rig.put("c", b"j", 16)
    holders = [Session(), Session()]
    for s in holders:
        assert _page(rig, s, True, 1)[1] is False  # each holds a listing now
    with pytest.raises(AssertionError, match="2 connections are listing keys already"):
        _page(rig, Session(), True, 1)
    _page(rig, holders[0], False, 1)  # finishes: a place is free again
    assert _page(rig, Session(), True, 10)[0] != []
