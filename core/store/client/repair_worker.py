"""A holder's side of re-replication (``repairs``): copies objects that lost replicas into this
holder's own segment when the master asks.

The worker asks the master for repairs about once a heartbeat (``Repairs``, which also carries
the reports of the last round; the loop is ``poller.MasterPoller``'s), reads each object from one
of its live replicas into the address the master reserved in this holder's segment, and reports
which copies are complete. A copy
that fails from one replica is tried from the next; one that fails from all is reported failed
(the master tries again later, perhaps elsewhere). While there is work it asks again at once.
Neighbours: ``client`` (``Store`` runs one when it contributes a segment), ``master_client``.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict

from tidekv.errors import TidekvError
from tidekv.store.client.master_client import MasterClient
from tidekv.store.client.poller import MasterPoller
from tidekv.store.wire import protocol as p
from tidekv.transfer import TransferEngine, TransferOp, TransferRequest, TransferState

logger = logging.getLogger(__name__)

MAX_BYTES_PER_ROUND = 64 << 20
"""Bytes of copies asked for per request: a round stays short, and so does its report's wait."""


class RepairWorker(MasterPoller):
    def __init__(self, rpc: MasterClient, engine: TransferEngine, client_id: str, interval_s: float,
                 closed: threading.Event) -> None:
        super().__init__("repairs", client_id, interval_s, closed)
        self._rpc = rpc
        self._engine = engine
        self._done: list[p.RepairResult] = []  # the last round's reports, sent with the next request
        self.copied = 0  # objects copied (for tests and stats)

    def _ask(self) -> list[p.RepairTask]:
        tasks: list[p.RepairTask] = self._rpc.call(p.Repairs(self._client_id, self._done, MAX_BYTES_PER_ROUND),
                                                   failover_timeout_s=0)
        return tasks

    def _work(self, tasks: list[p.RepairTask]) -> bool:
        self._done = self.copy(tasks) if tasks else []
        return bool(tasks)

    def copy(self, tasks: list[p.RepairTask]) -> list[p.RepairResult]:
        """Makes each copy, trying its sources in turn; returns one result per task."""
        ok = [False] * len(tasks)
        for attempt in range(max(len(t.sources) for t in tasks)):
            by_peer: dict[str, list[int]] = defaultdict(list)
            for i, task in enumerate(tasks):
                if not ok[i] and attempt < len(task.sources):
                    by_peer[task.sources[attempt].engine].append(i)
            for peer, items in by_peer.items():
                requests = [TransferRequest(TransferOp.READ, tasks[i].target, tasks[i].size, peer,
                                            tasks[i].sources[attempt].addr) for i in items]
                timeout = min(tasks[i].deadline_s for i in items) * 0.8
                try:
                    handle = self._engine.transfer(requests)
                    try:
                        handle.wait(timeout)
                    except TidekvError:
                        pass  # per request below
                    for i, status in zip(items, handle.statuses(), strict=True):
                        ok[i] = status.state == TransferState.DONE
                except TidekvError as exc:
                    logger.warning("store client %s: repairs from %s failed: %s", self._client_id, peer, exc)
        self.copied += sum(ok)
        return [p.RepairResult(t.key, t.token, done) for t, done in zip(tasks, ok, strict=True)]
