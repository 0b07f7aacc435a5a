"""Mount proofs (issue 17, item 2): a mount must prove its memory is the mounting process's own.

The engine side (``TransferEngine.region_proof`` and the listener's answer to
``_native.check_region_proof``), then a master with a secret, in its own process, checking
mounts with the engines they name: a client that holds the secret but names another engine's
memory is refused, the legitimate clients keep working, and a check that hangs delays no one
else."""

from __future__ import annotations

import socket
import threading
import time
import urllib.request

import numpy as np
import pytest
from tidekv import _native
from tidekv.config import StoreConfig, TransferConfig
from tidekv.errors import AuthenticationError, ConfigError, PeerUnavailableError, SegmentNotRegisteredError
from tidekv.store.client.master_client import MasterClient
from tidekv.store.client.store import Store
from tidekv.store.master import mount_check
from tidekv.store.wire import mount_proof
from tidekv.store.wire import protocol as p
from tidekv.transfer import TransferEngine

from tests.store.conftest import SpawnMaster

SECRET = "mount-proof-secret"
CONFIG = StoreConfig(staging_size_bytes=1 << 20, rpc_timeout_s=10.0, failover_timeout_s=0.0)
CONTEXT = bytes(range(32))


def _engine(secret: str | None = SECRET) -> TransferEngine:
    return TransferEngine(host="127.0.0.1", config=TransferConfig(secret=secret))


def _check(engine: TransferEngine, base: int, length: int, proof: bytes, secret: str | None = SECRET,
           context: bytes = CONTEXT) -> None:
    _native.check_region_proof(engine.name, secret or "", context, base, length, proof, 5000)


# ---- the engine ------------------------------------------------------------------------------


