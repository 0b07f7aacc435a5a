"""Mooncake comparison of ``bench transfer``: the same workloads through Mooncake's transfer engine.

Drives ``mooncake.engine.TransferEngine`` (from the wheel ``mooncake-transfer-engine-non-cuda``)
over its tcp protocol in P2PHANDSHAKE mode (no metadata server). Both sides run as helper
processes, a target that registers a region and an initiator that times the workloads, so
Mooncake's log output stays in their log files and a Mooncake crash cannot take the bench down.
The initiator uses one spelling per shape: ``transfer_sync_{read,write}`` for single requests,
``batch_transfer_sync_{read,write}`` for batches. Neighbours: ``transfer`` decides what to run;
``workload`` and ``timing`` keep the rows comparable with tidekv's.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from tidekv.bench.timing import Budget, measure
from tidekv.bench.workload import Workload
from tidekv.errors import ConfigError, TidekvError
from tidekv.helper_process import HelperProcess, send_ready, serve
from tidekv.transfer.batch import TransferOp

logger = logging.getLogger(__name__)

WHEEL = "mooncake-transfer-engine-non-cuda"
INSTALL_HINT = (
    f"install it with `pip install {WHEEL}`; the wheel also needs Debian's libibverbs1 even for tcp "
    "(`apt-get update && apt-get install -y libibverbs1`)"
)
_HOST = "127.0.0.1"


def check_available(module: str = "mooncake.engine") -> None:
    """Imports a Mooncake module here, to fail before a long run rather than in a helper.

    Raises:
        ConfigError: the wheel or a library it needs is missing; the message says how to install.
    """
    try:
        importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(f"--compare mooncake needs the Mooncake wheel, which cannot be imported ({e}); "
                          f"{INSTALL_HINT}") from None


def _start_engine() -> tuple[Any, str]:
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    rc = engine.initialize(_HOST, "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise TidekvError(f"mooncake TransferEngine.initialize({_HOST!r}, 'P2PHANDSHAKE', 'tcp', '') returned {rc}")
    return engine, f"{_HOST}:{engine.get_rpc_port()}"


def _register_region(engine: Any, region_bytes: int) -> tuple[Any, int]:
    region = (ctypes.c_char * region_bytes)()
    address = ctypes.addressof(region)
    ctypes.memset(address, 0x5A, region_bytes)
    rc = engine.register_memory(address, region_bytes)
    if rc != 0:
        raise TidekvError(f"mooncake register_memory({address:#x}, {region_bytes}) returned {rc}")
    return region, address


def _target_main(conn: Connection, region_bytes: int) -> None:
    engine, session = _start_engine()
    region, address = _register_region(engine, region_bytes)
    send_ready(conn, (session, address))
    serve(conn)
    del region


def _initiator_main(conn: Connection, peer_session: str, peer_address: int, region_bytes: int) -> None:
    engine, session = _start_engine()
    region, address = _register_region(engine, region_bytes)

    def run(message: tuple[Workload, Budget]) -> list[float]:
        workload, budget = message
        size = workload.size_bytes
        offsets = workload.offsets()
        is_read = workload.op == TransferOp.READ
        if workload.count == 1:
            fn = engine.transfer_sync_read if is_read else engine.transfer_sync_write
            local, remote = address + offsets[0], peer_address + offsets[0]
            args: tuple[Any, ...] = (peer_session, local, remote, size)
        else:
            fn = engine.batch_transfer_sync_read if is_read else engine.batch_transfer_sync_write
            args = (peer_session, [address + o for o in offsets], [peer_address + o for o in offsets],
                    [size] * workload.count)

        def step() -> None:
            rc = fn(*args)
            if rc != 0:
                raise TidekvError(f"mooncake {fn.__name__} of {workload.count} x {size} bytes to "
                                  f"{peer_session} returned {rc}")

        return measure(step, budget)

    send_ready(conn, session)
    serve(conn, run)
    del region


class MooncakeDriver:
    """A Mooncake target and initiator pair (two helper processes) on 127.0.0.1.

    Args:
        region_bytes: region size on each side (the workloads' region size).
        log_dir: where both processes log.

    Raises:
        ConfigError: the Mooncake wheel is not installed.
        TidekvError: an engine could not be started (the message quotes its log).
    """

    name = "mooncake"

    def __init__(self, region_bytes: int, log_dir: str | Path) -> None:
        check_available()
        self._target = HelperProcess("mooncake-target", _target_main, (region_bytes,), log_dir)
        try:
            session, address = self._target.hello
            self._initiator = HelperProcess("mooncake-initiator", _initiator_main,
                                            (session, address, region_bytes), log_dir)
        except BaseException:
            self._target.stop()
            raise
        logger.info("mooncake target %s ready, region %#x +%d", session, address, region_bytes)

    def measure(self, workload: Workload, budget: Budget, timeout_s: float = 600.0) -> list[float]:
        """Latency of each timed iteration (seconds), timed inside the Mooncake initiator.

        Raises:
            TidekvError: a transfer failed or the initiator died (the message quotes its log).
        """
        samples: list[float] = self._initiator.call((workload, budget), timeout_s)
        return samples

    def close(self) -> None:
        """Stops both processes (initiator first)."""
        self._initiator.stop()
        self._target.stop()
