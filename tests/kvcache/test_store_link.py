"""StoreLink: a connector's store client that comes back by itself, against a real master
process started late, stopped and restarted on one port."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import pytest
from tidekv.bench.ports import free_port
from tidekv.channel import Backoff
from tidekv.config import StoreConfig
from tidekv.errors import ConfigError, MasterUnavailableError, ObjectNotFoundError
from tidekv.kvcache.store_link import LinkState, StoreLink
from tidekv.store import Store

from tests.store.conftest import (
    SpawnMaster,
    spawn_master,  # noqa: F401 (fixture)
)
from tests.store.procs import wait_until

FAST = Backoff(initial_s=0.05, factor=2.0, max_s=0.2)


def _connector(address: str) -> Callable[[], Store]:
    config = StoreConfig(rpc_timeout_s=0.3, failover_timeout_s=0, heartbeat_interval_s=0.1, staging_size_bytes=1 << 20)
    return lambda: Store.connect(address, segment_size=4 << 20, config=config)  # a pool of its own


def _lines(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


def test_backoff_doubles_up_to_its_cap_and_refuses_nonsense() -> None:
    b = Backoff(initial_s=0.5, factor=2.0, max_s=10.0)
    assert [b.delay_s(n) for n in range(7)] == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    assert b.delay_s(10_000) == 10.0
    with pytest.raises(ConfigError, match="initial_s"):
        Backoff(initial_s=0)
    with pytest.raises(ConfigError, match="initial_s"):
        Backoff(initial_s=5, max_s=1)
    with pytest.raises(ConfigError, match="factor"):
        Backoff(factor=0.5)


def test_master_started_after_the_link_is_used_once_it_answers(spawn_master: SpawnMaster,  # noqa: F811
                                                               caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="tidekv.kvcache.store_link")
    port = free_port()
    address = f"127.0.0.1:{port}"
    link = StoreLink(address, _connector(address), owner="scheduler", backoff=FAST)
    try:
        assert link.state is LinkState.DOWN and link.store is None
        assert not link.wait_up(0.5), "nothing listens yet"
        spawn_master(port=port)
        assert link.wait_up(10.0), "the link came back once the master answered"
        store = link.store
        assert store is not None
        store.put("k", b"v")
        assert store.get("k") == b"v"
        off, on = _lines(caplog, "prefix reuse is off"), _lines(caplog, "prefix reuse is on")
        assert len(off) == 1 and address in off[0] and "unreachable" in off[0] and "scheduler" in off[0]
        assert len(on) == 1 and "answers again" in on[0]
        assert len(_lines(caplog, "still unreachable")) >= 2, "it kept retrying while the master was down"
    finally:
        link.close()
    assert link.state is LinkState.CLOSED and link.store is None


def test_master_that_goes_away_and_comes_back(spawn_master: SpawnMaster,  # noqa: F811
                                              caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tidekv.kvcache.store_link")
    master = spawn_master()
    address, port = master.address, master.port
    link = StoreLink(address, _connector(address), owner="rank 0", backoff=FAST)
    try:
        first = link.store
        assert first is not None and link.state is LinkState.UP
        link.lost(ObjectNotFoundError("not the master's fault"))
        assert link.store is first, "only a master that does not answer takes the link down"
        master.stop()
        with pytest.raises(MasterUnavailableError) as err:
            first.exists_many(["k"])
        link.lost(err.value)
        link.lost(err.value)  # a second failure of the same outage says nothing more
        assert link.store is None and link.state is LinkState.DOWN
        assert not link.wait_up(0.5)
        spawn_master(port=port)
        assert link.wait_up(10.0)
        assert link.store is first, "the same client: it re-registers with the new master by itself"
        assert link.store.exists_many(["k"]) == [False]
        assert len(_lines(caplog, "prefix reuse is off")) == 1
        assert "stopped answering" in _lines(caplog, "prefix reuse is off")[0]
        assert len(_lines(caplog, "prefix reuse is on")) == 2  # connected, then answers again
    finally:
        link.close()


def test_close_while_retrying_stops_the_thread_promptly() -> None:
    address = f"127.0.0.1:{free_port()}"
    link = StoreLink(address, _connector(address), owner="scheduler", backoff=Backoff(initial_s=5.0, max_s=5.0))
    thread = link._thread
    assert thread is not None and thread.is_alive()
    link.close()
    assert not thread.is_alive(), "close() woke the retry thread out of its backoff sleep"


class _Client:
    def exists_many(self, keys: object) -> list[bool]:
        return [False]

    def close(self) -> None:
        pass


def test_try_now_does_not_wait_for_the_backoff() -> None:
    """A caller that knows the master answers again (the scheduler found blocks there) gets the
    client at once, though the retry thread would sleep on; but no more often than initial_s."""
    calls, who, up, me = [], [], [False], threading.get_ident()

    def connect() -> _Client:
        calls.append(time.monotonic())
        who.append(threading.get_ident() == me)  # True: this test's thread (try_now), False: the retry thread
        if not up[0]:
            raise MasterUnavailableError("down")
        return _Client()

    link = StoreLink("h:1", connect, owner="rank 0", backoff=Backoff(initial_s=0.2, factor=1000.0, max_s=1000.0))
    try:
        assert link.try_now() is None and len(calls) == 1, "no second attempt within initial_s of the first"
        # Ordered by the event, not a sleep: the retry thread's attempt (at 0.2 s) came; then
        # initial_s passes after it on purpose, so try_now may try again.
        wait_until(lambda: len(calls) >= 2, 10.0, "the retry thread's attempt after initial_s")
        assert who == [True, False], "the second attempt was the retry thread's"
        time.sleep(max(0.0, calls[1] + 0.2 + 0.02 - time.monotonic()))
        assert len(calls) == 2, "the retry thread tried once at 0.2 s and now sleeps 200 s"
        up[0] = True
        store = link.try_now()
        assert isinstance(store, _Client) and len(calls) == 3
        assert who == [True, False, True], "try_now's attempt came after the retry thread's"
        assert calls[2] - calls[1] >= 0.2, "and not within initial_s of it"
        assert link.state is LinkState.UP and link.store is store and link.try_now() is store
    finally:
        link.close()


def test_a_lookup_only_master_client_is_a_link_client(spawn_master: SpawnMaster) -> None:  # noqa: F811
    """What the vLLM scheduler links to: a MasterClient (no transfer engine, no staging) that
    fails at once while the master is down and answers again once it is back."""
    from tidekv.store.client.master_client import MasterClient

    master = spawn_master()
    address, port = master.address, master.port

    def connect() -> MasterClient:
        client = MasterClient(address, "scheduler-test", timeout_s=0.3)
        client.connect()
        return client

    link = StoreLink(address, connect, owner="scheduler", backoff=FAST)
    try:
        client = link.store
        assert isinstance(client, MasterClient) and client.exists_many(["k"]) == [False]
        master.stop()
        started = time.monotonic()
        with pytest.raises(MasterUnavailableError) as err:
            client.exists_many(["k"])
        assert time.monotonic() - started < 1.0, "one attempt: the scheduling path does not wait out a failover"
        link.lost(err.value)
        spawn_master(port=port)
        assert link.wait_up(10.0) and link.store is client
        assert client.exists_many(["k"]) == [False]
    finally:
        link.close()
