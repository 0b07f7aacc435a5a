"""tidekv: the data layer for disaggregated LLM serving (transfer engine, KV store, plugins)."""

from tidekv import errors  # noqa: F401  (the native module maps its errors onto these classes)
from tidekv.config import TransferConfig, TransportKind
from tidekv.errors import (
    ConfigError,
    PeerUnavailableError,
    ProtocolVersionError,
    SegmentNotRegisteredError,
    TidekvError,
    TransferError,
    TransferTimeoutError,
)
from tidekv.transfer import (
    Region,
    RequestStatus,
    TransferEngine,
    TransferHandle,
    TransferOp,
    TransferRequest,
    TransferState,
)

__version__ = "0.1.0"

_LAZY = {"Store": "tidekv.store", "Pin": "tidekv.store", "StoreConfig": "tidekv.config"}
"""Top-level names imported on first use (``tidekv.Store``), so the transfer engine alone stays light."""


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tidekv' has no attribute {name!r}")


__all__ = [
    "ConfigError",
    "PeerUnavailableError",
    "Pin",
    "ProtocolVersionError",
    "Region",
    "RequestStatus",
    "SegmentNotRegisteredError",
    "Store",
    "StoreConfig",
    "TidekvError",
    "TransferConfig",
    "TransferEngine",
    "TransferError",
    "TransferHandle",
    "TransferOp",
    "TransferRequest",
    "TransferState",
    "TransferTimeoutError",
    "TransportKind",
]
