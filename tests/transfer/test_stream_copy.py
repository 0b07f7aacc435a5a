"""Same-host batches copied with streaming (non-temporal) stores: the same bytes as memcpy.

A batch of at least ``stream_copy_bytes`` is copied around the caches (``native/common/copy.h``):
a memcpy for the destination's unaligned head, streaming stores for whole blocks, a memcpy for
the tail. These check that every byte lands and no byte beside a request moves, at odd offsets
and lengths, both ways, through the memfd path and the same-process path, and that the engine
says which batches streamed (``shm_streamed_bytes``). Neighbours: the contract suite
(``test_contract``) checks shm bytes at the default settings.
"""

from __future__ import annotations

import platform
import random

import pytest

from tests.conftest import MakeEngine, SpawnTarget
from tests.transfer.reference import first_difference, pattern
from tidekv import TransferConfig, TransferOp, TransferRequest

pytestmark = pytest.mark.timeout(90)

REGION = 4 << 20
WAIT_S = 30.0
# (offset in the local buffer, offset at the peer, length): unaligned both sides, lengths that
# are not a multiple of any block, one shorter than a block, one of a single byte.
ODD_COPIES = [(3, 5, 1_000_003), (1_048_613, 64, 300_001), (2_000_000, 1_999_999, 255), (3_000_001, 3_500_000, 1),
              (3_100_000, 7, 517), (3_200_064, 2_900_000, 262_144)]
# Where each range goes back to at the peer: disjoint, at other odd offsets.
WRITE_BACK = [1_100_001, 9, 2_500_003, 4_000_000, 3_000_000, 3_600_011]


def _check(actual: bytes, expected: bytes, what: str) -> None:
    where = first_difference(actual, expected)
    assert where is None, f"{what}: {where}"


def test_streamed_reads_and_writes_move_exactly_their_bytes(spawn_target: SpawnTarget, make_engine: MakeEngine) -> None:
    target = spawn_target({"mem": ("alloc", REGION, 7)})
    engine = make_engine(TransferConfig(stream_copy_bytes=4096))
    assert engine.connect(target.name) == "shm"
    local = engine.allocate(REGION)
    before = pattern(8, REGION)
    local.view()[:] = before
    remote = target.regions["mem"]
    reads = [TransferRequest(TransferOp.READ, local.addr(lo), n, target.name, remote.addr(ro)) for lo, ro, n in ODD_COPIES]
    engine.transfer(reads).wait(timeout_s=WAIT_S)
    expected = bytearray(before)
    theirs = pattern(7, REGION)
    for lo, ro, n in ODD_COPIES:
        expected[lo:lo + n] = theirs[ro:ro + n]
    _check(bytes(local.view()), bytes(expected), "local buffer after streamed READs")
    moved = sum(n for _, _, n in ODD_COPIES)
    assert engine.stats()["shm_streamed_bytes"] == moved

    # And back: each range to a different place at the peer, at other odd offsets.
    writes = [TransferRequest(TransferOp.WRITE, local.addr(lo), n, target.name, remote.addr(to))
              for (lo, _, n), to in zip(ODD_COPIES, WRITE_BACK, strict=True)]
    engine.transfer(writes).wait(timeout_s=WAIT_S)
    expected_remote = bytearray(theirs)
    for (lo, _, n), to in zip(ODD_COPIES, WRITE_BACK, strict=True):
        expected_remote[to:to + n] = expected[lo:lo + n]
    _check(target.read("mem", 0, REGION), bytes(expected_remote), "peer memory after streamed WRITEs")
    assert engine.stats()["shm_streamed_bytes"] == 2 * moved


