"""``tidekv doctor``: real runs of the command, its self-test over real processes, and its failure paths."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from tidekv.cli import main
from tidekv.config import SECRET_SHOWN_AS, TransferConfig, TransportKind, settings_sources
from tidekv.doctor.selftest import SelfTestState, run_selftests
from tidekv.transfer import transports
from tidekv.transfer.transports import TransportStatus

_RUN_TIMEOUT_S = 120


def _doctor(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TIDEKV_")}
    return subprocess.run([sys.executable, "-m", "tidekv", "doctor", *args], env={**clean, **env},
                          capture_output=True, text=True, timeout=_RUN_TIMEOUT_S, check=False)


def _json(run: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    try:
        return json.loads(run.stdout)  # the whole of stdout is the one document
    except ValueError:
        pytest.fail(f"stdout is not one JSON document\n--- stdout ---\n{run.stdout}\n--- stderr ---\n{run.stderr}")


def _explain(run: subprocess.CompletedProcess[str]) -> str:
    return f"exit {run.returncode}\n--- stdout ---\n{run.stdout}\n--- stderr ---\n{run.stderr}"


def _selftest(doc: dict[str, Any], transport: str, memory: str) -> dict[str, Any]:
    [row] = [r for r in doc["selftest"] if (r["transport"], r["memory"]) == (transport, memory)]
    return row


def test_doctor_self_tests_fabric_on_the_provider_named() -> None:
    from tests.transfer.harness import FABRIC_PROVIDER, TRANSPORTS

    if "fabric" not in TRANSPORTS:
        if os.environ.get("CI") == "true":
            pytest.fail("fabric cannot run in CI: .ci/run installs libfabric1 for it")
        pytest.skip("fabric cannot run here (libfabric1 not installed)")
    run = _doctor("--json", TIDEKV_FABRIC_PROVIDER=FABRIC_PROVIDER)
    assert run.returncode == 0, _explain(run)
    doc = _json(run)
    [fabric] = [t for t in doc["transports"] if t["name"] == "fabric"]
    assert fabric["available"] and fabric["reason"].startswith("provider "), fabric
    row = _selftest(doc, "fabric", "allocated")
    assert (row["state"], row["byte_checked"], row["size_bytes"]) == ("passed", True, 4 << 20), row


def test_doctor_json_names_every_transport_and_passes_its_self_tests() -> None:
    run = _doctor("--json")
    assert run.returncode == 0, _explain(run)
    doc = _json(run)
    assert doc["ok"] is True and doc["problems"] == []
    states = {t["name"]: t["available"] for t in doc["transports"]}
    assert states == {"tcp": True, "shm": True, "cuda": False, "fabric": False}
    reasons = {t["name"]: t["reason"] for t in doc["transports"]}
    assert "cross-memory attach" in reasons["shm"]
    assert "libcuda.so.1 does not load" in reasons["cuda"] and "NVIDIA kernel driver" in reasons["cuda"]
    assert "no RDMA devices" in reasons["fabric"] and "fabric_provider" in reasons["fabric"]
    for transport, memory in (("tcp", "allocated"), ("shm", "allocated")):
        row = _selftest(doc, transport, memory)
        assert (row["state"], row["byte_checked"], row["size_bytes"]) == ("passed", True, 4 << 20), row
        assert row["write_mib_s"] > 0 and row["read_mib_s"] > 0
    cma_usable, why = transports.cross_memory_attach(TransferConfig())
    registered = _selftest(doc, "shm", "registered")
    if cma_usable:
        assert (registered["state"], registered["byte_checked"]) == ("passed", True), registered
    else:  # this host forbids it (seccomp, Yama): the doctor must say why instead of failing
        assert (registered["state"], registered["detail"]) == ("skipped", why)
    assert {h["name"] for h in doc["host"]} >= {"transparent huge pages", "yama ptrace_scope",
                                                 "open files (RLIMIT_NOFILE)"}
    settings = doc["settings"]
    assert settings["config_file"] is None and "no config file" in settings["config_file_note"]
    components = {c["component"]: c for c in settings["components"]}
    assert set(components) == {"TransferConfig", "MasterConfig", "StoreConfig", "WeightsConfig", "TlsConfig",
                               "EtcdSecurity"}
    assert {s["source"] for c in components.values() for s in c["settings"]} == {"default"}
    assert "doctor: self-test tcp" in run.stderr and "doctor: self-test shm" in run.stderr


def test_doctor_with_cross_memory_attach_disabled_says_so_and_passes_over_the_rest() -> None:
    run = _doctor("--json", TIDEKV_ENABLE_CROSS_MEMORY_ATTACH="0", TIDEKV_TRANSPROT="tcp")
    assert run.returncode == 0, _explain(run)
    doc = _json(run)
    shm = next(t for t in doc["transports"] if t["name"] == "shm")
    assert shm["available"] is True and "cross-memory attach is disabled" in shm["reason"]
    transfer = next(c for c in doc["settings"]["components"] if c["component"] == "TransferConfig")
    assert {"name": "enable_cross_memory_attach", "value": False,
            "source": "env TIDEKV_ENABLE_CROSS_MEMORY_ATTACH"} in transfer["settings"]
    registered = _selftest(doc, "shm", "registered")
    assert registered["state"] == "skipped" and "cross-memory attach is disabled" in registered["detail"]
    for transport, memory in (("tcp", "allocated"), ("shm", "allocated")):
        assert _selftest(doc, transport, memory)["state"] == "passed"
    assert doc["settings"]["unrecognised_variables"] == ["TIDEKV_TRANSPROT"]


def test_doctor_text_names_each_transport_and_never_prints_the_secret() -> None:
    run = _doctor(TIDEKV_SECRET="s3cr3t-value")  # both self-test ends share it, so the handshakes pass
    assert run.returncode == 0, _explain(run)
    assert "s3cr3t-value" not in run.stdout + run.stderr
    lines = run.stdout.splitlines()
    for name, state in (("tcp", "available"), ("shm", "available"), ("cuda", "unavailable"),
                        ("fabric", "unavailable")):
        assert any(line.split()[:2] == [name, state] for line in lines), run.stdout
    assert any(line.split()[:3] == ["secret", SECRET_SHOWN_AS, "env"] for line in lines), run.stdout
    assert lines[-1] == "OK: every available transport passed its self-test"


def test_doctor_exits_1_when_the_catalog_promises_more_than_the_engine_does(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # Cross-memory attach is off, but a (stale) catalog claims it usable: the self-test plans the
    # registered-memory check over forced shm, and the real engine refuses it.
    for name in [k for k in os.environ if k.startswith("TIDEKV_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("TIDEKV_ENABLE_CROSS_MEMORY_ATTACH", "0")
    monkeypatch.setattr(transports, "cross_memory_attach", lambda config: (True, "claimed usable"))
    assert main(["doctor", "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is False
    registered = _selftest(doc, "shm", "registered")
    assert (registered["state"], registered["byte_checked"]) == ("failed", False)
    assert "shm" in registered["detail"] and "--- target log ---" in registered["detail"]
    assert _selftest(doc, "shm", "allocated")["state"] == "passed"
    assert _selftest(doc, "tcp", "allocated")["state"] == "passed"


def test_a_transport_no_engine_can_be_forced_onto_fails_and_unavailable_ones_are_not_tested() -> None:
    statuses = [TransportStatus("warp", True, "claimed"), TransportStatus("fabric", False, "absent")]
    [result] = run_selftests(statuses, TransferConfig(), timeout_s=5)
    assert (result.transport, result.state, result.is_byte_checked) == ("warp", SelfTestState.FAILED, False)
    assert "no TransferConfig.transport value selects 'warp'" in result.detail


def test_cuda_is_not_self_tested_with_host_memory_and_says_what_checks_it() -> None:
    [result] = run_selftests([TransportStatus("cuda", True, "claimed")], TransferConfig(), timeout_s=5)
    assert (result.transport, result.state, result.is_byte_checked) == ("cuda", SelfTestState.SKIPPED, False)
    assert "integration/gpu_check.sh" in result.detail


def test_settings_sources_names_the_variable_and_hides_secrets() -> None:
    environ = {"TIDEKV_SECRET": "s3cr3t", "TIDEKV_TRANSPORT": "tcp", "TIDEKV_STORE_REPLICAS": "2"}
    rows = {name: (value, source) for name, value, source in settings_sources(TransferConfig, environ)}
    assert rows["secret"] == (SECRET_SHOWN_AS, "env TIDEKV_SECRET")
    assert rows["transport"] == (TransportKind.TCP, "env TIDEKV_TRANSPORT")
    assert rows["worker_threads"] == (TransferConfig().worker_threads, "default")
    assert ("secret", None, "default") in settings_sources(TransferConfig, {})


def test_the_byte_check_finds_the_first_differing_byte() -> None:
    from tidekv.doctor.selftest import _first_difference

    expected = bytes(range(256)) * 64
    corrupted = bytearray(expected)
    corrupted[5000] ^= 1
    assert _first_difference(memoryview(bytes(expected)), expected) is None
    assert _first_difference(memoryview(corrupted), expected) == 5000


@pytest.mark.parametrize("cpus, names_the_setting", [(2, True), (1, False), (8, False)])
def test_cpus_fact_names_vllms_reservation_setting_on_small_hosts(monkeypatch: pytest.MonkeyPatch, cpus: int,
                                                                  names_the_setting: bool) -> None:
    from tidekv.doctor import report

    monkeypatch.setattr(report.os, "sched_getaffinity", lambda pid: set(range(cpus)))
    fact = next(f for f in report.host_facts() if f.name == "cpus")
    assert fact.value == str(cpus)
    assert ("VLLM_CPU_NUM_OF_RESERVED_CPU=1" in fact.note) is names_the_setting


def test_doctor_says_which_address_listeners_take_and_why() -> None:
    from tidekv.doctor.report import address_fact

    assert address_fact({"TIDEKV_HOST": "10.0.0.9"}).value == "10.0.0.9"
    local = address_fact({"TIDEKV_MASTER": "127.0.0.1:50051"})
    assert local.value == "127.0.0.1" and "on loopback" in local.note
    wrong = address_fact({"TIDEKV_HOST": "0.0.0.0"})
    assert wrong.value == "?" and "wildcard" in wrong.note
