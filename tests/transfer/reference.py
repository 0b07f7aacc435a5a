"""Pure-Python reference of what a batch must do, and the deterministic data it is checked with.

The engine under test copies bytes between registered memory of two processes; this module says,
without any native code, what both sides must hold afterwards. Neighbours: ``target_main`` fills
target memory with ``pattern``; the contract tests compare engine results against ``apply``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

READ = "READ"
WRITE = "WRITE"


def pattern(seed: int, size_bytes: int) -> bytes:
    """Deterministic pseudo-random bytes; both processes derive the same bytes from the seed."""
    return random.Random(seed).randbytes(size_bytes)


@dataclass(frozen=True)
class Copy:
    """One request of a batch in offsets: ``op`` moves ``length`` bytes between the two sides.

    ``local`` and ``remote`` name regions of the initiator and of the target; offsets are
    relative to the start of each region.
    """

    op: str
    local: str
    local_offset: int
    length: int
    remote: str
    remote_offset: int


def apply(copies: Sequence[Copy], local: dict[str, bytearray], remote: dict[str, bytearray]) -> None:
    """Applies a batch to the models of both sides, as the engine must.

    The batches the tests build never let one request read bytes another request of the same
    batch writes, so request order within a batch does not matter and is not modelled.
    """
    for c in copies:
        lo, ro, n = c.local_offset, c.remote_offset, c.length
        if c.op == READ:
            local[c.local][lo : lo + n] = remote[c.remote][ro : ro + n]
        else:
            remote[c.remote][ro : ro + n] = local[c.local][lo : lo + n]


def random_lengths(rng: random.Random, count: int, max_bytes: int) -> list[int]:
    """Lengths spread log-uniformly over 1..max_bytes, so tiny, slice-sized and large all occur."""
    out = []
    for _ in range(count):
        exponent = rng.uniform(0, max_bytes.bit_length() - 1)
        out.append(max(1, min(max_bytes, int(2**exponent) + rng.randrange(64))))
    return out


def place_disjoint(rng: random.Random, lengths: Sequence[int], space_bytes: int) -> list[int]:
    """Random non-overlapping offsets (in a random order) for ranges of ``lengths`` in a space.

    Raises:
        ValueError: the lengths do not fit in the space.
    """
    free = space_bytes - sum(lengths)
    if free < 0:
        raise ValueError(f"{sum(lengths)} bytes of ranges do not fit in {space_bytes} bytes")
    order = list(range(len(lengths)))
    rng.shuffle(order)
    cuts = sorted(rng.randrange(free + 1) for _ in lengths)
    offsets = [0] * len(lengths)
    cursor = 0
    previous_cut = 0
    for slot, index in enumerate(order):
        cursor += cuts[slot] - previous_cut
        previous_cut = cuts[slot]
        offsets[index] = cursor
        cursor += lengths[index]
    return offsets


def first_difference(actual: bytes | bytearray | memoryview, expected: bytes | bytearray) -> str | None:
    """None when equal; else a short description of the first differing byte (not a huge diff)."""
    actual = bytes(actual)
    if actual == expected:
        return None
    if len(actual) != len(expected):
        return f"length {len(actual)} != expected {len(expected)}"
    index = next(i for i, (a, b) in enumerate(zip(actual, expected, strict=True)) if a != b)
    wrong = sum(1 for a, b in zip(actual, expected, strict=True) if a != b)
    window = slice(index, index + 16)
    return (
        f"{wrong} bytes differ; first at offset {index}: got {actual[window].hex()} expected {expected[window].hex()}"
    )
