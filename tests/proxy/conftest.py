"""Proxy fixtures: fake backends and in-process proxies on one loop thread, all on 127.0.0.1:0.

``backend(role, mode=Mode.OK, **fields)`` starts a FakeBackend; ``start_proxy(prefills, decodes,
**ProxyConfig fields)`` starts a ProxyServer pointed at them and returns its base URL;
``down_url`` is a loopback URL nothing listens on. Everything stops at teardown. A failed test
gets the proxy's log records appended to its report (pytest's caplog section).
Neighbours: ``fakes`` (the backends and the blocking HTTP helpers).
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.proxy.fakes import FakeBackend, LoopThread, Mode
from tidekv.proxy import ProxyConfig, ProxyServer

MakeBackend = Callable[..., FakeBackend]
StartProxy = Callable[..., str]


@pytest.fixture
def loop_thread() -> Iterator[LoopThread]:
    rig = LoopThread()
    yield rig
    rig.close()


@pytest.fixture
def backend(loop_thread: LoopThread) -> Iterator[MakeBackend]:
    started: list[FakeBackend] = []

    def make(role: str, mode: Mode = Mode.OK, **fields: Any) -> FakeBackend:
        fake = FakeBackend(name=f"{role}{sum(b.role == role for b in started)}", role=role, mode=mode, **fields)
        loop_thread.call(fake.start())
        started.append(fake)
        return fake

    yield make
    for fake in started:
        loop_thread.call(fake.stop())


@pytest.fixture
def start_proxy(loop_thread: LoopThread) -> Iterator[StartProxy]:
    servers: list[ProxyServer] = []

    def start(prefills: list[FakeBackend | str], decodes: list[FakeBackend | str], **config: Any) -> str:
        config.setdefault("timeout_s", 5.0)
        server = ProxyServer(ProxyConfig(
            prefill_urls=tuple(b if isinstance(b, str) else b.url for b in prefills),
            decode_urls=tuple(b if isinstance(b, str) else b.url for b in decodes),
            host="127.0.0.1", port=0, **config))
        servers.append(server)
        return loop_thread.call(server.start())

    yield start
    for server in servers:
        loop_thread.call(server.stop())


@pytest.fixture
def down_url() -> str:
    """A loopback URL with no listener (the port was free a moment ago)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"
