"""The listener under attack, on 127.0.0.1: connections that exhaust descriptors, threads or
patience must neither kill the engine's process nor lock out a legitimate peer afterwards.

Each case runs a target engine under a resource limit (``prlimit``; the thread limit as an
unprivileged user, since root is exempt from it), attacks it with raw sockets, then checks that
the target is alive, holds no more descriptors or threads than it should, and still serves a
real engine byte for byte. Neighbours: ``test_malformed_frames`` (bad bytes rather than many
connections), ``native/engine/listener.cpp`` and ``native/tcp/tcp_server.cpp``.
"""

from __future__ import annotations

import errno
import os
import shutil
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from tests.conftest import MakeEngine, SpawnTarget
from tests.transfer import rawwire
from tests.transfer.harness import TargetProcess, initiator_config
from tests.transfer.reference import pattern
from tidekv import PeerUnavailableError, TransferOp, TransferRequest

pytestmark = pytest.mark.timeout(120)

SIZE = 1 << 20
WAIT_S = 30.0


def assert_serves(make_engine: MakeEngine, target: TargetProcess) -> None:
    """A new engine (a legitimate peer) connects and reads the target's region intact."""
    engine = make_engine(initiator_config("tcp"))
    buf = engine.register(bytearray(SIZE))
    remote = target.regions["mem"]
    engine.transfer([TransferRequest(TransferOp.READ, buf.addr(0), SIZE, target.name, remote.addr(0))]).wait(
        timeout_s=WAIT_S
    )
    assert buf.view() == pattern(1, SIZE)


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


def wait_until(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(0.05)


@contextmanager
def raw_connections(name: str, count: int) -> Iterator[list[socket.socket]]:
    """`count` connections opened without blocking (those past the backlog stay in progress)."""
    host, _, port = name.rpartition(":")
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setblocking(False)
            err = s.connect_ex((host, int(port)))
            assert err in (0, errno.EINPROGRESS), os.strerror(err)
            socks.append(s)
        yield socks
    finally:
        for s in socks:
            s.close()


def test_descriptor_exhaustion_recovers(spawn_target: SpawnTarget, make_engine: MakeEngine) -> None:
    """300 connections against a 256-descriptor limit, then closed: the engine gets its
    descriptors back, logs the exhaustion a bounded number of times, and serves again."""
    target = spawn_target({"mem": ("alloc", SIZE, 1)}, prefix=["prlimit", "--nofile=256:256"])
    baseline = open_fds(target.pid)
    with raw_connections(target.name, 300):
        wait_until(lambda: target.stats()["connections_limited"] > 0, 10, "the engine refuses past its fd limit")
        assert target.proc.poll() is None
    wait_until(lambda: open_fds(target.pid) <= baseline + 2, 10,
               f"descriptors back to {baseline} (now {open_fds(target.pid)})")
    assert_serves(make_engine, target)
    stats = target.stats()
    assert stats["connections_open"] <= 4, stats  # the peer above may still hold its connections_per_peer
    lines = [line for line in target.log_text().splitlines() if "out of file descriptors" in line]
    assert 1 <= len(lines) <= 3, lines  # rate-limited, not a line per refused connection


def unprivileged(nproc: int) -> list[str]:
    """Runs the target as user nobody (root ignores RLIMIT_NPROC) with at most `nproc` threads,
    keeping read access to the interpreter and the checkout."""
    if shutil.which("setpriv") is None or shutil.which("prlimit") is None:
        pytest.skip("needs util-linux's setpriv and prlimit to run the target as an unprivileged user")
    caps = "+dac_read_search,+dac_override"
    return ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", f"--inh-caps={caps}",
            f"--ambient-caps={caps}", "prlimit", f"--nproc={nproc}"]


def test_idle_connections_cost_no_threads(spawn_target: SpawnTarget, make_engine: MakeEngine) -> None:
    """With 64 threads allowed, 300 idle connections (before and after the handshake) neither
    abort the process nor start a thread each; a legitimate peer still connects."""
    target = spawn_target({"mem": ("alloc", SIZE, 1)}, prefix=unprivileged(64))
    before = threads(target.pid)
    with raw_connections(target.name, 300):
        handshaken = [rawwire.handshake(target.name)[0] for _ in range(48)]
        try:
            wait_until(lambda: target.stats()["connections_accepted"] >= 348, 10, "every connection accepted")
            assert target.proc.poll() is None
            assert threads(target.pid) <= before + 2, (before, threads(target.pid))
            assert_serves(make_engine, target)
        finally:
            for s in handshaken:
                s.close()
    assert target.proc.poll() is None


def test_many_idle_connections(spawn_target: SpawnTarget, make_engine: MakeEngine) -> None:
    """500 idle connections (as many as the listen backlog takes at once): threads stay flat and
    the engine serves throughout."""
    target = spawn_target({"mem": ("alloc", SIZE, 1)}, max_connections=4096, handshake_timeout_s=120.0)
    before = threads(target.pid)
    with raw_connections(target.name, 500):
        wait_until(lambda: target.stats()["connections_open"] >= 500, 30,
                   f"every connection accepted (the target counts {target.stats()})")
        assert threads(target.pid) == before
        assert_serves(make_engine, target)


