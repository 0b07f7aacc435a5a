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
        location: where the memory is: "cpu" or "cuda:N".
        is_shared: True for engine-allocated memory (``TransferEngine.allocate``).
    """

    address: int
    length: int
    location: str = "cpu"
    is_shared: bool = False
    _owner: Any = field(default=None, repr=False, compare=False)

    def view(self) -> memoryview:
        """A writable memoryview over the region's bytes (valid while it stays registered).

        Raises:
            ConfigError: the region is GPU memory, which the host cannot read directly.
        """
        if self.location != "cpu":
            raise ConfigError(f"region at {self.address:#x} is {self.location} memory; view() reads host memory only")
        buf = (ctypes.c_char * self.length).from_address(self.address)
        return memoryview(buf).cast("B")

    def addr(self, offset: int = 0) -> int:
        """Address of byte ``offset`` of the region, bounds-checked."""
        if not 0 <= offset <= self.length:
            raise ConfigError(f"offset {offset} is outside region of {self.length} bytes")
        return self.address + offset


def memory_of(obj: Any, location: str | None = None) -> tuple[int, int, Any, str]:
    """Returns (address, length, keep-alive, location) of anything ``TransferEngine.register`` takes.

    Accepted: ``(address, length)`` (location as given, default "cpu"); a torch tensor on the
    CPU or a GPU; an object with ``__cuda_array_interface__`` or a DLPack CUDA capsule; a writable
    buffer-protocol object (host memory).

    Raises:
        ConfigError: the object is read-only, not contiguous, exposes no memory, or lives
            elsewhere than ``location`` says.
    """
    if isinstance(obj, tuple) and len(obj) == 2 and all(isinstance(v, int) for v in obj):
        address, length = obj
        if address <= 0 or length <= 0:
            raise ConfigError(f"(address, length)=({address:#x}, {length}) must both be > 0")
        return address, length, None, location or "cpu"
    if hasattr(obj, "data_ptr") and hasattr(obj, "element_size"):  # torch.Tensor, without importing torch
        device = getattr(obj, "device", None)
        kind = getattr(device, "type", "cpu")
        if kind not in ("cpu", "cuda"):
            raise ConfigError(f"tensor on {device} cannot be registered: tidekv moves cpu and cuda memory")
        found = "cpu" if kind == "cpu" else f"cuda:{device.index or 0}"
        if not obj.is_contiguous():
            raise ConfigError("tensor must be contiguous to be registered")
        return int(obj.data_ptr()), int(obj.numel() * obj.element_size()), obj, _same(found, location, obj)
    if hasattr(obj, "__cuda_array_interface__"):
        address, length = _cuda_array_interface(obj.__cuda_array_interface__, type(obj).__name__)
        return address, length, obj, _same(_gpu_of(address, type(obj).__name__), location, obj)
    if hasattr(obj, "__dlpack_device__") and obj.__dlpack_device__()[0] == _DL_CUDA:
        address, length, capsule = _dlpack_cuda(obj)
        return address, length, (obj, capsule), _same(_gpu_of(address, type(obj).__name__), location, obj)
    address, length, owner = buffer_address(obj)
    return address, length, owner, _same("cpu", location, obj)


def location_of_address(address: int) -> str:
    """"cuda:N" when the CUDA driver knows ``address`` as GPU memory of device N, else "cpu"."""
    from tidekv import _native

    device = _native.cuda_device_of(address)
    return f"cuda:{device}" if device >= 0 else "cpu"


def _same(found: str, asked: str | None, obj: Any) -> str:
    if asked is not None and asked != found and not (asked == "cuda" and found == "cuda:0"):
        raise ConfigError(f"{type(obj).__name__} is in {found} memory, but location={asked!r} was given")
    return found


def _gpu_of(address: int, what: str) -> str:
    from tidekv import _native

    device = _native.cuda_device_of(address)
    if device < 0:
        available, reason = _native.cuda_driver()
        why = "the CUDA driver does not know it as GPU memory" if available else reason
        raise ConfigError(f"{what} at {address:#x} says it is CUDA memory, but {why}")
    return f"cuda:{device}"


def _cuda_array_interface(cai: dict[str, Any], what: str) -> tuple[int, int]:
    address, readonly = cai["data"]
    if readonly:
        raise ConfigError(f"cannot register a read-only {what}; peers could not write into it")
    shape = tuple(int(n) for n in cai["shape"])
    itemsize = int(cai["typestr"][2:])
    count = 1
    for n in shape:
        count *= n
    contiguous = [itemsize] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        contiguous[i] = contiguous[i + 1] * shape[i + 1]
    strides = cai.get("strides")
    if strides is not None and count > 1 and any(s != c for s, c, n in zip(strides, contiguous, shape) if n > 1):
        raise ConfigError(f"cannot register a non-contiguous {what}")
    if count == 0 or not address:
        raise ConfigError(f"cannot register an empty {what}")
    return int(address), count * itemsize


_DL_CUDA = 2  # DLDeviceType kDLCUDA


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device_type", ctypes.c_int32),
        ("device_id", ctypes.c_int32),
        ("ndim", ctypes.c_int32),
        ("dtype_code", ctypes.c_uint8),
        ("dtype_bits", ctypes.c_uint8),
        ("dtype_lanes", ctypes.c_uint16),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


def _dlpack_cuda(obj: Any) -> tuple[int, int, Any]:
    """(address, length, capsule) of a DLPack CUDA tensor (the capsule is kept, not consumed)."""
    capsule = obj.__dlpack__()
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    tensor = _DLTensor.from_address(get(capsule, b"dltensor"))
    ndim = tensor.ndim
    shape = [tensor.shape[i] for i in range(ndim)]
    itemsize = tensor.dtype_bits * tensor.dtype_lanes // 8
    strides = [tensor.strides[i] * itemsize for i in range(ndim)] if tensor.strides else None
    cai = {"data": ((tensor.data or 0) + tensor.byte_offset, False), "shape": shape, "typestr": f"|V{itemsize}",
           "strides": strides}
    address, length = _cuda_array_interface(cai, type(obj).__name__)
    return address, length, capsule


def buffer_address(obj: Any) -> tuple[int, int, Any]:
    """Returns (address, length, keep-alive) of a writable buffer-protocol object or a torch tensor.

    Raises:
        ConfigError: the object is read-only, not contiguous, or exposes no memory.
    """
    if hasattr(obj, "data_ptr") and hasattr(obj, "element_size"):  # torch.Tensor, without importing torch
        if getattr(obj, "device", None) is not None and str(obj.device) != "cpu":
            raise ConfigError(f"tensor on {obj.device} is not host memory")
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
