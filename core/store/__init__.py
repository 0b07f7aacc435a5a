"""The tidekv store: a master (metadata, placement, leases, eviction) and clients that pool memory.

The package is split by side, and importing one side loads nothing of the other:

- ``wire``: what both sides agree on - the messages (``protocol``), keys and buffers, tenant
  names, mount proofs.
- ``client``: a process that pools memory and moves bytes - ``Store``, ``MasterClient`` and what
  they are built from.
- ``master``: the master process - the index (objects, segments, tenants, eviction, repairs), its
  journal, and the server that puts it on the network.
- ``ha``: masters in a cluster - etcd, the leader election, journal replication to standbys.
- ``allocator`` (byte ranges of one segment: the master's placement and a client's staging
  memory) and ``cli`` (``tidekv master``, ``tidekv up``) serve both.

``from tidekv.store import Store`` and the other names below load their side on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tidekv.store.client.master_client import MasterClient
    from tidekv.store.client.store import Store
    from tidekv.store.master.server import MasterServer
    from tidekv.store.wire.protocol import Pin, Status

_EXPORTS = {
    "MasterClient": "tidekv.store.client.master_client",
    "MasterServer": "tidekv.store.master.server",
    "Pin": "tidekv.store.wire.protocol",
    "Status": "tidekv.store.wire.protocol",
    "Store": "tidekv.store.client.store",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tidekv.store' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
