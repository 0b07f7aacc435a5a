"""Prefix caches simulated over a FAST'25 trace: one global pool, or per-instance local caches
with requests dealt round robin or by the proxy's prefix rule.

The semantics are fixed so that results compare across tools and papers: requests in file
order; a request's hit is its longest run of leading ``hash_ids`` present in the cache, worth
``min(hit_blocks * 512, input_length)`` tokens; then every block of the request is touched in
order (present: becomes the most recent; absent: inserted as the most recent), evicting the
least recent blocks while more than ``capacity_tokens // 512`` are held (capacity 0 =
unbounded); the hit rate is the sum of hit tokens over the sum of ``input_length``. Each of N
local caches holds ``capacity_tokens // N`` tokens. LRU has the inclusion property (a bigger
cache always holds what a smaller one does), so the hit rate grows with capacity and
``capacity_for_fraction`` may bisect. No I/O here. Neighbours: ``format`` (the requests),
``analyze`` (the report).
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tidekv.trace.format import TRACE_BLOCK_TOKENS, TraceRequest

Progress = Callable[[int], None]
"""Called with a number of requests simulated since the last call."""
_PROGRESS_EVERY = 4096


class Routing(enum.Enum):
    """How requests are dealt to local caches."""

    ROUND_ROBIN = "round_robin"  #: take turns
    PREFIX = "prefix"  #: the instance holding the longest leading run; ties and misses take turns


class CacheKind(enum.Enum):
    GLOBAL = "global"  #: one pool shared by every instance
    LOCAL = "local"  #: one cache per instance


@dataclass(frozen=True, slots=True)
class CacheResult:
    """Hits of one cache configuration over a trace."""

    capacity_tokens: int
    """Total capacity (0 = unbounded); a local cache holds ``capacity_tokens // instances``."""
    instances: int
    kind: CacheKind
    routing: Routing | None
    """How requests were dealt to local caches; None for the global pool."""
    requests: int
    hit_tokens: int
    """Prompt tokens found in the cache: the prefill tokens saved."""
    input_tokens: int
    disk_capacity_tokens: int = 0
    """The pool's disk tier (``simulate_two_tier``); 0 = none."""
    disk_hit_tokens: int = 0
    """Of ``hit_tokens``, those found on the disk tier."""

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.input_tokens if self.input_tokens else 0.0


class BlockCache:
    """An LRU set of block ids holding at most ``capacity_blocks`` (None: unbounded)."""

    def __init__(self, capacity_blocks: int | None) -> None:
        self.capacity_blocks = capacity_blocks
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def leading_hits(self, hash_ids: Sequence[int]) -> int:
        """How many leading blocks of ``hash_ids`` are held."""
        n = 0
        for block in hash_ids:
            if block not in self.blocks:
                break
            n += 1
        return n

    def touch(self, hash_ids: Sequence[int]) -> None:
        """Makes every block of ``hash_ids`` the most recent, in order, evicting the least recent."""
        blocks = self.blocks
        for block in hash_ids:
            if block in blocks:
                blocks.move_to_end(block)
            else:
                blocks[block] = None
        if self.capacity_blocks is not None:
            # Evicting once at the end keeps the same blocks as evicting after each insertion:
            # the capacity_blocks most recent ones.
            while len(blocks) > self.capacity_blocks:
                blocks.popitem(last=False)


def capacity_blocks(capacity_tokens: int, caches: int = 1) -> int | None:
    """Blocks each of ``caches`` caches holds for a total of ``capacity_tokens`` (0: unbounded, None)."""
    if capacity_tokens == 0:
        return None
    return capacity_tokens // caches // TRACE_BLOCK_TOKENS


def simulate_global(requests: Sequence[TraceRequest], capacity_tokens: int, *, instances: int = 1,
                    progress: Progress | None = None) -> CacheResult:
    """One global pool of ``capacity_tokens`` (0: unbounded) over the trace; ``instances`` is only
    recorded (every instance sees the same pool)."""
    hit_tokens = _run_one(requests, capacity_blocks(capacity_tokens), progress)
    return CacheResult(capacity_tokens, instances, CacheKind.GLOBAL, None, len(requests), hit_tokens,
                       sum(r.input_length for r in requests))


