"""Keys and buffers as the store's API takes them: a str or bytes key as the bytes the master
stores, a key cut short for an error message, a buffer (Region, (address, length) or any object
exporting the buffer protocol) as (address, length). Neighbours: ``client`` (Store),
``master_client`` (lookups by key).
"""

from __future__ import annotations

from typing import Any, Union

from tidekv.errors import ConfigError
from tidekv.transfer.region import Region, buffer_address

Key = Union[str, bytes]
Buffer = Union[Region, tuple[int, int], Any]  # a Region, (address, length) or a buffer object


def key_bytes(key: Key) -> bytes:
    """Raises ConfigError for anything but str or bytes-like."""
    if isinstance(key, str):
        return key.encode()
    if isinstance(key, (bytes, bytearray, memoryview)):
        return bytes(key)
    raise ConfigError(f"key must be str or bytes, got {type(key).__name__}")


def show_key(key: Key) -> str:
    """A key for an error message: repr, cut to 64 characters."""
    text = repr(key)
    return text if len(text) <= 64 else text[:61] + "..."


def buffer_span(buf: Buffer) -> tuple[int, int]:
    if isinstance(buf, Region):
        return buf.address, buf.length
    if isinstance(buf, tuple) and len(buf) == 2 and all(isinstance(v, int) for v in buf):
        return buf
    address, length, _ = buffer_address(buf)
    return address, length
