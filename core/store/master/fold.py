"""A lone master's fold of its journal, written by a forked child (Redis's way).

The master's loop cuts its ``JournalFile`` to a new log and forks; the child writes the snapshot
of the index as it was at the fork and exits; the loop, told by a pidfd, reaps it and lets the
journal drop what the snapshot replaces. Neighbours: ``journal`` (the files and the chain a
restart replays), ``server`` (starts folds and watches them).
Design notes: docs/store-design.md#tidekvstoremasterjournal
"""

from __future__ import annotations

import gc
import os
import resource
import signal
import time
import traceback
from collections.abc import Callable, Iterable
from typing import NoReturn

from tidekv.store.master.journal import JournalFile, Op


class Fold:
    """A fold whose snapshot a forked child writes (Redis's way): the master's loop pays only
    the cut and the fork, not the snapshot. The child holds the index as it was at the fork
    (copy-on-write; pages the parent changes meanwhile are copied, so a fold may take up to the
    index's memory again) while the parent appends to the new log. Construct it on the writer's
    thread between two batches; ``finish`` once ``pidfd`` is readable (the child exited)."""

    def __init__(self, journal: JournalFile, snapshot: Callable[[], Iterable[Op]]) -> None:
        """Raises OSError if the fork fails (the cut stands: the next fold starts over)."""
        self.journal = journal
        self.generation = journal.cut()
        self.started = time.perf_counter()
        self.pid = os.fork()
        if self.pid == 0:
            self._child(snapshot)
        self.forked_s = time.perf_counter() - self.started
        try:
            self.pidfd = os.pidfd_open(self.pid)
        except OSError:  # a kernel before 5.3: the caller waits on finish() instead
            self.pidfd = -1
        self.seconds = 0.0  # from the cut to the child's end, once finished
        self.exit_code: int | None = None

    def _child(self, snapshot: Callable[[], Iterable[Op]]) -> NoReturn:
        code = 1
        try:
            gc.disable()  # the index is all there is to walk, and it is walked once
            # The parent's sockets (its port, its clients' connections) must close when the
            # parent closes them, not when this child exits.
            os.closerange(3, resource.getrlimit(resource.RLIMIT_NOFILE)[1])
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, signal.SIG_DFL)
            self.journal.write_snapshot(self.generation, snapshot())
            code = 0
        except BaseException:  # noqa: BLE001 - reported on stderr; the parent sees the exit code
            os.write(2, f"tidekv master fold child: {traceback.format_exc()}".encode())
        finally:
            os._exit(code)

    def finish(self) -> bool:
        """Reaps the child (waiting for it if it still runs); True if it wrote the snapshot, which
        then becomes the journal's current one. False keeps the chain as it was (older snapshot,
        every log since): nothing is lost, the next fold starts over."""
        _, status = os.waitpid(self.pid, 0)
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1
        self.seconds = time.perf_counter() - self.started
        self.exit_code = os.waitstatus_to_exitcode(status)
        if self.exit_code != 0:
            (self.journal.dir / f"snapshot.{self.generation}.tmp").unlink(missing_ok=True)
            return False
        self.journal.folded(self.generation)
        return True

    def kill(self) -> None:
        """Stops the child (the writer is stopping) and reaps it; the chain stays consistent."""
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.finish()
