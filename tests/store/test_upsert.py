"""Upsert under concurrent readers: every read returns one whole version, never a mix.

Each version of the value is one repeated byte with a version-dependent length
(``payload.versioned``), so a torn read shows up as two distinct bytes or a wrong length.
Readers run as threads in this process and as a separate client process while a writer upserts.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.store.conftest import Connect, SpawnAgent, SpawnMaster
from tests.store.payload import is_whole_version, versioned
from tidekv.errors import LeaseExpiredError, OutOfSpaceError

BASE = 128 * 1024
DURATION_S = 2.0
MIB = 1 << 20


@pytest.mark.slow
def test_upsert_under_concurrent_readers_never_tears(spawn_master: SpawnMaster, spawn_agent: SpawnAgent,
                                                      connect: Connect) -> None:
    master = spawn_master(lease_ttl_s=0.5, high_watermark=1.0)
    spawn_agent(master.address, 64 * MIB)
    writer = connect(master.address)
    readers = connect(master.address)
    remote_reader = spawn_agent(master.address)
    writer.put("hot", versioned(0, BASE))
    stop = threading.Event()
    upserts = {"ok": 0, "out_of_space": 0}

    def write() -> None:
        version = 1
        while not stop.is_set():
            try:
                writer.upsert("hot", versioned(version, BASE))
            except OutOfSpaceError:  # old versions wait out their readers' leases; let some lapse
                upserts["out_of_space"] += 1
                time.sleep(0.01)
                continue
            upserts["ok"] += 1
            version += 1

    def read() -> dict[str, object]:
        reads, torn, versions, expired = 0, 0, set(), 0
        deadline = time.monotonic() + DURATION_S
        while time.monotonic() < deadline:
            try:
                data = readers.get("hot")
            except LeaseExpiredError:  # the read was too slow to trust; the store said so
                expired += 1
                continue
            reads += 1
            if is_whole_version(data, BASE):
                versions.add(data[0])
            else:
                torn += 1
        return {"reads": reads, "torn": torn, "distinct_versions": len(versions), "expired": expired}

    with ThreadPoolExecutor(4) as pool:
        writing = pool.submit(write)
        try:
            local = [pool.submit(read) for _ in range(2)]
            remote = pool.submit(remote_reader.call, "read_loop", DURATION_S + 20, key="hot", duration_s=DURATION_S,
                                 base_size=BASE)
            results = [f.result(timeout=DURATION_S + 30) for f in local]
            remote_result = remote.result(timeout=DURATION_S + 30)
        finally:
            stop.set()  # a failed reader must not leave the writer looping (the pool would wait forever)
        writing.result(timeout=30)

    assert upserts["ok"] >= 20, upserts
    for r in results:
        assert r["torn"] == 0, f"a reader saw a mix of two versions: {r}"
        assert r["reads"] >= 20 and r["distinct_versions"] >= 2, r
    assert remote_result["torn"] == 0, remote_result
    assert remote_result["reads"] >= 20 and remote_result["distinct_versions"] >= 2, remote_result
    assert set(remote_result["errors"]) <= {"LeaseExpiredError"}, remote_result
    assert is_whole_version(writer.get("hot"), BASE)
    stats = writer.stats()
    assert stats["keys"] == 1 and stats["pending_puts"] == 0
