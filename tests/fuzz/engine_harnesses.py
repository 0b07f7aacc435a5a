"""Fuzz harnesses of the transfer engine through the native module (issue 17, item 4): its
handshake (and the descriptor decoding of ``add_peer``), and its data frames, aimed at a
registered region with guard regions of a known pattern around it.

Both talk to a live engine in this process over loopback, with the wire of
``tests/transfer/rawwire`` (the layouts of ``native/common/wire.h``): a native crash kills the
fuzzing process, which the driver reports. Neighbours: ``fuzzing`` (the kit), ``harnesses``
(the Python parsers, and the registry of all).
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from typing import Any

from tidekv.errors import ConfigError, ProtocolVersionError

from tests.fuzz.fuzzing import SECRET, Hang, Harness, Source
from tests.transfer import rawwire


def _engine(secret: str | None) -> Any:
    from tidekv.config import TransferConfig
    from tidekv.transfer import TransferEngine

    return TransferEngine(config=TransferConfig(secret=secret, io_timeout_s=5.0))


class EngineHandshake(Harness):
    """Connections to a live engine (with and without a secret) that send any bytes: before the
    Hello, after a valid Hello, after a whole handshake; and descriptors given to ``add_peer``
    (garbage and real ones mutated). The engine must close (or answer) within the deadline after
    our end hangs up, raise only typed errors from add_peer, and keep serving real peers."""

    name = "engine_handshake"
    is_native = True
    DEADLINE_S = 5.0
    _CHECK_EVERY = 2000

    def setup(self) -> None:
        self._engines = {s: _engine(s) for s in (None, SECRET)}
        self._count = 0

    def close(self) -> None:
        for e in self._engines.values():
            e.close()

    def one(self, data: bytes) -> None:
        src, flags, secret = self.start_input(data)
        mode = (flags >> 1) % 4
        engine = self._engines[secret]
        self.note(("raw connection", "after a Hello", "add_peer garbage", "add_peer mutated descriptor")[mode]
                  + (", secured" if secret else ""))
        if mode >= 2:
            native = engine._native
            blob = src.rest() if mode == 2 else self._mutated(native.descriptor(), src)
            try:
                native.add_peer(f"127.0.0.1:{9 + flags}", blob)
            except (ConfigError, ProtocolVersionError):
                pass
            return
        sock = rawwire.connect(engine.name)
        try:
            if mode == 1:
                nonce = os.urandom(32)
                sock.sendall(rawwire.pack_hello(nonce, conn_type=1 + src.byte() % 3))  # descriptor, data, region proof
            try:
                sock.sendall(src.rest())
                sock.shutdown(socket.SHUT_WR)
            except OSError:
                return  # the engine hung up first (a bad Hello): what we want
            if not rawwire.is_closed_by_peer(sock, self.DEADLINE_S):
                raise Hang(f"engine {engine.name} kept a connection open {self.DEADLINE_S} s after it hung up")
        finally:
            sock.close()

    @staticmethod
    def _mutated(real: bytes, src: Source) -> bytes:
        out = bytearray(real)
        for _ in range(1 + src.byte() % 8):
            out[src.uint(2) % len(out)] = src.byte()
        return bytes(out[: src.uint(2) % (len(out) + 1)])

    def _check_alive(self) -> None:
        for secret, engine in self._engines.items():
            sock, status = rawwire.handshake(engine.name, secret)
            sock.close()
            assert status == rawwire.STATUS_OK, f"engine {engine.name} stopped accepting real peers ({status})"

    def report(self) -> dict[str, Any]:
        self._check_alive()
        return {**super().report(),
                "engine_stats": {"secret" if s else "open": e.stats() for s, e in self._engines.items()}}

    def seeds(self) -> list[bytes]:
        return [b"\x00" + rawwire.pack_hello(b"n" * 32), b"\x02" + b"\x00" * 8 + os.urandom(64), b"\x04\x03\x01",
                b"\x06\x01" + b"\x00" * 40]


@dataclass(frozen=True)
class _Frame:
    op: int
    addr: int
    length: int
    span_addr: int
    span_length: int
    payload: bytes


GUARD_BYTES = 4096
REGION_BYTES = 64 << 10
_GUARD_PATTERN = bytes((i * 37 + 11) & 0xFF for i in range(GUARD_BYTES))


class EngineFrames(Harness):
    """Data frames (READ/WRITE requests, as ``native/common/wire.h`` lays them out) at a live
    engine over a handshaken raw connection, aimed around one registered region that has
    ``GUARD_BYTES`` of a known pattern right before and after it (memory the engine was not
    given). After every input: the guards are intact (no write outside the registered region),
    every reply is well formed and in order, a READ that succeeds returns the region's bytes,
    and -- while the connection stands -- the region holds exactly what acknowledged WRITEs
    wrote (a Python reference copy). Refused frames must be answered or the connection closed
    within the deadline."""

    name = "engine_frames"
    is_native = True
    DEADLINE_S = 5.0

    def setup(self) -> None:
        import numpy as np

        self._engine = _engine(None)
        self._memory = np.zeros(GUARD_BYTES + REGION_BYTES + GUARD_BYTES, dtype=np.uint8)
        self._bytes = memoryview(self._memory).cast("B")
        self._bytes[:GUARD_BYTES] = _GUARD_PATTERN
        self._bytes[-GUARD_BYTES:] = _GUARD_PATTERN
        self._base = int(self._memory.ctypes.data) + GUARD_BYTES
        self._region = self._engine.register((self._base, REGION_BYTES))
        self._reference = bytearray(REGION_BYTES)
        self._sock: socket.socket | None = None
        self.stray_writes = 0
        self.frames_sent = 0
        self.reconnects = 0

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
        self._engine.close()

    def _connection(self) -> socket.socket:
        if self._sock is None:
            self._sock, status = rawwire.handshake(self._engine.name)
            self._sock.settimeout(self.DEADLINE_S)
            assert status == rawwire.STATUS_OK, status
            self.reconnects += 1
        return self._sock

    def _address(self, src: Source) -> int:
        kind = src.byte() % 8
        if kind < 6:  # around the region: from two guards before it to two after
            return self._base - 2 * GUARD_BYTES + src.uint(3) % (REGION_BYTES + 4 * GUARD_BYTES)
        return src.uint(8) if kind == 6 else self._base + REGION_BYTES - src.uint(1)

    @staticmethod
    def _length(src: Source) -> int:
        kind = src.byte() % 16
        if kind < 14:
            return src.uint(2) % 4097
        return src.uint(8) if kind == 14 else REGION_BYTES + GUARD_BYTES - src.uint(1)

    def one(self, data: bytes) -> None:
        src = Source(data)
        sent: list[_Frame] = []
        wire = bytearray()
        is_complete = True  # every frame whole, its payload all there: every reply must come
        is_malformed = False  # the last frame breaks the format: the engine must hang up
        for tag in range(1 + src.byte() % 4):
            op_byte = src.byte()
            op = op_byte % 2 if op_byte < 252 else op_byte
            addr, length = self._address(src), self._length(src)
            span_addr, span_length = addr, length
            if src.byte() % 32 == 31:  # the slice of a larger request, maybe not inside it
                span_addr, span_length = (addr - src.uint(2)) % (1 << 64), (length + src.uint(2)) % (1 << 64)
            magic = rawwire.MAGIC if src.byte() % 64 != 63 else src.uint(4)
            wire += rawwire.REQUEST.pack(magic, op, addr, length, tag, span_addr, span_length)
            is_malformed = (magic != rawwire.MAGIC or op > 1 or addr < span_addr or length > span_length
                            or addr - span_addr > span_length - length)
            if is_malformed:
                break
            payload = b""
            if op == rawwire.OP_WRITE:
                payload = src.take(min(length, 8192))
                if len(payload) < length:
                    payload += b"\xa5" * min(length - len(payload), 8192 - len(payload))
                is_complete = is_complete and len(payload) == length
                wire += payload
            sent.append(_Frame(op, addr, length, span_addr, span_length, payload))
            if not is_complete:
                break
        self.frames_sent += len(sent) + is_malformed
        sock = self._connection()
        is_intact = False
        try:
            sock.sendall(wire)
            if is_complete:
                is_intact = self._replies(sock, sent)
            if is_complete and is_malformed and not rawwire.is_closed_by_peer(sock, self.DEADLINE_S):
                raise Hang(f"engine {self._engine.name} kept a connection open {self.DEADLINE_S} s after a "
                           "malformed frame")
        except (ConnectionError, OSError) as exc:
            if isinstance(exc, TimeoutError) and is_complete:
                self._check_guards()
                raise Hang(f"engine {self._engine.name} neither answered nor closed within {self.DEADLINE_S} s") from None
        self._check_guards()
        region = self._bytes[GUARD_BYTES: GUARD_BYTES + REGION_BYTES]
        if is_intact and not is_malformed:
            assert region == self._reference, "the region differs from what acknowledged writes wrote"
            self.note("the connection stood")
            return
        self.note("the connection ended (a malformed frame, or a payload we cut short)")
        # The connection is done for (a malformed frame, or we cut a payload short): a write may
        # have landed in part, inside the region. Once the engine has let go of the connection
        # (it may still be copying what it had read), start again from what the region holds.
        sock.close()
        self._sock = None
        deadline = time.monotonic() + self.DEADLINE_S
        while self._engine.stats()["connections_open"]:
            if time.monotonic() > deadline:
                raise Hang(f"engine {self._engine.name} still serves a connection {self.DEADLINE_S} s after we closed it")
            time.sleep(0.0002)
        self._check_guards()
        self._reference[:] = region

    def _replies(self, sock: socket.socket, sent: list[_Frame]) -> bool:
        """Reads one reply per frame; True when all came (the connection stands)."""
        end = self._base + REGION_BYTES
        for tag, f in enumerate(sent):
            try:
                status, got_length, got_tag, body = rawwire.recv_response(sock)
            except ConnectionError:
                return False
            assert got_tag == tag, f"reply for frame {got_tag}, expected {tag}"
            inside = self._base <= f.span_addr and f.span_addr + f.span_length <= end
            if status == rawwire.STATUS_OK:
                assert inside, f"the engine served {f.span_length} bytes at {f.span_addr:#x}, outside the region"
                at = f.addr - self._base
                if f.op == rawwire.OP_READ:
                    assert got_length == f.length, f"READ of {f.length} bytes answered with {got_length}"
                    # A READ's reply goes out from the region itself when the engine flushes its
                    # replies, so a later WRITE of the same input to the same bytes may show in
                    # it (pipelined frames of one connection are not isolated from each other).
                    if not any(g.op == rawwire.OP_WRITE and g.addr < f.addr + f.length and f.addr < g.addr + g.length
                               for g in sent[tag + 1:]):
                        assert body == self._reference[at: at + f.length], "READ returned other bytes"
                else:
                    assert got_length == 0
                    self._reference[at: at + f.length] = f.payload
            else:
                assert status == rawwire.STATUS_NOT_REGISTERED and got_length == 0, (status, got_length)
                assert not inside or f.span_length == 0, \
                    f"the engine refused {f.span_length} bytes at {f.span_addr:#x}, inside the registered region"
        return True

    def _check_guards(self) -> None:
        before, after = self._bytes[:GUARD_BYTES], self._bytes[-GUARD_BYTES:]
        if before != _GUARD_PATTERN or after != _GUARD_PATTERN:
            self.stray_writes += 1
            self._bytes[:GUARD_BYTES] = _GUARD_PATTERN
            self._bytes[-GUARD_BYTES:] = _GUARD_PATTERN
            raise AssertionError("a guard region around the registered region was written")

    def report(self) -> dict[str, Any]:
        self._check_guards()
        return {**super().report(), "writes_outside_regions": self.stray_writes, "frames_sent": self.frames_sent,
                "connections": self.reconnects, "guard_bytes": GUARD_BYTES, "engine_stats": self._engine.stats()}

    def seeds(self) -> list[bytes]:
        return [b"\x00\x01" + b"\x00" * 3 + b"\x10\x00\x00" + b"\x00\x10\x00" + b"\x01\x01" + b"abcd" * 8,
                b"\x01\x00" + b"\x00" * 20, b"\x03" + os.urandom(60)]
