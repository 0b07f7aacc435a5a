"""PD disaggregation across hosts on real vLLM: the prefill, the decode, `tidekv proxy` and the
store's master each on a host of their own (network namespaces of a ``tests/multihost`` rig, each
with its own address and boot id, so tidekv takes them for four machines and uses tcp between
them), started as the README's "Many hosts" section says: nothing set but the master's address,
the servers' listen addresses (vLLM's ``--host``) and the proxy's backend URLs.

Proof that the decode pulled each prompt's KV from the other host rather than computing it: vLLM
counts the pulled tokens as external prefix-cache hits, and the decode's transfer engine logs its
connection, over tcp, to the address the prefill's engine advertised. That address is the prefill
host's rig address (the interface routing to the master), not loopback. The decode's release then
reaches the prefill's hold table on its host: the prefill's KV usage goes back to zero.

This process is on none of the rig's hosts: every request to a server or the proxy is made from a
rig host (``harness.http(via=...)``). Each host has ports of its own, so the master and the proxy
keep their default ports, as in the recipe.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import MAX_TOKENS, tidekv_config
from harness import HarnessError, OpenAIServer, PhaseResult, http

from tests.multihost.conftest import multihost  # noqa: F401  (the fixture, for this module's test)
from tests.multihost.rig import Host, Rig

EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"  # prompt tokens a connector supplied
KV_USAGE = "vllm:kv_cache_usage_perc"
RELEASE_TIMEOUT_S = 10.0
"""How long the prefill may take to free the blocks the decode pulled (a hold nobody releases
lasts ``hold_timeout_s``, 120 s)."""
MASTER_PORT = 50051  # `tidekv up`'s default
PROXY_PORT = 8000  # `tidekv proxy`'s default
_CONNECTOR_LINE = re.compile(r"tidekv connector: role \S+, tp rank 0, transfer engine (?P<engine>\S+), .*"
                             r"hold table (?P<hold>\S+);")


class _Daemon:
    """A tidekv server (``tidekv up``, ``tidekv proxy``) on a rig host, its output in a file."""

    def __init__(self, host: Host, argv: list[str], log_path: Path) -> None:
        self.host, self.argv, self.log_path = host, argv, log_path
        self.name = argv[3]  # [python, -m, tidekv, NAME, ...]
        self._proc: subprocess.Popen[bytes] | None = None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def start(self, ready: str, timeout_s: float = 60.0) -> None:
        """Starts it and returns once its output says ``ready``.

        Raises:
            HarnessError: it exited, or did not say ``ready`` within ``timeout_s``; quotes its output.
        """
        with open(self.log_path, "wb") as log_file:
            self._proc = self.host.popen(self.argv, stdout=log_file, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while ready not in self.log():
            if self._proc.poll() is not None or time.monotonic() > deadline:
                how = f"exited with {self._proc.returncode}" if self._proc.poll() is not None else \
                    f"did not say {ready!r} within {timeout_s:.0f} s"
                raise HarnessError(f"tidekv {self.name} on {self.host!r} {how}; its output:\n{self.log()[-5000:]}")
            time.sleep(0.1)

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()


@pytest.fixture
def daemons() -> Iterator[list[_Daemon]]:
    """Where a test lists the ``_Daemon``s it starts; each is stopped after the test."""
    started: list[_Daemon] = []
    yield started
    for daemon in reversed(started):
        daemon.stop()


def _advertised(server: OpenAIServer) -> tuple[str, str]:
    """The addresses of the transfer engine and the hold table the server's connector logged at start."""
    found = _CONNECTOR_LINE.search(server.log())
    assert found is not None, "no 'tidekv connector: ...' start-up line in the server's log"
    return found["engine"], found["hold"]


def _host_of(address: str) -> str:
    return address.rsplit(":", 1)[0].strip("[]")


