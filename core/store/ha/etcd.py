"""EtcdClient: the few etcd v3 calls the store needs, over etcd's JSON gateway (HTTP or HTTPS, urllib).

Leases (grant, keep alive, revoke), a compare-and-put transaction, get and put; keys and values
travel base64-encoded as the gateway wants them. Every call goes to the first endpoint that
answers, with a timeout, and raises ``EtcdUnavailableError`` when none does. With a secured etcd
(``EtcdSecurity``: CA, client certificate, user) a refused token is renewed once and the call
repeated; whatever etcd refuses then, or a failed TLS handshake, raises ``EtcdAccessError``
(``etcd_errors``) naming the endpoint and the setting to fix.

Neighbours: ``etcd_errors`` (what failures mean), ``election`` (campaigns and keeps the leader's
lease), ``master_client`` (finds the leader). Thread-safe (the endpoint order and the token are
the only shared state; a lock keeps each, and one thread at a time authenticates).
Design notes: docs/store-design.md#tidekvstorehaetcd
"""

from __future__ import annotations

import base64
import http.client
import json
import logging
import ssl
import threading
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tidekv.config import EtcdSecurity
from tidekv.errors import ConfigError
from tidekv.store.ha import etcd_errors
from tidekv.store.ha.etcd_errors import (
    EtcdAccessError,
    EtcdAuthError,
    EtcdError,
    EtcdTlsError,
    EtcdUnavailableError,
)

__all__ = ["EtcdAccessError", "EtcdAuthError", "EtcdClient", "EtcdError", "EtcdTlsError", "EtcdUnavailableError",
           "KeyValue"]  # the errors are etcd_errors', re-exported: callers catch them from here

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class KeyValue:
    value: bytes
    create_revision: int
    lease: int


class _Unanswered(Exception):
    """This endpoint did not answer (or answered with an HTTP error): the next one is tried."""


def _b64(data: bytes | str) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


