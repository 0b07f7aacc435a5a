"""``EtcdServer`` with its members on rig hosts (``hosts=``): each member listens on its host's
address only, the server's own calls (health, who leads) reach members this process has no route
to, and a member is SIGKILLed and started again on its host as on loopback. Neighbours:
``tests/store/test_etcd_server.py`` (the loopback default), ``test_ha_hosts.py`` (masters on it).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.multihost.rig import Rig
from tidekv.errors import ConfigError
from tidekv.bench.etcd_server import MISSING, EtcdHost, EtcdServer, etcd_binary

pytestmark = pytest.mark.skipif(etcd_binary() is None, reason=MISSING)

PROBE = str(Path(__file__).with_name("probe.py"))


def _connect(rig: Rig, host: int, address: str, port: int) -> dict[str, object]:
    done = rig.hosts[host].run([sys.executable, "-I", PROBE, "connect", address, str(port), "2"], timeout_s=15)
    assert done.returncode == 0, done.stderr
    out: dict[str, object] = json.loads(done.stdout)
    return out


def test_members_listen_on_their_hosts_and_a_killed_one_rejoins(multihost: Callable[..., Rig],
                                                               tmp_path: Path) -> None:
    rig = multihost(3)
    etcd = EtcdServer(tmp_path, hosts=[EtcdHost(h.ip, tuple(h.command([]))) for h in rig.hosts])
    try:
        assert [m.url for m in etcd.members] == [f"http://{h.ip}:{m.client_port}"
                                                 for h, m in zip(rig.hosts, etcd.members)]
        assert etcd.endpoints == ",".join(f"{h.ip}:{m.client_port}" for h, m in zip(rig.hosts, etcd.members))
        first = etcd.members[0]
        assert _connect(rig, 1, rig.hosts[0].ip, first.client_port)["connected"], "reached from another host"
        on_loopback = _connect(rig, 0, "127.0.0.1", first.client_port)
        assert not on_loopback["connected"] and "Refused" in str(on_loopback["error"]), "not on loopback"
        leader = etcd.leader()
        leader.kill()
        assert not leader.is_alive()
        assert etcd.leader() is not leader, "the two others elect a leader"
        leader.start()
        leader.wait_healthy()
        assert all(m.is_healthy() for m in etcd.members)
    finally:
        etcd.stop()
    assert not any(m.is_alive() for m in etcd.members)


def test_hosts_give_the_number_of_members(tmp_path: Path) -> None:
    hosts = [EtcdHost("10.0.0.1", ("true",)), EtcdHost("10.0.0.2", ("true",))]
    with pytest.raises(ConfigError, match="one EtcdHost per member"):
        EtcdServer(tmp_path, 3, hosts=hosts)
    with pytest.raises(ConfigError, match="one EtcdHost per member"):
        EtcdServer(tmp_path, hosts=[])
