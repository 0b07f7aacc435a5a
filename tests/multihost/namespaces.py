"""The kernel's namespaces as the multi-host rig uses them: ``ip`` commands, the processes inside a
network namespace (found through /proc and killed through pidfds), and what rigs of dead test
processes left behind (namespaces, their processes, their files in ``RUN_DIR``).

Every name a rig gives starts with ``PREFIX`` and the hex pid of the process that made it, which
is how ``remove_stale_rigs`` tells a crashed run's leftovers from a live rig of another pytest
worker (leftovers whose maker's pid went to a new process wait until that one ends too). Rigs
are made, and leftovers removed, under ``machine_lock()``. Neighbours: ``rig.py``
(builds rigs with these), ``test_rig.py``.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

PREFIX = "tkv"
"""Every rig's namespace, bridge and veth names start with it, then the maker's pid in hex and a dash."""
RUN_DIR = Path("/run/tidekv-multihost")
"""The machine-wide lock, and each rig's small files (``<netns>.boot_id``)."""
LOCK_PATH = RUN_DIR / "lock"
COMMAND_TIMEOUT_S = 10.0
"""How long one ``ip`` command may take."""
LOCK_TIMEOUT_S = 60.0
"""How long ``machine_lock()`` waits for another process to let go of it."""
KILL_TIMEOUT_S = 10.0
"""How long killed processes have to be gone."""
_MAKER_RE = re.compile(rf"^{PREFIX}([0-9a-f]+)-")
_PF_EXITING = 0x4


class RigError(RuntimeError):
    """A rig could not be made, used or taken down; the message quotes the failed command's stderr."""


def ip(*args: str) -> str:
    """Runs ``ip ARGS`` and returns its stdout.

    Raises:
        RigError: it failed or took longer than ``COMMAND_TIMEOUT_S``; names the command and its stderr.
    """
    cmd = ["ip", *args]
    logger.debug("%s", " ".join(cmd))
    try:
        done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise RigError(f"`{' '.join(cmd)}` did not finish within {COMMAND_TIMEOUT_S} s") from None
    if done.returncode != 0:
        raise RigError(f"`{' '.join(cmd)}` failed (exit {done.returncode}): {done.stderr.strip()}")
    return done.stdout


def netns_names() -> list[str]:
    """The named network namespaces (``ip netns list``)."""
    return [line.split()[0] for line in ip("netns", "list").splitlines() if line.strip()]


def is_alive(pid: int) -> bool:
    """Whether ``pid`` runs here: a zombie does not, nor a process already exiting (a pod's init
    killed with its pod stays exiting until this machine's init reaps the pod's orphans)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except (FileNotFoundError, ProcessLookupError):  # gone before, or while, it was read
        return False
    return fields[0] != "Z" and not int(fields[6]) & _PF_EXITING


def pids_in_netns(names: Iterable[str]) -> set[int]:
    """The processes (pids in this PID namespace) whose network namespace is one of ``names``."""
    inodes = _netns_inodes(names)
    return {pid for pid in _all_pids() if _netns_of(pid) in inodes}


def kill_netns_processes(names: Iterable[str]) -> set[int]:
    """SIGKILLs every process in the named network namespaces until none is left there; returns them.

    Each kill goes through a pidfd opened before the process's namespace is checked, so that a
    pid reused by an unrelated process in the meantime is never signalled.

    Raises:
        RigError: processes were still there ``KILL_TIMEOUT_S`` later.
    """
    names = list(names)
    inodes = _netns_inodes(names)
    killed: set[int] = set()
    deadline = time.monotonic() + KILL_TIMEOUT_S
    while pids := {pid for pid in _all_pids() if _netns_of(pid) in inodes}:
        if time.monotonic() > deadline:
            raise RigError(f"processes {sorted(pids)} still run in {', '.join(names)} {KILL_TIMEOUT_S} s after SIGKILL")
        for pid in pids:
            try:
                pidfd = os.pidfd_open(pid)
            except ProcessLookupError:
                continue
            try:
                if _netns_of(pid) in inodes:
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                    killed.add(pid)
            except ProcessLookupError:
                pass
            finally:
                os.close(pidfd)
        time.sleep(0.005)
    return killed


def wait_gone(pids: Iterable[int], what: str) -> None:
    """Waits until none of ``pids`` runs.

    Raises:
        RigError: some still ran ``KILL_TIMEOUT_S`` later; ``what`` says whose they are.
    """
    deadline = time.monotonic() + KILL_TIMEOUT_S
    while left := [pid for pid in pids if is_alive(pid)]:
        if time.monotonic() > deadline:
            raise RigError(f"{what}: processes {left} still run {KILL_TIMEOUT_S} s after SIGKILL")
        time.sleep(0.005)


@contextlib.contextmanager
def machine_lock() -> Iterator[None]:
    """Holds the machine-wide lock under which rigs are made and stale ones removed.

    Raises:
        RigError: another process held it for ``LOCK_TIMEOUT_S``.
    """
    RUN_DIR.mkdir(mode=0o700, exist_ok=True)
    fd = os.open(LOCK_PATH, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        deadline = time.monotonic() + LOCK_TIMEOUT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise RigError(f"{LOCK_PATH} stayed locked by another rig maker for {LOCK_TIMEOUT_S} s") from None
                time.sleep(0.01)
        yield
    finally:
        os.close(fd)


def rig_netns_names() -> list[str]:
    """The network namespaces of every rig on this machine, live or stale."""
    return [name for name in netns_names() if _MAKER_RE.match(name)]


def remove_stale_rigs() -> list[str]:
    """Kills the processes in, and deletes, every rig namespace (and file in ``RUN_DIR``) whose
    maker is dead; call it under ``machine_lock()``. Deleting a switch namespace takes its bridge
    and veths along.

    Returns:
        The names deleted.
    """
    stale = [name for name in netns_names() if _is_stale(name)]
    if stale:
        logger.info("removing the namespaces of rigs whose maker is dead: %s", " ".join(stale))
        wait_gone(kill_netns_processes(stale), f"stale rigs {' '.join(stale)}")
        for name in stale:
            ip("netns", "del", name)
    for path in RUN_DIR.iterdir():
        if _is_stale(path.name):
            path.unlink(missing_ok=True)
            stale.append(str(path))
    return stale


def _is_stale(name: str) -> bool:
    maker = _MAKER_RE.match(name)
    return maker is not None and not is_alive(int(maker[1], 16))


def _netns_inodes(names: Iterable[str]) -> set[tuple[int, int]]:
    inodes = set()
    for name in names:
        with contextlib.suppress(FileNotFoundError):
            st = os.stat(f"/run/netns/{name}")
            inodes.add((st.st_dev, st.st_ino))
    return inodes


def _all_pids() -> list[int]:
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]


def _netns_of(pid: int) -> tuple[int, int] | None:
    try:
        st = os.stat(f"/proc/{pid}/ns/net")
    except OSError:  # gone, or a zombie (no namespaces left)
        return None
    return st.st_dev, st.st_ino
