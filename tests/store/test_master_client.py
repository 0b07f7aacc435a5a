"""MasterClient's retry table, against real master processes and a master that never answers.

Read-only and idempotent calls wait out a master restart (up to failover_timeout_s) and then
succeed; a put_start that may have reached a master is never sent twice; failover_timeout_s=0
means one attempt; the typed errors name the master.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator

import pytest
from tidekv.auth import ServerHandshake
from tidekv.config import MasterAddress
from tidekv.errors import ConfigError, MasterUnavailableError, ObjectLeasedError
from tidekv.store.client.master_client import MasterClient
from tidekv.store.wire import protocol as p

from tests.store import wire
from tests.store.conftest import Connect, SpawnMaster
from tests.store.procs import wait_until


@pytest.fixture
def silent_master() -> Iterator[str]:
    """A TCP listener that accepts connections, completes the handshake (so a request sent
    afterwards may have arrived), reads everything and never answers."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.1)
    stop = threading.Event()
    conns: list[socket.socket] = []

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            conns.append(conn)
            conn.settimeout(5)
            try:
                wire.recv_exact(conn, len(p.MAGIC))
                conn.sendall(p.frame(ServerHandshake(None, "master", "client").greeted(wire.recv_frame(conn))))
            except OSError:
                pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    thread.join(5)
    for conn in conns:
        conn.close()
    server.close()


def test_addresses_parse_in_one_place() -> None:
    assert MasterAddress.parse("10.0.0.5:50051").address == "10.0.0.5:50051"
    cluster = MasterAddress.parse("etcd://a:2379,b:2379/pool-1")
    assert (cluster.address, cluster.etcd_endpoints, cluster.cluster) == (None, ("http://a:2379", "http://b:2379"), "pool-1")
    assert str(cluster) == "etcd://a:2379,b:2379/pool-1"
    for bad in ("nohost", "h:0", "h:99999", "etcd://a:2379", "etcd://a:2379/", "etcd://a/x", "etcd://a:1/x/y"):
        with pytest.raises(ConfigError):
            MasterAddress.parse(bad)


def test_put_start_that_may_have_arrived_is_not_sent_again(connect: Connect, silent_master: str) -> None:
    client = MasterClient(silent_master, "t", timeout_s=0.3, failover_timeout_s=30.0)
    try:
        started = time.monotonic()
        with pytest.raises(MasterUnavailableError, match=silent_master) as info:
            client.call(p.PutStart("t", [b"k"], [10]))
        assert info.value.is_request_sent
        assert time.monotonic() - started < 2.0, "one attempt only, not failover_timeout_s of them"
    finally:
        client.close()


def test_read_is_retried_until_failover_timeout(silent_master: str) -> None:
    client = MasterClient(silent_master, "t", timeout_s=0.2, failover_timeout_s=1.5)
    try:
        started = time.monotonic()
        with pytest.raises(MasterUnavailableError, match="did not answer Exists"):
            client.exists_many(["k"])
        assert 1.2 <= time.monotonic() - started < 3.0
    finally:
        client.close()


def test_zero_failover_timeout_is_one_attempt() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    client = MasterClient(address, "t", timeout_s=1.0)
    try:
        started = time.monotonic()
        with pytest.raises(MasterUnavailableError, match="cannot reach") as info:
            client.exists_many(["k"])
        assert not info.value.is_request_sent
        assert time.monotonic() - started < 0.5
    finally:
        client.close()


def test_reads_and_put_end_wait_out_a_master_restart(spawn_master: SpawnMaster, connect: Connect,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="tidekv.store.client.master_client")
    first = spawn_master()
    store = connect(first.address, segment_size=1 << 20, failover_timeout_s=20.0)
    store.put("before", b"x" * 100)
    first.kill()
    answers: dict[str, object] = {}

    def read() -> None:
        try:
            answers["exists"] = store.exists_many(["before", "nothing"])
        except Exception as exc:  # noqa: BLE001 - judged below
            answers["exists"] = exc

    def retries() -> int:  # the read's attempts that found no master
        return sum(1 for r in list(caplog.records)
                   if r.threadName == "reader" and "looking for the leader again" in r.getMessage())

    reader = threading.Thread(target=read, name="reader")
    started = time.monotonic()
    reader.start()
    # Ordered by the event, not a sleep: the read reached the dead master and is retrying before
    # the new one starts; then it keeps waiting a while (wall time passes on purpose).
    wait_until(retries, 10.0, "the read to find no master and retry")
    time.sleep(max(0.0, started + 1.0 - time.monotonic()))
    assert reader.is_alive(), "the read waits for a master rather than failing"
    assert retries() >= 2, "it went on retrying"
    spawn_master(port=first.port)
    reader.join(25)
    # Without --state-dir the new master starts empty; the read itself came through.
    assert answers["exists"] == [False, False]
    store.put("after", b"y" * 100)
    assert store.get("after") == b"y" * 100
    # put_end is idempotent: ending an ended put again answers OK (what a retry after a failover sees).
    # (A client of its own: a connection acts only for the client it said hello as.)
    client = MasterClient(first.address, "twice-writer", timeout_s=2.0, register=True)
    try:
        token = client.call(p.PutStart("twice-writer", [b"twice"], [100]))[0].token
        assert client.call(p.PutEnd("twice-writer", [b"twice"], [token])) == [p.Status.OK]
        assert client.call(p.PutEnd("twice-writer", [b"twice"], [token])) == [p.Status.OK]
        assert client.call(p.PutEnd("twice-writer", [b"twice"], [token + 1000])) == [p.Status.STALE]
    finally:
        client.close()


def test_exists_leased_takes_a_read_lease_on_what_it_finds(spawn_master: SpawnMaster, connect: Connect) -> None:
    """The connectors' lookup (``PrefixReuse``): a block found is leased, so nothing removes or
    evicts it before the load planned on the answer reads it."""
    master = spawn_master(lease_ttl_s=30.0)
    st = connect(master.address, segment_size=1 << 20)
    st.put("block", b"kv")
    client = MasterClient(master.address, "lookup", timeout_s=5.0)
    try:
        assert client.exists_leased(["block", "missing"]) == [True, False]
    finally:
        client.close()
    with pytest.raises(ObjectLeasedError):
        st.remove("block")
