"""Mooncake's session, segment, task and memory-pool calls on the drop-in (``AdminMethods``, a
base class of ``MooncakeDistributedStore``).

Sessions: a get session leases its keys at start (``Store.lookup_many``) and each ranged read
reads byte ranges of them into registered buffers (``Store.get_ranges_into``, which looks them up
again under the same lease rules); a put session holds each object's bytes in engine memory of
this client from start to end (ranged writes copy into it), and ``end`` puts them as one batch,
so the master sees a session only when it ends: a master failover in between loses nothing, and
pool space is taken at the end (a full pool answers then, not at start). Mooncake reserves the
space at start and writes in place.

Tasks: ``create_copy_task`` / ``create_move_task`` / ``query_task`` over ``Store.copy_to`` /
``move_to`` / ``task`` (the master's journaled tasks; the copies are made by the target
segments' holders).

More segments: ``allocate_and_mount_segment`` / ``mount_segment`` (a file mapped shared) /
``unmount_segment`` / ``unmount_and_free_segment`` over ``Store.mount_segment`` and
``unmount_segment``.

SSD offload: ``unmount_local_disk_segment`` and ``get_offload_rpc_read_count`` over the disk
tier (``Store.unmount_disks``, ``disk_reads_served``).

Not offered (Mooncake's -1011, ``UNAVAILABLE_IN_CURRENT_MODE``, with a log line naming why):
``init_all`` (``setup`` initializes).
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from tidekv.compat.mooncake_types import ErrorCode, QueryTaskResponse, ReplicateConfig, TaskStatus, TaskType, placement
from tidekv.errors import ConfigError
from tidekv.store.wire.protocol import Status
from tidekv.transfer.region import Region

logger = logging.getLogger(__name__)

UNAVAILABLE = int(ErrorCode.UNAVAILABLE_IN_CURRENT_MODE)
TASK_NOT_FOUND = -1400
"""Mooncake's code for a task id it does not know (``query_task``)."""


def _unavailable(op: str, why: str) -> int:
    logger.warning("mooncake store compat: %s() is not offered by tidekv: %s", op, why)
    return UNAVAILABLE


