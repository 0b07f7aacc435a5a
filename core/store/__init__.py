"""The tidekv store: a master (metadata, placement, leases, eviction) and clients that pool memory."""

from tidekv.store.client import Store
from tidekv.store.master_client import MasterClient
from tidekv.store.protocol import Pin, Status
from tidekv.store.server import MasterServer

__all__ = ["MasterClient", "MasterServer", "Pin", "Status", "Store"]
