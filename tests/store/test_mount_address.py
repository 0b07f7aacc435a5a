"""The master refuses a segment whose engine listens on loopback when its client connected from
another address, and a store's engine defaults to the address that routes to its master.
(Between real "hosts", network namespaces, the same is checked in tests/multihost.)"""

from __future__ import annotations

import urllib.request

import pytest

from tests.store.conftest import SpawnMaster
from tidekv.config import StoreConfig
from tidekv.errors import ConfigError
from tidekv.hostaddr import HOST_VARIABLE, default_route_source
from tidekv.store import Store


def _own_address() -> str:
    address = default_route_source()
    if address is None:
        pytest.skip("this machine has no default route, so no non-loopback address for the master")
    return address


def _failures(host: str, metrics_port: int, reason: str) -> float:
    with urllib.request.urlopen(f"http://{host}:{metrics_port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    prefix = f'tidekv_master_request_failures_total{{reason="{reason}"}} '
    return sum(float(line[len(prefix):]) for line in text.splitlines() if line.startswith(prefix))


def test_a_loopback_engine_named_from_another_address_is_refused(spawn_master: SpawnMaster,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(HOST_VARIABLE, raising=False)
    own = _own_address()
    master = spawn_master(host=own)
    config = StoreConfig(rpc_timeout_s=5.0)
    with pytest.raises(ConfigError) as info:
        Store.connect(master.address, segment_size=1 << 20, config=config, host="127.0.0.1")
    text = str(info.value)
    assert "loopback" in text and f"connected from {own}" in text and HOST_VARIABLE in text, text
    assert _failures(own, master.metrics_port, "loopback_engine") == 1
    # Left unset, the engine takes the address that routes to the master, and the pool works.
    with Store.connect(master.address, segment_size=1 << 20, config=config) as holder, \
            Store.connect(master.address, segment_size=0, config=config) as client:
        assert holder.engine.name.startswith(f"{own}:"), holder.engine.name
        client.put("k", b"across")
        assert client.get("k") == b"across"
    assert _failures(own, master.metrics_port, "loopback_engine") == 1


def test_a_master_on_loopback_keeps_engines_on_loopback(spawn_master: SpawnMaster,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(HOST_VARIABLE, raising=False)
    master = spawn_master()
    with Store.connect(master.address, segment_size=1 << 20) as st:
        assert st.engine.name.startswith("127.0.0.1:"), st.engine.name
    monkeypatch.setenv(HOST_VARIABLE, "127.0.0.1")
    with Store.connect(master.address, segment_size=1 << 20) as st:
        assert st.engine.name.startswith("127.0.0.1:")


def test_ipv6_addresses_print_and_parse_bracketed(monkeypatch: pytest.MonkeyPatch) -> None:
    from tidekv.config import MasterConfig
    from tidekv.store import MasterServer

    monkeypatch.delenv(HOST_VARIABLE, raising=False)
    try:
        server = MasterServer(MasterConfig(host="::1", port=0, metrics_port=-1)).start()
    except ConfigError as exc:
        pytest.skip(f"no IPv6 loopback here: {exc}")
    try:
        assert server.address.startswith("[::1]:"), server.address
        with Store.connect(server.address, segment_size=1 << 20) as holder, \
                Store.connect(server.address, segment_size=0) as client:
            assert holder.engine.name.startswith("[::1]:"), holder.engine.name
            client.put("k", b"over v6")
            assert client.get("k") == b"over v6"
    finally:
        server.stop()
