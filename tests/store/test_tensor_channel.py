"""TensorChannel end to end: producers and consumers in separate processes over a real master and
holder; order and bytes, back-pressure (refuse and block), a consumer that dies holding items
(redelivered, nothing lost), at-least-once delivery made exactly-once by seq, and waits on the
master (a waiting take or producer is answered when the channel changes, not by polling)."""

from __future__ import annotations

import re
import threading
import time
import urllib.request

import pytest
from tidekv.errors import ChannelFullError, ConfigError
from tidekv.store import Store

from tests.store.conftest import Connect, SpawnAgent
from tests.store.payload import digest, payload
from tests.store.procs import MasterProcess

torch = pytest.importorskip("torch", reason="the tensor channel moves torch tensors (a test dependency)")

SEGMENT = 64 << 20
SIZE = 64 << 10


@pytest.fixture
def store(master: MasterProcess, spawn_agent: SpawnAgent, connect: Connect) -> Store:
    spawn_agent(master.address, SEGMENT)
    return connect(master.address)


def _tensor(seed: int, size: int = SIZE) -> torch.Tensor:
    return torch.frombuffer(bytearray(payload(seed, size)), dtype=torch.uint8)


def test_a_producer_here_and_a_consumer_in_another_process(store: Store, master: MasterProcess,
                                                           spawn_agent: SpawnAgent) -> None:
    producer = store.tensor_channel("hidden")
    assert producer.put_many([_tensor(i) for i in range(5)]) == [0, 1, 2, 3, 4]
    assert producer.put(_tensor(5)) == 5
    consumer = spawn_agent(master.address)
    got = consumer.call("chan_take", name="hidden", max_items=4, wait_s=5)["items"]
    got += consumer.call("chan_take", name="hidden", max_items=4, wait_s=5)["items"]
    assert got == [[i, digest(payload(i, SIZE))] for i in range(6)]  # in order, byte for byte
    assert producer.info()["items"] == 0
    assert not list(store.keys())  # acks removed the objects


def test_a_full_channel_refuses_or_blocks(store: Store) -> None:
    refusing = store.tensor_channel("small", max_items=3, when_full="refuse")
    refusing.put_many([_tensor(0), _tensor(1)])
    with pytest.raises(ChannelFullError, match="'small' is full .* 1 of 2 tensors not appended") as err:
        refusing.put_many([_tensor(2), _tensor(3)])
    assert err.value.appended == 1
    assert refusing.info()["items"] == 3 and len(list(store.keys())) == 3  # the refused tensor left the pool
    blocking = store.tensor_channel("small", max_items=3, timeout_s=0.3)
    started = time.monotonic()
    with pytest.raises(ChannelFullError, match="after waiting 0.3 s"):
        blocking.put(_tensor(4))
    assert time.monotonic() - started >= 0.3
    consumer = store.tensor_channel("small")
    later = threading.Timer(0.2, lambda: consumer.ack(consumer.take(1, timeout_s=1)))
    later.start()
    try:
        patient = store.tensor_channel("small", max_items=3, timeout_s=10)
        assert patient.put(_tensor(5)) == 3  # waited for the ack, then appended
    finally:
        later.join()
    with pytest.raises(ConfigError, match="when_full"):
        store.tensor_channel("x", when_full="drop")


def test_a_consumer_that_dies_loses_nothing(store: Store, master: MasterProcess, spawn_agent: SpawnAgent) -> None:
    producer = store.tensor_channel("rollouts")
    producer.put_many([_tensor(i) for i in range(3)])
    doomed = spawn_agent(master.address)
    doomed.call("chan_take", name="warm-up", wait_s=0)  # its first take imports torch: not while it holds items
    held = doomed.call("chan_take", name="rollouts", max_items=2, wait_s=5, ack=False, visibility_s=2.0)
    assert [seq for seq, _ in held["items"]] == [0, 1]
    doomed.kill()
    survivor = store.tensor_channel("rollouts", visibility_s=30)
    first = survivor.take(5, timeout_s=0)
    assert [d.seq for d in first] == [2]  # the dead consumer's items are still hidden
    time.sleep(2.1)
    again = survivor.take(5, timeout_s=5)
    assert [d.seq for d in again] == [0, 1]  # handed out again: at least once
    assert [digest(d.tensor.numpy().tobytes()) for d in again] == [digest(payload(i, SIZE)) for i in (0, 1)]
    seen: set[int] = set()
    done = [d.seq for d in first + again if d.seq not in seen and not seen.add(d.seq)]  # exactly once, by seq
    assert sorted(done) == [0, 1, 2]
    assert survivor.ack(first + again) == 3 and survivor.ack([0]) == 0
    assert survivor.info() == {"items": 0, "ready": 0, "taken": 0, "bytes": 0, "next_seq": 3, "lost": 0}


