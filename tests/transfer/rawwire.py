"""The transfer protocol spoken from a plain Python socket (layouts from native/common/wire.h).

Lets tests act as a peer of another version, a peer without the secret, a client that sends
garbage, or a fake server, none of which the engine itself would ever be. Neighbours: the
handshake and malformed-frame tests.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass

MAGIC = 0x564B4454
VERSION = 7  # wire::kProtocolVersion (native/common/wire.h); a mismatch fails every test here at its handshake
TRANSPORT_TCP = 1
TRANSPORT_SHM = 2

CONN_DESCRIPTOR = 1
CONN_DATA = 2
CONN_REGION_PROOF = 3

STATUS_OK = 0
STATUS_VERSION_MISMATCH = 1
STATUS_AUTH_FAILED = 2
STATUS_NOT_REGISTERED = 4
STATUS_REFUSED = 6

OP_READ = 0
OP_WRITE = 1

HELLO = struct.Struct("<IIIHH32s16s")  # magic, version, conn_type, transport, reserved, nonce, instance
CHALLENGE = struct.Struct("<IIII32s")  # magic, version, status, secret_required, nonce
AUTH = struct.Struct("<32s")
WELCOME = struct.Struct("<IIII32s")  # magic, status, descriptor_bytes, reserved, server mac; the descriptor follows
DESCRIPTOR_HEADER = struct.Struct("<IIII16s")  # magic, version, sections, reserved, instance
SECTION_HEADER = struct.Struct("<HHI")  # transport, reserved, length
REQUEST = struct.Struct("<IB3xQQQQQ")  # magic, op, remote_addr, length, tag, span_addr, span_length
RESPONSE = struct.Struct("<IIQQQ")  # magic, status, length, tag, reserved

assert (HELLO.size, CHALLENGE.size, WELCOME.size, DESCRIPTOR_HEADER.size) == (64, 48, 48, 32)
assert (REQUEST.size, RESPONSE.size) == (48, 32)

IO_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Challenge:
    magic: int
    version: int
    status: int
    secret_required: int
    nonce: bytes


def mac(secret: str, server_nonce: bytes, client_nonce: bytes) -> bytes:
    """HMAC-SHA-256(secret, server nonce || client nonce), as the engine computes it."""
    return hmac.new(secret.encode(), server_nonce + client_nonce, hashlib.sha256).digest()


def server_mac(secret: str, client_nonce: bytes, server_nonce: bytes) -> bytes:
    """The server's proof in its Welcome: HMAC-SHA-256(secret, "tidekv-server" || client || server nonce)."""
    return hmac.new(secret.encode(), b"tidekv-server" + client_nonce + server_nonce, hashlib.sha256).digest()


def recv_exact(sock: socket.socket, size: int) -> bytes:
    """Exactly ``size`` bytes; ConnectionError if the peer closes first."""
    chunks = []
    while size:
        chunk = sock.recv(size)
        if not chunk:
            raise ConnectionError(f"closed with {size} bytes still expected")
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def is_closed_by_peer(sock: socket.socket, timeout_s: float = IO_TIMEOUT_S) -> bool:
    """True when the peer closes (EOF or reset) within timeout_s; any bytes it sends are skipped."""
    sock.settimeout(timeout_s)
    try:
        while sock.recv(1 << 16):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def connect(name: str) -> socket.socket:
    host, _, port = name.rpartition(":")
    sock = socket.create_connection((host, int(port)), timeout=IO_TIMEOUT_S)
    sock.settimeout(IO_TIMEOUT_S)
    return sock


def pack_hello(nonce: bytes, magic: int = MAGIC, version: int = VERSION, conn_type: int = CONN_DATA,
               transport: int = TRANSPORT_TCP, instance: bytes | None = None) -> bytes:
    """A Hello from a made-up client engine (a random instance id unless given)."""
    return HELLO.pack(magic, version, conn_type, transport if conn_type == CONN_DATA else 0, 0, nonce,
                      instance or os.urandom(16))


def send_hello(sock: socket.socket, version: int = VERSION, conn_type: int = CONN_DATA,
               instance: bytes | None = None, transport: int = TRANSPORT_TCP) -> bytes:
    """Sends a Hello; returns its nonce."""
    nonce = os.urandom(32)
    sock.sendall(pack_hello(nonce, version=version, conn_type=conn_type, transport=transport, instance=instance))
    return nonce


def recv_challenge(sock: socket.socket) -> Challenge:
    return Challenge(*CHALLENGE.unpack(recv_exact(sock, CHALLENGE.size)))


