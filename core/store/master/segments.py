"""Segments and the clients that mount them: capacity, liveness, and placement of replicas.

A segment is a range of a client's registered memory (its transfer engine name + base address)
that the master allocates object replicas in. Placement puts the replicas of one object on
distinct segments: the writer's preferred segment first when it has room, then the segments
with the most free bytes, found through a heap of (free bytes, segment) hints rather than a sort
of every segment per put (a fleet mounts hundreds).

A holder whose heartbeats lapse does not lose its segments at once: a segment mounted with an
incarnation (the holder's secret for the life of its process) is *suspended*, kept aside with its
allocator (the bytes of its replicas stay reserved) but counted in no capacity and given no new
replica, until the same incarnation mounts it again or its grace ends. Neighbours: ``allocator``
(offsets inside one segment), ``objects`` (which replicas live where), ``master`` (drives both).
"""

from __future__ import annotations

import hmac
import itertools
import logging
from collections.abc import Container
from dataclasses import dataclass, field
from heapq import heapify, heappop, heappush

from tidekv.errors import ConfigError
from tidekv.store.allocator import OffsetAllocator, align
from tidekv.store.wire import names

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
    incarnation: str = ""  # the holder's secret (MountSegment.incarnation); "" = none, never suspended
    tenant: str = ""  # of its client (``tenants``): whose objects it may hold

    def __post_init__(self) -> None:
        self.tenant = names.tenant_of(self.client_id)

    @property
    def used(self) -> int:
        return self.allocator.used

    def overlaps(self, engine: str, base: int, capacity: int) -> bool:
        return engine == self.engine and base < self.base + self.capacity and self.base < base + capacity


@dataclass(slots=True)
class SuspendedSegment:
    """A lapsed holder's segment, kept aside until ``until`` (the master's clock). ``objects``:
    how many objects had a replica on it when it was suspended (or restored from a journal)."""

    segment: Segment
    until: float
    objects: int = 0

    def matches(self, client_id: str, engine: str, base: int, capacity: int, incarnation: str) -> bool:
        """Whether a mount is its holder coming back: the same client, engine and range, and the
        same incarnation secret (a new process of the holder has another)."""
        seg = self.segment
        same_memory = (seg.client_id, seg.engine, seg.base, seg.capacity) == (client_id, engine, base, capacity)
        return same_memory and bool(incarnation) and hmac.compare_digest(seg.incarnation.encode(), incarnation.encode())


@dataclass(slots=True)
class ClientInfo:
    client_id: str
    last_seen: float
    segments: set[str] = field(default_factory=set)


