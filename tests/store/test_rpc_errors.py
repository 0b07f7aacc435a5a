"""Bad RPC traffic: garbage, oversized and wrong-version messages get a clear error reply, and
the master keeps serving well-behaved clients meanwhile.

Raw TCP sockets play the misbehaving peers; a normal Store checks the master after.
"""

from __future__ import annotations

import random
import socket
import threading
import time
from collections.abc import Iterator

import msgspec
import pytest
from tidekv.config import StoreConfig
from tidekv.errors import ConfigError, MasterUnavailableError, ProtocolVersionError, RpcError
from tidekv.store import Store
from tidekv.store.wire import protocol as p

from tests.store import wire
from tests.store.conftest import Connect, SpawnMaster
from tests.store.procs import MasterProcess, wait_until

MAX_MESSAGE = 4096
REPLY_TIMEOUT_S = 5.0


@pytest.fixture
def master(spawn_master: SpawnMaster) -> MasterProcess:
    return spawn_master(max_message_bytes=MAX_MESSAGE)


@pytest.fixture
def raw(master: MasterProcess) -> Iterator[socket.socket]:
    sock = wire.connect(master.address, timeout_s=REPLY_TIMEOUT_S)
    yield sock
    sock.close()


def _ask(sock: socket.socket, payload: bytes) -> p.Reply:
    sock.sendall(p.frame(payload))
    size = int.from_bytes(wire.recv_exact(sock, p.FRAME_HEADER), "little")
    return p.decode_reply(wire.recv_exact(sock, size))


def _closed_by_peer(sock: socket.socket, timeout_s: float | None = None) -> bool:
    """Whether the master closed it (within timeout_s when given; else the socket's own timeout)."""
    if timeout_s is not None:
        sock.settimeout(timeout_s)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def _wait_for_log(master: MasterProcess, text: str, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in master.log_text():
        assert time.monotonic() < deadline, f"{text!r} not in the master's log:\n{master.log_text()[-2000:]}"
        time.sleep(0.05)


def _all_read_by_peer(sock: socket.socket) -> bool:
    """Whether the process at the other end has read every byte sent on ``sock``: none waits
    unacknowledged on this side, none unread on the other (Linux's /proc/net/tcp queues)."""
    def name(address: tuple[str, int]) -> str:
        return f"{int.from_bytes(socket.inet_aton(address[0]), 'little'):08X}:{address[1]:04X}"

    mine, theirs = name(sock.getsockname()), name(sock.getpeername())
    queues = {}  # (local, remote) -> (tx_queue, rx_queue)
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            tx, rx = (int(q, 16) for q in fields[4].split(":"))
            queues[(fields[1], fields[2])] = (tx, rx)
    sent, received = queues.get((mine, theirs)), queues.get((theirs, mine))
    return sent is not None and received is not None and sent[0] == 0 and received[1] == 0


def _check_serving(st: Store, tag: str) -> None:
    st.put(f"after-{tag}", tag.encode())
    assert st.get(f"after-{tag}") == tag.encode()


def test_garbage_gets_a_malformed_error(master: MasterProcess, raw: socket.socket, connect: Connect) -> None:
    st = connect(master.address, segment_size=1 << 20)
    rng = random.Random(3)
    for _ in range(20):
        garbage = rng.randbytes(rng.randint(1, 2000))
        reply = _ask(raw, garbage)
        assert reply.error_kind == "malformed", reply
        assert reply.error.startswith("malformed request"), reply
        assert reply.result is None
    assert _ask(raw, b"").error_kind == "malformed"
    shaped = _ask(raw, msgspec.msgpack.encode([p.PROTOCOL_VERSION, 77, ["no_such_request", 1]]))
    assert (shaped.error_kind, shaped.request_id) == ("malformed", 77), "the request id must be echoed when readable"
    _check_serving(st, "garbage")


def test_oversized_request_gets_an_error_naming_the_limit(master: MasterProcess, raw: socket.socket,
                                                          connect: Connect) -> None:
    st = connect(master.address, segment_size=1 << 20)
    body = p.Exists([b"k" * 100] * 50)
    data = p.encode(p.Envelope(p.PROTOCOL_VERSION, 5, body))
    assert MAX_MESSAGE < len(data) < 2 * MAX_MESSAGE
    reply = _ask(raw, data)
    assert reply.error_kind == "oversized"
    assert str(len(data)) in reply.error and str(MAX_MESSAGE) in reply.error and "split the batch" in reply.error
    assert reply.request_id == 5, "the error must name the request it answers, or the client drops it as stale"
    _check_serving(st, "oversized")


@pytest.mark.parametrize("n_keys", [50, 200], ids=["just-over", "5x-over"])
def test_store_batch_over_the_message_limit_fails_fast_and_clearly(master: MasterProcess, connect: Connect,
                                                                   n_keys: int) -> None:
    st = connect(master.address, segment_size=1 << 20, rpc_timeout_s=3.0)
    keys = [f"key-{i:04d}-" + "x" * 90 for i in range(n_keys)]  # ~100 bytes per key; the limit is 4 KiB
    started = time.monotonic()
    with pytest.raises((ConfigError, RpcError)) as info:
        st.put_many(keys, [b"v"] * len(keys))
    assert "split the batch" in str(info.value) or str(MAX_MESSAGE) in str(info.value), info.value
    assert time.monotonic() - started < 2.0, "a refused request must not wait for the RPC timeout"
    _check_serving(st, "big-batch")


def test_a_batch_of_more_keys_than_the_master_takes_goes_in_parts(spawn_master: SpawnMaster,
                                                                 connect: Connect) -> None:
    """The master refuses requests naming more than max_batch_keys keys (so no request holds its
    event loop for long); the client learns the limit at hello and sends bigger batches in parts."""
    master = spawn_master(max_batch_keys=64)
    st = connect(master.address, segment_size=1 << 20, rpc_timeout_s=3.0)
    keys = [f"k{i}" for i in range(200)]
    values = [b"v%d" % i for i in range(200)]
    st.put_many(keys[:130], values[:130])  # PutStart and PutEnd in three parts each
    assert st.exists_many(keys) == [True] * 130 + [False] * 70
    assert st.get_many(keys[:130]) == values[:130]
    assert st.remove_many(keys[:130], force=True) == [p.Status.OK] * 130  # (just read: leased)
    assert st.exists_many(keys) == [False] * 200
    _check_serving(st, "many-keys")


def test_wrong_protocol_version_names_both_versions(master: MasterProcess, raw: socket.socket,
                                                    connect: Connect) -> None:
    st = connect(master.address, segment_size=1 << 20)
    for body in (p.Hello("old-client", 99), p.StatsRequest()):
        reply = _ask(raw, p.encode(p.Envelope(99, 8, body)))
        assert (reply.error_kind, reply.request_id) == ("version", 8)
        assert "v99" in reply.error and f"v{p.PROTOCOL_VERSION}" in reply.error, reply.error
    future = _ask(raw, msgspec.msgpack.encode([99, 9, ["hello_v99", "c", {"new": "field"}]]))
    assert (future.error_kind, future.request_id) == ("version", 9), "an undecodable future request is a version error"
    assert "v99" in future.error
    _check_serving(st, "version")


def test_a_frame_beyond_any_limit_closes_only_that_connection(master: MasterProcess, raw: socket.socket,
                                                               connect: Connect) -> None:
    st = connect(master.address, segment_size=1 << 20)
    raw.sendall((1 << 31).to_bytes(p.FRAME_HEADER, "little") + b"x" * 100)
    assert _closed_by_peer(raw), "a frame no request could fill must end the connection, not be buffered"
    _check_serving(st, "huge-frame")


def test_a_connection_without_the_greeting_is_closed(master: MasterProcess, connect: Connect) -> None:
    st = connect(master.address, segment_size=1 << 20)
    host, port = master.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=REPLY_TIMEOUT_S) as sock:
        sock.sendall(b"\xff\x00\x00\x00\x00\x00\x00\x00\x01\x7f")  # a ZeroMQ greeting: an older tidekv client
        assert _closed_by_peer(sock)
    _check_serving(st, "greeting")


