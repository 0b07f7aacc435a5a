"""Store test harness: masters and store clients in their own processes, driven with deadlines.

``MasterProcess`` runs ``master_main`` (a MasterServer) and reads its address from the first
stdout line; ``AgentProcess`` runs ``agent_main`` (a Store client, optionally contributing a
segment) and sends it one JSON command per line. Every answer is awaited with a deadline, so a
wedged child fails the test instead of hanging it. Neighbours: ``conftest`` wraps these in
fixtures and appends a failed test's child logs to its report; ``payload`` defines test bytes.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 30.0
COMMAND_TIMEOUT_S = 20.0


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


class ChildProcess:
    """A ``python -m <module> <json spec>`` child: first stdout line is its hello, then one answer per command."""

    def __init__(self, module: str, spec: dict[str, Any], log_path: Path, name: str) -> None:
        self.name = name
        self.log_path = log_path
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", module, json.dumps(spec)],
                cwd=REPO_ROOT,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=env,
            )
        self.pid = self.proc.pid
        self._buffer = b""
        self._selector = selectors.DefaultSelector()
        assert self.proc.stdout is not None
        self._selector.register(self.proc.stdout, selectors.EVENT_READ)
        try:
            self.hello = self._read_line(START_TIMEOUT_S)
        except ChildError as e:
            self.kill()
            self._close_pipes()
            raise ChildError(f"{e}; its stderr:\n{self.log_text()}") from None

    def call(self, cmd: str, timeout_s: float = COMMAND_TIMEOUT_S, **args: Any) -> dict[str, Any]:
        """Sends one command and returns its answer; raises ChildError if it failed or timed out."""
        reply = self.try_call(cmd, timeout_s, **args)
        if not reply["ok"]:
            raise ChildError(f"{self.name} command {cmd} {args} failed: {reply['error_type']}: {reply['error']}")
        return reply

    def try_call(self, cmd: str, timeout_s: float = COMMAND_TIMEOUT_S, **args: Any) -> dict[str, Any]:
        """Like call(), but a command that raised comes back as {"ok": False, "error_type", "error"}."""
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write((json.dumps({"cmd": cmd, **args}) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise ChildError(f"{self.name} exited ({self.proc.poll()}) before command {cmd!r}") from None
        return self._read_line(timeout_s)

    def start_call(self, cmd: str, **args: Any) -> None:
        """Sends a command without waiting (``finish_call`` reads its answer): children work in parallel."""
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({"cmd": cmd, **args}) + "\n").encode())
        self.proc.stdin.flush()

    def finish_call(self, timeout_s: float = COMMAND_TIMEOUT_S) -> dict[str, Any]:
        reply = self._read_line(timeout_s)
        if not reply["ok"]:
            raise ChildError(f"{self.name} failed: {reply['error_type']}: {reply['error']}")
        return reply

    def is_alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL, then reap (bounded)."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

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
        self._close_pipes()

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError as e:
            return f"(no log: {e})"

    def _close_pipes(self) -> None:
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None and not stream.closed:
                stream.close()
        self._selector.close()

    def _read_line(self, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not self._selector.select(left):
                raise ChildError(f"{self.name} (pid {self.pid}) did not answer within {timeout_s} s")
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                code = self.proc.wait(timeout=5)
                raise ChildError(f"{self.name} (pid {self.pid}) exited with {code} without answering")
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return json.loads(line)


class MasterProcess(ChildProcess):
    """A MasterServer in its own process. ``config`` holds MasterConfig fields (port 0 by default)."""

    def __init__(self, config: dict[str, Any], log_path: Path, name: str = "master") -> None:
        config = {"port": 0, "metrics_port": 0, **config}
        super().__init__("tests.store.master_main", {"config": config}, log_path, name)
        self.address: str = self.hello["address"]
        self.port: int = self.hello["port"]
        self.metrics_port: int = self.hello["metrics_port"]
        self.master_id: str = self.hello["master_id"]


class AgentProcess(ChildProcess):
    """A Store client in its own process; ``segment_size`` > 0 makes it a holder of pool memory."""

    def __init__(self, master: str, segment_size: int, store: dict[str, Any], log_path: Path, name: str) -> None:
        super().__init__("tests.store.agent_main", {"master": master, "segment_size": segment_size, "store": store},
                         log_path, name)
        self.engine: str = self.hello["engine"]
        self.segment: str = self.hello["segment"]
        self.client_id: str = self.hello["client_id"]
