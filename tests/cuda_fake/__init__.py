"""A fake CUDA driver for running the cuda transport's real code on hosts without a GPU.

``build(directory)`` compiles ``fake_libcuda.cpp`` into ``libcuda.so.1``; a process that sets
``TIDEKV_LIBCUDA`` to it before its first engine starts gets a cuda transport whose "GPU memory"
is host memory the host cannot touch directly (see the C++ file). Tests allocate and fill it
with ``tidekv.bench.gpumem.DeviceMemory``, which calls whichever driver the process loads.
Neighbours: ``scenarios`` (the checks, run in their own processes), ``tests/transfer/test_cuda_fake.py``.
"""

from __future__ import annotations

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
