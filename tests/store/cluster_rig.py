"""Test rig for clusters of masters: relays that cut links, and the masters' health and roles.

The etcd itself is ``tidekv.bench.etcd_server.EtcdServer`` (the ``etcd`` fixtures). ``TcpRelay``
forwards one port to another so a test can cut the link (``cut()``: connections are dropped and
new ones black-holed, as a pulled cable looks) and heal it; ``EtcdView`` shows one client the
masters' addresses as relays of its own, to cut that client alone off from the leader.
``health(master)`` reads a master's ``/health``. ``churn(clients, ...)`` runs
``tidekv.bench.churn`` on load clients at once, ``churn_through`` while the test breaks
something (and checks the break landed mid-churn), and ``verify(clients)`` has each read back
every key it was acknowledged. Neighbours: ``conftest`` (fixtures), ``test_failover``, ``test_etcd_members``.
"""

from __future__ import annotations

import base64
import contextlib
import http.server
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

from tests.store.procs import AgentProcess, MasterProcess, wait_until

MASTER = {"leader_ttl_s": 2, "sync_timeout_s": 0.5, "client_ttl_s": 10.0, "lease_ttl_s": 2.0}
"""Settings of a cluster's masters in tests: leaders replaced within seconds."""
CLIENT = {"rpc_timeout_s": 1.0, "failover_timeout_s": 15.0}
HOLDER_BYTES = 64 << 20
"""The churn's holder segment: room for its live keys (200 per client, 4 KiB each) and for what
its writes and removes retire for a lease TTL (kept longer after a failover: the new leader's
quarantine), so nothing is evicted: an evicted key reads back absent, which churn counts stale."""
"""Settings of a cluster's store clients in tests."""


def churn(clients: list[AgentProcess], duration_s: float, during: Callable[[], Any] | None = None) -> list[dict]:
    """Every client churns its own keys for ``duration_s`` while ``during()`` runs here; their reports."""
    for i, c in enumerate(clients):
        c.start_call("churn", prefix=f"c{i}", duration_s=duration_s, keys=60, size=4096, seed=i)
    if during is not None:
        during()
    return [c.finish_call(duration_s + 60) for c in clients]


class Moments:
    """When the failures a test causes during ``churn`` landed: ``with moments.of("kill"): ...``."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, float, float]] = []

    @contextlib.contextmanager
    def of(self, what: str) -> Iterator[None]:
        started = time.monotonic()
        yield
        self.spans.append((what, started, time.monotonic()))

    def landed_during(self, reports: list[dict], *whats: str) -> None:
        """Asserts that each of ``whats`` (caused since the last check) landed while every client's
        churn ran, after its first acknowledged op: the load was under way when it hit."""
        spans, self.spans = self.spans, []
        assert [w for w, _, _ in spans] == list(whats), spans
        for what, started, ended in spans:
            for r in reports:
                assert r["first_ok_s"] is not None and r["began_s"] <= r["first_ok_s"] < started, \
                    f"{what} at {started:.3f} came before the churn acknowledged anything: {r}"
                assert ended < r["ended_s"], f"{what} ended at {ended:.3f}, after the churn did: {r}"


Step = tuple[float, str, Callable[[], Any]]
"""(wait_s, what, action): ``action`` runs ``wait_s`` after the step before it (or the churn's
start), recorded as ``what``."""


def churn_through(clients: list[AgentProcess], duration_s: float, *steps: Step) -> list[dict]:
    """``churn`` while ``steps`` cause their failures in order; asserts that each landed while
    every client's churn ran, after its first acknowledged op (``Moments.landed_during``)."""
    moments = Moments()

    def run() -> None:
        for wait_s, what, action in steps:
            time.sleep(wait_s)  # load runs a while first: the order is asserted, not assumed
            with moments.of(what):
                action()
    reports = churn(clients, duration_s, run)
    moments.landed_during(reports, *(what for _, what, _ in steps))
    return reports


def verify(clients: list[AgentProcess]) -> None:
    """Each client reads back every key: nothing acknowledged lost, no stale read, ever."""
    for c in clients:
        report = c.call("verify", timeout_s=60)
        assert (report["lost"], report["stale"], report["stale_reads"]) == (0, 0, 0), report
        assert report["acknowledged"] > 0, report


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


class EtcdView:
    """etcd as one client sees it: an HTTP relay to ``etcd_url`` that rewrites the address in
    leader keys through ``addresses`` (a master's real "host:port" -> what this client dials).

    Give a client ``etcd://{view.address}/NAME`` and a ``TcpRelay`` per master in ``addresses``,
    and it reaches every leader through relays of its own, which the test can cut, while the
    masters' replication and every other client use the real addresses. ``addresses`` may be
    changed at any time (a master started later)."""

    def __init__(self, etcd_url: str, addresses: dict[str, str]) -> None:
        self.etcd_url = etcd_url
        self.addresses = addresses
        view = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                status, reply = view._forward(self.path, body)
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def _forward(self, path: str, body: bytes) -> tuple[int, bytes]:
        request = urllib.request.Request(self.etcd_url + path, body, {"Content-Type": "application/json"})
        try:
            with _OPENER.open(request, timeout=5) as r:
                status, reply = r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()
        out = json.loads(reply)
        for kv in out.get("kvs") or []:
            if base64.b64decode(kv["key"]).endswith(b"/leader"):
                leader = json.loads(base64.b64decode(kv["value"]))
                leader["address"] = self.addresses.get(leader["address"], leader["address"])
                kv["value"] = base64.b64encode(json.dumps(leader).encode()).decode()
        return status, json.dumps(out).encode()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(5)


_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


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
