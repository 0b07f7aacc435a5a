"""Election: which master of a cluster leads, decided by an etcd lease, and who may lead next.

``/tidekv/NAME/leader`` (on the leader's lease) names the leader; ``/tidekv/NAME/insync`` lists
the masters that hold every acknowledged change, and only they may campaign (no key: anyone).
The leader rewrites ``insync``, guarded by still holding the leader key, before it acknowledges a
change without a standby that fell behind. A leader serves only until ``sent + ttl - margin``
(``sent``: its last answered keep-alive), so one cut off from etcd stops before another is elected.

``Campaign`` runs one thread per master (polling every ``POLL_S`` standing by, keeping the lease
alive leading) and reports through two callbacks, called from its thread: ``on_elected(revision)``
and ``on_deposed(reason)``. An etcd that refuses the master's TLS or user (``EtcdAccessError``) is
retried every ``REFUSED_RETRY_S`` and logged as an error. Neighbours: ``etcd`` (the calls),
``server`` (acts on the callbacks), ``master_client`` (reads the leader key).
Design notes: docs/store-design.md#tidekvstorehaelection
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from tidekv.store.client.master_client import leader_key
from tidekv.store.ha.etcd import EtcdAccessError, EtcdClient, EtcdError, EtcdUnavailableError

logger = logging.getLogger(__name__)

POLL_S = 0.1
"""How often a standby looks at the leader key."""
REFUSED_RETRY_S = 1.0
"""How long the campaign waits after etcd refused its TLS or user (each try may cost etcd an
authentication) before it tries again: an operator may fix etcd's side meanwhile."""
REFUSED_LOG_INTERVAL_S = 30.0
"""At most one error line per this long while etcd keeps refusing."""


def insync_key(cluster: str) -> str:
    return f"/tidekv/{cluster}/insync"


@dataclass(frozen=True, slots=True)
class Leader:
    master_id: str
    address: str


class Campaign:
    """One master's part in the election of ``cluster`` (see the module docstring)."""

    def __init__(self, etcd: EtcdClient, cluster: str, ttl_s: int, *,
                 on_elected: Callable[[int], None], on_deposed: Callable[[str], None]) -> None:
        self.etcd = etcd
        self.cluster = cluster
        self.ttl_s = ttl_s
        self.margin_s = max(0.5, ttl_s / 6)
        self._on_elected = on_elected
        self._on_deposed = on_deposed
        self._lock = threading.Lock()
        self._me: Leader | None = None  # who this master is now (None: not campaigning)
        self._lease = 0
        self._revision = 0  # create revision of the leader key while this master leads
        self._valid_until = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._refused_logged = -REFUSED_LOG_INTERVAL_S
        self.last_seen: tuple[float, Leader | None] = (0.0, None)
        """When (time.monotonic) the last poll while standing by ran, and the leader it found."""

    # ---- what the server asks -----------------------------------------------------------

    def start(self, me: Leader) -> None:
        self._me = me
        self._thread = threading.Thread(target=self._run, name="tidekv-election", daemon=True)
        self._thread.start()

    def rename(self, me: Leader) -> None:
        """A deposed master stands by again under a new id (its old state is gone)."""
        with self._lock:
            self._me = me

    @property
    def is_leading(self) -> bool:
        """True while this master may act as leader (its lease surely has not passed to another)."""
        return self._revision != 0 and time.monotonic() < self._valid_until

    def resign(self) -> None:
        """Stops leading now (the server stepped down on its own); the thread then gives the old
        lease back, and reports no deposition."""
        with self._lock:
            self._revision = 0
            self._valid_until = 0.0

    def leader(self) -> Leader | None:
        kv = self.etcd.get(leader_key(self.cluster))
        return None if kv is None else _leader(kv.value)

    def set_insync(self, members: list[str]) -> bool:
        """Records the in-sync set, only while this master still holds the leader key."""
        if not self._revision:
            return False
        body = json.dumps({"members": sorted(members)}).encode()
        return self.etcd.put_if_owner(insync_key(self.cluster), body, leader_key(self.cluster), self._revision)

    def stop(self) -> None:
        """Stops campaigning; a leader gives its lease back so a standby takes over at once."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._lease:
            try:
                self.etcd.revoke(self._lease)
            except EtcdError:
                pass  # the lease expires by itself within its TTL

    # ---- the thread ---------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            wait_s = self.ttl_s / 6 if self._revision else POLL_S
            try:
                if self._revision:
                    self._keep_alive()
                else:
                    self._stand_by()
            except EtcdUnavailableError as exc:
                logger.debug("election of %s: %s", self.cluster, exc)
            except EtcdAccessError as exc:
                self._refused(exc)
                wait_s = min(wait_s, REFUSED_RETRY_S) if self._revision else REFUSED_RETRY_S
            if self._revision and time.monotonic() >= self._valid_until:
                self._deposed("its etcd lease could not be renewed in time")
            self._stop.wait(wait_s)

    def _refused(self, exc: EtcdAccessError) -> None:
        now = time.monotonic()
        if now - self._refused_logged >= REFUSED_LOG_INTERVAL_S:
            self._refused_logged = now
            logger.error("master %s cannot campaign in cluster %s: %s", self._me.master_id if self._me else "?",
                         self.cluster, exc)

    def _stand_by(self) -> None:
        me = self._me
        assert me is not None
        kv = self.etcd.get(leader_key(self.cluster))
        self.last_seen = (time.monotonic(), None if kv is None else _leader(kv.value))
        if kv is not None:
            if json.loads(kv.value)["id"] == me.master_id or (self._lease and kv.lease == self._lease):
                self.etcd.revoke(kv.lease)  # our own key from before a deposition: let it go
                self._lease = 0
            return
        insync = self.etcd.get(insync_key(self.cluster))
        if insync is not None and me.master_id not in json.loads(insync.value)["members"]:
            return  # it lacks changes the last leader acknowledged
        sent = time.monotonic()
        lease = self.etcd.grant(self.ttl_s)
        value = json.dumps({"id": me.master_id, "address": me.address}).encode()
        revision = self.etcd.create(leader_key(self.cluster), value, lease)
        if not revision:
            self.etcd.revoke(lease)
            return
        with self._lock:
            self._lease, self._revision = lease, revision
            self._valid_until = sent + self.ttl_s - self.margin_s
        logger.info("master %s leads cluster %s (etcd revision %d, lease ttl %d s)", me.master_id, self.cluster,
                    revision, self.ttl_s)
        self._on_elected(revision)

    def _keep_alive(self) -> None:
        sent = time.monotonic()
        if self.etcd.keep_alive(self._lease) <= 0:
            self._deposed("its etcd lease expired")
            return
        self._valid_until = sent + self.ttl_s - self.margin_s

    def _deposed(self, reason: str) -> None:
        with self._lock:
            if not self._revision:
                return
            self._revision = 0
            self._valid_until = 0.0
        logger.warning("master %s no longer leads cluster %s: %s", self._me.master_id if self._me else "?",
                       self.cluster, reason)
        self._on_deposed(reason)


def _leader(value: bytes) -> Leader:
    fields = json.loads(value)
    return Leader(fields["id"], fields["address"])