def handshake(name: str, secret: str | None = None, conn_type: int = CONN_DATA,
              instance: bytes | None = None, transport: int = TRANSPORT_TCP) -> tuple[socket.socket, int]:
    """Opens a connection the way an engine does; returns it and the Welcome status."""
    sock = connect(name)
    nonce = send_hello(sock, conn_type=conn_type, instance=instance, transport=transport)
    challenge = recv_challenge(sock)
    assert (challenge.magic, challenge.status) == (MAGIC, STATUS_OK), challenge
    sock.sendall(mac(secret, challenge.nonce, nonce) if secret else bytes(32))
    magic, status, descriptor_bytes, _, proof = WELCOME.unpack(recv_exact(sock, WELCOME.size))
    assert magic == MAGIC
    if secret and status == STATUS_OK:  # the engine proves it holds the secret too
        assert proof == server_mac(secret, nonce, challenge.nonce), "the server's proof does not check out"
    if descriptor_bytes:
        recv_exact(sock, descriptor_bytes)
    return sock, status


def send_request(sock: socket.socket, op: int, remote_addr: int, length: int, tag: int, payload: bytes = b"") -> None:
    sock.sendall(pack_request(op, remote_addr, length, tag) + payload)


def pack_request(op: int, remote_addr: int, length: int, tag: int = 0, magic: int = MAGIC) -> bytes:
    """A request frame whose slice is its whole request."""
    return REQUEST.pack(magic, op, remote_addr, length, tag, remote_addr, length)


def recv_response(sock: socket.socket) -> tuple[int, int, int, bytes]:
    """(status, length, tag, payload) of one reply."""
    magic, status, length, tag, _ = RESPONSE.unpack(recv_exact(sock, RESPONSE.size))
    assert magic == MAGIC
    return status, length, tag, recv_exact(sock, length) if length else b""


def descriptor(version: int = VERSION, sections: list[tuple[int, bytes]] | None = None,
               instance: bytes | None = None) -> bytes:
    """An encoded descriptor; by default that of a process on another host (tcp needs no section)."""
    sections = sections or []
    out = DESCRIPTOR_HEADER.pack(MAGIC, version, len(sections), 0, instance or os.urandom(16))
    for transport, body in sections:
        out += SECTION_HEADER.pack(transport, 0, len(body)) + body
    return out


def parse_descriptor(data: bytes) -> tuple[bytes, list[tuple[int, bytes]]]:
    """(instance, [(transport, section bytes)]) of an encoded descriptor."""
    magic, version, count, _, instance = DESCRIPTOR_HEADER.unpack_from(data)
    assert (magic, version) == (MAGIC, VERSION)
    at, sections = DESCRIPTOR_HEADER.size, []
    for _ in range(count):
        transport, _, length = SECTION_HEADER.unpack_from(data, at)
        at += SECTION_HEADER.size
        sections.append((transport, data[at:at + length]))
        at += length
    assert at == len(data)
    return instance, sections


def serve_handshake(sock: socket.socket, descriptor_version: int = VERSION) -> int:
    """The server side of a handshake without a secret, as a remote-host engine; returns the conn type."""
    _, _, conn_type, *_ = HELLO.unpack(recv_exact(sock, HELLO.size))
    sock.sendall(CHALLENGE.pack(MAGIC, VERSION, STATUS_OK, 0, os.urandom(32)))
    recv_exact(sock, AUTH.size)
    body = descriptor(descriptor_version)
    sock.sendall(WELCOME.pack(MAGIC, STATUS_OK, len(body), 0, bytes(32)) + body)
    return int(conn_type)


class FakeServer:
    """A listener on 127.0.0.1 whose every connection is handled by ``script(sock)`` in a thread.

    Exceptions in the script are kept in ``errors`` for the test to check; ``close`` stops it.
    """

    def __init__(self, script: Callable[[socket.socket], None]) -> None:
        self._script = script
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.1)
        self.name = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self.errors: list[BaseException] = []
        self.connections = 0
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._acceptor = threading.Thread(target=self._accept, name="fake-server", daemon=True)
        self._acceptor.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                sock, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.connections += 1
            t = threading.Thread(target=self._serve, args=(sock,), daemon=True)
            t.start()
            self._threads.append(t)

    def _serve(self, sock: socket.socket) -> None:
        sock.settimeout(IO_TIMEOUT_S)
        try:
            self._script(sock)
        except BaseException as e:  # handed to the test
            self.errors.append(e)
        finally:
            sock.close()

    def close(self) -> None:
        self._stop.set()
        self._acceptor.join(timeout=5)
        self._listener.close()
        for t in self._threads:
            t.join(timeout=IO_TIMEOUT_S + 1)
