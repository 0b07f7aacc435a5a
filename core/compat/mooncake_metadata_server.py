"""Mooncake's HTTP metadata server (``mooncake.http_metadata_server`` and its
``mooncake_http_metadata_server`` command): a key/value store over HTTP at ``/metadata?key=K``,
GET (200 and the bytes, or 404), PUT (200; 400 for a second PUT of a key holding "rpc_meta") and
DELETE (200, or 404); another method is 405, a missing key 400, with Mooncake's response texts.

tidekv's engines handshake directly and never ask it; it is here because deployment scripts
start it beside ``mooncake_master``. Served by the standard library (the shim needs no aiohttp);
the class keeps Mooncake's names (``KVBootstrapServer``, ``KVPoll``). Differences: it binds
127.0.0.1 unless ``--host`` (or ``host``) says otherwise (Mooncake: 0.0.0.0), and ``run()``
raises ``OSError`` when the port cannot be bound (Mooncake logs it and ``poll()`` says Failed).
Neighbours: ``tidekv.compat.mooncake_master`` (the master's command, same conventions).
"""

from __future__ import annotations

import argparse
import enum
import logging
import signal
import sys
import threading
import urllib.parse
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tidekv.hostaddr import is_loopback

logger = logging.getLogger(__name__)

PROG = "mooncake_http_metadata_server"
DEFAULT_HOST = "127.0.0.1"
"""Where the server binds unless told (Mooncake's default is 0.0.0.0)."""
DEFAULT_PORT = 8080
"""Mooncake's default port."""
PATH = "/metadata"


class KVPoll(enum.Enum):
    """``KVBootstrapServer.poll()``: Success while serving, Failed otherwise (Mooncake's enum)."""

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


class _Entries:
    """The server's keys and values; thread-safe (one request thread per connection)."""

    def __init__(self) -> None:
        self._values: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def get(self, key: str) -> tuple[int, bytes]:
        with self._lock:
            value = self._values.get(key)
        return (404, b"metadata not found") if value is None else (200, value)

    def put(self, key: str, value: bytes) -> tuple[int, bytes]:
        with self._lock:
            # A transfer engine's RPC endpoint is registered once; a second is a name clash.
            if "rpc_meta" in key and key in self._values:
                return 400, b"Duplicate rpc_meta key not allowed"
            self._values[key] = value
        return 200, b"metadata updated"

    def delete(self, key: str) -> tuple[int, bytes]:
        with self._lock:
            if self._values.pop(key, None) is None:
                return 404, b"metadata not found"
        return 200, b"metadata deleted"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: every response carries its Content-Length
    server: _Server

    def _handle(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length > 0 else b""
        if url.path != PATH:
            self._reply(404, b"404: Not Found", "text/plain")
            return
        key = urllib.parse.parse_qs(url.query).get("key", [""])[0].strip()
        entries = self.server.entries
        if not key:
            status, text = 400, b"metadata key is required"
        elif self.command == "GET":
            status, text = entries.get(key)
        elif self.command == "PUT":
            status, text = entries.put(key, body)
        elif self.command == "DELETE":
            status, text = entries.delete(key)
        else:
            status, text = 405, b"Method not allowed"
        self._reply(status, text, "application/json")

    do_GET = do_PUT = do_DELETE = do_POST = do_PATCH = do_HEAD = do_OPTIONS = _handle

    def _reply(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("%s: %s", self.address_string(), format % args)


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int]) -> None:
        super().__init__(address, _Handler)
        self.entries = _Entries()


class KVBootstrapServer:
    """The metadata server on ``host:port`` (``run()`` starts it in a thread, ``close()`` stops it)."""

    def __init__(self, port: int, host: str = DEFAULT_HOST) -> None:
        self.port = port
        self.host = host
        self.thread: threading.Thread | None = None
        self._server: _Server | None = None

    def run(self) -> threading.Thread:
        """Binds and serves in a daemon thread, which it returns; ``port`` 0 takes a free port
        (then ``port`` is the one taken).

        Raises:
            OSError: the address cannot be bound.
        """
        self._server = _Server((self.host, self.port))
        self.port = self._server.server_address[1]
        self.thread = threading.Thread(target=self._server.serve_forever, name=PROG, daemon=True)
        self.thread.start()
        logger.info("%s: serving %s on %s:%d", PROG, PATH, self.host, self.port)
        return self.thread

    def close(self) -> None:
        """Stops serving and waits for the thread (2 s at most); again is a no-op."""
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if self.thread is not None:
            self.thread.join(timeout=2)
        logger.info("%s: stopped", PROG)

    def poll(self) -> KVPoll:
        return KVPoll.Success if self.thread is not None and self.thread.is_alive() else KVPoll.Failed


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Mooncake's flags: --port, --host, --log-level."""
    parser = argparse.ArgumentParser(prog=PROG, description="HTTP metadata server for Mooncake (served by tidekv)",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="port to listen on")
    parser.add_argument("--host", default=DEFAULT_HOST, help="address to bind (Mooncake's default: 0.0.0.0)")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
                        help="logging level")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Serves until SIGINT or SIGTERM; 0, or 1 when the address cannot be bound."""
    from tidekv.logs import configure_logging

    args = parse_args(argv)
    configure_logging(args.log_level)
    if not is_loopback(args.host):
        logger.warning("%s listens on %s, beyond this host, with no authentication: anyone who reaches it can read "
                       "and overwrite its entries; tidekv's engines do not need it", PROG, args.host)
    server = KVBootstrapServer(args.port, args.host)
    try:
        server.run()
    except OSError as exc:
        print(f"{PROG}: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
