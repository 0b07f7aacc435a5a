"""The multi-host rig itself: addressing, cuts, boot ids and pods, two rigs at once, what a skip
names, and that nothing outlives a rig.

Every check runs real processes in the rig's namespaces (``probe.py``) and would fail against a
rig that only pretended: a server reached by its address and refused on another host's loopback,
connects that fail while a host is cut, boot ids, PIDs and /dev/shm as each host and pod sees
them, and namespaces, processes and files gone after teardown, also after a failed, interrupted
or killed test. Neighbours: ``rig.py``, ``conftest.py``, ``probe.py``.
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.childproc import REPO_ROOT
from tests.multihost.conftest import MakeRig
from tests.multihost.namespaces import RUN_DIR, is_alive, machine_lock
from tests.multihost.rig import Host, missing_prerequisites, read_line

PYTHON = sys.executable
PROBE = str(Path(__file__).with_name("probe.py"))
LINE_TIMEOUT_S = 10.0
"""How long a started probe or rig-making child has for its first line."""
CONNECT_TIMEOUT_S = 5.0
"""A connect that should work: generous, it takes milliseconds."""
CUT_CONNECT_TIMEOUT_S = 1.0
"""A connect across a cut: it must fail within this (plus ``SLACK_S``), not merely be slow."""
SLACK_S = 0.5


def probe(*args: str) -> list[str]:
    return [PYTHON, "-I", PROBE, *args]


def first_json_line(proc: subprocess.Popen[Any]) -> dict[str, Any]:
    assert proc.stdout is not None
    line = read_line(proc.stdout.fileno(), LINE_TIMEOUT_S)
    if not line:
        proc.kill()
        raise AssertionError(f"{proc.args!r} said nothing within {LINE_TIMEOUT_S} s (exit {proc.wait(5)})")
    out: dict[str, Any] = json.loads(line)
    return out


def serve(host: Host, label: str, port: int = 0) -> int:
    """Starts a server on ``host`` answering ``label``; returns its port (the rig stops it)."""
    server = host.popen(probe("serve", label, str(port)), stdout=subprocess.PIPE)
    port = first_json_line(server)["port"]
    assert server.stdout is not None
    server.stdout.close()
    return int(port)


def connect(client: Host, address: str, port: int, timeout_s: float = CONNECT_TIMEOUT_S) -> dict[str, Any]:
    done = client.run(probe("connect", address, str(port), str(timeout_s)), timeout_s=timeout_s + LINE_TIMEOUT_S)
    assert done.returncode == 0, done.stderr
    out: dict[str, Any] = json.loads(done.stdout)
    return out


def connect_at_once(attempts: Sequence[tuple[Host, Host]], port_of: dict[str, int],
                    timeout_s: float) -> list[dict[str, Any]]:
    """``connect`` from each client to each server, all at the same time (a cut costs one timeout)."""
    procs = [client.popen(probe("connect", server.ip, str(port_of[server.name]), str(timeout_s)),
                          stdout=subprocess.PIPE, text=True) for client, server in attempts]
    return [json.loads(proc.communicate(timeout=timeout_s + LINE_TIMEOUT_S)[0]) for proc in procs]


def facts(host: Host) -> dict[str, Any]:
    done = host.run(probe("facts", host.ip))
    assert done.returncode == 0, done.stderr
    out: dict[str, Any] = json.loads(done.stdout)
    return out


def facts_here() -> dict[str, Any]:
    out: dict[str, Any] = json.loads(subprocess.run(probe("facts"), capture_output=True, text=True,
                                                    check=True, timeout=LINE_TIMEOUT_S).stdout)
    return out


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        time.sleep(0.01)


def netns_names() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True, timeout=10).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def link_names(netns: str | None = None) -> set[str]:
    argv = ["ip", *(["-n", netns] if netns else []), "-o", "link", "show"]
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=10).stdout
    return {line.split(":")[1].strip().partition("@")[0] for line in out.splitlines()}


def programs(host: Host) -> list[str]:
    """The program names (argv[0] without its directory) of the processes on ``host`` now, sorted."""
    names = []
    for pid in host.pids():
        try:
            argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
        except (FileNotFoundError, ProcessLookupError):  # gone meanwhile
            continue
        names.append(Path(argv0.decode()).name)
    return sorted(names)


def rig_files(tag: str) -> list[str]:
    return [path.name for path in RUN_DIR.iterdir() if path.name.startswith(f"{tag}-")]


def skip_unless_rigs(*, with_pods: bool) -> None:
    reason = missing_prerequisites(with_pods=with_pods)
    if reason is not None:
        pytest.skip(f"multihost rig: {reason}")


_PREREQUISITES = "from tests.multihost.rig import missing_prerequisites as m; print(m(with_pods={}))"


@pytest.mark.parametrize("with_pods, tools, user, expected", [
    (False, ["sh", "mount"], None, "`ip` is not on PATH (Debian package iproute2)"),
    (True, ["ip", "sh", "mount"], None, "`unshare` is not on PATH (Debian package util-linux)"),
    (True, ["ip", "sh", "mount", "unshare"], None, "None"),  # the control: as root, with these, a rig can be made
    (False, ["ip", "sh", "mount"], 65534, "needs root (running as uid 65534)"),
    (False, ["failing-ip", "sh", "mount"], None, "`ip netns add tkv"),
])
def test_a_machine_without_what_rigs_need_gets_a_reason_naming_it(tmp_path: Path, with_pods: bool,
                                                                   tools: list[str], user: int | None,
                                                                   expected: str) -> None:
    skip_unless_rigs(with_pods=True)
    for tool in tools:
        real = shutil.which(tool.removeprefix("failing-"))
        assert real is not None
        if tool == "failing-ip":  # an ip whose `netns add` fails as in a container without CAP_SYS_ADMIN
            (tmp_path / "ip").write_text(f'''#!/bin/sh
case "$*" in "netns add"*) echo "mount --make-shared /run/netns failed: Operation not permitted" >&2; exit 1;; esac
exec {real} "$@"
''')
            (tmp_path / "ip").chmod(0o755)
        else:
            (tmp_path / tool).symlink_to(real)
    python = PYTHON if user is None else "/usr/bin/python3"  # this one may be under /root
    if not os.access(python, os.X_OK):
        pytest.skip(f"no {python} for uid {user} to run")
    done = subprocess.run([python, "-c", _PREREQUISITES.format(with_pods)], check=False, cwd=REPO_ROOT, user=user,
                          env={"PATH": str(tmp_path)}, capture_output=True, text=True, timeout=LINE_TIMEOUT_S)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(expected), done.stdout
    if "failing-ip" in tools:  # the failed command's stderr is in the reason
        assert done.stdout.strip().endswith("failed (exit 1): mount --make-shared /run/netns failed: "
                                            "Operation not permitted"), done.stdout


def test_a_server_is_reached_by_its_address_from_other_hosts_and_not_on_their_loopback(multihost: MakeRig) -> None:
    rig = multihost(3)
    h0, h1, h2 = rig.hosts
    assert len({host.ip for host in rig.hosts}) == 3
    assert all(ipaddress.IPv4Address(host.ip) in rig.subnet for host in rig.hosts)
    port = serve(h0, "h0")

    assert connect(h1, h0.ip, port)["reply"] == "h0"
    assert connect(h2, h0.ip, port)["reply"] == "h0"
    assert connect(h0, "127.0.0.1", port)["reply"] == "h0"  # it listens on loopback too...
    elsewhere = connect(h1, "127.0.0.1", port)  # ...but h1's loopback is h1's own
    assert elsewhere["reply"] is None and "ConnectionRefused" in elsewhere["error"], elsewhere


def test_a_cut_host_is_unreachable_both_ways_until_healed(multihost: MakeRig) -> None:
    rig = multihost(3)
    h0, h1, h2 = rig.hosts
    port_of = {host.name: serve(host, host.name) for host in rig.hosts}

    h0.cut()
    into, out_of, between_others = connect_at_once([(h1, h0), (h0, h1), (h1, h2)], port_of, CUT_CONNECT_TIMEOUT_S)
    for attempt in (into, out_of):
        assert attempt["reply"] is None, attempt
        assert attempt["elapsed_s"] <= CUT_CONNECT_TIMEOUT_S + SLACK_S, attempt
    assert between_others["reply"] == "h2", between_others

    h0.heal()
    assert connect(h1, h0.ip, port_of["h0"])["reply"] == "h0"
    assert connect(h0, h1.ip, port_of["h1"])["reply"] == "h1"


_OTHER_PROCESS_RIG = """
import json, sys
from tests.multihost.rig import Rig
with Rig(2) as rig:
    print(json.dumps({"names": rig.names(), "subnet": str(rig.subnet)}), flush=True)
    sys.stdin.read()
