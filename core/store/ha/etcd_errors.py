"""What etcd's failures mean: the etcd client's typed errors, and the messages that say what to set.

``EtcdUnavailableError`` (no member answered: retried by every caller) and ``EtcdAccessError``
(a member answered and refused this client: its TLS or its user; retrying changes nothing, so
callers report it) are siblings under ``EtcdError``. The functions here turn what urllib raised,
or what etcd's JSON gateway answered, into one of them, naming the endpoint and the setting
(``tidekv.config.EtcdSecurity.how_to_set``) that fixes it. Neighbours: ``etcd`` (the client
that raises these), ``election``/``cluster``/``master_client`` (which catch them).
"""

from __future__ import annotations

import ssl
from typing import Any

from tidekv.config import EtcdSecurity
from tidekv.errors import StoreError

KEY_PREFIX = "/tidekv/"
"""Every key tidekv keeps in etcd starts so: the prefix an etcd role must be granted."""

_STALE_TOKEN = ("invalid auth token", "revision of auth store is old")
"""Refusals after which a fresh token may succeed (expired or revoked, or auth changed meanwhile)."""
_NO_TOKEN = ("user name is empty", "permission denied")
"""How etcd with authentication on refuses a request that carries no token."""


class EtcdError(StoreError):
    """Base of the etcd client's errors."""


class EtcdUnavailableError(EtcdError):
    """No etcd endpoint answered (or it answered with an error); callers retry."""


class EtcdAccessError(EtcdError):
    """etcd answered but refused this client: its TLS settings or its user. Retrying does not
    help; the message names the endpoint and the setting to fix."""


class EtcdTlsError(EtcdAccessError):
    """The TLS handshake with etcd failed: its certificate is not signed by ``ca_file``, or it
    wants a client certificate that this client lacks or that it refuses."""


class EtcdAuthError(EtcdAccessError):
    """etcd refused this client's user: a wrong password, a user unknown or without the role
    it needs, no user for an etcd with authentication on, or a renewed token refused again.

    Attributes:
        user: the etcd user refused (None when no user is configured).
    """

    def __init__(self, message: str, *, user: str | None) -> None:
        super().__init__(message)
        self.user = user


def message_of(reply: dict[str, Any]) -> str:
    """etcd's error text in a gateway reply (unary: "message"; a stream's: "error": {"message"})."""
    error = reply.get("error")
    if isinstance(error, dict):
        return str(error.get("message", error))
    return str(reply.get("message") or error or reply)


def is_error(reply: dict[str, Any]) -> bool:
    return "error" in reply or ("code" in reply and "header" not in reply)


def is_stale_token(reply: dict[str, Any], had_token: bool) -> bool:
    """True when a new token may make etcd accept the request: the one sent expired or was
    revoked, or none was sent (authentication was off when this client last looked)."""
    text = message_of(reply)
    return any(s in text for s in _STALE_TOKEN) or (not had_token and any(s in text for s in _NO_TOKEN))


def tls_error(endpoint: str, exc: BaseException, security: EtcdSecurity) -> EtcdTlsError:
    """The typed error for an ``ssl.SSLError`` raised while talking to ``endpoint``."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return EtcdTlsError(f"etcd {endpoint}'s certificate cannot be verified ({exc.verify_message}) with "
                            f"{security.ca_file or 'the system CAs'}; set {security.how_to_set('ca_file')} to the "
                            "PEM CA that signed etcd's --cert-file")
    text = str(exc)
    if "WRONG_VERSION_NUMBER" in text or "wrong version number" in text:
        return EtcdTlsError(f"etcd {endpoint} does not speak TLS ({text}); use an http:// URL, or serve TLS there")
    # A server that requires a client certificate answers a handshake without one, or with one it
    # does not trust, with an alert about it (bad/unknown certificate, certificate required) or
    # by hanging up (EOF).
    about_ours = "CERTIFICATE" in text.upper() or isinstance(exc, ssl.SSLEOFError)
    if security.cert_file is None:
        claim = "it requires a client certificate" if about_ours else "if it requires a client certificate"
        return EtcdTlsError(f"etcd {endpoint} refused the TLS handshake ({text}): {claim} (--client-cert-auth), "
                            f"set {security.how_to_set('cert_file')} and {security.how_to_set('key_file')}")
    return EtcdTlsError(f"etcd {endpoint} refused the TLS handshake ({text}): is {security.cert_file} signed by a CA "
                        "in etcd's --trusted-ca-file, and meant for clients (no extendedKeyUsage, or clientAuth)?")


def unanswered_hint(endpoint: str, security: EtcdSecurity) -> str:
    """Said after a plain-http endpoint hung up without an answer, as etcd serving TLS does."""
    if not endpoint.startswith("http://"):
        return ""
    return f" (if etcd serves TLS there, set {security.how_to_set('ca_file')}; a master takes https:// URLs then)"


def refusal(endpoint: str, path: str, reply: dict[str, Any], security: EtcdSecurity) -> EtcdAccessError | None:
    """The typed error for a reply that refuses this client's TLS or user, else None."""
    text = message_of(reply)
    user = security.user
    if "CommonName of client" in text:
        return EtcdTlsError(f"etcd {endpoint} refused {path}: {text}. With authentication on, etcd's JSON gateway "
                            f"refuses a client certificate that has a Common Name; issue "
                            f"{security.cert_file} without one (e.g. openssl -subj /O=tidekv) and authenticate with "
                            f"{security.how_to_set('user')} and a password")
    if "authentication failed" in text:
        return EtcdAuthError(f"etcd {endpoint} refused user {user!r}: {text}; check {security.how_to_set('user')} and "
                             f"{security.how_to_set('password')}", user=user)
    if user is None and any(s in text for s in _NO_TOKEN):
        return EtcdAuthError(f"etcd {endpoint} refused {path} without credentials ({text}): it has authentication "
                             f"on; set {security.how_to_set('user')} and {security.how_to_set('password')}", user=None)
    if "permission denied" in text:
        return EtcdAuthError(f"etcd {endpoint} denied user {user!r} {path} ({text}); grant its role read and write "
                             f"on the keys under {KEY_PREFIX} (etcdctl role grant-permission ROLE --prefix=true "
                             f"readwrite {KEY_PREFIX})", user=user)
    if any(s in text for s in _STALE_TOKEN) or "user name is empty" in text:
        return EtcdAuthError(f"etcd {endpoint} refused {path} for user {user!r} ({text}) right after this client "
                             "authenticated again; is the user's role still granted?", user=user)
    return None