class AdminMethods:
    """Mooncake's session, segment, task and memory-pool methods (see the module docstring)."""

    _call: Callable[[str, Callable[[Any], Any]], Any]
    _code: Callable[[str, Callable[[Any], Any]], int]
    _per_key: Callable[[str, Sequence[str], Callable[[Any], Any]], list[int]]
    _lock: threading.Lock

    def _admin(self) -> dict[str, Any]:
        """This store's session and pool state, made on first use."""
        state = self.__dict__.get("_admin_state")
        if state is None:
            state = self.__dict__.setdefault("_admin_state", {"gets": set(), "puts": {}, "pool": {}, "mapped": {}})
        return state

    # ---- get sessions -------------------------------------------------------------------

    def batch_get_session_start(self, keys: list[str]) -> list[int]:
        """Leases the keys for ranged reads; per key 0 or -704 (missing)."""
        def run(store: Any) -> list[int]:
            infos = store.lookup_many(keys)
            with self._lock:
                self._admin()["gets"].update(k for k, i in zip(keys, infos) if i is not None)
            return [int(ErrorCode.OBJECT_NOT_FOUND) if i is None else 0 for i in infos]
        out = self._call("batch_get_session_start", run)
        return [out] * len(keys) if isinstance(out, int) else out

    def batch_get_into_multi_buffer_ranges(self, keys: list[str], all_buffer_ptrs: list[list[int]],
                                           all_sizes: list[list[int]], all_src_offsets: list[list[int]]) -> list[int]:
        """For key ``i``, object bytes from ``all_src_offsets[i][j]`` go to buffer
        ``all_buffer_ptrs[i][j]`` (``all_sizes[i][j]`` bytes); per key the bytes read or a code."""
        try:
            ranges = [[(off, (ptr, n)) for ptr, n, off in zip(p, s, o, strict=True)]
                      for p, s, o in zip(all_buffer_ptrs, all_sizes, all_src_offsets, strict=True)]
            if len(ranges) != len(keys):
                raise ValueError
        except ValueError:
            logger.error("mooncake store compat: batch_get_into_multi_buffer_ranges: its lists differ in shape")
            return [int(ErrorCode.INVALID_PARAMS)] * len(keys)

        def run(store: Any) -> list[int]:
            sizes = store.get_ranges_into(keys, ranges)
            return [int(ErrorCode.OBJECT_NOT_FOUND) if n is None else sum(b[1] for _, b in r)
                    for n, r in zip(sizes, ranges)]
        out = self._call("batch_get_into_multi_buffer_ranges", run)
        return [out] * len(keys) if isinstance(out, int) else out

    def batch_get_session_end(self, keys: list[str]) -> int:
        """Ends the get session of ``keys`` (their leases run out on the master's clock); 0."""
        with self._lock:
            self._admin()["gets"].difference_update(keys)
        return 0

    # ---- put sessions -------------------------------------------------------------------

    def batch_put_session_start(self, keys: list[str], sizes: list[int],
                                config: ReplicateConfig | None = None) -> list[int]:
        """Opens a put session per key for an object of ``sizes[i]`` bytes; per key 0, -600 (a
        bad size, or a session already open) or another code."""
        def run(store: Any) -> list[int]:
            out = []
            for key, size in zip(keys, sizes, strict=True):
                with self._lock:
                    sessions = self._admin()["puts"]
                    if key in sessions or size <= 0:
                        out.append(int(ErrorCode.INVALID_PARAMS))
                        continue
                    sessions[key] = (store.engine.allocate(size), placement(config))
                out.append(0)
            return out
        out = self._call("batch_put_session_start", run)
        return [out] * len(keys) if isinstance(out, int) else out

    def batch_put_from_multi_buffer_ranges(self, keys: list[str], all_buffer_ptrs: list[list[int]],
                                           all_sizes: list[list[int]], all_dst_offsets: list[list[int]]) -> list[int]:
        """Copies each buffer into its session's object at its offset; per key the bytes written,
        or -600 (no session, a range past the object's end, lists of unequal shape)."""
        import ctypes

        out = []
        for i, key in enumerate(keys):
            with self._lock:
                session = self._admin()["puts"].get(key)
            try:
                if session is None:
                    raise ConfigError(f"no put session for {key!r}: batch_put_session_start() it first")
                region: Region = session[0]
                written = 0
                for ptr, n, off in zip(all_buffer_ptrs[i], all_sizes[i], all_dst_offsets[i], strict=True):
                    if off < 0 or off + n > region.length:
                        raise ConfigError(f"range [{off}, +{n}) is outside {key!r}'s {region.length} bytes")
                    ctypes.memmove(region.address + off, ptr, n)
                    written += n
                out.append(written)
            except (ConfigError, ValueError, IndexError) as exc:
                logger.error("mooncake store compat: batch_put_from_multi_buffer_ranges(%r): %s", key, exc)
                out.append(int(ErrorCode.INVALID_PARAMS))
        return out

    def batch_put_session_end(self, keys: list[str]) -> list[int]:
        """Stores every session's object (one put per placement) and closes the sessions; per key
        0 or a code (-600: no session)."""
        with self._lock:
            sessions = self._admin()["puts"]
            taken = {k: sessions.pop(k) for k in dict.fromkeys(keys) if k in sessions}
        codes: dict[str, int] = {}
        try:
            for kwargs in {repr(p): p for _, p in taken.values()}.values():
                batch = [k for k, (_, p) in taken.items() if p == kwargs]
                codes.update(zip(batch, self._puts(batch, [taken[k][0] for k in batch], kwargs)))
        finally:
            for region, _ in taken.values():
                self._release(region)
        return [codes.get(k, int(ErrorCode.INVALID_PARAMS)) for k in keys]

    def batch_put_session_revoke(self, keys: list[str]) -> list[int]:
        """Drops open sessions (nothing reaches the pool); per key 0 or -600 (no session)."""
        out = []
        for key in keys:
            with self._lock:
                session = self._admin()["puts"].pop(key, None)
            if session is not None:
                self._release(session[0])
            out.append(0 if session is not None else int(ErrorCode.INVALID_PARAMS))
        return out

    def _puts(self, keys: list[str], regions: Sequence[Region], kwargs: dict[str, Any]) -> list[int]:
        return self._per_key("batch_put_session_end", keys, lambda s: s.put_many_from(keys, list(regions), **kwargs))

    def _release_all(self, store: Any) -> None:
        """Frees the memory of open put sessions and of ``alloc_from_mem_pool`` (at ``close``)."""
        with self._lock:
            state = self._admin()
            regions = [r for r, _ in state["puts"].values()] + list(state["pool"].values())
            state["puts"].clear()
            state["pool"].clear()
            state["gets"].clear()
        for region in regions:
            store.engine.unregister(region)

    def _close_mapped(self) -> None:
        """Unmaps the files ``mount_segment`` mapped (after the store let go of them, at ``close``)."""
        with self._lock:
            mapped = list(self._admin()["mapped"].values())
            self._admin()["mapped"].clear()
        for mapping in mapped:
            try:
                mapping.close()
            except BufferError:  # still exported somewhere: leave it mapped rather than crash
                logger.warning("mooncake store compat: a mapped segment is still in use; it stays mapped")

    def _release(self, region: Region) -> None:
        store = getattr(self, "_store", None)
        if store is not None:
            store.engine.unregister(region)

    # ---- memory pool, replicas ----------------------------------------------------------

    def alloc_from_mem_pool(self, size: int) -> int:
        """The address of ``size`` bytes of registered memory of this client's engine (valid
        until ``close``), for the zero-copy calls; 0 when it cannot be had."""
        def run(store: Any) -> int:
            region = store.engine.allocate(size)
            with self._lock:
                self._admin()["pool"][region.address] = region
            return region.address
        out = self._call("alloc_from_mem_pool", run)
        return out if isinstance(out, int) and out > 0 else 0

    def batch_replica_clear(self, keys: list[str], segment_name: str = "") -> list[str]:
        """Clears the objects whose replicas are all on ``segment_name`` (any segment when "")
        and that no reader leases; returns the keys cleared."""
        def run(store: Any) -> list[str]:
            if segment_name:
                infos = store.lookup_many(keys)
                keys_here = [k for k, i in zip(keys, infos) if i is not None and
                             all(loc.segment == segment_name for loc in i.locations)]
            else:
                keys_here = list(keys)
            statuses = store.remove_many(keys_here) if keys_here else []
            return [k for k, s in zip(keys_here, statuses) if s is Status.OK]
        out = self._call("batch_replica_clear", run)
        return [] if isinstance(out, int) else out

    # ---- more segments ---------------------------------------------------------------------

    def allocate_and_mount_segment(self, size: int, protocol: str = "tcp", location: str = "") -> dict[str, Any]:
        """Contributes ``size`` more bytes of this client's memory as a segment:
        {"ret": 0, "segment_ids": [its name], "allocated_size": size}, or a negative "ret"."""
        out = self._call("allocate_and_mount_segment", lambda s: s.mount_segment(size))
        if isinstance(out, int):
            return {"ret": out, "segment_ids": [], "allocated_size": 0}
        return {"ret": 0, "segment_ids": [out], "allocated_size": size}

    def mount_segment(self, path: str, size: int, offset: int = 0, protocol: str = "tcp",
                      location: str = "") -> dict[str, Any]:
        """Contributes ``size`` bytes of the file at ``path`` from ``offset`` (a file on /dev/shm,
        a DAX device), mapped shared, as a segment: {"ret": 0, "segment_ids": [its name]}."""
        def run(store: Any) -> str:
            try:
                fd = os.open(path, os.O_RDWR)
            except OSError as exc:
                raise ConfigError(f"mount_segment: cannot open {path!r}: {exc}") from None
            try:
                if os.fstat(fd).st_size < offset + size:
                    raise ConfigError(f"mount_segment: {path!r} holds fewer than {offset + size} bytes")
                mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, offset=offset)
            except (OSError, ValueError) as exc:
                raise ConfigError(f"mount_segment: cannot map {size} bytes of {path!r} at {offset}: {exc}") from None
            finally:
                os.close(fd)
            name = store.mount_segment(memory=mapping)
            with self._lock:
                self._admin()["mapped"][name] = mapping
            return name
        out = self._call("mount_segment", run)
        return {"ret": out, "segment_ids": []} if isinstance(out, int) else {"ret": 0, "segment_ids": [out]}

    def unmount_segment(self, segment_ids: list[str], grace_period_seconds: int = 0) -> int:
        """Takes segments ``mount_segment`` / ``allocate_and_mount_segment`` mounted out of the
        pool after ``grace_period_seconds`` (their objects go with them); 0, or -600 for an id
        that is not one of them (the others are unmounted)."""
        return self._unmount("unmount_segment", segment_ids, grace_period_seconds)

    def unmount_and_free_segment(self, segment_ids: list[str], grace_period_seconds: int = 0) -> int:
        """As ``unmount_segment``; the memory is freed (tidekv frees it at unmount either way)."""
        return self._unmount("unmount_and_free_segment", segment_ids, grace_period_seconds)

    def _unmount(self, op: str, segment_ids: list[str], grace_s: int) -> int:
        if grace_s > 0:
            time.sleep(grace_s)

        def run(store: Any) -> int:
            code = 0
            for name in segment_ids:
                try:
                    store.unmount_segment(name)
                except ConfigError as exc:
                    logger.error("mooncake store compat: %s: %s", op, exc)
                    code = int(ErrorCode.INVALID_PARAMS)
                with self._lock:
                    mapping = self._admin()["mapped"].pop(name, None)
                if mapping is not None:
                    mapping.close()
            return code
        return int(self._call(op, run))

    # ---- not offered --------------------------------------------------------------------

    def init_all(self, protocol: str, device_name: str, mount_segment_size: int) -> int:
        return _unavailable("init_all", "setup() initializes the engine and mounts the segment in one call")

    def unmount_local_disk_segment(self, grace_period_seconds: int = 0) -> int:
        """Takes this client's SSD offload tier out of the pool (``Store.unmount_disks``): its
        objects leave with it, reads under way are served for the grace period, its files go. 0,
        or a negative code (-600 without a tier)."""
        return self._code("unmount_local_disk_segment", lambda s: s.unmount_disks(float(grace_period_seconds)))

    def get_offload_rpc_read_count(self) -> int:
        """Reads of this client's SSD records it served to other clients (its disk server)."""
        store = getattr(self, "_store", None)
        return store.disk_reads_served if store is not None else 0

    # ---- tasks ----------------------------------------------------------------------------

    def create_copy_task(self, key: str, targets: list[str]) -> tuple[tuple[int, int], int]:
        """Copies the object to each target segment (names as ``get_hostname`` gives them):
        (task id, 0), or ((0, 0), a negative code: -600 for what the master refused)."""
        out = self._call("create_copy_task", lambda s: s.copy_to(key, targets))
        return ((0, 0), out) if isinstance(out, int) else (out, 0)

    def create_move_task(self, key: str, source: str, target: str) -> tuple[tuple[int, int], int]:
        """Moves the object's replica on ``source`` to ``target``: as ``create_copy_task``."""
        out = self._call("create_move_task", lambda s: s.move_to(key, source, target))
        return ((0, 0), out) if isinstance(out, int) else (out, 0)

    def query_task(self, task_id: tuple[int, int]) -> tuple[QueryTaskResponse | None, int]:
        """(the task's state, 0), or (None, -1400) for an id no master knows."""
        out = self._call("query_task", lambda s: s.task(task_id))
        if isinstance(out, int):
            return None, out
        if out is None:
            return None, TASK_NOT_FOUND
        return QueryTaskResponse(tuple(out["id"]), TaskType[f"REPLICA_{out['type']}"], TaskStatus[out["status"]],
                                 out["created_at_ms"], out["updated_at_ms"], out["assigned_client"],
                                 out["message"]), 0

