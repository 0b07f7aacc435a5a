"""EtcdServer: a local etcd of one or more members, started for tests and benches.

Runs Debian's ``etcd`` on free ports, one client port, peer port and data directory per member,
on 127.0.0.1 or on given ``hosts`` (commands to a member then run through its host's argv prefix).
A member can be SIGKILLed and started again on the same ports and data (it rejoins the cluster).
``EtcdServerTls`` and ``EtcdServerAuth`` secure it as an operator's etcd may be;
``client_settings()`` is what a tidekv client then needs, ``admin()`` calls etcd as root. Not for
production (that is the operator's etcd, reached with ``--etcd``). Neighbours:
``tidekv.store.ha.etcd`` (the client), ``tidekv bench failover`` and the store's failover tests.

Ownership: an ``EtcdServer`` owns its member processes; ``stop()`` ends them all. Not
thread-safe.
Design notes: docs/design-bench.md#tidekvbenchetcd_server
"""

from __future__ import annotations

import base64
import email.message
import io
import json
import logging
import secrets
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tidekv.bench.ports import free_port
from tidekv.config import EtcdSecurity
from tidekv.errors import ConfigError, TidekvError

logger = logging.getLogger(__name__)

MISSING = "the etcd binary is not installed (Debian: apt-get install etcd-server)"
"""Why an ``EtcdServer`` cannot start here, for skips and errors."""

START_TIMEOUT_S = 20.0
START_ATTEMPTS = 3
"""Times a cluster is started on fresh ports when a member finds one of its ports taken."""
_PORT_TAKEN = "bind: address already in use"
HOST_CALL_OVERHEAD_S = 10.0
"""What a call to a member on another host may take beyond its own timeout: starting the child
process that makes it there (a Python interpreter, behind the prefix)."""
_CALL_ON_HOST = r"""
import json, ssl, sys, urllib.error, urllib.request
spec = json.loads(sys.argv[1])
handlers = [urllib.request.ProxyHandler({})]
if spec["url"].startswith("https://"):
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=spec["ca_file"])
    if spec["cert_file"] is not None:
        context.load_cert_chain(spec["cert_file"], spec["key_file"])
    handlers.append(urllib.request.HTTPSHandler(context=context))
data = None if spec["data"] is None else spec["data"].encode()
request = urllib.request.Request(spec["url"], data, spec["headers"])
try:
    with urllib.request.build_opener(*handlers).open(request, timeout=spec["timeout_s"]) as response:
        out = {"reply": response.read().decode(errors="replace")}
except urllib.error.HTTPError as exc:
    out = {"status": exc.code, "reason": str(exc.reason), "body": exc.read().decode(errors="replace")}
except OSError as exc:
    out = {"error": f"{type(exc).__name__}: {exc}"}
print(json.dumps(out), flush=True)
"""
"""What a member's host runs for one call (stdlib only, under ``python -I``): the request, then
one JSON line: the reply's text, the HTTP refusal, or the OSError."""


@dataclass(frozen=True, slots=True)
class EtcdHost:
    """Where a member runs: it listens on ``ip``, and its process, like every call this server
    makes to it, runs through ``prefix``."""

    ip: str = "127.0.0.1"
    """The address its client and peer URLs are on. Default 127.0.0.1."""
    prefix: tuple[str, ...] = ()
    """The argv that runs a command on that host, prepended to etcd's own (e.g. a
    ``tests/multihost`` host's ``command([])``); it must exec the command, so that ``kill()``
    reaches etcd itself. Default (): this process's own host, calls made from this process."""


LOOPBACK = EtcdHost()
"""Every member on this host's 127.0.0.1: the default."""


def etcd_binary() -> str | None:
    """Path of the ``etcd`` binary on PATH, or None."""
    return shutil.which("etcd")


