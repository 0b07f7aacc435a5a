"""Contract of ``tidekv.compat.mooncake.TransferEngine``: Mooncake's method names, arguments and
return codes (reference/mooncake.md §1.2), between real processes on 127.0.0.1.

The peer is ``peer_main`` in a child process; bytes are ``payload(seed, size)`` on both sides and
compared by digest. Data-path failures must come back as Mooncake's codes (-1, batch id 0),
never as exceptions.
"""

from __future__ import annotations

import ctypes
import itertools
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.store.payload import digest, payload
from tests.store.procs import ChildProcess, wait_until
from tidekv.compat.mooncake import TransferEngine, TransferOpcode

SIZE = 1 << 20
PEER_SEED = 7
LOCAL_SEED = 11

SpawnPeer = Callable[..., ChildProcess]


@pytest.fixture
def spawn_peer(tmp_path: Path) -> Iterator[SpawnPeer]:
    started: list[ChildProcess] = []
    counter = itertools.count()

    def spawn(protocol: str = "tcp", size: int = SIZE, seed: int = PEER_SEED) -> ChildProcess:
        n = next(counter)
        peer = ChildProcess("tests.compat.peer_main", {"protocol": protocol, "size": size, "seed": seed},
                            tmp_path / f"peer-{n}.log", name=f"peer-{n}")
        started.append(peer)
        return peer

    yield spawn
    for peer in started:
        peer.stop()


class LocalBuffer:
    """A ctypes buffer holding ``payload(seed, size)``, with its address."""

    def __init__(self, size: int, seed: int) -> None:
        self.raw = ctypes.create_string_buffer(payload(seed, size), size)
        self.addr = ctypes.addressof(self.raw)
        self.size = size

    def bytes(self, offset: int = 0, length: int | None = None) -> bytes:
        return ctypes.string_at(self.addr + offset, self.size - offset if length is None else length)


@pytest.fixture
def engine() -> Iterator[TransferEngine]:
    te = TransferEngine()
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    yield te
    te.close()


def test_initialize_names_the_session_like_mooncake(engine: TransferEngine) -> None:
    port = engine.get_rpc_port()
    assert 0 < port < 65536
    assert engine.get_engine().name == f"127.0.0.1:{port}"
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == -1  # twice


@pytest.mark.parametrize("metadata_server", ["127.0.0.1:2379", "http://127.0.0.1:8080/metadata", "etcd://x:1"])
def test_metadata_servers_other_than_p2p_handshake_are_refused(metadata_server: str) -> None:
    te = TransferEngine()
    assert te.initialize("127.0.0.1", metadata_server, "tcp", "") == -1
    assert te.initialize_ext("127.0.0.1", metadata_server, "tcp", "", "etcd") == -1


def test_calls_before_initialize_return_failure_codes() -> None:
    te = TransferEngine()
    buf = LocalBuffer(4096, 1)
    assert te.register_memory(buf.addr, buf.size) == -1
    assert te.batch_transfer_sync_write("127.0.0.1:1", [buf.addr], [0], [8]) == -1
    assert te.batch_transfer_async_read("127.0.0.1:1", [buf.addr], [0], [8]) == 0
    assert te.allocate_managed_buffer(4096) == 0


