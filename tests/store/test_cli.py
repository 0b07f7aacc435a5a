"""The ``tidekv master`` and ``tidekv up`` commands, run as real processes."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import selectors
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from tidekv.config import ETCD_MASTER_FLAGS, MasterConfig
from tidekv.store.client.rpc import MasterChannel
from tidekv.store.wire import protocol as p

from tests.childproc import REPO_ROOT
from tests.store.conftest import Connect

TIMEOUT_S = 60


def _tidekv(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tidekv", *args], capture_output=True, text=True, timeout=TIMEOUT_S,
                          cwd=REPO_ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1"))


@pytest.mark.parametrize("command", ["master", "up"])
def test_help_exits_zero(command: str) -> None:
    result = _tidekv(command, "--help")
    assert result.returncode == 0, result.stderr
    for f in dataclasses.fields(MasterConfig):  # every master setting has a documented flag
        if f.name == "secret":  # never a flag (it would show in ps): the variables, documented
            assert "TIDEKV_SECRET" in result.stdout and "TIDEKV_SECRET_FILE" in result.stdout
            continue
        if f.name == "etcd_security":  # composed: a flag per field but the password, and its variable
            for name in ETCD_MASTER_FLAGS:
                assert f"--etcd-{name.replace('_', '-')} " in result.stdout, name
                assert f"$TIDEKV_ETCD_{name.upper()}" in result.stdout, name
            assert "TIDEKV_ETCD_PASSWORD:" in " ".join(result.stdout.split())
            continue
        assert f"--{f.name.replace('_', '-')} " in result.stdout, f.name
    if command == "up":
        assert "--segment-size" in result.stdout and "--selftest" in result.stdout


def test_up_selftest_puts_and_gets_through_the_pool() -> None:
    result = _tidekv("up", "--port", "0", "--metrics-port", "0", "--segment-size", "16MiB", "--selftest")
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert "OK" in result.stdout and "selftest" in result.stdout
    address = re.search(r'"master": "([^"]+)"', result.stdout).group(1)  # type: ignore[union-attr]
    assert f"TIDEKV_MASTER={address}" in result.stdout
    _check_engine_flags(result.stdout, address)


def _check_engine_flags(text: str, master: str) -> None:
    """The vLLM and SGLang lines in ``text`` are flags each plugin accepts, naming ``master``."""
    from tidekv.kvcache.settings import KVConnectorConfig
    from tidekv_sglang.settings import HiCacheSettings
    from tidekv_vllm.command_line import CONNECTOR_NAME

    vllm_line = next(line for line in text.splitlines() if line.strip().startswith("vLLM:"))
    flag, value = shlex.split(vllm_line.split("vLLM:", 1)[1])
    assert flag == "--kv-transfer-config"
    config = json.loads(value)
    assert config["kv_connector"] == CONNECTOR_NAME and config["kv_role"] == "kv_both"
    assert KVConnectorConfig.from_mapping(config["kv_connector_extra_config"], environ={}).master == master
    sglang_line = next(line for line in text.splitlines() if line.strip().startswith("SGLang:"))
    args = shlex.split(sglang_line.split("SGLang:", 1)[1])
    assert args[args.index("--hicache-storage-backend") + 1] == "dynamic"
    extra = json.loads(args[args.index("--hicache-storage-backend-extra-config") + 1])
    assert HiCacheSettings.from_extra_config(extra, environ={}).master == master
    module = importlib.util.find_spec(extra["module_path"])
    assert module is not None and module.origin is not None
    assert f"class {extra['class_name']}" in Path(module.origin).read_text()


def test_help_names_the_engine_plugins_and_their_json() -> None:
    top = _tidekv("--help")
    assert top.returncode == 0, top.stderr
    assert "TidekvConnector" in top.stdout and "kv_connector_extra_config" in top.stdout
    for key in ("master", "store_segment_size", "hold_timeout_s", "load_mode", "transport"):
        assert f"{key} (" in top.stdout, key
    assert "$TIDEKV_MASTER" in top.stdout
    assert "--kv-transfer-config '{" in top.stdout and "--hicache-storage-backend-extra-config '{" in top.stdout
    up = _tidekv("up", "--help")
    assert up.returncode == 0, up.stderr
    assert "TidekvConnector" in up.stdout and "TIDEKV_MASTER" in up.stdout and "SGLang:" in up.stdout


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["master", "--port", "0", "--high-watermark", "5"], "high_watermark"),
        (["master", "--port", "70000"], "port"),
        (["up", "--port", "0", "--segment-size", "lots"], "is not a size"),
    ],
)
def test_bad_settings_exit_nonzero_naming_the_setting(args: list[str], needle: str) -> None:
    result = _tidekv(*args)
    assert result.returncode == 2
    assert needle in result.stderr, result.stderr


@pytest.mark.parametrize("flag", ["--port", "--metrics-port"])
def test_a_port_in_use_exits_2_naming_it(flag: str) -> None:
    # A taken metrics port once made `tidekv master` exit 0 without a word.
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        other = {"--port": ["--metrics-port", "0"], "--metrics-port": ["--port", "0"]}[flag]
        result = _tidekv("master", "--host", "127.0.0.1", flag, port, *other)
    assert result.returncode == 2, result.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr, result.stderr
    assert ("metrics port" in result.stderr) == (flag == "--metrics-port"), result.stderr


def _read_until(proc: subprocess.Popen, stream: Any, pattern: bytes) -> tuple[re.Match[bytes], bytes]:
    """Reads ``proc``'s ``stream`` until ``pattern`` matches (or TIMEOUT_S passes, or it exits:
    the assertion then shows what it wrote); returns the match and everything read."""
    out = b""
    with selectors.DefaultSelector() as sel:
        sel.register(stream, selectors.EVENT_READ)
        deadline = time.monotonic() + TIMEOUT_S
        while (match := re.search(pattern, out)) is None:
            assert time.monotonic() < deadline and sel.select(deadline - time.monotonic()), out.decode()
            chunk = os.read(stream.fileno(), 65536)
            assert chunk, f"{proc.args} exited with {proc.wait(5)}:\n{out.decode()}"
            out += chunk
    return match, out


class CliMaster:
    """``python -m tidekv master ...`` as a process; its address is parsed from its "listening on" log line."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "tidekv", "master", *args], cwd=REPO_ROOT,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})))
        assert self.proc.stderr is not None
        try:
            match, self.log = _read_until(self.proc, self.proc.stderr, rb"listening on (\S+:\d+)")
        except BaseException:
            self.close()
            raise
        self.address = match.group(1).decode()

    def lease_ttl_s(self) -> float:
        """The read lease this master grants (a Get reply carries it)."""
        channel = MasterChannel(self.address, "cli-test", 5.0)
        try:
            lease, _ = channel.call(p.Get([b"any"]))
        finally:
            channel.close()
        return lease

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        if self.proc.stderr is not None:
            self.proc.stderr.close()


