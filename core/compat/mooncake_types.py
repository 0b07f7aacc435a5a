"""Mooncake's store value types and error codes (``mooncake.store`` names): ``ErrorCode`` and the
one table from tidekv's typed errors to it, ``ReplicateConfig``, the replica descriptors,
``BufferHandle`` and ``MooncakeHostMemAllocator``, as the Mooncake drop-in hands them to callers.

Neighbours: ``tidekv.compat.mooncake_store`` (the store that returns them), ``tidekv.errors``.
"""

from __future__ import annotations

import ctypes
import enum
import logging
import mmap
import os
import threading
from typing import Any, ClassVar

from tidekv.errors import (
    ConfigError,
    LeaseExpiredError,
    MasterUnavailableError,
    ObjectLeasedError,
    ObjectNotFoundError,
    OutOfSpaceError,
    RpcError,
    TensorFormatError,
    TidekvError,
    TransferError,
)
from tidekv.logs import WarnEvery
from tidekv.store.wire.protocol import Pin

logger = logging.getLogger(__name__)


class ErrorCode(enum.IntEnum):
    """The codes of Mooncake's ``ErrorCode`` (mooncake-store/include/types.h) this module returns."""

    OK = 0
    INTERNAL_ERROR = -1
    NO_AVAILABLE_HANDLE = -200  #: no space, even after eviction
    INVALID_PARAMS = -600  #: a bad argument, a buffer too small for the object
    OBJECT_NOT_FOUND = -704
    OBJECT_HAS_LEASE = -706
    LEASE_EXPIRED = -707  #: the read outlived its lease; the bytes are not to be trusted
    TRANSFER_FAIL = -800
    RPC_FAIL = -900  #: the master did not answer
    UNAVAILABLE_IN_CURRENT_MODE = -1011  #: an operation tidekv does not offer


_ERROR_CODES: tuple[tuple[type[BaseException], ErrorCode], ...] = (
    (ObjectNotFoundError, ErrorCode.OBJECT_NOT_FOUND),
    (ObjectLeasedError, ErrorCode.OBJECT_HAS_LEASE),
    (LeaseExpiredError, ErrorCode.LEASE_EXPIRED),
    (OutOfSpaceError, ErrorCode.NO_AVAILABLE_HANDLE),
    (ConfigError, ErrorCode.INVALID_PARAMS),
    (TensorFormatError, ErrorCode.INVALID_PARAMS),
    (MasterUnavailableError, ErrorCode.RPC_FAIL),
    (RpcError, ErrorCode.RPC_FAIL),
    (TransferError, ErrorCode.TRANSFER_FAIL),
    (TidekvError, ErrorCode.INTERNAL_ERROR),
)
"""tidekv's typed errors -> Mooncake's codes: the one table (first match wins, so subclasses first)."""


def error_code(error: BaseException | type[BaseException]) -> int:
    """Mooncake's code for a tidekv error (an instance or a class), by ``_ERROR_CODES``."""
    cls = error if isinstance(error, type) else type(error)
    for kind, code in _ERROR_CODES:
        if issubclass(cls, kind):
            return int(code)
    raise AssertionError(f"no Mooncake code for {cls.__name__}")  # only TidekvErrors reach here


_OTHER_TIERS = WarnEvery(60.0)


def placement(config: ReplicateConfig | None) -> dict[str, Any]:
    """A ReplicateConfig as the keyword arguments of tidekv's put calls. NVMe-oF and DFS replicas
    (``nof_replica_num``, ``dfs_replica_num``) have no counterpart: the put goes on with memory
    replicas, and a warning (at most once a minute) says that disk copies come from the holders'
    disk tier instead."""
    if config is None:
        return {}
    if (config.nof_replica_num or config.dfs_replica_num) and (held := _OTHER_TIERS.due()) is not None:
        logger.warning("mooncake store compat: nof_replica_num=%s / dfs_replica_num=%s are not served: tidekv keeps "
                       "disk copies on its holders' disk tier (disk_paths, the master's disk_write_through), not "
                       "per put; the put goes on with %s memory replica(s)%s", config.nof_replica_num,
                       config.dfs_replica_num, config.replica_num,
                       f" ({held} similar warnings held back)" if held else "")
    if config.with_hard_pin:
        pin = Pin.HARD
    elif config.with_soft_pin or config.soft_pin_action == SoftPinAction.ENABLE:
        pin = Pin.SOFT
    else:
        pin = Pin.NONE
    preferred = config.preferred_segment or next(iter(config.preferred_segments), "")
    return {"pin": pin, "replicas": config.replica_num, "preferred_segment": preferred or None}


