"""GPU memory through the CUDA driver API (ctypes on libcuda.so.1, or on ``$TIDEKV_LIBCUDA``).

What the GPU benchmark and the cuda tests allocate, fill and read GPU memory with, without torch:
cudaMalloc-like memory (exported by IPC handles), virtual-memory-managed memory (exported by
POSIX fds, as PyTorch's expandable segments), synchronous copies in and out, and device-to-device
copies for baselines. It loads the same library the transfer engine does, so on the fake driver
(``tests/cuda_fake``) it allocates the fake's memory. Neighbours: ``tidekv.bench.gpu``.
"""

from __future__ import annotations

import ctypes
import os

VMM_GRANULARITY = 2 << 20
"""Physical allocations of VMM memory are made in multiples of this (the driver's minimum on
current GPUs); the mapping is as large, the caller uses the first ``size`` bytes."""


class _Prop(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [("type", ctypes.c_int), ("handle_types", ctypes.c_int), ("location_type", ctypes.c_int),
                ("location_id", ctypes.c_int), ("win32", ctypes.c_void_p), ("flags", ctypes.c_ubyte * 8)]


class _AccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location_type", ctypes.c_int), ("location_id", ctypes.c_int), ("flags", ctypes.c_int)]


class DeviceMemory:
    """GPU memory of this process through the driver the transfer engine loads."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL(os.environ.get("TIDEKV_LIBCUDA") or "libcuda.so.1")
        self._check(self.lib.cuInit(0), "cuInit")
        count = ctypes.c_int(0)
        self._check(self.lib.cuDeviceGetCount(ctypes.byref(count)), "cuDeviceGetCount")
        self.devices = count.value
        """How many GPUs this process sees."""
        self._keep: list[int] = []
        self.set_device(0)

    @staticmethod
    def _check(rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what} failed with CUresult {rc}")

    def set_device(self, device: int) -> None:
        """Makes ``device`` current on this thread (what ``torch.cuda.set_device`` does)."""
        ctx = ctypes.c_void_p()
        self._check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device), "cuDevicePrimaryCtxRetain")
        self._check(self.lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")

    def alloc(self, size: int, device: int = 0) -> int:
        """cudaMalloc-like memory on ``device``: exported to peers by a CUDA IPC handle."""
        self.set_device(device)
        ptr = ctypes.c_uint64()
        self._check(self.lib.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(size)), "cuMemAlloc")
        return ptr.value

    def vmm_alloc(self, size: int, device: int = 0, *, exportable: bool = True) -> int:
        """Virtual-memory-managed memory (PyTorch's expandable segments): cuMemCreate + map.

        ``exportable``: created with the POSIX-fd handle type, which peers need.
        """
        size = -(-size // VMM_GRANULARITY) * VMM_GRANULARITY
        prop = _Prop(1, 1 if exportable else 0, 1, device, None)
        handle, va = ctypes.c_uint64(), ctypes.c_uint64()
        self._check(self.lib.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(size), ctypes.byref(prop),
                                         ctypes.c_ulonglong(0)), "cuMemCreate")
        self._check(self.lib.cuMemAddressReserve(ctypes.byref(va), ctypes.c_size_t(size), ctypes.c_size_t(0),
                                                 ctypes.c_uint64(0), ctypes.c_ulonglong(0)), "cuMemAddressReserve")
        self._check(self.lib.cuMemMap(ctypes.c_uint64(va.value), ctypes.c_size_t(size), ctypes.c_size_t(0), handle,
                                      ctypes.c_ulonglong(0)), "cuMemMap")
        access = _AccessDesc(1, device, 3)  # this device, read-write
        self._check(self.lib.cuMemSetAccess(ctypes.c_uint64(va.value), ctypes.c_size_t(size), ctypes.byref(access),
                                            ctypes.c_size_t(1)), "cuMemSetAccess")
        self._check(self.lib.cuMemRelease(handle), "cuMemRelease")  # the mapping keeps it
        return va.value

    def copy(self, dst: int, src: int, size: int) -> None:
        """Device -> device (or any UVA pair), synchronously: the baseline copy."""
        self._check(self.lib.cuMemcpy(ctypes.c_uint64(dst), ctypes.c_uint64(src), ctypes.c_size_t(size)), "cuMemcpy")

    def write(self, ptr: int, data: bytes) -> None:
        """Host -> device, synchronously."""
        self._check(self.lib.cuMemcpyHtoD_v2(ctypes.c_uint64(ptr), data, ctypes.c_size_t(len(data))), "cuMemcpyHtoD")

    def read(self, ptr: int, size: int) -> bytes:
        """Device -> host, synchronously."""
        out = ctypes.create_string_buffer(size)
        self._check(self.lib.cuMemcpyDtoH_v2(out, ctypes.c_uint64(ptr), ctypes.c_size_t(size)), "cuMemcpyDtoH")
        return out.raw
