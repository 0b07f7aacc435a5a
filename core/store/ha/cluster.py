"""ClusterRole: a master's part in a cluster of masters (``tidekv master --etcd ... --cluster``).

A master starts as a standby: it follows whichever master leads (``replication.FollowSession``
keeps a ``journal.Mirror`` of the leader's index) and answers clients not_ready, naming the
leader. When ``election.Campaign`` elects it, it stops following, records itself as the only
in-sync master in etcd (so nobody who may lack its changes can lead after it), restores the
mirror into its service and serves, replicating to the standbys that follow it from then on.
A leader that loses its lease (or finds it about to pass) steps down at once: it closes every
connection, so no reply waiting for replication is ever sent, drops its index and stands by
again under a new id. A master whose TLS or user etcd refuses does not start (``EtcdAccessError``
from its first read of etcd). Neighbours: ``server`` (the event loop and connections this drives),
``election``, ``replication``.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from typing import TYPE_CHECKING

from tidekv.store.ha.election import POLL_S, REFUSED_RETRY_S, Campaign, Leader
from tidekv.store.ha.etcd import EtcdAccessError, EtcdClient, EtcdError, EtcdUnavailableError
from tidekv.store.ha.replication import FollowSession, Replicator
from tidekv.store.master.journal import Mirror
from tidekv.store.master.service import MasterService

if TYPE_CHECKING:
    from tidekv.store.master.server import MasterServer

logger = logging.getLogger(__name__)


class Role(enum.Enum):
    STANDBY = "standby"
    PROMOTING = "promoting"
    LEADER = "leader"
    STOPPED = "stopped"


class ClusterRole:
    def __init__(self, server: MasterServer) -> None:
        config = server.config
        self.server = server
        self.cluster = config.cluster
        self.etcd = EtcdClient(config.etcd_urls(), timeout_s=max(0.5, config.leader_ttl_s / 4),
                               security=config.etcd_security)
        self.campaign = Campaign(self.etcd, config.cluster, config.leader_ttl_s,
                                 on_elected=self._elected, on_deposed=self._deposed)
        self._check_etcd()
        self.state = Role.STANDBY
        self._session: FollowSession | None = None
        self._mirror: Mirror | None = None
        self._idle = threading.Event()  # the follow thread is between sessions
        self._thread: threading.Thread | None = None
        self._standing_by(server.service)

    def _check_etcd(self) -> None:
        """One read of etcd before the master starts: a refused TLS handshake or user stops it with
        the reason (EtcdAccessError); an etcd that does not answer yet is only waited for."""
        try:
            self.campaign.leader()
        except EtcdUnavailableError as exc:
            logger.warning("etcd of cluster %s does not answer yet; standing by until it does: %s", self.cluster, exc)

    def start(self) -> None:
        self.campaign.start(self._me())
        self._thread = threading.Thread(target=self._follow_loop, name="tidekv-standby", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.state = Role.STOPPED
        session = self._session
        if session is not None:
            session.stop()
        self.campaign.stop()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def check_lease(self) -> bool:
        """On the loop, before serving: False (and the leader steps down) once the lease may have passed."""
        if self.state is Role.LEADER and not self.campaign.is_leading:
            self._step_down("its lease may have passed to another master")
            return False
        return True

    # ---- standing by (the follow thread) -----------------------------------------------

    def _me(self) -> Leader:
        return Leader(self.server.service.master_id, self.server.address)

    def _standing_by(self, service: MasterService) -> None:
        service.not_serving = f"is a standby of cluster {self.cluster!r}, not its leader"

    def _follow_loop(self) -> None:
        while self.state is not Role.STOPPED:
            self._idle.set()
            time.sleep(POLL_S)
            if self.state is not Role.STANDBY:
                continue
            try:
                leader = self.campaign.leader()
            except EtcdUnavailableError:
                continue
            except EtcdAccessError:  # the campaign, polling the same etcd, logs it
                time.sleep(REFUSED_RETRY_S)
                continue
            service = self.server.service
            if leader is None or leader.master_id == service.master_id:
                continue
            service.leader_hint = leader.address
            session = FollowSession(leader.address, service.master_id, self.server.config.lease_ttl_s, service.clock,
                                    self.server.config.secret, self.server.config.standby_tls())
            self._idle.clear()
            self._session = session
            if self.state is Role.STANDBY:
                self._follow(session, leader)
            self._session = None
            if session.mirror is not None:
                self._mirror = session.mirror

    def _follow(self, session: FollowSession, followed: Leader) -> None:
        """Runs ``session`` until it ends, ending it once etcd names another leader: a leader
        whose host was cut off never closes the connection, and a standby still bound to it
        would hold back every change the new leader makes (it waits for an in-sync standby)."""
        started = time.monotonic()
        thread = threading.Thread(target=session.run, name="tidekv-follow", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(POLL_S)
            seen_at, leader = self.campaign.last_seen  # the campaign polls the leader key every POLL_S
            if (thread.is_alive() and seen_at > started and leader is not None
                    and leader.master_id != followed.master_id):
                logger.info("standby %s: %s now leads; leaving %s", self.server.service.master_id,
                            leader.address, session.leader)
                session.stop()

    # ---- transitions --------------------------------------------------------------------

    def _elected(self, revision: int) -> None:
        """Campaign thread: stop following, make this master the only in-sync one, then serve."""
        self.state = Role.PROMOTING
        session = self._session
        if session is not None:
            session.stop()
        self._idle.wait()  # the follow thread finishes the batch it is applying
        me = self.server.service.master_id
        while self.campaign.is_leading:
            try:
                if self.campaign.set_insync([me]):
                    break
            except EtcdError:
                pass
            time.sleep(POLL_S)
        else:
            return  # the lease went first: the campaign reports the deposition
        mirror, self._mirror = self._mirror or Mirror(self.server.config.lease_ttl_s), None
        loop = self.server.loop
        assert loop is not None
        loop.call_soon_threadsafe(self._lead, mirror)

    def _lead(self, mirror: Mirror) -> None:
        """Loop: serve the mirrored index."""
        if self.state is not Role.PROMOTING or not self.campaign.is_leading:
            return
        started = time.perf_counter()
        service = self.server.service
        service.restore(mirror)
        service.enable_journal(track_keys=True)
        config = self.server.config
        self.server.replicator = Replicator(service.master_id, config.sync_timeout_s, self.campaign.set_insync,
                                            self.server.committed, config.min_standbys)
        service.leader_hint = ""
        service.not_serving = ""
        self.state = Role.LEADER
        logger.info("master %s serves as leader of %s: %d objects restored in %.3f s; changes are acknowledged "
                    "once %d standby(s) hold them (--min-standbys)", service.master_id, self.cluster,
                    len(mirror.objects), time.perf_counter() - started, config.min_standbys)

    def _deposed(self, reason: str) -> None:
        loop = self.server.loop
        if loop is not None:
            loop.call_soon_threadsafe(self._step_down, reason)

    def _step_down(self, reason: str) -> None:
        """Loop: stop serving at once, forget the index, stand by under a new id."""
        if self.state is Role.STOPPED or (self.state is Role.STANDBY and not self.campaign.is_leading):
            return
        old = self.server.service.master_id
        self.campaign.resign()
        self.server.reset_service()
        self._standing_by(self.server.service)
        self.campaign.rename(self._me())
        self.state = Role.STANDBY
        logger.warning("master %s stepped down (%s); standing by as %s", old, reason, self.server.service.master_id)
