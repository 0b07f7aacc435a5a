"""Which NIC serves which memory: the map ``tidekv doctor`` prints for the fabric transport.

fabric stripes a request over the NICs on its memory's NUMA node, or over every NIC where none is
on that node or the node is unknown (``native/fabric/fabric_link.cpp``, ``FabricLink::rails_for``;
``nearest_nics`` states the same rule for the report). A GPU is shown with the NICs nearest it on
PCIe (the longest shared path of bridges in sysfs, then its NUMA node): where GPUDirect
(``FI_HMEM``) would send its memory. fabric does not carry GPU memory yet, so that row is advice
for placing NICs, not what the engine does. Everything is read from sysfs, so tests point
``sysfs`` at a tree of their own.
Neighbours: ``transports`` (the fabric transport's probes), ``tidekv.doctor.report``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

NUMA_OVERRIDE_VARIABLE = "TIDEKV_FABRIC_NIC_NUMA"
_NVIDIA_VENDOR = "0x10de"
_DISPLAY_CLASSES = ("0x0300", "0x0302")  # VGA and 3D controllers


@dataclass(frozen=True, slots=True)
class Nic:
    """One NIC fabric may use: its name (a libfabric domain: an RDMA device or, for the tcp
    provider, an interface), its NUMA node (-1 unknown) and its PCI device's path in sysfs."""

    name: str
    numa_node: int
    pci_path: str


@dataclass(frozen=True, slots=True)
class Gpu:
    """One NVIDIA GPU as PCI sees it: address, NUMA node (-1 unknown), path in sysfs."""

    address: str
    numa_node: int
    pci_path: str


def nearest_nics(numa_node: int, nics: Sequence[Nic]) -> list[Nic]:
    """The NICs fabric uses for host memory on ``numa_node``: those on that node, else all."""
    near = [nic for nic in nics if numa_node >= 0 and nic.numa_node == numa_node]
    return near or list(nics)


def nics_nearest_gpu(gpu: Gpu, nics: Sequence[Nic]) -> list[Nic]:
    """The NICs sharing the longest PCIe path with ``gpu`` (behind the same switch beats the same
    root complex); among those, the ones on its NUMA node where any is."""
    def shared(nic: Nic) -> int:
        return len(os.path.commonpath([gpu.pci_path, nic.pci_path]).split(os.sep)) if nic.pci_path else 0

    if not nics:
        return []
    best = max(map(shared, nics))
    closest = [nic for nic in nics if shared(nic) == best]
    return [nic for nic in closest if gpu.numa_node >= 0 and nic.numa_node == gpu.numa_node] or closest


def numa_nodes(sysfs: str = "/sys") -> list[int]:
    """The machine's NUMA nodes ([0] where sysfs lists none)."""
    try:
        found = [int(m[1]) for name in os.listdir(os.path.join(sysfs, "devices/system/node"))
                 if (m := re.fullmatch(r"node(\d+)", name))]
    except OSError:
        found = []
    return sorted(found) or [0]


def find_nics(names: Sequence[str], environ: Mapping[str, str], sysfs: str = "/sys") -> list[Nic]:
    """The NICs of ``names`` that sysfs knows (an RDMA device or a network interface), with their
    NUMA node from ``$TIDEKV_FABRIC_NIC_NUMA`` ("mlx5_0=0,mlx5_1=1") or sysfs."""
    override = dict(part.split("=", 1) for part in environ.get(NUMA_OVERRIDE_VARIABLE, "").split(",") if "=" in part)
    out = []
    for name in names:
        device = re.sub(r"-(rdm|dgrm|dgram|xrc)$", "", name)
        known = [os.path.join(sysfs, cls, device) for cls in ("class/infiniband", "class/net")
                 if os.path.exists(os.path.join(sysfs, cls, device))]
        if not known:
            continue
        link = os.path.join(known[0], "device")  # absent for virtual interfaces
        pci_path = os.path.realpath(link) if os.path.exists(link) else ""
        node = _int(_read(os.path.join(link, "numa_node"))) if pci_path else -1
        if name in override:
            node = _int(override[name])
        out.append(Nic(name, max(node, -1), pci_path))
    return out


def find_gpus(sysfs: str = "/sys") -> list[Gpu]:
    """The NVIDIA GPUs on PCI (by vendor and display class), whether or not a driver is loaded."""
    root = os.path.join(sysfs, "bus/pci/devices")
    try:
        addresses = sorted(os.listdir(root))
    except OSError:
        return []
    out = []
    for address in addresses:
        device = os.path.join(root, address)
        if _read(os.path.join(device, "vendor")) == _NVIDIA_VENDOR and \
                _read(os.path.join(device, "class")).startswith(_DISPLAY_CLASSES):
            out.append(Gpu(address, max(_int(_read(os.path.join(device, "numa_node"))), -1), os.path.realpath(device)))
    return out


def memory_nic_map(nics: Sequence[Nic], nodes: Sequence[int], gpus: Sequence[Gpu]) -> list[tuple[str, str, str]]:
    """(memory, its NICs, why) for each NUMA node's host memory and each GPU; empty without NICs."""
    if not nics:
        return []
    rows = []
    for node in nodes:
        near = nearest_nics(node, nics)
        why = f"the NICs on node {node}" if near[0].numa_node == node else "no NIC is known to be on this node: all"
        rows.append((f"host memory, node {node}", ", ".join(nic.name for nic in near), why))
    for gpu in gpus:
        nearest = ", ".join(nic.name for nic in nics_nearest_gpu(gpu, nics))
        rows.append((f"GPU {gpu.address} (node {gpu.numa_node})", nearest,
                     "nearest on PCIe, for GPUDirect; fabric does not carry GPU memory yet"))
    return rows


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        return -1
