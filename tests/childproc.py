"""A test's child process driven over its stdin and stdout: one JSON line per command in, one
JSON line per answer out, the first line out its hello. Every answer is awaited against a
deadline, so that a wedged child fails the test instead of hanging it; its stderr goes to a log
file that failures quote. Neighbours: ``tests/store/procs.py`` (masters, holders, clients) and
``tests/transfer/harness.py`` (transfer targets) build on it.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 30.0
"""How long a child has for its hello."""
COMMAND_TIMEOUT_S = 20.0
"""How long a child has, by default, for the answer to a command."""


class JsonLineChild:
    """A started child, its hello read (``hello``). ``label`` names it in errors, which are of the
    subclass's ``error`` type."""

    error: type[AssertionError] = AssertionError

    def __init__(self, argv: Sequence[str], log_path: Path, label: str) -> None:
        self.log_path = log_path
        self.label = label
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(list(argv), cwd=REPO_ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=log, env=env)
        self._buffer = b""
        self._selector = selectors.DefaultSelector()
        assert self.proc.stdout is not None
        self._selector.register(self.proc.stdout, selectors.EVENT_READ)
        try:
            self.hello = self.read_line(START_TIMEOUT_S)
        except self.error as e:
            self.kill()
            self.close_pipes()
            raise self.error(f"{e}; its stderr:\n{self.log_text()}") from None

    def send(self, cmd: str, **args: Any) -> None:
        """Writes one command (``{"cmd": cmd, **args}``) without waiting for its answer."""
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write((json.dumps({"cmd": cmd, **args}) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise self.error(f"{self.label} exited ({self.proc.poll()}) before command {cmd!r}") from None

    def read_line(self, timeout_s: float) -> dict[str, Any]:
        """The next answer; ``error`` if none comes within ``timeout_s`` or the child exits first."""
        deadline = time.monotonic() + timeout_s
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not self._selector.select(left):
                raise self.error(f"{self.label} (pid {self.proc.pid}) did not answer within {timeout_s} s")
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                code = self.proc.wait(timeout=5)
                raise self.error(f"{self.label} (pid {self.proc.pid}) exited with {code} without answering")
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        out: dict[str, Any] = json.loads(line)
        return out

    def is_alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL, then reap (bounded)."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def close_pipes(self) -> None:
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None and not stream.closed:
                stream.close()
        self._selector.close()

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError as e:
            return f"(no log: {e})"
