"""Copy and move tasks: an object's replica made on named segments (copy), or moved from one
segment to another (move), by the holders of the target segments, as re-replication makes its
copies (``repairs``): the master hands the holder a ``RepairTask`` for its own segment, the holder
copies the bytes from a replica and reports, the replica is added. A move then drops the
source's replica (its bytes kept for the lease TTL, as any freed bytes). A task is PENDING until
a holder is handed its copy, PROCESSING until every copy is reported, then SUCCESS, or FAILED with
a message (a copy failed or missed its deadline, the object was removed or replaced).

Every change of a task is journaled (``journal.TaskOp``), so a failover or a restart loses
neither a task nor its outcome; copies under way are repairs, journaled as such. Ids are random
128-bit UUIDs, as Mooncake's (two 64-bit halves). Neighbours: ``repairs`` (the copies),
``objects``, ``service`` (``CreateTask``, ``QueryTask``).
"""

from __future__ import annotations

import enum
import logging
import time
import uuid
from typing import TYPE_CHECKING, Any

from tidekv.errors import ConfigError
from tidekv.store.master import journal as j
from tidekv.store.wire import names

if TYPE_CHECKING:
    from tidekv.store.master.objects import ObjectTable

logger = logging.getLogger(__name__)


class TaskKind(enum.IntEnum):
    COPY = 0
    MOVE = 1


class TaskStatus(enum.IntEnum):
    PENDING = 0
    PROCESSING = 1
    SUCCESS = 2
    FAILED = 3


def _ms() -> int:
    return int(time.time() * 1000)


class TaskBook:
    """The copy and move tasks of one master (see the module docstring). Single-threaded."""

    def __init__(self, table: ObjectTable) -> None:
        self.table = table
        self.tasks: dict[tuple[int, int], j.TaskOp] = {}
        self._by_key: dict[bytes, tuple[int, int]] = {}  # key -> its task under way (one at a time)
        table.repairs.on_handed = self._handed
        table.repairs.on_finished = self._finished

    def create(self, kind: TaskKind, key: bytes, targets: list[str], source: str) -> tuple[int, int]:
        """A new task; its id.

        Raises:
            ConfigError: no complete object ``key``, a task of it under way, a target that is not
                a mounted segment or already holds a replica, or (move) a source without one.
        """
        meta = self.table.objects.get(key)
        if meta is None or meta.put is not None:
            raise ConfigError(f"no complete object {key[:64]!r} to {kind.name.lower()}")
        if key in self._by_key:
            raise ConfigError(f"object {key[:64]!r} has a task under way already")
        have = set(meta.replicas[::2])
        if not targets or len(set(targets)) != len(targets):
            raise ConfigError(f"targets {[names.plain(t) for t in targets]}: expected distinct segment names")
        for target in targets:
            if target not in self.table.segments.segments:
                raise ConfigError(f"target {names.plain(target)!r} is not a mounted segment")
            if target in have:
                raise ConfigError(f"target {names.plain(target)!r} holds a replica of {key[:64]!r} already")
        if kind == TaskKind.MOVE and (len(targets) != 1 or source not in have):
            raise ConfigError(f"a move takes one target and a source holding a replica; {names.plain(source)!r} "
                              "holds none" if source not in have else "a move takes one target")
        value = uuid.uuid4().int
        task_id = (value >> 64, value & ((1 << 64) - 1))
        now = _ms()
        task = j.TaskOp(list(task_id), int(kind), key, list(targets), source, int(TaskStatus.PENDING), now, now)
        self._start(task)
        self._journal(task)
        return task_id

    def query(self, task_id: tuple[int, int]) -> dict[str, Any] | None:
        task = self.tasks.get((int(task_id[0]), int(task_id[1])))
        if task is None:
            return None
        return {"id": list(task.id), "type": task.kind, "status": task.status, "created_at_ms": task.created_ms,
                "updated_at_ms": task.updated_ms, "assigned_client": names.plain(task.assigned),
                "message": task.message}

    def tick(self) -> None:
        """Fails tasks whose object is gone (no copy will ever be handed out for it)."""
        for key, task_id in list(self._by_key.items()):
            meta = self.table.objects.get(key)
            task = self.tasks[task_id]
            if meta is None or meta.put is not None or meta.token != task.token:
                self._end(task, TaskStatus.FAILED, "the object was removed or replaced")

    def snapshot(self) -> list[j.Op]:
        return list(self.tasks.values())

    def restore(self, tasks: dict[tuple[int, int], j.TaskOp]) -> None:
        """Tasks from a mirror; those under way go on (their copies under way are repairs)."""
        for task in tasks.values():
            self.tasks[tuple(task.id)] = task  # type: ignore[index]
            if task.status in (TaskStatus.PENDING, TaskStatus.PROCESSING):
                self._start(task)

    def _start(self, task: j.TaskOp) -> None:
        meta = self.table.objects.get(task.key)
        self.tasks[tuple(task.id)] = task  # type: ignore[index]
        if meta is None:
            return
        task.token = meta.token
        self._by_key[task.key] = tuple(task.id)  # type: ignore[assignment]
        left = [t for t in task.targets if t not in meta.replicas[::2]]
        self.table.repairs.targets[task.key] = set(left)
        self.table.repairs.degraded[task.key] = None

    def _handed(self, key: bytes, segment: str, client_id: str) -> None:
        task_id = self._by_key.get(key)
        if task_id is None:
            return
        task = self.tasks[task_id]
        task.status, task.assigned, task.updated_ms = int(TaskStatus.PROCESSING), client_id, _ms()
        self._journal(task)

    def _finished(self, key: bytes, segment: str, ok: bool) -> None:
        task_id = self._by_key.get(key)
        if task_id is None:
            return
        task = self.tasks[task_id]
        if not ok:
            self._end(task, TaskStatus.FAILED, f"the copy to {names.plain(segment)!r} failed or missed its deadline")
            return
        left = self.table.repairs.targets.get(key, set())
        left.discard(segment)
        if left:
            return
        if task.kind == TaskKind.MOVE:
            self.table.drop_replica(key, task.source)
        self._end(task, TaskStatus.SUCCESS, "")

    def _end(self, task: j.TaskOp, status: TaskStatus, message: str) -> None:
        self._by_key.pop(task.key, None)
        self.table.repairs.targets.pop(task.key, None)
        task.status, task.message, task.updated_ms = int(status), message, _ms()
        if status == TaskStatus.FAILED:
            logger.warning("task %x-%x (%s of %r) failed: %s", task.id[0], task.id[1], TaskKind(task.kind).name,
                           task.key[:64], message)
        self._journal(task)

    def _journal(self, task: j.TaskOp) -> None:
        if self.table.journal is not None:
            self.table.journal.add(j.TaskOp(**{f: getattr(task, f) for f in task.__struct_fields__}), task.key)
