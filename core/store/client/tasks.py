"""Copy and move tasks from a store client (``TaskCalls``, a base class of ``Store``): a replica
of an object made on named segments, or moved from one segment to another, by the holders of
those segments; ``task`` says how it stands. The bookkeeping is the master's
(``tidekv.store.master.tasks``, journaled: a failover loses neither a task nor its outcome).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tidekv.store.wire import protocol as p
from tidekv.store.wire.keys import Key, key_bytes

if TYPE_CHECKING:
    from tidekv.store.client.store import Store

TaskId = tuple[int, int]
"""A task's id: a UUID as two 64-bit halves (as Mooncake's)."""

STATUSES = ("PENDING", "PROCESSING", "SUCCESS", "FAILED")


class TaskCalls:
    """The task methods of ``Store`` (mixed in)."""

    def copy_to(self: Store, key: Key, targets: Sequence[str]) -> TaskId:
        """Starts copying ``key``'s object to each of ``targets`` (segment names, as
        ``Store.segment_name``); returns the task's id.

        Raises:
            ConfigError: no complete object, a task of it under way, a target that is not a
                mounted segment or holds a replica already (the message says which).
        """
        return _create(self, 0, key, list(targets), "")

    def move_to(self: Store, key: Key, source: str, target: str) -> TaskId:
        """Starts moving ``key``'s replica on segment ``source`` to segment ``target``."""
        return _create(self, 1, key, [target], source)

    def task(self: Store, task_id: TaskId) -> dict[str, Any] | None:
        """A task's state ("status": PENDING, PROCESSING, SUCCESS or FAILED; "message" says why
        it failed; "assigned_client", "created_at_ms", "updated_at_ms"), or None when the master
        of its object's group does not know the id."""
        for rpc in self._pool.clients:
            state = rpc.call(p.QueryTask(list(task_id)))
            if state is not None:
                return {**state, "status": STATUSES[state["status"]], "type": ("COPY", "MOVE")[state["type"]]}
        return None


def _create(store: Store, kind: int, key: Key, targets: list[str], source: str) -> TaskId:
    bkey = key_bytes(key)
    group = store._pool.map.group_of(bkey)
    hi, lo = store._groups[group].rpc.call(p.CreateTask(kind, [bkey], targets, source))
    return hi, lo
