"""The transports this build knows, and whether each can carry requests here (with the reason).

``catalog()`` is the one list of transports: ``tidekv doctor`` prints it and self-tests what it
calls available. Which transports this build has, and whether each can run, comes from the
native engine itself (its transport registry); the probes here add the reasons in words a user
can act on.
Each probe only looks — it loads a shared library, reads /proc or /sys, or makes one harmless
system call on this process.
Neighbours: ``memory`` (THP, Yama and seccomp facts the store also decides with),
``tidekv.config.TransferConfig`` (the settings a probe honours), ``tidekv.doctor``.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass

from tidekv.config import TransferConfig, TransportKind, format_size
from tidekv.transfer import memory

BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
INFINIBAND_PATH = "/sys/class/infiniband"
NVIDIA_GPUS_PATH = "/proc/driver/nvidia/gpus"
_CAP_SYS_PTRACE = 19


@dataclass(frozen=True, slots=True)
class TransportStatus:
    """One transport's state in this process."""

    name: str
    """The transport's name as logs and ``TransferConfig.transport`` spell it: "tcp", "shm", ..."""
    available: bool
    """Whether an engine started here with this build can use it."""
    reason: str
    """Why it is available or not, in words a user can act on."""


def catalog(config: TransferConfig) -> list[TransportStatus]:
    """Every transport this build has, in the engine's order.

    Args:
        config: the settings an engine here would run with (e.g. whether cross-memory attach is on).

    Returns:
        One status per transport of the native registry ("tcp", "shm", "cuda", "fabric", ...).
    """
    out = []
    for name, available, reason in built_transports(config):
        detail = _DETAILS.get(name)
        hint = _HINTS.get(name)
        said = hint() if hint else ""
        if said:
            reason = f"{reason}; {said}"
        out.append(detail(config) if detail and available else TransportStatus(name, available, reason))
    return out


def built_transports(config: TransferConfig) -> list[tuple[str, bool, str]]:
    """The native engine's own report: (name, available, reason) for each transport it was built with."""
    from tidekv import _native
    from tidekv.transfer.engine import _native_options

    engine = _native.Engine(_native_options("127.0.0.1", 0, dataclasses.replace(config, transport=TransportKind.AUTO)))
    try:
        return list(engine.transports())
    finally:
        engine.close()


def tcp_status() -> TransportStatus:
    """tcp needs nothing but sockets."""
    return TransportStatus("tcp", True, "sockets, to peers on any host; needs nothing else")


def shm_status(config: TransferConfig) -> TransportStatus:
    """shm: same-host peers found by boot id and watched by pidfd; cross-memory attach optional."""
    try:
        with open(BOOT_ID_PATH) as f:
            has_boot_id = bool(f.read().strip())
    except OSError:
        has_boot_id = False
    if not has_boot_id:
        return TransportStatus("shm", False, f"{BOOT_ID_PATH} cannot be read, so no peer is known to be on this "
                                             "host; same-host peers use tcp")
    try:
        os.close(os.pidfd_open(os.getpid()))
    except (AttributeError, OSError) as exc:
        return TransportStatus("shm", False, f"pidfd_open is unavailable ({exc}; Linux 5.3+ needed), so a "
                                             "same-host peer's death could not be noticed; same-host peers use tcp")
    from tidekv import _native

    _, cma = cross_memory_attach(config)
    kind = _native.stream_copy_kind()
    if config.stream_copy_bytes and kind != "none":
        copies = (f"memcpy, batches of {format_size(config.stream_copy_bytes)} or more with streaming "
                  f"{kind} stores")
    else:
        copies = "memcpy" + (" (streaming stores off: stream_copy_bytes=0)" if kind != "none" else "")
    return TransportStatus("shm", True, f"same-host peers: memory from allocate() is mapped and copied with "
                                        f"{copies}; {cma}; a peer with this boot id counts as same-host "
                                        "only if its region table opens through /proc/<pid>/fd (a pod on "
                                        "this node, with its own PIDs and /dev/shm, uses tcp; the engine "
                                        "logs why)")