def test_master_command_serves_clients_and_stops_on_sigint(connect: Connect) -> None:
    master = CliMaster("--port", "0", "--metrics-port", "-1")
    try:
        st = connect(master.address, segment_size=1 << 20)
        st.put("cli", b"served")
        assert st.get("cli") == b"served"
        st.close()
        master.proc.send_signal(signal.SIGINT)
        assert master.proc.wait(timeout=10) in (0, 130)
    finally:
        master.close()


def _health_once_frozen(url: str, timeout_s: float = 10.0) -> dict[str, Any]:
    """The master's /health at ``url`` once its collector froze at least once (or after timeout_s)."""
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while True:
        with urllib.request.urlopen(url, timeout=5) as resp:
            health: dict[str, Any] = json.loads(resp.read())
        if health.get("gc", {}).get("freezes", 0) >= 1 or time.monotonic() > deadline:
            return health
        time.sleep(0.2)


def test_the_master_command_keeps_the_cycle_collector_off_its_index(connect: Connect) -> None:
    """``tidekv master`` owns its process: its timer freezes the survivors (store.master.collector), which
    /health reports; a master started inside another program (tests) does not."""
    master = CliMaster("--port", "0", "--metrics-port", "0")
    try:
        port = int(re.search(rb"metrics http port (\d+)", master.log).group(1))  # type: ignore[union-attr]
        st = connect(master.address, segment_size=1 << 20)
        st.put_many([f"k{i}" for i in range(500)], [b"v"] * 500)
        health = _health_once_frozen(f"http://127.0.0.1:{port}/health")
        assert health["gc"]["freezes"] >= 1 and health["gc"]["frozen_objects"] > 0, health["gc"]
        assert health["keys"] == 500
        st.close()
    finally:
        master.close()


def test_up_keeps_the_cycle_collector_off_its_index_too() -> None:
    """``tidekv up`` owns its process as ``tidekv master`` does: its master's timer freezes the
    survivors (the first tick does at once), which /health reports."""
    proc = subprocess.Popen([sys.executable, "-m", "tidekv", "up", "--port", "0", "--metrics-port", "0",
                             "--segment-size", "16MiB"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            cwd=REPO_ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        assert proc.stdout is not None
        match, _ = _read_until(proc, proc.stdout, rb"tidekv is up: (.*)\n")
        metrics = json.loads(match.group(1))["metrics"]
        health = _health_once_frozen(metrics.replace("/metrics", "/health"))
        assert health["gc"]["freezes"] >= 1 and health["gc"]["frozen_objects"] > 0, health
    finally:
        proc.terminate()
        assert proc.wait(timeout=15) in (0, -signal.SIGTERM), "tidekv up did not stop on SIGTERM"


@pytest.mark.parametrize(
    ("file_s", "env_s", "flag_s", "expected_s"),
    [(7.0, None, None, 7.0), (None, 8.0, None, 8.0), (7.0, 8.0, None, 8.0), (7.0, 8.0, 9.0, 9.0)],
    ids=["file", "env", "env-over-file", "flag-over-all"],
)
def test_master_settings_come_from_file_then_environment_then_flags(
    tmp_path: Path, file_s: float | None, env_s: float | None, flag_s: float | None, expected_s: float
) -> None:
    args = ["--port", "0", "--metrics-port", "-1"]
    if file_s is not None:
        config = tmp_path / "master.json"
        config.write_text(json.dumps({"lease_ttl_s": file_s}))
        args += ["--config", str(config)]
    if flag_s is not None:
        args += ["--lease-ttl-s", str(flag_s)]
    env = {"TIDEKV_MASTER_LEASE_TTL_S": str(env_s)} if env_s is not None else {}
    master = CliMaster(*args, env=env)
    try:
        assert master.lease_ttl_s() == expected_s
    finally:
        master.close()
