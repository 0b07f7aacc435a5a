"""Channels on the master (``tidekv.store.master.channels``) on a fake clock: bounds, order,
visibility and redelivery, acks removing objects, objects that vanish, tenants, and every
unacknowledged item surviving a journal replay with its seq (seqs never reused)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from tidekv.store.master.journal import JournalFile, Mirror
from tidekv.store.wire import protocol as p
from tidekv.store.wire.protocol import Pin, Status

from tests.store.rig import ServiceRig, flush_journal, reloaded

PAGE = 4096


def _rig(**config: object) -> ServiceRig:
    rig = ServiceRig(**{"lease_ttl_s": 0.0, **config})
    rig.hello("h")
    rig.hello("w")
    rig.mount("h", "seg-h", 64 * PAGE)
    return rig


def _push(rig: ServiceRig, keys: list[bytes], max_items: int = 100, max_bytes: int = 1 << 30,
          channel: str = "c", client: str = "w") -> tuple[list[int], list[int]]:
    for key in keys:
        if not rig.exists(key, client=client):
            rig.put(client, key, PAGE, pin=Pin.HARD)
    statuses, seqs = rig.call(p.ChannelPush(channel, keys, max_items, max_bytes), client)
    return list(statuses), list(seqs)


def _take(rig: ServiceRig, n: int = 10, consumer: str = "a", visibility_s: float = 5.0,
          client: str = "w") -> list[p.ChannelItem]:
    _, items = rig.call(p.ChannelTake("c", consumer, n, visibility_s), client)
    return msgspec.convert(items, list[p.ChannelItem])


def test_items_come_out_in_order_and_acks_remove_their_objects() -> None:
    rig = _rig()
    statuses, seqs = _push(rig, [b"k0", b"k1", b"k2"])
    assert statuses == [Status.OK] * 3 and seqs == [0, 1, 2]
    got = _take(rig, 2)
    assert [(i.seq, i.key, i.size) for i in got] == [(0, b"k0", PAGE), (1, b"k1", PAGE)]
    assert [i.seq for i in _take(rig, 5, consumer="b")] == [2]  # the taken ones are hidden
    assert rig.call(p.ChannelAck("c", [0, 1, 7]), "w") == [Status.OK, Status.OK, Status.NOT_FOUND]
    assert not rig.exists(b"k0") and not rig.exists(b"k1") and rig.exists(b"k2")
    assert rig.call(p.ChannelInfo("c"), "w") == {"items": 1, "ready": 0, "taken": 1, "bytes": PAGE, "next_seq": 3,
                                                 "lost": 0}


def test_a_push_sent_again_appends_nothing_twice() -> None:
    """A push whose reply was lost is sent again by the client (``master_client`` retries it):
    a key already in the channel is answered with its seq, and only the new one is appended."""
    rig = _rig()
    assert _push(rig, [b"k0", b"k1"]) == ([Status.OK] * 2, [0, 1])
    assert _push(rig, [b"k1", b"k2"]) == ([Status.OK] * 2, [1, 2])
    assert rig.call(p.ChannelInfo("c"), "w")["items"] == 3
    rig.call(p.ChannelAck("c", [1]), "w")
    assert rig.call(p.ChannelPush("c", [b"k1"], 100, 1 << 30), "w")[0] == [Status.NOT_FOUND], \
        "an acked item's object is gone: nothing to append"


def test_a_publish_ends_the_puts_and_appends_what_it_ended_in_one_request() -> None:
    """``ChannelPublish``: a producer's PutEnd and ChannelPush in one round trip. A put that
    does not end (a wrong token) is not appended; one the bound refuses is published but not
    appended, and a push appends it later; sent again, it appends nothing twice."""
    rig = _rig()
    slots = [rig.put_start("w", k, PAGE, pin=Pin.HARD) for k in (b"k0", b"k1", b"k2")]
    tokens = [slots[0].token, slots[1].token + 999, slots[2].token]
    publish = p.ChannelPublish("w", [b"k0", b"k1", b"k2"], tokens, "c", 1, 1 << 30)
    ended, appended, seqs = rig.call(publish, "w")
    assert ended[0] == ended[2] == Status.OK and ended[1] != Status.OK
    assert appended == [Status.OK, Status.NOT_FOUND, Status.FULL] and seqs == [0, -1, -1]
    assert rig.exists(b"k2") and not rig.exists(b"k1")
    assert rig.call(publish, "w")[1:] == [[Status.OK, Status.NOT_FOUND, Status.FULL], [0, -1, -1]]
    rig.call(p.ChannelAck("c", [0]), "w")
    assert _push(rig, [b"k2"]) == ([Status.OK], [1])
    assert [(i.seq, i.key) for i in _take(rig)] == [(1, b"k2")]


def test_a_take_acks_what_it_carries_before_taking() -> None:
    """``ChannelTake.acks``: the consume loop's one round trip per batch; the acked items and
    their objects are gone, and the room they left is taken at once."""
    rig = _rig()
    _push(rig, [b"k0", b"k1", b"k2", b"k3"])
    first = _take(rig, 2)
    _, items = rig.call(p.ChannelTake("c", "a", 10, 5.0, [i.seq for i in first]), "w")
    assert [i.seq for i in msgspec.convert(items, list[p.ChannelItem])] == [2, 3]
    assert not rig.exists(b"k0") and not rig.exists(b"k1") and rig.exists(b"k2")
    assert rig.call(p.ChannelInfo("c"), "w")["items"] == 2
    assert rig.call(p.ChannelAck("c", [0, 1]), "w") == [Status.NOT_FOUND] * 2  # acked by the take


def test_a_push_past_the_bound_is_refused_per_key() -> None:
    rig = _rig()
    statuses, seqs = _push(rig, [b"a", b"b", b"c"], max_items=2)
    assert statuses == [Status.OK, Status.OK, Status.FULL] and seqs == [0, 1, -1]
    assert _push(rig, [b"d"], max_bytes=2 * PAGE)[0] == [Status.FULL]
    rig.call(p.ChannelAck("c", [0]), "w")
    assert _push(rig, [b"c"], max_items=2) == ([Status.OK], [2])
    assert _push(rig, [b"never-put"])[0] == [Status.OK]  # put by _push; a key with no object:
    assert rig.call(p.ChannelPush("c", [b"no-such-object"], 100, 1 << 30), "w") == [[Status.NOT_FOUND], [-1]]


def test_an_item_not_acked_in_time_is_handed_out_again() -> None:
    rig = _rig()
    _push(rig, [b"k0", b"k1"])
    assert [i.seq for i in _take(rig, 1, consumer="dies", visibility_s=2.0)] == [0]
    assert [i.seq for i in _take(rig, 5, consumer="b")] == [1]
    rig.advance(2.1)
    assert [i.seq for i in _take(rig, 5, consumer="b")] == [0]  # at least once: the dead consumer's item
    assert rig.call(p.ChannelAck("c", [0, 1]), "w") == [Status.OK, Status.OK]
    assert _take(rig) == []


def test_an_item_whose_object_vanished_is_dropped_and_counted() -> None:
    rig = _rig()
    _push(rig, [b"k0", b"k1"])
    assert rig.remove(b"k0", force=True) == Status.OK
    assert [i.seq for i in _take(rig)] == [1]
    assert rig.call(p.ChannelInfo("c"), "w")["lost"] == 1


def test_unacknowledged_items_and_the_counter_survive_a_journal_replay(tmp_path: Path) -> None:
    rig = _rig()
    rig.service.enable_journal()
    journal = JournalFile(tmp_path)
    journal.load(Mirror(0.0), 0.0)
    journal.resume()
    _push(rig, [b"k0", b"k1", b"k2"])
    _take(rig, 1)  # taken, not acked: ready again after the replay
    rig.call(p.ChannelAck("c", [1]), "w")
    flush_journal(rig, journal)
    journal.rewrite(rig.service.snapshot())  # compaction keeps them too
    _push(rig, [b"k3"])
    flush_journal(rig, journal)
    journal.close()

    restored = reloaded(tmp_path)
    restored.hello("w")
    assert [(i.seq, i.key) for i in _take(restored, 10)] == [(0, b"k0"), (2, b"k2"), (3, b"k3")]
    assert _push(restored, [b"k0", b"k4"])[1] == [0, 4]  # k0 is in it already; seqs are not reused


@pytest.mark.parametrize("start", [1000.0, 1000.1234567891])  # a clock a lease's 2^-20 s ticks do not hold exactly
def test_a_take_leases_its_items_and_the_holders_ack_frees_their_bytes_at_once(start: float) -> None:
    rig = _rig(lease_ttl_s=3.0)
    rig.clock.now = start
    _push(rig, [b"k0", b"k1"])
    lease_s, raw = rig.call(p.ChannelTake("c", "a", 5, 1.0), "w")
    items = msgspec.convert(raw, list[p.ChannelItem])
    assert lease_s == 3.0 and [loc.segment for loc in items[0].locations] == ["seg-h"]
    assert rig.remove(b"k0") == Status.LEASED  # the take leased them, as a get does
    rig.advance(1.5)
    assert _take(rig, consumer="b") == []  # visibility (1 s) is over, the lease (3 s) is not: still hidden
    assert rig.call(p.ChannelAck("c", [0], "a"), "w") == [Status.OK]  # the holder: freed at once
    assert rig.stats()["used_bytes"] == PAGE
    rig.get(b"k1")  # someone else leases k1 too: an ack must not free what another reader may be reading
    assert rig.call(p.ChannelAck("c", [1], "a"), "w") == [Status.OK]
    assert rig.stats()["used_bytes"] == PAGE
    rig.advance(3.1)
    assert rig.stats()["used_bytes"] == 0
