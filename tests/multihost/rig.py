"""Several hosts on one machine for tests: network namespaces joined by Linux bridges (``Rig``).

A ``Rig`` of N hosts is N network namespaces, each with loopback up and an ``eth0`` (one end of a
veth pair) holding one IPv4 address of a private /24; the other ends are ports of one bridge.
``Rig(n, nics=2)`` gives every host a second NIC, ``eth1``, on a second bridge and /24 (the next
one), as machines with two RDMA rails have.
The bridge and its ports live in a switch namespace of the rig's own, not in the machine's, so
that the machine's firewall and ``br_netfilter`` settings never see the rig's traffic and a rig
adds nothing to ``ip link`` here. ``host.cut()`` sets the host's bridge port down (its packets
go nowhere: connects time out or fail, both ways; every NIC of the host) and ``host.heal()`` sets
it up again.

Each host stands for a machine: besides its address it has a boot id of its own, a random one
mounted over the kernel's (``/proc/sys/kernel/random/boot_id``) for its processes, so that
tidekv, which tells same-host peers by boot id, takes two hosts for two machines. A plain host
still shares this machine's PIDs and /dev/shm (tidekv uses them only between processes of one
boot id), so that its commands are exec'd as they are: a Popen's pid is the command's own, and
SIGSTOP or /proc/<pid> reach it.

A host made a *pod* of another host's node (``Rig(3, pods={1: 0, 2: 0})``) has its node's boot
id, and PID, IPC and mount namespaces of its own, with a fresh tmpfs on ``/dev/shm``, shared by
every process started in it, as the containers of one Kubernetes pod are. ``pod.py`` holds its
init and the shim its commands run under.

Names carry the maker's pid (``tkv<pid hex>-<n>-h0``...), so that making a rig first removes what
rigs of dead processes left (``namespaces.remove_stale_rigs``); ``close()`` kills every process
in the rig's namespaces, whoever started it, then deletes them. Rigs are made under a
machine-wide lock, and the switch namespace's name carries the rig's subnet
(``...-sw-10.231.0.0``, ``...-sw-10.231.0.0x2`` for two NICs), so that rigs made at once
(pytest-xdist workers) get different subnets.
Not thread-safe. Needs root, ``ip`` (iproute2), ``sh``, ``mount`` and, for pods, ``unshare``
(util-linux); ``missing_prerequisites`` says what is missing.
Neighbours: ``namespaces.py`` (the kernel side), ``pod.py``, ``conftest.py`` (the ``multihost``
fixture), ``test_rig.py``.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import ipaddress
import itertools
import json
import logging
import os
import re
import selectors
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tests.multihost import namespaces as ns
from tests.multihost import pod
from tests.multihost.namespaces import RigError, ip

logger = logging.getLogger(__name__)

IFNAME_MAX_CHARS = 15
"""The kernel's limit on an interface name (IFNAMSIZ less the NUL)."""
SUBNET_POOLS = (ipaddress.IPv4Network("10.231.0.0/16"), ipaddress.IPv4Network("172.29.0.0/16"))
"""Where a rig's /24 comes from: the first one that no address here or of another rig overlaps."""
POD_START_TIMEOUT_S = 10.0
"""How long a pod's init has to mount its /dev/shm and say so."""
_PACKAGES = {"ip": "iproute2", "sh": "dash", "mount": "mount", "unshare": "util-linux"}
_WITH_BOOT_ID = 'mount --bind "$0" /proc/sys/kernel/random/boot_id && exec "$@"'
"""``sh -c`` script: mounts the file named by $0 over the boot id, then execs the command.
`ip netns exec` made the mount namespace it runs in (a slave one: nothing propagates back)."""
_POD_UNSHARE = ("unshare", "--pid", "--fork", "--mount", "--mount-proc", "--ipc", "--kill-child")
_SWITCH_RE = re.compile(r"-sw-(\d+\.\d+\.\d+\.0)(?:x(\d+))?$")
"""A switch namespace's name ends with its rig's first subnet and, past one, how many /24s follow."""
MAX_NICS = 4
_rig_numbers = itertools.count()
_open_rigs: set[Rig] = set()