class SoftPinAction(enum.IntEnum):
    """``ReplicateConfig.soft_pin_action``."""

    PRESERVE = 0
    ENABLE = 1
    DISABLE = 2


class ReplicaStatus(enum.IntEnum):
    """A replica's state; the replicas this module reports are all COMPLETE."""

    UNDEFINED = 0
    INITIALIZED = 1
    PROCESSING = 2
    COMPLETE = 3
    REMOVED = 4
    FAILED = 5


class ReplicateConfig:
    """Mooncake's placement settings for a put, constructible with no arguments. Unknown
    attributes are refused (``__slots__``), as on Mooncake's bound class."""

    __slots__ = ("replica_num", "nof_replica_num", "dfs_replica_num", "with_soft_pin", "soft_pin_action",
                 "soft_pin_ttl_ms", "with_hard_pin", "preferred_segment", "preferred_segments",
                 "preferred_nof_segments", "prefer_alloc_in_same_node", "group_ids", "session_ids", "data_type")

    def __init__(self) -> None:
        self.replica_num = 1
        self.nof_replica_num = 0
        self.dfs_replica_num = 0
        self.with_soft_pin = False
        self.soft_pin_action = SoftPinAction.PRESERVE
        self.soft_pin_ttl_ms: int | None = None
        self.with_hard_pin = False
        self.preferred_segment = ""
        self.preferred_segments: list[str] = []
        self.preferred_nof_segments: list[str] = []
        self.prefer_alloc_in_same_node = False
        self.group_ids: list[str] | None = None
        self.session_ids: list[str] | None = None
        self.data_type = 0

    def __repr__(self) -> str:
        return "ReplicateConfig(" + ", ".join(f"{n}={getattr(self, n)!r}" for n in self.__slots__) + ")"


class Descriptor:
    """Where one replica's bytes are: ``transport_endpoint`` is the holder's transfer engine."""

    def __init__(self, buffer_address: int = 0, size: int = 0, transport_endpoint: str = "") -> None:
        self.buffer_address = buffer_address
        self.size = size
        self.transport_endpoint = transport_endpoint


class MemoryDescriptor:
    def __init__(self, buffer_descriptor: Descriptor) -> None:
        self.buffer_descriptor = buffer_descriptor


class DiskDescriptor:
    """An object on a holder's disk (Mooncake's ``LOCAL_DISK`` replica): ``transport_endpoint`` is
    the holder's disk server, ``file_path`` names the disk and the record's offset."""

    def __init__(self, file_path: str, object_size: int, transport_endpoint: str) -> None:
        self.file_path = file_path
        self.object_size = object_size
        self.transport_endpoint = transport_endpoint


class ReplicaDescriptor:
    """One replica (``batch_get_replica_desc``): in a holder's memory, or on its disk (the disk tier)."""

    def __init__(self, memory: MemoryDescriptor | None, disk: DiskDescriptor | None = None) -> None:
        self._memory = memory
        self._disk = disk
        self.status = ReplicaStatus.COMPLETE

    def is_memory_replica(self) -> bool:
        return self._memory is not None

    def is_disk_replica(self) -> bool:
        return False

    def is_local_disk_replica(self) -> bool:
        return self._disk is not None

    def get_memory_descriptor(self) -> MemoryDescriptor | None:
        return self._memory

    def get_disk_descriptor(self) -> DiskDescriptor | None:
        return self._disk

    get_local_disk_descriptor = get_disk_descriptor


class BufferHandle(bytearray):
    """An object's bytes (``get_buffer``): a buffer with Mooncake's ``ptr()`` and ``size()``."""

    def ptr(self) -> int:
        return ctypes.addressof((ctypes.c_char * len(self)).from_buffer(self)) if self else 0

    def size(self) -> int:
        return len(self)


