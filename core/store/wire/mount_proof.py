"""Mount proofs: the memory a segment names must be the mounting process's own.

A mount names a transfer engine and a range of its memory, and other clients' puts then write
into that range. Without a proof, a client holding the secret could mount a range of *another*
engine's memory that nobody has mounted yet (a vLLM worker's KV cache, say) and have innocent
clients' puts overwrite it. So the mounting client has its own engine make a region proof for
the segment (``prove``: ``TransferEngine.region_proof``, an HMAC under a key that never leaves
the engine's process), bound by ``context`` to the client and the segment it mounts as; the
master asks that engine whether it vouches for the proof before it accepts the mount
(``tidekv.store.master.mount_check``). Neighbours: ``client.membership`` (proves),
``native/common/region_proof.h`` (the proof and the engine's answer).
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import msgspec
from tidekv.store.wire import names

if TYPE_CHECKING:
    from tidekv.transfer import Region, TransferEngine


def context(client_id: str, segment: str) -> bytes:
    """What a mount's proof is bound to: the client and the segment as the master names them
    (inside the tenant's namespace), so a proof cannot be replayed for another mount."""
    return hashlib.sha256(msgspec.msgpack.encode(["tidekv-mount/1", client_id, segment])).digest()


def prove(engine: TransferEngine, region: Region, tenant: str, client_id: str, segment: str) -> bytes:
    """The proof a client of ``tenant`` sends with its mount of ``region`` as ``segment``."""
    pre = names.prefix(tenant)
    return engine.region_proof(region, context(pre + client_id, pre + segment))
