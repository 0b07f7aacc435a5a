"""The transfer contract, run over every transport against a target engine in another process.

Each test builds batches from random sizes and offsets, runs them through the engine, applies
the same batch to the pure-Python reference (``reference.apply``) and compares both processes'
memory byte for byte. "shm" means an AUTO initiator towards a same-host target; each test first
proves which path it takes with ``engine.connect()``.
"""

from __future__ import annotations

import ctypes
import random
import threading
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import MakeEngine, SpawnTarget
from tests.transfer.harness import (
    TRANSPORTS,
    TargetProcess,
    assert_bytes_equal,
    initiator_config,
    requests_for,
)
from tests.transfer.reference import (
    READ,
    WRITE,
    Copy,
    apply,
    pattern,
    place_disjoint,
    random_lengths,
)
from tidekv import (
    ConfigError,
    SegmentNotRegisteredError,
    TransferEngine,
    TransferOp,
    TransferRequest,
    TransferState,
)
from tidekv.transfer import Region

pytestmark = [pytest.mark.parametrize("transport", TRANSPORTS), pytest.mark.timeout(90)]

KINDS = ["alloc", "bytearray", "numpy"]
"""Target memory: engine-allocated shared memory, or plain registered memory."""

REGION_BYTES = 8 << 20
WAIT_S = 30.0


def connect(engine: TransferEngine, target: TargetProcess, transport: str) -> None:
    assert engine.connect(target.name) == transport


def local_region(engine: TransferEngine, kind: str, size_bytes: int, seed: int) -> Region:
    """Initiator memory of the given kind, filled with pattern(seed)."""
    if kind == "alloc":
        region = engine.allocate(size_bytes)
    elif kind == "bytearray":
        region = engine.register(bytearray(size_bytes))
    else:
        region = engine.register(np.zeros(size_bytes, dtype=np.uint8))
    region.view()[:] = pattern(seed, size_bytes)
    return region


def run_and_check(
    engine: TransferEngine,
    target: TargetProcess,
    copies: list[Copy],
    local: dict[str, Region],
    local_model: dict[str, bytearray],
    remote_model: dict[str, bytearray],
    tmp_path: Path,
) -> None:
    """Runs one batch, applies it to the models, and compares both sides with them."""
    handle = engine.transfer(requests_for(copies, local, target))
    handle.wait(timeout_s=WAIT_S)
    assert handle.done()
    assert [s.state for s in handle.statuses()] == [TransferState.DONE] * len(copies)
    assert handle.bytes_done == sum(c.length for c in copies)
    apply(copies, local_model, remote_model)
    for name, region in local.items():
        assert_bytes_equal(region.view(), local_model[name], f"initiator region {name}")
    for name in {c.remote for c in copies if c.op == WRITE}:
        assert_bytes_equal(target.dump(name, tmp_path), remote_model[name], f"target region {name}")


def check_path_counters(engine: TransferEngine, transport: str, moved_bytes: int) -> None:
    """The bytes went where the transport says: all through shm (or fabric), or none of them."""
    stats = engine.stats()
    assert stats["bytes_read"] + stats["bytes_written"] == moved_bytes
    assert stats["shm_bytes"] == (moved_bytes if transport == "shm" else 0)
    assert stats["fabric_bytes"] == (moved_bytes if transport == "fabric" else 0)


def fit(lengths: list[int], space_bytes: int) -> list[int]:
    while sum(lengths) > space_bytes:
        lengths.pop()
    return lengths


@pytest.mark.parametrize("kind", KINDS)
def test_read_random_sizes_and_offsets(
    transport: str, kind: str, spawn_target: SpawnTarget, make_engine: MakeEngine, tmp_path: Path
) -> None:
    rng = random.Random(f"read-{transport}-{kind}")
    target = spawn_target({"mem": (kind, REGION_BYTES, 1)})
    engine = make_engine(initiator_config(transport))
    connect(engine, target, transport)
    local = {"buf": local_region(engine, "bytearray", REGION_BYTES, 2)}
    local_model = {"buf": bytearray(pattern(2, REGION_BYTES))}
    remote_model = {"mem": bytearray(pattern(1, REGION_BYTES))}
    moved = 0
    for _ in range(4):
        lengths = fit(random_lengths(rng, rng.randint(1, 40), 3 << 20), REGION_BYTES)
        local_offsets = place_disjoint(rng, lengths, REGION_BYTES)
        copies = [
            Copy(READ, "buf", lo, n, "mem", rng.randrange(REGION_BYTES - n + 1))
            for lo, n in zip(local_offsets, lengths, strict=True)
        ]
        run_and_check(engine, target, copies, local, local_model, remote_model, tmp_path)
        moved += sum(lengths)
    check_path_counters(engine, transport, moved)