class MooncakeHostMemAllocator:
    """Page-aligned host memory for a pool the caller registers (SGLang's standalone storage).
    Memory stays mapped until ``free(ptr)``, whatever becomes of the allocator object."""

    _mappings: ClassVar[dict[int, mmap.mmap]] = {}
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def alloc(self, size: int) -> int:
        """The address of ``size`` fresh zeroed bytes; 0 when they cannot be had."""
        try:
            mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        except (OSError, ValueError, OverflowError, TypeError) as exc:
            logger.warning("mooncake store compat: cannot allocate %r bytes of host memory: %s", size, exc)
            return 0
        ptr = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
        with self._lock:
            self._mappings[ptr] = mapping
        return ptr

    def free(self, ptr: int) -> int:
        """Unmaps memory from ``alloc``; 0, or -600 for an address it did not hand out."""
        with self._lock:
            mapping = self._mappings.pop(ptr, None)
        if mapping is None:
            return int(ErrorCode.INVALID_PARAMS)
        try:
            mapping.close()
        except BufferError:  # still exported (a tensor over it): leave it mapped rather than crash
            logger.warning("mooncake store compat: memory at %#x is still in use; it stays mapped", ptr)
        return int(ErrorCode.OK)


# ---- parallel tensor I/O and tasks ----------------------------------------------------------

class ParallelAxis:
    """One axis of a shard's identity: ``kind`` "tp", "dp", "ep" or "pp", ``rank`` of ``size``;
    ``split_dim`` set for an axis that cuts the tensor (TP, or EP by a dimension), ``expert_id``
    / ``stage_id`` optional names of an EP / PP coordinate."""

    __slots__ = ("kind", "rank", "size", "split_dim", "expert_id", "stage_id")

    def __init__(self) -> None:
        self.kind = "tp"
        self.rank = 0
        self.size = 1
        self.split_dim: int | None = None
        self.expert_id: int | None = None
        self.stage_id: int | None = None

    def __repr__(self) -> str:
        return "ParallelAxis(" + ", ".join(f"{n}={getattr(self, n)!r}" for n in self.__slots__) + ")"


class TensorParallelism:
    """The ordered axes identifying a stored or requested shard."""

    __slots__ = ("axes",)

    def __init__(self) -> None:
        self.axes: list[ParallelAxis] = []


class ReadTarget:
    """What a tensor read returns: ``mode`` "as_stored" (the object under the key), "shard" (the
    shard ``parallelism`` names) or "full" (the whole, rebuilt from its shards)."""

    __slots__ = ("mode", "parallelism")

    def __init__(self) -> None:
        self.mode = "as_stored"
        self.parallelism: TensorParallelism | None = None


class TaskType(enum.IntEnum):
    REPLICA_COPY = 0
    REPLICA_MOVE = 1


class TaskStatus(enum.IntEnum):
    PENDING = 0
    PROCESSING = 1
    SUCCESS = 2
    FAILED = 3


class QueryTaskResponse:
    """A copy or move task's state (``query_task``)."""

    def __init__(self, id: tuple[int, int], type: TaskType, status: TaskStatus, created_at_ms_epoch: int,
                 last_updated_at_ms_epoch: int, assigned_client: str = "", message: str = "") -> None:
        self.id = id
        self.type = type
        self.status = status
        self.created_at_ms_epoch = created_at_ms_epoch
        self.last_updated_at_ms_epoch = last_updated_at_ms_epoch
        self.assigned_client = assigned_client
        self.message = message


def bind_to_numa_node(node: int) -> None:
    """Binds the calling thread's CPUs to NUMA node ``node`` (its CPUs from sysfs); a node this
    machine does not have is logged and ignored, as Mooncake does."""
    try:
        with open(f"/sys/devices/system/node/node{int(node)}/cpulist") as f:
            text = f.read().strip()
    except OSError:
        logger.warning("mooncake store compat: bind_to_numa_node(%r): no such NUMA node here", node)
        return
    cpus: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    os.sched_setaffinity(0, cpus)
