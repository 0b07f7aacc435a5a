"""Segments and the clients that mount them: capacity, liveness, and placement of replicas.

A segment is a range of a client's registered memory (its transfer engine name + base address)
that the master allocates object replicas in. Placement puts the replicas of one object on
distinct segments: the writer's preferred segment first when it has room, then the segments
with the most free bytes. Neighbours: ``allocator`` (offsets inside one segment), ``objects``
(which replicas live where), ``master`` (drives both).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from tidekv.errors import ConfigError
from tidekv.store.allocator import OffsetAllocator, align

logger = logging.getLogger(__name__)

ADDRESS_LIMIT = 1 << 64
"""A segment must end within the 64-bit address space (every address a reply carries is a u64)."""


@dataclass(slots=True)
class Segment:
    name: str
    client_id: str
    engine: str
    base: int
    capacity: int
    allocator: OffsetAllocator

    @property
    def used(self) -> int:
        return self.allocator.used


@dataclass(slots=True)
class ClientInfo:
    client_id: str
    last_seen: float
    segments: set[str] = field(default_factory=set)


class SegmentTable:
    """All mounted segments and known clients. Single-threaded (the master's loop)."""

    def __init__(self) -> None:
        self.segments: dict[str, Segment] = {}
        self.clients: dict[str, ClientInfo] = {}
        self.capacity = 0
        self.used = 0

    # ---- clients ------------------------------------------------------------------------

    def touch(self, client_id: str, now: float) -> bool:
        """Records a sign of life; returns False when the client is unknown (never said hello)."""
        info = self.clients.get(client_id)
        if info is None:
            return False
        info.last_seen = now
        return True

    def add_client(self, client_id: str, now: float) -> None:
        info = self.clients.get(client_id)
        if info is None:
            self.clients[client_id] = ClientInfo(client_id, now)
        else:
            info.last_seen = now

    def dead_clients(self, now: float, ttl_s: float) -> list[str]:
        return [c.client_id for c in self.clients.values() if now - c.last_seen > ttl_s]

    def remove_client(self, client_id: str) -> list[str]:
        """Forgets a client; returns the names of the segments it had mounted (now unmounted)."""
        info = self.clients.pop(client_id, None)
        if info is None:
            return []
        names = sorted(info.segments)
        for name in names:
            self._drop(name)
        return names

    # ---- segments -----------------------------------------------------------------------

    def mount(self, client_id: str, name: str, engine: str, base: int, capacity: int) -> None:
        """Raises ConfigError for an unknown client, a bad size, or a name mounted by another client."""
        info = self.clients.get(client_id)
        if info is None:
            raise ConfigError(f"client {client_id!r} must say hello before mounting segment {name!r}")
        if capacity <= 0 or base <= 0:
            raise ConfigError(f"segment {name!r}: base and capacity must be > 0 (got {base:#x}, {capacity})")
        if base + capacity > ADDRESS_LIMIT:
            raise ConfigError(f"segment {name!r}: [{base:#x}, +{capacity}) reaches past the 64-bit address space")
        existing = self.segments.get(name)
        if existing is not None:
            if existing.client_id != client_id:
                raise ConfigError(f"segment {name!r} is already mounted by client {existing.client_id!r}")
            return  # re-mount of the same segment: keep its allocations
        self.segments[name] = Segment(name, client_id, engine, base, capacity, OffsetAllocator(capacity))
        info.segments.add(name)
        self.capacity += capacity
        logger.info("segment %s mounted by %s (engine %s, %d bytes)", name, client_id, engine, capacity)

    def restore(self, client_id: str, name: str, engine: str, base: int, capacity: int,
                used: list[tuple[int, int]], now: float) -> None:
        """Mounts a segment known from a journal, its ``used`` (offset, size) ranges allocated;
        its client counts as alive from ``now``."""
        self.add_client(client_id, now)
        allocator = OffsetAllocator.with_used(capacity, used)
        self.segments[name] = Segment(name, client_id, engine, base, capacity, allocator)
        self.clients[client_id].segments.add(name)
        self.capacity += capacity
        self.used += allocator.used

    def unmount(self, client_id: str, name: str) -> bool:
        seg = self.segments.get(name)
        if seg is None or seg.client_id != client_id:
            return False
        self.clients[client_id].segments.discard(name)
        self._drop(name)
        return True

    def _drop(self, name: str) -> None:
        seg = self.segments.pop(name)
        self.capacity -= seg.capacity
        self.used -= seg.used
        logger.info("segment %s unmounted (%d bytes were in use)", name, seg.used)

    # ---- placement ----------------------------------------------------------------------

    def allocate(self, size: int, replicas: int, preferred: str) -> list[tuple[str, int]]:
        """Places up to ``replicas`` copies of ``size`` bytes on distinct segments.

        Returns (segment name, offset) pairs: as many as fit (best effort), possibly none.
        """
        placed: list[tuple[str, int]] = []
        pref = self.segments.get(preferred) if preferred else None
        if pref is not None:
            offset = pref.allocator.allocate(size)
            if offset is not None:
                placed.append((pref.name, offset))
        if len(placed) < replicas:
            need = align(size)
            candidates = sorted(
                (s for s in self.segments.values() if s is not pref and s.allocator.largest_free() >= need),
                key=lambda s: s.allocator.free,
                reverse=True,
            )
            for seg in candidates:
                if len(placed) == replicas:
                    break
                offset = seg.allocator.allocate(size)
                if offset is not None:
                    placed.append((seg.name, offset))
        self.used += align(size) * len(placed)
        return placed

    def release(self, name: str, offset: int, size: int) -> None:
        """Frees a replica's bytes; a replica on an already dropped segment is simply forgotten."""
        seg = self.segments.get(name)
        if seg is None:
            return
        seg.allocator.release(offset, size)
        self.used -= align(size)

    def fits_anywhere(self, size: int) -> bool:
        need = align(size)
        return any(s.capacity >= need for s in self.segments.values())