"""


def test_rigs_made_at_once_have_their_own_names_subnets_and_ports(multihost: MakeRig) -> None:
    skip_unless_rigs(with_pods=False)
    # Made by another process while this one makes two: what two pytest-xdist workers do.
    other = subprocess.Popen([PYTHON, "-c", _OTHER_PROCESS_RIG], cwd=REPO_ROOT, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        a, b = multihost(2), multihost(2)
        other_rig = first_json_line(other)
    finally:
        other.communicate(timeout=30)
    assert other.returncode == 0

    names = [set(a.names()), set(b.names()), set(other_rig["names"])]
    assert not (names[0] & names[1] or names[0] & names[2] or names[1] & names[2]), names
    subnets = [a.subnet, b.subnet, ipaddress.IPv4Network(other_rig["subnet"])]
    assert not any(x.overlaps(y) for i, x in enumerate(subnets) for y in subnets[i + 1:]), subnets
    assert not names[2] & netns_names()  # the other process's rig is gone with it

    port = serve(a.hosts[0], "a")
    assert serve(b.hosts[0], "b", port) == port  # the same port, free in b's own namespace
    assert connect(a.hosts[1], a.hosts[0].ip, port)["reply"] == "a"
    assert connect(b.hosts[1], b.hosts[0].ip, port)["reply"] == "b"
    assert connect(a.hosts[1], b.hosts[0].ip, port)["reply"] is None  # rigs do not reach each other


def test_hosts_are_machines_and_pods_share_their_node_s_boot_id_but_not_pids_or_dev_shm(multihost: MakeRig) -> None:
    rig = multihost(4, pods={1: 0, 2: 0})
    node, pod1, pod2, other_node = rig.hosts
    assert [(host.is_pod, host.node) for host in rig.hosts] == [(False, "h0"), (True, "h0"), (True, "h0"), (False, "h3")]
    here, on_node, in_pod1, in_pod2, on_other = facts_here(), facts(node), facts(pod1), facts(pod2), facts(other_node)

    # Boot ids: a pod has its node's; two nodes, and this machine, have each their own.
    assert in_pod1["boot_id"] == in_pod2["boot_id"] == on_node["boot_id"] == node.boot_id == pod1.boot_id
    assert on_other["boot_id"] == other_node.boot_id
    assert len({here["boot_id"], on_node["boot_id"], on_other["boot_id"]}) == 3
    # PIDs: a plain host shares this machine's; each pod has its own, numbered from 1.
    assert on_node["pid_ns"] == on_other["pid_ns"] == here["pid_ns"]
    assert len({here["pid_ns"], in_pod1["pid_ns"], in_pod2["pid_ns"]}) == 3
    assert in_pod1["pids"] == [1, in_pod1["pid"]], in_pod1  # its init, and itself
    assert in_pod2["pids"] == [1, in_pod2["pid"]], in_pod2
    assert all(host["can_bind"] for host in (on_node, in_pod1, in_pod2, on_other))  # each on its own address

    # /dev/shm: each pod has its own, shared by its processes; a plain host has this machine's.
    assert in_pod1["shm"] == in_pod2["shm"] == []
    marker = f"{rig.tag}-pod1"
    assert pod1.run(["touch", f"/dev/shm/{marker}"]).returncode == 0
    again = facts(pod1)
    assert again["pid_ns"] == in_pod1["pid_ns"] and marker in again["shm"]  # one pod, one set of namespaces
    assert marker not in facts(pod2)["shm"] and marker not in facts(node)["shm"]
    assert not Path("/dev/shm", marker).exists()
    machine_marker = Path("/dev/shm", f"{rig.tag}-machine")
    machine_marker.touch()
    try:
        assert machine_marker.name in facts(node)["shm"]
        assert machine_marker.name not in facts(pod1)["shm"]
    finally:
        machine_marker.unlink()


@pytest.mark.parametrize("stop, signum", [(subprocess.Popen.terminate, signal.SIGTERM),
                                           (subprocess.Popen.kill, signal.SIGKILL)])
def test_popen_s_signals_reach_a_pod_process(multihost: MakeRig, stop: Callable[[subprocess.Popen[Any]], None],
                                             signum: int) -> None:
    rig = multihost(2, pods={1: 0})
    pod = rig.hosts[1]
    server = pod.popen(probe("serve", "x"), stdout=subprocess.PIPE)
    first_json_line(server)
    assert len(facts(pod)["pids"]) == 3  # init, the server, facts itself

    stop(server)
    assert server.wait(timeout=5) == -signum
    wait_for(lambda: len(facts(pod)["pids"]) == 2, "the server gone from the pod")
    assert server.stdout is not None
    server.stdout.close()


def test_commands_get_the_environment_cwd_and_exit_status_on_hosts_and_pods(multihost: MakeRig,
                                                                             tmp_path: Path) -> None:
    rig = multihost(2, pods={1: 0})
    env = {**os.environ, "TIDEKV_RIG_PROBE": "passed"}
    for host in rig.hosts:
        assert host.run([PYTHON, "-c", "raise SystemExit(7)"]).returncode == 7
        assert host.run(["pwd"], cwd=tmp_path).stdout == f"{tmp_path}\n"
        # A process driver that makes its own Popen takes the host's prefix.
        own = subprocess.run(host.command(["sh", "-c", "echo $TIDEKV_RIG_PROBE"]), check=False, env=env,
                             capture_output=True, text=True, timeout=LINE_TIMEOUT_S)
        assert (own.returncode, own.stdout) == (0, "passed\n"), own.stderr
    # On a plain host the command is exec'd: its Popen's pid is its own (for SIGSTOP, /proc/<pid>/fd).
    sleeper = rig.hosts[0].popen(["sleep", "30"])
    wait_for(lambda: Path(f"/proc/{sleeper.pid}/cmdline").read_bytes() == b"sleep\x0030\x00", "sleep exec'd")


def test_close_kills_every_process_and_leaves_no_namespace_or_link(multihost: MakeRig) -> None:
    rig = multihost(3, pods={2: 0})
    for host in rig.hosts:
        host.popen(["sleep", "60"])
        host.popen(["sh", "-c", "setsid sleep 60 & exec sleep 60"])  # one left its session and group
    sleeps = ["sleep"] * 3
    in_pod = sorted([*sleeps, "unshare", *[Path(PYTHON).name] * 3])  # and its init, the two pod.py shims
    wait_for(lambda: [programs(host) for host in rig.hosts] == [sleeps, sleeps, in_pod], "every sleep started")
    pids = [pid for host in rig.hosts for pid in host.pids()]
    names = set(rig.names())
    assert set(rig.netns_names) == {rig.switch_netns, *(host.netns for host in rig.hosts)}
    assert set(rig.netns_names) <= netns_names()
    assert names - set(rig.netns_names) <= link_names(rig.switch_netns)

    assert rig_files(rig.tag)  # the hosts' boot ids

    rig.close()
    assert not [pid for pid in pids if is_alive(pid)]
    assert not names & netns_names()
    assert not names & link_names()
    assert not rig_files(rig.tag)


_INNER_TESTS = """
import json, os, signal, time
from tests.multihost.conftest import multihost  # noqa: F401 (the fixture under test)
from tests.multihost.test_rig import programs, wait_for

