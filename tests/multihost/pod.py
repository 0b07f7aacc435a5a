"""A pod's two programs: its init (PID 1, owner of its /dev/shm) and the shim that runs a command in it.

A pod host of ``rig.Rig`` is one set of namespaces that every process started there shares, as
the containers of one Kubernetes pod do: network (the host's), PID, IPC and mount, the mount
namespace with a fresh tmpfs on ``/dev/shm`` and its node's boot id. ``rig.PodHost`` makes them
once by running ``ip netns exec NS unshare --pid --fork --mount --mount-proc --ipc --kill-child --
python -I pod.py init BOOT_ID_FILE``: that ``unshare`` process (the pod's *anchor*) holds the
namespaces, and its child, this init, is PID 1 of the new PID namespace. When either dies, the
kernel kills every process of the pod.

``pod.py exec NETNS ANCHOR_PID -- ARGV...`` (``PodHost.command``) enters the anchor's namespaces
and runs ARGV as its child, so that ARGV sees the pod's PIDs, /dev/shm and /proc. Unlike
``nsenter`` it forwards the usual termination signals to ARGV, kills ARGV when it is killed itself
(``PR_SET_PDEATHSIG``) and exits as ARGV did, so that a ``Popen`` of it behaves as one of ARGV.

Both run under ``python -I`` (stdlib only, no project on the path). Neighbours: ``rig.py``
(starts them), ``test_rig.py`` (checks what a pod's process sees).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from typing import NoReturn

READY_LINE = "ready"
"""What the init prints on stdout once /dev/shm is mounted; ``rig.PodHost`` waits for it."""
BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
_MS_NOSUID = 0x2
_MS_NODEV = 0x4
_MS_BIND = 0x1000
_PR_SET_PDEATHSIG = 1
_FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
_NAMESPACES = ("net", "ipc", "pid_for_children", "mnt")
"""Opened first, then entered in this order: entering ``mnt`` changes what /proc shows."""

_libc = ctypes.CDLL(None, use_errno=True)


def _fail(message: str) -> NoReturn:
    print(f"pod.py: {message}", file=sys.stderr, flush=True)
    os._exit(127)


def init(boot_id_file: str) -> NoReturn:
    """Mounts a fresh tmpfs on /dev/shm and ``boot_id_file`` over the kernel's boot id, says
    ``ready``, then reaps orphans until SIGTERM or SIGINT.

    The rig ends a pod with SIGKILL, which takes its whole PID namespace with it.
    """
    if os.getpid() != 1:  # anywhere else, the mounts below would cover this machine's own
        _fail(f"init runs as PID 1 of a new PID and mount namespace, not as pid {os.getpid()}")
    if _libc.mount(b"tmpfs", b"/dev/shm", b"tmpfs", _MS_NOSUID | _MS_NODEV, b"mode=1777") != 0:
        _fail(f"mounting a tmpfs on /dev/shm: {os.strerror(ctypes.get_errno())}")
    if _libc.mount(boot_id_file.encode(), BOOT_ID_PATH.encode(), None, _MS_BIND, None) != 0:
        _fail(f"mounting {boot_id_file} over {BOOT_ID_PATH}: {os.strerror(ctypes.get_errno())}")
    # Blocked rather than handled: PID 1 gets no default action for them, and sigwaitinfo takes
    # them without the race between a reap and a pause().
    waited = {signal.SIGCHLD, signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, waited)
    print(READY_LINE, flush=True)
    while signal.sigwaitinfo(waited).si_signo == signal.SIGCHLD:
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
    sys.exit(0)


def exec_in(netns: str, anchor_pid: int, argv: list[str]) -> NoReturn:
    """Runs ``argv`` in the pod whose namespaces ``anchor_pid`` holds; exits as ``argv`` did."""
    cwd = os.getcwd()
    try:
        fds = [os.open(f"/proc/{anchor_pid}/ns/{name}", os.O_RDONLY) for name in _NAMESPACES]
        anchor_net, named_net = os.stat(f"/proc/{anchor_pid}/ns/net"), os.stat(f"/run/netns/{netns}")
        is_anchor = (anchor_net.st_dev, anchor_net.st_ino) == (named_net.st_dev, named_net.st_ino)
    except OSError as e:
        _fail(f"pod of {netns} (anchor pid {anchor_pid}) is gone: {e}")
    if not is_anchor:  # the anchor died and its pid went to an unrelated process
        _fail(f"pid {anchor_pid} is not in network namespace {netns}: its pod is gone")
    for name, fd in zip(_NAMESPACES, fds):
        if _libc.setns(fd, 0) != 0:
            _fail(f"entering the {name} namespace of pid {anchor_pid}: {os.strerror(ctypes.get_errno())}")
        os.close(fd)
    os.chdir(cwd)  # entering a mount namespace moves the cwd to its root
    signal.pthread_sigmask(signal.SIG_BLOCK, _FORWARDED_SIGNALS)
    child = os.fork()
    if child == 0:
        _libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
        if os.getppid() != 0:  # the shim (outside this PID namespace, so seen as 0) is gone already
            os._exit(128 + signal.SIGKILL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _FORWARDED_SIGNALS)
        try:
            os.execvp(argv[0], argv)
        except OSError as e:
            _fail(f"cannot run {argv[0]!r}: {e}")
    for sig in _FORWARDED_SIGNALS:
        signal.signal(sig, lambda signum, _frame: os.kill(child, signum))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _FORWARDED_SIGNALS)
    _, status = os.waitpid(child, 0)
    code = os.waitstatus_to_exitcode(status)
    if code < 0:  # die of the same signal: the caller's Popen.returncode is then -signal, as for argv
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code if code >= 0 else 128 - code)


def main(args: list[str]) -> NoReturn:
    if len(args) == 2 and args[0] == "init":
        init(args[1])
    if len(args) >= 5 and args[0] == "exec" and args[3] == "--":
        exec_in(args[1], int(args[2]), args[4:])
    _fail(f"usage: pod.py init BOOT_ID_FILE | pod.py exec NETNS ANCHOR_PID -- ARGV...; got {args}")


if __name__ == "__main__":
    main(sys.argv[1:])
