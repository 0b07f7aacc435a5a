"""A store client's membership in the pool: its segment, mounted and kept alive at the master. Nothing else.

A Store that contributes memory (``segment_size`` > 0) allocates its segment here and mounts it,
with a proof that the memory is its engine's (``mount_proof``). Every ``heartbeat_interval_s``
the member tells the master it is alive, which segments it holds, and how many of its reads
outlived their lease. When the master does not know it (restarted without its index, failed
over, or declared it dead after ``client_ttl_s``) it says hello again and re-mounts, quoting the
incarnation secret it mounted with: the master then gives back the objects its segment still
holds and says how many were superseded meanwhile (logged at WARNING). A holder also runs the
copies the master asks of it to bring objects back to their replica count (``repair_worker``).
Pure clients (no segment) heartbeat too, so the master keeps them as writers and readers.

Neighbours: ``client`` (Store, the data API, owns one Member), ``master_client`` (the RPCs).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time

from tidekv.config import StoreConfig
from tidekv.errors import ConfigError, TidekvError
from tidekv.store.client.master_client import MasterClient
from tidekv.store.client.repair_worker import RepairWorker
from tidekv.store.wire import mount_proof
from tidekv.store.wire import protocol as p
from tidekv.transfer.engine import TransferEngine
from tidekv.transfer.memory import huge_pages_shareable
from tidekv.transfer.region import Region

logger = logging.getLogger(__name__)

_SLOW_ALLOCATION_BYTES = 8 << 30
"""Segments from this size up say that they are being allocated (it takes seconds)."""
_SLOW_ALLOCATION_S = 1.0
"""An allocation that took this long says so (some VMs back long-unused memory again on first touch)."""


def _huge_segment(choice: str, engine: TransferEngine) -> bool:
    """Resolves StoreConfig.segment_memory to whether the segment is allocated on huge pages.

    Huge-page segments are read by cross-memory attach, so ``auto`` takes them only where the
    host allows it and this engine's config has not turned it off."""
    shareable = engine.config.enable_cross_memory_attach and huge_pages_shareable()
    if choice == "auto":
        return shareable
    if choice == "huge" and not shareable:
        logger.warning("segment_memory=huge: this host restricts cross-memory attach or has THP off, "
                       "or enable_cross_memory_attach is off; same-host peers may have to read the segment over tcp")
    return choice == "huge"


