"""The cuda transport's real code on a fake CUDA driver (``tests/cuda_fake``), on any host.

The fake's "GPU memory" faults when the host touches it directly and its async copies land only
when the stream is synchronised, so these catch a host access to device memory and a copy
reported done too early, as a GPU would. Each scenario runs in a process of its own: the
driver is chosen once per process (``TIDEKV_LIBCUDA``). What the fake cannot show — real DMA,
IPC across real devices, speed — is ``integration/gpu_check.sh``'s.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import cuda_fake

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def fake_libcuda(tmp_path_factory: pytest.TempPathFactory) -> Path:
    try:
        return cuda_fake.build(tmp_path_factory.mktemp("fake-cuda"))
    except RuntimeError as exc:
        pytest.skip(f"needs a C++ compiler to build the fake CUDA driver: {exc}")


def run(scenario: str, libcuda: Path, *args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, TIDEKV_LIBCUDA=str(libcuda))
    return subprocess.run([sys.executable, *args, "-m", "tests.cuda_fake.scenarios", scenario], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout_s)


@pytest.mark.parametrize("scenario", ["registration", "in_process", "forced", "two_process", "scattered_blocks",
                                      "staged", "peer_exit"])
def test_scenario(scenario: str, fake_libcuda: Path) -> None:
    done = run(scenario, fake_libcuda)
    assert done.returncode == 0, f"scenario {scenario} failed:\n{done.stderr[-6000:]}"


def test_doctor_lists_the_gpus(fake_libcuda: Path) -> None:
    env = dict(os.environ, TIDEKV_LIBCUDA=str(fake_libcuda))
    done = subprocess.run([sys.executable, "-m", "tidekv", "doctor"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    out = " ".join(done.stdout.split())
    assert "cuda available" in out and "2 GPU(s): cuda:0 Fake GPU 0, cuda:1 Fake GPU 1" in out, done.stdout
    assert "integration/gpu_check.sh" in out, done.stdout  # its self-test is skipped, saying where to look


def test_without_a_driver_gpu_memory_is_refused_naming_why(tmp_path: Path) -> None:
    missing = tmp_path / "libcuda.so.1"  # does not exist
    code = ("from tidekv import TransferEngine, ConfigError\n"
            "e = TransferEngine()\n"
            "try:\n"
            "    e.register((0x10000, 4096), location='cuda:0')\n"
            "except ConfigError as exc:\n"
            "    print(exc)\n"
            "e.close()\n")
    env = dict(os.environ, TIDEKV_LIBCUDA=str(missing))
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "cannot be registered" in done.stdout and "cuda is unavailable" in done.stdout, done.stdout
    assert str(missing) in done.stdout and "does not load" in done.stdout, done.stdout
