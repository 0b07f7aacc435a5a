"""``mooncake.store`` served by tidekv: every name is ``tidekv.compat.mooncake_store``'s."""

from tidekv.compat.mooncake_store import (
    BufferHandle,
    Descriptor,
    MemoryDescriptor,
    MooncakeDistributedStore,
    MooncakeHostMemAllocator,
    ReplicaDescriptor,
    ReplicaStatus,
    ReplicateConfig,
    SoftPinAction,
)

__all__ = ["BufferHandle", "Descriptor", "MemoryDescriptor", "MooncakeDistributedStore", "MooncakeHostMemAllocator",
           "ReplicaDescriptor", "ReplicaStatus", "ReplicateConfig", "SoftPinAction"]