def cross_memory_attach(config: TransferConfig) -> tuple[bool, str]:
    """Whether same-host peers can reach registered memory not from allocate() (process_vm_readv/writev).

    Returns:
        ``(usable, reason)``; where not usable, such memory goes over tcp (or fails under a
        forced shm transport).
    """
    if not config.enable_cross_memory_attach:
        return False, ("cross-memory attach is disabled (enable_cross_memory_attach=False, "
                       "$TIDEKV_ENABLE_CROSS_MEMORY_ATTACH): other registered memory goes over tcp")
    seccomp = seccomp_mode()
    if not memory.cross_memory_attach_allowed():
        return False, (f"cross-memory attach is refused: process_vm_readv fails on this process itself "
                       f"(seccomp {seccomp}; a container profile may forbid it): other registered memory "
                       "goes over tcp")
    allowed = f"process_vm_readv allowed (seccomp {seccomp})"
    scope = memory.yama_ptrace_scope()
    if scope is None:
        return True, f"cross-memory attach usable: {allowed}, no Yama"
    if scope == 0:
        return True, f"cross-memory attach usable: {allowed}, Yama ptrace_scope 0"
    if scope == 1:
        return True, (f"cross-memory attach usable: {allowed}, Yama ptrace_scope 1 (each engine lets "
                      "same-host peers attach with PR_SET_PTRACER_ANY)")
    if scope == 2 and _has_cap_sys_ptrace():
        return True, f"cross-memory attach usable: {allowed}, Yama ptrace_scope 2 and this process has CAP_SYS_PTRACE"
    return False, (f"cross-memory attach is refused: Yama ptrace_scope {scope} "
                   f"({'only CAP_SYS_PTRACE may attach' if scope == 2 else 'no process may attach'}; "
                   "see /proc/sys/kernel/yama/ptrace_scope): other registered memory goes over tcp")


def _nvidia_kernel_gpus() -> str:
    try:
        gpus = os.listdir(NVIDIA_GPUS_PATH)
    except OSError:
        return f"no NVIDIA kernel driver ({NVIDIA_GPUS_PATH} absent)"
    return f"the NVIDIA kernel driver lists {len(gpus)} GPU(s) in {NVIDIA_GPUS_PATH}"


def _rdma_devices_hint() -> str:
    nics = [describe_rdma_device(d) for d in rdma_devices()]  # (the engine itself says when there are none)
    return f"RDMA devices here: {'; '.join(nics)}" if nics else ""


def describe_rdma_device(device: str) -> str:
    """``"mlx5_0: port 1 ACTIVE 200 Gb/sec (4X HDR), numa node 0"``: what sysfs says of one RDMA
    device, so a user sees which NICs are up and which memory is near each."""
    base = os.path.join(INFINIBAND_PATH, device)
    ports = []
    with contextlib.suppress(OSError):
        for port in sorted(os.listdir(os.path.join(base, "ports")), key=lambda p: int(p) if p.isdigit() else 0):
            state = _read(os.path.join(base, "ports", port, "state")).partition(":")[2].strip() or "state unknown"
            rate = _read(os.path.join(base, "ports", port, "rate"))
            ports.append(f"port {port} {state}" + (f" {rate}" if rate else ""))
    numa = _read(os.path.join(base, "device", "numa_node"))
    where = f", numa node {numa}" if numa and numa != "-1" else ""
    return f"{device}: {', '.join(ports) or 'no ports'}{where}"


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def library_state(soname: str) -> str:
    """"loads" or "does not load (why)" for a shared library, as the dynamic loader sees it."""
    try:
        ctypes.CDLL(soname)
    except OSError as exc:
        return f"does not load ({_load_error(exc, soname)})"
    return "loads"


def _load_error(exc: OSError, soname: str) -> str:
    return str(exc).removeprefix(f"{soname}: ")


def rdma_devices() -> list[str]:
    """Names of the RDMA devices the kernel exposes (mlx5_0, ...); empty without any."""
    try:
        return sorted(os.listdir(INFINIBAND_PATH))
    except OSError:
        return []


def seccomp_mode() -> str:
    """This process's seccomp mode: "off", "strict", "filter" or "unknown"."""
    value = _status_field("Seccomp")
    return {"0": "off", "1": "strict", "2": "filter"}.get(value or "", "unknown")


def _has_cap_sys_ptrace() -> bool:
    value = _status_field("CapEff")
    return value is not None and bool(int(value, 16) >> _CAP_SYS_PTRACE & 1)


def _status_field(name: str) -> str | None:
    with contextlib.suppress(OSError), open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key == name:
                return value.strip()
    return None


_DETAILS: dict[str, Callable[[TransferConfig], TransportStatus]] = {
    "tcp": lambda config: tcp_status(),
    "shm": shm_status,
}
"""Probes that explain a built transport the engine calls available."""

_HINTS: dict[str, Callable[[], str]] = {"cuda": _nvidia_kernel_gpus, "fabric": _rdma_devices_hint}
"""What the host itself says, added to the reason of a built transport that is unavailable."""
