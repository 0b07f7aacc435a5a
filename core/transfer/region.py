"""Registered memory: the Region a peer may read or write, and how a Python object becomes one.

Neighbours: ``engine.TransferEngine.register/allocate`` create Regions; requests point into them.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Any

from tidekv.errors import ConfigError


@dataclass(frozen=True, slots=True)
class Region:
    """A contiguous range of registered memory.

    Attributes:
        address: first byte (a virtual address in the owning process).
        length: size in bytes.
        location: device tag: "cpu" (later "cuda:N").
        is_shared: True for engine-allocated memory (``TransferEngine.allocate``).
    """

    address: int
    length: int
    location: str = "cpu"
    is_shared: bool = False
    _owner: Any = field(default=None, repr=False, compare=False)

    def view(self) -> memoryview:
        """A writable memoryview over the region's bytes (valid while it stays registered)."""
        buf = (ctypes.c_char * self.length).from_address(self.address)
        return memoryview(buf).cast("B")

    def addr(self, offset: int = 0) -> int:
        """Address of byte ``offset`` of the region, bounds-checked."""
        if not 0 <= offset <= self.length:
            raise ConfigError(f"offset {offset} is outside region of {self.length} bytes")
        return self.address + offset


def buffer_address(obj: Any) -> tuple[int, int, Any]:
    """Returns (address, length, keep-alive) of a writable buffer-protocol object or a torch tensor.

    Raises:
        ConfigError: the object is read-only, not contiguous, or exposes no memory.
    """
    if hasattr(obj, "data_ptr") and hasattr(obj, "element_size"):  # torch.Tensor, without importing torch
        if getattr(obj, "device", None) is not None and str(obj.device) != "cpu":
            raise ConfigError(f"tensor on {obj.device} cannot be registered by this build (cpu only)")
        if not obj.is_contiguous():
            raise ConfigError("tensor must be contiguous to be registered")
        return int(obj.data_ptr()), int(obj.numel() * obj.element_size()), obj
    try:
        mv = memoryview(obj)
    except TypeError:
        raise ConfigError(
            f"cannot register {type(obj).__name__}: pass a writable buffer (bytearray, numpy array, mmap, "
            "torch CPU tensor) or an (address, length) pair"
        ) from None
    if mv.readonly:
        raise ConfigError(f"cannot register a read-only {type(obj).__name__}; peers could not write into it")
    if not mv.c_contiguous:
        raise ConfigError(f"cannot register a non-contiguous {type(obj).__name__}")
    if mv.nbytes == 0:
        raise ConfigError("cannot register an empty buffer")
    flat = mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv
    address = ctypes.addressof(ctypes.c_char.from_buffer(flat))
    return address, mv.nbytes, (obj, mv, flat)
