"""Store keys for KV blocks: a chained hash of the token prefix, namespaced by everything that
makes KV bytes incompatible (model, dtype, layout, block size, tensor-parallel rank).

Block i's key commits to all tokens of blocks 0..i, so equal keys mean equal prefixes, and two
engines that differ in anything that changes the KV bytes can never share a key. A key names one
store object: the whole block of one rank (``KEY_SCHEME``).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence


KEY_SCHEME = 2
"""What a block key names. 2: one object per block and rank, its layers' runs concatenated in
``layout.block_spans`` order. (1, keys ``kv/...``: one object per run of a block, ``/<run>``
after the block key.) The scheme is part of every key, so a pool written under another one is
never read as this one's."""


def namespace(model: str, dtype: str, layout_fingerprint: str, block_size: int, tp_rank: int, tp_size: int) -> str:
    text = f"{model}|{dtype}|{layout_fingerprint}|bs{block_size}|tp{tp_rank}/{tp_size}"
    return f"kv{KEY_SCHEME}/" + hashlib.sha256(text.encode()).hexdigest()[:16]


def block_keys(ns: str, token_ids: Sequence[int], block_size: int) -> list[str]:
    """Keys of every *full* block of ``token_ids`` (a partial last block has none)."""
    keys = []
    h = hashlib.sha256(ns.encode()).digest()
    full = len(token_ids) // block_size
    for b in range(full):
        block = token_ids[b * block_size : (b + 1) * block_size]
        h = hashlib.sha256(h + struct.pack(f"<{block_size}q", *block)).digest()
        keys.append(f"{ns}/{h[:16].hex()}")
    return keys