class SegmentTable:
    """All mounted segments and known clients, and the suspended segments of lapsed ones.
    ``capacity`` and ``used`` count mounted segments only. Single-threaded (the master's loop)."""

    def __init__(self) -> None:
        self.segments: dict[str, Segment] = {}
        self.suspended: dict[str, SuspendedSegment] = {}
        self.clients: dict[str, ClientInfo] = {}
        self.capacity = 0
        self.used = 0
        # Placement hints, most free first: (-free bytes, order, name). An entry is current while
        # its segment is mounted with that many free bytes; every change of a mounted segment's
        # free bytes pushes a new one, and stale ones are dropped as they surface.
        self._by_free: list[tuple[int, int, str]] = []
        self._order = itertools.count()

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

    def suspend_client(self, client_id: str, until: float) -> tuple[list[str], list[str]]:
        """Forgets a client whose heartbeats lapsed: its segments with an incarnation are
        suspended until ``until``, the others unmounted. Returns (suspended, unmounted) names."""
        info = self.clients.pop(client_id, None)
        if info is None:
            return [], []
        kept, dropped = [], []
        for name in sorted(info.segments):
            seg = self.segments[name]
            if not seg.incarnation:
                self._drop(name)
                dropped.append(name)
                continue
            del self.segments[name]
            self.capacity -= seg.capacity
            self.used -= seg.used
            self.suspended[name] = SuspendedSegment(seg, until)
            kept.append(name)
        return kept, dropped

    def resume(self, client_id: str, name: str) -> None:
        """Mounts the suspended segment ``name`` again for its client (who said hello), its
        allocations as they were."""
        seg = self.suspended.pop(name).segment
        assert seg.client_id == client_id and name not in self.segments
        self.segments[name] = seg
        self.clients[client_id].segments.add(name)
        self.capacity += seg.capacity
        self.used += seg.used
        self._rank(seg)
        logger.info("segment %s resumed by %s (engine %s, %d bytes in use)", name, client_id, seg.engine, seg.used)

    def drop_suspended(self, names: list[str]) -> None:
        for name in names:
            seg = self.suspended.pop(name).segment
            logger.info("suspended segment %s dropped (%d bytes were in use)", name, seg.used)

    def expired_suspensions(self, now: float) -> list[str]:
        return [name for name, s in self.suspended.items() if s.until <= now]

    def suspended_of(self, client_id: str) -> list[str]:
        return [name for name, s in self.suspended.items() if s.segment.client_id == client_id]

    def suspended_overlapping(self, engine: str, base: int, capacity: int, besides: str) -> list[str]:
        """Suspended segments (other than ``besides``) whose memory a new mount on ``engine``
        covers: their holder is gone (an engine address names one process; one process mounts
        a range once), and so are the bytes they held."""
        return [name for name, s in self.suspended.items()
                if name != besides and s.segment.overlaps(engine, base, capacity)]

    # ---- segments -----------------------------------------------------------------------

    def check_mount(self, client_id: str, name: str, base: int, capacity: int) -> None:
        """Raises ConfigError for an unknown client, a bad size, or a name another client holds
        (mounted or suspended)."""
        if client_id not in self.clients:
            raise ConfigError(f"client {client_id!r} must say hello before mounting segment {name!r}")
        if capacity <= 0 or base <= 0:
            raise ConfigError(f"segment {name!r}: base and capacity must be > 0 (got {base:#x}, {capacity})")
        if base + capacity > ADDRESS_LIMIT:
            raise ConfigError(f"segment {name!r}: [{base:#x}, +{capacity}) reaches past the 64-bit address space")
        existing = self.segments.get(name)
        if existing is not None and existing.client_id != client_id:
            raise ConfigError(f"segment {name!r} is already mounted by client {existing.client_id!r}")
        held = self.suspended.get(name)
        if held is not None and held.segment.client_id != client_id:
            raise ConfigError(f"segment {name!r} is held suspended for client {held.segment.client_id!r}")

    def check_memory(self, client_id: str, name: str, engine: str, base: int, capacity: int) -> None:
        """Raises ConfigError when the memory of a mount is part of a segment another client
        has mounted: one engine's range is one holder's (writers would overwrite its objects)."""
        for seg in self.segments.values():
            if seg.name != name and seg.client_id != client_id and seg.overlaps(engine, base, capacity):
                raise ConfigError(f"segment {names.plain(name)!r}: "
                                  f"[{base:#x}, +{capacity}) of engine {engine} overlaps a segment another client "
                                  "has mounted; a range of memory belongs to one holder")

    def mount(self, client_id: str, name: str, engine: str, base: int, capacity: int, incarnation: str = "") -> bool:
        """Mounts a segment (a re-mount of one this client has mounted keeps its allocations);
        returns whether it is new. Raises as ``check_mount``; the name must not be suspended."""
        self.check_mount(client_id, name, base, capacity)
        assert name not in self.suspended, "resume or drop a suspended segment before mounting its name"
        if name in self.segments:
            return False
        self.segments[name] = Segment(name, client_id, engine, base, capacity, OffsetAllocator(capacity), incarnation)
        self.clients[client_id].segments.add(name)
        self.capacity += capacity
        self._rank(self.segments[name])
        logger.info("segment %s mounted by %s (engine %s, %d bytes)", name, client_id, engine, capacity)
        return True

    def restore(self, client_id: str, name: str, engine: str, base: int, capacity: int,
                allocator: OffsetAllocator, now: float, incarnation: str = "",
                suspended_until: float | None = None) -> None:
        """Mounts a segment known from a journal, with its bytes in use already in ``allocator``;
        its client counts as alive from ``now``. With ``suspended_until``: a suspended segment
        instead (its client is not known)."""
        seg = Segment(name, client_id, engine, base, capacity, allocator, incarnation)
        if suspended_until is not None:
            self.suspended[name] = SuspendedSegment(seg, suspended_until)
            return
        self.add_client(client_id, now)
        self.segments[name] = seg
        self.clients[client_id].segments.add(name)
        self.capacity += capacity
        self.used += allocator.used
        self._rank(seg)

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

    def allocate(self, size: int, replicas: int, preferred: str, pool: Container[str] | None = None,
                 avoid: Container[str] | None = None) -> list[tuple[str, int]]:
        """Places up to ``replicas`` copies of ``size`` bytes on distinct segments; with ``pool``,
        only on segments of those tenants; never on segments of the engines in ``avoid``.

        Returns (segment name, offset) pairs: as many as fit (best effort), possibly none.
        """
        placed: list[tuple[str, int]] = []
        pref = self.segments.get(preferred) if preferred else None
        if pref is not None and ((pool is not None and pref.tenant not in pool) or (avoid and pref.engine in avoid)):
            pref = None
        if pref is not None:
            offset = pref.allocator.allocate(size)
            if offset is not None:
                placed.append((pref.name, offset))
                self._rank(pref)
        if len(placed) < replicas:
            need = align(size)
            heap, skipped = self._by_free, []
            while heap and len(placed) < replicas:
                entry = heappop(heap)
                seg = self.segments.get(entry[2])
                if seg is None or -entry[0] != seg.allocator.free:
                    continue  # stale: unmounted, or its free bytes changed since (a newer entry holds it)
                skipped.append(entry)  # current: it goes back, or a newer one does once it takes a replica
                if seg is pref or seg.allocator.largest_free() < need or (pool is not None and seg.tenant not in pool) \
                        or (avoid and seg.engine in avoid) or (placed and any(n == seg.name for n, _ in placed)):
                    continue
                offset = seg.allocator.allocate(size)
                if offset is not None:
                    placed.append((seg.name, offset))
                    skipped[-1] = (-seg.allocator.free, next(self._order), seg.name)
            for entry in skipped:
                heappush(heap, entry)
        self.used += align(size) * len(placed)
        return placed

    def _rank(self, seg: Segment) -> None:
        """Records ``seg``'s free bytes as a placement hint (a mounted segment's changed)."""
        heap = self._by_free
        heappush(heap, (-seg.allocator.free, next(self._order), seg.name))
        if len(heap) > 4 * len(self.segments) + 256:  # mostly stale: start over from the mounted segments
            self._by_free = [(-s.allocator.free, next(self._order), s.name) for s in self.segments.values()]
            heapify(self._by_free)

    def allocate_on(self, name: str, size: int) -> int | None:
        """One range of ``size`` bytes on the mounted segment ``name`` (no eviction); None when
        it has no room."""
        seg = self.segments[name]
        offset = seg.allocator.allocate(size)
        if offset is not None:
            self.used += align(size)
            self._rank(seg)
        return offset

    def release(self, name: str, offset: int, size: int) -> None:
        """Frees a replica's bytes (on a mounted or a suspended segment); a replica on an already
        dropped segment is simply forgotten."""
        seg = self.segments.get(name)
        if seg is None:
            held = self.suspended.get(name)
            if held is not None:
                held.segment.allocator.release(offset, size)
            return
        seg.allocator.release(offset, size)
        self.used -= align(size)
        self._rank(seg)

    def fits_anywhere(self, size: int, pool: Container[str] | None = None, avoid: Container[str] | None = None) -> bool:
        need = align(size)
        return any(s.capacity >= need for s in self.segments.values()
                   if (pool is None or s.tenant in pool) and not (avoid and s.engine in avoid))

    def pool_usage(self, pool: Container[str]) -> tuple[int, int]:
        """(used, capacity) of the mounted segments of the tenants in ``pool``."""
        used = capacity = 0
        for s in self.segments.values():
            if s.tenant in pool:
                used += s.used
                capacity += s.capacity
        return used, capacity
