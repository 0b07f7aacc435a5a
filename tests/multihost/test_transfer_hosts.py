"""The transfer engine between hosts (network namespaces, ``rig``): the contract's random sizes,
offsets and scatter batches byte for byte over tcp and over fabric (libfabric's tcp provider
where libfabric is installed), a target killed or cut off mid-run failing
its initiator's batches with typed errors in bounded time, and two pods of one node (same
kernel and boot id, their own PIDs and /dev/shm) taking tcp because shm cannot work between them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.multihost.rig import Host, Rig
from tests.transfer.harness import FABRIC_PROVIDER, TRANSPORTS, TargetProcess
from tests.transfer.reference import pattern

REGION_BYTES = 8 << 20
SEEDS = {"mem": 11, "out": 12}
FAILURES = {"PeerUnavailableError", "TransferError", "TransferTimeoutError"}
CROSS_HOST = [pytest.param("tcp"), pytest.param("fabric", marks=pytest.mark.skipif(
    "fabric" not in TRANSPORTS, reason="fabric cannot run here (libfabric1 not installed; tidekv doctor says why)"))]
"""The transports that cross hosts, each forced on the initiator (the target offers both)."""
IO_TIMEOUT_S = 2.0
"""The initiator's io_timeout_s where a peer goes silent: a cut host answers nothing, so this
(30 s by default) is what bounds a batch to it."""


@pytest.fixture
def target_on(tmp_path: Path) -> Iterator[Callable[[Host], TargetProcess]]:
    """``target_on(host)``: a target engine listening on that host's address, regions "mem" and "out"."""
    started: list[TargetProcess] = []

    def start(host: Host) -> TargetProcess:
        target = TargetProcess({name: ("alloc", REGION_BYTES, seed) for name, seed in SEEDS.items()}, {},
                               tmp_path / f"target-{host.name}.log", prefix=host.command([]), host=host.ip)
        started.append(target)
        return target

    yield start
    for target in started:
        if target.is_alive():
            target.stop()


def _spec(target: TargetProcess, mode: str) -> str:
    regions = {name: {"address": r.address, "length": r.length} for name, r in target.regions.items()}
    return json.dumps({"target": target.name, "regions": regions, "seeds": SEEDS, "mode": mode, "seed": 3})


def _initiator(host: Host, target: TargetProcess, mode: str, transport: str = "auto", **env: str
               ) -> subprocess.Popen[str]:
    env = {"TIDEKV_TRANSPORT": transport, **env}
    if transport == "fabric":
        # On the host's own address: fabric's endpoint binds to it (on loopback it could not reach out).
        env = {"TIDEKV_FABRIC_PROVIDER": FABRIC_PROVIDER, "TIDEKV_HOST": host.ip, **env}
    return host.popen([sys.executable, "-m", "tests.multihost.initiator_main", _spec(target, mode)],
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=Path(__file__).parents[2],
                      env={**os.environ, **env})


def _result(proc: subprocess.Popen[str], timeout_s: float = 60.0) -> dict[str, Any]:
    out, err = proc.communicate(timeout=timeout_s)
    assert proc.returncode == 0, f"initiator exited with {proc.returncode}:\n{err[-4000:]}"
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    result["log"] = err[-4000:]  # shown by a failed assertion on the result
    return result


@pytest.mark.parametrize("transport", CROSS_HOST)
def test_contract_between_two_hosts(transport: str, multihost: Callable[..., Rig],
                                    target_on: Callable[[Host], TargetProcess], tmp_path: Path) -> None:
    h1, h2 = multihost(2).hosts
    target = target_on(h2)
    assert target.name.startswith(f"{h2.ip}:")
    result = _result(_initiator(h1, target, "contract", transport))
    assert result["transport"] == transport and result["mismatch"] is None, result
    assert result["moved"] > 1 << 20
    assert target.dump("mem", tmp_path) == pattern(SEEDS["mem"], REGION_BYTES), "READs changed the target"


