"""``tidekv proxy`` as a real process: help, bad settings, a missing aiohttp, and one request through it."""

from __future__ import annotations

import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from tests.childproc import REPO_ROOT
from tests.proxy.conftest import MakeBackend
from tests.proxy.fakes import FakeBackend, engine_of, http_request, sse_events

TIMEOUT_S = 20.0
ProxyProcess = tuple[subprocess.Popen[bytes], str, list[FakeBackend]]


def _tidekv(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tidekv", *args], check=False, capture_output=True, text=True,
                          timeout=TIMEOUT_S, cwd=REPO_ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1"))


def test_help_lists_every_flag_and_explains_the_prefix_policy() -> None:
    result = _tidekv("proxy", "--help")
    assert result.returncode == 0, result.stderr
    for flag in ("--prefill", "--decode", "--host", "--port", "--policy", "--timeout-s", "--prefix-chunk-chars",
                 "--prefix-capacity", "round_robin", "prefix"):
        assert flag in result.stdout
    assert "tidekv store is asked nothing" in result.stdout and "tokenizer" in result.stdout


@pytest.mark.parametrize(("args", "needle"), [
    (["--timeout-s", "0"], "timeout_s"),
    (["--policy", "random"], "invalid choice"),
    (["--port", "70000"], "port"),
])
def test_bad_settings_exit_2_naming_the_setting(args: list[str], needle: str) -> None:
    result = _tidekv("proxy", "--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:2", *args)
    assert result.returncode == 2
    assert needle in result.stderr, result.stderr


def test_port_in_use_exits_2_naming_the_address() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        result = _tidekv("proxy", "--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:2", "--port", port)
    assert result.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr, result.stderr


def test_missing_aiohttp_says_what_to_install() -> None:
    code = ("import sys; sys.modules['aiohttp'] = None; import tidekv; from tidekv.cli import main; "
            "sys.exit(main(['proxy', '--prefill', 'h:1', '--decode', 'h:2']))")
    result = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True,
                            timeout=TIMEOUT_S, cwd=REPO_ROOT)
    assert result.returncode == 2, result.stderr
    assert "pip install aiohttp (tidekv's proxy extra)" in result.stderr


@pytest.fixture
def proxy_process(backend: MakeBackend) -> Iterator[ProxyProcess]:
    prefills, decodes = [backend("prefill"), backend("prefill")], [backend("decode"), backend("decode")]
    proc = subprocess.Popen(
        [sys.executable, "-m", "tidekv", "--log-level", "DEBUG", "proxy", "--port", "0", "--timeout-s", "5",
         "--prefill", *(p.url for p in prefills), "--decode", *(d.url for d in decodes)],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        line = _first_line(proc, TIMEOUT_S)
        assert line.startswith("tidekv proxy listening on http://127.0.0.1:"), line
        yield proc, line.rsplit(" ", 1)[1], prefills + decodes
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(TIMEOUT_S)


def _first_line(proc: subprocess.Popen[bytes], timeout_s: float) -> str:
    assert proc.stdout is not None and proc.stderr is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout_s):
            proc.kill()
            raise AssertionError(f"proxy printed nothing in {timeout_s} s; stderr:\n{proc.stderr.read().decode()}")
    line = proc.stdout.readline().decode().strip()
    if not line:
        proc.wait(TIMEOUT_S)
        raise AssertionError(f"proxy exited with {proc.returncode}; stderr:\n{proc.stderr.read().decode()}")
    return line


def test_proxy_process_serves_and_stops_on_sigterm(proxy_process: ProxyProcess) -> None:
    proc, url, (p0, p1, d0, d1) = proxy_process
    answer = http_request(url + "/v1/completions", body={"model": "tiny", "prompt": "hello", "max_tokens": 4})
    assert answer.status == 200, answer.body
    status, _, events = sse_events(url + "/v1/chat/completions",
                                   {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True})
    assert status == 200 and events[-1] == "[DONE]" and len(events) == 6
    assert [len(b.received) for b in (p0, p1, d0, d1)] == [1, 1, 1, 1]
    assert engine_of(d1.bodies()[0]["kv_transfer_params"]) == "prefill1"
    assert http_request(url + "/health", method="GET").json()["status"] == "ok"

    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(TIMEOUT_S) == 0
    assert time.monotonic() - started < 5.0
    assert proc.stderr is not None
    log = proc.stderr.read().decode()
    assert "proxy listening on" in log and "stopped" in log, log
