"""The doctor's self-test: a few MiB between two processes over each available transport, byte-checked.

For each transport the catalog calls available, a target engine starts in a child process
(``tidekv.helper_process.HelperProcess``) with the transport forced, and fills its regions with a
random pattern. This process's engine, forced the same way, then reads that pattern (compared
byte for byte), writes another one (the target compares its memory's sha256) and reads it back
(compared byte for byte). The shm transport is checked twice: on memory from ``allocate()``,
which the peer maps, and on plain registered memory, which it reaches by cross-memory attach —
the second only where ``transports.cross_memory_attach`` says it is usable. Every step is bounded
by a timeout; a failure carries the target's log. Neighbours: ``report`` (which calls this),
``tidekv.transfer.transports`` (the catalog).
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import logging
import random
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from tidekv.config import TransferConfig, TransportKind
from tidekv.errors import TidekvError
from tidekv.helper_process import HelperProcess, send_ready, serve
from tidekv.transfer import transports
from tidekv.transfer.batch import TransferOp, TransferRequest
from tidekv.transfer.engine import TransferEngine
from tidekv.transfer.region import Region
from tidekv.transfer.transports import TransportStatus

logger = logging.getLogger(__name__)

DEFAULT_SIZE_BYTES = 4 << 20
READ_PIECE_BYTES = 64 << 10
"""Reads are a scatter batch of pieces this size; the write is one request (cut into slices)."""

Progress = Callable[[str], None]


class TargetMemory(enum.Enum):
    """What kind of registered memory the target offers."""

    ALLOCATED = "allocated"  #: from allocate(): a memfd that a same-host peer maps
    REGISTERED = "registered"  #: a registered bytearray: a same-host peer needs cross-memory attach


class SelfTestState(enum.Enum):
    """Outcome of one self-test."""

    PASSED = "passed"
    FAILED = "failed"
    SKIPPED = "skipped"  #: not runnable here; the detail says why (not a failure)


@dataclass(frozen=True, slots=True)
class SelfTestResult:
    """One transport over one kind of target memory."""

    transport: str
    memory: TargetMemory
    state: SelfTestState
    size_bytes: int
    is_byte_checked: bool
    """True when every byte read and written was compared and matched."""
    write_mib_s: float | None = None
    read_mib_s: float | None = None
    detail: str = ""
    """Why it failed (with the target's log) or was skipped; empty when it passed."""


def run_selftests(statuses: Sequence[TransportStatus], config: TransferConfig, *, timeout_s: float,
                  size_bytes: int = DEFAULT_SIZE_BYTES, progress: Progress | None = None) -> list[SelfTestResult]:
    """Self-tests every available transport of ``statuses`` with ``config`` (transport forced per test).

    Args:
        statuses: the catalog; unavailable transports are not tested.
        config: both engines' settings (e.g. the secret, cross-memory attach).
        timeout_s: bound on each step: starting the target, each batch, each call to it.
        size_bytes: bytes moved each way per test.
        progress: called with one line per step.

    Returns:
        Results in catalog order; an available transport that has no TransportKind to force it
        with is reported FAILED (the catalog promises what no engine can be asked for).
    """
    say = progress or (lambda line: None)
    results: list[SelfTestResult] = []
    with tempfile.TemporaryDirectory(prefix="tidekv-doctor-") as log_dir:
        for status in statuses:
            if not status.available:
                continue
            try:
                kind = TransportKind(status.name)
            except ValueError:
                results.append(SelfTestResult(status.name, TargetMemory.ALLOCATED, SelfTestState.FAILED, size_bytes,
                                              False, detail=f"no TransferConfig.transport value selects "
                                              f"{status.name!r}; allowed {[k.value for k in TransportKind]}"))
                continue
            if kind is TransportKind.CUDA:
                results.append(SelfTestResult(status.name, TargetMemory.ALLOCATED, SelfTestState.SKIPPED, size_bytes,
                                              False, detail="the self-test moves host memory, which cuda does not "
                                              "carry; integration/gpu_check.sh checks GPU memory end to end"))
                continue
            memories = [TargetMemory.ALLOCATED]
            skipped: list[SelfTestResult] = []
            if kind is TransportKind.SHM:
                usable, why = transports.cross_memory_attach(config)
                if usable:
                    memories.append(TargetMemory.REGISTERED)
                else:
                    skipped.append(SelfTestResult(status.name, TargetMemory.REGISTERED, SelfTestState.SKIPPED,
                                                  size_bytes, False, detail=why))
            say(f"self-test {status.name}: starting a target process")
            results += _test_transport(kind, memories, dataclasses.replace(config, transport=kind),
                                       size_bytes, timeout_s, log_dir, say)
            results += skipped
    return results


def _test_transport(kind: TransportKind, memories: list[TargetMemory], config: TransferConfig, size_bytes: int,
                    timeout_s: float, log_dir: str, say: Progress) -> list[SelfTestResult]:
    seed = random.getrandbits(32)
    try:
        target = HelperProcess(f"doctor-{kind.value}", _target_main,
                               (config, [m.value for m in memories], size_bytes, seed), log_dir, ready_timeout_s=timeout_s)
    except TidekvError as exc:
        return [_failed(kind, m, size_bytes, f"the target process did not start: {exc}") for m in memories]
    results: list[SelfTestResult] = []
    try:
        with target, TransferEngine(config=config) as engine:
            peer, addresses = target.hello
            via = engine.connect(peer)
            if via != kind.value:
                raise TidekvError(f"engine {engine.name} reaches target {peer} via {via}, not {kind.value}")
            local = engine.allocate(size_bytes)
            for index, memory in enumerate(memories):
                say(f"self-test {kind.value}: {memory.value} memory, {size_bytes >> 20} MiB each way")
                try:
                    results.append(_check(engine, target, peer, local, addresses[memory.value], memory, kind,
                                          seed + index, timeout_s))
                except TidekvError as exc:
                    results.append(_failed(kind, memory, size_bytes, _with_log(str(exc), target)))
    except TidekvError as exc:  # no check could run: every memory fails with the same reason
        results += [_failed(kind, m, size_bytes, _with_log(str(exc), target)) for m in memories[len(results):]]
    return results


def _with_log(what: str, target: HelperProcess) -> str:
    log = target.log_tail()
    return f"{what}\n--- target log ---\n{log}" if log and log not in what else what


def _check(engine: TransferEngine, target: HelperProcess, peer: str, local: Region, remote_addr: int,
           memory: TargetMemory, kind: TransportKind, seed: int, timeout_s: float) -> SelfTestResult:
    size = local.length
    theirs, ours = _pattern(seed, size), _pattern(seed ^ 0x5EED, size)

    def move(op: TransferOp, piece: int) -> float:
        requests = [TransferRequest(op, local.address + off, min(piece, size - off), peer, remote_addr + off)
                    for off in range(0, size, piece)]
        start = time.perf_counter()
        engine.transfer(requests).wait(timeout_s)
        return time.perf_counter() - start

    def failed(what: str) -> SelfTestResult:
        return _failed(kind, memory, size, _with_log(what, target))

    read_s = move(TransferOp.READ, READ_PIECE_BYTES)
    offset = _first_difference(local.view(), theirs)
    if offset is not None:
        return failed(f"READ of the target's {memory.value} memory returned other bytes (first at offset {offset})")
    local.view()[:] = ours
    write_s = move(TransferOp.WRITE, size)
    if target.call(memory.value, timeout_s) != hashlib.sha256(ours).hexdigest():
        return failed(f"after a WRITE the target's {memory.value} memory does not hold the bytes written (sha256)")
    local.view()[:] = bytes(size)
    move(TransferOp.READ, READ_PIECE_BYTES)
    offset = _first_difference(local.view(), ours)
    if offset is not None:
        return failed(f"reading back the WRITE returned other bytes (first at offset {offset})")
    return SelfTestResult(kind.value, memory, SelfTestState.PASSED, size, True,
                          write_mib_s=size / write_s / (1 << 20), read_mib_s=size / read_s / (1 << 20))


def _failed(kind: TransportKind, memory: TargetMemory, size_bytes: int, detail: str) -> SelfTestResult:
    return SelfTestResult(kind.value, memory, SelfTestState.FAILED, size_bytes, False, detail=detail)


def _pattern(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


def _first_difference(got: memoryview, expected: bytes) -> int | None:
    data = bytes(got)
    if data == expected:
        return None
    return next(i for i, (a, b) in enumerate(zip(data, expected, strict=True)) if a != b)


def _target_main(conn: Connection, config: TransferConfig, memories: list[str], size_bytes: int, seed: int) -> None:
    """The child: one engine, a region per kind of memory filled with its pattern; answers sha256 calls."""
    keep: list[bytearray] = []
    with TransferEngine(config=config) as engine:
        regions: dict[str, Region] = {}
        for index, memory in enumerate(memories):
            if memory == TargetMemory.ALLOCATED.value:
                regions[memory] = engine.allocate(size_bytes)
            else:
                keep.append(bytearray(size_bytes))
                regions[memory] = engine.register(keep[-1])
            regions[memory].view()[:] = _pattern(seed + index, size_bytes)
        send_ready(conn, (engine.name, {m: r.address for m, r in regions.items()}))

        def digest(memory: Any) -> str:
            return hashlib.sha256(regions[memory].view()).hexdigest()

        serve(conn, digest)
