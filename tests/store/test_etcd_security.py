"""A secured etcd: TLS with client certificates, and etcd's user authentication, against real etcd.

The etcd client's every call over https with a client certificate and a user; each
misconfiguration (a wrong CA, no client certificate, one etcd's gateway refuses, a wrong
password, no user, a user without the role) failing at once with a typed error that names the
endpoint and the setting; a token that etcd drops (expired, or authentication switched off and
on) renewed once, transparently, and a renewal that fails naming the user; the settings, from
the variables clients read and the flags masters take; and two ``tidekv master`` processes
electing a leader over such an etcd, found by a ``Store`` configured by the variables alone.
"""

from __future__ import annotations

import dataclasses
import json
import re
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from tidekv.bench.etcd_server import MISSING, EtcdServer, EtcdServerAuth, EtcdServerTls, etcd_binary
from tidekv.cli import build_parser
from tidekv.config import ConfigError, EtcdSecurity, MasterAddress
from tidekv.store.cli import master_config_from_args
from tidekv.store.ha.etcd import (
    EtcdAccessError,
    EtcdAuthError,
    EtcdClient,
    EtcdTlsError,
    EtcdUnavailableError,
    KeyValue,
)

from tests.childproc import REPO_ROOT
from tests.store.conftest import _ETCDS, Connect
from tests.store.procs import wait_until
from tests.store.test_cli import CliMaster
from tests.store.tls_certs import Certs, issue_client_cert, make_certs

pytestmark = pytest.mark.skipif(etcd_binary() is None, reason=MISSING)

PASSWORD = "tidekv-test-password"
QUICK_S = 1.0
"""A refusal must come this fast: well inside the clients' timeout (TIMEOUT_S), so it is etcd's
answer and not a timeout."""
TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("etcd-certs"))


@pytest.fixture(scope="module")
def secured_module(tmp_path_factory: pytest.TempPathFactory, certs: Certs) -> Iterator[EtcdServer]:
    # etcd's gateway refuses client certificates that have a Common Name once auth is on.
    cert, key = issue_client_cert(certs, "gateway-client", "/O=tidekv")
    tls = EtcdServerTls(certs.ca, certs.server_cert, certs.server_key, cert, key)
    server = EtcdServer(tmp_path_factory.mktemp("etcd-secured"), tls=tls, auth=EtcdServerAuth(PASSWORD))
    yield server
    server.stop()


@pytest.fixture
def secured(request: pytest.FixtureRequest, secured_module: EtcdServer) -> EtcdServer:
    """One etcd for the module: https, client certificates required, authentication on (user
    "tidekv", whose role may read and write /tidekv/). Its log is printed when a test fails."""
    request.node.stash.setdefault(_ETCDS, []).append(secured_module)
    return secured_module


@pytest.fixture
def start_etcd(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[..., EtcdServer]]:
    """Factory: ``start_etcd(**EtcdServer options)``, an etcd of this test's own (it may change its users)."""
    started: list[EtcdServer] = []

    def start(**options: Any) -> EtcdServer:
        work_dir = tmp_path / f"etcd{len(started)}"
        work_dir.mkdir()
        server = EtcdServer(work_dir, **options)
        started.append(server)
        request.node.stash.setdefault(_ETCDS, []).append(server)
        return server

    yield start
    for server in started:
        server.stop()


def _client(server: EtcdServer, security: EtcdSecurity | None = None, urls: list[str] | None = None) -> EtcdClient:
    return EtcdClient(urls or server.url.split(","), timeout_s=TIMEOUT_S,
                      security=security if security is not None else server.client_settings())


# ---- the calls ------------------------------------------------------------------------------


