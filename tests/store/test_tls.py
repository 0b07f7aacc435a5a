"""The master's RPC over TLS (issue 17, item 1, optional encryption in transit): a client with
the CA reaches it, a plain client or one trusting another CA does not (a typed error naming TLS);
with --tls-ca-file the master requires client certificates; TLS and the shared secret combine."""

from __future__ import annotations

from pathlib import Path

import pytest
from tidekv.bench.etcd_server import EtcdServer
from tidekv.config import MasterConfig, StoreConfig, TlsConfig, TransferConfig
from tidekv.errors import AuthenticationError, ConfigError, MasterUnavailableError
from tidekv.store.client.store import Store

from tests.store.cluster_rig import MASTER, in_sync, leader_of
from tests.store.conftest import SpawnMaster
from tests.store.tls_certs import Certs, make_certs

CONFIG = StoreConfig(staging_size_bytes=1 << 20, rpc_timeout_s=3.0, failover_timeout_s=0.0)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


def _store(address: str, tls: TlsConfig, secret: str | None = None) -> Store:
    return Store.connect(address, 1 << 20, config=CONFIG, tls=tls, transfer_config=TransferConfig(secret=secret))


def test_a_client_with_the_ca_reaches_a_tls_master_and_others_do_not(spawn_master: SpawnMaster, certs: Certs) -> None:
    master = spawn_master(tls_cert_file=certs.server_cert, tls_key_file=certs.server_key)
    with _store(master.address, TlsConfig(enable=True, ca_file=certs.ca)) as st:
        st.put("k", b"over tls" * 1000)
        assert st.get("k") == b"over tls" * 1000
    with pytest.raises(MasterUnavailableError):  # plain TCP: the master's TLS layer drops it
        _store(master.address, TlsConfig())
    with pytest.raises(MasterUnavailableError, match="TLS with master .* failed"):
        _store(master.address, TlsConfig(enable=True, ca_file=certs.other_ca))


def test_mutual_tls_requires_a_client_certificate(spawn_master: SpawnMaster, certs: Certs) -> None:
    master = spawn_master(tls_cert_file=certs.server_cert, tls_key_file=certs.server_key, tls_ca_file=certs.ca)
    with _store(master.address, TlsConfig(True, certs.ca, certs.client_cert, certs.client_key)) as st:
        st.put("k", b"v")
        assert st.get("k") == b"v"
    with pytest.raises(MasterUnavailableError):
        _store(master.address, TlsConfig(enable=True, ca_file=certs.ca))


def test_tls_and_the_secret_combine(spawn_master: SpawnMaster, certs: Certs) -> None:
    master = spawn_master(tls_cert_file=certs.server_cert, tls_key_file=certs.server_key, secret="s")
    tls = TlsConfig(enable=True, ca_file=certs.ca)
    with _store(master.address, tls, secret="s") as st:
        st.put("k", b"v")
        assert st.get("k") == b"v"
    with pytest.raises(AuthenticationError, match="requires a shared secret"):
        _store(master.address, tls)


def test_tls_settings_are_checked(tmp_path: Path, certs: Certs) -> None:
    with pytest.raises(ConfigError, match="go together"):
        MasterConfig(tls_cert_file=certs.server_cert)
    with pytest.raises(ConfigError, match="needs the master's own"):
        MasterConfig(tls_ca_file=certs.ca)
    with pytest.raises(ConfigError, match="cannot be read"):
        MasterConfig(tls_cert_file=str(tmp_path / "missing.pem"), tls_key_file=certs.server_key)
    with pytest.raises(ConfigError, match="enable is false"):
        TlsConfig(ca_file=certs.ca)
    assert TlsConfig.from_env({"TIDEKV_TLS_ENABLE": "1", "TIDEKV_TLS_CA_FILE": certs.ca}).ca_file == certs.ca


def test_a_cluster_replicates_and_fails_over_over_mutual_tls(etcd: EtcdServer, spawn_master: SpawnMaster,
                                                            certs: Certs) -> None:
    """Standbys reach the leader over TLS with the masters' own certificates (the CA checks both
    ends), and a client follows the new leader after the old one is killed, objects intact."""
    tls = {"tls_cert_file": certs.server_cert, "tls_key_file": certs.server_key, "tls_ca_file": certs.ca}
    masters = [spawn_master(etcd=etcd.url, cluster="tls", secret="s", **MASTER, **tls) for _ in range(2)]
    leader = leader_of(masters)
    in_sync(masters, 1)
    client_tls = TlsConfig(True, certs.ca, certs.client_cert, certs.client_key)
    config = StoreConfig(staging_size_bytes=1 << 20, rpc_timeout_s=1.0, failover_timeout_s=15.0)
    holder = Store.connect(f"etcd://{etcd.endpoints}/tls", 4 << 20, config=config, tls=client_tls,
                           transfer_config=TransferConfig(secret="s"))
    try:
        for i in range(20):
            holder.put(f"k{i}", bytes([i]) * 5000)
        leader.kill()
        assert leader_of([m for m in masters if m is not leader]) is not leader
        for i in range(20):
            assert holder.get(f"k{i}") == bytes([i]) * 5000, f"k{i} after the failover"
    finally:
        holder.close()