@dataclass(frozen=True, slots=True)
class EtcdServerTls:
    """TLS on the members' client URLs (their peer URLs stay plain http, on loopback or the
    ``EtcdHost`` addresses)."""

    ca_file: str
    """PEM CA that signed ``cert_file`` (and, with ``client_cert_file``, the clients' certificates)."""
    cert_file: str
    """PEM certificate the members present, valid for 127.0.0.1 (with ``hosts``, for every host's address)."""
    key_file: str
    """PEM private key of ``cert_file``."""
    client_cert_file: str | None = None
    """Set: etcd requires client certificates signed by ``ca_file`` (``--client-cert-auth``), and
    this server's own calls present this one (with no Common Name when authentication is on too:
    etcd's JSON gateway refuses such certificates then). Default None: none required."""
    client_key_file: str | None = None
    """PEM private key of ``client_cert_file``."""


@dataclass(frozen=True, slots=True)
class EtcdServerAuth:
    """etcd authentication: a root user, and ``user`` whose role, of the same name, may read and
    write the keys under ``key_prefix`` and nothing else."""

    password: str
    """``user``'s password."""
    user: str = "tidekv"
    """The user tidekv authenticates as. Default "tidekv"."""
    key_prefix: str = "/tidekv/"
    """The keys its role may read and write. Default "/tidekv/" (every key of tidekv's)."""
    token_ttl_s: int = 300
    """How long a token stays valid unused (etcd's ``--auth-token-ttl``). Default 300 s."""


def _prefix_end(prefix: bytes) -> bytes:
    """The range end that covers every key starting with ``prefix`` (etcdctl's --prefix)."""
    return prefix[:-1] + bytes([prefix[-1] + 1])


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


