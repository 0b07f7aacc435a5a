"""The cuda transport on this host's real GPUs: the fake-driver scenarios again, and torch's own
memory (cudaMalloc'd and expandable segments). Skipped, naming what is missing, without a GPU.
``integration/gpu_check.sh`` runs the same scenarios (and the GPU benchmark) without pytest.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _gpu_missing() -> str | None:
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        return f"needs a CUDA GPU: libcuda.so.1 does not load ({exc})"
    count = ctypes.c_int(0)
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value == 0:
        return "needs a CUDA GPU: the driver loads but sees none"
    return None


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_gpu_missing() is not None, reason=_gpu_missing() or "")]


def run(scenario: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TIDEKV_LIBCUDA"}
    return subprocess.run([sys.executable, "-m", "tests.cuda_fake.scenarios", scenario], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("scenario", ["registration", "in_process", "forced", "two_process", "scattered_blocks",
                                      "staged", "peer_exit", "torch_tensors"])
def test_scenario_on_the_gpu(scenario: str) -> None:
    if scenario == "torch_tensors":
        torch = pytest.importorskip("torch", reason="needs torch with CUDA")
        if not torch.cuda.is_available():
            pytest.skip("needs torch built with CUDA")
    done = run(scenario)
    assert done.returncode == 0, f"scenario {scenario} failed:\n{done.stderr[-6000:]}"
