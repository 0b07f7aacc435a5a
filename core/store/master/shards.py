"""``LruTable``: the object table's dict of key -> metadata, in least-recently-used order, in
hash shards. Nothing else.

Shards, because CPython rebuilds a whole dict now and then as keys come and go, with the
master's loop stopped; a shard's rebuild is 1/16 of the work. Keys go to shards by CRC-32, not
``hash()``, so a snapshot loaded by another process keeps each key's shard. Each shard is a dict
in its own recency order and every value carries a stamp of its last touch (``used``), so
``by_age()`` merges the shards into the exact global order, oldest first. Assigning an existing
key keeps its place (as a dict does); ``move_to_end`` and inserting a new key make it the
newest; ``load`` fills an empty table (a restore). Measurements and the designs tried:
docs/store-design.md, "The object table's shards".
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Iterator, MutableMapping
from itertools import chain
from typing import Generic, Protocol, TypeVar
from zlib import crc32


class Stamped(Protocol):
    used: int


K = TypeVar("K", bound=bytes)
V = TypeVar("V", bound=Stamped)

_MISSING = object()


class LruTable(MutableMapping[K, V], Generic[K, V]):
    """Iteration (``items``, ``values``, iter) goes shard by shard, each shard oldest first;
    ``by_age`` gives the LRU order. Mutating while iterating raises, as for a dict."""

    __slots__ = ("_shards", "_mask", "_clock")

    def __init__(self, shards: int = 16) -> None:
        if shards < 1 or shards & (shards - 1):
            raise ValueError(f"shards must be a power of two, got {shards}")
        self._shards: list[dict[K, V]] = [{} for _ in range(shards)]
        self._mask = shards - 1
        self._clock = 0

    def __getitem__(self, key: K) -> V:
        return self._shards[crc32(key) & self._mask][key]

    def get(self, key: K, default: V | None = None) -> V | None:  # type: ignore[override]
        return self._shards[crc32(key) & self._mask].get(key, default)

    def __contains__(self, key: object) -> bool:
        return key in self._shards[crc32(key) & self._mask]

    def __delitem__(self, key: K) -> None:
        del self._shards[crc32(key) & self._mask][key]

    def pop(self, key: K, default: object = _MISSING) -> V:  # type: ignore[override]
        shard = self._shards[crc32(key) & self._mask]
        if default is _MISSING:
            return shard.pop(key)
        return shard.pop(key, default)  # type: ignore[arg-type]

    def __len__(self) -> int:
        return sum(len(s) for s in self._shards)

    @property
    def shard_count(self) -> int:
        return len(self._shards)

    @property
    def dicts(self) -> list[dict[K, V]]:
        """The shards themselves (key ``k`` is in ``dicts[crc32(k) & (shard_count - 1)]``), for a
        loop over millions that inlines the lookup; change them only through this table."""
        return self._shards

    @property
    def clock(self) -> int:
        """The last stamp handed out."""
        return self._clock

    def __bool__(self) -> bool:
        return any(self._shards)

    # chain, not a generator: a million keys cost 0.25 s more through ``yield from``
    def __iter__(self) -> Iterator[K]:
        return chain.from_iterable(self._shards)

    def items(self) -> Iterator[tuple[K, V]]:  # type: ignore[override]
        return chain.from_iterable(shard.items() for shard in self._shards)

    def values(self) -> Iterator[V]:  # type: ignore[override]
        return chain.from_iterable(shard.values() for shard in self._shards)

    # How a value carries its stamp. A subclass storing values in another form (``index``: plain
    # objects packed into an int) overrides these two; what ``_restamp`` returns is what is stored.
    def _used(self, value: V) -> int:
        return value.used

    def _restamp(self, value: V, used: int) -> V:
        value.used = used
        return value

    def __setitem__(self, key: K, value: V) -> None:
        shard = self._shards[crc32(key) & self._mask]
        old = shard.get(key)
        if old is None:
            self._clock += 1
            used = self._clock
        else:
            used = self._used(old)  # keeps its place, as a dict's assignment does
        shard[key] = self._restamp(value, used)

    def load(self, pairs: list[tuple[K, V]]) -> None:
        """Fills an empty table from ``pairs`` (distinct keys) given oldest first: a restore of a
        million objects, so two passes over the list in its order (cache-friendly), no sort and
        no method call each. Each shard keeps their order; across shards a pair counts as old as
        its place within its shard (the k-th of n is k/n of the way from oldest to newest), which
        is where a key spread at random lands in the whole. A key's shard is the same in every
        process (its CRC), so a snapshot written shard by shard elsewhere loads shard by shard.
        (The object index restores from stamped ops instead, keeping the order exactly:
        ``ObjectIndex.load_ops``; this is its path for journals written before stamps.)"""
        assert not self, "load into an empty table"
        where, stamps = self._placements([key for key, _ in pairs])
        shards, restamp = self._shards, self._restamp
        for (key, value), i, used in zip(pairs, where, stamps):
            shards[i][key] = restamp(value, used)
        self._clock = len(pairs)

    def _placements(self, keys: list[K]) -> tuple[list[int], list[int]]:
        """Each key's shard and stamp for ``load`` (see there): two passes, no sort."""
        mask = self._mask
        where = [crc32(key) & mask for key in keys]  # once: a CRC is not cached as a hash() is
        counted = Counter(where)
        sizes = [counted[i] for i in range(mask + 1)]
        total = len(keys)
        places = [0] * (mask + 1)
        stamps = []
        for i in where:
            places[i] += 1
            stamps.append(places[i] * total // sizes[i])
        return where, stamps

    def move_to_end(self, key: K) -> V:
        """Makes ``key`` the most recently used; returns its value (KeyError if absent)."""
        shard = self._shards[crc32(key) & self._mask]
        value = shard.pop(key)
        self._clock += 1
        value = shard[key] = self._restamp(value, self._clock)
        return value

    def by_age(self) -> Iterator[tuple[K, V]]:
        """(key, value) pairs, least recently used first; lazy, for taking the oldest few (an
        eviction on a full pool's put path: its cost is one look at each shard's oldest)."""
        used = self._used
        runs = [iter(shard.items()) for shard in self._shards if shard]
        heads = []
        for i, run in enumerate(runs):
            key, value = next(run)
            heads.append((used(value), i, key, value))
        heapq.heapify(heads)
        while heads:
            _, i, key, value = heads[0]
            yield key, value
            following = next(runs[i], None)
            if following is None:
                heapq.heappop(heads)
            else:
                heapq.heapreplace(heads, (used(following[1]), i, following[0], following[1]))
