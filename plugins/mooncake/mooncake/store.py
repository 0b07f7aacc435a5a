"""``mooncake.store`` served by tidekv: every name is ``tidekv.compat.mooncake_store``'s or
``tidekv.compat.mooncake_types``'s."""

from tidekv.compat.mooncake_store import MooncakeDistributedStore
from tidekv.compat.mooncake_types import (
    BufferHandle,
    Descriptor,
    MemoryDescriptor,
    MooncakeHostMemAllocator,
    ReplicaDescriptor,
    ReplicaStatus,
    ReplicateConfig,
    SoftPinAction,
)

__all__ = ["BufferHandle", "Descriptor", "MemoryDescriptor", "MooncakeDistributedStore", "MooncakeHostMemAllocator",
           "ReplicaDescriptor", "ReplicaStatus", "ReplicateConfig", "SoftPinAction"]