@pytest.mark.parametrize("transport", CROSS_HOST)
@pytest.mark.parametrize("how", ["killed", "cut"])
def test_a_target_lost_mid_run_fails_the_initiator_in_bounded_time(
        how: str, transport: str, multihost: Callable[..., Rig], target_on: Callable[[Host], TargetProcess]) -> None:
    h1, h2 = multihost(2).hosts
    target = target_on(h2)
    proc = _initiator(h1, target, "until_error", transport, TIDEKV_IO_TIMEOUT_S=str(IO_TIMEOUT_S))
    assert proc.stdout is not None
    assert json.loads(proc.stdout.readline()) == {"looping": True}
    if how == "killed":
        target.kill()
    else:
        h2.cut()
    # Killed: the connection resets at once. Cut: nothing answers; the batch fails once the io
    # timeout passed on its connection and on the one reconnect the engine tries.
    result = _result(proc, timeout_s=60.0)
    assert result["error_type"] in FAILURES, result
    assert target.name in result["error"], result
    assert result["failed_after_s"] < (5.0 if how == "killed" else 3 * IO_TIMEOUT_S + 2), result


def test_two_pods_of_one_node_take_tcp(multihost: Callable[..., Rig], target_on: Callable[[Host], TargetProcess],
                                       tmp_path: Path) -> None:
    """Same boot id, so shm is considered; the peer's region table cannot be opened from another
    PID namespace, so the pair uses tcp, correctly, and the initiator's log says why."""
    rig = multihost(3, pods={1: 0, 2: 0})
    _, pod_a, pod_b = rig.hosts
    target = target_on(pod_b)
    proc = _initiator(pod_a, target, "contract")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-4000:]
    result = json.loads(out.strip().splitlines()[-1])
    assert result["transport"] == "tcp" and result["mismatch"] is None, result
    assert "shares this host's boot id" in err and "using tcp" in err, err[-4000:]


@pytest.mark.skipif("fabric" not in TRANSPORTS,
                    reason="fabric cannot run here (libfabric1 not installed; tidekv doctor says why)")
@pytest.mark.parametrize(("nics", "env", "used"), [
    ("eth0,eth1", {}, ["eth0", "eth1"]),
    ("eth1", {}, ["eth1"]),
    ("eth0,eth1", {"TIDEKV_FABRIC_CONFIRM_BY_READ": "1"}, ["eth0", "eth1"]),
    # This machine's memory is all on node 0: the NIC said to be there serves it alone.
    ("eth0,eth1", {"TIDEKV_FABRIC_NIC_NUMA": "eth0=1,eth1=0"}, ["eth1"]),
    ("eth0,eth1", {"TIDEKV_FABRIC_NIC_NUMA": "eth0=1,eth1=1"}, ["eth0", "eth1"]),
], ids=["two", "one", "confirm-by-read", "numa-near", "numa-none-near"])
def test_fabric_stripes_over_the_nics_named(nics: str, env: dict[str, str], used: list[str],
                                            multihost: Callable[..., Rig], tmp_path: Path) -> None:
    """Two NICs per host (two veth pairs on two subnets: two rails, as RDMA machines have), both
    engines given ``fabric_nics``: the contract holds byte for byte, and each NIC that should carry
    the data carried a share of it as the initiator's kernel counts them, the other none (rail k of
    one host reaches rail k of the other; naming eth1 alone shows the counters tell the NICs
    apart). Also with writes confirmed by a read on every rail they took (providers without
    delivery-complete), and with the NICs' NUMA nodes set: the memory's node picks its NIC, all
    of them where none is on it."""
    h1, h2 = multihost(2, nics=2).hosts
    target = TargetProcess({name: ("alloc", REGION_BYTES, seed) for name, seed in SEEDS.items()},
                           {"fabric_nics": nics}, tmp_path / "target.log", prefix=h2.command([]), host=h2.ip)
    try:
        before = h1.nic_bytes()
        result = _result(_initiator(h1, target, "contract", "fabric", TIDEKV_FABRIC_NICS=nics, **env))
        carried = {nic: count - before[nic] for nic, count in h1.nic_bytes().items()}
    finally:
        target.stop()
    assert result["transport"] == "fabric" and result["mismatch"] is None, result
    share = result["moved"] // (2 * len(used))
    assert all(carried[nic] > share for nic in used), (carried, result["moved"], result["log"])
    # eth0 also carries the control connection (region lookups) to the target's address.
    idle = [nic for nic in ("eth0", "eth1") if nic not in used]
    assert all(carried[nic] < result["moved"] // 20 for nic in idle), (carried, result["moved"])
