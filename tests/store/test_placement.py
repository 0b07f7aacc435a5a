"""Placement (``SegmentTable.allocate``) through its heap of hints: after any sequence of mounts,
unmounts, suspensions, resumes, puts and frees, each replica goes to an eligible segment with the
most free bytes, as a sort of every segment would pick, and its cost does not grow with the
number of segments."""

from __future__ import annotations

import random
import time

from tidekv.store.allocator import align
from tidekv.store.master.segments import SegmentTable

MIB = 1 << 20


def _most_free(table: SegmentTable, need: int, exclude: set[str], pool: set[str] | None,
               avoid: set[str]) -> int | None:
    """The most free bytes of any segment a replica of ``need`` bytes may go to, by brute force."""
    free = [s.allocator.free for s in table.segments.values()
            if s.name not in exclude and s.allocator.largest_free() >= need
            and (pool is None or s.tenant in pool) and s.engine not in avoid]
    return max(free, default=None)


def test_each_replica_goes_to_an_eligible_segment_with_the_most_free_bytes() -> None:
    rng = random.Random(5)
    table = SegmentTable()
    placed: list[tuple[str, int, int]] = []  # (segment, offset, size) of every live replica
    names = [f"seg{i}" for i in range(12)]
    for step in range(6000):
        mounted = list(table.segments)
        roll = rng.random()
        if roll < 0.04 or not mounted:  # mount one, or resume a suspended one
            name = rng.choice(names)
            if name in table.suspended:
                table.add_client(table.suspended[name].segment.client_id, 0.0)
                table.resume(table.suspended[name].segment.client_id, name)
            elif name not in table.segments:
                client = f"client-{name}"
                table.add_client(client, 0.0)
                table.mount(client, name, f"10.0.0.{names.index(name)}:1", 1 << 30, rng.choice([4, 8, 16]) * MIB,
                            incarnation="i" if rng.random() < 0.5 else "")
        elif roll < 0.06:  # a holder leaves: unmounted, or suspended (its replicas kept aside)
            name = rng.choice(mounted)
            client = table.segments[name].client_id
            suspended, dropped = table.suspend_client(client, until=1e9)
            gone = set(dropped)
            placed = [r for r in placed if r[0] not in gone]
            if rng.random() < 0.3:
                table.drop_suspended(suspended)
                placed = [r for r in placed if r[0] not in set(suspended)]
        elif roll < 0.45 and placed:  # a replica freed (on a mounted or a suspended segment)
            seg, offset, size = placed.pop(rng.randrange(len(placed)))
            table.release(seg, offset, size)
        else:  # a put: 1-3 replicas, sometimes a preferred segment, a tenant pool or engines to avoid
            size = rng.choice([4096, 60_000, 300_000, 1 * MIB])
            replicas = rng.choice([1, 1, 1, 2, 3])
            preferred = rng.choice(mounted) if rng.random() < 0.2 else ""
            avoid = {table.segments[rng.choice(mounted)].engine} if rng.random() < 0.1 else set()
            pool = {""} if rng.random() < 0.9 else {"nobody"}
            pref = table.segments.get(preferred)
            expect_first = preferred if pref is not None and pref.allocator.largest_free() >= align(size) \
                and pref.engine not in avoid and pool == {""} else None
            chosen: set[str] = set()
            before = {n: s.allocator.free for n, s in table.segments.items()}
            wanted = []
            for _ in range(replicas):  # what a sort of every segment gives, one replica after another
                if expect_first and not chosen:
                    wanted.append(None)
                    chosen.add(expect_first)
                    continue
                best = _most_free(table, align(size), chosen, pool, avoid)
                if best is None:
                    break
                wanted.append(best)
                chosen.add(next(n for n, s in table.segments.items()
                                if s.allocator.free == best and n not in chosen))
            got = table.allocate(size, replicas, preferred, pool=pool, avoid=avoid)
            assert len(got) == len(wanted), (step, got, wanted)
            assert len({seg for seg, _ in got}) == len(got), "replicas on distinct segments"
            for i, (seg, offset) in enumerate(got):
                if i == 0 and expect_first:
                    assert seg == preferred, step
                else:
                    assert before[seg] == wanted[i], (step, i, seg, before[seg], wanted[i])
                placed.append((seg, offset, size))
        assert table.used == sum(s.allocator.used for s in table.segments.values())


def test_a_put_costs_the_same_with_512_segments_as_with_4() -> None:
    def per_put(segments: int) -> float:
        table = SegmentTable()
        for i in range(segments):
            table.add_client(f"c{i}", 0.0)
            table.mount(f"c{i}", f"s{i}", f"10.0.{i // 256}.{i % 256}:1", 1 << 30, 1 << 36)
        started = time.perf_counter()
        for _ in range(20_000):
            table.allocate(4096, 1, "")
        return (time.perf_counter() - started) / 20_000

    few, many = min(per_put(4) for _ in range(3)), min(per_put(512) for _ in range(3))
    assert many < 4 * few, f"{many * 1e6:.1f} µs a put with 512 segments against {few * 1e6:.1f} µs with 4"