def simulate_local(requests: Sequence[TraceRequest], capacity_tokens: int, instances: int, routing: Routing, *,
                   progress: Progress | None = None) -> CacheResult:
    """``instances`` local caches of ``capacity_tokens // instances`` each (0: unbounded), requests
    dealt by ``routing``. The prefix rule is the proxy's (``tidekv.proxy.routing.Router``): the
    instance holding the longest leading run of the request's blocks, the turn taken among those
    tied (or among all when none holds any); the turn advances only when there is a choice."""
    if instances < 1:
        raise ValueError(f"instances={instances} must be at least 1")
    caches = [BlockCache(capacity_blocks(capacity_tokens, instances)) for _ in range(instances)]
    turn = 0
    hit_tokens = 0
    everyone = list(range(instances))
    for index, request in enumerate(requests, 1):
        if routing is Routing.PREFIX and instances > 1:
            hits = [c.leading_hits(request.hash_ids) for c in caches]
            best = max(hits)
            candidates = [i for i, h in enumerate(hits) if h == best] if best else everyone
        else:
            candidates = everyone
        if len(candidates) == 1:
            choice = candidates[0]
        else:
            turn += 1
            choice = candidates[(turn - 1) % len(candidates)]
        cache = caches[choice]
        hit_tokens += min(cache.leading_hits(request.hash_ids) * TRACE_BLOCK_TOKENS, request.input_length)
        cache.touch(request.hash_ids)
        if progress is not None and index % _PROGRESS_EVERY == 0:
            progress(_PROGRESS_EVERY)
    if progress is not None:
        progress(len(requests) % _PROGRESS_EVERY)
    return CacheResult(capacity_tokens, instances, CacheKind.LOCAL, routing, len(requests), hit_tokens,
                       sum(r.input_length for r in requests))


def simulate_two_tier(requests: Sequence[TraceRequest], capacity_tokens: int, disk_tokens: int, *,
                      instances: int = 1, progress: Progress | None = None) -> CacheResult:
    """One global pool with a disk tier, as the store runs it (``store.master.disks``): memory is
    an LRU of ``capacity_tokens``; a block it evicts goes to the disk tier, an LRU of
    ``disk_tokens`` whose least recent blocks leave the pool; a hit is the longest leading run
    held on either tier; a block found on disk stays there (the store does not promote), others
    become the most recent in memory. Both capacities must be bounded."""
    if capacity_tokens <= 0 or disk_tokens <= 0:
        raise ValueError("a two-tier pool needs a bounded memory and disk capacity")
    memory: OrderedDict[int, None] = OrderedDict()
    disk: OrderedDict[int, None] = OrderedDict()
    limit, disk_limit = capacity_blocks(capacity_tokens), capacity_blocks(disk_tokens)
    assert limit is not None and disk_limit is not None
    hit_tokens = disk_hit_tokens = 0
    for index, request in enumerate(requests, 1):
        ids = request.hash_ids
        hits = on_disk = 0
        for block in ids:
            if block in memory:
                hits += 1
            elif block in disk:
                hits += 1
                on_disk += 1
            else:
                break
        tokens = min(hits * TRACE_BLOCK_TOKENS, request.input_length)
        hit_tokens += tokens
        # the run's last block may be cut by input_length: count disk tokens within the tokens hit
        disk_hit_tokens += min(on_disk * TRACE_BLOCK_TOKENS, tokens)
        for block in ids:
            if block in memory:
                memory.move_to_end(block)
            elif block in disk:
                disk.move_to_end(block)
            else:
                memory[block] = None
        while len(memory) > limit:
            disk[memory.popitem(last=False)[0]] = None
        while len(disk) > disk_limit:
            disk.popitem(last=False)
        if progress is not None and index % _PROGRESS_EVERY == 0:
            progress(_PROGRESS_EVERY)
    if progress is not None:
        progress(len(requests) % _PROGRESS_EVERY)
    return CacheResult(capacity_tokens, instances, CacheKind.GLOBAL, None, len(requests), hit_tokens,
                       sum(r.input_length for r in requests), disk_tokens, disk_hit_tokens)


