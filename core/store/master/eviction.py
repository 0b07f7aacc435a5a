"""Eviction policy: which objects go when space is needed. Nothing else.

Approximate LRU: the object table keeps its objects in access order (a get moves the key to the
end; ``shards``), so the oldest objects come first. Objects being written, read-leased, or
hard-pinned are never chosen; soft-pinned ones only when everything else evictable is not enough.
"""

from __future__ import annotations

from collections.abc import Iterable

from tidekv.store.wire.protocol import Pin


def select_victims(objects: Iterable[tuple[bytes, int, int, float, bool]], now: float,
                   bytes_needed: int) -> list[bytes]:
    """Keys to evict, oldest first, freeing at least ``bytes_needed`` if the evictable set allows.

    ``objects`` yields (key, size, pin, lease end, pending) in LRU order
    (``ObjectIndex.oldest``); the sizes counted are object sizes (one per replica is the
    caller's business).
    """
    victims: list[bytes] = []
    soft: list[tuple[bytes, int]] = []
    freed = 0
    for key, size, pin, lease_until, pending in objects:
        if pending or pin == Pin.HARD or lease_until > now:
            continue
        if pin == Pin.SOFT:
            soft.append((key, size))
            continue
        victims.append(key)
        freed += size
        if freed >= bytes_needed:
            return victims
    for key, size in soft:
        victims.append(key)
        freed += size
        if freed >= bytes_needed:
            break
    return victims
