"""MasterChannel: a client's request/reply channel to the master over a ZeroMQ DEALER socket.

Thread-safe (one call at a time). Every call carries a request id; a reply that arrives after
its call timed out is recognised and dropped. Errors come back typed: MasterUnavailableError on
timeout, ProtocolVersionError on version skew, ConfigError for a refused argument.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import Any

import msgspec
import zmq

from tidekv.errors import ConfigError, MasterUnavailableError, ProtocolVersionError, RpcError
from tidekv.store import protocol as p

logger = logging.getLogger(__name__)

class MasterChannel:
    def __init__(self, address: str, client_id: str, timeout_s: float) -> None:
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ConfigError(f"master address {address!r} is not of the form host:port")
        self.address = address
        self.client_id = client_id
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(f"tcp://{address}")
        self._closed = False
        self.max_message_bytes: int | None = None  # learned from the master's hello reply

    def call(self, body: msgspec.Struct, timeout_s: float | None = None) -> Any:
        """Sends one request and returns its result.

        Raises:
            MasterUnavailableError: no reply within the timeout.
            ProtocolVersionError: the master speaks another protocol version.
            ConfigError: the master refused an argument.
            RpcError: the master found the request malformed.
        """
        limit = self.timeout_s if timeout_s is None else timeout_s
        with self._lock:
            if self._closed:
                raise MasterUnavailableError("store client is closed")
            request_id = next(self._ids)
            data = p.encode(p.Envelope(p.PROTOCOL_VERSION, request_id, body))
            if self.max_message_bytes is not None and len(data) > self.max_message_bytes:
                raise ConfigError(
                    f"{type(body).__name__} request of {len(data)} bytes exceeds master {self.address}'s limit of "
                    f"{self.max_message_bytes} bytes; split the batch"
                )
            self._sock.send(data, copy=True)
            # No busy-polling here (this runs inside inference engines); the master busy-polls.
            deadline = time.monotonic() + limit
            while True:
                try:
                    data = self._sock.recv(zmq.NOBLOCK, copy=True)
                except zmq.Again:
                    left = deadline - time.monotonic()
                    if left <= 0 or not self._sock.poll(int(left * 1000) + 1, zmq.POLLIN):
                        if time.monotonic() >= deadline:
                            raise MasterUnavailableError(
                                f"master {self.address} did not answer {type(body).__name__} within {limit:.1f} s; "
                                "is `tidekv master` running there?"
                            ) from None
                    continue
                reply = p.decode_reply(data)
                if reply.request_id == request_id:
                    break
                logger.debug("dropped late reply %d from master %s", reply.request_id, self.address)
        if reply.error_kind:
            if reply.error_kind == "version":
                raise ProtocolVersionError(reply.error)
            if reply.error_kind in ("invalid", "oversized"):
                raise ConfigError(reply.error)
            raise RpcError(f"master {self.address} refused {type(body).__name__}: {reply.error}")
        return reply.result

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._sock.close(linger=0)