def test_every_call_works_over_tls_with_a_client_certificate_and_a_user(secured: EtcdServer) -> None:
    client = _client(secured)
    assert client.endpoints[0].startswith("https://")
    lease = client.grant(5)
    revision = client.create("/tidekv/calls/leader", b"me", lease)
    assert revision > 0
    assert client.create("/tidekv/calls/leader", b"another", lease) == 0
    assert client.get("/tidekv/calls/leader") == KeyValue(b"me", revision, lease)
    assert client.put_if_owner("/tidekv/calls/insync", b"in", "/tidekv/calls/leader", revision)
    assert not client.put_if_owner("/tidekv/calls/insync", b"stale", "/tidekv/calls/leader", revision + 1000)
    client.put("/tidekv/calls/plain", b"put")
    assert [kv.value for kv in map(client.get, ("/tidekv/calls/insync", "/tidekv/calls/plain")) if kv] == [b"in", b"put"]
    assert client.keep_alive(lease) > 0
    client.revoke(lease)
    assert client.get("/tidekv/calls/leader") is None, "the revoked lease took its key along"
    assert client.keep_alive(lease) == 0
    assert client.renewals == 0


def _wrong_ca(s: EtcdSecurity, certs: Certs) -> EtcdSecurity:
    return dataclasses.replace(s, ca_file=certs.other_ca)


def _no_client_cert(s: EtcdSecurity, certs: Certs) -> EtcdSecurity:
    return dataclasses.replace(s, cert_file=None, key_file=None)


def _cert_with_common_name(s: EtcdSecurity, certs: Certs) -> EtcdSecurity:
    return dataclasses.replace(s, cert_file=certs.client_cert, key_file=certs.client_key)


def _wrong_password(s: EtcdSecurity, certs: Certs) -> EtcdSecurity:
    return dataclasses.replace(s, password="not-the-password")


def _unknown_user(s: EtcdSecurity, certs: Certs) -> EtcdSecurity:
    return dataclasses.replace(s, user="nobody")


def _no_user(s: EtcdSecurity, certs: Certs) -> EtcdSecurity:
    return dataclasses.replace(s, user=None, password=None)


MISCONFIGURED = {
    "wrong CA": (_wrong_ca, EtcdTlsError, ["cannot be verified", "TIDEKV_ETCD_CA_FILE", "--etcd-ca-file"]),
    "no client certificate": (_no_client_cert, EtcdTlsError,
                              ["requires a client certificate", "TIDEKV_ETCD_CERT_FILE", "--etcd-key-file"]),
    "client certificate with a Common Name": (_cert_with_common_name, EtcdTlsError, ["Common Name", "/O=tidekv"]),
    "wrong password": (_wrong_password, EtcdAuthError, ["user 'tidekv'", "TIDEKV_ETCD_PASSWORD_FILE",
                                                        "--etcd-password-file"]),
    "unknown user": (_unknown_user, EtcdAuthError, ["user 'nobody'", "TIDEKV_ETCD_USER"]),
    "no user": (_no_user, EtcdAuthError, ["authentication on", "TIDEKV_ETCD_USER", "--etcd-user"]),
}


@pytest.mark.parametrize("case", list(MISCONFIGURED))
def test_each_misconfiguration_fails_at_once_with_a_typed_error_naming_the_endpoint_and_setting(
        secured: EtcdServer, certs: Certs, case: str) -> None:
    settings, error, phrases = MISCONFIGURED[case]
    client = _client(secured, settings(secured.client_settings(), certs))
    started = time.monotonic()
    with pytest.raises(error) as info:
        client.get("/tidekv/misconfigured/leader")
    assert time.monotonic() - started < QUICK_S
    assert secured.url in str(info.value)
    for phrase in phrases:
        assert phrase in str(info.value)
    if isinstance(info.value, EtcdAuthError):
        assert info.value.user == client.security.user


def test_plain_http_to_a_tls_port_says_to_use_tls(secured: EtcdServer) -> None:
    client = _client(secured, EtcdSecurity(), [secured.url.replace("https://", "http://")])
    started = time.monotonic()
    with pytest.raises(EtcdUnavailableError, match="TIDEKV_ETCD_CA_FILE.*https://"):
        client.get("/tidekv/plain/leader")
    assert time.monotonic() - started < QUICK_S


