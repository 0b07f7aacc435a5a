"""Replicator's commit rule without sockets: a leader with fewer standbys than min_standbys
acknowledges nothing; a standby counts once it acked its snapshot and joins the in-sync set
once caught up; one that leaves is removed from the in-sync set before anything commits
without it."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
from tidekv.store.ha.replication import Ack, Follow, Replicator
from tidekv.store.master.journal import DropOp
from tidekv.store.wire import protocol as p


class _Transport:
    def __init__(self) -> None:
        self.frames: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.frames.append(data)

    def close(self) -> None:
        self.closed = True


def _ack(seq: int) -> bytes:
    return p.frame(msgspec.msgpack.encode(Ack(seq)))


def test_commit_waits_for_a_standby_and_for_etcd_before_dropping_one() -> None:
    """Ordered by events, not sleeps: the in-sync writes run in a worker thread; the one that drops
    the standby is held there (``etcd``) while the test checks that nothing committed meanwhile."""
    async def main() -> None:
        commits: list[int] = []
        records: list[list[str]] = []
        etcd = threading.Event()  # the drop's write to etcd finishes only when the test says so

        def record(members: list[str]) -> bool:
            records.append(members)
            if members == ["L"]:
                assert etcd.wait(10), "the test never let the write finish"
            return True

        r = Replicator("L", sync_timeout_s=60.0, record_insync=record, on_commit=commits.append, min_standbys=1)
        r.publish(1, [DropOp(1)])
        assert r.commit_seq == 0, "a leader alone acknowledges nothing"
        t: Any = _Transport()
        r.attach(t, Follow(p.PROTOCOL_VERSION, "S"), [])
        r.received(t, _ack(1))  # the snapshot (at seq 1) holds batch 1
        assert (r.commit_seq, commits) == (1, [1])
        await _until(lambda: r.insync == ["L", "S"], "the in-sync write (a worker thread) to add S")
        assert records == [["L", "S"]]
        r.publish(2, [DropOp(2)])
        assert r.commit_seq == 1
        r.lost(t)  # the standby disconnects before acking batch 2
        assert r.commit_seq == 1, "nothing commits without it before etcd no longer lists it"
        await _until(lambda: records[-1] == ["L"], "the write that drops S to start")
        assert r.commit_seq == 1 and not t.closed and r.insync == ["L", "S"], \
            "while etcd still lists it, S is not dropped and nothing commits without it"
        etcd.set()
        await _until(lambda: t.closed, "the standby to be dropped once etcd no longer lists it")
        assert records[-1] == ["L"] and r.insync == ["L"]
        assert r.commit_seq == 1, "and then still nothing: fewer than min_standbys hold batch 2"

        alone = Replicator("L", sync_timeout_s=60.0, record_insync=record, on_commit=commits.append, min_standbys=0)
        alone.publish(1, [DropOp(1)])
        assert alone.commit_seq == 1, "min_standbys=0: a leader alone may acknowledge"

    asyncio.run(main())


async def _until(condition: Callable[[], Any], what: str, timeout_s: float = 10.0) -> None:
    """Lets the event loop run (its executor callbacks) until ``condition()`` holds."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        await asyncio.sleep(0.005)