def test_pd_across_hosts_through_the_proxy(multihost: Callable[..., Rig],  # noqa: F811
                                           daemons: list[_Daemon], prompts: list[str], tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
    """Greedy tokens of every prompt through the proxy (host 3) equal a single engine's, with each
    prompt's KV (all its tokens but the last) pulled over tcp by the decode (host 2) from the
    prefill (host 1), whose transfer engine and hold table advertise host 1's rig address, and
    released there; both servers use the store's master (host 4)."""
    for name in ("TIDEKV_HOST", "TIDEKV_MASTER", "TIDEKV_CONNECTOR_CONFIG"):
        monkeypatch.delenv(name, raising=False)  # nothing set but the master's address
    rig = multihost(4)
    # Asked for after the rig: where no rig can be made, the test skips before these run vLLM.
    tiny_model: str = request.getfixturevalue("tiny_model")
    baseline: PhaseResult = request.getfixturevalue("baseline")
    prefill_host, decode_host, proxy_host, master_host = rig.hosts
    master = f"{master_host.ip}:{MASTER_PORT}"
    tidekv = [sys.executable, "-m", "tidekv"]
    servers: list[tuple[str, OpenAIServer]] = []
    try:
        # The README's recipe: `tidekv up`, a master with pool memory (a master alone holds nothing,
        # and every save of the prefill would fail).
        daemons.append(_Daemon(master_host, [*tidekv, "up", "--host", master_host.ip, "--segment-size", "256M"],
                               tmp_path / "master.log"))
        daemons[-1].start(ready=f"listening on {master}")
        # The README's set-up for engines sharing a CPU machine: each server's model in its
        # engine-core process, each server on a core of its own.
        config = tidekv_config(master=master)
        with OpenAIServer(tiny_model, kv_transfer_config=config, host=prefill_host.ip, via=prefill_host.command([]),
                          in_process=True, cpus={0}, log_path=tmp_path / "prefill.log") as prefill, \
                OpenAIServer(tiny_model, kv_transfer_config=config, host=decode_host.ip, via=decode_host.command([]),
                             in_process=True, cpus={1}, log_path=tmp_path / "decode.log") as decode:
            servers += [("prefill", prefill), ("decode", decode)]
            daemons.append(_Daemon(proxy_host, [*tidekv, "proxy", "--prefill", prefill.url, "--decode", decode.url],
                                   tmp_path / "proxy.log"))
            daemons[-1].start(ready="tidekv proxy listening on")
            url = f"http://127.0.0.1:{PROXY_PORT}/v1/completions"  # the proxy's default address, on its host

            for prompt, expected in zip(prompts, baseline.completions, strict=True):
                body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                        "ignore_eos": True, "return_token_ids": True}
                pulled = decode.metric(EXTERNAL_HITS)
                status, text = http(url, body, timeout_s=120, via=proxy_host.command([]))
                assert status == 200, text
                choice = json.loads(text)["choices"][0]
                assert (choice["prompt_token_ids"], choice["token_ids"]) == \
                    (expected.prompt_token_ids, expected.token_ids)
                assert decode.metric(EXTERNAL_HITS) - pulled == len(expected.prompt_token_ids) - 1

            deadline = time.monotonic() + RELEASE_TIMEOUT_S
            while (usage := prefill.metric(KV_USAGE)) > 0.0 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert usage == 0.0, f"the prefill still holds KV blocks (usage {usage}) {RELEASE_TIMEOUT_S} s on"
            prefill_engine, prefill_hold = _advertised(prefill)
            decode_engine, _ = _advertised(decode)
            assert [_host_of(prefill_engine), _host_of(prefill_hold), _host_of(decode_engine)] == \
                [prefill_host.ip, prefill_host.ip, decode_host.ip]
            assert f"engine {decode_engine} connected to peer {prefill_engine} via tcp" in decode.log()
            for _, server in servers:
                assert f"tidekv store at {master}: connected" in server.log()
                assert "prefix reuse is off" not in server.log()
            assert "pulling KV from" not in decode.log()  # no pull failed (tidekv warns on each)
            assert "failed" not in "".join(line for line in prefill.log().splitlines(keepends=True)
                                           if "tidekv: saving" in line), "a save to the pool on host 4 failed"
    except BaseException:
        print(rig.describe())
        for name, log in [*((n, s.log()) for n, s in servers), *((d.name, d.log()) for d in daemons)]:
            print(f"----- {name} log\n{log[-15000:]}")
        raise
