"""The fabric transport's own checks, beside the contract suite that runs every transfer test
over it (tests/transfer/harness.py drives it on libfabric's tcp provider where libfabric is
installed): that CI does run it, and how it reports a host where it cannot run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tidekv import TransferConfig
from tidekv.transfer.transports import built_transports, rdma_devices

from tests.transfer.harness import FABRIC_PROVIDER, TRANSPORTS


def _fabric(config: TransferConfig) -> tuple[bool, str]:
    [(available, reason)] = [(a, r) for name, a, r in built_transports(config) if name == "fabric"]
    return available, reason


def test_ci_runs_the_contract_suite_over_fabric() -> None:
    available, reason = _fabric(TransferConfig(fabric_provider=FABRIC_PROVIDER))
    if not available and os.environ.get("CI") != "true":
        pytest.skip(f"fabric cannot run here ({reason}); CI installs libfabric1 and must run it")
    assert available, reason
    assert "fabric" in TRANSPORTS
    assert reason.startswith("provider tcp;ofi_rxm") or FABRIC_PROVIDER != "tcp", reason


def test_without_an_rdma_device_fabric_is_off_by_default_and_says_how_to_turn_it_on() -> None:
    if rdma_devices():
        pytest.skip(f"this host has RDMA devices ({rdma_devices()}): fabric may well run by default")
    available, reason = _fabric(TransferConfig())
    assert not available
    assert "fabric_provider" in reason, reason
    assert "no RDMA devices" in reason, reason  # said without loading libfabric at all


def test_an_unknown_provider_is_named_in_the_reason() -> None:
    available, reason = _fabric(TransferConfig(fabric_provider="no-such-provider"))
    assert not available
    assert "no-such-provider" in reason or "does not load" in reason, reason


def test_a_missing_libfabric_is_unavailable_with_the_package_to_install() -> None:
    code = ("import json; from tidekv import TransferConfig; from tidekv.transfer.transports import built_transports;"
            "print(json.dumps([t for t in built_transports(TransferConfig(fabric_provider='tcp')) if t[0] == 'fabric']))")
    env = dict(os.environ, TIDEKV_LIBFABRIC="/nonexistent/libfabric.so.1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, check=True)
    [[name, available, reason]] = json.loads(out.stdout)
    assert (name, available) == ("fabric", False)
    assert "/nonexistent/libfabric.so.1 does not load" in reason and "libfabric1" in reason, reason


def test_doctor_describes_each_rdma_nic_from_sysfs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tidekv.transfer import transports

    port = tmp_path / "mlx5_0" / "ports" / "1"
    port.mkdir(parents=True)
    (port / "state").write_text("4: ACTIVE\n")
    (port / "rate").write_text("200 Gb/sec (4X HDR)\n")
    (tmp_path / "mlx5_0" / "device").mkdir()
    (tmp_path / "mlx5_0" / "device" / "numa_node").write_text("1\n")
    (tmp_path / "rxe0" / "ports" / "1").mkdir(parents=True)
    (tmp_path / "rxe0" / "ports" / "1" / "state").write_text("1: DOWN\n")
    monkeypatch.setattr(transports, "INFINIBAND_PATH", str(tmp_path))
    assert transports.rdma_devices() == ["mlx5_0", "rxe0"]
    assert transports.describe_rdma_device("mlx5_0") == "mlx5_0: port 1 ACTIVE 200 Gb/sec (4X HDR), numa node 1"
    assert transports.describe_rdma_device("rxe0") == "rxe0: port 1 DOWN"
