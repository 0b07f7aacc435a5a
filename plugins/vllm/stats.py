"""The connector's transfer stats in vLLM's channel: workers report ``TransferStats`` totals as
``TidekvConnectorStats``; vLLM sums them across workers, logs ``reduce()`` with its periodic
stats line and passes them to ``TidekvPromMetrics``, whose counters appear on vLLM's /metrics
(``vllm:tidekv_kv_*{flow="pull|load|save"}``)."""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from tidekv.kvcache.transfer_stats import FIELDS, FLOWS, merge, summary

_COUNTERS = {
    "blocks": ("vllm:tidekv_kv_blocks", "KV blocks tidekv was asked to move, by flow (pull: from a prefill; "
               "load/save: from/to the store)"),
    "bytes": ("vllm:tidekv_kv_bytes", "bytes of KV blocks tidekv moved, by flow"),
    "seconds": ("vllm:tidekv_kv_seconds", "seconds tidekv's KV moves took, by flow (an async pull: until the "
                "worker saw it end)"),
    "failed_blocks": ("vllm:tidekv_kv_failed_blocks", "KV blocks tidekv failed to move, by flow (recomputed)"),
}


class TidekvConnectorStats(KVConnectorStats):
    """``data`` is a ``transfer_stats.Report``: {flow: {field: total}}."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        merge(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        return summary(self.data)

    def is_empty(self) -> bool:
        return not self.data


class TidekvPromMetrics(KVConnectorPromMetrics):
    """One counter per field, labelled by vLLM's engine labels and the flow."""

    def __init__(self, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._series: dict[tuple[int, str, str], Any] = {}
        for name, (metric, documentation) in _COUNTERS.items():
            counter = self._counter_cls(name=metric, documentation=documentation,
                                        labelnames=[*labelnames, "flow"])
            for engine, values in per_engine_labelvalues.items():
                for flow in FLOWS:
                    self._series[(engine, flow, name)] = counter.labels(*values, flow)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for flow, totals in transfer_stats_data.items():
            for name in FIELDS:
                if totals.get(name):
                    self._series[(engine_idx, flow, name)].inc(totals[name])
