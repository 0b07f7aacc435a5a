"""Store test harness: masters and store clients in their own processes, driven with deadlines.

``MasterProcess`` runs ``master_main`` (a MasterServer) and reads its address from the first
stdout line; ``AgentProcess`` runs ``agent_main`` (a Store client, optionally contributing a
segment) and sends it one JSON command per line (``tests.childproc``: every answer is awaited
with a deadline). Neighbours: ``conftest`` wraps these in fixtures and appends a failed test's
child logs to its report; ``payload`` defines test bytes.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tests.childproc import COMMAND_TIMEOUT_S, JsonLineChild


class ChildError(AssertionError):
    """A child process did not answer as the test expected (died, timed out, refused)."""


def wait_until(predicate: Callable[[], Any], timeout_s: float, what: str, interval_s: float = 0.02) -> Any:
    """Polls ``predicate`` until it returns something truthy; fails naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)


class ChildProcess(JsonLineChild):
    """A ``python -m <module> <json spec>`` child: first stdout line is its hello, then one answer per command."""

    error = ChildError

    def __init__(self, module: str, spec: dict[str, Any], log_path: Path, name: str, prefix: Sequence[str] = ()) -> None:
        self.name = name
        # prefix: what runs it elsewhere, e.g. on another "host" of tests/multihost (ip netns exec ...)
        super().__init__([*prefix, sys.executable, "-m", module, json.dumps(spec)], log_path, name)
        self.pid = self.proc.pid

    def call(self, cmd: str, timeout_s: float = COMMAND_TIMEOUT_S, **args: Any) -> dict[str, Any]:
        """Sends one command and returns its answer; raises ChildError if it failed or timed out."""
        reply = self.try_call(cmd, timeout_s, **args)
        if not reply["ok"]:
            raise ChildError(f"{self.name} command {cmd} {args} failed: {reply['error_type']}: {reply['error']}")
        return reply

    def try_call(self, cmd: str, timeout_s: float = COMMAND_TIMEOUT_S, **args: Any) -> dict[str, Any]:
        """Like call(), but a command that raised comes back as {"ok": False, "error_type", "error"}."""
        self.send(cmd, **args)
        return self.read_line(timeout_s)

    def start_call(self, cmd: str, **args: Any) -> None:
        """Sends a command without waiting (``finish_call`` reads its answer): children work in parallel."""
        self.send(cmd, **args)

    def finish_call(self, timeout_s: float = COMMAND_TIMEOUT_S) -> dict[str, Any]:
        reply = self.read_line(timeout_s)
        if not reply["ok"]:
            raise ChildError(f"{self.name} failed: {reply['error_type']}: {reply['error']}")
        return reply

    def stop(self, timeout_s: float = 10.0) -> None:
        """Closes stdin (the child's cue to shut down cleanly); kills it if it lingers."""
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()
                self.proc.wait(timeout=timeout_s)
            except (OSError, subprocess.TimeoutExpired):
                pass
        if self.proc.poll() is None:
            self.kill()
        self.close_pipes()


class MasterProcess(ChildProcess):
    """A MasterServer in its own process. ``config`` holds MasterConfig fields (port 0 by default)."""

    def __init__(self, config: dict[str, Any], log_path: Path, name: str = "master", prefix: Sequence[str] = ()) -> None:
        config = {"port": 0, "metrics_port": 0, **config}
        super().__init__("tests.store.master_main", {"config": config}, log_path, name, prefix)
        self.address: str = self.hello["address"]
        self.port: int = self.hello["port"]
        self.metrics_port: int = self.hello["metrics_port"]
        self.master_id: str = self.hello["master_id"]


class AgentProcess(ChildProcess):
    """A Store client in its own process; ``segment_size`` > 0 makes it a holder of pool memory."""

    def __init__(self, master: str, segment_size: int, store: dict[str, Any], log_path: Path, name: str,
                 prefix: Sequence[str] = (), host: str | None = None) -> None:
        super().__init__("tests.store.agent_main", {"master": master, "segment_size": segment_size, "store": store,
                                                    "host": host}, log_path, name, prefix)
        self.engine: str = self.hello["engine"]
        self.segment: str = self.hello["segment"]
        self.client_id: str = self.hello["client_id"]
