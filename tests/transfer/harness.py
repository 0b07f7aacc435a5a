"""Test harness: target engines in separate processes, and bounded waits on them.

``TargetProcess`` starts ``target_main`` as a subprocess, reads its engine name and region
addresses, and sends it commands, each answer awaited with a deadline (``tests.childproc``).
Neighbours: ``tests/conftest.py`` wraps this in fixtures and prints a failed test's target
stderr; ``reference`` defines the bytes targets hold.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.childproc import COMMAND_TIMEOUT_S, JsonLineChild
from tests.transfer.reference import READ, Copy, first_difference
from tidekv import TransferConfig, TransferOp, TransferRequest, TransportKind
from tidekv.transfer import Region

_DRIVEN = ("tcp", "shm", "fabric")
"""Transports the contract suite knows how to drive: "tcp" and "fabric" force theirs; "shm" is AUTO
towards a same-host target (so it also checks that AUTO picks it)."""

FABRIC_PROVIDER = os.environ.get("TIDEKV_TEST_FABRIC_PROVIDER", "tcp")
"""The libfabric provider the suite runs fabric on, initiators and targets alike: libfabric's
software tcp provider (tcp;ofi_rxm) on a host without an RDMA NIC; "verbs" or "efa" on one."""


def _contract_transports() -> list[str]:
    """Every transport the native engine reports available here. One the suite cannot drive yet
    is an error, so that a new transport cannot go unchecked by the contract."""
    from tidekv.transfer.transports import built_transports

    config = TransferConfig(fabric_provider=FABRIC_PROVIDER)
    available = [name for name, is_available, _ in built_transports(config) if is_available]
    undriven = sorted(set(available) - set(_DRIVEN))
    if undriven:
        raise RuntimeError(f"the contract suite has no driver for transport(s) {undriven}; add one in {__file__}")
    return available


TRANSPORTS = _contract_transports()
"""Contract-suite transports: every available one (tcp, shm and, where libfabric is installed, fabric)."""


def initiator_config(transport: str, **settings: Any) -> TransferConfig:
    """The config an initiator uses to reach a same-host target over ``transport``."""
    kinds = {"tcp": TransportKind.TCP, "shm": TransportKind.AUTO, "fabric": TransportKind.FABRIC}
    if transport == "fabric":
        settings.setdefault("fabric_provider", FABRIC_PROVIDER)
    return TransferConfig(transport=kinds[transport], **settings)


class TargetError(AssertionError):
    """The target process did not answer as the test expected (died, timed out, refused)."""


@dataclass(frozen=True)
class RemoteRegion:
    """A region registered in a target process: where it is and what it was filled with."""

    address: int
    length: int
    is_shared: bool

    def addr(self, offset: int = 0) -> int:
        assert 0 <= offset <= self.length, (offset, self.length)
        return self.address + offset


class TargetProcess(JsonLineChild):
    """A TransferEngine in a child process that the test drives with commands (``tests.childproc``).

    Args:
        regions: name -> (kind, size_bytes, seed); kind is "alloc" (engine shared memory),
            "bytearray" or "numpy" (plain registered memory).
        config: TransferConfig keyword arguments (transport as its string value).
        log_path: where the child's stderr (its engine log) goes.
        port: the engine's port (0: any free one).
        host: the engine's address (default 127.0.0.1).
    """

    error = TargetError

    def __init__(
        self,
        regions: dict[str, tuple[str, int, int]],
        config: dict[str, Any],
        log_path: Path,
        prefix: Sequence[str] = (),
        port: int = 0,
        host: str = "127.0.0.1",
    ) -> None:
        # prefix: a command the target runs under, e.g. ["prlimit", "--nofile=256"], or a rig
        # host's (tests/multihost); host: the address its engine listens on.
        config = {"fabric_provider": FABRIC_PROVIDER, **config}  # so that a fabric initiator can reach it
        spec = json.dumps({"regions": regions, "config": config, "port": port, "host": host})
        super().__init__([*prefix, sys.executable, "-m", "tests.transfer.target_main", spec], log_path, "target")
        self.name: str = self.hello["name"]
        self.label = f"target {self.name}"
        self.pid: int = self.hello["pid"]
        self.regions = {n: RemoteRegion(**r) for n, r in self.hello["regions"].items()}

    def call(self, cmd: str, timeout_s: float = COMMAND_TIMEOUT_S, **args: Any) -> dict[str, Any]:
        """Sends one command and returns its answer; raises TargetError if it failed or timed out."""
        self.send(cmd, **args)
        reply = self.read_line(timeout_s)
        if not reply["ok"]:
            raise TargetError(f"target command {cmd} {args} failed: {reply['error_type']}: {reply['error']}")
        return reply

    def fill(self, region: str, seed: int) -> None:
        """Refills a region with ``reference.pattern(seed)``."""
        self.call("fill", region=region, seed=seed)

    def dump(self, region: str, tmp_dir: Path) -> bytes:
        """The region's current bytes, read by the target itself (not through the engine)."""
        path = tmp_dir / f"dump-{self.pid}-{region}-{time.monotonic_ns()}.bin"
        self.call("dump", region=region, path=str(path))
        data = path.read_bytes()
        path.unlink()
        return data

    def read(self, region: str, offset: int, length: int) -> bytes:
        """A few bytes of a region, read by the target itself."""
        return base64.b64decode(self.call("read", region=region, offset=offset, length=length)["data"])

    def add(self, region: str, kind: str, size_bytes: int, seed: int) -> RemoteRegion:
        """Allocates or registers one more region, filled with ``pattern(seed)``."""
        reply = self.call("add", region=region, kind=kind, size_bytes=size_bytes, seed=seed)
        self.regions[region] = RemoteRegion(reply["address"], reply["length"], reply["is_shared"])
        return self.regions[region]

    def unregister(self, region: str) -> None:
        self.call("unregister", region=region)
        self.regions.pop(region)

    def stats(self) -> dict[str, int]:
        return self.call("stats")["stats"]

    def stop(self) -> None:
        """Asks the target to close its engine and exit; kills it if it does not within a few seconds."""
        if self.proc.poll() is None:
            try:
                self.call("stop", timeout_s=5)
                self.proc.wait(timeout=5)
            except (TargetError, subprocess.TimeoutExpired, OSError):
                pass
        if self.proc.poll() is None:
            self.kill()
        self.close_pipes()

    def wait_for_log(self, needle: str, timeout_s: float = 10.0) -> str:
        """Returns the first log line containing ``needle``; fails after timeout_s."""
        deadline = time.monotonic() + timeout_s
        while True:
            for line in self.log_text().splitlines():
                if needle in line:
                    return line
            if time.monotonic() > deadline:
                raise TargetError(f"target {self.name} logged no line containing {needle!r} within {timeout_s} s")
            time.sleep(0.02)


def requests_for(copies: Sequence[Copy], local: dict[str, Region], target: TargetProcess) -> list[TransferRequest]:
    """The engine requests for a batch described in region offsets (see ``reference.Copy``)."""
    return [
        TransferRequest(
            TransferOp.READ if c.op == READ else TransferOp.WRITE,
            local[c.local].addr(c.local_offset),
            c.length,
            target.name,
            target.regions[c.remote].addr(c.remote_offset),
        )
        for c in copies
    ]


def assert_bytes_equal(actual: bytes | bytearray | memoryview, expected: bytes | bytearray, what: str) -> None:
    """Byte-for-byte compare that reports the first difference instead of two huge reprs."""
    difference = first_difference(actual, expected)
    assert difference is None, f"{what}: {difference}"