@pytest.mark.parametrize("protocol", ["tcp", "rdma"])  # rdma: tidekv picks shm for a same-host peer
def test_batch_sync_write_and_read_between_processes(spawn_peer: SpawnPeer, protocol: str) -> None:
    peer = spawn_peer(protocol=protocol)
    session, remote = peer.hello["session"], peer.hello["addr"]
    te = TransferEngine()
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", protocol, "") == 0
    try:
        local = LocalBuffer(SIZE, LOCAL_SEED)
        assert te.register_memory(local.addr, local.size) == 0
        # Scatter three local ranges to other offsets at the peer (one empty, as SGLang may send).
        srcs, dsts, lens = [0, 4096, 300_000, 500], [65536, 8192, 700_000, 0], [4096, 1000, 250_000, 0]
        assert te.batch_transfer_sync_write(session, [local.addr + s for s in srcs],
                                            [remote + d for d in dsts], lens) == 0
        for s, d, n in zip(srcs, dsts, lens):
            if n:
                assert peer.call("digest", offset=d, length=n)["digest"] == digest(local.bytes(s, n))
        # Gather the peer's untouched tail into the local buffer.
        peer_bytes = payload(PEER_SEED, SIZE)
        assert te.batch_transfer_sync_read(session, [local.addr, local.addr + 100_000],
                                           [remote + 950_000, remote + 960_000], [10_000, 80_000]) == 0
        assert local.bytes(0, 10_000) == peer_bytes[950_000:960_000]
        assert local.bytes(100_000, 80_000) == peer_bytes[960_000:1_040_000]
        # Single-request spellings and the opcode spelling.
        written = local.bytes(0, 16)
        assert te.transfer_sync_write(session, local.addr, remote, 16) == 0
        assert peer.call("digest", offset=0, length=16)["digest"] == digest(written)
        assert te.transfer_sync_read(session, local.addr + 200_000, remote + 20, 4) == 0
        assert local.bytes(200_000, 4) == peer_bytes[20:24]
        assert te.batch_transfer_sync(session, [local.addr], [remote + 32], [8], TransferOpcode.READ) == 0
        assert local.bytes(0, 8) == peer_bytes[32:40]
    finally:
        te.close()


def test_peer_writes_into_memory_registered_here(spawn_peer: SpawnPeer, engine: TransferEngine) -> None:
    local = LocalBuffer(SIZE, LOCAL_SEED)
    assert engine.register_memory(local.addr, local.size) == 0
    peer = spawn_peer()
    session = f"127.0.0.1:{engine.get_rpc_port()}"
    reply = peer.call("write", session=session, offsets=[0, 5000], remote_addrs=[local.addr + 1000, local.addr + 90_000],
                      lengths=[2000, 40_000])
    assert reply["ret"] == 0
    peer_bytes = payload(PEER_SEED, SIZE)
    assert local.bytes(1000, 2000) == peer_bytes[0:2000]
    assert local.bytes(90_000, 40_000) == peer_bytes[5000:45_000]
    # After unregistering, the peer's write is refused with -1 (and nothing is written).
    assert engine.unregister_memory(local.addr) == 0
    before = local.bytes()
    assert peer.call("write", session=session, offsets=[0], remote_addrs=[local.addr], lengths=[64])["ret"] == -1
    assert local.bytes() == before


def test_async_batches_and_status_codes(spawn_peer: SpawnPeer, engine: TransferEngine) -> None:
    peer = spawn_peer()
    session, remote = peer.hello["session"], peer.hello["addr"]
    local = LocalBuffer(SIZE, LOCAL_SEED)
    assert engine.register_memory(local.addr, local.size) == 0
    ids = [engine.batch_transfer_async_write(session, [local.addr + i * 1024], [remote + i * 1024], [1024])
           for i in range(4)]
    ids.append(engine.batch_transfer_async(session, [local.addr + 8192], [remote + 8192], [4096], TransferOpcode.WRITE))
    assert all(i > 0 for i in ids) and len(set(ids)) == len(ids)
    assert engine.get_batch_transfer_status(ids) == 0
    assert peer.call("digest", offset=0, length=4096)["digest"] == digest(local.bytes(0, 4096))
    assert peer.call("digest", offset=8192, length=4096)["digest"] == digest(local.bytes(8192, 4096))
    assert engine.get_batch_transfer_status(ids[:1]) == -1  # forgotten once reported
    one = engine.transfer_submit_write(session, local.addr, remote + 500_000, 65536)
    assert one > 0
    code = wait_until(lambda: engine.transfer_check_status(one) or None, 10.0, "transfer_check_status != 0",
                      interval_s=0.001)
    assert code == 1
    assert engine.transfer_check_status(one) == -1  # forgotten once done
    assert engine.transfer_check_status(123456) == -1


