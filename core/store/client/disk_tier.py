"""A holder's disk tier, assembled: its files (``disk``), its disk server (``disk_reads``) and its
spill worker, opened, started and closed together by the ``Store`` (``disk_paths``)."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time

from tidekv.config import StoreConfig
from tidekv.errors import ConfigError
from tidekv.store.client.disk import DiskTier
from tidekv.store.client.disk_reads import DiskServer
from tidekv.store.client.master_client import MasterClient
from tidekv.store.client.spill_worker import SpillWorker
from tidekv.store.client.staging import StagingArea
from tidekv.store.wire import protocol as p
from tidekv.transfer.engine import TransferEngine
from tidekv.values import parse_host_port

logger = logging.getLogger(__name__)


class DiskTierParts:
    def __init__(self, tier: DiskTier, server: DiskServer, engine: TransferEngine) -> None:
        self.tier = tier
        self.server = server
        self._engine = engine
        self._records = tier.scan()
        self.worker: SpillWorker | None = None
        self.closed = False
        self._stop = threading.Event()
        self._rpc: MasterClient | None = None
        self._client_id = ""
        if self._records:
            logger.info("disk tier %s: %d records found, reported to the master once connected",
                        ", ".join(tier.paths), len(self._records))

    @classmethod
    def open(cls, config: StoreConfig, engine: TransferEngine, staging: StagingArea, groups: int) -> DiskTierParts:
        """Opens the tier of ``config.disk_paths`` and its disk server on the engine's host.

        Raises:
            ConfigError: no segment to spill from, a sharded pool, no ``disk_size``, or a path
                the tier cannot use (``DiskTier``).
        """
        paths = [p.strip() for p in config.disk_paths.split(",") if p.strip()]
        if config.segment_size_bytes <= 0:
            raise ConfigError("disk_paths needs a segment (segment_size > 0): the disk tier keeps what the master "
                              "evicts from this holder's memory")
        if groups > 1:
            raise ConfigError("disk_paths is not supported on a pool sharded over several master groups yet")
        if config.disk_size_bytes <= 0:
            raise ConfigError(f"disk_paths={config.disk_paths!r} needs disk_size (bytes of each path to use)")
        tier = DiskTier(paths, config.disk_size_bytes, name="store", io_threads=config.disk_io_threads)
        try:
            host = parse_host_port(engine.name, "engine")[0]
            server = DiskServer(tier, engine, staging, host, engine.config.secret, config.disk_server_port)
            return cls(tier, server, engine)
        except BaseException:
            tier.close()
            raise

    def start(self, rpc: MasterClient, client_id: str, interval_s: float, segment: str) -> None:
        self._rpc, self._client_id = rpc, client_id
        self.worker = SpillWorker(rpc, self.tier, self._records, self._engine.name, self.server.address, client_id,
                                  interval_s, self._stop, segment)
        self._records = []
        self.worker.start()
        if not self.worker.registered.wait(interval_s + 5.0):  # puts that follow find the disks known
            logger.warning("disk tier %s: the master has not answered yet; objects put before it does are spilled "
                           "only under pressure", ", ".join(self.tier.paths))

    def unmount(self, grace_s: float) -> None:
        """Leaves the tier for good: the master drops these disks and everything on them, the
        disk server answers for ``grace_s`` more (reads already handed out), then the files go."""
        self._stop.set()
        if self.worker is not None:
            self.worker.join(5.0)
        if self._rpc is not None:
            disks = [p.DiskInfo(name, self._engine.name, self.server.address, capacity)
                     for name, capacity in zip(self.tier.ids, self.tier.capacities, strict=True)]
            self._rpc.call(p.Spills(self._client_id, disks, unmount=True))
        if grace_s > 0:
            time.sleep(grace_s)
        files = list(self.tier.files)
        self.close()
        for file in files:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(file)
        logger.info("disk tier %s unmounted and its files removed", ", ".join(self.tier.paths))

    def close(self) -> None:
        """Stops spilling and serving; the files stay (a holder started on them gets their records back)."""
        if self.closed:
            return
        self.closed = True
        self._stop.set()
        if self.worker is not None:
            self.worker.join(5.0)
        self.server.close()
        self.tier.close()