@pytest.mark.parametrize("kind", KINDS)
def test_write_random_sizes_and_offsets(
    transport: str, kind: str, spawn_target: SpawnTarget, make_engine: MakeEngine, tmp_path: Path
) -> None:
    rng = random.Random(f"write-{transport}-{kind}")
    target = spawn_target({"mem": (kind, REGION_BYTES, 3)})
    engine = make_engine(initiator_config(transport))
    connect(engine, target, transport)
    local = {"buf": local_region(engine, "numpy", REGION_BYTES, 4)}
    local_model = {"buf": bytearray(pattern(4, REGION_BYTES))}
    remote_model = {"mem": bytearray(pattern(3, REGION_BYTES))}
    moved = 0
    for _ in range(4):
        lengths = fit(random_lengths(rng, rng.randint(1, 40), 3 << 20), REGION_BYTES)
        remote_offsets = place_disjoint(rng, lengths, REGION_BYTES)
        copies = [
            Copy(WRITE, "buf", rng.randrange(REGION_BYTES - n + 1), n, "mem", ro)
            for ro, n in zip(remote_offsets, lengths, strict=True)
        ]
        run_and_check(engine, target, copies, local, local_model, remote_model, tmp_path)
        moved += sum(lengths)
    check_path_counters(engine, transport, moved)


def test_scatter_gather_batch_over_all_memory_kinds(
    transport: str, spawn_target: SpawnTarget, make_engine: MakeEngine, tmp_path: Path
) -> None:
    """One batch gathers from and scatters to every kind of target memory, mixing READ and WRITE.

    Reads come from the first half of each target region and land in local "dst"; writes go from
    local "src" to the second half of each target region, so no request touches bytes another
    request of the batch writes.
    """
    rng = random.Random(f"sg-{transport}")
    size = 4 << 20
    half = size // 2
    target = spawn_target({k: (k, size, 10 + i) for i, k in enumerate(KINDS)})
    engine = make_engine(initiator_config(transport))
    connect(engine, target, transport)
    local = {"dst": local_region(engine, "alloc", size, 20), "src": local_region(engine, "numpy", size, 21)}
    local_model = {"dst": bytearray(pattern(20, size)), "src": bytearray(pattern(21, size))}
    remote_model = {k: bytearray(pattern(10 + i, size)) for i, k in enumerate(KINDS)}
    for _ in range(3):
        copies = []
        read_lengths = fit(random_lengths(rng, 60, 256 << 10), size)
        for lo, n in zip(place_disjoint(rng, read_lengths, size), read_lengths, strict=True):
            copies.append(Copy(READ, "dst", lo, n, rng.choice(KINDS), rng.randrange(half - n + 1)))
        for kind in KINDS:
            write_lengths = fit(random_lengths(rng, 20, 128 << 10), half)
            for ro, n in zip(place_disjoint(rng, write_lengths, half), write_lengths, strict=True):
                copies.append(Copy(WRITE, "src", rng.randrange(size - n + 1), n, kind, half + ro))
        rng.shuffle(copies)
        run_and_check(engine, target, copies, local, local_model, remote_model, tmp_path)


def test_many_tiny_requests(transport: str, spawn_target: SpawnTarget, make_engine: MakeEngine, tmp_path: Path) -> None:
    """Thousands of 1..60-byte requests: on shm a batch small enough to be copied inside
    transfer(), on tcp many rounds of frames over a single connection."""
    rng = random.Random(f"tiny-{transport}")
    size = 256 << 10
    target = spawn_target({"a": ("alloc", size, 30), "b": ("bytearray", size, 31)})
    engine = make_engine(initiator_config(transport, connections_per_peer=1))
    connect(engine, target, transport)
    local = {"buf": local_region(engine, "bytearray", size, 32)}
    local_model = {"buf": bytearray(pattern(32, size))}
    remote_model = {"a": bytearray(pattern(30, size)), "b": bytearray(pattern(31, size))}
    for op in (READ, WRITE):
        lengths = [rng.randint(1, 60) for _ in range(2000)]
        local_offsets = place_disjoint(rng, lengths, size)
        remote_offsets = place_disjoint(rng, lengths, size)
        copies = [
            Copy(op, "buf", lo, n, "a" if i % 2 else "b", ro)
            for i, (lo, ro, n) in enumerate(zip(local_offsets, remote_offsets, lengths, strict=True))
        ]
        run_and_check(engine, target, copies, local, local_model, remote_model, tmp_path)


