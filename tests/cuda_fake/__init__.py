"""A fake CUDA driver for running the cuda transport's real code on hosts without a GPU.

``build(directory)`` compiles ``fake_libcuda.cpp`` into ``libcuda.so.1``; a process that sets
``TIDEKV_LIBCUDA`` to it before its first engine starts gets a cuda transport whose "GPU memory"
is host memory the host cannot touch directly (see the C++ file). ``FakeCuda`` is what a test
uses in place of torch.cuda: allocations (cudaMalloc-like and VMM), and copies in and out.
Neighbours: ``scenarios`` (the checks, run in their own processes), ``tests/transfer/test_cuda_fake.py``.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

SOURCE = Path(__file__).with_name("fake_libcuda.cpp")


def build(directory: Path) -> Path:
    """Compiles the fake driver into ``directory/libcuda.so.1``; returns its path.

    Raises:
        RuntimeError: no C++ compiler, or the build failed (with the compiler's output).
    """
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (c++ or g++) to build the fake CUDA driver")
    out = directory / "libcuda.so.1"
    done = subprocess.run([compiler, "-std=c++17", "-O1", "-shared", "-fPIC", "-o", str(out), str(SOURCE)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"building the fake CUDA driver failed:\n{done.stderr}")
    return out


class _Prop(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("handle_types", ctypes.c_int), ("location_type", ctypes.c_int),
                ("location_id", ctypes.c_int), ("win32", ctypes.c_void_p), ("flags", ctypes.c_ubyte * 8)]


class FakeCuda:
    """The fake driver of this process (``TIDEKV_LIBCUDA`` must name it)."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL(os.environ["TIDEKV_LIBCUDA"])
        self._check(self.lib.cuInit(0), "cuInit")
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
        prop = _Prop(1, 1 if exportable else 0, 1, device, None)
        handle, va = ctypes.c_uint64(), ctypes.c_uint64()
        self._check(self.lib.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(size), ctypes.byref(prop),
                                         ctypes.c_ulonglong(0)), "cuMemCreate")
        self._check(self.lib.cuMemAddressReserve(ctypes.byref(va), ctypes.c_size_t(size), ctypes.c_size_t(0),
                                                 ctypes.c_uint64(0), ctypes.c_ulonglong(0)), "cuMemAddressReserve")
        self._check(self.lib.cuMemMap(ctypes.c_uint64(va.value), ctypes.c_size_t(size), ctypes.c_size_t(0), handle,
                                      ctypes.c_ulonglong(0)), "cuMemMap")
        self._check(self.lib.cuMemRelease(handle), "cuMemRelease")  # the mapping keeps it
        return va.value

    def write(self, ptr: int, data: bytes) -> None:
        """Host -> device, synchronously."""
        self._check(self.lib.cuMemcpyHtoD_v2(ctypes.c_uint64(ptr), data, ctypes.c_size_t(len(data))), "cuMemcpyHtoD")

    def read(self, ptr: int, size: int) -> bytes:
        """Device -> host, synchronously."""
        out = ctypes.create_string_buffer(size)
        self._check(self.lib.cuMemcpyDtoH_v2(out, ctypes.c_uint64(ptr), ctypes.c_size_t(size)), "cuMemcpyDtoH")
        return out.raw