class EtcdClient:
    """Calls to an etcd of one or more members (``endpoints``: their client URLs).

    Each call tries the members in turn, each within ``timeout_s``, and the member that answered
    last is tried first (a member that is gone costs one refused connection or one timeout,
    once per client, not per call). Every call raises ``EtcdUnavailableError`` when no member
    answered, and ``EtcdAccessError`` (``EtcdTlsError``, ``EtcdAuthError``) when etcd refused
    this client's TLS or user (a TLS refusal only once every member refused or failed)."""

    def __init__(self, endpoints: Sequence[str], timeout_s: float = 1.0, security: EtcdSecurity | None = None) -> None:
        """Args:
            endpoints: etcd's client URLs (http:// or https://).
            timeout_s: longest wait for one endpoint's answer (connect, TLS handshake and reply).
            security: TLS files and user (default: none).

        Raises:
            ConfigError: the TLS files cannot be loaded.
        """
        self.endpoints = list(endpoints)
        self.timeout_s = timeout_s
        self.security = security if security is not None else EtcdSecurity()
        handlers: list[urllib.request.BaseHandler] = [urllib.request.ProxyHandler({})]  # never through a proxy
        if any(e.startswith("https://") for e in self.endpoints):
            handlers.append(urllib.request.HTTPSHandler(context=self.security.client_context()))
        self._opener = urllib.request.build_opener(*handlers)
        self._lock = threading.Lock()
        self._auth_lock = threading.Lock()
        self._token: str | None = None  # sent in Authorization; None: no user, or etcd has authentication off
        self._needs_token = self.security.user is not None  # no token asked for since the client began
        self.renewals = 0
        """Times this client authenticated again because etcd refused its token."""

    def get(self, key: str) -> KeyValue | None:
        kvs = self._post("/v3/kv/range", {"key": _b64(key)}).get("kvs") or []
        if not kvs:
            return None
        kv = kvs[0]
        return KeyValue(base64.b64decode(kv.get("value", "")), int(kv.get("create_revision", 0)),
                        int(kv.get("lease", 0)))

    def grant(self, ttl_s: int) -> int:
        """A new lease of ``ttl_s`` seconds; returns its id."""
        return int(self._post("/v3/lease/grant", {"TTL": ttl_s})["ID"])

    def keep_alive(self, lease: int) -> int:
        """Renews the lease; returns its TTL in seconds, 0 if it has expired."""
        return int(self._post("/v3/lease/keepalive", {"ID": str(lease)}).get("result", {}).get("TTL", 0))

    def revoke(self, lease: int) -> None:
        self._post("/v3/lease/revoke", {"ID": str(lease)})

    def create(self, key: str, value: bytes, lease: int) -> int:
        """Puts ``key`` only if it does not exist; returns its create revision, 0 if it existed."""
        reply = self._post("/v3/kv/txn", {
            "compare": [{"target": "CREATE", "key": _b64(key), "create_revision": "0"}],
            "success": [{"request_put": {"key": _b64(key), "value": _b64(value), "lease": str(lease)}}],
        })
        return int(reply["header"]["revision"]) if reply.get("succeeded") else 0

    def put_if_owner(self, key: str, value: bytes, owner_key: str, owner_revision: int) -> bool:
        """Puts ``key`` only while ``owner_key`` still has create revision ``owner_revision`` (the
        caller still holds what it created then); True if it did."""
        reply = self._post("/v3/kv/txn", {
            "compare": [{"target": "CREATE", "key": _b64(owner_key), "create_revision": str(owner_revision)}],
            "success": [{"request_put": {"key": _b64(key), "value": _b64(value)}}],
        })
        return bool(reply.get("succeeded"))

    def put(self, key: str, value: bytes) -> None:
        self._post("/v3/kv/put", {"key": _b64(key), "value": _b64(value)})

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        data = json.dumps(body).encode()
        errors = []
        refused: EtcdTlsError | None = None
        with self._lock:
            endpoints = list(self.endpoints)  # several threads call at once (election, follow, replication)
        for i, endpoint in enumerate(endpoints):
            try:
                out = self._call(endpoint, path, data)
            except _Unanswered as exc:
                errors.append(f"{endpoint}: {exc}")
                continue
            except EtcdTlsError as exc:  # another member may present a certificate this client trusts
                refused = refused or exc
                errors.append(str(exc))
                continue
            if i:
                with self._lock:
                    self.endpoints.remove(endpoint)
                    self.endpoints.insert(0, endpoint)
            return out
        if refused is not None:
            raise refused
        raise EtcdUnavailableError(f"no etcd endpoint answered {path}: {'; '.join(errors)}")

    def _call(self, endpoint: str, path: str, data: bytes) -> dict[str, Any]:
        """One call at one endpoint, with one new token if etcd refuses the one sent."""
        token = self._current_token(endpoint)
        status, out = self._send(endpoint, path, data, token)
        if self.security.user is not None and etcd_errors.is_error(out) \
                and etcd_errors.is_stale_token(out, token is not None):
            token = self._renew(endpoint, token, etcd_errors.message_of(out))
            status, out = self._send(endpoint, path, data, token)
        if not etcd_errors.is_error(out):
            return out
        refusal = etcd_errors.refusal(endpoint, path, out, self.security)
        if refusal is not None:
            raise refusal
        if status != 200:  # e.g. no raft leader yet: another member may have one
            raise _Unanswered(f"HTTP {status}: {etcd_errors.message_of(out)}")
        raise EtcdUnavailableError(f"etcd {endpoint} refused {path}: {etcd_errors.message_of(out)}")

    def _send(self, endpoint: str, path: str, data: bytes, token: str | None) -> tuple[int, dict[str, Any]]:
        """(HTTP status, the JSON reply); raises _Unanswered, or EtcdTlsError for a failed handshake."""
        headers = {"Content-Type": "application/json"}
        if token is not None:
            headers["Authorization"] = token
        request = urllib.request.Request(endpoint + path, data, headers)
        try:
            try:
                with self._opener.open(request, timeout=self.timeout_s) as response:
                    status, body = response.status, response.read()
            except urllib.error.HTTPError as exc:  # etcd's refusals come as 4xx/5xx with a JSON body
                status, body = exc.code, exc.read()
        except ssl.SSLError as exc:  # TLS 1.3: a refused client certificate shows on the first read
            raise etcd_errors.tls_error(endpoint, exc, self.security) from None
        except urllib.error.URLError as exc:
            if isinstance(exc.reason, ssl.SSLError):
                raise etcd_errors.tls_error(endpoint, exc.reason, self.security) from None
            hint = etcd_errors.unanswered_hint(endpoint, self.security) if isinstance(exc.reason, ConnectionResetError) else ""
            raise _Unanswered(f"{exc}{hint}") from None
        # etcd serving TLS hangs up on plain http: without a word (BadStatusLine) or, when the hang-up
        # races the request's last bytes, with a reset.
        except (http.client.BadStatusLine, ConnectionResetError) as exc:
            raise _Unanswered(f"{exc!r}{etcd_errors.unanswered_hint(endpoint, self.security)}") from None
        except (OSError, http.client.HTTPException) as exc:
            raise _Unanswered(str(exc)) from None
        try:
            out = json.loads(body)
        except ValueError:
            out = {"error": body.decode(errors="replace").strip() or f"HTTP {status}"}
        return status, out if isinstance(out, dict) else {"error": str(out)}

    # ---- the token ----------------------------------------------------------------------

    def _current_token(self, endpoint: str) -> str | None:
        if self._needs_token:
            with self._auth_lock:
                if self._needs_token:
                    self._token = self._authenticate(endpoint)
                    self._needs_token = False
        return self._token

    def _renew(self, endpoint: str, refused: str | None, reason: str) -> str | None:
        """A token other than ``refused``: another thread's newer one, or one asked for now."""
        with self._auth_lock:
            if self._token == refused and not self._needs_token:
                logger.info("etcd %s refused the token of user %s (%s); authenticating again", endpoint,
                            self.security.user, reason)
                self._token = self._authenticate(endpoint)
                self.renewals += 1
            return self._token

    def _authenticate(self, endpoint: str) -> str | None:
        """A token for the user, or None when etcd has authentication off."""
        user = self.security.user
        try:
            password = self.security.read_password()
        except ConfigError as exc:
            raise EtcdAuthError(f"cannot authenticate user {user!r} to etcd {endpoint}: {exc}", user=user) from None
        body = json.dumps({"name": user, "password": password}).encode()
        status, out = self._send(endpoint, "/v3/auth/authenticate", body, None)
        if not etcd_errors.is_error(out) and out.get("token"):
            logger.info("authenticated to etcd %s as user %s", endpoint, user)
            return str(out["token"])
        text = etcd_errors.message_of(out)
        if "authentication is not enabled" in text:
            logger.warning("etcd %s has authentication off; user %s sends no token until it is on", endpoint, user)
            return None
        refusal = etcd_errors.refusal(endpoint, "/v3/auth/authenticate", out, self.security)
        if refusal is not None:
            raise refusal
        raise _Unanswered(f"HTTP {status}: cannot authenticate user {user!r}: {text}")
