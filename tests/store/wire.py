"""Raw ``tidekv.channel`` connections for tests that speak to a server byte by byte (the store's
master by default; the weights publisher and the PD hold table with their magic and label)."""

from __future__ import annotations

import socket

from tidekv.auth import ClientHandshake
from tidekv.store.wire import protocol as p


def recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        assert chunk, "the server closed the connection"
        data += chunk
    return data


def recv_frame(sock: socket.socket) -> bytes:
    return recv_exact(sock, int.from_bytes(recv_exact(sock, p.FRAME_HEADER), "little"))


def authenticate(sock: socket.socket, secret: str | None = None, magic: bytes = p.MAGIC,
                 label: str = "master") -> None:
    """Greets the server on a fresh connection and proves ``secret`` (any proof without one), as
    ``channel.Client`` does; the connection is ready for requests afterwards."""
    handshake = ClientHandshake(secret, label, "test server")
    sock.sendall(magic + p.frame(handshake.greeting()))
    sock.sendall(p.frame(handshake.challenged(recv_frame(sock))))


def connect(address: str, secret: str | None = None, timeout_s: float = 5.0) -> socket.socket:
    """A raw connection to the master at ``address``, authenticated."""
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=timeout_s)
    authenticate(sock, secret)
    return sock
