"""tidekv.weights: publish/pull round trips, fan-out, version consistency and failures, with
publishers and subscribers in separate processes where the behaviour depends on it."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from tidekv import channel
from tidekv.channel import Client
from tidekv.config import WeightsConfig
from tidekv.errors import (
    ConfigError,
    ProtocolVersionError,
    PublisherUnavailableError,
    VersionChangedError,
    VersionNotFoundError,
    VersionPendingError,
    WeightsError,
)
from tidekv.transfer import TransferEngine, TransferOp, TransferRequest
from tidekv.weights import Publisher, Subscriber, layout
from tidekv.weights import protocol as p

from tests.store import wire
from tests.weights import procs

CTX = multiprocessing.get_context("spawn")
SMALL = {"chunk_bytes": 64 << 10}


class Proc:
    def __init__(self, target: Any, *args: Any) -> None:
        self.conn, child = CTX.Pipe()
        self.proc = CTX.Process(target=target, args=(child, *args), daemon=True)
        self.proc.start()
        self.hello = self.recv(60)

    def recv(self, timeout_s: float = 60) -> Any:
        if not self.conn.poll(timeout_s):
            raise AssertionError(f"process {self.proc.pid} did not answer within {timeout_s} s")
        return self.conn.recv()

    def send(self, msg: Any) -> None:
        self.conn.send(msg)

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(None)
            except OSError:
                pass
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


@pytest.fixture
def spawn() -> Iterator[Any]:
    started: list[Proc] = []

    def start(target: Any, *args: Any) -> Proc:
        proc = Proc(target, *args)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.stop()


# -- in one process -----------------------------------------------------------------------

def test_round_trip_every_dtype_shape_and_layout() -> None:
    tensors = procs.make_tensors(3)
    tensors["strided"] = torch.arange(60, dtype=torch.float32).reshape(6, 10).t()  # not contiguous
    with Publisher(tensors, config=WeightsConfig(**SMALL)) as pub, Subscriber(pub.address) as sub:
        assert pub.publish(3) == 3
        pulled = sub.pull(3)
        assert pulled.version == 3
        assert list(pulled.tensors) == list(tensors)
        for name, t in tensors.items():
            assert pulled.tensors[name].dtype == t.dtype and torch.equal(pulled.tensors[name], t), name
        assert pulled.nbytes == sum(t.numel() * t.element_size() for t in tensors.values())


def test_snapshot_is_isolated_from_later_changes_and_into_fills_destinations() -> None:
    tensors = procs.make_tensors(1)
    with Publisher(tensors, config=WeightsConfig(**SMALL)) as pub, Subscriber(pub.address) as sub:
        pub.publish(1)
        original = {n: t.clone() for n, t in tensors.items()}
        for t in tensors.values():
            t.zero_()  # the trainer moves on; version 1 stays as published
        dest = {n: torch.empty_like(t) for n, t in original.items()}
        assert sub.pull(1, into=dest).version == 1
        for name, t in original.items():
            assert torch.equal(dest[name], t), name


def test_latest_version_and_versions_list() -> None:
    with Publisher(procs.make_tensors(1), config=WeightsConfig(keep_versions=2, **SMALL)) as pub, Subscriber(pub.address) as sub:
        with pytest.raises(VersionPendingError):
            sub.pull()
        for v in (1, 2, 5):
            pub.publish(v, tensors=procs.make_tensors(v))
        assert pub.versions() == sub.versions() == [2, 5]
        pulled = sub.pull()
        assert pulled.version == 5 and torch.equal(pulled.tensors["embed.weight"], procs.make_tensors(5)["embed.weight"])
        with pytest.raises(VersionNotFoundError, match="version 1 is not held"):
            sub.pull(1)


def test_pull_waits_for_a_version_published_later() -> None:
    tensors = procs.make_tensors(1)
    with Publisher(tensors, config=WeightsConfig(**SMALL)) as pub, Subscriber(pub.address) as sub:
        timer = threading.Timer(0.3, pub.publish, args=(4,))
        timer.start()
        pulled = sub.pull(4, wait_s=10)
        assert pulled.version == 4 and torch.equal(pulled.tensors["lm_head.weight"], tensors["lm_head.weight"])
        timer.join()
        with pytest.raises(VersionPendingError):
            sub.pull(9, wait_s=0.05)


def test_bad_input_is_refused_with_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="no tensors"):
        Publisher({})
    with pytest.raises(ConfigError, match="expected a torch.Tensor"):
        Publisher({"w": [1, 2]})
    with pytest.raises(ConfigError, match="fanout"):
        WeightsConfig(fanout=-1)
    with pytest.raises(ConfigError, match="host:port"):
        Subscriber("nowhere")
    with Publisher(procs.make_tensors(1), config=WeightsConfig(**SMALL)) as pub, Subscriber(pub.address) as sub:
        pub.publish(2)
        with pytest.raises(ConfigError, match="greater than the last published"):
            pub.publish(2)
        with pytest.raises(ConfigError, match="no tensor of that name"):
            sub.pull(2, into={"nope": torch.empty(1)})
        with pytest.raises(ConfigError, match=r"into\['embed.weight'\] is float32"):
            sub.pull(2, into={"embed.weight": torch.empty(512, 256)})


def test_publisher_survives_garbage_and_refuses_other_protocol_versions() -> None:
    with Publisher(procs.make_tensors(1), config=WeightsConfig(**SMALL)) as pub:
        pub.publish(1)
        host, port = pub.address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5.0) as sock:
            wire.authenticate(sock, None, p.MAGIC, "weights")
            sock.sendall(channel.frame(b"\x00garbage"))
            reply = channel.decode_reply(wire.recv_frame(sock))
            assert reply.error_kind == channel.ErrorKind.MALFORMED
            sock.sendall(channel.frame(channel.encode(channel.Envelope(99, 7, p.Describe(None)))))
            reply = channel.decode_reply(wire.recv_frame(sock))
            assert (reply.request_id, reply.error_kind) == (7, channel.ErrorKind.VERSION) and "99" in reply.error
        other = dataclasses.replace(p.SPEC, version=p.PROTOCOL_VERSION + 1)  # a newer subscriber: told why
        with pytest.raises(ProtocolVersionError, match=f"speaks version {p.PROTOCOL_VERSION}"):
            Client(pub.address, other, 5.0).call(p.Versions())
        with Subscriber(pub.address) as sub:  # still serving
            assert sub.pull(1).version == 1


def test_unreachable_publisher_is_reported() -> None:
    with Subscriber("127.0.0.1:9", config=WeightsConfig(rpc_timeout_s=0.3)) as sub, \
            pytest.raises(PublisherUnavailableError, match="cannot reach weights publisher 127.0.0.1:9"):
        sub.pull(1)


def test_lease_holds_a_version_and_freed_buffers_are_detected() -> None:
    tensors = procs.make_tensors(1)
    cfg = WeightsConfig(keep_versions=1, lease_s=2.0, **SMALL)  # long enough for a loaded machine's publish
    with Publisher(tensors, config=cfg) as pub:
        pub.publish(1)
        ch = Client(pub.address, p.SPEC, 5.0)
        joined = time.monotonic()
        plan = ch.call(p.Join(1, "127.0.0.1:1", 0))
        assert isinstance(plan, p.Plan)
        pub.publish(2)
        assert pub.versions() == [1, 2]  # the lease keeps version 1
        time.sleep(max(0.0, joined + cfg.lease_s + 0.1 - time.monotonic()))
        pub.publish(3)  # lease ran out: version 1 goes, its buffer is reused
        assert 1 not in pub.versions()
        ch.close()
        with Subscriber(pub.address) as sub:  # a reader with the stale plan finds another version there
            got = sub._read_header(plan.publisher, plan.snapshot_addr)
            assert got[0] != 1
            with pytest.raises(VersionChangedError):
                sub._check_source(plan, 1)


# -- across processes ---------------------------------------------------------------------

@pytest.mark.parametrize("fanout", [0, 1, 2])
def test_fan_out_to_receiver_processes(spawn: Any, fanout: int) -> None:
    cfg = WeightsConfig(fanout=fanout, **SMALL)
    tensors = procs.make_tensors(1, scale=8)
    with Publisher(tensors, config=cfg) as pub:
        subs = [spawn(procs.subscriber_main, pub.address, {}) for _ in range(4)]
        for version in (1, 2):
            for name, t in procs.make_tensors(version, 8).items():
                tensors[name].copy_(t)
            for s in subs:
                s.send((version, 8))
            pub.publish(version)
            replies = [s.recv() for s in subs]
            assert all(r[0] == "pulled" and r[1] == version and r[3] for r in replies), replies
            relayed = sum(r[2] for r in replies)
            if fanout == 0:
                assert relayed == 0
            else:  # receivers after the publisher's direct children read from a parent
                assert relayed > 0


def test_a_receiver_killed_mid_pull_does_not_stop_its_children(spawn: Any) -> None:
    """Ordered by events, not sleeps: the first receiver joins and stops for good after 8 chunks
    (its engine still serving them); the second joins as its child and must have read those 8
    from it before the first is killed; then it finishes from the publisher, long before the
    stall timeout could have sent it there; a third then reads from the second."""
    paused_at = 8
    cfg = WeightsConfig(fanout=1, window=1, chunk_bytes=64 << 10, stall_timeout_s=60.0)
    tensors = procs.make_tensors(1, scale=64)  # ~30 MiB: hundreds of chunks
    with Publisher(tensors, config=cfg) as pub, TransferEngine() as probe:
        pub.publish(1)
        first = spawn(procs.subscriber_main, pub.address, {}, paused_at)
        first.send((1, 64))
        assert first.recv(60) == ("paused", paused_at)  # joined, holds 8 chunks, will never finish
        second = spawn(procs.subscriber_main, pub.address, {})
        second.send((1, 64))
        receivers = _wait_for(lambda: len(pub._versions[1].receivers) == 2 and pub._versions[1].receivers)
        assert receivers[0].name == first.hello[1] and receivers[1].name == second.hello[1]
        header = probe.allocate(layout.HEADER_BYTES)
        read = TransferRequest(TransferOp.READ, header.address, layout.HEADER_BYTES, receivers[1].name,
                               receivers[1].staging_addr)

        def second_holds_what_the_first_has() -> bool:
            probe.transfer([read]).wait()
            version, done, _ = layout.read_header(header.view())
            return version == 1 and done >= paused_at

        _wait_for(second_holds_what_the_first_has)  # read from its parent, now waiting for more
        os.kill(first.proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        reply = second.recv(60)
        assert reply[0] == "pulled" and reply[1] == 1 and reply[3], reply
        assert reply[2] >= paused_at * cfg.chunk_bytes, "the second read the first's chunks from it"
        assert time.monotonic() - killed < cfg.stall_timeout_s / 2, "it left the dead parent at once, not by timeout"
        third = spawn(procs.subscriber_main, pub.address, {})  # its parent: the second, which finished
        third.send((1, 64))
        reply = third.recv(60)
        assert reply[0] == "pulled" and reply[3], reply
        assert reply[2] > 0, "the third read from its live parent"


def _wait_for(condition: Any, timeout_s: float = 60.0) -> Any:
    """Polls ``condition`` until it returns something true (which is returned)."""
    deadline = time.monotonic() + timeout_s
    while not (result := condition()):
        assert time.monotonic() < deadline, "the awaited state never came"
        time.sleep(0.01)
    return result


def test_trainer_killed_mid_publish_fails_the_pull_cleanly(spawn: Any) -> None:
    publisher = spawn(procs.publisher_main, {"chunk_bytes": 64 << 10, "stall_timeout_s": 1.0}, 64)
    address = publisher.hello[1]
    publisher.send(("publish", 1))
    assert publisher.recv() == ("published", 1)
    with Subscriber(address, config=WeightsConfig(rpc_timeout_s=2)) as sub:
        old = {n: t.clone() for n, t in sub.pull(1).tensors.items()}
        dest = {n: t.clone() for n, t in old.items()}
        publisher.send(("die_mid_publish", 2))
        started = time.monotonic()
        with pytest.raises(WeightsError):
            sub.pull(2, into=dest, wait_s=10)
        assert time.monotonic() - started < 15
        publisher.proc.join(5)
        assert publisher.proc.exitcode == -signal.SIGKILL
        for name, t in old.items():  # nothing of the broken version reached the destination
            assert torch.equal(dest[name], t), name


def test_concurrent_publishes_never_give_a_mixed_version(spawn: Any) -> None:
    """Publishes as fast as possible while receivers pull the latest: every pull is one whole
    version, or a typed error when the version was freed under it -- never a mix."""
    tensors = procs.make_tensors(1, scale=4)
    cfg = WeightsConfig(keep_versions=1, lease_s=0.1, **SMALL)
    with Publisher(tensors, config=cfg) as pub:
        pub.publish(1)
        subs = [spawn(procs.subscriber_main, pub.address, {}) for _ in range(2)]
        stop = threading.Event()

        def churn() -> None:
            v = 1
            while not stop.is_set():
                v += 1
                for name, t in procs.make_tensors(v, 4).items():
                    tensors[name].copy_(t)
                pub.publish(v)

        thread = threading.Thread(target=churn)
        thread.start()
        outcomes: list[Any] = []
        try:
            for _ in range(15):
                for s in subs:
                    s.send((None, 4))
                outcomes += [s.recv() for s in subs]
        finally:
            stop.set()
            thread.join()
        pulled = [o for o in outcomes if o[0] == "pulled"]
        assert pulled, outcomes
        assert all(o[3] for o in pulled), [o for o in pulled if not o[3]]
        errors = [o for o in outcomes if o[0] == "error"]
        assert all(o[1] in ("VersionChangedError", "VersionNotFoundError") for o in errors), errors


# -- in-place serving ---------------------------------------------------------------------

def test_in_place_serving_reads_the_trainers_tensors_and_retires(spawn: Any) -> None:
    tensors = procs.make_tensors(5, scale=8)
    with Publisher(tensors, config=WeightsConfig(**SMALL)) as pub:
        with pub.serve(5) as version, Subscriber(pub.address) as sub:
            assert version == 5 and pub.versions() == [5]
            pulled = sub.pull(5)
            for name, t in tensors.items():
                assert torch.equal(pulled.tensors[name], t), name
            child = spawn(procs.subscriber_main, pub.address, {})  # another process: cross-memory reads
            child.send((5, 8))
            reply = child.recv()
            assert reply[0] == "pulled" and reply[1] == 5 and reply[3], reply
        assert pub.versions() == []  # retired: the trainer may change its tensors now
        with Subscriber(pub.address) as sub, pytest.raises(VersionNotFoundError):
            sub.pull(5)
        pub.publish(6)  # snapshots and in-place versions mix
        with pub.serve(7), Subscriber(pub.address) as sub:
            assert sub.pull(6).version == 6 and sub.pull(7).version == 7
        shared = dict(tensors, tied=tensors["embed.weight"], view=tensors["lm_head.weight"][100:200])
        pub.publish(9, tensors=shared, in_place=True)  # tensors sharing storage: registered once
        with Subscriber(pub.address) as sub:
            pulled = sub.pull(9)
            for name, t in shared.items():
                assert torch.equal(pulled.tensors[name], t), name
        pub.retire(9)


def test_in_place_pull_racing_a_retire_fails_instead_of_mixing() -> None:
    tensors = procs.make_tensors(2, scale=64)
    with Publisher(tensors, config=WeightsConfig(chunk_bytes=64 << 10, window=1)) as pub, Subscriber(pub.address) as sub:
        pub.publish(2, in_place=True)

        def retire_and_scribble() -> None:
            time.sleep(0.002)
            pub.retire(2)
            for t in tensors.values():
                t.zero_()

        thread = threading.Thread(target=retire_and_scribble)
        thread.start()
        try:
            pulled = sub.pull(2)
        except (VersionChangedError, VersionNotFoundError):
            pass  # the retire came first or mid-pull: refused, never mixed
        else:  # the pull finished (and checked) before the retire: the whole version 2
            want = procs.make_tensors(2, scale=64)
            assert all(torch.equal(pulled.tensors[n], t) for n, t in want.items())
        thread.join()


def test_in_place_refuses_what_it_cannot_serve() -> None:
    with Publisher({"w": torch.zeros(4, 4).t()}) as pub:
        with pytest.raises(ConfigError, match="contiguous CPU tensors"):
            pub.publish(1, in_place=True)
        with pytest.raises(VersionNotFoundError, match="not being served in place"):
            pub.retire(1)
