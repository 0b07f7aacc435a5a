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
from tidekv import (
    SegmentNotRegisteredError,
    TransferConfig,
    TransferOp,
    TransferRequest,
    TransferState,
)
from tidekv.transfer.transports import built_transports, rdma_devices

from tests.conftest import MakeEngine, SpawnTarget
from tests.transfer.harness import FABRIC_PROVIDER, TRANSPORTS, initiator_config
from tests.transfer.reference import pattern


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


@pytest.mark.skipif("fabric" not in TRANSPORTS, reason="fabric cannot run here (libfabric1 not installed)")
def test_writes_confirmed_by_a_read_after_them_land_byte_for_byte(
        spawn_target: SpawnTarget, make_engine: MakeEngine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without FI_DELIVERY_COMPLETE a batch's writes are reported done only when a read ordered
    after them comes back; the tcp provider has delivery-complete, so the fallback is forced here."""
    monkeypatch.setenv("TIDEKV_FABRIC_CONFIRM_BY_READ", "1")
    size = 1 << 20
    target = spawn_target({"mem": ("alloc", size, 60), "other": ("bytearray", size, 61)})
    engine = make_engine(initiator_config("fabric"))
    [reason] = [r for name, _, r in engine.transports() if name == "fabric"]
    assert "confirmed by a read after them" in reason, reason
    assert engine.connect(target.name) == "fabric"
    local = engine.register(bytearray(pattern(62, 2 * size)))
    W = TransferOp.WRITE
    # Writes to two regions in one batch, some of them past a region's end (refused, never posted).
    batch = [TransferRequest(W, local.addr(i * 65536), 65536, target.name, target.regions["mem"].addr(i * 65536))
             for i in range(16)]
    batch += [TransferRequest(W, local.addr(size), size, target.name, target.regions["other"].addr(0)),
              TransferRequest(W, local.addr(0), 100, target.name, target.regions["other"].addr(size - 50))]
    handle = engine.transfer(batch)
    with pytest.raises(SegmentNotRegisteredError):
        handle.wait(timeout_s=30)
    assert [s.state for s in handle.statuses()] == [TransferState.DONE] * 17 + [TransferState.FAILED]
    assert target.dump("mem", tmp_path) == pattern(62, 2 * size)[:size]
    assert target.dump("other", tmp_path) == pattern(62, 2 * size)[size:]
