"""What one worker's KV moves came to since its engine last asked: per flow (``pull``: a PD
decode reading a prefill's blocks; ``load`` and ``save``: blocks from and to the store), the
blocks moved, their bytes, the seconds they took and the blocks that failed.

Engine plugins hand ``take()`` to their engine's stats channel (vLLM: ``KVConnectorStats``,
exported on vLLM's own ``/metrics``), which sums the workers' reports with ``merge``.
"""

from __future__ import annotations

import threading
from typing import Literal

Flow = Literal["pull", "load", "save"]
FLOWS: tuple[Flow, ...] = ("pull", "load", "save")
FIELDS = ("blocks", "bytes", "seconds", "failed_blocks")

Report = dict[str, dict[str, float]]
"""{flow: {field: total}}, holding only the flows that moved or failed something."""


class TransferStats:
    """Totals since the last ``take()``. Thread-safe: saves are recorded on the saver thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._report: Report = {}

    def record(self, flow: Flow, blocks: int, nbytes: int, seconds: float, failed_blocks: int = 0) -> None:
        """One batch of ``flow``: ``blocks`` asked for, of which ``failed_blocks`` were not moved;
        ``nbytes`` is what did move."""
        if flow not in FLOWS:
            raise ValueError(f"unknown KV transfer flow {flow!r} (one of {', '.join(FLOWS)})")
        with self._lock:
            totals = self._report.setdefault(flow, dict.fromkeys(FIELDS, 0))
            totals["blocks"] += blocks
            totals["bytes"] += nbytes
            totals["seconds"] += seconds
            totals["failed_blocks"] += failed_blocks

    def take(self) -> Report:
        """The totals since the last call, and starts anew."""
        with self._lock:
            report, self._report = self._report, {}
        return report


def merge(into: Report, other: Report) -> Report:
    """Adds ``other``'s totals to ``into`` (returned)."""
    for flow, totals in other.items():
        mine = into.setdefault(flow, dict.fromkeys(FIELDS, 0))
        for name in FIELDS:
            mine[name] += totals.get(name, 0)
    return into


def summary(report: Report) -> dict[str, float]:
    """A line's worth of ``report``: per flow the blocks, failed blocks and GB/s while moving."""
    out: dict[str, float] = {}
    for flow, t in report.items():
        out[f"{flow}_blocks"] = t["blocks"]
        if t["failed_blocks"]:
            out[f"{flow}_failed_blocks"] = t["failed_blocks"]
        if t["seconds"] > 0:
            out[f"{flow}_GBps"] = round(t["bytes"] / t["seconds"] / 1e9, 3)
    return out
