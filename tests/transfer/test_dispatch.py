"""Per-request transport choice, the versioned descriptor, and the one native error boundary.

The engine picks a transport for each request, not each peer: one batch can mix same-host shm
with tcp, and even one peer's requests can go both ways. Descriptors carry a section per
transport; a section of a transport this build lacks is skipped. Failed requests come back as
typed errors naming peer, op and byte range, mapped in one place. Neighbours: the contract suite
(``test_contract``), which checks bytes over each transport alone.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from tests.conftest import MakeEngine, SpawnTarget
from tests.transfer import rawwire
from tests.transfer.harness import initiator_config
from tests.transfer.reference import pattern
from tidekv import (
    ConfigError,
    SegmentNotRegisteredError,
    TransferConfig,
    TransferEngine,
    TransferError,
    TransferOp,
    TransferRequest,
    TransferState,
)
from tidekv.errors import EngineClosedError
from tidekv.transfer.directory import DirectDirectory

pytestmark = pytest.mark.timeout(90)

SIZE = 256 << 10
WAIT_S = 30.0


class TcpOnlyDirectory(DirectDirectory):
    """Hands out descriptors without their shm section: a same-host peer then looks remote."""

    def lookup(self, name: str) -> bytes:
        instance, sections = rawwire.parse_descriptor(super().lookup(name))
        return rawwire.descriptor(sections=[s for s in sections if s[0] != rawwire.TRANSPORT_SHM], instance=instance)


def test_one_batch_mixes_transports_across_peers(spawn_target: SpawnTarget) -> None:
    near = spawn_target({"mem": ("alloc", SIZE, 1)})
    far = spawn_target({"mem": ("alloc", SIZE, 2)})
    engine = TransferEngine(config=TransferConfig())
    try:
        assert engine.connect(near.name) == "shm"
        engine._directory = TcpOnlyDirectory(engine._native)  # far: reachable by tcp alone
        assert engine.connect(far.name) == "tcp"
        buf = engine.register(bytearray(2 * SIZE))
        batch = [
            TransferRequest(TransferOp.READ, buf.addr(0), SIZE, near.name, near.regions["mem"].addr(0)),
            TransferRequest(TransferOp.READ, buf.addr(SIZE), SIZE, far.name, far.regions["mem"].addr(0)),
        ]
        engine.transfer(batch).wait(timeout_s=WAIT_S)
        assert buf.view()[:SIZE] == pattern(1, SIZE) and buf.view()[SIZE:] == pattern(2, SIZE)
        assert engine.stats()["shm_bytes"] == SIZE
        assert far.stats()["served_bytes"] == SIZE and near.stats()["served_bytes"] == 0
    finally:
        engine.close()


def test_one_peers_requests_take_different_transports(spawn_target: SpawnTarget, make_engine: MakeEngine) -> None:
    """Without cross-memory attach, a peer's allocate()d memory goes by shm and its plain
    registered memory by tcp, within one batch."""
    target = spawn_target({"shared": ("alloc", SIZE, 1), "plain": ("bytearray", SIZE, 2)})
    engine = make_engine(TransferConfig(enable_cross_memory_attach=False))
    assert engine.connect(target.name) == "shm"
    buf = engine.register(bytearray(2 * SIZE))
    batch = [
        TransferRequest(TransferOp.READ, buf.addr(0), SIZE, target.name, target.regions["shared"].addr(0)),
        TransferRequest(TransferOp.READ, buf.addr(SIZE), SIZE, target.name, target.regions["plain"].addr(0)),
    ]
    engine.transfer(batch).wait(timeout_s=WAIT_S)
    assert buf.view()[:SIZE] == pattern(1, SIZE) and buf.view()[SIZE:] == pattern(2, SIZE)
    assert engine.stats()["shm_bytes"] == SIZE
    assert target.stats()["served_bytes"] == SIZE


def test_forced_shm_fails_what_it_cannot_serve_and_names_why(spawn_target: SpawnTarget, make_engine: MakeEngine) -> None:
    target = spawn_target({"shared": ("alloc", SIZE, 1), "plain": ("bytearray", SIZE, 2)})
    engine = make_engine(TransferConfig.from_env({"TIDEKV_TRANSPORT": "shm"}, enable_cross_memory_attach=False))
    buf = engine.register(bytearray(2 * SIZE))
    handle = engine.transfer([
        TransferRequest(TransferOp.READ, buf.addr(0), SIZE, target.name, target.regions["shared"].addr(0)),
        TransferRequest(TransferOp.WRITE, buf.addr(SIZE), SIZE, target.name, target.regions["plain"].addr(0)),
    ])
    with pytest.raises(TransferError) as info:
        handle.wait(timeout_s=WAIT_S)
    ok, failed = handle.statuses()
    assert ok.state is TransferState.DONE and failed.state is TransferState.FAILED
    assert "transport 'shm' is forced" in str(failed.error) and "cross-memory attach" in str(failed.error)
    assert (failed.error.peer, failed.error.op, failed.error.length) == (target.name, "WRITE", SIZE)
    assert failed.error.remote_addr == target.regions["plain"].addr(0)
    assert [(i, str(e)) for i, e in info.value.failures] == [(1, str(failed.error))]
    assert buf.view()[:SIZE] == pattern(1, SIZE)


def test_unknown_forced_transport_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="TIDEKV_TRANSPORT='carrier-pigeon'"):
        TransferConfig.from_env({"TIDEKV_TRANSPORT": "carrier-pigeon"})


def test_descriptor_with_an_unknown_transport_section(spawn_target: SpawnTarget, make_engine: MakeEngine) -> None:
    """A peer of a build with a transport we lack (wire id 77) still serves us over what we share."""

    class NewerPeerDirectory(DirectDirectory):
        def lookup(self, name: str) -> bytes:
            instance, sections = rawwire.parse_descriptor(super().lookup(name))
            return rawwire.descriptor(sections=[(77, b"\x01" * 40), *sections, (78, b"")], instance=instance)

    target = spawn_target({"mem": ("alloc", SIZE, 1)})
    engine = make_engine(TransferConfig())
    engine._directory = NewerPeerDirectory(engine._native)
    assert engine.connect(target.name) == "shm"
    buf = engine.register(bytearray(SIZE))
    engine.transfer([TransferRequest(TransferOp.READ, buf.addr(0), SIZE, target.name, target.regions["mem"].addr(0))]).wait(
        timeout_s=WAIT_S
    )
    assert buf.view() == pattern(1, SIZE)


@pytest.mark.parametrize("damage", ["cut", "bad-length", "trailing", "bad-magic"])
def test_malformed_descriptor_is_refused_by_name(damage: str, make_engine: MakeEngine) -> None:
    engine = make_engine(TransferConfig())
    good = rawwire.descriptor(sections=[(rawwire.TRANSPORT_SHM, b"\0" * 72)])
    bad = {
        "cut": good[:-10],
        "bad-length": good[:32] + rawwire.SECTION_HEADER.pack(rawwire.TRANSPORT_SHM, 0, 1 << 20) + good[40:],
        "trailing": good + b"x",
        "bad-magic": b"\0\0\0\0" + good[4:],
    }[damage]
    with pytest.raises(ConfigError, match="descriptor of peer 127.0.0.1:9 is malformed"):
        engine._native.add_peer("127.0.0.1:9", bad)


def test_a_batch_naming_16_new_peers(spawn_target: SpawnTarget, make_engine: MakeEngine) -> None:
    targets = [spawn_target({"mem": ("alloc", 4096, seed)}) for seed in range(16)]
    engine = make_engine(initiator_config("tcp"))
    buf = engine.register(bytearray(16 * 4096))
    batch = [TransferRequest(TransferOp.READ, buf.addr(i * 4096), 4096, t.name, t.regions["mem"].addr(0))
             for i, t in enumerate(targets)]
    engine.transfer(batch).wait(timeout_s=WAIT_S)
    for i in range(16):
        assert buf.view()[i * 4096:(i + 1) * 4096] == pattern(i, 4096)


def test_local_range_error_is_typed(make_engine: MakeEngine, spawn_target: SpawnTarget) -> None:
    target = spawn_target({"mem": ("alloc", SIZE, 1)})
    engine = make_engine(TransferConfig())
    with pytest.raises(SegmentNotRegisteredError, match="register"):
        engine.transfer([TransferRequest(TransferOp.READ, 0x1000, 16, target.name, target.regions["mem"].addr(0))])


def test_closed_engine_is_one_error_everywhere(spawn_target: SpawnTarget) -> None:
    """Closing the engine fails its own calls and its batches still in flight with
    EngineClosedError alike (before, the batch said PeerUnavailableError)."""
    target = spawn_target({"mem": ("alloc", 64 << 20, 1)})
    engine = TransferEngine(config=initiator_config("tcp", slice_size_bytes=64 << 10, connections_per_peer=1))
    buf = engine.register(bytearray(64 << 20))
    engine.connect(target.name)
    handle = engine.transfer([TransferRequest(TransferOp.READ, buf.addr(0), 64 << 20, target.name, target.regions["mem"].addr(0))])
    engine.close()
    status = handle.statuses()[0]
    if status.state is TransferState.FAILED:  # the usual case: the close cut it short
        assert isinstance(status.error, EngineClosedError), status.error
        assert status.error.peer == target.name and status.error.op == "READ"
    else:
        assert status.state is TransferState.DONE  # it finished before the close reached it
    with pytest.raises(EngineClosedError):
        engine.transfer([TransferRequest(TransferOp.READ, buf.addr(0), 16, target.name, 0)])


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_request_reaching_past_its_region_lands_nowhere(transport: str, spawn_target: SpawnTarget,
                                                          make_engine: MakeEngine) -> None:
    """Slices are cut per transport (tcp 256 KiB, shm 16 MiB); a request whose last slice falls
    outside the region must not land its other slices either."""
    size = 24 << 20
    target = spawn_target({"mem": ("alloc", size, 1)})
    engine = make_engine(initiator_config(transport))
    assert engine.connect(target.name) == transport
    buf = engine.register(bytearray(size))
    buf.view()[:] = pattern(2, size)
    over = TransferRequest(TransferOp.WRITE, buf.addr(0), size - (1 << 20) + 1, target.name, target.regions["mem"].addr(1 << 20))
    with pytest.raises(SegmentNotRegisteredError):
        engine.transfer([over]).wait(timeout_s=WAIT_S)
    assert target.read("mem", 0, 4 << 20) == pattern(1, size)[: 4 << 20]
    assert target.read("mem", size - (4 << 20), 4 << 20) == pattern(1, size)[size - (4 << 20):]


@pytest.mark.parametrize("target", ["own huge allocation", "own plain buffer", "other engine's plain buffer"])
def test_a_peer_in_this_process_is_copied_by_shm_without_cross_memory_attach(target: str,
                                                                            make_engine: MakeEngine) -> None:
    """An engine reaching itself (a store client writing into its own segment) or another engine
    of its process copies that peer's memory in place, by shm, whatever the memory: it is this
    process's own. With cross-memory attach off, a peer in another process would need tcp for
    anything but allocate()d shared memory (test_one_peers_requests_take_different_transports)."""
    config = TransferConfig(enable_cross_memory_attach=False)
    engine = make_engine(config)
    if target == "own huge allocation":
        peer, region = engine, engine.allocate(SIZE, huge=True)
    elif target == "own plain buffer":
        peer, region = engine, engine.register(bytearray(SIZE))
    else:
        peer = make_engine(config)
        region = peer.register(bytearray(SIZE))
    buf = engine.register(bytearray(pattern(3, SIZE)))
    back = engine.register(bytearray(SIZE))
    assert engine.connect(peer.name) == "shm"
    for op, local in ((TransferOp.WRITE, buf), (TransferOp.READ, back)):
        engine.transfer([TransferRequest(op, local.addr(0), SIZE, peer.name, region.addr(0))]).wait(timeout_s=WAIT_S)
    assert region.view()[:SIZE] == pattern(3, SIZE) and back.view()[:SIZE] == pattern(3, SIZE)
    assert engine.stats()["shm_bytes"] == 2 * SIZE
    assert peer.stats()["served_bytes"] == 0  # nothing went over its tcp listener
    # Outside every registered region of the peer: refused, as for a peer in another process.
    with pytest.raises(TransferError, match="no registered region"):
        engine.transfer([TransferRequest(TransferOp.WRITE, buf.addr(0), SIZE, peer.name,
                                         region.addr(0) + SIZE)]).wait(timeout_s=WAIT_S)


def _until_done(handles: list, deadline_s: float) -> float:
    """Polls done() (which runs nothing itself) until every handle is done; returns the seconds it took."""
    started = time.monotonic()
    while not all(h.done() for h in handles):
        assert time.monotonic() - started < deadline_s, "batches nobody waited for did not finish"
        time.sleep(0.001)
    return time.monotonic() - started


def test_small_batches_nobody_waits_for_still_finish(spawn_target: SpawnTarget, make_engine: MakeEngine) -> None:
    """A small tcp batch is left to its waiter for a grace period; one nobody waits for is handed
    to a worker by the thread that watches those deadlines, also in a stream where most of them
    are waited for (they are dropped by the watcher, the others must not be)."""
    target = spawn_target({"mem": ("bytearray", 1 << 20, 3)})
    engine = make_engine(initiator_config("tcp"))
    local = engine.register(bytearray(1 << 20))
    remote = target.regions["mem"].addr(0)
    unwaited = []
    for i in range(200):
        handle = engine.transfer([TransferRequest(TransferOp.READ, local.addr(i * 4096), 4096, target.name,
                                                  remote + i * 4096)])
        if i % 7 == 0:
            unwaited.append(handle)
        else:
            handle.wait(timeout_s=WAIT_S)
    _until_done(unwaited, WAIT_S)
    for handle in unwaited:
        handle.wait(timeout_s=0)
    assert local.view()[: 200 * 4096] == pattern(3, 1 << 20)[: 200 * 4096]


def _sleeps_of_other_threads() -> int:
    """Voluntary context switches (sleeps) of every thread of this process but the calling one."""
    me = threading.get_native_id()
    total = 0
    for task in os.listdir("/proc/self/task"):
        if int(task) == me:
            continue
        try:
            with open(f"/proc/self/task/{task}/status") as f:
                total += sum(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))
        except FileNotFoundError:  # (a thread that ended meanwhile)
            continue
    return total


def test_small_batches_that_are_waited_for_wake_no_other_thread(spawn_target: SpawnTarget,
                                                              make_engine: MakeEngine) -> None:
    """A small tcp batch waited for at once runs on its waiter, and its fallback (a worker after
    the grace period) is a kernel timer the waiter stops: no worker or watcher wakes for it.
    (Waking one per request cost two context switches and ~6 futex calls per 4 KiB store put.)"""
    target = spawn_target({"mem": ("bytearray", 1 << 20, 3)})
    engine = make_engine(initiator_config("tcp"))
    local = engine.register(bytearray(1 << 20))
    remote = target.regions["mem"].addr(0)
    read = [TransferRequest(TransferOp.READ, local.addr(0), 4096, target.name, remote)]
    engine.transfer(read).wait(timeout_s=WAIT_S)  # connected
    before = _sleeps_of_other_threads()
    for _ in range(300):
        engine.transfer(read).wait(timeout_s=WAIT_S)
        time.sleep(0.0005)  # requests further apart than the grace period, as a store's puts are
    woken = _sleeps_of_other_threads() - before
    # Before: >= 2 per request (600). Left: the log pump's 200 ms ticks and a rare waiter that
    # reached wait() after the grace period (a preempted test process).
    assert woken < 60, f"{woken} sleeps of other threads over 300 waited 4 KiB requests"
    assert local.view()[:4096] == pattern(3, 1 << 20)[:4096]


def test_a_lone_worker_watching_deferred_work_still_serves_the_queue(spawn_target: SpawnTarget,
                                                                    make_engine: MakeEngine) -> None:
    """With one worker and a deferred request's deadline pending, a multi-task batch that nobody
    waits for is still run at once: watching deadlines never keeps the worker from the queue."""
    target = spawn_target({"mem": ("bytearray", 4 << 20, 4)})
    engine = make_engine(initiator_config("tcp", worker_threads=1, connections_per_peer=4))
    local = engine.register(bytearray(4 << 20))
    remote = target.regions["mem"].addr(0)
    engine.transfer([TransferRequest(TransferOp.READ, local.addr(0), 4096, target.name, remote)]).wait(timeout_s=WAIT_S)
    small = engine.transfer([TransferRequest(TransferOp.READ, local.addr(0), 4096, target.name, remote)])
    large = engine.transfer([TransferRequest(TransferOp.READ, local.addr(1 << 20), 2 << 20, target.name, remote)])
    _until_done([small, large], 10.0)
    large.wait(timeout_s=0)
    assert local.view()[1 << 20 : 3 << 20] == pattern(4, 4 << 20)[: 2 << 20]


def test_a_same_host_batch_up_to_inline_bytes_is_copied_before_transfer_returns(spawn_target: SpawnTarget,
                                                                                 make_engine: MakeEngine) -> None:
    """Up to ``inline_bytes`` (1 MiB) a same-host batch is copied on the submitting thread: no
    deferral, whose kernel timer (armed and stopped per batch) cost 15 µs of a 1 MiB copy's 40 on
    this VM (``tidekv bench transfer --transports shm``); past it, the batch is deferred as before."""
    target = spawn_target({"mem": ("alloc", 4 << 20, 5)})
    engine = make_engine(initiator_config("shm"))
    local = engine.register(bytearray(4 << 20))
    remote = target.regions["mem"].addr(0)
    engine.transfer([TransferRequest(TransferOp.READ, local.addr(0), 4096, target.name, remote)]).wait(timeout_s=WAIT_S)
    whole = engine.transfer([TransferRequest(TransferOp.READ, local.addr(0), 1 << 20, target.name, remote)])
    assert whole.done(), "a 1 MiB same-host READ is done when transfer() returns"
    assert local.view()[: 1 << 20] == pattern(5, 4 << 20)[: 1 << 20]
    gathered = engine.transfer([TransferRequest(TransferOp.READ, local.addr(i << 14), 4096, target.name, remote + (i << 14))
                                for i in range(64)])
    assert gathered.done(), "64 x 4 KiB same-host READs are done when transfer() returns"
    larger = engine.transfer([TransferRequest(TransferOp.READ, local.addr(0), 2 << 20, target.name, remote)])
    larger.wait(timeout_s=WAIT_S)
    assert local.view()[: 2 << 20] == pattern(5, 4 << 20)[: 2 << 20]
