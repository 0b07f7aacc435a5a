"""NIXL comparison of ``bench transfer`` (``--compare nixl``): the same workloads through NIXL.

NIXL's Python agent API with the UCX backend, in two helper processes (target, initiator) as
``mooncake_te`` does for Mooncake; UCX's default transports beside tidekv's same-host rows and
``UCX_TLS=tcp`` beside its tcp rows, one transfer handle per shape posted again each iteration.
The helpers end with ``os._exit`` (UCX agents crash in their destructors at exit) and are paused
(SIGSTOP) except while their own rows are measured (idle progress threads spin). Neighbours:
``transfer`` decides what to run; ``workload`` and ``timing`` keep the rows comparable.
Design notes: docs/design-bench.md#tidekvbenchnixl_te
"""

from __future__ import annotations

import importlib
import logging
import os
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from tidekv.bench.timing import Budget, measure
from tidekv.bench.workload import Workload
from tidekv.errors import ConfigError, TidekvError
from tidekv.helper_process import HelperProcess, send_ready, serve
from tidekv.transfer.batch import TransferOp

logger = logging.getLogger(__name__)

INSTALL_HINT = ("install it with `pip install --no-deps nixl-cu12 nixl` plus numpy (the wheels ask for torch, "
                "which only their GPU helpers import; they run on CPU hosts too)")
DEFAULT_UCX: dict[str, str] = {}
"""NIXL as it comes: UCX picks its transports (cross-memory attach between processes of one host)."""
TCP_UCX = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}
"""UCX's tcp transport on loopback only (with tcp alone it would stripe over every interface)."""
_TARGET = "tidekv-bench-nixl-target"
_INITIATOR = "tidekv-bench-nixl-initiator"


def check_available() -> None:
    """Imports NIXL here, to fail before a long run rather than in a helper.

    Raises:
        ConfigError: NIXL (or numpy) is missing; the message says how to install it.
    """
    try:
        importlib.import_module("numpy")
        importlib.import_module("nixl._api")
    except ImportError as e:
        raise ConfigError(f"--compare nixl needs NIXL, which cannot be imported ({e}); {INSTALL_HINT}") from None


def _agent(name: str, ucx_env: dict[str, str]) -> Any:
    os.environ.update(ucx_env)  # before UCX starts in this process
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent(name, nixl_agent_config(backends=["UCX"]))


def _region(agent: Any, region_bytes: int) -> Any:
    import numpy as np

    buf = np.full(region_bytes, 0x5A, dtype=np.uint8)
    agent.register_memory([(buf.ctypes.data, region_bytes, 0, "")], "DRAM")
    return buf


def _target_main(conn: Connection, region_bytes: int, ucx_env: dict[str, str]) -> None:
    agent = _agent(_TARGET, ucx_env)
    buf = _region(agent, region_bytes)
    send_ready(conn, (agent.get_agent_metadata(), buf.ctypes.data))
    try:
        while True:  # progress the agent (UCX's tcp emulates READ on the target's side) until told to stop
            if conn.poll(0.0005):
                try:
                    if conn.recv() is None:
                        break
                except EOFError:
                    break
            agent.get_new_notifs()
    finally:
        os._exit(0)


def _initiator_main(conn: Connection, target_metadata: bytes, target_address: int, region_bytes: int,
                    ucx_env: dict[str, str]) -> None:
    agent = _agent(_INITIATOR, ucx_env)
    remote = agent.add_remote_agent(target_metadata)
    buf = _region(agent, region_bytes)
    local_address = buf.ctypes.data

    def run(message: tuple[Workload, Budget]) -> list[float]:
        workload, budget = message
        size, offsets = workload.size_bytes, workload.offsets()
        local = agent.get_xfer_descs([(local_address + o, size, 0) for o in offsets], "DRAM")
        far = agent.get_xfer_descs([(target_address + o, size, 0) for o in offsets], "DRAM")
        op = "READ" if workload.op == TransferOp.READ else "WRITE"
        handle = agent.initialize_xfer(op, local, far, remote, b"")

        def step() -> None:
            state = agent.transfer(handle)
            while state == "PROC":
                state = agent.check_xfer_state(handle)
            if state != "DONE":
                raise TidekvError(f"nixl {op} of {workload.count} x {size} bytes ended in state {state!r}")

        try:
            return measure(step, budget)
        finally:
            agent.release_xfer_handle(handle)

    send_ready(conn, _INITIATOR)
    try:
        serve(conn, run)
    finally:
        os._exit(0)


class NixlDriver:
    """A NIXL target and initiator pair (two helper processes) with one UCX setting.

    Args:
        region_bytes: region size on each side (the workloads' region size).
        log_dir: where both processes log.
        ucx_env: UCX variables of both processes (``DEFAULT_UCX`` or ``TCP_UCX``).
        label: names the pair in logs ("nixl-default", "nixl-tcp").

    Raises:
        ConfigError: NIXL is not installed.
        TidekvError: an agent could not be started (the message quotes its log).
    """

    def __init__(self, region_bytes: int, log_dir: str | Path, ucx_env: dict[str, str], label: str) -> None:
        check_available()
        self._target = HelperProcess(f"{label}-target", _target_main, (region_bytes, ucx_env), log_dir)
        try:
            metadata, address = self._target.hello
            self._initiator = HelperProcess(f"{label}-initiator", _initiator_main,
                                            (metadata, address, region_bytes, ucx_env), log_dir)
        except BaseException:
            self._target.stop()
            raise
        self._helpers = (self._target, self._initiator)
        self.pause()
        logger.info("%s target ready, region %#x +%d", label, address, region_bytes)

    def measure(self, workload: Workload, budget: Budget, timeout_s: float = 600.0) -> list[float]:
        """Latency of each timed iteration (seconds), timed inside the NIXL initiator.

        Raises:
            TidekvError: a transfer failed or the initiator died (the message quotes its log).
        """
        for helper in self._helpers:
            helper.resume()
        try:
            samples: list[float] = self._initiator.call((workload, budget), timeout_s)
        finally:
            self.pause()
        return samples

    def pause(self) -> None:
        """Stops both processes between measurements: idle, UCX's progress threads spin (about half a
        core each here), which would slow every other row measured meanwhile."""
        for helper in self._helpers:
            helper.pause()

    def close(self) -> None:
        """Stops both processes (initiator first)."""
        self._initiator.stop()
        self._target.stop()
