"""RL weight broadcast (``tidekv.weights``) across hosts (``rig``): a trainer's Publisher on one
host, Subscribers on two others pulling two versions and checking every tensor byte for byte,
with default settings (both read from the publisher) and with fan-out (one reads from the other);
a subscriber whose host is cut off mid-pull, while the other reads from it, fails with a typed
error in bounded time and the other completes from the publisher; and the address a Publisher
given no host takes on a host with a default route, with $TIDEKV_HOST, and with neither.

Rig hosts have no default route, so a Publisher given no host listens on loopback there
(``tidekv.hostaddr``): the tests give it its host's address (``host=``), except the one about
exactly that. Subscribers are given nothing: they take the address that routes to the publisher.
The processes are ``weights_main`` (one per host); tensors come from
``tests.weights.procs.make_tensors``. Neighbours: ``tests/weights/test_weights.py`` (one host).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from tests.childproc import JsonLineChild
from tests.multihost.rig import Host, Rig

Start = Callable[..., JsonLineChild]
SCALE = 32
"""make_tensors' scale for the broadcast: ~35 MiB, three chunks of the default 16 MiB."""
PULL_TIMEOUT_S = 60.0
IO_TIMEOUT_S = 2.0
"""TIDEKV_IO_TIMEOUT_S where a host is cut off: nothing answers there, so this (30 s by default)
is what bounds a read from it."""
CUT_SCALE = 64
"""~70 MiB, read in 4 KiB chunks one at a time by the cut test: 4 s of pulling here idle, 10-12 s
under load, where the second subscriber reaches PROGRESS_BYTES 0.5-1.2 s after the first did:
the cut lands mid-pull, with margin."""
CUT_CONFIG = {"fanout": 1, "chunk_bytes": 4096, "window": 1}
PROGRESS_BYTES = 256 << 10


@pytest.fixture
def weights_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Start]:
    """``weights_on(host, role, env={...}, **spec)``: a ``weights_main`` publisher or subscriber on
    ``host`` (``env``: variables for that process only), stopped after the test; a failed test
    shows their logs (captured at teardown)."""
    monkeypatch.delenv("TIDEKV_HOST", raising=False)
    started: list[JsonLineChild] = []

    def start(host: Host, role: str, /, env: Mapping[str, str] | None = None, **spec: Any) -> JsonLineChild:
        prefix = host.command(["env", *(f"{k}={v}" for k, v in env.items())] if env else [])
        argv = [*prefix, sys.executable, "-m", "tests.multihost.weights_main", json.dumps({"role": role, **spec})]
        label = f"{role}@{host.name}"
        child = JsonLineChild(argv, tmp_path / f"{label}-{len(started)}.log", label)
        started.append(child)
        return child

    yield start
    for child in reversed(started):
        if child.is_alive():
            try:
                child.send("stop")
                child.proc.wait(timeout=10)
            except (AssertionError, subprocess.TimeoutExpired):
                child.kill()
        child.close_pipes()
        print(f"--- {child.label} (exit {child.proc.returncode}) log ---\n{child.log_text()[-6000:]}")


def _publish(publisher: JsonLineChild, version: int) -> None:
    publisher.send("publish", version=version)
    assert publisher.read_line(PULL_TIMEOUT_S) == {"ok": True, "version": version}


def _pulled(answer: dict[str, Any], version: int) -> dict[str, Any]:
    assert answer.get("ok") and answer["version"] == version and answer["mismatch"] is None, answer
    return answer


@pytest.mark.parametrize("fanout", [None, 1], ids=["default", "fanout1"])
def test_two_versions_reach_subscribers_on_two_hosts(fanout: int | None, multihost: Callable[..., Rig],
                                                     weights_on: Start) -> None:
    """Version 1 pulled by one subscriber, then the other; version 2 by both at once. Default
    settings: both read from the publisher. Fan-out 1 (a chain): the second to join reads every
    chunk from the first, across hosts."""
    h0, h1, h2 = multihost(3).hosts
    config = {} if fanout is None else {"fanout": fanout}
    publisher = weights_on(h0, "publisher", host=h0.ip, config=config, scale=SCALE)
    address = publisher.hello["address"]
    assert address.startswith(f"{h0.ip}:") and publisher.hello["engine"].startswith(f"{h0.ip}:"), publisher.hello
    subscribers = [weights_on(h, "subscriber", publisher=address, scale=SCALE) for h in (h1, h2)]
    for sub, host in zip(subscribers, (h1, h2), strict=True):
        assert sub.hello["engine"].startswith(f"{host.ip}:"), sub.hello  # the address that routes to h0

    _publish(publisher, 1)
    first = []
    for sub in subscribers:
        sub.send("pull", version=1)
        first.append(_pulled(sub.read_line(PULL_TIMEOUT_S), 1))
    nbytes = first[0]["nbytes"]
    relayed = [a["from_parent_bytes"] for a in first]
    assert relayed[0] == 0 and (relayed[1] == 0 if fanout is None else relayed[1] >= nbytes), first

    _publish(publisher, 2)
    for sub in subscribers:
        sub.send("pull", version=2)
    second = [_pulled(sub.read_line(PULL_TIMEOUT_S), 2) for sub in subscribers]
    relayed = sorted(a["from_parent_bytes"] for a in second)
    # Which one joins first is a race; with a chain, whichever joined second read it all from the other.
    assert relayed[0] == 0 and (relayed[1] == 0 if fanout is None else relayed[1] >= nbytes), second