def test_a_plain_http_request_reset_by_a_tls_port_also_says_to_use_tls() -> None:
    """etcd's hang-up on plain http can race the request's last bytes and arrive as a reset: the
    hint must not depend on which of the two the kernel delivers (CI saw the reset)."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def reset_one() -> None:
        conn, _ = listener.accept()
        conn.recv(65536)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with RST
        conn.close()

    server = threading.Thread(target=reset_one, daemon=True)
    server.start()
    try:
        client = EtcdClient([f"http://127.0.0.1:{port}"], timeout_s=TIMEOUT_S, security=EtcdSecurity())
        with pytest.raises(EtcdUnavailableError, match="TIDEKV_ETCD_CA_FILE.*https://"):
            client.get("/tidekv/plain/leader")
    finally:
        server.join(TIMEOUT_S)
        listener.close()


def test_a_user_without_permission_on_a_key_is_told_what_to_grant(secured: EtcdServer) -> None:
    client = _client(secured)
    with pytest.raises(EtcdAuthError, match=r"denied user 'tidekv' /v3/kv/put .*readwrite /tidekv/") as info:
        client.put("/elsewhere/key", b"x")
    assert info.value.user == "tidekv"
    assert not isinstance(info.value, EtcdUnavailableError)


# ---- tokens -------------------------------------------------------------------------------


def test_a_token_that_expired_unused_is_renewed_once_transparently(start_etcd: Callable[..., EtcdServer]) -> None:
    server = start_etcd(auth=EtcdServerAuth(PASSWORD, token_ttl_s=1))
    client = _client(server)
    client.put("/tidekv/ttl/key", b"before")
    time.sleep(2.2)  # etcd drops a simple token unused for its TTL, checking every second
    kv = client.get("/tidekv/ttl/key")
    assert kv is not None and kv.value == b"before"
    assert client.renewals == 1
    client.put("/tidekv/ttl/key", b"after")
    assert client.renewals == 1


def test_authentication_switched_off_and_on_costs_one_renewal_each(start_etcd: Callable[..., EtcdServer]) -> None:
    server = start_etcd(auth=EtcdServerAuth(PASSWORD))
    client = _client(server)
    client.put("/tidekv/cycle/key", b"1")
    server.admin("/v3/auth/disable", {})  # every token is dropped; etcd refuses the old one still
    client.put("/tidekv/cycle/key", b"2")
    assert client.renewals == 1
    server.admin("/v3/auth/enable", {})  # the client sends no token now: etcd refuses that
    kv = client.get("/tidekv/cycle/key")
    assert kv is not None and kv.value == b"2"
    assert client.renewals == 2


def test_a_renewal_refused_fails_naming_the_user_and_a_rotated_password_file_is_read_again(
        start_etcd: Callable[..., EtcdServer], tmp_path: Path) -> None:
    server = start_etcd(auth=EtcdServerAuth(PASSWORD))
    password_file = tmp_path / "etcd-password"
    password_file.write_text(PASSWORD + "\n")
    client = _client(server, dataclasses.replace(server.client_settings(), password=None,
                                                 password_file=str(password_file)))
    client.put("/tidekv/rotate/key", b"1")
    server.admin("/v3/auth/user/changepw", {"name": "tidekv", "password": "rotated"})  # drops the user's tokens
    started = time.monotonic()
    with pytest.raises(EtcdAuthError, match=f"user 'tidekv'.*{server.url}|{server.url}.*user 'tidekv'") as info:
        client.get("/tidekv/rotate/key")
    assert time.monotonic() - started < QUICK_S
    assert info.value.user == "tidekv" and "TIDEKV_ETCD_PASSWORD_FILE" in str(info.value)
    password_file.write_text("rotated\n")
    kv = client.get("/tidekv/rotate/key")
    assert kv is not None and kv.value == b"1"


# ---- settings -----------------------------------------------------------------------------


def test_clients_take_every_setting_from_the_etcd_variables(certs: Certs, tmp_path: Path) -> None:
    password_file = tmp_path / "pw"
    password_file.write_text("secret\n")
    env = {"TIDEKV_ETCD_CA_FILE": certs.ca, "TIDEKV_ETCD_CERT_FILE": certs.client_cert,
           "TIDEKV_ETCD_KEY_FILE": certs.client_key, "TIDEKV_ETCD_USER": "tidekv",
           "TIDEKV_ETCD_PASSWORD_FILE": str(password_file)}
    settings = EtcdSecurity.from_env(env)
    assert settings == EtcdSecurity(certs.ca, certs.client_cert, certs.client_key, "tidekv", None, str(password_file))
    assert settings.read_password() == "secret"
    assert "secret" not in repr(EtcdSecurity.from_env({"TIDEKV_ETCD_USER": "u", "TIDEKV_ETCD_PASSWORD": "secret"}))
    cluster = MasterAddress.parse("etcd://10.0.0.1:2379,10.0.0.2:2379/pool")
    assert settings.cluster_urls(cluster) == ("https://10.0.0.1:2379", "https://10.0.0.2:2379")
    assert EtcdSecurity().cluster_urls(cluster) == cluster.etcd_endpoints


INVALID = [
    ({"TIDEKV_ETCD_CERT_FILE": "{cert}"}, "cert_file=.*key_file=None: give both"),
    ({"TIDEKV_ETCD_CA_FILE": "/nonexistent/ca.pem"}, "ca_file='/nonexistent/ca.pem' cannot be read"),
    ({"TIDEKV_ETCD_USER": "tidekv"}, "user='tidekv' has no password; set TIDEKV_ETCD_PASSWORD_FILE"),
    ({"TIDEKV_ETCD_PASSWORD": "x"}, "no user; set TIDEKV_ETCD_USER"),
    ({"TIDEKV_ETCD_USER": "u", "TIDEKV_ETCD_PASSWORD": "x", "TIDEKV_ETCD_PASSWORD_FILE": "{cert}"},
     "password and password_file=.* are both set"),
    ({"TIDEKV_ETCD_USER": "u", "TIDEKV_ETCD_PASSWORD_FILE": "{empty}"}, "password_file=.* is empty"),
]


@pytest.mark.parametrize(("env", "message"), INVALID)
def test_invalid_settings_are_refused_naming_the_field(env: dict[str, str], message: str, certs: Certs,
                                                       tmp_path: Path) -> None:
    (tmp_path / "empty").write_text("\n")
    paths = {"cert": certs.client_cert, "empty": str(tmp_path / "empty")}
    with pytest.raises(ConfigError, match=message):
        EtcdSecurity.from_env({k: v.format(**paths) for k, v in env.items()})


def _master_args(*flags: str) -> Any:
    return build_parser().parse_args(["master", "--host", "127.0.0.1", *flags])


def test_master_flags_win_over_the_variables_and_need_tls_urls(certs: Certs, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    password_file = tmp_path / "pw"
    password_file.write_text("from-file\n")
    monkeypatch.setenv("TIDEKV_ETCD_CA_FILE", certs.ca)
    monkeypatch.setenv("TIDEKV_ETCD_USER", "from-env")
    monkeypatch.setenv("TIDEKV_ETCD_PASSWORD", "from-env")
    config = master_config_from_args(_master_args("--etcd", "127.0.0.1:2379", "--etcd-user", "tidekv",
                                                  "--etcd-password-file", str(password_file)))
    assert config.etcd_security == EtcdSecurity(ca_file=certs.ca, user="tidekv", password_file=str(password_file))
    assert config.etcd_urls() == ("https://127.0.0.1:2379",), "a URL without a scheme takes TLS's"
    with pytest.raises(ConfigError, match="http://127.0.0.1:2379 is plain http.*use https://"):
        master_config_from_args(_master_args("--etcd", "http://127.0.0.1:2379"))
    with pytest.raises(ConfigError, match="--etcd-user given without --etcd"):
        master_config_from_args(_master_args("--etcd-user", "tidekv"))
    config_file = tmp_path / "master.json"
    config_file.write_text(json.dumps({"etcd": "127.0.0.1:2379", "etcd_security": {"user": "from-file",
                                                                                   "password": "p"}}))
    layered = master_config_from_args(_master_args("--config", str(config_file))).etcd_security
    assert (layered.user, layered.password, layered.ca_file) == ("from-env", "from-env", certs.ca), \
        "the variables win over the config file"


# ---- masters and a store client -----------------------------------------------------------


def _master_flags(server: EtcdServer, cluster: str, password_file: Path) -> list[str]:
    s = server.client_settings()
    assert s.ca_file and s.cert_file and s.key_file and s.user
    return ["--host", "127.0.0.1", "--port", "0", "--metrics-port", "0", "--etcd", server.url, "--cluster", cluster,
            "--leader-ttl-s", "2", "--etcd-ca-file", s.ca_file, "--etcd-cert-file", s.cert_file,
            "--etcd-key-file", s.key_file, "--etcd-user", s.user, "--etcd-password-file", str(password_file)]


def _role(master: CliMaster) -> str:
    port = re.search(rb"metrics http port (\d+)", master.log).group(1).decode()  # type: ignore[union-attr]
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"http://127.0.0.1:{port}/health", timeout=2) as response:
        health: dict[str, Any] = json.loads(response.read())
    return str(health["role"]) if health["serving"] or health["role"] != "leader" else "promoting"


def test_two_masters_elect_a_leader_over_tls_and_auth_and_a_store_configured_by_variables_finds_it(
        secured: EtcdServer, connect: Connect, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    password_file = tmp_path / "etcd-password"
    password_file.write_text(PASSWORD + "\n")
    masters: list[CliMaster] = []
    try:
        for _ in range(2):  # their environment has no TIDEKV_ETCD_*: the flags alone secure them
            masters.append(CliMaster(*_master_flags(secured, "secured", password_file)))
        wait_until(lambda: sorted(map(_role, masters)) == ["leader", "standby"], 15.0, "a leader and a standby")
        s = secured.client_settings()
        for name, value in (("CA_FILE", s.ca_file), ("CERT_FILE", s.cert_file), ("KEY_FILE", s.key_file),
                            ("USER", s.user), ("PASSWORD_FILE", str(password_file))):
            monkeypatch.setenv(f"TIDEKV_ETCD_{name}", str(value))
        store = connect(f"etcd://{secured.endpoints}/secured", segment_size=8 << 20)
        store.put("secured-key", b"over https, as user tidekv")
        assert store.get("secured-key") == b"over https, as user tidekv"
    finally:
        for m in masters:
            m.close()


@pytest.mark.parametrize(("flag", "value", "phrases"), [
    ("--etcd-password-file", "wrong", ["user 'tidekv'", "--etcd-password-file"]),
    ("--etcd-ca-file", "other_ca", ["cannot be verified", "--etcd-ca-file"]),
])
def test_a_master_that_etcd_refuses_exits_with_the_reason(secured: EtcdServer, certs: Certs, tmp_path: Path,
                                                          flag: str, value: str, phrases: list[str]) -> None:
    password_file = tmp_path / "etcd-password"
    password_file.write_text(PASSWORD + "\n")
    flags = _master_flags(secured, "refused", password_file)
    wrong = tmp_path / "wrong-password"
    wrong.write_text("wrong\n")
    flags[flags.index(flag) + 1] = str(wrong) if value == "wrong" else certs.other_ca
    result = subprocess.run([sys.executable, "-m", "tidekv", "master", *flags], capture_output=True, text=True,
                            timeout=60, cwd=REPO_ROOT, check=False)
    assert result.returncode == 2, result.stderr
    for phrase in phrases:
        assert phrase in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_access_errors_are_not_unavailability() -> None:
    """Callers retry EtcdUnavailableError; a refused TLS or user must not be retried as one."""
    assert not issubclass(EtcdAccessError, EtcdUnavailableError)
    assert issubclass(EtcdTlsError, EtcdAccessError) and issubclass(EtcdAuthError, EtcdAccessError)
