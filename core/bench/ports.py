"""Free ports for the servers that benches and tests start on this host a moment later.

Neighbours: ``etcd_server`` (its members' ports), the benches' peers (``mooncake_store``), and the
tests' masters and proxies, which all bind what ``free_port`` returns.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_FREE_PORT_TRIES = 32


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now, for a server started on ``host`` a moment later
    (a bench's peer, a test's etcd or master).

    Picked at random below the kernel's ephemeral range (``ip_local_port_range``) when it can be, so
    no outgoing connection can take it before the server binds it. Else (no room below the range, or
    every try taken) any port the kernel picks.
    Design notes: docs/design-bench.md#tidekvbenchports
    """
    try:
        low = int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    rng = random.SystemRandom()
    for _ in range(_FREE_PORT_TRIES if low > 2048 else 0):
        port = rng.randrange(max(1024, low // 2), low)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
