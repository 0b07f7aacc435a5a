"""Same-run baselines of ``bench transfer``: what the hardware gives without tidekv.

* ``MemcpyBaseline``: ``ctypes.memmove`` between two preallocated buffers in this process, the
  ceiling for the shm transport (one copy per request, by the initiator).
* ``SocketBaseline``: plain Python sockets (``sendall`` / ``recv_into``) over one loopback TCP
  connection to a server in another process, with the same socket buffer sizes and
  TCP_NODELAY. A WRITE iteration streams the requests' bytes and waits for a 1-byte ack; a READ
  iteration sends a 1-byte request and receives the bytes. With one request per iteration it is
  a ping-pong (the reference for small-op latency), with a batch it is a stream.

Both move the same ``Workload`` as the engine (sizes, counts, offsets, region size). On a
small VM, wake-up latency and memory bandwidth drift between runs, so only ratios to a baseline
of the same run mean anything. Neighbours: ``transfer`` runs them next to the engine's rows.
"""

from __future__ import annotations

import ctypes
import logging
import socket
import struct
import threading
from multiprocessing.connection import Connection
from pathlib import Path

from tidekv.bench.timing import Budget, measure
from tidekv.bench.workload import Workload
from tidekv.helper_process import HelperProcess, send_ready, serve
from tidekv.transfer.batch import TransferOp

logger = logging.getLogger(__name__)

# op, count, size_bytes, region_bytes: sent once per connection, before the timed iterations.
_SESSION = struct.Struct("<IIQQ")
_ACK = b"k"


class _Buffer:
    """A private, pre-faulted buffer with a fixed address."""

    def __init__(self, size_bytes: int, fill: int) -> None:
        self.raw = (ctypes.c_char * size_bytes)()
        self.address = ctypes.addressof(self.raw)
        self.view = memoryview(self.raw).cast("B")
        ctypes.memset(self.address, fill, size_bytes)


class MemcpyBaseline:
    """In-process memory copy of a workload's requests (READ and WRITE are the same copy).

    Args:
        region_bytes: size of each of the two buffers (the workloads' region size).
    """

    name = "memcpy"

    def __init__(self, region_bytes: int) -> None:
        self._src = _Buffer(region_bytes, 0x5A)
        self._dst = _Buffer(region_bytes, 0)
        self.region_bytes = region_bytes

    def measure(self, workload: Workload, budget: Budget) -> list[float]:
        """Latency of each timed iteration (seconds)."""
        src, dst, size = self._src.address, self._dst.address, workload.size_bytes
        pairs = [(dst + off, src + off) for off in workload.offsets()]
        memmove = ctypes.memmove
        if len(pairs) == 1:
            d, s = pairs[0]
            return measure(lambda: memmove(d, s, size), budget)

        def step() -> None:
            for d, s in pairs:
                memmove(d, s, size)

        return measure(step, budget)


def _tune(sock: socket.socket, socket_buffer_bytes: int) -> None:
    if socket_buffer_bytes > 0:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, socket_buffer_bytes)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, socket_buffer_bytes)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _recv_exact(sock: socket.socket, view: memoryview) -> bool:
    """Fills ``view``; False if the peer closed before the first byte."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            if got == 0:
                return False
            raise ConnectionError(f"peer closed after {got} of {len(view)} bytes")
        got += n
    return True


def _serve_session(sock: socket.socket, regions: dict[int, _Buffer]) -> None:
    header = bytearray(_SESSION.size)
    if not _recv_exact(sock, memoryview(header)):
        return
    op, count, size, region_bytes = _SESSION.unpack(header)
    work = Workload(TransferOp(op), size, count, region_bytes)
    if region_bytes not in regions:  # one per size, kept: faulting it in is not what we measure
        regions[region_bytes] = _Buffer(region_bytes, 0x5A)
    region = regions[region_bytes]
    views = [region.view[off:off + size] for off in work.offsets()]
    ack = bytearray(1)
    while True:
        if work.op == TransferOp.WRITE:
            if not _recv_exact(sock, views[0]):
                return
            for v in views[1:]:
                _recv_exact(sock, v)
            sock.sendall(_ACK)
        else:
            if not _recv_exact(sock, memoryview(ack)):
                return
            for v in views:
                sock.sendall(v)


def _accept_loop(listener: socket.socket, socket_buffer_bytes: int) -> None:
    regions: dict[int, _Buffer] = {}
    while True:
        sock, peer = listener.accept()
        _tune(sock, socket_buffer_bytes)
        try:
            _serve_session(sock, regions)
        except OSError as e:
            logger.warning("socket baseline session from %s failed: %s", peer, e)
        finally:
            sock.close()


def _socket_server_main(conn: Connection, socket_buffer_bytes: int) -> None:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    _tune(listener, socket_buffer_bytes)  # accepted sockets inherit the buffer sizes asked here
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    threading.Thread(target=_accept_loop, args=(listener, socket_buffer_bytes), daemon=True).start()
    send_ready(conn, listener.getsockname()[1])
    serve(conn)


class SocketBaseline:
    """Raw loopback TCP between this process and a server process (started here).

    Args:
        region_bytes: size of the client's buffer (the workloads' region size).
        socket_buffer_bytes: SO_SNDBUF/SO_RCVBUF on both ends (the engine's setting).
        log_dir: where the server process logs.

    Raises:
        TidekvError: the server process could not be started.
    """

    def __init__(self, region_bytes: int, socket_buffer_bytes: int, log_dir: str | Path) -> None:
        self.socket_buffer_bytes = socket_buffer_bytes
        self._region = _Buffer(region_bytes, 0x5A)
        self._server = HelperProcess("socket-server", _socket_server_main, (socket_buffer_bytes,), log_dir)
        self.port: int = self._server.hello

    def measure(self, workload: Workload, budget: Budget) -> list[float]:
        """Latency of each timed iteration (seconds), over a fresh connection.

        Raises:
            OSError: the connection failed (the server's log has details).
        """
        with socket.create_connection(("127.0.0.1", self.port), timeout=60) as sock:
            # Plain blocking calls: a timeout would add a poll() to every recv. A dead server still
            # ends the wait, because the kernel closes its socket.
            sock.settimeout(None)
            _tune(sock, self.socket_buffer_bytes)
            sock.sendall(_SESSION.pack(int(workload.op), workload.count, workload.size_bytes, workload.region_bytes))
            views = [self._region.view[off:off + workload.size_bytes] for off in workload.offsets()]
            ack = memoryview(bytearray(1))
            if workload.op == TransferOp.WRITE:

                def step() -> None:
                    for v in views:
                        sock.sendall(v)
                    _recv_exact(sock, ack)

            else:

                def step() -> None:
                    sock.sendall(_ACK)
                    for v in views:
                        _recv_exact(sock, v)

            return measure(step, budget)

    def close(self) -> None:
        """Stops the server process."""
        self._server.stop()