def test_failures_come_back_as_codes_not_exceptions(spawn_peer: SpawnPeer, engine: TransferEngine) -> None:
    peer = spawn_peer()
    session, remote = peer.hello["session"], peer.hello["addr"]
    local = LocalBuffer(SIZE, LOCAL_SEED)
    assert engine.register_memory(local.addr, local.size) == 0
    unregistered = LocalBuffer(4096, 3)
    # Bad peer (nobody listens), malformed session, beyond the peer's region, unregistered local memory.
    assert engine.batch_transfer_sync_write("127.0.0.1:1", [local.addr], [remote], [64]) == -1
    assert engine.transfer_sync_write("no-port-here", local.addr, remote, 64) == -1
    assert engine.batch_transfer_sync_write(session, [local.addr], [remote + SIZE - 10], [64]) == -1
    assert engine.batch_transfer_sync_read(session, [unregistered.addr], [remote], [64]) == -1
    assert engine.batch_transfer_sync_write(session, [local.addr, local.addr], [remote], [64]) == -1  # lengths differ
    assert engine.batch_transfer_sync(session, [local.addr], [remote], [64], 7) == -1  # no such opcode
    assert engine.transfer_sync(session, local.addr, remote, 64, TransferOpcode.WRITE, notify=object()) == -1
    assert engine.batch_transfer_async_write("127.0.0.1:1", [local.addr], [remote], [64]) == 0
    # The peer is still usable after all of that, and nothing outside the good range moved.
    assert peer.call("digest", offset=0, length=SIZE)["digest"] == digest(payload(PEER_SEED, SIZE))
    assert engine.batch_transfer_sync_write(session, [local.addr], [remote], [64]) == 0
    # A peer that died: probe and transfers say -1.
    assert engine.send_probe(session) == 0
    peer.kill()
    assert engine.send_probe(session) == -1
    assert engine.batch_transfer_sync_write(session, [local.addr], [remote], [64]) == -1
    assert engine.send_probe("127.0.0.1:1") == -1


def test_memory_registration_codes(engine: TransferEngine) -> None:
    a, b = LocalBuffer(8192, 1), LocalBuffer(8192, 2)
    assert engine.batch_register_memory([a.addr, b.addr], [a.size, b.size]) == 0
    assert engine.register_memory(a.addr + 100, 100) == -1  # overlaps a registered region
    assert engine.batch_register_memory([a.addr], [1, 2]) == -1  # lengths differ
    assert engine.register_memory(a.addr, a.size, "cuda:0") == -1  # host memory is not GPU memory
    assert engine.batch_unregister_memory([a.addr, b.addr]) == 0
    assert engine.unregister_memory(a.addr) == -1  # not registered any more
    assert engine.register_memory(a.addr, a.size, "cpu:0") == 0  # and can be registered again


def test_managed_buffers_and_byte_helpers(spawn_peer: SpawnPeer, engine: TransferEngine) -> None:
    addr = engine.allocate_managed_buffer(65536)
    assert addr != 0
    data = payload(5, 65536)
    assert engine.write_bytes_to_buffer(addr, data, len(data)) == 0
    assert engine.read_bytes_from_buffer(addr, len(data)) == data
    assert engine.write_bytes_to_buffer(addr, b"ab", 3) == -1
    peer = spawn_peer()
    assert engine.batch_transfer_sync_write(peer.hello["session"], [addr], [peer.hello["addr"]], [65536]) == 0
    assert peer.call("digest", offset=0, length=65536)["digest"] == digest(data)
    assert engine.free_managed_buffer(addr, 65536) == 0
    assert engine.free_managed_buffer(addr, 65536) == -1


