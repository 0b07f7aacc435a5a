"""Helper processes: peers that a bench or the doctor's self-test drives, each a separate process.

A helper is a top-level function ``main(conn, *args)`` started with multiprocessing's *spawn*
method (a fresh interpreter, no state inherited from its driver). It answers over a pipe: first
``send_ready(conn, info)``, then ``serve(conn, handler)`` answers calls until told to stop. Its
stdout and stderr go to a log file, which error messages quote (native libraries such as
Mooncake's log to stderr and would otherwise tear a progress bar). Neighbours: the self-test's
target in ``tidekv.doctor.selftest``; the benches' targets (``transfer``, ``baselines``,
``mooncake_te``, ...).

Ownership: ``HelperProcess`` owns its process; ``stop()`` (or leaving the ``with`` block) ends it.
As with any spawn start, a script that starts helpers needs the ``if __name__ == "__main__":``
guard (the ``tidekv`` command and pytest have it).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from tidekv.errors import TidekvError

logger = logging.getLogger(__name__)

_POLL_S = 0.2
_LOG_TAIL_BYTES = 4000


def _entry(main: Callable[..., None], log_path: str, conn: Connection, args: tuple[Any, ...]) -> None:
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115  (lives as long as the process)
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        main(conn, *args)
    except BaseException:
        text = traceback.format_exc()
        sys.stderr.write(text)
        with contextlib.suppress(OSError, EOFError):  # the driver may be gone already
            conn.send(("error", text))
        raise


def send_ready(conn: Connection, info: Any) -> None:
    """Called by a helper once it is ready: ``info`` is what the driver receives as ``hello``."""
    conn.send(("ready", info))


def serve(conn: Connection, handler: Callable[[Any], Any] | None = None) -> None:
    """Answers calls with ``handler(message)`` until the driver says stop or goes away.

    A handler's exception is sent back as an error (the driver raises it) and serving goes on.
    """
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message is None:
            return
        if handler is None:
            conn.send(("error", f"this helper takes no calls (got {message!r})"))
            continue
        try:
            conn.send(("ok", handler(message)))
        except Exception:
            conn.send(("error", traceback.format_exc()))


class HelperProcess:
    """A running helper process and its driver's end of the pipe.

    Args:
        name: short name for logs and errors (also the log file's stem).
        main: the helper's top-level function, ``main(conn, *args)``.
        args: picklable arguments after ``conn``.
        log_dir: folder for ``<name>.log``.
        ready_timeout_s: how long to wait for ``send_ready``.

    Raises:
        TidekvError: the helper died or reported an error before it was ready, or timed out.
    """

    def __init__(self, name: str, main: Callable[..., None], args: tuple[Any, ...], log_dir: str | Path,
                 ready_timeout_s: float = 60.0) -> None:
        self.name = name
        self.log_path = Path(log_dir) / f"{name}.log"
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(target=_entry, args=(main, str(self.log_path), child, args),
                                    name=f"tidekv-helper-{name}", daemon=True)
        self._process.start()
        child.close()
        try:
            self.hello: Any = self._receive(ready_timeout_s, "ready")
        except BaseException:
            self.stop()
            raise
        logger.info("helper %s started (pid %s)", name, self._process.pid)

    @property
    def pid(self) -> int | None:
        """The helper's process id (None before it started)."""
        return self._process.pid

    def call(self, message: Any, timeout_s: float) -> Any:
        """Sends ``message`` to the helper's handler and returns its answer.

        Raises:
            TidekvError: the handler raised, the helper died, or no answer came within timeout_s.
        """
        self._conn.send(message)
        return self._receive(timeout_s, "ok")

    def send(self, message: Any) -> None:
        """Sends ``message`` without waiting; ``receive`` reads the answer (helpers then work in parallel)."""
        self._conn.send(message)

    def receive(self, timeout_s: float) -> Any:
        """The answer to the last ``send``; raises as ``call`` does."""
        return self._receive(timeout_s, "ok")

    def kill(self) -> None:
        """SIGKILL (a crash), then reaps the process."""
        if self._process.pid is not None and self._process.is_alive():
            os.kill(self._process.pid, signal.SIGKILL)
        self._process.join(10)
        self._conn.close()

    def pause(self) -> None:
        """Stops every thread of the helper (SIGSTOP) until ``resume()``: a helper that spins while
        idle (a UCX agent's progress thread) then takes no CPU from what is measured meanwhile."""
        if self._process.is_alive() and self._process.pid is not None:
            os.kill(self._process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """Lets a paused helper run again (SIGCONT); harmless on one that runs."""
        if self._process.is_alive() and self._process.pid is not None:
            os.kill(self._process.pid, signal.SIGCONT)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Asks the helper to exit; terminates it if it does not within timeout_s. Idempotent."""
        self.resume()
        if self._process.is_alive():
            with contextlib.suppress(OSError, ValueError):
                self._conn.send(None)
            self._process.join(timeout_s)
        if self._process.is_alive():
            logger.warning("helper %s (pid %s) did not exit; terminating it", self.name, self._process.pid)
            self._process.terminate()
            self._process.join(timeout_s)
        with contextlib.suppress(OSError):
            self._conn.close()

    def log_tail(self) -> str:
        """The last lines of the helper's log ("" when it wrote none)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - _LOG_TAIL_BYTES))
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def __enter__(self) -> HelperProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _receive(self, timeout_s: float, expected: str) -> Any:
        deadline = time.monotonic() + timeout_s
        while not self._conn.poll(_POLL_S):
            if not self._process.is_alive() and not self._conn.poll(0):
                raise self._failure(f"exited with code {self._process.exitcode}")
            if time.monotonic() > deadline:
                raise self._failure(f"did not answer within {timeout_s:.0f} s")
        try:
            kind, payload = self._conn.recv()
        except EOFError:
            raise self._failure("closed its pipe") from None
        if kind != expected:
            raise self._failure(f"reported an error:\n{payload}")
        return payload

    def _failure(self, what: str) -> TidekvError:
        return TidekvError(
            f"helper {self.name} (pid {self._process.pid}) {what}\n"
            f"--- last lines of {self.log_path} ---\n{self.log_tail()}"
        )