class Member:
    """Allocates the segment (if any) when made, before the master knows this client: faulting
    in a large segment can take longer than ``client_ttl_s``, and a client silent that long
    would be declared dead between its hello and its mount. Then ``mount`` it, ``start`` the
    heartbeat, ``stop`` it, and ``release`` the segment's memory when the engine outlives the
    store."""

    def __init__(self, rpc: MasterClient, engine: TransferEngine, client_id: str, config: StoreConfig) -> None:
        self._rpc = rpc
        self._engine = engine
        self._client_id = client_id
        self._interval_s = config.heartbeat_interval_s
        self.segment: Region | None = None
        self.segment_name = ""
        self.lease_expired = 0
        """Reads that outlived their lease since the last heartbeat (the Store counts them)."""
        # Proves to the master that a re-mount comes from this very process (a new one, with the
        # same engine address, must not get this one's objects back); never leaves this process
        # but in MountSegment.
        self._incarnation = secrets.token_hex(16)
        self._closed = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self._repairs: RepairWorker | None = None
        self.extra: dict[str, Region] = {}  # more segments (``mount_extra``): name -> its memory
        self._extra_count = 0
        self._lock = threading.Lock()
        if config.segment_size_bytes > 0:
            gib = config.segment_size_bytes / (1 << 30)
            if config.segment_size_bytes >= _SLOW_ALLOCATION_BYTES:
                logger.info("allocating a segment of %.1f GiB (faulting it in now, not inside the first transfers)", gib)
            started = time.monotonic()
            self.segment = engine.allocate(config.segment_size_bytes, huge=_huge_segment(config.segment_memory, engine))
            elapsed_s = time.monotonic() - started
            if elapsed_s >= _SLOW_ALLOCATION_S:
                logger.info("faulting in the %.1f GiB segment took %.1f s", gib, elapsed_s)
            self.segment_name = f"{engine.name}/{client_id}"

    def mount(self) -> None:
        """Mounts the segment at the master (after hello); nothing for a pure client."""
        if self.segment is not None:
            self._mount()

    def start(self) -> None:
        """Starts heartbeating and, on a holder, taking repairs."""
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, name=f"tidekv-heartbeat-{self._client_id}",
                                           daemon=True)
        self._heartbeat.start()
        if self.segment is not None:
            self._repairs = RepairWorker(self._rpc, self._engine, self._client_id, self._interval_s, self._closed)
            self._repairs.start()

    def stop(self) -> None:
        """Stops both threads (waits up to 5 s for each)."""
        self._closed.set()
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=5)
        if self._repairs is not None:
            self._repairs.join(timeout_s=5)

    def release(self) -> None:
        """Gives the segments' memory back to the engine (when the engine is not closed with the store)."""
        if self.segment is not None:
            self._engine.unregister(self.segment)
            self.segment = None
        with self._lock:
            extra, self.extra = self.extra, {}
        for region in extra.values():
            self._engine.unregister(region)

    def mount_extra(self, region: Region) -> str:
        """Mounts one more segment of this client's (memory registered with its engine, which
        ``unmount_extra`` unregisters, freeing it if the engine allocated it); returns its name."""
        with self._lock:
            self._extra_count += 1
            name = f"{self._engine.name}/{self._client_id}/{self._extra_count}"
        self._mount_region(name, region)
        with self._lock:
            self.extra[name] = region
        if self._repairs is None and self._heartbeat is not None:  # a pure client holds memory now
            self._repairs = RepairWorker(self._rpc, self._engine, self._client_id, self._interval_s, self._closed)
            self._repairs.start()
        return name

    def unmount_extra(self, name: str) -> None:
        """Unmounts a segment ``mount_extra`` mounted (its objects leave the pool, as with any
        segment that goes) and unregisters its memory.

        Raises:
            ConfigError: no such segment of this client's.
        """
        with self._lock:
            held = self.extra.pop(name, None)
        if held is None:
            raise ConfigError(f"segment {name!r} is not one this client mounted with mount_segment()")
        try:
            self._rpc.call(p.UnmountSegment(self._client_id, name))
        finally:
            self._engine.unregister(held)

    def _mount(self) -> p.MountResult:
        assert self.segment is not None
        return self._mount_region(self.segment_name, self.segment)

    def _mount_region(self, name: str, region: Region) -> p.MountResult:
        proof = mount_proof.prove(self._engine, region, self._rpc.tenant, self._client_id, name)
        result: p.MountResult = self._rpc.call(p.MountSegment(self._client_id, name, self._engine.name,
                                                              region.address, region.length, self._incarnation,
                                                              proof))
        return result

    def _remount(self) -> None:
        """The master does not know this client (it declared it dead, or restarted): hello again
        and mount the segment again, saying what became of the objects it held."""
        self._rpc.call(p.Hello(self._client_id, p.PROTOCOL_VERSION))
        with self._lock:
            extra = list(self.extra.items())
        for name, region in extra:
            self._mount_region(name, region)
        if self.segment is None:
            logger.warning("master %s did not know client %s (restarted, or declared it dead): said hello again",
                           self._rpc.address, self._client_id)
            return
        result = self._mount()
        if result.outcome == p.MountOutcome.RESUMED:
            logger.warning("master %s had expired client %s; %d objects restored, %d superseded (re-put, upserted, "
                           "removed, evicted or copied elsewhere meanwhile; their bytes in segment %s are free again)",
                           self._rpc.address,
                           self._client_id, result.restored, result.superseded, self.segment_name)
        elif result.outcome == p.MountOutcome.NEW:
            logger.warning("master %s had no record of segment %s (it restarted without its index, or dropped the "
                           "segment after its suspension grace): re-mounted empty, the objects it held are gone",
                           self._rpc.address, self.segment_name)

    def count_lease_expiry(self) -> None:
        """A read outlived its lease: the next heartbeat tells the master."""
        self.lease_expired += 1

    def _heartbeat_loop(self) -> None:
        warned = False
        while not self._closed.wait(self._interval_s):
            expired, self.lease_expired = self.lease_expired, 0
            try:
                with self._lock:
                    mounted = ([self.segment_name] if self.segment is not None else []) + list(self.extra)
                need_remount = self._rpc.call(p.Heartbeat(self._client_id, expired, mounted), failover_timeout_s=0)
                if need_remount:
                    self._remount()
                warned = False
            except TidekvError as exc:  # never let the heartbeat die: the master would drop us
                self.lease_expired += expired
                if not warned:
                    logger.warning("store client %s: heartbeat failed: %s", self._client_id, exc)
                    warned = True
