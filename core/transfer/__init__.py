"""The transfer engine: registered regions, one-sided batch READ/WRITE, tcp and same-host shm."""

from tidekv.transfer.batch import RequestStatus, TransferHandle, TransferOp, TransferRequest, TransferState
from tidekv.transfer.directory import DirectDirectory, PeerDirectory
from tidekv.transfer.engine import TransferEngine
from tidekv.transfer.memory import huge_pages_shareable
from tidekv.transfer.region import Region

__all__ = [
    "DirectDirectory",
    "PeerDirectory",
    "Region",
    "RequestStatus",
    "TransferEngine",
    "TransferHandle",
    "TransferOp",
    "TransferRequest",
    "TransferState",
    "huge_pages_shareable",
]
