"""``mooncake.buffer_pool`` served by tidekv: ``tidekv.compat.mooncake_buffer_pool``'s pool."""

from tidekv.compat.mooncake_buffer_pool import BufferPool, RegisteredBufferPool

__all__ = ["BufferPool", "RegisteredBufferPool"]
