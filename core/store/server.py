"""MasterServer: puts a MasterService on the network. ZeroMQ ROUTER for RPC, HTTP for metrics.

One asyncio event loop does everything: the ROUTER socket's file descriptor is watched by the
loop and drained without blocking (one reply per request, in order), the housekeeping timer
runs between batches, and a tiny HTTP server answers ``/metrics`` (Prometheus text) and
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

import zmq

from tidekv.config import MasterConfig
from tidekv.errors import ConfigError
from tidekv.store.master import MasterService

logger = logging.getLogger(__name__)

_MAX_DRAIN = 256  # requests handled per wake-up before housekeeping gets a turn


class MasterServer:
    """Serves one MasterService. Addresses are known once ``start()`` (or ``serve()``) bound them."""

    def __init__(self, config: MasterConfig) -> None:
        self.config = config
        self.service = MasterService(config)
        self.rpc_port = 0
        self.metrics_port = 0
        self._ctx = zmq.Context.instance()
        self._sock: zmq.Socket | None = None
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
            self._bind()
            if self.config.metrics_port >= 0:
                http = await asyncio.start_server(self._http, self.config.host, self.config.metrics_port)
                self.metrics_port = http.sockets[0].getsockname()[1]
        except BaseException as exc:  # noqa: BLE001 - reported to start()'s caller
            self._error = exc if isinstance(exc, ConfigError) else ConfigError(f"master cannot start: {exc}")
            self._ready.set()
            self._close_socket()
            return
        assert self._sock is not None
        fd = self._sock.getsockopt(zmq.FD)
        self._loop.add_reader(fd, self._drain)
        tick = asyncio.ensure_future(self._ticker())
        logger.info(
            "tidekv master %s listening on %s (metrics http port %s)",
            self.service.master_id,
            self.address,
            self.metrics_port if http else "off",
        )
        self._ready.set()
        self._loop.call_soon(self._drain)  # the FD is edge-triggered: pick up anything already queued
        try:
            await self._stopped.wait()
        finally:
            tick.cancel()
            self._loop.remove_reader(fd)
            if http is not None:
                http.close()
            self._close_socket()
            logger.info("tidekv master stopped")

    def _bind(self) -> None:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        # A memory guard only, far above the configured limit: a message between the two gets a
        # clear "oversized" reply; one beyond this is dropped by ZeroMQ with its connection.
        sock.setsockopt(zmq.MAXMSGSIZE, 2 * self.config.max_message_bytes + (1 << 20))
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        try:
            if self.config.port == 0:
                self.rpc_port = sock.bind_to_random_port(f"tcp://{self.config.host}")
            else:
                sock.bind(f"tcp://{self.config.host}:{self.config.port}")
                self.rpc_port = self.config.port
        except zmq.ZMQError as exc:
            sock.close()
            raise ConfigError(f"master cannot listen on {self.config.host}:{self.config.port}: {exc}") from None
        self._sock = sock

    def _close_socket(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    # ---- RPC ----------------------------------------------------------------------------

    def _drain(self) -> None:
        sock = self._sock
        if sock is None:
            return
        handle = self.service.handle
        spin_s = self.config.busy_poll_us * 1e-6
        spin_until = 0.0
        for _ in range(_MAX_DRAIN):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                # Busy-poll a little before sleeping: clients in a request loop send the next
                # request within microseconds, and waking a sleeping thread costs far more.
                now = time.perf_counter()
                if not spin_until:
                    spin_until = now + spin_s
                if now < spin_until:
                    continue
                return
            spin_until = 0.0
            if len(frames) != 2:
                logger.warning("dropped a message with %d frames (expected identity + payload)", len(frames))
                continue
            identity, payload = frames
            sock.send_multipart((identity, handle(payload)), zmq.NOBLOCK)
        # More may be queued: the edge-triggered FD will not fire again for it, so come back.
        assert self._loop is not None
        self._loop.call_soon(self._drain)

    async def _ticker(self) -> None:
        while True:
            await asyncio.sleep(self.config.tick_s)
            try:
                self.service.tick()
            except Exception:  # noqa: BLE001 - housekeeping must not die with one bad state
                logger.exception("master housekeeping failed")
            self._drain()  # zmq's FD may not wake us for messages queued while we worked

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
