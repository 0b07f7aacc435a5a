"""MasterServer: puts a MasterService on the network. Framed TCP for RPC, HTTP for metrics.

One asyncio event loop does everything: each client connection's frames (see ``protocol``) are
handled as they arrive, one reply per request, in order; after a request the loop busy-polls its
sockets for ``busy_poll_us`` before sleeping (a client in a request loop sends the next one
within microseconds, and waking a sleeping vCPU costs tens of them); the housekeeping timer runs
between requests, and a tiny HTTP server answers ``/metrics`` (Prometheus text) and
``/health`` (JSON). ``run_master`` serves in the foreground (the CLI); ``MasterServer.start()``
serves from a background thread (``tidekv up``, tests).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from typing import Any

from tidekv.config import MasterConfig
from tidekv.errors import ConfigError
from tidekv.store import protocol as p
from tidekv.store.master import MasterService

logger = logging.getLogger(__name__)


class MasterServer:
    """Serves one MasterService. Addresses are known once ``start()`` (or ``serve()``) bound them."""

    def __init__(self, config: MasterConfig) -> None:
        self.config = config
        self.service = MasterService(config)
        self.rpc_port = 0
        self.metrics_port = 0
        self._rpc: asyncio.Server | None = None
        self._spin_until = 0.0
        self._spinning = False
        # A memory guard only, far above the configured limit: a frame between the two gets a
        # clear "oversized" reply; a longer one closes its connection.
        self._max_frame = 2 * config.max_message_bytes + (1 << 20)
        self._connections: set[asyncio.Transport] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    @property
    def address(self) -> str:
        """Where clients connect: "host:port"."""
        return f"{self.config.host}:{self.rpc_port}"

    # ---- lifecycle ----------------------------------------------------------------------

    def start(self) -> MasterServer:
        """Serves from a daemon thread; returns once listening. Raises ConfigError if it cannot bind."""
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), name="tidekv-master", daemon=True)
        self._thread.start()
        self._ready.wait(timeout=30)
        if self._error is not None:
            raise self._error
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stopped is not None:
            self._loop.call_soon_threadsafe(self._stopped.set)
        if self._thread is not None:
            self._thread.join(timeout=10)

    def serve_forever(self) -> None:
        """Serves in the calling thread until interrupted."""
        asyncio.run(self._main())

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()
        http = None
        try:
            self._rpc = await self._loop.create_server(lambda: _Connection(self), self.config.host, self.config.port)
            self.rpc_port = self._rpc.sockets[0].getsockname()[1]
            if self.config.metrics_port >= 0:
                http = await asyncio.start_server(self._http, self.config.host, self.config.metrics_port)
                self.metrics_port = http.sockets[0].getsockname()[1]
        except BaseException as exc:  # noqa: BLE001 - reported to start()'s caller
            reason = f"master cannot listen on {self.config.host}:{self.config.port}: {exc}"
            self._error = exc if isinstance(exc, ConfigError) else ConfigError(reason)
            self._ready.set()
            if self._rpc is not None:
                self._rpc.close()
            return
        tick = asyncio.ensure_future(self._ticker())
        logger.info(
            "tidekv master %s listening on %s (metrics http port %s)",
            self.service.master_id,
            self.address,
            self.metrics_port if http else "off",
        )
        self._ready.set()
        try:
            await self._stopped.wait()
        finally:
            tick.cancel()
            self._rpc.close()
            for transport in list(self._connections):
                transport.close()
            if http is not None:
                http.close()
            logger.info("tidekv master stopped")

    # ---- RPC ----------------------------------------------------------------------------

    def _handled(self) -> None:
        """Keeps the loop polling (not sleeping) for busy_poll_us after a request."""
        spin_s = self.config.busy_poll_us * 1e-6
        if spin_s <= 0:
            return
        self._spin_until = time.perf_counter() + spin_s
        if not self._spinning:
            self._spinning = True
            assert self._loop is not None
            self._loop.call_soon(self._spin)

    def _spin(self) -> None:
        # While a callback is ready the loop polls its sockets without blocking.
        if time.perf_counter() < self._spin_until:
            assert self._loop is not None
            self._loop.call_soon(self._spin)
        else:
            self._spinning = False

    async def _ticker(self) -> None:
        while True:
            await asyncio.sleep(self.config.tick_s)
            try:
                self.service.tick()
            except Exception:  # noqa: BLE001 - housekeeping must not die with one bad state
                logger.exception("master housekeeping failed")

    # ---- HTTP ---------------------------------------------------------------------------

    async def _http(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(reader.readline(), timeout=5)
            while (await asyncio.wait_for(reader.readline(), timeout=5)) not in (b"\r\n", b"\n", b""):
                pass
            parts = request.decode("latin-1").split()
            path = parts[1] if len(parts) >= 2 else "/"
            status, ctype, body = self._http_route(path)
            head = f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            writer.write(head.encode() + body)
            await writer.drain()
        except (asyncio.TimeoutError, ConnectionError, UnicodeDecodeError):
            pass
        finally:
            writer.close()

    def _http_route(self, path: str) -> tuple[str, str, bytes]:
        path = path.split("?", 1)[0]
        if path == "/metrics":
            return "200 OK", "text/plain; version=0.0.4; charset=utf-8", self.service.metrics.render().encode()
        if path == "/health":
            stats: dict[str, Any] = self.service.stats()
            body = {"status": "ok", "master": self.address, **stats}
            return "200 OK", "application/json", json.dumps(body).encode()
        return "404 Not Found", "text/plain", b"not found: try /metrics or /health\n"


def run_master(config: MasterConfig) -> None:
    """Serves a master in the foreground until SIGINT/SIGTERM."""
    MasterServer(config).serve_forever()


class _Connection(asyncio.Protocol):
    """One client connection: checks the magic, then answers each whole frame in order."""

    def __init__(self, server: MasterServer) -> None:
        self._server = server
        self._handle = server.service.handle
        self._buf = bytearray()
        self._greeted = False
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        self._server._connections.add(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._transport is not None:
            self._server._connections.discard(self._transport)

    # A client that does not read its replies stops being read from (its requests wait in the
    # kernel), so the master's memory does not grow with replies nobody collects.
    def pause_writing(self) -> None:
        assert self._transport is not None
        self._transport.pause_reading()

    def resume_writing(self) -> None:
        assert self._transport is not None
        self._transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        if not self._greeted:
            if len(buf) < len(p.MAGIC):
                return
            if buf[: len(p.MAGIC)] != p.MAGIC:
                self._refuse(f"sent {bytes(buf[:8])!r}, not a tidekv store client's greeting (an older tidekv "
                             "speaking ZeroMQ, or another service?)")
                return
            del buf[: len(p.MAGIC)]
            self._greeted = True
        assert self._transport is not None
        start, end, answered = 0, len(buf), False
        while end - start >= p.FRAME_HEADER:
            size = int.from_bytes(buf[start: start + p.FRAME_HEADER], "little")
            if size > self._server._max_frame:
                self._refuse(f"sent a frame of {size} bytes, beyond any request the master accepts")
                return
            if end - start - p.FRAME_HEADER < size:
                break
            payload = bytes(buf[start + p.FRAME_HEADER: start + p.FRAME_HEADER + size])
            start += p.FRAME_HEADER + size
            self._transport.write(p.frame(self._handle(payload)))
            answered = True
        del buf[:start]
        if answered:
            self._server._handled()

    def _refuse(self, why: str) -> None:
        assert self._transport is not None
        peer = self._transport.get_extra_info("peername")
        logger.warning("closed the connection from %s: it %s", peer, why)
        self._buf.clear()
        self._transport.close()

