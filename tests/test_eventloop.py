"""tidekv.eventloop: which loop tidekv's servers run on, and a store round trip on each."""

from __future__ import annotations

import asyncio

import pytest

from tidekv import eventloop
from tidekv.config import StoreConfig
from tidekv.errors import ConfigError
from tidekv.store import Store
from tidekv.store.master.server import MasterServer


def test_the_choice_follows_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("uvloop", reason="uvloop is a dependency of tidekv on CPython; it is not installed here")
    monkeypatch.delenv(eventloop.VARIABLE, raising=False)
    assert eventloop.kind() == "uvloop"
    monkeypatch.setenv(eventloop.VARIABLE, "asyncio")
    assert eventloop.kind() == "asyncio"
    assert type(eventloop.new_event_loop()).__module__.startswith("asyncio")
    monkeypatch.setenv(eventloop.VARIABLE, "tokio")
    with pytest.raises(ConfigError, match="TIDEKV_EVENT_LOOP='tokio' is invalid; allowed: auto, uvloop, asyncio"):
        eventloop.kind()


def test_run_returns_the_coroutines_result(monkeypatch: pytest.MonkeyPatch) -> None:
    async def answer() -> int:
        await asyncio.sleep(0)
        return 42

    for kind in ("auto", "asyncio"):
        monkeypatch.setenv(eventloop.VARIABLE, kind)
        assert eventloop.run(answer()) == 42


@pytest.mark.parametrize("kind", ["asyncio", "uvloop"])
def test_a_master_serves_on_either_loop(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if kind == "uvloop":
        pytest.importorskip("uvloop", reason="uvloop is a dependency of tidekv on CPython; it is not installed here")
    monkeypatch.setenv(eventloop.VARIABLE, kind)
    from tidekv.config import MasterConfig

    server = MasterServer(MasterConfig(port=0, metrics_port=-1)).start()
    try:
        assert server.loop is not None and (type(server.loop).__module__.split(".")[0] == kind)
        with Store.connect(f"127.0.0.1:{server.rpc_port}", segment_size=4 << 20,
                           config=StoreConfig(staging_size_bytes=1 << 20)) as store:
            store.put_many([b"a", b"b"], [b"x" * 1000, b"y" * 5000])
            assert store.get_many([b"a", b"b", b"c"]) == [b"x" * 1000, b"y" * 5000, None]
    finally:
        server.stop()