def test_an_engine_vouches_for_its_own_proof_and_nothing_else() -> None:
    with _engine() as owner, _engine() as other:
        buf = np.zeros(1 << 20, dtype=np.uint8)
        region = owner.register(buf)
        proof = owner.region_proof(region, CONTEXT)
        assert len(proof) == 32
        _check(owner, region.address, region.length, proof)  # vouched: returns
        _check(owner, region.address + 4096, 8192, owner._native.region_proof(CONTEXT, region.address + 4096, 8192))

        with pytest.raises(AuthenticationError, match="does not vouch"):
            _check(owner, region.address, region.length, bytes(32))  # a made-up proof
        with pytest.raises(AuthenticationError, match="does not vouch"):
            _check(owner, region.address, region.length, proof, context=bytes(32))  # bound to its context
        with pytest.raises(AuthenticationError, match="does not vouch"):
            _check(owner, region.address, region.length // 2, proof)  # and to its range
        with pytest.raises(SegmentNotRegisteredError, match="no live region"):
            _check(other, region.address, region.length, proof)  # another engine has no such region
        # Another engine cannot make a proof for memory it has not registered...
        with pytest.raises(SegmentNotRegisteredError):
            other._native.region_proof(CONTEXT, region.address, region.length)
        # ...and a proof of its own for the same numbers is not the owner's.
        other_region = other.register((region.address, region.length))
        forged = other.region_proof(other_region, CONTEXT)
        assert forged != proof
        with pytest.raises(AuthenticationError, match="does not vouch"):
            _check(owner, region.address, region.length, forged)
        other.unregister(other_region)

        owner.unregister(region)
        with pytest.raises(SegmentNotRegisteredError, match="no live region"):
            _check(owner, region.address, region.length, proof)  # gone: no longer vouched for


def test_the_check_needs_the_engines_secret() -> None:
    with _engine() as owner:
        region = owner.allocate(1 << 16)
        proof = owner.region_proof(region, CONTEXT)
        with pytest.raises(AuthenticationError, match="shared secret"):
            _check(owner, region.address, region.length, proof, secret=None)
        with pytest.raises(AuthenticationError):
            _check(owner, region.address, region.length, proof, secret="not-the-secret")
        _check(owner, region.address, region.length, proof)


def test_an_unreachable_engine_is_a_typed_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(PeerUnavailableError):
        _native.check_region_proof(f"127.0.0.1:{port}", SECRET, CONTEXT, 1 << 20, 4096, bytes(32), 2000)


# ---- the master ------------------------------------------------------------------------------


def _attacker(address: str, client_id: str = "attacker") -> MasterClient:
    """A client that holds the secret and speaks the protocol by hand."""
    client = MasterClient(address, client_id, timeout_s=15.0, failover_timeout_s=0.0, register=True, secret=SECRET)
    client.connect()
    return client


def test_a_mount_of_another_engines_memory_is_refused(spawn_master: SpawnMaster) -> None:
    master = spawn_master(secret=SECRET)  # verify_mounts "auto": on, since the master has a secret
    holder = Store.connect(master.address, 1 << 20, config=CONFIG, transfer_config=TransferConfig(secret=SECRET))
    victim = _engine()  # a vLLM worker's engine, say: memory registered, never mounted
    kv_cache = victim.allocate(1 << 20)
    attacker_engine = _engine()
    attacker = _attacker(master.address)
    try:
        holder.put("k", b"v" * 4096)
        # 1. The victim's memory with no proof, with a made-up one, and with a proof the
        #    attacker's own engine made for its own region of the same size.
        own = attacker_engine.allocate(1 << 20)
        theirs = attacker_engine.region_proof(own, mount_proof.context("attacker", "stolen"))
        for proof in (b"", bytes(32), theirs):
            with pytest.raises(AuthenticationError, match="refused"):
                attacker.call(p.MountSegment("attacker", "stolen", victim.name, kv_cache.address, kv_cache.length,
                                             "", proof))
        # 2. The legitimate holder's own segment, renamed: not mounted twice, and no proof for it.
        seg = holder._member.segment
        assert seg is not None
        with pytest.raises(ConfigError, match="overlaps a segment another client has mounted"):
            attacker.call(p.MountSegment("attacker", "copy", holder.engine.name, seg.address, seg.length, "",
                                         bytes(32)))
        # 3. A proof the victim's engine made, replayed for another client or segment name.
        replayed = victim.region_proof(kv_cache, mount_proof.context("victim-client", "its-segment"))
        with pytest.raises(AuthenticationError, match="does not vouch"):
            attacker.call(p.MountSegment("attacker", "stolen", victim.name, kv_cache.address, kv_cache.length, "",
                                         replayed))
        stats = holder.stats()
        assert list(stats["segments"]) == [holder.segment_name], "no mount went through"
        # The legitimate client's next request, timed, and its data untouched.
        started = time.perf_counter()
        assert holder.get("k") == b"v" * 4096
        elapsed = time.perf_counter() - started
        assert elapsed < 1.0, f"the holder's next get took {elapsed:.3f} s"
        # 4. The attacker's own memory, with its own engine's proof: an ordinary mount.
        good = attacker_engine.region_proof(own, mount_proof.context("attacker", "mine"))
        result = attacker.call(p.MountSegment("attacker", "mine", attacker_engine.name, own.address, own.length, "",
                                              good))
        assert result.outcome == p.MountOutcome.NEW
    finally:
        attacker.close()
        holder.close()
        attacker_engine.close()
        victim.close()
    with urllib.request.urlopen(f"http://127.0.0.1:{master.metrics_port}/metrics", timeout=5) as r:
        metrics = r.read().decode()
    assert 'tidekv_master_mount_checks_total{outcome="refused"} 4' in metrics, metrics
    assert 'tidekv_master_mount_checks_total{outcome="vouched"} 2' in metrics, metrics  # the holder's and "mine"


def test_a_check_that_hangs_delays_no_one_else(spawn_master: SpawnMaster) -> None:
    """An engine address that accepts and then says nothing: the mount waits out the check's
    timeout and is refused by name, while other clients' requests (and heartbeats) go on."""
    master = spawn_master(secret=SECRET)
    holder = Store.connect(master.address, 1 << 20, config=CONFIG, transfer_config=TransferConfig(secret=SECRET))
    silent = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    threading.Thread(target=lambda: accepted.append(silent.accept()[0]), daemon=True).start()
    attacker = _attacker(master.address)
    outcome: list[BaseException] = []

    def mount() -> None:
        try:
            attacker.call(p.MountSegment("attacker", "hang", f"127.0.0.1:{silent.getsockname()[1]}", 1 << 30, 1 << 20,
                                         "", bytes(32)))
        except BaseException as exc:  # noqa: BLE001 - inspected below
            outcome.append(exc)

    try:
        holder.put("k", b"v" * 4096)
        t = threading.Thread(target=mount)
        started = time.perf_counter()
        t.start()
        worst = 0.0
        while t.is_alive() and time.perf_counter() - started < 30:
            before = time.perf_counter()
            assert holder.get("k") == b"v" * 4096
            worst = max(worst, time.perf_counter() - before)
            time.sleep(0.05)
        t.join(timeout=30)
        took = time.perf_counter() - started
        assert outcome and isinstance(outcome[0], AuthenticationError), outcome
        assert "could not ask engine" in str(outcome[0]), outcome[0]
        assert mount_check.CHECK_TIMEOUT_S - 0.5 < took < mount_check.CHECK_TIMEOUT_S + 5, took
        # A check on the loop would hold every get for the check's whole timeout (5 s).
        assert worst < 1.0, f"a get waited {worst * 1000:.1f} ms while a mount was being checked"
    finally:
        attacker.close()
        holder.close()
        silent.close()
        for s in accepted:
            s.close()


def test_verify_mounts_off_takes_a_mount_on_its_word(spawn_master: SpawnMaster) -> None:
    master = spawn_master(secret=SECRET, verify_mounts="off")
    attacker = _attacker(master.address)
    try:
        result = attacker.call(p.MountSegment("attacker", "word", "127.0.0.1:1", 1 << 30, 1 << 20, "", b""))
        assert result.outcome == p.MountOutcome.NEW
    finally:
        attacker.close()