def test_a_take_acks_the_batch_before_it(store: Store) -> None:
    """The consume loop ``items = ch.take(n, ack=items)``: one round trip per batch, nothing left over."""
    channel = store.tensor_channel("loop")
    channel.put_many([_tensor(i) for i in range(4)])
    first = channel.take(2, timeout_s=5)
    second = channel.take(2, timeout_s=5, ack=first)
    assert [d.seq for d in second] == [2, 3] and channel.info()["items"] == 2
    assert channel.take(2, timeout_s=0, ack=second) == [] and channel.info()["items"] == 0
    assert not list(store.keys())


def _requests(master: MasterProcess, kind: str) -> float:
    """The master's count of ``kind`` requests answered so far (its /metrics)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{master.metrics_port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    found = re.search(rf'^tidekv_master_requests_total{{type="{kind}"}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def test_a_waiting_take_is_answered_when_an_item_comes_not_by_polling(store: Store, master: MasterProcess) -> None:
    """The take waits on the master, which answers it on the push: one request for the wait,
    and the item in hand soon after it was put (a poll would ask every few ms, and wait up to
    its interval). Another request of the same Store meanwhile is not held up by the wait."""
    consumer = store.tensor_channel("wake")
    consumer.take(1, timeout_s=0)  # its connections are made
    before = _requests(master, "ChannelTake")
    put_at: list[float] = []

    def produce() -> None:
        time.sleep(0.5)
        assert store.exists("nothing") is False  # the Store's own connection is free meanwhile
        store.tensor_channel("wake").put(_tensor(7))
        put_at.append(time.monotonic())

    producer = threading.Thread(target=produce)
    producer.start()
    try:
        got = consumer.take(1, timeout_s=20)
        taken_at = time.monotonic()
    finally:
        producer.join()
    assert [d.seq for d in got] == [0] and digest(got[0].tensor.numpy().tobytes()) == digest(payload(7, SIZE))
    assert taken_at - put_at[0] < 0.5, "the waiting take was answered when the item came"
    assert _requests(master, "ChannelTake") - before == 1, "one take request waited; none polled"
    started = time.monotonic()
    assert consumer.take(1, timeout_s=0.4, ack=got) == []
    assert 0.4 <= time.monotonic() - started < 3.0, "an empty-handed wait lasts its timeout"


def test_a_blocked_producer_is_answered_when_an_ack_makes_room(store: Store, master: MasterProcess) -> None:
    producer = store.tensor_channel("room", max_items=1, timeout_s=20)
    producer.put(_tensor(0))
    consumer = store.tensor_channel("room")
    before = _requests(master, "ChannelPush")
    acked_at: list[float] = []

    def consume() -> None:
        time.sleep(0.5)
        items = consumer.take(1, timeout_s=5)
        consumer.ack(items)
        acked_at.append(time.monotonic())

    thread = threading.Thread(target=consume)
    thread.start()
    try:
        assert producer.put(_tensor(1)) == 1
        appended_at = time.monotonic()
    finally:
        thread.join()
    assert appended_at - acked_at[0] < 0.5, "the blocked put was appended when the ack made room"
    assert _requests(master, "ChannelPush") - before == 1, "one push waited for room; none polled"
    assert [d.seq for d in consumer.take(1, timeout_s=5)] == [1]


def test_read_ahead_takes_the_next_batch_while_this_one_is_read(store: Store) -> None:
    """``read_ahead``: each take that gets items has the next batch taken meanwhile; the consume
    loop sees every item once, in order. A consumer that stops leaves its batch taken ahead
    hidden until ``visibility_s``, then it comes back to any consumer."""
    producer = store.tensor_channel("ahead")
    producer.put_many([_tensor(i) for i in range(10)])
    consumer = store.tensor_channel("ahead", read_ahead=True, visibility_s=1.0)
    seen, items = [], []
    while len(seen) < 6:
        items = consumer.take(3, timeout_s=5, ack=items)
        seen += [(d.seq, digest(d.tensor.numpy().tobytes())) for d in items]
    assert seen == [(i, digest(payload(i, SIZE))) for i in range(6)]
    consumer.ack(items)
    time.sleep(0.2)  # the take sent ahead (seqs 6-8) has landed
    other = store.tensor_channel("ahead")
    assert [d.seq for d in other.take(5, timeout_s=0)] == [9], "6-8 are the stopped consumer's, taken ahead"
    time.sleep(1.1)
    assert [d.seq for d in other.take(5, timeout_s=5)] == [6, 7, 8], "after visibility_s they come back"
