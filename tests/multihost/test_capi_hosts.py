"""libtransfer_engine.so, tidekv's Mooncake C API, between two hosts (``rig``), as TensorRT-LLM's
MooncakeTransferAgent uses it across machines.

The C harness of ``tests/trtllm/test_capi.py`` (``agent_harness.c``, built by that module's
fixture) runs as target on one host and as initiator on another, each creating its engine on
its host's address the way the agent does (``$TLLM_MOONCAKE_IP_ADDR``). The initiator replays
the agent's calls: batches of 1, 64 and 1,024 READ/WRITE checked byte for byte against its
shadow copy (READs) and by the target when a WRITE's notification arrives (WRITEs), sync
messages, refusals, then the peer lost mid-batch: every task ends FAILED, within the bound.
"Lost" is the target SIGKILLed by the initiator (a reset connection), or its host cut off
(nothing answers: the initiator's io timeout bounds it). Neighbours: ``tests/trtllm/test_capi.py``
(the same harness between two processes of one host), ``test_transfer_hosts`` (the Python engine).
"""

from __future__ import annotations

import re
import signal
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.multihost.rig import Host, Rig
from tests.trtllm.test_capi import _Target, env, harness, library  # noqa: F401 (env, harness, library: fixtures)

IO_TIMEOUT_S = 2.0
"""The initiator's TIDEKV_IO_TIMEOUT_S when its peer's host is cut off: nothing answers there, so
this is what bounds a batch to it."""
STEPS = ("ok READ x1 (notify=0)", "ok WRITE x64 (notify=1)", "ok WRITE x1024 (notify=1)", "ok READ x1024",
         "ok sync messages", "ok local segment", "ok refusals", "ok two submits into one batch id", "ok peer killed")
"""Lines the initiator prints for the steps it passed (``agent_harness.c``)."""
_PEER_LOST = re.compile(r"ok peer killed: (\d+) tasks FAILED over (\d+) batch\(es\) in ([\d.]+) s")


def _host_env(base: dict[str, str], host: Host, transport: str) -> dict[str, str]:
    """The harness's environment on ``host``: its engine on the host's address, as the agent's
    $TLLM_MOONCAKE_IP_ADDR sets it (the agent's other source, an interface by name, is not replayed)."""
    out = {**base, "TLLM_MOONCAKE_IP_ADDR": host.ip}
    if transport == "tcp":
        out["MC_FORCE_TCP"] = "1"
    return out


def _initiator(host: Host, exe: Path, target: _Target, victim_pid: int,
               environ: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """The harness as initiator on ``host``, to its end; ``victim_pid``: what its last step kills."""
    return host.run([str(exe), "initiator", target.segment, target.addr, target.size, str(victim_pid)],
                    timeout_s=240, env=environ)


def _report(run: subprocess.CompletedProcess[str], target: _Target) -> str:
    return (f"initiator stdout:\n{run.stdout}\ninitiator stderr:\n{run.stderr[-8000:]}\n"
            f"target stderr:\n{target.stderr()}")


def _check_passed(run: subprocess.CompletedProcess[str], report: str) -> float:
    """Asserts every step passed; returns how long failing the lost peer's batches took."""
    assert run.returncode == 0, report
    assert "PASSED: 0 failure(s)" in run.stdout, report
    for step in STEPS:
        assert step in run.stdout, f"step {step!r} missing\n{report}"
    lost = _PEER_LOST.search(run.stdout)
    assert lost is not None and int(lost[1]) > 0, report
    return float(lost[3])


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_agent_sequence_between_two_hosts(transport: str, multihost: Callable[..., Rig], harness: Path,  # noqa: F811
                                          env: dict[str, str]) -> None:  # noqa: F811
    """Target on one host advertising its address, initiator on another; the initiator SIGKILLs
    the target mid-batch (same PID namespace: a rig host is not a pod)."""
    a, b = multihost(2).hosts
    target = _Target(harness, _host_env(env, a, transport), prefix=a.command([]))
    try:
        assert target.segment.startswith(f"{a.ip}:"), target.segment
        run = _initiator(b, harness, target, target.proc.pid, _host_env(env, b, transport))
        target.proc.wait(timeout=30)  # killed by the initiator in its last step
        report = _report(run, target)
        took_s = _check_passed(run, report)
        assert took_s < 5.0, report  # a killed peer resets the connection: no timeout to wait out
        assert target.proc.returncode == -signal.SIGKILL, report
    finally:
        target.stop()


def test_agent_sequence_with_the_target_host_cut_off_mid_batch(multihost: Callable[..., Rig],
                                                               harness: Path,  # noqa: F811
                                                               env: dict[str, str]) -> None:  # noqa: F811
    """As above, but the peer is lost by cutting its host off just after the initiator's first
    submit of the last step: the initiator "kills" a sentinel process, whose death cuts the
    target's host. Its batches fail within the io timeout (on the connection and on the one
    reconnect), the target itself lives on."""
    a, b = multihost(2).hosts
    target = _Target(harness, _host_env(env, a, "auto"), prefix=a.command([]))
    sentinel = a.popen(["sleep", "600"])
    finished = threading.Event()

    def cut_when_killed() -> None:
        if sentinel.wait() == -signal.SIGKILL and not finished.is_set():
            a.cut()

    cutter = threading.Thread(target=cut_when_killed, daemon=True)
    cutter.start()
    try:
        run = _initiator(b, harness, target, sentinel.pid,
                         {**_host_env(env, b, "auto"), "TIDEKV_IO_TIMEOUT_S": str(IO_TIMEOUT_S)})
        cutter.join(timeout=10)
        assert a.is_cut, f"the initiator never reached its last step\n{_report(run, target)}"
        assert target.proc.poll() is None, "the target died: it was only cut off"
        target.stop()
        report = _report(run, target)
        took_s = _check_passed(run, report)
        assert took_s < 3 * IO_TIMEOUT_S + 2, report
    finally:
        finished.set()
        if sentinel.poll() is None:
            sentinel.kill()
        cutter.join(timeout=10)
        target.stop()