@pytest.mark.parametrize(("protocol", "provider"), [("rdma", "verbs"), ("efa", "efa")])
def test_rdma_protocols_select_fabric_and_say_when_it_cannot_run(
        protocol: str, provider: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Mooncake's wheel turns "rdma" into tcp without a word where there is no NIC; the drop-in
    asks the fabric transport for that provider and logs why it cannot run instead."""
    monkeypatch.delenv("TIDEKV_FABRIC_PROVIDER", raising=False)
    te = TransferEngine()
    try:
        with caplog.at_level("WARNING", logger="tidekv.compat.mooncake"):
            assert te.initialize("127.0.0.1", "P2PHANDSHAKE", protocol, "") == 0
        engine = te.get_engine()
        assert engine.config.fabric_provider == provider
        [(available, reason)] = [(a, r) for name, a, r in engine.transports() if name == "fabric"]
        if not available:
            assert f"protocol {protocol!r} asks for RDMA" in caplog.text and reason in caplog.text
    finally:
        te.get_engine().close()


def test_mooncake_device_names_become_fabric_nics(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mooncake's ``device_name`` / ``rdma_devices`` ("mlx5_0,mlx5_1") name the NICs fabric
    stripes over, for "rdma" and "efa"; ``TIDEKV_FABRIC_NICS`` set wins; too many is refused."""
    from tidekv.compat import mooncake_store
    from tidekv.compat.mooncake import transfer_config_for
    from tidekv.config import TransportKind
    from tidekv.errors import ConfigError

    for variable in ("TIDEKV_FABRIC_PROVIDER", "TIDEKV_FABRIC_NICS", "TIDEKV_TRANSPORT", "MC_FORCE_TCP"):
        monkeypatch.delenv(variable, raising=False)
    config = transfer_config_for("rdma", "mlx5_0,mlx5_1")
    assert (config.transport, config.fabric_provider, config.fabric_nics) == \
        (TransportKind.AUTO, "verbs", "mlx5_0,mlx5_1")
    assert transfer_config_for("efa", "rdmap0s6-rdm").fabric_nics == "rdmap0s6-rdm"
    tcp = transfer_config_for("tcp", "mlx5_0")
    assert (tcp.transport, tcp.fabric_nics) == (TransportKind.TCP, "")
    with pytest.raises(ConfigError, match="fabric_nics"):
        transfer_config_for("rdma", ",".join(f"mlx5_{i}" for i in range(9)))
    monkeypatch.setenv("TIDEKV_FABRIC_NICS", "mlx5_3")
    assert transfer_config_for("rdma", "mlx5_0").fabric_nics == "mlx5_3"
    monkeypatch.delenv("TIDEKV_FABRIC_NICS")

    # The store's setup() starts its engine the same way (its "tcp" keeps same-host peers on shm).
    started = []

    def recorded(protocol: str, devices: str = "") -> object:
        started.append(transfer_config_for(protocol, devices))
        return started[-1]

    class NoMaster:
        @staticmethod
        def connect(*args: object, **kwargs: object) -> None:
            raise ConfigError("no master: setup fails after its engine started, which is all this test needs")

    monkeypatch.setattr(mooncake_store, "transfer_config_for", recorded)
    monkeypatch.setattr(mooncake_store, "Store", NoMaster)
    store = mooncake_store.MooncakeDistributedStore()
    assert store.setup("127.0.0.1", "P2PHANDSHAKE", 1 << 20, 1 << 20, "rdma", "mlx5_0,mlx5_1", "127.0.0.1:1") != 0
    assert store.setup("127.0.0.1", "P2PHANDSHAKE", 1 << 20, 1 << 20, "tcp", "", "127.0.0.1:1") != 0
    assert [(c.transport, c.fabric_provider, c.fabric_nics) for c in started] == [
        (TransportKind.AUTO, "verbs", "mlx5_0,mlx5_1"), (TransportKind.AUTO, "", "")]
