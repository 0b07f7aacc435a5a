"""The one authentication mechanism of the control planes (``tidekv.auth``), without I/O: both
sides prove the secret, a proof is bound to its channel and role; and the secret's one setting
(``secret_from_env``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from tidekv import auth
from tidekv.auth import ClientHandshake, ServerHandshake
from tidekv.config import MasterConfig, TransferConfig, secret_from_env
from tidekv.errors import AuthenticationError, ConfigError


def _pair(client_secret: str | None, server_secret: str | None, client_label: str = "master",
          server_label: str = "master") -> tuple[ClientHandshake, ServerHandshake, bytes]:
    client = ClientHandshake(client_secret, client_label, "server")
    server = ServerHandshake(server_secret, server_label, "client")
    return client, server, server.greeted(client.greeting())


def test_matching_secrets_prove_both_sides() -> None:
    client, server, challenge = _pair("s", "s")
    server.proved(client.challenged(challenge))  # raises on a failed proof either way
    replayed = ServerHandshake("s", "master", "client")  # a proof is bound to the server's fresh nonce
    replayed.greeted(client.greeting())
    with pytest.raises(AuthenticationError, match="did not prove"):
        replayed.proved(client.challenged(challenge))


@pytest.mark.parametrize(("client_secret", "server_secret", "match"), [
    ("s", None, "does not authenticate"),
    (None, "s", "requires a shared secret"),
    ("s", "t", "failed to prove the shared secret"),
])
def test_the_client_refuses_a_server_that_does_not_prove_its_secret(client_secret: str | None,
                                                                    server_secret: str | None, match: str) -> None:
    client, _, challenge = _pair(client_secret, server_secret)
    with pytest.raises(AuthenticationError, match=match):
        client.challenged(challenge)


def test_the_server_refuses_a_proof_of_another_secret_or_channel() -> None:
    client, server, challenge = _pair("t", "s")
    with pytest.raises(AuthenticationError, match="failed to prove"):
        client.challenged(challenge)  # the client sees at once that the server's secret differs
    with pytest.raises(AuthenticationError, match="did not prove"):
        server.proved(auth.encode(auth.Proof(b"\x00" * auth.MAC_BYTES)))
    # A proof made for the weights channel is worthless on the master's, even with the same secret.
    weights_client, weights_server, weights_challenge = _pair("s", "s", "weights", "weights")
    weights_proof = weights_client.challenged(weights_challenge)
    weights_server.proved(weights_proof)
    master_server = ServerHandshake("s", "master", "client")
    master_server.greeted(weights_client.greeting())
    with pytest.raises(AuthenticationError, match="did not prove"):
        master_server.proved(weights_proof)


def test_malformed_handshakes_are_authentication_errors() -> None:
    for data in (b"", b"\xff", auth.encode(auth.Proof(b"x")), auth.encode(auth.Greeting(auth.AUTH_VERSION, b"short")),
                 auth.encode(auth.Greeting(auth.AUTH_VERSION + 1, b"n" * 32))):
        with pytest.raises(AuthenticationError):
            ServerHandshake("s", "master", "client").greeted(data)
    client = ClientHandshake("s", "master", "server")
    with pytest.raises(AuthenticationError, match="nonce of 3 bytes"):
        client.challenged(auth.encode(auth.Challenge(b"abc", b"")))
    assert auth.decode_any(b"\x94\x01\xa1r\x00\xa0") is None  # a channel's own message is not a handshake one


def test_the_secret_has_one_setting_a_variable_or_a_file(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_text("from-a-file\n")
    assert secret_from_env({}) is None
    assert secret_from_env({"TIDEKV_SECRET": "x"}) == "x"
    assert secret_from_env({"TIDEKV_SECRET_FILE": str(path)}) == "from-a-file"
    for env, match in (({"TIDEKV_SECRET": "x", "TIDEKV_SECRET_FILE": str(path)}, "both set"),
                       ({"TIDEKV_SECRET_FILE": str(tmp_path / "missing")}, "cannot be read"),
                       ({"TIDEKV_SECRET": ""}, "empty")):
        with pytest.raises(ConfigError, match=match):
            secret_from_env(env)
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="is empty"):
        secret_from_env({"TIDEKV_SECRET_FILE": str(tmp_path / "empty")})
    env = {"TIDEKV_SECRET_FILE": str(path)}
    assert TransferConfig.from_env(env).secret == MasterConfig.from_env(env).secret == "from-a-file"
    with pytest.raises(ConfigError, match="TIDEKV_MASTER_SECRET is not a setting"):
        MasterConfig.from_env({"TIDEKV_MASTER_SECRET": "x"})
    assert "from-a-file" not in repr(MasterConfig.from_env(env))
