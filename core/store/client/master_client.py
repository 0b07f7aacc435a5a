"""MasterClient: the one way tidekv talks to a store master (Store, the proxy's store policy,
the vLLM scheduler's lookups).

It owns the connection to the current leader (a fixed "host:port", or the leader key of a cluster
in etcd: ``etcd://H:P[,H:P]/NAME``), follows it, and retries: a call that finds no master, or one
that does not serve (recovering, a standby), looks the leader up again until
``failover_timeout_s`` has passed, then raises the last error (``MasterUnavailableError`` /
``MasterNotReadyError``). Reads and idempotent requests are always retried (a retried Remove may
answer NOT_FOUND); a later ListKeys page on a new connection raises ``ConfigError`` (list again);
PutStart is retried only when it certainly never reached a master, else it raises
``MasterUnavailableError`` with ``is_request_sent`` True. Auth, config, protocol-version, RPC and
etcd-access errors are never retried. Thread-safe.
Neighbours: ``rpc`` (one connection), ``election`` (where the leader is written), ``client``.
Design notes: docs/store-design.md#tidekvstoreclientmaster_client
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import msgspec
from tidekv.config import EtcdSecurity, MasterAddress, TlsConfig
from tidekv.errors import MasterUnavailableError
from tidekv.store.client.rpc import MasterChannel
from tidekv.store.ha.etcd import EtcdClient, EtcdUnavailableError
from tidekv.store.wire import names
from tidekv.store.wire import protocol as p
from tidekv.store.wire.keys import Key, key_bytes

logger = logging.getLogger(__name__)

RETRY_INTERVAL_S = 0.05
"""Pause between two attempts to find a serving master."""
_NEVER_RETRIED_WHEN_SENT = (p.PutStart,)


def leader_key(cluster: str) -> str:
    """The etcd key the leader of ``cluster`` holds under its lease (value: JSON id + address)."""
    return f"/tidekv/{cluster}/leader"


class MasterClient:
    """A connection to the store master that follows its leader.

    Args:
        master: "host:port", "etcd://H:P[,H:P...]/CLUSTER", or a parsed MasterAddress.
        client_id: who this client is to the master.
        timeout_s: longest wait for one reply.
        failover_timeout_s: how long retried calls look for a serving master (0: one attempt).
        busy_poll_us: how long to poll for a reply before sleeping.
        register: say hello on every new connection (a Store does; lookup-only clients do not,
            so the master does not track them as clients that must heartbeat).
        secret: the shared secret the master must prove and this client proves (``tidekv.auth``);
            None: the master must have none either.
        tls: reach the master over TLS (default: plain TCP).
        tenant: the tenant this client acts for (``tenants``); None: ``TIDEKV_TENANT``, "" for
            none (the default tenant).
        etcd_security: how to reach a secured etcd, for an ``etcd://`` master; None:
            ``EtcdSecurity.from_env()`` (``TIDEKV_ETCD_*``).

    Raises:
        ConfigError: ``master`` is neither form, or the etcd settings are invalid.
    """

    def __init__(self, master: str | MasterAddress, client_id: str, *, timeout_s: float,
                 failover_timeout_s: float = 0.0, busy_poll_us: int = 0, register: bool = False,
                 secret: str | None = None, tls: TlsConfig | None = None, tenant: str | None = None,
                 etcd_security: EtcdSecurity | None = None) -> None:
        self.master = master if isinstance(master, MasterAddress) else MasterAddress.parse(master)
        self.client_id = client_id
        self.timeout_s = timeout_s
        self.failover_timeout_s = failover_timeout_s
        self._busy_poll_us = busy_poll_us
        self._register = register
        self._secret = secret
        self.tenant = names.tenant_from_env() if tenant is None else tenant and names.check_name(tenant)
        self._tls = (tls if tls is not None else TlsConfig()).client_context()
        self._etcd: EtcdClient | None = None
        if self.master.is_cluster:
            security = etcd_security if etcd_security is not None else EtcdSecurity.from_env()
            self._etcd = EtcdClient(security.cluster_urls(self.master), timeout_s=min(timeout_s, 1.0),
                                    security=security)
        self._lock = threading.Lock()
        self._channel: MasterChannel | None = None
        self._closed = False
        self.max_message_bytes: int | None = None
        self.master_id = ""
        self.lease_ttl_s = 0.0

    @property
    def address(self) -> str:
        """The master this client talks to now ("host:port"), or the cluster's etcd address."""
        channel = self._channel
        return channel.address if channel is not None else str(self.master)

    @property
    def master_on_this_host(self) -> bool | None:
        """Whether the master this client talks to now shares its network (``MasterChannel``);
        None while not connected."""
        channel = self._channel
        return channel.master_on_this_host if channel is not None else None

    @property
    def channel(self) -> MasterChannel | None:
        """The connection to the master in use now (None when there is none): one object per
        connection, so a caller can tell whether two answers came over the same one."""
        return self._channel

    def call(self, body: msgspec.Struct, timeout_s: float | None = None, failover_timeout_s: float | None = None) -> Any:
        """Sends one request to the leader and returns its result, retrying as the table says
        (for ``failover_timeout_s``, default the client's).

        Raises:
            MasterUnavailableError: no master answered within ``failover_timeout_s``.
            MasterNotReadyError: a master answered, but none served within ``failover_timeout_s``.
            ProtocolVersionError, ConfigError, RpcError: the master refused the request.
            EtcdAccessError: etcd refused this client's TLS or user (an ``etcd://`` master).
        """
        deadline = time.monotonic() + (self.failover_timeout_s if failover_timeout_s is None else failover_timeout_s)
        while True:
            channel = None
            try:
                channel = self._current()
                if channel is None:
                    raise MasterUnavailableError(f"no leader of cluster {self.master} is registered in etcd "
                                                 f"{', '.join(self._etcd.endpoints if self._etcd else ())}", is_request_sent=False)
                return channel.call(body, timeout_s)
            except MasterUnavailableError as exc:
                self._lost(channel)
                if exc.is_request_sent and isinstance(body, _NEVER_RETRIED_WHEN_SENT):
                    raise
                if time.monotonic() + RETRY_INTERVAL_S > deadline:
                    raise
                logger.debug("master %s: %s; looking for the leader again", self.address, exc)
                time.sleep(RETRY_INTERVAL_S)

    def connect(self) -> None:
        """Connects (saying hello when registering) now rather than on the first call; retried
        like a call. Raises as ``call`` does."""
        self.call(p.Heartbeat(self.client_id) if self._register else p.Exists([]))

    def exists_many(self, keys: Sequence[Key]) -> list[bool]:
        """Whether each key holds a complete object (one round trip, no lease)."""
        return list(self.call(p.Exists([key_bytes(k) for k in keys])))

    def exists_leased(self, keys: Sequence[Key]) -> list[bool]:
        """Whether each key holds a complete object, taking a read lease on each that does (one
        round trip, as a get): for the master's lease_ttl_s eviction and remove() without force
        leave them alone, so a load planned on this answer finds its objects."""
        _, results = self.call(p.Get([key_bytes(k) for k in keys]))
        return [r.status == p.Status.OK for r in results]

    def locate_many(self, keys: Sequence[Key]) -> list[list[str]]:
        """Transfer engines holding each key's replicas (one round trip, no lease)."""
        return [[str(e) for e in engines] for engines in self.call(p.Locate([key_bytes(k) for k in keys]))]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            channel, self._channel = self._channel, None
        if channel is not None:
            channel.close()

    # ---- the leader ---------------------------------------------------------------------

    def _current(self) -> MasterChannel | None:
        channel = self._channel
        if channel is not None:
            return channel
        with self._lock:
            if self._closed:
                raise MasterUnavailableError("master client is closed", is_request_sent=False)
            if self._channel is None:
                address = self._find_leader()
                if address is None:
                    return None
                channel = MasterChannel(address, self.client_id, self.timeout_s, self._busy_poll_us, self._secret,
                                        self._tls, self.tenant)
                if self._register:
                    try:
                        self._hello(channel)
                    except BaseException:
                        channel.close()
                        raise
                self._channel = channel
            return self._channel

    def _hello(self, channel: MasterChannel) -> None:
        info = channel.call(p.Hello(self.client_id, p.PROTOCOL_VERSION))
        self.max_message_bytes = channel.max_message_bytes = int(info["max_message_bytes"])
        if "max_batch_keys" in info:
            channel.max_batch_keys = int(info["max_batch_keys"])
        self.master_id = str(info["master_id"])
        self.lease_ttl_s = float(info["lease_ttl_s"])

    def _find_leader(self) -> str | None:
        if self._etcd is None:
            return self.master.address
        try:
            kv = self._etcd.get(leader_key(self.master.cluster))
        except EtcdUnavailableError as exc:
            raise MasterUnavailableError(f"cannot find the leader of {self.master}: {exc}",
                                         is_request_sent=False) from None
        return str(json.loads(kv.value)["address"]) if kv is not None else None

    def _lost(self, channel: MasterChannel | None) -> None:
        """Forgets a channel that failed, so the next attempt looks the leader up again."""
        if channel is None:
            return
        with self._lock:
            if self._channel is channel:
                self._channel = None
        channel.close()
