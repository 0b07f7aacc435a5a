"""A private network namespace for a benchmark process whose peers bind every interface.

Mooncake's transfer engine binds its handshake and data ports to 0.0.0.0 whatever host it is
given, so a benchmark that runs it would open those ports to the network. ``enter_loopback_netns``
moves the calling process (and every process it starts afterwards) into a network namespace of
its own, as ``unshare -n`` does, and brings its loopback interface up: 127.0.0.1 works, nothing
outside the namespace can reach in. Pipes and files are unaffected, so a parent that talks to
the process over stdin/stdout or a multiprocessing pipe keeps talking to it.

Needs CAP_SYS_ADMIN (root, as in CI) and no threads yet in the caller (call it first thing).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import os
import socket
import struct

from tidekv.errors import ConfigError

logger = logging.getLogger(__name__)

_CLONE_NEWNET = 0x40000000
_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1
_IFREQ = "16sH14x"  # struct ifreq: the name, then ifr_flags in the union


def enter_loopback_netns() -> None:
    """Moves this process into a new network namespace with only ``lo``, and brings ``lo`` up.

    Raises:
        ConfigError: the kernel refused (not root / no CAP_SYS_ADMIN, or namespaces disabled);
            the message names the reason.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(_CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        hint = " (needs root or CAP_SYS_ADMIN)" if err == errno.EPERM else ""
        raise ConfigError(f"unshare(CLONE_NEWNET) failed: {os.strerror(err)}{hint}; cannot give this process a "
                          "network namespace of its own")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack(_IFREQ, b"lo", 0)
        flags = struct.unpack(_IFREQ, fcntl.ioctl(s.fileno(), _SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(s.fileno(), _SIOCSIFFLAGS, struct.pack(_IFREQ, b"lo", flags | _IFF_UP))
    logger.info("pid %d: in a network namespace of its own, loopback only", os.getpid())


def interfaces() -> list[str]:
    """The names of the network interfaces this process's namespace has (``["lo"]`` once inside)."""
    return [name for _, name in socket.if_nameindex()]
