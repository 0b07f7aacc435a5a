"""``mooncake.async_store`` served by tidekv: ``tidekv.compat.mooncake_async.MooncakeDistributedStoreAsync``."""

from tidekv.compat.mooncake_async import MooncakeDistributedStoreAsync

__all__ = ["MooncakeDistributedStoreAsync"]