def test_silent_connections_are_dropped_at_the_handshake_timeout(spawn_target: SpawnTarget) -> None:
    target = spawn_target({"mem": ("alloc", SIZE, 1)}, handshake_timeout_s=0.3)
    with rawwire.connect(target.name) as silent:
        assert rawwire.is_closed_by_peer(silent, timeout_s=5)
    wait_until(lambda: target.stats()["connections_open"] == 0, 5, "the silent connection is gone from the books")
    target.wait_for_log("no handshake within 300 ms")


def test_idle_data_connections_are_closed(spawn_target: SpawnTarget, make_engine: MakeEngine) -> None:
    """Handshaken connections that send nothing are closed after idle_timeout; an engine whose
    pooled connections were closed that way reconnects instead of failing."""
    target = spawn_target({"mem": ("alloc", SIZE, 1)}, idle_timeout_s=1.0)
    sock, status = rawwire.handshake(target.name)
    with sock:
        assert status == rawwire.STATUS_OK
        started = time.monotonic()
        assert rawwire.is_closed_by_peer(sock, timeout_s=10)
        assert 0.9 < time.monotonic() - started < 5
    assert target.stats()["connections_idle_closed"] >= 1
    engine = make_engine(initiator_config("tcp", idle_timeout_s=60.0))  # keeps its pool longer than the target
    buf = engine.register(bytearray(SIZE))
    remote = target.regions["mem"]
    read = [TransferRequest(TransferOp.READ, buf.addr(0), SIZE, target.name, remote.addr(0))]
    engine.transfer(read).wait(timeout_s=WAIT_S)
    wait_until(lambda: target.stats()["connections_open"] == 0, 10, "the target closes the engine's idle connections")
    buf.view()[:] = bytes(SIZE)
    engine.transfer(read).wait(timeout_s=WAIT_S)
    assert buf.view() == pattern(1, SIZE)


def test_connections_per_peer_are_bounded(spawn_target: SpawnTarget, make_engine: MakeEngine) -> None:
    target = spawn_target({"mem": ("alloc", SIZE, 1)}, connections_per_peer=2, max_connections_per_peer=3)
    instance = os.urandom(16)
    held = [rawwire.handshake(target.name, instance=instance) for _ in range(3)]
    try:
        assert [status for _, status in held] == [rawwire.STATUS_OK] * 3
        extra, status = rawwire.handshake(target.name, instance=instance)
        with extra:
            assert status == rawwire.STATUS_REFUSED
        assert target.stats()["connections_limited"] >= 1
        assert_serves(make_engine, target)  # another peer is not affected
    finally:
        for s, _ in held:
            s.close()


def test_engine_reports_a_refusal_by_the_limit(spawn_target: SpawnTarget, make_engine: MakeEngine) -> None:
    """An engine over its limit at a peer gets a clear error, not a hang or a silent close."""
    target = spawn_target({"mem": ("alloc", SIZE, 1)}, connections_per_peer=1, max_connections_per_peer=1)
    engine = make_engine(initiator_config("tcp", connections_per_peer=1, max_connections_per_peer=1))
    instance, _ = rawwire.parse_descriptor(engine.descriptor)
    squatter, status = rawwire.handshake(target.name, instance=instance)  # takes the engine's one slot
    with squatter:
        assert status == rawwire.STATUS_OK
        buf = engine.register(bytearray(SIZE))
        read = [TransferRequest(TransferOp.READ, buf.addr(0), SIZE, target.name, target.regions["mem"].addr(0))]
        with pytest.raises(PeerUnavailableError, match="connection limit") as info:
            engine.transfer(read).wait(timeout_s=WAIT_S)
        assert info.value.peer == target.name and info.value.op == "READ", info.value
    wait_until(lambda: target.stats()["connections_open"] == 0, 10, "the target reaps the squatter")
    engine.transfer(read).wait(timeout_s=WAIT_S)  # the slot is free again
    assert buf.view() == pattern(1, SIZE)


def test_engine_makes_do_with_the_connections_a_peer_allows(spawn_target: SpawnTarget, make_engine: MakeEngine) -> None:
    """A peer that takes fewer connections than we stripe over: we use the ones it took."""
    target = spawn_target({"mem": ("alloc", SIZE, 1)}, connections_per_peer=2, max_connections_per_peer=2)
    engine = make_engine(initiator_config("tcp", connections_per_peer=4, slice_size_bytes=64 << 10))
    buf = engine.register(bytearray(SIZE))
    read = [TransferRequest(TransferOp.READ, buf.addr(0), SIZE, target.name, target.regions["mem"].addr(0))]
    for _ in range(3):
        buf.view()[:] = bytes(SIZE)
        engine.transfer(read).wait(timeout_s=WAIT_S)
        assert buf.view() == pattern(1, SIZE)
    assert target.stats()["connections_open"] <= 2
