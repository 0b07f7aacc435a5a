"""How an engine learns a peer's descriptor from its name.

``PeerDirectory`` is the interface; ``DirectDirectory`` (the default) asks the peer itself over
a handshake on its port, so no metadata server is needed. A cluster directory (etcd) implements
the same two methods. Neighbours: ``engine.TransferEngine`` calls ``lookup`` on first use of a
peer name and ``publish`` at start.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from tidekv import _native


class PeerDirectory(Protocol):
    """Maps engine names ("host:port") to opaque descriptors. Implementations are thread-safe."""

    def publish(self, name: str, descriptor: bytes) -> None:
        """Makes this engine's descriptor findable under its name."""

    def lookup(self, name: str) -> bytes:
        """Returns the descriptor of engine ``name``.

        Raises:
            PeerUnavailableError: nobody answers for that name.
            ProtocolVersionError, AuthenticationError: the peer refused the handshake.
        """


class DirectDirectory:
    """Asks the peer directly: connect to host:port, handshake, receive its descriptor."""

    def __init__(self, native: _native.Engine) -> None:
        self._native = native

    def publish(self, name: str, descriptor: bytes) -> None:
        """Nothing to do: the engine's listener answers for itself."""

    def lookup(self, name: str) -> bytes:
        from tidekv.config import parse_host_port

        host, port = parse_host_port(name, "peer name")
        return self._native.fetch_descriptor(host, port)