def test_small_batches_and_zero_setting_do_not_stream(spawn_target: SpawnTarget, make_engine: MakeEngine) -> None:
    target = spawn_target({"mem": ("alloc", REGION, 3)})
    for setting, size, streams in [(1 << 20, (1 << 20) - 1, False), (1 << 20, 1 << 20, True), (0, REGION, False)]:
        engine = make_engine(TransferConfig(stream_copy_bytes=setting))
        local = engine.allocate(REGION)
        engine.transfer([TransferRequest(TransferOp.READ, local.addr(0), size, target.name,
                                         target.regions["mem"].addr(0))]).wait(timeout_s=WAIT_S)
        _check(bytes(local.view()[:size]), pattern(3, REGION)[:size], f"READ of {size} bytes")
        assert engine.stats()["shm_bytes"] == size
        assert engine.stats()["shm_streamed_bytes"] == (size if streams else 0), (setting, size)


def test_same_process_peer_streams_at_its_own_addresses(make_engine: MakeEngine) -> None:
    """An engine reaching another engine of its own process (a store client and its own segment)."""
    holder = make_engine(TransferConfig())
    client = make_engine(TransferConfig(stream_copy_bytes=4096))
    segment = holder.register(bytearray(pattern(5, REGION)))
    local = client.register(bytearray(REGION))
    rng = random.Random(1)
    copies = []
    for _ in range(24):  # disjoint local ranges: each request its own slot of the buffer
        n = rng.randrange(1, 150_000)
        copies.append((len(copies) * 170_000 + rng.randrange(0, 64), rng.randrange(0, REGION - n), n))
    client.transfer([TransferRequest(TransferOp.READ, local.addr(lo), n, holder.name, segment.addr(ro))
                     for lo, ro, n in copies]).wait(timeout_s=WAIT_S)
    expected = bytearray(REGION)
    theirs = pattern(5, REGION)
    for lo, ro, n in copies:
        expected[lo:lo + n] = theirs[ro:ro + n]
    _check(bytes(local.view()), bytes(expected), "reads from an engine of this process")
    assert client.stats()["shm_streamed_bytes"] == sum(n for _, _, n in copies)


def test_stream_copy_setting_is_checked() -> None:
    from tidekv import ConfigError

    with pytest.raises(ConfigError, match="stream_copy_bytes"):
        TransferConfig(stream_copy_bytes=-1)


def test_doctor_says_how_same_host_batches_are_copied() -> None:
    from tidekv import _native
    from tidekv.transfer.transports import shm_status

    kind = _native.stream_copy_kind()
    if platform.machine() == "x86_64":
        with open("/proc/cpuinfo") as f:
            assert kind == ("avx2" if "avx2" in f.read().split() else "sse2"), kind
    else:
        assert kind == "none", kind
        return
    on = shm_status(TransferConfig(stream_copy_bytes=16 << 20))
    assert on.available and f"batches of 16 MiB or more with streaming {kind} stores" in on.reason, on.reason
    off = shm_status(TransferConfig(stream_copy_bytes=0))
    assert "streaming stores off: stream_copy_bytes=0" in off.reason, off.reason


@pytest.mark.parametrize("kind", ["avx2", "sse2", "memcpy"])
def test_each_copy_routine_moves_exactly_its_bytes(kind: str) -> None:
    """Each routine, also the one this CPU does not pick (SSE2 where AVX2 is there), at every
    destination alignment and at lengths around its block size, with guard bytes on both sides."""
    import ctypes

    from tidekv import _native

    size = 1 << 16
    src = ctypes.create_string_buffer(pattern(11, size), size)
    for offset in (0, 1, 31, 32, 63, 64, 65):
        for length in (0, 1, 127, 128, 129, 255, 256, 257, 4095, 4096, 12_345, size - 200):
            dst = ctypes.create_string_buffer(b"\xee" * (size + 256), size + 256)
            done = _native._stream_copy_with(kind, ctypes.addressof(dst) + 64 + offset,
                                             ctypes.addressof(src) + 7, length)
            if not done:  # only a routine this build or CPU cannot run may be missing
                assert kind == "avx2" or (kind == "sse2" and platform.machine() != "x86_64"), kind
                pytest.skip(f"no {kind} streaming copy on this {platform.machine()} CPU")
            expected = b"\xee" * (64 + offset) + src.raw[7:7 + length]
            expected += b"\xee" * (size + 256 - len(expected))
            _check(dst.raw, expected, f"{kind}, destination offset {offset}, {length} bytes")
