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

from tidekv.bench.ports import free_port

REPO = Path(__file__).resolve().parents[2]
SHIM = REPO / "plugins" / "mooncake"
MODULES = ("__init__", "engine", "store", "master", "mooncake_config", "async_store", "buffer_pool",
           "http_metadata_server", "cli_client", "structured_object_store", "dataproto_catalog")


@pytest.fixture(scope="module")
def shim_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shim's wheel, built and installed into a folder of its own."""
    root = tmp_path_factory.mktemp("shim")
    wheels, site = root / "wheels", root / "site"
    build = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels), str(SHIM)]
    # With the venv's own setuptools first (no index needed); a fresh venv's (Python 3.11 ships
    # setuptools 65 without `wheel`) cannot build wheels, so then in an isolated build env.
    if subprocess.run([*build, "--no-build-isolation"], timeout=300, check=False, capture_output=True).returncode:
        subprocess.run(build, check=True, timeout=300)
    (wheel,) = wheels.glob("tidekv_mooncake_shim-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {f"mooncake/{m}.py" for m in MODULES} <= set(names), names
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, timeout=300)
    return site


def shim_env(site: Path) -> dict[str, str]:
    """The environment of a child whose ``import mooncake`` finds the installed shim first."""
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path}


def run_with_shim(site: Path, code: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], env=shim_env(site), capture_output=True, text=True,
                          timeout=timeout_s, cwd=REPO, check=False)


def test_the_installed_engine_routes_to_tidekv(shim_site: Path) -> None:
    probe = ("import mooncake, mooncake.engine as e, tidekv.compat.mooncake as c; "
             "assert mooncake.IS_TIDEKV_SHIM and e.TransferEngine is c.TransferEngine; "
             "te = e.TransferEngine(); assert te.initialize('127.0.0.1', 'P2PHANDSHAKE', 'tcp', '') == 0; "
             "print(te.get_rpc_port())")
    out = run_with_shim(shim_site, probe)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.strip()) > 0


def test_the_installed_store_and_master_script_work_together(shim_site: Path, tmp_path: Path) -> None:
    """``mooncake_master`` (the console script the wheel installs) serves ``mooncake.store``."""
    script = shim_site / "bin" / "mooncake_master"
    assert script.exists(), sorted(p.name for p in (shim_site / "bin").iterdir())
    port, metrics = free_port(), free_port()
    log = (tmp_path / "master.log").open("w")
    master = subprocess.Popen([str(script), f"--rpc_port={port}", "--metrics_port", str(metrics),
                               "--default_kv_lease_ttl=2s", "--eviction_high_watermark_ratio=0.9"],
                              env=shim_env(shim_site), stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        probe = f"""
import time
import mooncake.store as s, tidekv.compat.mooncake_store as c, tidekv.compat.mooncake_types as v
assert s.MooncakeDistributedStore is c.MooncakeDistributedStore and s.ReplicateConfig is v.ReplicateConfig
assert s.MooncakeHostMemAllocator is v.MooncakeHostMemAllocator
store = s.MooncakeDistributedStore()
deadline = time.monotonic() + 30
while store.setup("127.0.0.1", "P2PHANDSHAKE", 4 << 20, 1 << 20, "tcp", "", "127.0.0.1:{port}", None) != 0:
    assert time.monotonic() < deadline, "mooncake_master did not come up"
    time.sleep(0.2)
assert store.put("k", b"over the shim") == 0 and store.get("k") == b"over the shim"
assert store.is_exist("k") == 1 and store.remove("k") == -706  # is_exist leased it for 2 s
print("ok", store.close())
"""
        out = run_with_shim(shim_site, probe)
        assert out.returncode == 0 and out.stdout.split() == ["ok", "0"], out.stderr + out.stdout
    finally:
        master.terminate()
        master.wait(timeout=10)
        log.close()
    text = (tmp_path / "master.log").read_text()
    assert f"127.0.0.1:{port}" in text and "lease 2 s" in text, text


def test_the_installed_master_script_refuses_unknown_flags(shim_site: Path) -> None:
    out = subprocess.run([str(shim_site / "bin" / "mooncake_master"), "--enable_http_metadata_server=true"],
                         env=shim_env(shim_site), capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 2 and "--enable_http_metadata_server" in out.stderr, out.stderr


def test_the_installed_helper_modules_and_commands_are_tidekvs(shim_site: Path) -> None:
    """``mooncake.mooncake_config``, ``async_store``, ``buffer_pool``, ``http_metadata_server``, the
    package's ``BufferPool``, the modules not served and the two other commands, as installed."""
    probe = """
import mooncake, mooncake.mooncake_config as mc, mooncake.async_store as a, mooncake.buffer_pool as bp
import mooncake.http_metadata_server as h, mooncake.cli_client as cc, mooncake.store as s
from tidekv.compat import (mooncake_async, mooncake_buffer_pool, mooncake_client, mooncake_config,
                           mooncake_metadata_server)
assert mc.MooncakeConfig is mooncake_config.MooncakeConfig
assert a.MooncakeDistributedStoreAsync is mooncake_async.MooncakeDistributedStoreAsync
assert bp.BufferPool is bp.RegisteredBufferPool is s.BufferPool is mooncake.BufferPool
assert bp.BufferPool is mooncake_buffer_pool.BufferPool
assert h.KVBootstrapServer is mooncake_metadata_server.KVBootstrapServer and cc.main is mooncake_client.main
for name in ("mooncake.structured_object_store", "mooncake.dataproto_catalog"):
    try:
        __import__(name)
    except ModuleNotFoundError as exc:
        assert exc.name == name and "not provided by tidekv" in str(exc) and "Store.put_tensor" in str(exc), exc
    else:
        raise AssertionError(name + " imported")
print("ok")
"""
    out = run_with_shim(shim_site, probe)
    assert out.returncode == 0 and out.stdout.split() == ["ok"], out.stderr + out.stdout
    for script in ("mooncake_client", "mooncake_http_metadata_server"):
        out = subprocess.run([str(shim_site / "bin" / script), "--help"], env=shim_env(shim_site), capture_output=True,
                             text=True, timeout=60, check=False)
        assert out.returncode == 0 and "--port" in out.stdout and "tidekv" in out.stdout, out.stderr + out.stdout
