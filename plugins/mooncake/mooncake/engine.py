"""``mooncake.engine`` served by tidekv: ``TransferEngine`` is ``tidekv.compat.mooncake.TransferEngine``."""

from tidekv.compat.mooncake import TransferEngine, TransferOpcode

SUPPORT_CUDA = False
"""tidekv moves host memory in this build (Mooncake's build flags, read by some callers)."""

__all__ = ["SUPPORT_CUDA", "TransferEngine", "TransferOpcode"]