def test_a_client_that_vanishes_mid_frame_does_not_disturb_others(master: MasterProcess, connect: Connect) -> None:
    st = connect(master.address, segment_size=1 << 20)
    host, port = master.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=REPLY_TIMEOUT_S) as sock:
        wire.authenticate(sock)
        sock.sendall((1000).to_bytes(p.FRAME_HEADER, "little") + b"half")
    _check_serving(st, "vanished")


def test_garbage_flood_does_not_disturb_a_working_client(master: MasterProcess, connect: Connect) -> None:
    st = connect(master.address, segment_size=4 << 20)
    stop = threading.Event()
    errors: list[BaseException] = []

    def flood() -> None:
        host, port = master.address.rsplit(":", 1)
        sock = socket.create_connection((host, int(port)), timeout=0.2)
        rng = random.Random(9)
        try:
            sock.settimeout(REPLY_TIMEOUT_S)
            wire.authenticate(sock)
            sock.settimeout(0.2)
            while not stop.is_set():
                try:  # replies are never read: the master must stop reading us, not buffer without end
                    sock.sendall(p.frame(rng.randbytes(rng.randint(1, 3 * MAX_MESSAGE // 2))))
                except TimeoutError:  # it did (a partial frame may be out, so send no more)
                    stop.wait()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            sock.close()

    thread = threading.Thread(target=flood, daemon=True)
    thread.start()
    try:
        for i in range(200):
            st.put(f"k{i}", bytes([i]) * 1000)
            assert st.get(f"k{i}") == bytes([i]) * 1000
    finally:
        stop.set()
        thread.join(timeout=10)
    assert not errors
    assert st.stats()["keys"] == 200


class _FutureMaster:
    """A fake master that speaks protocol v(N+1): it answers everything with a version error."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.05)
        self.port = self.listener.getsockname()[1]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        theirs = p.PROTOCOL_VERSION + 1
        while not self._stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(5)
                assert wire.recv_exact(conn, len(p.MAGIC)) == p.MAGIC
                wire.recv_frame(conn)  # the greeting: answered with a version error, not a challenge
                message = f"client speaks tidekv store protocol v{p.PROTOCOL_VERSION}, this master speaks v{theirs}"
                conn.sendall(p.frame(p.encode(p.Reply(0, error_kind="version", error=message))))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.listener.close()


def test_connecting_to_a_master_of_another_version_raises_protocol_version_error() -> None:
    fake = _FutureMaster()
    try:
        with pytest.raises(ProtocolVersionError) as info:
            Store.connect(f"127.0.0.1:{fake.port}", config=StoreConfig(staging_size_bytes=1 << 20, rpc_timeout_s=5))
        assert f"v{p.PROTOCOL_VERSION}" in str(info.value) and f"v{p.PROTOCOL_VERSION + 1}" in str(info.value)
    finally:
        fake.close()


def test_connecting_to_no_master_raises_master_unavailable() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(MasterUnavailableError, match=f"127.0.0.1:{port}"):
        Store.connect(f"127.0.0.1:{port}",
                      config=StoreConfig(staging_size_bytes=1 << 20, rpc_timeout_s=0.3, failover_timeout_s=0.5))
    with pytest.raises(ConfigError, match="host:port"):
        Store.connect("no-port-here", config=StoreConfig(staging_size_bytes=1 << 20))


def test_a_holder_that_finds_no_master_gives_its_memory_back() -> None:
    """The segment is allocated before the master is asked (a large one takes seconds): a connect
    that then fails leaves nothing registered on an engine the caller keeps."""
    from tidekv.transfer import TransferEngine

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    engine = TransferEngine("127.0.0.1")
    try:
        with pytest.raises(MasterUnavailableError):
            Store.connect(f"127.0.0.1:{port}", segment_size=8 << 20, engine=engine,
                          config=StoreConfig(staging_size_bytes=1 << 20, rpc_timeout_s=0.3, failover_timeout_s=0.5))
        assert not engine._regions, "the segment and the staging area must be unregistered"  # noqa: SLF001
    finally:
        engine.close()


def _partial_request(master: MasterProcess, body_bytes: int) -> socket.socket:
    """A connection that greets and starts a request of body_bytes, sending all but its last byte."""
    host, port = master.address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=REPLY_TIMEOUT_S)
    wire.authenticate(sock)
    sock.sendall(body_bytes.to_bytes(p.FRAME_HEADER, "little") + b"\x00" * (body_bytes - 1))
    return sock


def test_an_unfinished_request_is_dropped_after_frame_timeout(spawn_master: SpawnMaster, connect: Connect) -> None:
    master = spawn_master(frame_timeout_s=0.5, tick_s=0.05)
    st = connect(master.address, segment_size=1 << 20, rpc_timeout_s=3.0)
    stalled = _partial_request(master, 1000)
    started = time.monotonic()
    with stalled:
        assert _closed_by_peer(stalled, timeout_s=5.0)
    assert 0.4 < time.monotonic() - started < 3.0
    _wait_for_log(master, "frame_timeout_s")
    _check_serving(st, "after-stall")


def test_unfinished_requests_past_the_total_cap_close_the_connection_that_passes_it(
        spawn_master: SpawnMaster, connect: Connect) -> None:
    master = spawn_master(max_buffered_bytes=1 << 20)
    st = connect(master.address, segment_size=1 << 20, rpc_timeout_s=3.0)
    first = _partial_request(master, 600 << 10)  # 600 KiB held: under the cap
    # Ordered by the event, not a sleep: the master read all of the first before the second starts.
    wait_until(lambda: _all_read_by_peer(first), 10.0, "the master to read the first unfinished request")
    second = _partial_request(master, 600 << 10)  # with it, 1.2 MiB: this one goes
    with first, second:
        assert _closed_by_peer(second, timeout_s=5.0)
        assert not _closed_by_peer(first, timeout_s=0.3)
    _wait_for_log(master, "max_buffered_bytes")
    _check_serving(st, "after-cap")


def test_connections_beyond_max_connections_are_closed(spawn_master: SpawnMaster, connect: Connect) -> None:
    master = spawn_master(max_connections=3)
    st = connect(master.address, segment_size=1 << 20, rpc_timeout_s=3.0)  # one connection
    host, port = master.address.rsplit(":", 1)
    held = [socket.create_connection((host, int(port)), timeout=REPLY_TIMEOUT_S) for _ in range(2)]
    extra = socket.create_connection((host, int(port)), timeout=REPLY_TIMEOUT_S)
    try:
        assert _closed_by_peer(extra, timeout_s=5.0)
        assert not any(_closed_by_peer(s, timeout_s=0.2) for s in held)
        _wait_for_log(master, "max_connections")
        _check_serving(st, "at-capacity")
    finally:
        for s in (*held, extra):
            s.close()
