"""A target that dies or never existed: requests fail with a typed error in bounded time.

The target is SIGKILLed while a large batch is in flight (tcp: sockets reset; shm: the process
behind the mapped memory or the cross-memory copy vanishes). Every wait is bounded; a hang
fails the test.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from tests.conftest import MakeEngine, SpawnTarget
from tests.transfer import rawwire
from tests.transfer.harness import TRANSPORTS, initiator_config
from tests.transfer.reference import pattern
from tidekv import (
    PeerUnavailableError,
    TransferError,
    TransferOp,
    TransferRequest,
    TransferState,
    TransferTimeoutError,
)
from tidekv.bench.ports import free_port

pytestmark = pytest.mark.timeout(90)

DEADLINE_S = 10.0
REQUEST_BYTES = 4 << 20
REQUESTS = 64


@pytest.mark.parametrize("kind", ["alloc", "bytearray"])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_target_killed_mid_batch(transport: str, kind: str, spawn_target: SpawnTarget, make_engine: MakeEngine) -> None:
    target = spawn_target({"mem": (kind, REQUEST_BYTES, 1)})
    # One copying thread: on two vCPUs, two would starve this thread until the batch is over.
    engine = make_engine(initiator_config(transport, io_timeout_s=30.0, shm_parallelism=1))
    assert engine.connect(target.name) == transport
    local = engine.register(bytearray(REQUESTS * REQUEST_BYTES))
    remote = target.regions["mem"].addr(0)
    batch = [
        TransferRequest(TransferOp.READ, local.addr(i * REQUEST_BYTES), REQUEST_BYTES, target.name, remote)
        for i in range(REQUESTS)
    ]
    # Warm up (connections open, shared memory mapped) and prove the data path works.
    engine.transfer(batch[:1]).wait(timeout_s=DEADLINE_S)
    assert local.view()[:REQUEST_BYTES] == pattern(1, REQUEST_BYTES)

    handle = engine.transfer(batch)
    was_running = not handle.done()
    target.kill()
    started = time.monotonic()
    try:
        handle.wait(timeout_s=DEADLINE_S)
    except TransferError as e:
        info = pytest.ExceptionInfo.from_exc_info((type(e), e, e.__traceback__))
    else:
        # Reads of engine-allocated shared memory may all finish before the kernel has torn the
        # process down: the pages are the peer's shared memory, intact while we map them, so
        # that is a correct result - and it must be the right bytes.
        assert transport == "shm" and kind == "alloc", "a batch against a killed peer succeeded"
        assert local.view() == pattern(1, REQUEST_BYTES) * REQUESTS
        info = None
    elapsed = time.monotonic() - started
    assert was_running, "the batch finished before the kill; make it larger"
    assert elapsed < DEADLINE_S
    if info is not None:
        assert isinstance(info.value, PeerUnavailableError), repr(info.value)
        assert info.value.peer == target.name
        states = [s.state for s in handle.statuses()]
        assert TransferState.PENDING not in states
        assert states.count(TransferState.FAILED) == len(info.value.failures) > 0

    # Later batches to the dead peer fail fast too (transfer() may refuse at once or per request).
    started = time.monotonic()
    with pytest.raises(PeerUnavailableError):
        engine.transfer(batch[:2]).wait(timeout_s=DEADLINE_S)
    assert time.monotonic() - started < DEADLINE_S


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_dead_target_fails_only_its_requests(
    transport: str, spawn_target: SpawnTarget, make_engine: MakeEngine
) -> None:
    """One batch over a live and a killed target: the live target's requests complete."""
    alive = spawn_target({"mem": ("alloc", 1 << 20, 1)})
    doomed = spawn_target({"mem": ("bytearray", 1 << 20, 2)})
    engine = make_engine(initiator_config(transport))
    for target in (alive, doomed):
        assert engine.connect(target.name) == transport
    local = engine.register(bytearray(4 << 20))
    doomed.kill()
    batch = [
        TransferRequest(TransferOp.READ, local.addr(i << 20), 1 << 20, t.name, t.regions["mem"].addr(0))
        for i, t in enumerate([alive, doomed, alive, doomed])
    ]
    handle = engine.transfer(batch)
    with pytest.raises(PeerUnavailableError) as info:
        handle.wait(timeout_s=DEADLINE_S)
    assert [i for i, _ in info.value.failures] == [1, 3]
    assert all(e.peer == doomed.name for _, e in info.value.failures)
    assert [s.state for s in handle.statuses()] == [TransferState.DONE, TransferState.FAILED] * 2
    for i in (0, 2):
        assert local.view()[i << 20 : (i + 1) << 20] == pattern(1, 1 << 20)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_connect_to_nobody_is_refused(transport: str, make_engine: MakeEngine) -> None:
    engine = make_engine(initiator_config(transport))
    nobody = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(PeerUnavailableError, match=nobody):
        engine.connect(nobody)
    buf = engine.register(bytearray(64))
    with pytest.raises(PeerUnavailableError):
        engine.transfer([TransferRequest(TransferOp.READ, buf.addr(0), 64, nobody, 0x10000)]).wait(timeout_s=DEADLINE_S)
    assert time.monotonic() - started < DEADLINE_S


