"""The Mooncake drop-in as its own distribution: ``pip install ./plugins/mooncake`` builds a
wheel whose ``mooncake`` package routes to ``tidekv.compat``.

This venv also holds the real Mooncake wheel (the benchmarks' comparison peer), and both own
the top-level ``mooncake`` package, so the shim is installed into a folder of its own
(``pip install --target``) and probed in child processes that put that folder first on
``PYTHONPATH``: there ``import mooncake`` is the shim, here it stays Mooncake.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SHIM = REPO / "plugins" / "mooncake"


@pytest.fixture(scope="module")
def shim_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shim's wheel, built and installed into a folder of its own."""
    root = tmp_path_factory.mktemp("shim")
    wheels, site = root / "wheels", root / "site"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels),
                    str(SHIM)], check=True, timeout=300)
    (wheel,) = wheels.glob("tidekv_mooncake_shim-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {"mooncake/__init__.py", "mooncake/engine.py"} <= set(names), names
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, timeout=300)
    return site


def run_with_shim(site: Path, code: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    """Runs ``code`` in a child whose ``import mooncake`` finds the installed shim first."""
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout_s,
                          cwd=REPO)


def test_the_installed_engine_routes_to_tidekv(shim_site: Path) -> None:
    probe = ("import mooncake, mooncake.engine as e, tidekv.compat.mooncake as c; "
             "assert mooncake.IS_TIDEKV_SHIM and e.TransferEngine is c.TransferEngine; "
             "te = e.TransferEngine(); assert te.initialize('127.0.0.1', 'P2PHANDSHAKE', 'tcp', '') == 0; "
             "print(te.get_rpc_port())")
    out = run_with_shim(shim_site, probe)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.strip()) > 0
