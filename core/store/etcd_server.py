"""EtcdServer: a local etcd of one or more members, started for tests and benches.

Runs Debian's ``etcd`` (package ``etcd-server``) on free 127.0.0.1 ports: each member has its
own client port, peer port and data directory, and the members form one cluster through
``--initial-cluster``. Short raft timings (heartbeat 50 ms, election 500 ms) keep the loss of a
member's leadership brief. A member can be SIGKILLed and started again on the same ports and
data (it rejoins the cluster). This is not how etcd is run in production: that is the
operator's own etcd, reached with ``--etcd``. Neighbours: ``etcd`` (the client), the
``tidekv bench failover`` run and the store's failover tests, which both use this.

Ownership: an ``EtcdServer`` owns its member processes; ``stop()`` ends them all. Not
thread-safe.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

from tidekv.bench.process import free_port
from tidekv.errors import ConfigError, TidekvError

logger = logging.getLogger(__name__)

MISSING = "the etcd binary is not installed (Debian: apt-get install etcd-server)"
"""Why an ``EtcdServer`` cannot start here, for skips and errors."""

START_TIMEOUT_S = 20.0
START_ATTEMPTS = 3
"""Times a cluster is started on fresh ports when a member finds one of its ports taken."""
_PORT_TAKEN = "bind: address already in use"
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def etcd_binary() -> str | None:
    """Path of the ``etcd`` binary on PATH, or None."""
    return shutil.which("etcd")


def _get_json(url: str, body: bytes | None = None, timeout_s: float = 0.5) -> Any:
    request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    with _OPENER.open(request, timeout=timeout_s) as response:
        return json.loads(response.read())


class EtcdMember:
    """One etcd process of an ``EtcdServer`` (its name, ports and data directory stay fixed)."""

    def __init__(self, binary: str, name: str, work_dir: Path) -> None:
        self.binary = binary
        self.name = name
        self.data_dir = work_dir / f"{name}.data"
        self.log_path = work_dir / f"{name}.log"
        self.client_port, self.peer_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.client_port}"
        """Its client URL ("http://127.0.0.1:PORT"), as ``--etcd`` takes it."""
        self.peer_url = f"http://127.0.0.1:{self.peer_port}"
        self.initial_cluster = ""
        self.proc: subprocess.Popen[bytes] | None = None
        self._log_start = 0

    def start(self) -> None:
        """Launches the process (returns at once: a member of several is healthy only with a quorum)."""
        assert self.initial_cluster, "the EtcdServer sets initial_cluster before any start"
        with open(self.log_path, "ab") as log:
            self._log_start = log.tell()
            self.proc = subprocess.Popen(
                [self.binary, "--name", self.name, "--data-dir", str(self.data_dir),
                 "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
                 "--listen-peer-urls", self.peer_url, "--initial-advertise-peer-urls", self.peer_url,
                 "--initial-cluster", self.initial_cluster,
                 "--heartbeat-interval", "50", "--election-timeout", "500"],
                stdout=log, stderr=log)
        logger.info("etcd member %s starting on %s (pid %d)", self.name, self.url, self.proc.pid)

    def is_alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def is_healthy(self) -> bool:
        """True when it answers ``/health`` with true (it is part of a cluster that has a leader)."""
        try:
            return _get_json(self.url + "/health").get("health") in ("true", True)
        except (OSError, ValueError):
            return False

    def wait_healthy(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Raises:
            TidekvError: it exited or was not healthy within ``timeout_s`` (the message quotes its log).
        """
        deadline = time.monotonic() + timeout_s
        while not self.is_healthy():
            if not self.is_alive() or time.monotonic() > deadline:
                raise TidekvError(f"etcd member {self.name} on {self.url} did not become healthy within "
                                  f"{timeout_s:.0f} s; the end of {self.log_path}:\n{self.log_text()[-3000:]}")
            time.sleep(0.05)

    def member_id(self) -> int:
        """Its raft member id."""
        return int(_get_json(self.url + "/v3/maintenance/status", b"{}")["header"]["member_id"])

    def leader_id(self) -> int:
        """The raft member id of the cluster's leader, as this member sees it."""
        return int(_get_json(self.url + "/v3/maintenance/status", b"{}")["leader"])

    def kill(self) -> None:
        """SIGKILL, then reap."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            logger.info("etcd member %s killed", self.name)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it lingers past 10 s."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def lost_a_port(self) -> bool:
        """True when it exited because another process took one of its ports between the
        moment it was picked free and etcd's bind."""
        if self.proc is None or self.is_alive():
            return False
        with open(self.log_path, "rb") as log:
            log.seek(self._log_start)
            return _PORT_TAKEN.encode() in log.read()


class EtcdServer:
    """``members`` etcd processes forming one cluster, started and healthy when this returns.

    Args:
        work_dir: where the members' data directories and logs go (it must exist).
        members: how many (1, or 3 to survive the loss of one).

    A port is picked free and bound by etcd a moment later; when another process takes it in
    between (another server a test starts can), the member exits, and the whole cluster is
    started again on fresh ports and empty data directories, up to ``START_ATTEMPTS`` times.

    Raises:
        ConfigError: the etcd binary is not installed.
        TidekvError: a member did not become healthy in time (every member is stopped again).
    """

    def __init__(self, work_dir: Path, members: int = 1) -> None:
        binary = etcd_binary()
        if binary is None:
            raise ConfigError(MISSING)
        if members < 1:
            raise ConfigError(f"members={members}: an etcd cluster has at least 1 member")
        for attempt in range(1, START_ATTEMPTS + 1):
            self.members = [EtcdMember(binary, f"etcd{i}", work_dir) for i in range(members)]
            try:
                self._start()
                return
            except TidekvError:
                if attempt == START_ATTEMPTS or not any(m.lost_a_port() for m in self.members):
                    raise
                logger.warning("an etcd member lost a port to another process; starting the cluster "
                               "again on fresh ports (attempt %d of %d)", attempt + 1, START_ATTEMPTS)
                for m in self.members:
                    shutil.rmtree(m.data_dir, ignore_errors=True)

    def _start(self) -> None:
        initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        for m in self.members:
            m.initial_cluster = initial
            m.start()
        try:
            for m in self.members:
                m.wait_healthy()
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        """Every member's client URL, comma-separated, as ``--etcd`` takes them."""
        return ",".join(m.url for m in self.members)

    @property
    def endpoints(self) -> str:
        """Every member's "host:port", comma-separated, as ``etcd://H:P,H:P/NAME`` takes them."""
        return ",".join(m.url.removeprefix("http://") for m in self.members)

    def leader(self) -> EtcdMember:
        """The member that leads the raft cluster now (waits up to 10 s for one)."""
        deadline = time.monotonic() + 10.0
        while True:
            for m in self.members:
                try:
                    if m.is_alive() and m.member_id() == m.leader_id():
                        return m
                except (OSError, ValueError, KeyError):
                    continue
            if time.monotonic() > deadline:
                raise TidekvError(f"no etcd member of {self.url} leads")
            time.sleep(0.05)

    def stop(self) -> None:
        for m in self.members:
            m.stop()

    def log_text(self) -> str:
        return "\n".join(f"--- {m.name} ({m.url})\n{m.log_text()}" for m in self.members)
