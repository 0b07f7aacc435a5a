"""What the master exports about its index: gauges read from the segment and object tables at
each scrape (keys, pending puts, clients, segment bytes, eviction, loss, suspension, repairs,
the disk tier).
Nothing else. The request counters and timings live with the request path (``master``).
"""

from __future__ import annotations

from collections.abc import Callable

from tidekv.metrics import Registry
from tidekv.store.master.objects import ObjectTable
from tidekv.store.master.segments import SegmentTable


def index_gauges(metrics: Registry, segments: SegmentTable, objects: ObjectTable,
                 complete_keys: Callable[[], int]) -> None:
    """Registers the index's gauges on ``metrics`` (``complete_keys``: objects readable now)."""
    metrics.gauge("tidekv_keys", "complete objects", lambda: {(): complete_keys()})
    metrics.gauge("tidekv_pending_puts", "puts started but not ended",
                  lambda: {(): len(objects.pending) - len(objects.live_spares())})
    metrics.gauge("tidekv_spares", "slots reserved for clients' next small puts (store.wire.protocol.Spare)",
                  lambda: {(): len(objects.live_spares())})
    metrics.gauge("tidekv_clients", "live clients", lambda: {(): len(segments.clients)})
    metrics.gauge(
        "tidekv_segment_used_bytes",
        "bytes allocated per segment",
        lambda: {(("segment", s.name),): s.used for s in segments.segments.values()},
    )
    metrics.gauge(
        "tidekv_segment_capacity_bytes",
        "capacity per segment",
        lambda: {(("segment", s.name),): s.capacity for s in segments.segments.values()},
    )
    c = objects.counters
    metrics.gauge("tidekv_evictions_total", "objects evicted", lambda: {(): c.evictions}, kind="counter")
    metrics.gauge("tidekv_evicted_bytes_total", "bytes of objects evicted", lambda: {(): c.evicted_bytes},
                  kind="counter")
    metrics.gauge("tidekv_puts_reclaimed_total", "unfinished puts reclaimed", lambda: {(): c.puts_reclaimed},
                  kind="counter")
    metrics.gauge("tidekv_objects_lost_total", "objects lost with their last replica",
                  lambda: {(): c.objects_lost}, kind="counter")
    metrics.gauge("tidekv_suspended_segments", "segments of clients declared dead, kept for their return",
                  lambda: {(): len(segments.suspended)})
    metrics.gauge("tidekv_suspended_keys", "objects unreadable until their holder returns",
                  lambda: {(): len(objects.suspended)})
    rc = objects.repairs.counters
    for name, what in (("started", "repairs handed to holders (copies of objects that lost replicas)"),
                       ("done", "repairs whose copy became a replica"),
                       ("failed", "repairs that failed or missed their deadline (retried)"),
                       ("stale", "repairs of objects removed or replaced meanwhile")):
        metrics.gauge(f"tidekv_repairs_{name}_total", what, lambda n=name: {(): getattr(rc, n)}, kind="counter")
    metrics.gauge("tidekv_repairs_under_way", "repairs handed out and not yet reported",
                  lambda: {(): len(objects.repairs.under_way)})
    metrics.gauge("tidekv_objects_restored_total", "objects given back to a holder that returned",
                  lambda: {(): c.objects_restored}, kind="counter")
    metrics.gauge("tidekv_replicas_trimmed_total",
                  "replicas freed on a returning holder's segment: copies elsewhere had replaced them",
                  lambda: {(): c.replicas_trimmed}, kind="counter")
    metrics.gauge("tidekv_objects_superseded_total",
                  "objects on a suspended segment replaced or removed before their holder returned",
                  lambda: {(): c.objects_superseded}, kind="counter")
    metrics.gauge("tidekv_suspended_objects_dropped_total",
                  "objects dropped because their holder did not return within suspend_grace_s",
                  lambda: {(): c.suspended_lost}, kind="counter")
    disks = objects.disks
    metrics.gauge("tidekv_disk_keys", "objects with a copy on a holder's disk (the disk tier)",
                  lambda: {(): len(disks.entries)})
    metrics.gauge("tidekv_disk_used_bytes", "bytes of records (and spills under way) per disk",
                  lambda: {(("disk", d.name),): d.used for d in disks.disks.values()})
    metrics.gauge("tidekv_disk_capacity_bytes", "capacity per disk",
                  lambda: {(("disk", d.name),): d.capacity for d in disks.disks.values()})
    metrics.gauge("tidekv_disk_online", "1 while a disk's holder is alive, 0 while it is offline",
                  lambda: {(("disk", d.name),): int(d.online) for d in disks.disks.values()})
    dc = disks.counters
    for name, what in (("spills", "objects written to a holder's disk and indexed"),
                       ("spilled_bytes", "bytes of objects written to holders' disks"),
                       ("spill_failures", "spills reported failed or past their deadline (queued again)"),
                       ("spills_dropped", "objects evicted from memory before their holder could spill them"),
                       ("kept_on_disk", "objects evicted from memory that stayed in the pool, on disk"),
                       ("disk_evictions", "records evicted from a full disk"),
                       ("disk_hits", "gets answered from a holder's disk"),
                       ("promotions", "disk hits handed to their holders to bring back to memory"),
                       ("stale_records", "records a holder reported that the master no longer wanted (freed)")):
        metrics.gauge(f"tidekv_disk_{name.removeprefix('disk_')}_total", what, lambda n=name: {(): getattr(dc, n)},
                      kind="counter")