@functools.cache
def missing_prerequisites(*, with_pods: bool) -> str | None:
    """Why no rig (``with_pods``: with pods) can be made here, or None when one can.

    Checks root and the tools on PATH, then makes (and deletes) a namespace with a bridge and a
    veth in it, and runs a command in it (and, with pods, in a pod's namespaces).

    Raises:
        RigError: the probe's namespace was made but could not be deleted (a failure, not a lack).
    """
    if os.geteuid() != 0:
        return (f"needs root (running as uid {os.geteuid()}): network namespaces, bridges and veths "
                "need CAP_SYS_ADMIN and CAP_NET_ADMIN")
    for tool in ("ip", "sh", "mount", "unshare") if with_pods else ("ip", "sh", "mount"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not on PATH (Debian package {_PACKAGES[tool]})"
    name = f"{ns.PREFIX}{os.getpid():x}-probe"
    subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True, timeout=ns.COMMAND_TIMEOUT_S)
    ns.RUN_DIR.mkdir(mode=0o700, exist_ok=True)
    boot_id = ns.RUN_DIR / f"{name}.boot_id"
    boot_id.write_text(f"{uuid.uuid4()}\n")
    steps = [["ip", "netns", "add", name],
             ["ip", "-n", name, "link", "add", "probe-br", "type", "bridge"],
             ["ip", "-n", name, "link", "add", "probe-a", "type", "veth", "peer", "name", "probe-b"],
             ["ip", "netns", "exec", name, "sh", "-c", _WITH_BOOT_ID, str(boot_id), "sh", "-c", "exit 0"]]
    if with_pods:
        steps.append(["ip", "netns", "exec", name, *_POD_UNSHARE, "--", "sh", "-c", "exit 0"])
    try:
        for step in steps:
            done = subprocess.run(step, check=False, capture_output=True, text=True, timeout=ns.COMMAND_TIMEOUT_S)
            if done.returncode != 0:
                return f"`{' '.join(step)}` failed (exit {done.returncode}): {done.stderr.strip()}"
    finally:
        boot_id.unlink()
        if name in ns.netns_names():
            ip("netns", "del", name)
    return None


