"""The fuzzing kit the harnesses share: a byte reader for structured inputs, the tally of a run,
crash signatures, the random mutator that stands in for atheris under pytest, and the
``Harness`` interface.

A harness's ``one(data)`` raises when a property breaks; ``run_one`` turns that into a crash
*signature* (the exception type and the innermost tidekv function it came from), so that a long
run keeps going and reports every distinct one. ``KNOWN_BUGS`` lists the signatures of bugs
found and not fixed yet (each with a strict xfail in ``test_found``): a run reports them apart
from new ones. Neighbours: ``harnesses`` and ``engine_harnesses`` (the harnesses),
``benchmarks/fuzz.py`` (the atheris driver), ``test_harnesses`` (the pytest run).
"""

from __future__ import annotations

import collections
import os
import random
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

SECRET = "fuzz-secret"

KNOWN_BUGS: dict[str, str] = {}
"""Crash signatures of bugs found and not fixed yet (none now: the negative-seq OverflowError in
tidekv.auth -- whose sealing is gone, the test now sends hostile handshake values -- and the
lone-surrogate UnicodeEncodeError in contract.from_params are fixed, with regression tests in
test_found)."""


class Hang(Exception):
    """A peer neither answered nor closed within the harness's deadline."""


class Source:
    """Reads typed values off the front of an input; past its end every read gives zeros/empty."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.at = 0

    def byte(self) -> int:
        if self.at >= len(self.data):
            return 0
        self.at += 1
        return self.data[self.at - 1]

    def uint(self, size: int) -> int:
        return int.from_bytes(self.take(size).ljust(size, b"\0"), "little")

    def take(self, size: int) -> bytes:
        out = self.data[self.at: self.at + size]
        self.at += len(out)
        return out

    def rest(self) -> bytes:
        out = self.data[self.at:]
        self.at = len(self.data)
        return out

    def wide_int(self) -> int:
        """Any msgpack integer: -2**63 .. 2**64-1, small ones likelier."""
        kind = self.byte() % 4
        if kind == 0:
            return self.byte() - 128
        if kind == 1:
            return self.uint(8) - (1 << 63)
        if kind == 2:
            return self.uint(8)
        return -self.uint(2)


@dataclass
class Tally:
    inputs: int = 0
    crashes: dict[str, int] = field(default_factory=dict)
    examples: dict[str, str] = field(default_factory=dict)  # signature -> first input (hex) and traceback
    hangs: int = 0

    def new_crashes(self) -> dict[str, int]:
        return {s: n for s, n in self.crashes.items() if s not in KNOWN_BUGS}

    def as_dict(self) -> dict[str, Any]:
        return {"inputs": self.inputs, "crashes": self.crashes, "hangs": self.hangs, "examples": self.examples}


def signature(exc: BaseException) -> str:
    """``Type@file:function`` of the innermost frame in tidekv (else in the harness)."""
    frames = traceback.extract_tb(exc.__traceback__)
    inner = [f for f in frames if "/core/" in f.filename or "/tidekv/" in f.filename] or frames
    where = f"{os.path.basename(inner[-1].filename)}:{inner[-1].name}" if inner else "?"
    return f"{type(exc).__name__}@{where}"


def run_one(harness: Harness, tally: Tally, data: bytes) -> None:
    """One input; an exception becomes a crash (or a hang) in the tally, never propagates."""
    tally.inputs += 1
    try:
        harness.one(data)
    except Hang as exc:
        tally.hangs += 1
        tally.examples.setdefault("hang", f"{data.hex()}\n{exc}")
    except Exception as exc:  # noqa: BLE001 - every escape is what the run reports
        sig = signature(exc)
        tally.crashes[sig] = tally.crashes.get(sig, 0) + 1
        if sig not in tally.examples:
            tally.examples[sig] = f"{data[:4096].hex()}\n{''.join(traceback.format_exception(exc))[-3000:]}"


def mutations(seeds: list[bytes], count: int, seed: int = 0) -> Iterator[bytes]:
    """``count`` inputs: the seeds, then random mutations of them (flips, cuts, splices, random
    bytes) -- the pytest run's stand-in for atheris."""
    rng = random.Random(seed)
    yield from seeds[:count]
    for _ in range(count - len(seeds)):
        data = bytearray(rng.choice(seeds))
        for _ in range(rng.randrange(1, 5)):
            kind = rng.randrange(6)
            at = rng.randrange(len(data) + 1)
            if kind == 0 and data:
                data[min(at, len(data) - 1)] = rng.randrange(256)
            elif kind == 1:
                data[at:at] = rng.randbytes(rng.randrange(1, 16))
            elif kind == 2:
                del data[at: at + rng.randrange(1, 16)]
            elif kind == 3:
                data = data[:at]
            elif kind == 4:
                other = rng.choice(seeds)
                data[at:] = other[rng.randrange(len(other) + 1):]
            else:
                data = bytearray(data[:1] + rng.randbytes(rng.randrange(64)))
        yield bytes(data)


class Harness:
    name: ClassVar[str]
    is_native: ClassVar[bool] = False

    def setup(self) -> None:
        """Builds the servers the inputs go to (once per run)."""

    def one(self, data: bytes) -> None:
        raise NotImplementedError

    def seeds(self) -> list[bytes]:
        """Starting inputs (real messages) for the random mutator and atheris's corpus."""
        return [b""]

    _CHECK_EVERY: ClassVar[int] = 0
    """Live-server harnesses: check every this many inputs that the servers still serve (0: never)."""

    def _check_alive(self) -> None:
        """Raises unless the harness's servers still serve a well-behaved client."""

    def start_input(self, data: bytes) -> tuple[Source, int, str | None]:
        """Begins one input: counts it (checking the servers every ``_CHECK_EVERY``), and reads its
        first byte of flags, whose low bit says whether it goes to the secured server.
        Returns (the rest of the input, the flags, the secret or None)."""
        self._count = getattr(self, "_count", 0) + 1
        if self._CHECK_EVERY and self._count % self._CHECK_EVERY == 0:
            self._check_alive()
        src = Source(data)
        flags = src.byte()
        return src, flags, SECRET if flags & 1 else None

    def note(self, kind: str) -> None:
        """Counts one input as of ``kind`` (the report says what the inputs exercised)."""
        kinds = self.__dict__.setdefault("kinds", collections.Counter())
        kinds[kind] += 1

    def report(self) -> dict[str, Any]:
        """Harness-specific results: the inputs by kind (the native ones add stray writes)."""
        kinds = self.__dict__.get("kinds")
        return {"inputs_by_kind": dict(sorted(kinds.items()))} if kinds else {}

    def close(self) -> None:
        pass
