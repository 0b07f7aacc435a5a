"""Replicator's commit rule without sockets: a leader with fewer standbys than min_standbys
acknowledges nothing; a standby counts once it acked its snapshot and joins the in-sync set
once caught up; one that leaves is removed from the in-sync set before anything commits
without it."""

from __future__ import annotations

import asyncio
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
    async def main() -> None:
        commits: list[int] = []
        records: list[list[str]] = []

        def record(members: list[str]) -> bool:
            records.append(members)
            return True

        r = Replicator("L", sync_timeout_s=60.0, record_insync=record, on_commit=commits.append, min_standbys=1)
        r.publish(1, [DropOp(1)])
        assert r.commit_seq == 0, "a leader alone acknowledges nothing"
        t: Any = _Transport()
        r.attach(t, Follow(p.PROTOCOL_VERSION, "S"), [])
        r.received(t, _ack(1))  # the snapshot (at seq 1) holds batch 1
        assert (r.commit_seq, commits) == (1, [1])
        await asyncio.sleep(0.1)  # the in-sync write runs in a worker thread
        assert records == [["L", "S"]] and r.insync == ["L", "S"]
        r.publish(2, [DropOp(2)])
        assert r.commit_seq == 1
        r.lost(t)  # the standby disconnects before acking batch 2
        assert r.commit_seq == 1, "nothing commits without it before etcd no longer lists it"
        await asyncio.sleep(0.1)
        assert records[-1] == ["L"] and t.closed
        assert r.commit_seq == 1, "and then still nothing: fewer than min_standbys hold batch 2"

        alone = Replicator("L", sync_timeout_s=60.0, record_insync=record, on_commit=commits.append, min_standbys=0)
        alone.publish(1, [DropOp(1)])
        assert alone.commit_seq == 1, "min_standbys=0: a leader alone may acknowledge"

    asyncio.run(main())
