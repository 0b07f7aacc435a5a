"""Performance bars: the targets a bench's rows are checked against, each on one row value.

A ``Bar`` selects rows by key/values and compares one value of each with a limit, so the
result reads as "PASS tcp READ batch 1 MiB: ratio 0.95 >= 0.9 (vs socket stream)". Bars are
printed, never enforced: on a shared VM a bench run is evidence, not a test. ``TRANSFER_BARS``
are the ones of the transfer-engine issue. Neighbours: ``transfer`` prints them under its table.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tidekv.report import format_size

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Bar:
    """One target: for every row matching ``where``, ``row[key]`` must be >= (or <=) ``limit``.

    Attributes:
        where: key -> allowed value, or a tuple of allowed values.
        key: the row value checked.
        limit: the bound.
        is_lower_bound: True for ">= limit", False for "<= limit".
        meaning: what the bound says, in words.
    """

    where: Mapping[str, Any]
    key: str
    limit: float
    is_lower_bound: bool = True
    meaning: str = ""

    def matches(self, row: Mapping[str, Any]) -> bool:
        for k, allowed in self.where.items():
            options = allowed if isinstance(allowed, tuple) else (allowed,)
            if row.get(k) not in options:
                return False
        return row.get(self.key) is not None


def _label(row: Mapping[str, Any]) -> str:
    return f"{row['transport']} {row['op']} {row['mode']} {format_size(row['size_bytes'])}"


def evaluate_bars(rows: Sequence[Mapping[str, Any]], bars: Sequence[Bar] | None = None) -> list[str]:
    """One "PASS ..." or "FAIL ..." line per (bar, matching row); bars default to TRANSFER_BARS."""
    lines = []
    for bar in TRANSFER_BARS if bars is None else bars:
        for row in rows:
            if not bar.matches(row):
                continue
            value = float(row[bar.key])
            ok = value >= bar.limit if bar.is_lower_bound else value <= bar.limit
            sign = ">=" if bar.is_lower_bound else "<="
            lines.append(f"  {'PASS' if ok else 'FAIL'}  {_label(row):<26} {bar.key} {value:.2f} {sign} "
                         f"{bar.limit:g}  ({bar.meaning})")
    return lines


_KIB4 = 4 << 10
TRANSFER_BARS: tuple[Bar, ...] = (
    Bar({"transport": "tcp", "mode": "batch", "size_bytes": (1 << 20, 16 << 20)}, "ratio", 1.0,
        meaning="tcp batches of 1 and 16 MiB >= 1.0x the raw socket stream"),
    Bar({"transport": "tcp", "mode": "single", "size_bytes": _KIB4}, "ratio", 0.5,
        meaning="tcp 4 KiB p50 <= 2x the raw socket ping-pong"),
    Bar({"transport": "tcp", "mode": "batch", "size_bytes": _KIB4}, "gbps", 0.6,
        meaning="tcp 4 KiB batches >= 0.6 GB/s"),
    Bar({"transport": "fabric", "mode": "batch", "size_bytes": 1 << 20}, "ratio", 0.5,
        meaning="fabric 64x1 MiB >= 0.5x tidekv's tcp (a software provider's overhead, not RDMA speed)"),
    Bar({"transport": "shm", "mode": "batch", "size_bytes": 1 << 20}, "ratio_nixl", 3.0,
        meaning="default path 64x1 MiB >= 3x NIXL's default (UCX cma)"),
    Bar({"transport": "shm", "mode": "batch", "size_bytes": _KIB4}, "ratio_nixl", 5.0,
        meaning="default path 64x4 KiB >= 5x NIXL's default (UCX cma)"),
    Bar({"transport": "tcp", "mode": "batch", "size_bytes": 1 << 20}, "ratio_nixl", 2.0,
        meaning="tcp 64x1 MiB >= 2x NIXL on UCX_TLS=tcp"),
    Bar({"transport": "tcp", "mode": "batch", "size_bytes": _KIB4}, "ratio_nixl", 4.0,
        meaning="tcp 64x4 KiB >= 4x NIXL on UCX_TLS=tcp"),
    Bar({"transport": "shm", "mode": "single", "size_bytes": 64 << 20}, "ratio", 1.0,
        meaning="shm 64 MiB >= 1.0x memcpy"),
    Bar({"transport": "shm", "mode": "single", "size_bytes": _KIB4}, "p50_us", 3.0, is_lower_bound=False,
        meaning="shm 4 KiB p50 <= 3 us"),
    Bar({"transport": "shm", "mode": "batch", "size_bytes": _KIB4}, "ratio", 0.8,
        meaning="shm 64x4 KiB >= 0.8x memcpy"),
    Bar({"transport": "tcp", "mode": "batch", "size_bytes": _KIB4}, "ratio_mooncake", 5.0,
        meaning="tcp 64x4 KiB >= 5x Mooncake"),
    Bar({"transport": "tcp"}, "ratio_mooncake", 1.5, meaning=">= 1.5x Mooncake at every size and op"),
)
