"""Test rig for clusters of masters: a real etcd on free ports, relays that cut links, health.

``EtcdProcess`` runs Debian's ``etcd`` (``etcd-server``) on two free 127.0.0.1 ports with its
own data directory; ``kill()``/``start()`` restart it on the same ports and data. ``TcpRelay``
forwards one port to another so a test can cut the link (``cut()``: connections are dropped and
new ones black-holed, as a pulled cable looks) and heal it. ``health(master)`` reads a master's
``/health``. Neighbours: ``conftest`` (fixtures), ``test_failover``.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from tests.store.procs import MasterProcess, wait_until

ETCD = shutil.which("etcd")
SKIP_REASON = "the etcd binary is not installed (Debian: apt-get install etcd-server; .ci/run installs it)"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EtcdProcess:
    def __init__(self, data_dir: Path, log_path: Path) -> None:
        self.data_dir = data_dir
        self.log_path = log_path
        self.client_port, self.peer_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.client_port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        assert ETCD is not None
        peer = f"http://127.0.0.1:{self.peer_port}"
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [ETCD, "--name", "t", "--data-dir", str(self.data_dir), "--listen-client-urls", self.url,
                 "--advertise-client-urls", self.url, "--listen-peer-urls", peer,
                 "--initial-advertise-peer-urls", peer, "--initial-cluster", f"t={peer}",
                 "--heartbeat-interval", "50", "--election-timeout", "500"],
                stdout=log, stderr=log)
        wait_until(self._is_healthy, 20.0, f"etcd on {self.url} to answer")

    def _is_healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=0.5) as r:
                return bool(json.loads(r.read()).get("health") in ("true", True))
        except OSError:
            return False

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


class TcpRelay:
    """127.0.0.1:``port`` -> ``target`` ("host:port"), until ``cut()``."""

    def __init__(self, target: str) -> None:
        host, port = target.replace("http://", "").rsplit(":", 1)
        self.target = (host, int(port))
        self.server = socket.create_server(("127.0.0.1", 0))
        self.server.settimeout(0.1)
        self.port = self.server.getsockname()[1]
        self.address = f"127.0.0.1:{self.port}"
        self.is_cut = False
        self._closed = False
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def cut(self) -> None:
        """Drops every connection; new ones are accepted and never answered."""
        with self._lock:
            self.is_cut = True
            for c in self._conns:
                c.close()
            self._conns.clear()

    def heal(self) -> None:
        with self._lock:
            self.is_cut = False

    def close(self) -> None:
        self._closed = True
        self.cut()
        self._thread.join(5)
        self.server.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self.server.accept()
            except OSError:
                continue
            with self._lock:
                self._conns.append(conn)
                if self.is_cut:
                    continue  # a black hole: held open, never answered
            try:
                upstream = socket.create_connection(self.target, timeout=2)
            except OSError:
                conn.close()
                continue
            with self._lock:
                self._conns.append(upstream)
            for a, b in ((conn, upstream), (upstream, conn)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data or self.is_cut:
                    break
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.close()
            except OSError:
                pass


def health(master: MasterProcess) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{master.metrics_port}/health", timeout=2) as r:
        return dict(json.loads(r.read()))


def role(master: MasterProcess) -> str:
    try:
        h = health(master)
    except OSError:
        return "down"
    return str(h["role"]) if h["serving"] or h["role"] != "leader" else "leader-not-serving"


def leader_of(masters: list[MasterProcess], timeout_s: float = 15.0) -> MasterProcess:
    """The one serving leader among ``masters`` (waits for it)."""
    def find() -> MasterProcess | None:
        leaders = [m for m in masters if m.is_alive() and role(m) == "leader"]
        return leaders[0] if len(leaders) == 1 else None
    return wait_until(find, timeout_s, "one serving leader")


def in_sync(masters: list[MasterProcess], n: int, timeout_s: float = 20.0) -> None:
    """Waits until the leader has ``n`` in-sync standbys."""
    def synced() -> bool:
        try:
            return len(health(leader_of(masters, 2.0)).get("insync", [])) == n + 1
        except (OSError, AssertionError):
            return False
    wait_until(synced, timeout_s, f"{n} standbys in sync", interval_s=0.1)


def wait_gone(master: MasterProcess) -> None:
    deadline = time.monotonic() + 10
    while master.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