def _make_and_record(make):
    rig = make(2, pods={1: 0})
    for host in rig.hosts:
        host.popen(["sleep", "60"])
    wait_for(lambda: [programs(host).count("sleep") for host in rig.hosts] == [1, 1], "both sleeps started")
    pids = [pid for host in rig.hosts for pid in host.pids()]
    with open(os.environ["RIG_RECORD"], "a") as f:
        f.write(json.dumps({"names": rig.names(), "pids": pids}) + "\\n")

def test_body_raises(multihost):
    _make_and_record(multihost)
    raise RuntimeError("the test body failed")

def test_body_interrupted(multihost):
    _make_and_record(multihost)
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(10)
"""


def test_the_fixture_takes_rigs_down_after_a_failed_or_interrupted_test(tmp_path: Path) -> None:
    skip_unless_rigs(with_pods=True)
    (tmp_path / "test_inner.py").write_text(_INNER_TESTS)
    record = tmp_path / "rigs.jsonl"
    env = {name: value for name, value in os.environ.items() if not name.startswith("PYTEST")}
    env.update(RIG_RECORD=str(record), PYTHONPATH=str(REPO_ROOT))
    inner = subprocess.run([PYTHON, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "test_inner.py"],
                           check=False, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    output = inner.stdout + inner.stderr
    assert inner.returncode == pytest.ExitCode.INTERRUPTED, output
    assert "1 failed" in output and "RuntimeError: the test body failed" in output, output

    rigs = [json.loads(line) for line in record.read_text().splitlines()]
    assert len(rigs) == 2, output
    for made in rigs:
        assert len(made["pids"]) == 5, made  # a sleep on each host, the pod's unshare, init and shim
        assert not [pid for pid in made["pids"] if is_alive(pid)], made
        assert not set(made["names"]) & netns_names(), made


_KILLED_MAKER = """
import json, os, signal, subprocess, sys
from tests.multihost.rig import Rig
from tests.multihost.test_rig import programs, wait_for
rig = Rig(2, pods={1: 0})
rig.hosts[0].popen(["sleep", "60"], stdout=subprocess.DEVNULL)
wait_for(lambda: programs(rig.hosts[0]) == ["sleep"], "the sleep started")
pids = rig.hosts[0].pids() + rig.hosts[1].pids()  # the sleep; the pod's unshare and init
print(json.dumps({"tag": rig.tag, "netns": rig.netns_names, "pids": pids}), flush=True)
sys.stdin.readline()
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_new_rig_removes_what_a_killed_maker_left_behind(multihost: MakeRig) -> None:
    skip_unless_rigs(with_pods=True)
    maker = subprocess.Popen([PYTHON, "-c", _KILLED_MAKER], cwd=REPO_ROOT, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    left = first_json_line(maker)
    netns_left = set(left["netns"])
    with machine_lock():  # so that no other rig maker (an xdist worker) clears them before they are seen
        assert maker.stdin is not None
        maker.stdin.write("\n")
        maker.stdin.close()
        assert maker.wait(timeout=10) == -signal.SIGKILL
        assert netns_left <= netns_names()
        assert not [pid for pid in left["pids"] if not is_alive(pid)], left
        assert rig_files(left["tag"])

    multihost(1)
    assert not netns_left & netns_names()
    assert not [pid for pid in left["pids"] if is_alive(pid)], left
    assert not rig_files(left["tag"])
