"""``tidekv bench gpu`` end to end on the fake CUDA driver (its numbers say nothing about a GPU:
the fake copies with memcpy; what this checks is that every row runs and is reported), and its
refusal without a driver."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import cuda_fake

ROOT = Path(__file__).resolve().parents[2]
ROWS = ["ipc 64x1MiB", "ipc 2000x16KiB", "staged tcp 64x1MiB", "vllm hand-off, cuda", "vllm hand-off, staged tcp"]


def test_every_row_runs_on_the_fake_driver(tmp_path: Path) -> None:
    try:
        libcuda = cuda_fake.build(tmp_path)
    except RuntimeError as exc:
        pytest.skip(f"needs a C++ compiler to build the fake CUDA driver: {exc}")
    out = tmp_path / "rows.json"
    env = dict(os.environ, TIDEKV_LIBCUDA=str(libcuda))
    done = subprocess.run([sys.executable, "-m", "tidekv", "bench", "gpu", "--reps", "1", "--json", str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode in (0, 1), done.stderr  # 1: a bar missed, which memcpy "GPUs" may well do
    rows = json.loads(out.read_text())
    assert [r["name"] for r in rows] == ROWS
    handoff = rows[3]
    assert handoff["requests"] == 8000 and handoff["bytes"] == 8000 * 32 * 1024
    for r in rows:
        assert r["tidekv_s"] > 0 and r["gbps"] > 0, r
        assert (r["ratio"] is None) == (r["bar"] is None), r
        if r["bar"] is not None:
            assert r["passed"] == (r["ratio"] >= r["bar"]), r
    assert "Fake GPU 0" in done.stdout and "vllm hand-off, staged tcp" in done.stdout


def test_without_a_gpu_it_says_so(tmp_path: Path) -> None:
    env = dict(os.environ, TIDEKV_LIBCUDA=str(tmp_path / "absent.so"))
    done = subprocess.run([sys.executable, "-m", "tidekv", "bench", "gpu"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode != 0
    assert "needs a CUDA GPU" in done.stderr and "does not load" in done.stderr, done.stderr
