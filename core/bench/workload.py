"""Workload of one benchmark measurement: which op, how many requests of what size, and where.

Every driver of ``bench transfer`` (tidekv, the raw-socket and memcpy baselines, Mooncake)
moves the same ``Workload`` so their numbers compare: the same sizes, the same number of
requests per iteration, and the same offsets cycling through a region of the same size (so no
driver stays in cache where another does not). Neighbours: ``timing`` repeats and summarizes;
``transfer`` builds workloads from the command line.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from tidekv.errors import ConfigError
from tidekv.transfer.batch import TransferOp

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Workload:
    """One iteration: ``count`` requests of ``size_bytes`` each, all the same ``op``.

    Request i uses offset ``offsets()[i]`` on both sides, cycling through ``region_bytes``.
    """

    op: TransferOp
    """READ (peer -> initiator) or WRITE (initiator -> peer)."""
    size_bytes: int
    """Bytes of one request (> 0)."""
    count: int
    """Requests per iteration: 1 for single requests, the batch size for batches (>= 1)."""
    region_bytes: int
    """Bytes of the registered region on each side (>= size_bytes)."""

    def __post_init__(self) -> None:
        if self.size_bytes <= 0:
            raise ConfigError(f"size_bytes={self.size_bytes} must be > 0")
        if self.count < 1:
            raise ConfigError(f"count={self.count} must be >= 1")
        if self.region_bytes < self.size_bytes:
            raise ConfigError(f"region_bytes={self.region_bytes} must be >= size_bytes={self.size_bytes}")

    @property
    def bytes_per_iteration(self) -> int:
        """Payload bytes one iteration moves."""
        return self.size_bytes * self.count

    def offsets(self) -> list[int]:
        """Offset of each request of an iteration inside the region."""
        slots = self.region_bytes // self.size_bytes
        return [(i % slots) * self.size_bytes for i in range(self.count)]


def region_bytes_for(max_size_bytes: int, count: int, cap_bytes: int = 256 << 20) -> int:
    """Region size that holds one batch of the largest requests, capped (offsets wrap past the cap)."""
    return max(max_size_bytes, min(max_size_bytes * count, cap_bytes))
