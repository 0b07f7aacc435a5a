"""The test etcd's start: a port picked free but taken before etcd binds it costs a restart of
the cluster on fresh ports, not a failed test (a clean-clone CI run once lost a member so)."""

from __future__ import annotations

import itertools
import logging
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from tidekv.bench.ports import free_port
from tidekv.errors import TidekvError
from tidekv.bench import etcd_server
from tidekv.bench.etcd_server import MISSING, EtcdServer, etcd_binary

pytestmark = pytest.mark.skipif(etcd_binary() is None, reason=MISSING)


@pytest.fixture
def taken() -> Iterator[socket.socket]:
    """A port another process holds, listening, for the whole test."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s


def test_a_cluster_whose_member_loses_a_port_starts_again_on_fresh_ports(
        taken: socket.socket, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    port = taken.getsockname()[1]
    picks = itertools.chain([port], iter(free_port, None))
    monkeypatch.setattr(etcd_server, "free_port", lambda: next(picks))
    with caplog.at_level(logging.WARNING, logger=etcd_server.__name__):
        server = EtcdServer(tmp_path, 3)
    try:
        assert "lost a port" in caplog.text
        assert port not in [p for m in server.members for p in (m.client_port, m.peer_port)]
        assert all(m.is_healthy() for m in server.members)
        assert server.leader() in server.members
    finally:
        server.stop()


def test_a_port_taken_at_every_attempt_fails_with_the_members_log(
        taken: socket.socket, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(etcd_server, "free_port", lambda: taken.getsockname()[1])
    with caplog.at_level(logging.WARNING, logger=etcd_server.__name__), \
            pytest.raises(TidekvError, match="address already in use"):
        EtcdServer(tmp_path, 1)
    assert caplog.text.count("lost a port") == etcd_server.START_ATTEMPTS - 1
