"""The SGLang plugin across hosts (network namespaces of a ``tests/multihost`` rig, each with its
own address and boot id, so tidekv takes them for separate machines and uses tcp between them),
on the real SGLang package, with default settings but the addresses a deployment must name.

- HiCache: ``tidekv up`` (master plus the pool's one segment) on h0; SGLang ranks on h1 and h2,
  each a real host pool with the tidekv backend built by SGLang's dynamic factory
  (``hicache_peer.py``), their extra config naming nothing but the master. Pages one rank saves
  the other finds (``batch_exists``) and reads back byte for byte, both ways. The ranks' transfer
  engines are given no host: they take the interface that routes to the master.
- PD: SGLang's own mooncake connector on the tidekv shim (``pd_peer.py``), prefill on h1 (with
  its bootstrap server, on SGLang's ``--host``), decode on h2; the KV pages and first token of
  two requests move from h1 to h2 and compare by digest. Rig hosts have no default route, so
  SGLang's ``get_local_ip_auto()`` is given each host's address through ``$SGLANG_HOST_IP`` (its
  own setting for this); the decode names the prefill's bootstrap address, as a request does.
  Then h2 is cut off after the decode asked for a third request: the prefill's send fails
  (``KVPoll.Failed``, SGLang's ``KVTransferError``) within its transfer engine's io timeout.

This process is on none of the rig's hosts. Neighbours: ``test_sglang_hicache.py`` and
``test_sglang_pd.py`` (the same, on one host), ``tests/multihost/test_weights_hosts.py`` (style).
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
import sglang_rig

from tests import childproc
from tests.childproc import JsonLineChild
from tests.multihost.conftest import multihost  # noqa: F401  (the fixture, for this module's tests)
from tests.multihost.rig import Host, Rig

Start = Callable[..., JsonLineChild]
HERE = Path(__file__).resolve().parent
SHIM = sglang_rig.REPO / "plugins" / "mooncake"
START_TIMEOUT_S = 120.0
"""An SGLang child imports SGLang, torch and transformers: ~10 s idle, more on a loaded 2-core machine."""
CALL_TIMEOUT_S = 60.0
MASTER_PORT = 50051  # `tidekv up`'s default
BOOTSTRAP_PORT = 8998  # SGLang's --disaggregation-bootstrap-port default
SHAPE = {"pages": 32}  # sglang_rig.PoolShape's small model, 32 pages of 16 tokens (16 KiB each)
IO_TIMEOUT_S = 2.0
"""TIDEKV_IO_TIMEOUT_S of the prefill in the cut test: what bounds a write to a host that went
silent (30 s by default)."""
KVPOLL_FAILED, KVPOLL_SUCCESS = 0, 4


@pytest.fixture
def sglang_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Start]:
    """``sglang_on(host, script, env={...}, **spec)``: ``hicache_peer.py`` or ``pd_peer.py`` on ``host``
    under this interpreter (``env``: variables for that process only), stopped after the test; a
    failed test shows their logs."""
    for name in ("TIDEKV_HOST", "TIDEKV_MASTER", "SGLANG_HOST_IP", "HOST_IP"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(childproc, "START_TIMEOUT_S", START_TIMEOUT_S)
    started: list[JsonLineChild] = []

    def start(host: Host, script: str, /, env: Mapping[str, str] | None = None, **spec: Any) -> JsonLineChild:
        prefix = host.command(["env", *(f"{k}={v}" for k, v in (env or {}).items())])
        argv = [*prefix, sys.executable, str(HERE / script), json.dumps(spec)]
        label = f"{Path(script).stem}@{host.name}"
        child = JsonLineChild(argv, tmp_path / f"{label}-{len(started)}.log", label)
        started.append(child)
        return child

    yield start
    for child in reversed(started):
        if child.is_alive():
            try:
                child.proc.stdin.close()  # type: ignore[union-attr]  # EOF: both scripts close and exit
                child.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                child.kill()
        child.close_pipes()
        print(f"--- {child.label} (exit {child.proc.returncode}) log ---\n{child.log_text()[-6000:]}")


def _call(child: JsonLineChild, cmd: str, timeout_s: float = CALL_TIMEOUT_S, **args: Any) -> dict[str, Any]:
    child.send(cmd, **args)
    reply = child.read_line(timeout_s)
    assert reply.get("ok"), f"{child.label}: {cmd!r} failed: {reply.get('error')}\n{child.log_text()[-4000:]}"
    return reply


def _tidekv_up(host: Host, log_path: Path) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    """``tidekv up --host <host>`` (defaults otherwise: 1 GiB segment) on ``host``; returns it and
    what it printed (``master``, ``engine``: its segment's transfer engine)."""
    with open(log_path, "wb") as log:  # the child keeps its own descriptor
        proc = host.popen([sys.executable, "-m", "tidekv", "up", "--host", host.ip], stdout=subprocess.PIPE,
                          stderr=log, cwd=sglang_rig.REPO)
    assert proc.stdout is not None
    line = sglang_rig._read_line(proc.stdout, 60.0)
    assert line.startswith("tidekv is up: "), f"{line!r}; log:\n{log_path.read_text(errors='replace')}"
    info = json.loads(line.removeprefix("tidekv is up: "))
    assert info["master"] == f"{host.ip}:{MASTER_PORT}" and info["engine"].startswith(f"{host.ip}:"), info
    return proc, info


def test_hicache_pages_saved_on_one_host_are_found_and_read_on_another(
        multihost: Callable[..., Rig], sglang_on: Start, tmp_path: Path) -> None:  # noqa: F811
    """h1 saves four pages, h2 finds all four and reads them byte for byte (the pages are in h0's
    segment: neither rank holds pool memory by default); then h2 saves four and h1 reads them."""
    h0, h1, h2 = multihost(3).hosts
    up, pool = _tidekv_up(h0, tmp_path / "tidekv-up.log")
    try:
        ranks = {h: sglang_on(h, "hicache_peer.py", master=pool["master"], shape=SHAPE) for h in (h1, h2)}
        for host, rank in ranks.items():  # given no host: the interface that routes to the master
            assert rank.hello["engine"].startswith(f"{host.ip}:"), rank.hello
        for saver, reader, seed in ((h1, h2, 1), (h2, h1, 2)):
            hashes = sglang_rig.page_hashes(4, seed=100 + seed)
            assert _call(ranks[reader], "exists", hashes=hashes)["hits"] == 0
            saved = _call(ranks[saver], "set", pages=[0, 1, 2, 3], hashes=hashes, seed=seed)
            assert saved["results"] == [True] * 4, saved
            assert _call(ranks[reader], "exists", hashes=hashes)["hits"] == 4
            # Into other slots of the reader's pool than the saver's, so nothing compares equal by chance.
            got = _call(ranks[reader], "get", pages=[20, 21, 22, 23], hashes=hashes)
            assert got["results"] == [True] * 4, got
            assert got["digests"] == saved["digests"]
            assert len(set(saved["digests"])) == 4
        for rank in ranks.values():  # both moved their pages to and from h0's segment over tcp
            assert f"connected to peer {pool['engine']} via tcp" in rank.log_text()
    finally:
        up.terminate()
        up.wait(timeout=15)
        if up.stdout is not None:
            up.stdout.close()


def test_pd_kv_moves_from_a_prefill_host_to_a_decode_host_and_a_cut_fails_typed(
        multihost: Callable[..., Rig], sglang_on: Start, tmp_path: Path) -> None:  # noqa: F811
    """Two requests in flight at once move their pages and first token from h1 to h2 over tcp,
    byte for byte; a third, after h2 is cut off, fails on the prefill within the io timeout."""
    h1, h2 = multihost(2).hosts
    spec = {"bootstrap_port": BOOTSTRAP_PORT, "pages": 64, "model_dir": str(tmp_path / "model")}
    env = {"PYTHONPATH": str(SHIM), "HF_HUB_OFFLINE": "1"}
    prefill = sglang_on(h1, "pd_peer.py", env={**env, "SGLANG_HOST_IP": h1.ip, "TIDEKV_IO_TIMEOUT_S": str(IO_TIMEOUT_S)},
                        **spec, role="prefill", host=h1.ip)
    decode = sglang_on(h2, "pd_peer.py", env={**env, "SGLANG_HOST_IP": h2.ip}, **spec, role="decode", host=h2.ip)
    for peer, host in ((prefill, h1), (decode, h2)):
        assert peer.hello["engine_class"] == "tidekv.compat.mooncake.TransferEngine", peer.hello
        assert peer.hello["session"].startswith(f"{host.ip}:"), peer.hello
    where = {"bootstrap_host": h1.ip, "bootstrap_port": BOOTSTRAP_PORT}
    requests = [
        {"room": 2**62 + 11, "src": [3, 4, 5, 9], "dst": [40, 41, 50, 51], "aux": (0, 2), "token": 1234},
        {"room": 987654321, "src": [10, 11], "dst": [7, 8], "aux": (1, 3), "token": 77},
    ]
    sent = {r["room"]: _call(prefill, "fill", pages=r["src"], seed=r["room"] % 1000)["digests"] for r in requests}
    for r in requests:
        _call(prefill, "sender", room=r["room"], pages=r["src"], aux_index=r["aux"][0], **where)
        _call(decode, "receive", room=r["room"], pages=r["dst"], aux_index=r["aux"][1], **where)
    for r in requests:
        reply = _call(prefill, "send", room=r["room"], pages=r["src"], aux_index=r["aux"][0], first_token=r["token"])
        assert reply["poll"] == KVPOLL_SUCCESS, reply
        got = _call(decode, "wait", room=r["room"], pages=r["dst"], aux_index=r["aux"][1])
        assert got["poll"] == KVPOLL_SUCCESS, got
        assert got["digests"] == sent[r["room"]] and got["first_token"] == r["token"]
    assert f"to peer {decode.hello['session']} via tcp" in prefill.log_text()

    # The decode's metadata is in (the prefill waits for input), the connection to h2 is up: cut it.
    room, src = 424242, [20, 21, 22, 23]
    _call(prefill, "fill", pages=src, seed=5)
    _call(prefill, "sender", room=room, pages=src, aux_index=4, **where)
    _call(decode, "receive", room=room, pages=[60, 61, 62, 63], aux_index=5, **where)
    h2.cut()
    cut_at = time.monotonic()
    failed = _call(prefill, "send", room=room, pages=src, aux_index=4, first_token=9, timeout_s=45)
    failed_after_s = time.monotonic() - cut_at
    assert failed["poll"] == KVPOLL_FAILED, failed
    # SGLang's failure channel: KVTransferError naming the room and the decode rank's address.
    assert failed["failure"].startswith(f"KVTransferError(bootstrap_room={room}): Failed to send kv chunk") \
        and f"to {h2.ip}:" in failed["failure"], failed
    # The tidekv TransferError under it (peer, op and byte range), logged by the shim.
    assert f"WRITE of 8 request(s) to {decode.hello['session']} failed: request 0 (WRITE" in prefill.log_text()
    assert failed_after_s < 2 * IO_TIMEOUT_S + 4, failed_after_s  # ~IO_TIMEOUT_S here; the default is 30 s
