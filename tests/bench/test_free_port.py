"""``free_port``: a port a server can bind a moment later, outside the range outgoing
connections take their ports from."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tidekv.bench import ports
from tidekv.bench.ports import free_port


def _listen(port: int) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()


def test_a_free_port_lies_below_the_ephemeral_range_and_can_be_bound() -> None:
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    picked = [free_port() for _ in range(20)]
    assert all(1024 <= p < low for p in picked), (low, picked)
    assert len(set(picked)) > 1, "picked at random"
    for port in picked:
        _listen(port)


def test_without_the_range_the_kernel_picks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "_EPHEMERAL_RANGE", tmp_path / "missing")
    port = free_port()
    _listen(port)


def test_a_taken_port_is_not_given(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        picks = iter([taken] * ports._FREE_PORT_TRIES)

        class Rng:
            def randrange(self, start: int, stop: int) -> int:
                return next(picks)

        monkeypatch.setattr(ports.random, "SystemRandom", Rng)
        port = free_port()
        assert port != taken
        _listen(port)
