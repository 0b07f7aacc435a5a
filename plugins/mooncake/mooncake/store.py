"""``mooncake.store`` served by tidekv: every name is ``tidekv.compat.mooncake_store``'s,
``tidekv.compat.mooncake_types``'s or ``tidekv.compat.mooncake_buffer_pool``'s."""

from tidekv.compat.mooncake_buffer_pool import BufferLease, BufferPool, RegisteredBufferLease, RegisteredBufferPool
from tidekv.compat.mooncake_store import MooncakeDistributedStore
from tidekv.compat.mooncake_types import (
    BufferHandle,
    Descriptor,
    MemoryDescriptor,
    MooncakeHostMemAllocator,
    ParallelAxis,
    QueryTaskResponse,
    ReadTarget,
    ReplicaDescriptor,
    ReplicaStatus,
    ReplicateConfig,
    SoftPinAction,
    TaskStatus,
    TaskType,
    TensorParallelism,
    bind_to_numa_node,
)

__all__ = ["BufferHandle", "BufferLease", "BufferPool", "Descriptor", "MemoryDescriptor", "MooncakeDistributedStore",
           "MooncakeHostMemAllocator", "ParallelAxis", "QueryTaskResponse", "ReadTarget", "RegisteredBufferLease",
           "RegisteredBufferPool", "ReplicaDescriptor", "ReplicaStatus", "ReplicateConfig", "SoftPinAction",
           "TaskStatus", "TaskType", "TensorParallelism", "bind_to_numa_node"]