class Host:
    """One host of a rig: a network namespace whose ``eth0`` has address ``ip`` on the rig's bridge
    (and with ``nics`` > 1, ``eth1``... with ``ips[1]``... on the rig's further bridges).

    ``node`` names the host whose machine it stands for: its own name, or for a pod its node's;
    ``boot_id`` is that machine's, as the host's processes read it.
    """

    def __init__(self, rig: Rig, name: str, netns: str, addresses: list[str], ports: list[str], node: str,
                 boot_id: str) -> None:
        self.name = name
        self.netns = netns
        self.ips = addresses
        self.ip = addresses[0]
        self.node = node
        self.boot_id = boot_id
        self.is_cut = False
        self._rig = rig
        self._ports = ports
        self._boot_id_file = ns.RUN_DIR / f"{netns}.boot_id"

    @property
    def is_pod(self) -> bool:
        return False

    def command(self, argv: Sequence[str]) -> list[str]:
        """The argv that runs ``argv`` on this host from this machine (``command([])``: the prefix,
        for process drivers that make their own Popen). It execs ``argv`` (``ip netns exec``) or,
        on a pod, stays its parent and passes signals and exit status through (``pod.py exec``).

        Raises:
            RigError: the rig is closed (or, for a pod, the pod is gone).
        """
        self._rig._check_open()
        return ["ip", "netns", "exec", self.netns, "sh", "-c", _WITH_BOOT_ID, str(self._boot_id_file), *argv]

    def popen(self, argv: Sequence[str], **popen_kwargs: Any) -> subprocess.Popen[Any]:
        """Starts ``argv`` on this host; ``popen_kwargs`` go to ``subprocess.Popen`` (the environment
        is inherited unless ``env`` is given). ``close()`` kills it and whatever it started here.

        Raises:
            RigError: the rig is closed (or, for a pod, the pod is gone).
            TypeError: ``shell`` or ``executable`` was given: the command is wrapped, pass an argv.
        """
        if "shell" in popen_kwargs or "executable" in popen_kwargs:
            raise TypeError("Host.popen takes an argv list; shell= and executable= cannot be wrapped into a namespace")
        proc = subprocess.Popen(self.command(argv), **popen_kwargs)
        self._rig._processes.append(proc)
        return proc

    def run(self, argv: Sequence[str], *, timeout_s: float = 30.0, check: bool = False,
            input: str | bytes | None = None, **popen_kwargs: Any) -> subprocess.CompletedProcess[Any]:
        """Runs ``argv`` on this host to its end, as ``subprocess.run`` does: output captured as text
        unless ``popen_kwargs`` say otherwise.

        Raises:
            subprocess.TimeoutExpired: it ran past ``timeout_s`` (it was killed first).
            subprocess.CalledProcessError: ``check`` and it exited non-zero.
            RigError: the rig is closed (or, for a pod, the pod is gone).
        """
        popen_kwargs = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, **popen_kwargs}
        if input is not None:
            popen_kwargs.setdefault("stdin", subprocess.PIPE)
        with self.popen(argv, **popen_kwargs) as proc:
            try:
                out, err = proc.communicate(input, timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                raise
        if check and proc.returncode:
            raise subprocess.CalledProcessError(proc.returncode, proc.args, out, err)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def cut(self) -> None:
        """Cuts this host off from every other one, both ways (its bridge ports go down)."""
        for port in self._ports:
            ip("-n", self._rig.switch_netns, "link", "set", port, "down")
        self.is_cut = True
        logger.info("rig %s: %s (%s) cut off", self._rig.tag, self.name, self.ip)

    def heal(self) -> None:
        """Undoes ``cut()``. Also forgets the address resolutions that failed meanwhile, on every
        host, so that the first packet after does not wait out the kernel's ARP retry timer (1 s)."""
        for port in self._ports:
            ip("-n", self._rig.switch_netns, "link", "set", port, "up")
        for host in self._rig.hosts:
            ip("-n", host.netns, "neigh", "flush", "all")
        self.is_cut = False
        logger.info("rig %s: %s (%s) healed", self._rig.tag, self.name, self.ip)

    def nic_bytes(self) -> dict[str, int]:
        """Bytes each NIC (``eth0``...) has sent and received so far, as the kernel counts them."""
        links = json.loads(ip("-n", self.netns, "-s", "-j", "link", "show"))
        return {link["ifname"]: link["stats64"]["rx"]["bytes"] + link["stats64"]["tx"]["bytes"]
                for link in links if link["ifname"].startswith("eth")}

    def pids(self) -> list[int]:
        """The processes running on this host now, by their pids in this machine's PID namespace."""
        return sorted(ns.pids_in_netns([self.netns]))

    def __repr__(self) -> str:
        kind = f"pod on {self.node}'s node" if self.is_pod else "host"
        return f"{self.name} {self.ip} ({kind}, netns {self.netns}{', CUT' if self.is_cut else ''})"


class PodHost(Host):
    """A host whose processes also share a PID, IPC and mount namespace, with a private /dev/shm."""

    _anchor: subprocess.Popen[bytes]

    @property
    def is_pod(self) -> bool:
        return True

    def _start(self) -> None:
        """Makes the pod's namespaces and starts its init (``pod.py``); returns once /dev/shm is mounted.

        Raises:
            RigError: the init did not get ready within ``POD_START_TIMEOUT_S``; quotes its stderr.
        """
        argv = ["ip", "netns", "exec", self.netns, *_POD_UNSHARE, "--",
                sys.executable, "-I", pod.__file__, "init", str(self._boot_id_file)]
        # Its own session: a Ctrl-C meant for the test run must not end the pod under the teardown.
        self._anchor = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, start_new_session=True)
        self._rig._processes.append(self._anchor)
        assert self._anchor.stdout is not None and self._anchor.stderr is not None
        line = read_line(self._anchor.stdout.fileno(), POD_START_TIMEOUT_S)
        if line != pod.READY_LINE:
            self._anchor.kill()
            _, stderr = self._anchor.communicate(timeout=ns.KILL_TIMEOUT_S)
            raise RigError(f"pod {self.name}'s init ({' '.join(argv)}) did not get ready within "
                           f"{POD_START_TIMEOUT_S} s (said {line!r}); its stderr: {stderr.decode(errors='replace')}")
        self._anchor.stdout.close()
        self._anchor.stderr.close()

    def command(self, argv: Sequence[str]) -> list[str]:
        self._rig._check_open()
        if self._anchor.poll() is not None:
            raise RigError(f"pod {self.name} of rig {self._rig.tag} is gone: its unshare exited with "
                           f"{self._anchor.returncode}")
        return [sys.executable, "-I", pod.__file__, "exec", self.netns, str(self._anchor.pid), "--", *argv]


