"""EtcdClient: the few etcd v3 calls the store needs, over etcd's JSON gateway (HTTP, urllib).

Leases (grant, keep alive, revoke), a compare-and-put transaction, get and delete; keys and
values travel base64-encoded as the gateway wants them. Every call goes to the first endpoint
that answers, with a timeout, and raises ``EtcdUnavailableError`` when none does.

Why the gateway and not a Python client: ``etcd3`` (python-etcd3) has had no release since 2020
and pins an old protobuf; ``aetcd`` is asyncio-only and brings grpcio; ``etcd3gw`` speaks this
same gateway but brings requests, futurist and pbr. Five POSTs of JSON need none of them.
Neighbours: ``election`` (campaigns and keeps the leader's lease), ``master_client`` (finds the
leader). Thread-safe (the endpoint order is the only shared state; a lock keeps it).
"""

from __future__ import annotations

import base64
import json
import logging
import threading
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tidekv.errors import StoreError

logger = logging.getLogger(__name__)


class EtcdUnavailableError(StoreError):
    """No etcd endpoint answered (or it answered with an error)."""


@dataclass(frozen=True, slots=True)
class KeyValue:
    value: bytes
    create_revision: int
    lease: int


_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # etcd is never reached through a proxy


def _b64(data: bytes | str) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


class EtcdClient:
    """Calls to an etcd of one or more members (``endpoints``: their client URLs).

    Each call tries the members in turn, each within ``timeout_s``, and the member that answered
    last is tried first (a member that is gone costs one refused connection or one timeout,
    once per client, not per call)."""

    def __init__(self, endpoints: Sequence[str], timeout_s: float = 1.0) -> None:
        self.endpoints = list(endpoints)
        self.timeout_s = timeout_s
        self._lock = threading.Lock()

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
        with self._lock:
            endpoints = list(self.endpoints)  # several threads call at once (election, follow, replication)
        for i, endpoint in enumerate(endpoints):
            request = urllib.request.Request(endpoint + path, data, {"Content-Type": "application/json"})
            try:
                with _OPENER.open(request, timeout=self.timeout_s) as response:
                    out: dict[str, Any] = json.loads(response.read())
            except (OSError, ValueError) as exc:
                errors.append(f"{endpoint}: {exc}")
                continue
            if "error" in out or "code" in out and "header" not in out:
                raise EtcdUnavailableError(f"etcd {endpoint} refused {path}: {out.get('message') or out}")
            if i:
                with self._lock:
                    self.endpoints.remove(endpoint)
                    self.endpoints.insert(0, endpoint)
            return out
        raise EtcdUnavailableError(f"no etcd endpoint answered {path}: {'; '.join(errors)}")