def test_thousands_of_small_requests_to_plain_memory(
    transport: str, spawn_target: SpawnTarget, make_engine: MakeEngine, tmp_path: Path
) -> None:
    """KV-hand-off shaped: 3,000 scattered 1 B..8 KiB copies to memory the target registered but
    did not allocate (on shm: cross-memory attach, many copies per syscall, more than IOV_MAX)."""
    rng = random.Random(f"plain-{transport}")
    size = 16 << 20
    target = spawn_target({"kv": ("numpy", size, 50), "other": ("bytearray", size, 51)})
    engine = make_engine(initiator_config(transport))
    connect(engine, target, transport)
    local = {"buf": local_region(engine, "numpy", size, 52)}
    local_model = {"buf": bytearray(pattern(52, size))}
    remote_model = {"kv": bytearray(pattern(50, size)), "other": bytearray(pattern(51, size))}
    for op in (READ, WRITE):
        lengths = [rng.choice([1, 4096, 8192, rng.randint(1, 8192)]) for _ in range(3000)]
        local_offsets = place_disjoint(rng, lengths, size)
        remote_offsets = place_disjoint(rng, lengths, size)
        copies = [
            Copy(op, "buf", lo, n, "other" if i % 500 == 499 else "kv", ro)
            for i, (lo, ro, n) in enumerate(zip(local_offsets, remote_offsets, lengths, strict=True))
        ]
        run_and_check(engine, target, copies, local, local_model, remote_model, tmp_path)


@pytest.mark.parametrize("kind", ["alloc", "bytearray"])
def test_large_requests_cross_slice_boundaries(
    transport: str, kind: str, spawn_target: SpawnTarget, make_engine: MakeEngine, tmp_path: Path
) -> None:
    """Requests larger than the tcp slice (shrunk to 256 KiB here) and the 16 MiB shm slice."""
    size = 36 << 20
    length = (33 << 20) + 3
    target = spawn_target({"mem": (kind, size, 40)})
    engine = make_engine(initiator_config(transport, slice_size_bytes=256 << 10, connections_per_peer=3))
    connect(engine, target, transport)
    local = {"buf": local_region(engine, "bytearray", size, 41)}
    local_model = {"buf": bytearray(pattern(41, size))}
    remote_model = {"mem": bytearray(pattern(40, size))}
    run_and_check(
        engine, target, [Copy(READ, "buf", 5, length, "mem", 1001)], local, local_model, remote_model, tmp_path
    )
    local["buf"].view()[:] = pattern(42, size)
    local_model["buf"][:] = pattern(42, size)
    run_and_check(
        engine, target, [Copy(WRITE, "buf", 77, length, "mem", 3)], local, local_model, remote_model, tmp_path
    )
    check_path_counters(engine, transport, 2 * length)


