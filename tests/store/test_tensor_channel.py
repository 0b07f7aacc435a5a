"""TensorChannel end to end: producers and consumers in separate processes over a real master and
holder; order and bytes, back-pressure (refuse and block), a consumer that dies holding items
(redelivered, nothing lost), and at-least-once delivery made exactly-once by seq."""

from __future__ import annotations

import threading
import time

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