def test_a_subscriber_cut_off_mid_pull_fails_typed_while_the_other_completes(
        multihost: Callable[..., Rig], weights_on: Start, monkeypatch: pytest.MonkeyPatch) -> None:
    """A chain (fan-out 1): the subscriber on h2 joins first, the one on h1 second and so reads
    from h2. h2 is cut off once both are pulling: h2's pull fails with PublisherUnavailableError
    within its io timeout (the read in flight and the one reconnect), and h1 bypasses its cut-off
    parent (the same io timeout) and completes from the publisher, byte for byte."""
    monkeypatch.setenv("TIDEKV_IO_TIMEOUT_S", str(IO_TIMEOUT_S))
    h0, h1, h2 = multihost(3).hosts
    publisher = weights_on(h0, "publisher", host=h0.ip, config=CUT_CONFIG, scale=CUT_SCALE)
    address = publisher.hello["address"]
    parent, child = (weights_on(h, "subscriber", publisher=address, scale=CUT_SCALE) for h in (h2, h1))
    _publish(publisher, 1)
    for sub in (parent, child):  # in this order (the join order): each answers once PROGRESS_BYTES are in
        sub.send("pull", version=1, progress_bytes=PROGRESS_BYTES)
        assert "progress" in sub.read_line(PULL_TIMEOUT_S)
    h2.cut()
    cut_at = time.monotonic()
    failed = parent.read_line(PULL_TIMEOUT_S)
    failed_after_s = time.monotonic() - cut_at
    assert not failed["ok"], f"h2's pull ended before the cut: make the pull longer (CUT_SCALE)\n{failed}"
    assert failed["error_type"] == "PublisherUnavailableError" and address.split(":")[0] in failed["error"], failed
    assert failed_after_s < 3 * IO_TIMEOUT_S + 3, failed_after_s  # + the Leave it cannot send (1 s)
    done = _pulled(child.read_line(PULL_TIMEOUT_S), 1)
    assert 0 < done["from_parent_bytes"] < done["nbytes"], done  # part from h2, the rest from h0


@pytest.mark.parametrize("setup", ["default_route", "TIDEKV_HOST", "no_route"])
def test_a_publisher_given_no_host(setup: str, multihost: Callable[..., Rig], weights_on: Start) -> None:
    """``Publisher(tensors)`` with no host: the default route's interface; $TIDEKV_HOST when set;
    loopback when there is no default route (the rig's case), logged, and then a subscriber on
    another host, given that address, dials its own loopback and is refused, saying where it dialed."""
    h0, h1 = multihost(2).hosts
    env = {"TIDEKV_HOST": h0.ip} if setup == "TIDEKV_HOST" else None
    if setup == "default_route":
        h0.run(["ip", "route", "add", "default", "dev", "eth0"], check=True)
    publisher = weights_on(h0, "publisher", env=env, scale=1)
    address = publisher.hello["address"]
    _publish(publisher, 1)
    if setup == "no_route":
        assert address.startswith("127.0.0.1:"), publisher.hello
        said = [line for line in publisher.log_text().splitlines()
                if all(words in line for words in ("no default route", "127.0.0.1", "$TIDEKV_HOST"))]
        assert said, f"the publisher did not say it took loopback for want of a default route:\n{publisher.log_text()}"
        sub = weights_on(h1, "subscriber", publisher=address, config={"rpc_timeout_s": 1.0}, scale=1)
        sub.send("pull", version=1)
        answer = sub.read_line(PULL_TIMEOUT_S)
        assert answer["error_type"] == "PublisherUnavailableError", answer
        assert f"cannot reach weights publisher {address}" in answer["error"], answer
        return
    assert address.startswith(f"{h0.ip}:") and publisher.hello["engine"].startswith(f"{h0.ip}:"), publisher.hello
    sub = weights_on(h1, "subscriber", publisher=address, scale=1)
    sub.send("pull", version=1)
    _pulled(sub.read_line(PULL_TIMEOUT_S), 1)
