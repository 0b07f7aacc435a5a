"""TidekvConnector: vLLM's KV connector for tidekv.

Enable with ``--kv-transfer-config '{"kv_connector": "TidekvConnector", "kv_role": "kv_both",
"kv_connector_extra_config": {...}}'`` (the ``vllm.general_plugins`` entry point registers the
name; ``"kv_connector_module_path": "tidekv_vllm.connector"`` works too). Extra-config keys are
``tidekv.kvcache.settings.KVConnectorConfig``'s fields; unknown keys are refused (on a server's
command line already by the plugin, before the model loads: ``command_line``). Without
``master`` the store master comes from ``$TIDEKV_MASTER``.

- PD disaggregation: a prefill request sent with ``kv_transfer_params={"do_remote_decode": true}``
  holds its blocks when it finishes and returns params naming its transfer engine, blocks and
  layout; a decode request sent with those params pulls the blocks through the transfer engine
  instead of recomputing the prompt.
- Prefix reuse: with ``master`` set, computed prompt blocks are saved to the tidekv store under
  a chained prefix hash, and any instance on the same master loads the longest stored prefix.
  With both, a prefill's params also name its key namespace and block size, so that
  ``tidekv proxy --policy store`` can ask the master which instance holds a prompt's blocks.

vLLM builds one instance per role: SCHEDULER (engine core) and WORKER (each worker process);
each delegates to TidekvScheduler or TidekvWorker.

Tensor parallelism: every rank's worker has its own transfer engine and store client and moves
only its slice of each block; a decode's rank r pulls from the prefill's rank r (both must run
the same ``tensor_parallel_size``, which the decode checks per request), and a prefix counts as
stored only as far as every rank's blocks are. Pipeline and context parallelism are refused at
start-up (``tidekv.kvcache.ranks.check_parallel``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

from tidekv.kvcache.ranks import check_parallel
from tidekv.kvcache.settings import KVConnectorConfig
from tidekv_vllm.metadata import TidekvMetadata
from tidekv_vllm.stats import TidekvConnectorStats, TidekvPromMetrics

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


class TidekvConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer_config = vllm_config.kv_transfer_config
        assert transfer_config is not None
        settings = KVConnectorConfig.from_mapping(transfer_config.kv_connector_extra_config)
        parallel = vllm_config.parallel_config
        check_parallel(tensor_parallel_size=parallel.tensor_parallel_size,
                       pipeline_parallel_size=parallel.pipeline_parallel_size,
                       decode_context_parallel_size=getattr(parallel, "decode_context_parallel_size", 1),
                       prefill_context_parallel_size=getattr(parallel, "prefill_context_parallel_size", 1))
        self._scheduler = None
        self._worker = None
        if role == KVConnectorRole.SCHEDULER:
            from tidekv_vllm.scheduler import TidekvScheduler

            self._scheduler = TidekvScheduler(vllm_config, settings, str(transfer_config.engine_id))
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            from tidekv_vllm.worker import TidekvWorker

            # Data-parallel engines of one host each take tp_size ports from engine_port on.
            self._worker = TidekvWorker(vllm_config, settings, tp_rank=get_tensor_model_parallel_rank(),
                                        tp_size=parallel.tensor_parallel_size, kv_role=str(transfer_config.kv_role),
                                        dp_rank=int(getattr(parallel, "data_parallel_rank_local", 0) or 0))

    # ---- worker side --------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> Any:
        return self._worker.handshake() if self._worker is not None else None

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        if self._worker is not None and isinstance(kv_connector_metadata, TidekvMetadata):
            self._worker.handle_preemptions(kv_connector_metadata)

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, TidekvMetadata):
            self._worker.bind(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if self._worker is not None and isinstance(meta, TidekvMetadata):
            self._worker.start_load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # blocks are saved whole after the forward (wait_for_save)

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        if self._worker is not None and isinstance(meta, TidekvMetadata):
            self._worker.save(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._worker is None:
            return None, None
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        idle = isinstance(meta, TidekvMetadata) and meta.idle
        sending, recving = self._worker.get_finished(finished_req_ids, idle=idle)
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.block_ids_with_load_errors() if self._worker is not None else set()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """This worker's KV moves since vLLM last asked (None when there were none)."""
        if self._worker is None:
            return None
        report = self._worker.stats.take()
        return TidekvConnectorStats(data=report) if report else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return TidekvConnectorStats(data={} if data is None else data)

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type, type], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> TidekvPromMetrics:
        return TidekvPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ---- scheduler side -----------------------------------------------------------------

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        if self._scheduler is not None:
            self._scheduler.set_handshake(metadata)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> TidekvMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()
