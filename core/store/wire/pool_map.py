"""Which master group of a pool owns a key: every client of a pool computes the same answer.

A key falls in one of ``SLOTS`` slots by a stable hash of its bytes (CRC-32: in C, about 0.2 µs
a key, and the same in every process and Python version); each slot belongs to the group that
rendezvous hashing of the slot over the groups' names ranks first. Adding a group to n moves
about 1/(n+1) of the slots, each to the new group, and no other slot. A pool of one group maps
every key to it without hashing. Design notes: docs/design-sharding.md
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Sequence

SLOTS = 4096
"""Slots of the key space (a power of two: a slot is the hash's low bits)."""


def slot_of(key: bytes) -> int:
    """The slot ``key`` falls in."""
    return zlib.crc32(key) & (SLOTS - 1)


def _score(group: str, slot: int) -> bytes:
    return hashlib.blake2b(f"{group}/{slot}".encode(), digest_size=8).digest()


class PoolMap:
    """Slot -> group for a pool of groups named ``names`` (order does not matter: the map is the
    same for the same set of names)."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = tuple(names)
        n = len(self.names)
        self._owner = [0] * SLOTS if n == 1 else [
            max(range(n), key=lambda g: _score(self.names[g], slot)) for slot in range(SLOTS)]

    def group_of(self, key: bytes) -> int:
        """Index (into ``names``) of the group that owns ``key``."""
        return 0 if len(self.names) == 1 else self._owner[zlib.crc32(key) & (SLOTS - 1)]

    def split(self, keys: Sequence[bytes]) -> list[tuple[int, list[int]]]:
        """The batch ``keys`` by group: (group index, positions of its keys in ``keys``), for
        each group that owns at least one, positions ascending."""
        if len(self.names) == 1:
            return [(0, list(range(len(keys))))]
        owner, out = self._owner, [[] for _ in self.names]  # type: list[int], list[list[int]]
        crc = zlib.crc32
        for i, key in enumerate(keys):
            out[owner[crc(key) & (SLOTS - 1)]].append(i)
        return [(g, positions) for g, positions in enumerate(out) if positions]

    def slots_of(self, group: int) -> int:
        """How many slots ``group`` owns."""
        return sum(1 for g in self._owner if g == group) if len(self.names) > 1 else SLOTS
