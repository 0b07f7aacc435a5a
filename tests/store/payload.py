"""The bytes tests store: reproducible from (seed, size) in any process, compared by digest."""

from __future__ import annotations

import hashlib
import random


def payload(seed: int, size: int) -> bytes:
    """``size`` pseudo-random bytes determined by ``seed``."""
    return random.Random(seed).randbytes(size)


def digest(data: bytes | bytearray | memoryview) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def versioned(version: int, base_size: int) -> bytes:
    """Version ``version`` of an upserted value: one repeated byte, with a length that depends on it.

    A read that mixes two versions (a torn read) has two distinct bytes or the wrong length.
    """
    byte = version % 256
    return bytes([byte]) * (base_size + (byte % 7) * 4096)


def is_whole_version(data: bytes, base_size: int) -> bool:
    """Whether ``data`` is exactly some ``versioned(v, base_size)``."""
    return len(data) > 0 and data.count(data[0]) == len(data) and data == versioned(data[0], base_size)