@pytest.mark.parametrize("kind", KINDS)
def test_remote_bounds_violations_fail_only_their_requests(
    transport: str, kind: str, spawn_target: SpawnTarget, make_engine: MakeEngine, tmp_path: Path
) -> None:
    size = 1 << 20
    target = spawn_target({"mem": (kind, size, 50)})
    engine = make_engine(initiator_config(transport))
    connect(engine, target, transport)
    buf = local_region(engine, "bytearray", size, 51)
    remote = target.regions["mem"]
    name = target.name
    R, W = TransferOp.READ, TransferOp.WRITE
    batch = [
        TransferRequest(R, buf.addr(0), 4096, name, remote.addr(0)),  # good
        TransferRequest(R, buf.addr(4096), 20, name, remote.addr(size - 10)),  # straddles the end
        TransferRequest(R, buf.addr(8192), 1, name, remote.addr(size)),  # starts at the end
        TransferRequest(R, buf.addr(8192), 2, name, remote.address - 1),  # starts before the region
        TransferRequest(R, buf.addr(8192), 8, name, 0x1000),  # nowhere near any region
        TransferRequest(W, buf.addr(16384), 4096, name, remote.addr(size - 4095)),  # write past the end
        TransferRequest(W, buf.addr(16384), 4096, name, remote.addr(65536)),  # good
        TransferRequest(W, buf.addr(size // 2 - 1), size // 2 + 1, name, remote.addr(size // 2)),  # 1 byte over
    ]
    bad = [1, 2, 3, 4, 5, 7]
    handle = engine.transfer(batch)
    with pytest.raises(SegmentNotRegisteredError) as info:
        handle.wait(timeout_s=WAIT_S)
    assert [i for i, _ in info.value.failures] == bad
    statuses = handle.statuses()
    for i, status in enumerate(statuses):
        if i in bad:
            assert status.state is TransferState.FAILED
            assert isinstance(status.error, SegmentNotRegisteredError), status.error
            assert (status.error.peer, status.error.remote_addr, status.error.length) == (
                name,
                batch[i].remote_addr,
                batch[i].length,
            )
            assert status.error.op == TransferOp(batch[i].op).name
        else:
            assert (status.state, status.error) == (TransferState.DONE, None)
    expected = bytearray(pattern(50, size))
    assert_bytes_equal(buf.view()[:4096], expected[:4096], "good READ next to refused ones")
    expected[65536 : 65536 + 4096] = pattern(51, size)[16384 : 16384 + 4096]
    assert_bytes_equal(target.dump("mem", tmp_path), expected, "target memory (refused writes must not land)")


def test_local_range_errors_raise_from_transfer(
    transport: str, spawn_target: SpawnTarget, make_engine: MakeEngine
) -> None:
    target = spawn_target({"mem": ("alloc", 1 << 20, 60)})
    engine = make_engine(initiator_config(transport))
    connect(engine, target, transport)
    buf = local_region(engine, "bytearray", 1 << 20, 61)
    stray = bytearray(4096)
    remote = target.regions["mem"].addr(0)
    R = TransferOp.READ
    good = TransferRequest(R, buf.addr(0), 16, target.name, remote)
    stray_addr = ctypes.addressof(ctypes.c_char.from_buffer(stray))
    with pytest.raises(SegmentNotRegisteredError, match="register"):
        engine.transfer([good, TransferRequest(R, stray_addr, 16, target.name, remote)])
    with pytest.raises(SegmentNotRegisteredError):
        engine.transfer([TransferRequest(R, buf.addr((1 << 20) - 8), 16, target.name, remote)])
    with pytest.raises(ConfigError, match="length 0"):
        engine.transfer([good._replace(length=0)])
    with pytest.raises(ConfigError):
        engine.transfer([good._replace(peer="no-port-here")])
    # None of the refused batches moved anything; the engine still works.
    assert engine.stats()["batches"] == 0
    engine.transfer([good]).wait(timeout_s=WAIT_S)
    assert_bytes_equal(buf.view()[:16], pattern(60, 1 << 20)[:16], "READ after refused batches")


@pytest.mark.parametrize("kind", ["alloc", "bytearray"])
def test_concurrent_batches_from_four_threads(
    transport: str, kind: str, spawn_target: SpawnTarget, make_engine: MakeEngine, tmp_path: Path
) -> None:
    """100 batches from 4 threads at once; each thread reads and writes its own ranges.

    The threads meet the target for the first time concurrently (no connect() beforehand)."""
    threads, batches_per_thread = 4, 25
    area = 512 << 10
    size = 2 * threads * area  # target: [read-only sources | one write area per thread]
    target = spawn_target({"mem": (kind, size, 70)})
    engine = make_engine(initiator_config(transport))
    # Initiator: per thread a read destination area and a write source area.
    local = {"buf": local_region(engine, "bytearray", size, 71)}
    local_model = {"buf": bytearray(pattern(71, size))}
    remote_model = {"mem": bytearray(pattern(70, size))}
    errors: list[BaseException] = []
    copies_by_thread: list[list[list[Copy]]] = [[] for _ in range(threads)]

    def worker(t: int) -> None:
        rng = random.Random(f"threads-{transport}-{kind}-{t}")
        dst, src, write_area = 2 * t * area, (2 * t + 1) * area, (threads + t) * area
        model = {"buf": bytearray(local_model["buf"])}
        try:
            for _ in range(batches_per_thread):
                copies = []
                lengths = fit(random_lengths(rng, rng.randint(1, 12), 64 << 10), area)
                for lo, n in zip(place_disjoint(rng, lengths, area), lengths, strict=True):
                    copies.append(Copy(READ, "buf", dst + lo, n, "mem", rng.randrange(threads * area - n + 1)))
                lengths = fit(random_lengths(rng, rng.randint(1, 12), 64 << 10), area)
                for ro, n in zip(place_disjoint(rng, lengths, area), lengths, strict=True):
                    copies.append(Copy(WRITE, "buf", src + rng.randrange(area - n + 1), n, "mem", write_area + ro))
                engine.transfer(requests_for(copies, local, target)).wait(timeout_s=WAIT_S)
                apply([c for c in copies if c.op == READ], model, {"mem": remote_model["mem"]})
                assert_bytes_equal(
                    local["buf"].view()[dst : dst + area], model["buf"][dst : dst + area], f"thread {t} reads"
                )
                copies_by_thread[t].append(copies)
        except BaseException as e:  # re-raised by the test thread
            errors.append(e)

    workers = [threading.Thread(target=worker, args=(t,), daemon=True) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=120)
    assert not any(w.is_alive() for w in workers), "a thread is still waiting on its batches"
    if errors:
        raise errors[0]
    assert sum(len(c) for c in copies_by_thread) == threads * batches_per_thread
    for per_thread in copies_by_thread:
        for copies in per_thread:
            apply([c for c in copies if c.op == WRITE], local_model, remote_model)
    assert_bytes_equal(target.dump("mem", tmp_path), remote_model["mem"], "target after 100 concurrent batches")
    moved = sum(c.length for per_thread in copies_by_thread for copies in per_thread for c in copies)
    check_path_counters(engine, transport, moved)
    assert engine.stats()["batches"] == threads * batches_per_thread
    connect(engine, target, transport)


@pytest.mark.parametrize("kind", KINDS)
def test_unregister_while_peer_holds_old_descriptor(
    transport: str, kind: str, spawn_target: SpawnTarget, make_engine: MakeEngine, tmp_path: Path
) -> None:
    """After the target unregisters a region the initiator already used (on shm: mapped), READ and
    WRITE to it are refused per request and nothing lands; a region registered next works with
    its own contents even if it reuses the address."""
    size = 1 << 20
    target = spawn_target({"old": (kind, size, 80), "other": (kind, size, 81)})
    engine = make_engine(initiator_config(transport))
    connect(engine, target, transport)
    buf = local_region(engine, "bytearray", size, 82)
    old = target.regions["old"]
    R, W = TransferOp.READ, TransferOp.WRITE
    engine.transfer([TransferRequest(R, buf.addr(0), size, target.name, old.addr(0))]).wait(timeout_s=WAIT_S)
    assert_bytes_equal(buf.view(), pattern(80, size), "READ before unregister")

    target.unregister("old")
    buf.view()[:] = pattern(83, size)
    for op in (R, W):
        handle = engine.transfer([TransferRequest(op, buf.addr(0), 4096, target.name, old.addr(4096))])
        with pytest.raises(SegmentNotRegisteredError):
            handle.wait(timeout_s=WAIT_S)
    assert_bytes_equal(buf.view(), pattern(83, size), "initiator memory after refused READ")
    if kind != "alloc":  # plain memory outlives its registration; the refused WRITE must not be in it
        assert_bytes_equal(target.dump("old", tmp_path), pattern(80, size), "unregistered target memory")
    # The other region is untouched by all this.
    engine.transfer([TransferRequest(R, buf.addr(0), 4096, target.name, target.regions["other"].addr(0))]).wait(
        timeout_s=WAIT_S
    )
    assert_bytes_equal(buf.view()[:4096], pattern(81, size)[:4096], "READ of the other region")

    new = target.add("new", kind, size, 84)
    engine.transfer([TransferRequest(R, buf.addr(0), size, target.name, new.addr(0))]).wait(timeout_s=WAIT_S)
    assert_bytes_equal(
        buf.view(),
        pattern(84, size),
        f"READ of a new region (at {'the same' if new.address == old.address else 'another'} address)",
    )
    buf.view()[:] = pattern(85, size)
    engine.transfer([TransferRequest(W, buf.addr(0), size, target.name, new.addr(0))]).wait(timeout_s=WAIT_S)
    assert_bytes_equal(target.dump("new", tmp_path), pattern(85, size), "WRITE into the new region")
