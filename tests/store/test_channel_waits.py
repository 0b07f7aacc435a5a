"""Channel requests that wait on the master (``ChannelTake.wait_s``, ``ChannelPush.wait_s``), at
the connection: a parked take is answered when an item is pushed, frames sent after it on its
connection are answered after it (in order), its wait ends with an empty answer, and a
connection closed while parked leaves nothing behind. An in-process master, raw connections."""

from __future__ import annotations

import time
from collections.abc import Iterator

import msgspec
import pytest
from tidekv.config import MasterConfig, StoreConfig
from tidekv.store.client.store import Store
from tidekv.store.master.server import MasterServer
from tidekv.store.wire import protocol as p
from tidekv.store.wire.protocol import Pin, Status

from tests.store import wire
from tests.store.procs import wait_until


@pytest.fixture
def server() -> Iterator[MasterServer]:
    server = MasterServer(MasterConfig(port=0, metrics_port=-1, host="127.0.0.1")).start()
    yield server
    server.stop()


def _send(sock: object, request_id: int, body: msgspec.Struct) -> None:
    sock.sendall(p.frame(p.encode(p.Envelope(p.PROTOCOL_VERSION, request_id, body))))  # type: ignore[attr-defined]


def _reply(sock: object) -> p.Reply:
    return p.decode_reply(wire.recv_frame(sock))  # type: ignore[arg-type]


def _parked(server: MasterServer) -> int:
    return sum(len(conns) for conns in server._parked.values())


def test_a_parked_take_is_answered_on_a_push_and_the_frames_after_it_wait_their_turn(server: MasterServer) -> None:
    holder = Store.connect(server.address, 1 << 20, config=StoreConfig(prefer_local_segment=True))
    try:
        sock = wire.connect(server.address)
        _send(sock, 1, p.ChannelTake("c", "me", 4, 5.0, [], 10.0))
        _send(sock, 2, p.ChannelInfo("c"))  # pipelined behind the parked take
        wait_until(lambda: _parked(server) == 1, 5, "the take to park")
        sock.settimeout(0.3)
        with pytest.raises(TimeoutError):
            wire.recv_frame(sock)  # neither is answered while the take waits
        sock.settimeout(5)
        holder.put("item", b"x" * 100, pin=Pin.HARD)
        assert holder._groups[0].rpc.call(p.ChannelPush("c", [b"item"], 10, 1 << 20)) == ([Status.OK], [0])
        take = _reply(sock)
        assert take.request_id == 1 and [item[1] for item in take.result[1]] == [b"item"]
        info = _reply(sock)
        assert info.request_id == 2 and info.result["taken"] == 1
        assert _parked(server) == 0
    finally:
        holder.close()


def test_a_wait_ends_empty_handed_and_a_closed_connection_leaves_nothing_parked(server: MasterServer) -> None:
    sock = wire.connect(server.address)
    started = time.monotonic()
    _send(sock, 1, p.ChannelTake("c", "me", 4, 5.0, [], 0.3))
    reply = _reply(sock)
    # (the loop's timers fire to the millisecond)
    assert reply.request_id == 1 and reply.result[1] == [] and time.monotonic() - started >= 0.29
    # the lease as the client counts it, from when it sent the take: the wait, then the lease
    assert reply.result[0] >= server.config.lease_ttl_s + 0.29
    _send(sock, 2, p.ChannelTake("c", "me", 4, 5.0, [], 30.0))
    wait_until(lambda: _parked(server) == 1, 5, "the take to park")
    sock.close()
    wait_until(lambda: _parked(server) == 0, 5, "the closed connection's take to be forgotten")
    other = wire.connect(server.address)
    _send(other, 3, p.ChannelInfo("c"))
    assert _reply(other).result["items"] == 0  # the master serves on