class Rig:
    """N hosts on one bridge (see the module docstring); ``close()`` (or ``with``) takes it down.

    Args:
        n_hosts: how many hosts, named ``h0``... with addresses ``.1``... of ``subnet``.
        pods: ``{pod index: node index}``: which hosts are pods, and on which host's node.
        nics: NICs per host (``eth0``...), each on a bridge and /24 of its own (``subnets``).

    Raises:
        ValueError: a bad count or pod mapping.
        RigError: a command failed or timed out (quoting its stderr); what was made is removed.
    """

    def __init__(self, n_hosts: int, *, pods: Mapping[int, int] | None = None, nics: int = 1) -> None:
        pods = dict(pods or {})
        if not 1 <= n_hosts <= 200:
            raise ValueError(f"n_hosts={n_hosts}: a rig has 1 to 200 hosts")
        if not 1 <= nics <= MAX_NICS:
            raise ValueError(f"nics={nics}: a rig's hosts have 1 to {MAX_NICS} NICs")
        for pod_index, node_index in pods.items():
            if not (0 <= pod_index < n_hosts and 0 <= node_index < n_hosts) or node_index in pods:
                raise ValueError(f"pods={pods}: each entry maps a host index to the index of another host "
                                 f"that is not a pod itself (hosts 0..{n_hosts - 1})")
        self.tag = f"{ns.PREFIX}{os.getpid():x}-{next(_rig_numbers)}"
        self.switch_netns = ""
        self.bridge = _ifname(f"{self.tag}br")
        self.bridges = [self.bridge, *(_ifname(f"{self.tag}b{k}") for k in range(1, nics))]
        self.subnet = ipaddress.IPv4Network("0.0.0.0/32")
        self.subnets = [self.subnet]
        self.hosts: list[Host] = []
        self._processes: list[subprocess.Popen[Any]] = []
        self._netns: list[str] = []
        self._files: list[Path] = []
        self._is_closed = False
        _open_rigs.add(self)
        try:
            with ns.machine_lock():
                ns.remove_stale_rigs()
                self.subnets = _free_subnets(nics)
                self.subnet = self.subnets[0]
                self.switch_netns = f"{self.tag}-sw-{self.subnet.network_address}" + (f"x{nics}" if nics > 1 else "")
                self._build(n_hosts, pods)
            for host in self.hosts:
                if isinstance(host, PodHost):
                    host._start()
        except BaseException:
            with contextlib.suppress(RigError):
                self.close()
            raise
        logger.info("rig %s up: %s", self.tag, "; ".join(map(repr, self.hosts)))

    def _build(self, n_hosts: int, pods: dict[int, int]) -> None:
        self._add_netns(self.switch_netns)
        for bridge in self.bridges:
            ip("-n", self.switch_netns, "link", "add", bridge, "type", "bridge", "forward_delay", "0")
            ip("-n", self.switch_netns, "link", "set", bridge, "up")
        addresses = [list(subnet.hosts()) for subnet in self.subnets]
        boot_ids = {i: str(uuid.uuid4()) for i in range(n_hosts) if i not in pods}
        for i in range(n_hosts):
            name, netns = f"h{i}", f"{self.tag}-h{i}"
            ports = [_ifname(f"{self.tag}{'vwxy'[k]}{i}") for k in range(len(self.bridges))]
            node = pods.get(i, i)
            kind = PodHost if i in pods else Host
            host = kind(self, name, netns, [str(a[i]) for a in addresses], ports, f"h{node}", boot_ids[node])
            self._files.append(host._boot_id_file)
            host._boot_id_file.write_text(f"{host.boot_id}\n")
            self._add_netns(netns)
            for k, (port, bridge, subnet) in enumerate(zip(ports, self.bridges, self.subnets, strict=True)):
                ip("-n", self.switch_netns, "link", "add", port, "type", "veth", "peer", "name", f"eth{k}",
                   "netns", netns)
                ip("-n", self.switch_netns, "link", "set", port, "master", bridge, "up")
                ip("-n", netns, "addr", "add", f"{host.ips[k]}/{subnet.prefixlen}", "dev", f"eth{k}")
                ip("-n", netns, "link", "set", f"eth{k}", "up")
            ip("-n", netns, "link", "set", "lo", "up")
            self.hosts.append(host)

    def _add_netns(self, name: str) -> None:
        ip("netns", "add", name)
        self._netns.append(name)

    def _check_open(self) -> None:
        if self._is_closed:
            raise RigError(f"rig {self.tag} is closed")

    @property
    def netns_names(self) -> list[str]:
        """The switch's namespace, then the hosts'."""
        return list(self._netns)

    def names(self) -> list[str]:
        """Every namespace and interface name this rig made (the hosts' ``eth0`` and ``lo`` aside)."""
        return [*self._netns, *self.bridges, *(port for host in self.hosts for port in host._ports)]

    def describe(self) -> str:
        """The rig, then one line per host: name, address, kind, namespace, whether it is cut."""
        state = "closed" if self._is_closed else "open"
        return "\n".join([f"rig {self.tag} ({state}), subnets {', '.join(map(str, self.subnets))}, "
                          f"switch netns {self.switch_netns}",
                          *(f"  {host!r}" for host in self.hosts)])

    def close(self) -> None:
        """Kills every process in the rig's namespaces, waits until they are gone, then deletes the
        namespaces (and with them the bridge and veths). Idempotent; tries every step before raising.

        Raises:
            RigError: a process outlived ``namespaces.KILL_TIMEOUT_S`` or a namespace could not be deleted.
        """
        if self._is_closed:
            return
        self._is_closed = True
        _open_rigs.discard(self)
        errors = []
        try:
            killed = ns.kill_netns_processes(self._netns)
            # A child of ours may not have entered its namespace yet (still in `ip netns exec` or
            # the pod shim): kill it directly (not reaped yet, its pid is still its own), then
            # sweep again for anything that entered meanwhile.
            for proc in self._processes:
                if proc.poll() is None:
                    proc.kill()
                try:
                    proc.wait(timeout=ns.KILL_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    errors.append(f"{proc.args!r} (pid {proc.pid}) outlived SIGKILL by {ns.KILL_TIMEOUT_S} s")
            killed |= ns.kill_netns_processes(self._netns)
            ns.wait_gone(killed, f"closing rig {self.tag}")
        except RigError as e:
            errors.append(str(e))
        for name in reversed(self._netns):
            try:
                ip("netns", "del", name)
            except RigError as e:
                errors.append(str(e))
        for path in self._files:
            path.unlink(missing_ok=True)
        if errors:
            raise RigError(f"closing rig {self.tag}: " + "; ".join(errors))
        logger.info("rig %s closed", self.tag)

    def __enter__(self) -> Rig:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Rig({self.tag}, {self.subnet}, {len(self.hosts)} hosts)"


def read_line(fd: int, timeout_s: float) -> str:
    """One line from ``fd`` without its newline, or whatever came before EOF or ``timeout_s``."""
    data = b""
    deadline = time.monotonic() + timeout_s
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while b"\n" not in data and (left := deadline - time.monotonic()) > 0 and selector.select(left):
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            data += chunk
    return data.partition(b"\n")[0].decode(errors="replace")


def _free_subnets(count: int) -> list[ipaddress.IPv4Network]:
    """``count`` consecutive /24s that no address here and no other rig uses."""
    # Other rigs' subnets are read from their switches' names, not from inside their namespaces:
    # an `ip -n` there would be a process in another rig's host for a moment.
    taken = _networks(ip("-o", "-4", "addr", "show"))
    for name in ns.rig_netns_names():
        if m := _SWITCH_RE.search(name):
            first = ipaddress.IPv4Network(f"{m[1]}/24")
            taken += [ipaddress.IPv4Network((int(first.network_address) + 256 * k, 24)) for k in range(int(m[2] or 1))]
    for pool in SUBNET_POOLS:
        subnets = list(pool.subnets(new_prefix=24))
        for start in range(len(subnets) - count + 1):
            run = subnets[start:start + count]
            if not any(subnet.overlaps(net) for subnet in run for net in taken):
                return run
    raise RigError(f"no {count} free /24s in {', '.join(map(str, SUBNET_POOLS))}: all overlap "
                   f"{', '.join(map(str, taken))}")


def _networks(ip_o_addr: str) -> list[ipaddress.IPv4Network]:
    """The networks of the ``inet`` addresses in ``ip -o -4 addr`` output."""
    return [ipaddress.IPv4Interface(fields[fields.index("inet") + 1]).network
            for fields in map(str.split, ip_o_addr.splitlines()) if "inet" in fields]


def _ifname(name: str) -> str:
    if len(name) > IFNAME_MAX_CHARS:
        raise RigError(f"interface name {name!r} is longer than {IFNAME_MAX_CHARS} characters")
    return name


@atexit.register
def _close_open_rigs() -> None:
    for rig in list(_open_rigs):
        with contextlib.suppress(RigError):
            rig.close()
