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

__all__ = [
    "ConfigError",
    "PeerUnavailableError",
    "ProtocolVersionError",
    "Region",
    "RequestStatus",
    "SegmentNotRegisteredError",
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