class StalledPeer:
    """A fake remote-host engine that completes handshakes but answers no data frame until released;
    then it hangs up."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.frames = threading.Event()
        self.server = rawwire.FakeServer(self._script)
        self.name = self.server.name

    def _script(self, sock: socket.socket) -> None:
        if rawwire.serve_handshake(sock) == rawwire.CONN_DATA:
            rawwire.recv_exact(sock, rawwire.REQUEST.size)
            self.frames.set()
            self.release.wait(DEADLINE_S)


@pytest.fixture
def stalled_peer() -> Iterator[StalledPeer]:
    peer = StalledPeer()
    yield peer
    peer.release.set()
    peer.server.close()


def test_wait_timeout_is_honoured_while_peer_stalls(stalled_peer: StalledPeer, make_engine: MakeEngine) -> None:
    """wait(timeout_s) returns by its deadline even though the peer's io timeout is far longer and
    no worker is free (the only one is stuck on an earlier batch); the batches keep running and
    fail once the peer hangs up."""
    engine = make_engine(initiator_config("tcp", io_timeout_s=8.0, worker_threads=1, connections_per_peer=2))
    engine.connect(stalled_peer.name)
    buf = engine.register(bytearray(8192))
    first = engine.transfer([TransferRequest(TransferOp.READ, buf.addr(0), 4096, stalled_peer.name, 0x7000_0000)])
    assert stalled_peer.frames.wait(DEADLINE_S), "the first request never reached the peer"
    second = engine.transfer([TransferRequest(TransferOp.READ, buf.addr(4096), 4096, stalled_peer.name, 0x7000_0000)])
    for handle in (second, first):
        started = time.monotonic()
        with pytest.raises(TransferTimeoutError, match="not finished after 0.3 s"):
            handle.wait(timeout_s=0.3)
        assert time.monotonic() - started < 2.0, "wait(timeout_s=0.3) overran its deadline"
        assert not handle.done()
    stalled_peer.release.set()
    for handle in (first, second):
        with pytest.raises(PeerUnavailableError):
            handle.wait(timeout_s=DEADLINE_S)
        assert handle.statuses()[0].state is TransferState.FAILED


def test_a_silent_peer_fails_the_batch_in_the_io_timeout_however_long_the_wait(stalled_peer: StalledPeer,
                                                                                 make_engine: MakeEngine) -> None:
    """A peer that stops answering (a host cut off: no reset, no reply) fails the batch in the io
    timeout even while wait(timeout_s) allows far longer: the waiting thread runs one of the
    batch's two connections itself (the one worker has the other) and must not wait for the
    reply past the io timeout."""
    engine = make_engine(initiator_config("tcp", io_timeout_s=1.0, worker_threads=1, connections_per_peer=2))
    engine.connect(stalled_peer.name)
    buf = engine.register(bytearray(8192))
    handle = engine.transfer([TransferRequest(TransferOp.READ, buf.addr(i * 4096), 4096, stalled_peer.name, 0x7000_0000)
                              for i in range(2)])
    started = time.monotonic()
    with pytest.raises(TransferTimeoutError, match=f"receiving from {stalled_peer.name} timed out"):
        handle.wait(timeout_s=30.0)
    assert time.monotonic() - started < 5.0, "the batch outlived the io timeout"
    assert [s.state for s in handle.statuses()] == [TransferState.FAILED] * 2


def test_close_with_batch_in_flight_returns_promptly(stalled_peer: StalledPeer, make_engine: MakeEngine) -> None:
    """close() does not sit out the io timeout of a stalled peer; the batch fails instead of hanging."""
    engine = make_engine(initiator_config("tcp", io_timeout_s=8.0))
    engine.connect(stalled_peer.name)
    buf = engine.register(bytearray(4096))
    handle = engine.transfer([TransferRequest(TransferOp.READ, buf.addr(0), 4096, stalled_peer.name, 0x7000_0000)])
    assert stalled_peer.frames.wait(DEADLINE_S), "the request never reached the peer"
    started = time.monotonic()
    engine.close()
    assert time.monotonic() - started < 2.0, "close() waited for the stalled peer"
    with pytest.raises(TransferError):
        handle.wait(timeout_s=DEADLINE_S)


@pytest.mark.parametrize("kind", ["alloc", "bytearray"])
def test_same_host_peer_restarted_on_its_address(kind: str, spawn_target: SpawnTarget, make_engine: MakeEngine) -> None:
    """A same-host peer SIGKILLed and started again on the same address is looked up again before
    the next request, which reaches the new process's memory over shm: not the dead process's
    mapped memory, not a refusal. Only the dead peer's region table tells the initiator (its owner
    mutex, marked by the kernel when the process died), so this also checks that mark."""
    size = 1 << 20
    first = spawn_target({"mem": (kind, size, 1)})
    engine = make_engine(initiator_config("shm"))
    assert engine.connect(first.name) == "shm"
    local = engine.register(bytearray(size))
    engine.transfer([TransferRequest(TransferOp.READ, local.addr(0), size, first.name, first.regions["mem"].addr(0))]).wait(
        timeout_s=DEADLINE_S
    )
    assert local.view() == pattern(1, size)

    first.kill()
    second = spawn_target({"mem": (kind, size, 2)}, port=int(first.name.rsplit(":", 1)[1]))
    assert second.name == first.name
    shm_before = engine.stats()["shm_bytes"]
    engine.transfer(
        [TransferRequest(TransferOp.READ, local.addr(0), size, second.name, second.regions["mem"].addr(0))]
    ).wait(timeout_s=DEADLINE_S)
    assert local.view() == pattern(2, size)
    assert engine.stats()["shm_bytes"] - shm_before == size, "the request did not go by shm"


def test_closed_in_process_peer_is_gone_at_once(make_engine: MakeEngine) -> None:
    """An engine of this very process that closes is gone for its peers at their next request:
    they fail it (typed, naming the peer) instead of copying into memory nobody serves."""
    engine = make_engine(initiator_config("shm"))
    other = make_engine(initiator_config("shm"))
    remote = other.allocate(4096)
    local = engine.register(bytearray(4096))
    assert engine.connect(other.name) == "shm"
    request = TransferRequest(TransferOp.WRITE, local.addr(0), 4096, other.name, remote.addr(0))
    engine.transfer([request]).wait(timeout_s=DEADLINE_S)
    other.close()
    started = time.monotonic()
    with pytest.raises(PeerUnavailableError) as info:
        engine.transfer([request]).wait(timeout_s=DEADLINE_S)
    assert info.value.peer == other.name
    assert time.monotonic() - started < DEADLINE_S