class EtcdMember:
    """One etcd process of an ``EtcdServer`` (its name, ports and data directory stay fixed)."""

    def __init__(self, binary: str, name: str, work_dir: Path, tls: EtcdServerTls | None = None,
                 auth_token_ttl_s: int | None = None, host: EtcdHost = LOOPBACK, pre_vote: bool = False) -> None:
        self.binary = binary
        self.name = name
        self.host = host
        self.data_dir = work_dir / f"{name}.data"
        self.log_path = work_dir / f"{name}.log"
        # Picked free here, for a host that may be another network namespace: a port taken
        # there meanwhile is the same retry as one taken here (``lost_a_port``).
        self.client_port, self.peer_port = free_port(), free_port()
        self.url = f"{'https' if tls else 'http'}://{host.ip}:{self.client_port}"
        """Its client URL ("http://IP:PORT", https with TLS), as ``--etcd`` takes it."""
        self.peer_url = f"http://{host.ip}:{self.peer_port}"
        self.initial_cluster = ""
        self.proc: subprocess.Popen[bytes] | None = None
        self._log_start = 0
        self._security_args: list[str] = []
        self._tls_files: dict[str, str | None] = {"ca_file": None, "cert_file": None, "key_file": None}
        handlers: list[urllib.request.BaseHandler] = [urllib.request.ProxyHandler({})]
        if tls is not None:
            self._tls_files = {"ca_file": tls.ca_file, "cert_file": tls.client_cert_file,
                               "key_file": tls.client_key_file}
            self._security_args = ["--cert-file", tls.cert_file, "--key-file", tls.key_file]
            if tls.client_cert_file is not None:
                self._security_args += ["--trusted-ca-file", tls.ca_file, "--client-cert-auth"]
            security = EtcdSecurity(ca_file=tls.ca_file, cert_file=tls.client_cert_file, key_file=tls.client_key_file)
            handlers.append(urllib.request.HTTPSHandler(context=security.client_context()))
        if auth_token_ttl_s is not None:
            self._security_args += ["--auth-token", "simple", "--auth-token-ttl", str(auth_token_ttl_s)]
        self._raft_args = ["--pre-vote"] if pre_vote else []
        self._opener = urllib.request.build_opener(*handlers)

    def call(self, path: str, body: dict[str, Any] | None = None, token: str | None = None,
             timeout_s: float = 0.5) -> Any:
        """POSTs ``body`` (GET without one) to this member, from its host; the JSON reply. Raises
        OSError (urllib's HTTPError for a refusal) or ValueError."""
        headers = {"Content-Type": "application/json", **({"Authorization": token} if token else {})}
        if self.host.prefix:
            return json.loads(self._call_on_host(path, None if body is None else json.dumps(body), headers, timeout_s))
        data = None if body is None else json.dumps(body).encode()
        with self._opener.open(urllib.request.Request(self.url + path, data, headers), timeout=timeout_s) as response:
            return json.loads(response.read())

    def _call_on_host(self, path: str, data: str | None, headers: dict[str, str], timeout_s: float) -> str:
        """``call``'s request, made by a child process on the member's host; the reply's text.
        Raises what ``call`` raises, as urllib would have here."""
        url = self.url + path
        spec = {"url": url, "data": data, "headers": headers, "timeout_s": timeout_s, **self._tls_files}
        argv = [*self.host.prefix, sys.executable, "-I", "-c", _CALL_ON_HOST, json.dumps(spec)]
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s + HOST_CALL_OVERHEAD_S,
                                  check=False)
        except subprocess.TimeoutExpired:
            raise OSError(f"the call of {url} on {self.host.ip} did not return within "
                          f"{timeout_s + HOST_CALL_OVERHEAD_S:.1f} s") from None
        try:
            out = json.loads(done.stdout.splitlines()[-1])
        except (IndexError, ValueError):
            raise OSError(f"the call of {url} on {self.host.ip} exited with {done.returncode} and no answer; "
                          f"its stderr: {done.stderr.strip()[-2000:]}") from None
        if "status" in out:
            raise urllib.error.HTTPError(url, int(out["status"]), str(out["reason"]), email.message.Message(),
                                         io.BytesIO(str(out["body"]).encode()))
        if "error" in out:
            raise OSError(f"{url} (called on {self.host.ip}): {out['error']}")
        return str(out["reply"])

    def start(self) -> None:
        """Launches the process (returns at once: a member of several is healthy only with a quorum)."""
        assert self.initial_cluster, "the EtcdServer sets initial_cluster before any start"
        with open(self.log_path, "ab") as log:
            self._log_start = log.tell()
            self.proc = subprocess.Popen(
                [*self.host.prefix, self.binary, "--name", self.name, "--data-dir", str(self.data_dir),
                 "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
                 "--listen-peer-urls", self.peer_url, "--initial-advertise-peer-urls", self.peer_url,
                 "--initial-cluster", self.initial_cluster,
                 "--heartbeat-interval", "50", "--election-timeout", "500", *self._raft_args,
                 *self._security_args],
                stdout=log, stderr=log)
        logger.info("etcd member %s starting on %s (pid %d)", self.name, self.url, self.proc.pid)

    def is_alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def is_healthy(self) -> bool:
        """True when it answers ``/health`` with true (it is part of a cluster that has a leader)."""
        try:
            return self.call("/health").get("health") in ("true", True)
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
        return int(self.call("/v3/maintenance/status", {})["header"]["member_id"])

    def leader_id(self) -> int:
        """The raft member id of the cluster's leader, as this member sees it."""
        return int(self.call("/v3/maintenance/status", {})["leader"])

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
        work_dir: where the members' data directories and logs go (it must exist, and be
            visible to ``hosts`` at the same path).
        members: how many (1, or 3 to survive the loss of one).
        tls: serve the client URLs over https (default: http).
        auth: turn authentication on once the cluster is healthy (default: off).
        hosts: where each member runs, one ``EtcdHost`` per member (then ``members`` is their
            number; give it as 1 or that number). Default None: every member on 127.0.0.1 here.
        pre_vote: members run raft's pre-vote phase (``--pre-vote``, etcd 3.5's default): one cut
            off from the others, which keeps campaigning meanwhile, does not depose the raft
            leader when it is back. Default False (etcd 3.4's default: it does, and the cluster
            has no leader for an election or more).

    A port is picked free and bound by etcd a moment later; when another process takes it in
    between (another server a test starts can), the member exits, and the whole cluster is
    started again on fresh ports and empty data directories, up to ``START_ATTEMPTS`` times.

    Raises:
        ConfigError: the etcd binary is not installed, or ``members`` and ``hosts`` disagree.
        TidekvError: a member did not become healthy in time (every member is stopped again).
    """

    def __init__(self, work_dir: Path, members: int = 1, *, tls: EtcdServerTls | None = None,
                 auth: EtcdServerAuth | None = None, hosts: Sequence[EtcdHost] | None = None,
                 pre_vote: bool = False) -> None:
        binary = etcd_binary()
        if binary is None:
            raise ConfigError(MISSING)
        if hosts is not None:
            if not hosts or members not in (1, len(hosts)):
                raise ConfigError(f"members={members}, hosts={list(hosts)!r}: give one EtcdHost per member "
                                  "(members may be left at 1)")
            members = len(hosts)
        if members < 1:
            raise ConfigError(f"members={members}: an etcd cluster has at least 1 member")
        places = list(hosts) if hosts is not None else [LOOPBACK] * members
        self.tls = tls
        self.auth = auth
        self.root_password = secrets.token_hex(16)
        """The root user's password (with ``auth``)."""
        ttl_s = auth.token_ttl_s if auth is not None else None
        for attempt in range(1, START_ATTEMPTS + 1):
            self.members = [EtcdMember(binary, f"etcd{i}", work_dir, tls, ttl_s, place, pre_vote)
                            for i, place in enumerate(places)]
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
            if self.auth is not None:
                self._enable_auth(self.auth)
        except BaseException:
            self.stop()
            raise

    def _enable_auth(self, auth: EtcdServerAuth) -> None:
        prefix = auth.key_prefix.encode()
        for path, body in (
                ("/v3/auth/user/add", {"name": "root", "password": self.root_password}),
                ("/v3/auth/user/grant", {"user": "root", "role": "root"}),
                ("/v3/auth/role/add", {"name": auth.user}),
                ("/v3/auth/role/grant", {"name": auth.user, "perm": {
                    "permType": "READWRITE", "key": _b64(prefix), "range_end": _b64(_prefix_end(prefix))}}),
                ("/v3/auth/user/add", {"name": auth.user, "password": auth.password}),
                ("/v3/auth/user/grant", {"user": auth.user, "role": auth.user}),
                ("/v3/auth/enable", {})):
            self.admin(path, body)
        logger.info("etcd %s: authentication on; user %s may read and write %s", self.url, auth.user, auth.key_prefix)

    def admin(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """Calls the gateway's ``path`` as root (anonymously while authentication is off).

        Raises:
            TidekvError: no member answered, or etcd refused the call (the message quotes it).
        """
        errors = []
        for m in self.members:
            if not m.is_alive():
                continue
            try:
                reply: dict[str, Any] = m.call(path, body, self._root_token(m, path), timeout_s=5.0)
                return reply
            except urllib.error.HTTPError as exc:
                raise TidekvError(f"etcd {m.url} refused {path}: HTTP {exc.code} "
                                  f"{exc.read().decode(errors='replace')}") from None
            except (OSError, ValueError) as exc:
                errors.append(f"{m.url}: {exc}")
        raise TidekvError(f"no etcd member of {self.url} answered {path}: {'; '.join(errors)}")

    def _root_token(self, member: EtcdMember, path: str) -> str | None:
        """root's token from ``member``; None while authentication is off."""
        if self.auth is None or path == "/v3/auth/enable":
            return None
        try:
            reply = member.call("/v3/auth/authenticate", {"name": "root", "password": self.root_password}, timeout_s=5.0)
        except urllib.error.HTTPError as exc:
            text = exc.read()
            if b"authentication is not enabled" in text:
                return None
            raise TidekvError(f"etcd {member.url} refused root: HTTP {exc.code} {text.decode(errors='replace')}") \
                from None
        return str(reply["token"])

    def client_settings(self) -> EtcdSecurity:
        """What a tidekv client sets to reach this etcd: its CA, the client certificate, the user."""
        tls, auth = self.tls, self.auth
        return EtcdSecurity(ca_file=tls.ca_file if tls else None, cert_file=tls.client_cert_file if tls else None,
                            key_file=tls.client_key_file if tls else None, user=auth.user if auth else None,
                            password=auth.password if auth else None)

    @property
    def url(self) -> str:
        """Every member's client URL, comma-separated, as ``--etcd`` takes them."""
        return ",".join(m.url for m in self.members)

    @property
    def endpoints(self) -> str:
        """Every member's "host:port", comma-separated, as ``etcd://H:P,H:P/NAME`` takes them."""
        return ",".join(m.url.partition("://")[2] for m in self.members)

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
