"""Which NIC serves which memory (``tidekv.transfer.topology``), on sysfs trees made here: two NUMA
nodes with a NIC each, a GPU behind the first NIC's PCIe switch, and the NUMA override."""

from __future__ import annotations

import os
from pathlib import Path

from tidekv.config import TransferConfig
from tidekv.doctor.report import nic_facts
from tidekv.transfer import topology
from tidekv.transfer.topology import Nic


def _device(sysfs: Path, pci: str, numa: int, **files: str) -> Path:
    device = sysfs / "devices" / pci
    device.mkdir(parents=True)
    (device / "numa_node").write_text(f"{numa}\n")
    for name, text in files.items():
        (device / name).write_text(text + "\n")
    return device


def _machine(tmp_path: Path) -> Path:
    """Nodes 0 and 1; mlx5_0 (node 0) and a GPU behind one switch of root complex 00; mlx5_1 on
    root complex 80 (node 1); eth9, a NIC without a PCI device (virtual)."""
    sysfs = tmp_path / "sys"
    for node in (0, 1):
        (sysfs / "devices/system/node" / f"node{node}").mkdir(parents=True)
    (sysfs / "devices/system/node/online").write_text("0-1\n")
    switch = "pci0000:00/0000:00:01.0/0000:10:00.0"
    for name, pci, numa in (("mlx5_0", f"{switch}/0000:11:00.0", 0),
                            ("mlx5_1", "pci0000:80/0000:80:01.0/0000:81:00.0", 1)):
        device = _device(sysfs, pci, numa)
        (sysfs / "class/infiniband" / name).mkdir(parents=True)
        os.symlink(device, sysfs / "class/infiniband" / name / "device")
    (sysfs / "class/net/eth9").mkdir(parents=True)
    gpu = _device(sysfs, f"{switch}/0000:12:00.0", 0, vendor="0x10de", **{"class": "0x030200"})
    other = _device(sysfs, "pci0000:00/0000:00:02.0", 0, vendor="0x8086", **{"class": "0x030000"})
    (sysfs / "bus/pci/devices").mkdir(parents=True)
    for device in (gpu, other):
        os.symlink(device, sysfs / "bus/pci/devices" / device.name)
    return sysfs


def test_host_memory_goes_over_the_nics_of_its_node_and_a_gpu_to_the_nic_behind_its_switch(tmp_path: Path) -> None:
    sysfs = str(_machine(tmp_path))
    nics = topology.find_nics(["mlx5_0", "mlx5_1", "eth9"], {}, sysfs)
    assert [(n.name, n.numa_node) for n in nics] == [("mlx5_0", 0), ("mlx5_1", 1), ("eth9", -1)]
    assert topology.numa_nodes(sysfs) == [0, 1]
    [gpu] = topology.find_gpus(sysfs)  # the Intel display controller is not one
    assert (gpu.address, gpu.numa_node) == ("0000:12:00.0", 0)
    rows = topology.memory_nic_map(nics[:2], [0, 1], [gpu])
    assert [(memory, used) for memory, used, _ in rows] == [
        ("host memory, node 0", "mlx5_0"), ("host memory, node 1", "mlx5_1"), ("GPU 0000:12:00.0 (node 0)", "mlx5_0")]


def test_memory_on_a_node_without_a_nic_or_of_unknown_node_goes_over_every_nic() -> None:
    nics = [Nic("a", 1, ""), Nic("b", 1, ""), Nic("c", -1, "")]
    assert [n.name for n in topology.nearest_nics(1, nics)] == ["a", "b"]
    assert [n.name for n in topology.nearest_nics(0, nics)] == ["a", "b", "c"]
    assert [n.name for n in topology.nearest_nics(-1, nics)] == ["a", "b", "c"]
    assert topology.memory_nic_map([], [0], []) == []


def test_the_override_sets_nodes_sysfs_does_not_know(tmp_path: Path) -> None:
    sysfs = str(_machine(tmp_path))
    env = {"TIDEKV_FABRIC_NIC_NUMA": "eth9=1,mlx5_1=0"}
    nics = topology.find_nics(["mlx5_0", "mlx5_1", "eth9"], env, sysfs)
    assert [(n.name, n.numa_node) for n in nics] == [("mlx5_0", 0), ("mlx5_1", 0), ("eth9", 1)]
    facts = nic_facts(TransferConfig(fabric_nics="mlx5_0,mlx5_1,eth9,mlx5_7"), env, sysfs)
    assert [(f.name, f.value) for f in facts] == [
        ("fabric: host memory, node 0", "mlx5_0, mlx5_1"), ("fabric: host memory, node 1", "eth9"),
        ("fabric: GPU 0000:12:00.0 (node 0)", "mlx5_0"), ("fabric: NICs not found", "mlx5_7")]