def _run_one(requests: Sequence[TraceRequest], limit: int | None, progress: Progress | None) -> int:
    """Hit tokens of one LRU cache of ``limit`` blocks (None: unbounded): the hot loop, inlined."""
    blocks: OrderedDict[int, None] = OrderedDict()
    move, pop = blocks.move_to_end, blocks.popitem
    hit_tokens = 0
    for index, request in enumerate(requests, 1):
        ids = request.hash_ids
        hits = 0
        for block in ids:
            if block not in blocks:
                break
            hits += 1
        hit_tokens += min(hits * TRACE_BLOCK_TOKENS, request.input_length)
        for block in ids:
            if block in blocks:
                move(block)
            else:
                blocks[block] = None
        if limit is not None:
            while len(blocks) > limit:
                pop(last=False)
        if progress is not None and index % _PROGRESS_EVERY == 0:
            progress(_PROGRESS_EVERY)
    if progress is not None:
        progress(len(requests) % _PROGRESS_EVERY)
    return hit_tokens


def unique_blocks(requests: Sequence[TraceRequest]) -> int:
    """Distinct block ids in the trace: what an unbounded cache holds at the end."""
    return len({b for r in requests for b in r.hash_ids})


def capacity_for_fraction(requests: Sequence[TraceRequest], fraction: float,
                          progress: Progress | None = None) -> tuple[int, float]:
    """The smallest global capacity (a multiple of 512 tokens) whose hit rate reaches ``fraction``
    of the unbounded one, by bisection on blocks.

    Returns:
        (capacity in tokens, its hit rate). (0, 0.0) when the unbounded hit rate is 0.
    """
    total = sum(r.input_length for r in requests)
    if not total:
        return 0, 0.0
    unbounded_hits = _run_one(requests, None, progress)
    if unbounded_hits == 0:
        return 0, 0.0
    target = fraction * unbounded_hits
    low, high = 0, unique_blocks(requests)  # hits(high) == unbounded_hits >= target
    high_hits = unbounded_hits
    while low < high:
        mid = (low + high) // 2
        hits = _run_one(requests, mid, progress)
        if hits >= target:
            high, high_hits = mid, hits
        else:
            low = mid + 1
    return high * TRACE_BLOCK_TOKENS, high_hits / total


@dataclass(frozen=True, slots=True)
class WorkingSetPoint:
    """The working set of one time window."""

    start_s: float
    """The window's start, seconds from the trace's start."""
    window_tokens: int
    """Distinct blocks touched in the window, times 512."""
    footprint_tokens: int
    """Distinct blocks touched since the start (an unbounded cache's size) at the window's end, times 512."""


def working_set(requests: Sequence[TraceRequest], window_s: float) -> list[WorkingSetPoint]:
    """Distinct blocks touched per window of ``window_s`` seconds of trace time (requests in file
    order, windows by timestamp; an empty window is left out)."""
    if window_s <= 0:
        raise ValueError(f"window_s={window_s} must be positive")
    points: list[WorkingSetPoint] = []
    seen: set[int] = set()
    window: set[int] = set()
    current: int | None = None
    for request in requests:
        index = int(request.timestamp_ms / 1000.0 // window_s)
        if current is not None and index != current:
            points.append(WorkingSetPoint(current * window_s, len(window) * TRACE_BLOCK_TOKENS,
                                          len(seen) * TRACE_BLOCK_TOKENS))
            window = set()
        current = index
        window.update(request.hash_ids)
        seen.update(request.hash_ids)
    if current is not None:
        points.append(WorkingSetPoint(current * window_s, len(window) * TRACE_BLOCK_TOKENS,
                                      len(seen) * TRACE_BLOCK_TOKENS))
    return points
