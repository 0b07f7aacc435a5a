"""TensorRT-LLM KV cache connector backed by the tidekv store: prompts whose KV another
instance saved load it instead of recomputing it.

Loaded by TensorRT-LLM's ``kv_connector_config`` (LLM-API YAML)::

    kv_connector_config:
      connector_module: tidekv_trtllm.connector
      connector_scheduler_class: TidekvConnectorScheduler
      connector_worker_class: TidekvConnectorWorker

Settings come from ``$TIDEKV_CONNECTOR_CONFIG`` (JSON), ``$TIDEKV_MASTER`` (unset: no store, the
connector does nothing) and ``$TIDEKV_SECRET``. Translation only: keys, reuse rules and block
moves live in ``tidekv.kvcache`` (``prefix``, ``ranks``, ``prefix_reuse``, ``block_store``).
Limits: tensor parallelism 1, synchronous loads, and a load that finds blocks gone is logged as
an error (this API cannot report failed blocks). Not yet run inside TensorRT-LLM.
Design notes: docs/design-kvcache.md#tidekv_trtllmconnector
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from tidekv.errors import ConfigError, TidekvError
from tidekv.kvcache import ranks
from tidekv.kvcache.block_store import SaveQueue, load_blocks, save_blocks
from tidekv.kvcache.layout import KVLayout
from tidekv.kvcache.prefix_reuse import BlockJob, PrefixReuse
from tidekv.kvcache.ranks import RankedKeys
from tidekv.kvcache.settings import KVConnectorConfig
from tidekv.kvcache.store_link import StoreLink, lookup_client

try:  # TensorRT-LLM 1.x; newer trees moved the module into connectors/
    from tensorrt_llm._torch.pyexecutor.kv_cache_connector import (
        KvCacheConnectorScheduler,
        KvCacheConnectorWorker,
    )
except ImportError:
    from tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector import (  # type: ignore[no-redef]
        KvCacheConnectorScheduler,
        KvCacheConnectorWorker,
    )

logger = logging.getLogger(__name__)

_local_layout: list[KVLayout] = []
"""The KV layout the worker of this process registered (rank 0's: where the scheduler runs)."""


@dataclass
class TidekvTrtllmMetadata:
    """What the scheduler tells every worker each step (TensorRT-LLM broadcasts it)."""

    loads: list[BlockJob] = field(default_factory=list)
    saves: list[BlockJob] = field(default_factory=list)


def _settings() -> KVConnectorConfig:
    return KVConnectorConfig.from_environment()


def _model_tag(llm_args: Any) -> str:
    dtype = getattr(llm_args, "dtype", "auto")
    return f"{llm_args.model}|{dtype}"


def _tp(llm_args: Any) -> tuple[int, int]:
    mapping = llm_args.parallel_config.to_mapping()
    ranks.check_parallel(tensor_parallel_size=mapping.tp_size, pipeline_parallel_size=mapping.pp_size)
    if mapping.tp_size != 1:
        raise ConfigError(f"tensor_parallel_size={mapping.tp_size}: the tidekv TensorRT-LLM connector supports 1 "
                          "(its scheduler knows only the KV layout of its own rank); run without it or with TP 1")
    return mapping.tp_rank, mapping.tp_size


class TidekvConnectorScheduler(KvCacheConnectorScheduler):  # type: ignore[misc]
    """Rank 0: which prompt blocks come from the store, which blocks go to it."""

    def __init__(self, llm_args: Any) -> None:
        super().__init__(llm_args)
        self.settings = _settings()
        self.block_size = int(llm_args.kv_cache_config.tokens_per_block)
        self.model_tag = _model_tag(llm_args)
        _tp(llm_args)
        link = None
        if self.settings.master and (self.settings.save or self.settings.load):
            link = StoreLink(self.settings.master, self._connect_store, owner="trtllm-scheduler")
        self.reuse = PrefixReuse(self.block_size, link, load=self.settings.load, save=self.settings.save)
        self._matched: dict[str, int] = {}  # request -> store tokens promised, until allocation

    def _connect_store(self) -> Any:
        return lookup_client(self.settings.master or "", "trtllm-scheduler", self.settings.store_timeout_s,
                             self.settings.secret)

    def _keys(self) -> None:
        if self.reuse.keys is None and _local_layout:
            self.reuse.keys = RankedKeys.of(ranks.layout_tag(self.model_tag, 0, 1), _local_layout[:1], self.block_size)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        self._keys()
        tokens = self.reuse.matched_tokens(list(request.get_tokens(0)), num_computed_tokens)
        if tokens > 0:
            self._matched[str(request.request_id)] = tokens
        return tokens, False

    def update_state_after_alloc(self, request: Any, block_ids: list[int]) -> None:
        self.reuse.expect_load(str(request.request_id), self._matched.pop(str(request.request_id), 0))

    def build_connector_meta(self, scheduler_output: Any) -> TidekvTrtllmMetadata:
        meta = TidekvTrtllmMetadata()
        for r in scheduler_output.new_requests:
            rid = str(r.request_id)
            # TensorRT-LLM's computed_position leaves out the store's tokens: they come next.
            external = self.reuse.external_tokens(rid)
            load = self.reuse.start(rid, list(r.new_tokens), list(r.new_block_ids), r.computed_position)
            if load is not None:
                meta.loads.append(load)
            self._add_save(meta, rid, r.computed_position + external + r.num_scheduled_tokens)
        for r in scheduler_output.cached_requests:
            rid = str(r.request_id)
            self.reuse.extend(rid, list(r.new_block_ids))
            self._add_save(meta, rid, r.computed_position + r.num_scheduled_tokens)
        return meta

    def _add_save(self, meta: TidekvTrtllmMetadata, rid: str, computed_after_step: int) -> None:
        job = self.reuse.plan_save(rid, computed_after_step)
        if job is not None:
            meta.saves.append(job)

    def request_finished(self, request: Any, cache_block_ids: list[int]) -> bool:
        self._matched.pop(str(request.request_id), None)
        return self.reuse.finish(str(request.request_id))  # True: TensorRT-LLM waits for get_finished

    def shutdown(self) -> None:
        if self.reuse.link is not None:
            self.reuse.link.close()


class TidekvConnectorWorker(KvCacheConnectorWorker):  # type: ignore[misc]
    """Every rank: its transfer engine and store client; loads before the forward, saves after."""

    def __init__(self, llm_args: Any) -> None:
        super().__init__(llm_args)
        from tidekv.config import TransferConfig, TransportKind
        from tidekv.transfer import TransferEngine

        self.settings = _settings()
        self.tp_rank, tp_size = _tp(llm_args)
        self.block_size = int(llm_args.kv_cache_config.tokens_per_block)
        self.model_tag = ranks.layout_tag(_model_tag(llm_args), self.tp_rank, tp_size)
        config = TransferConfig.from_env(transport=TransportKind(self.settings.transport), secret=self.settings.secret)
        self.engine = TransferEngine(self.settings.listen_host(), ranks.rank_port(self.settings.engine_port, self.tp_rank),
                                     config)
        self.layout: KVLayout | None = None
        self._saves = SaveQueue()
        self._load_errors: set[int] = set()
        self._link: StoreLink | None = None
        if self.settings.master and (self.settings.save or self.settings.load):
            self._link = StoreLink(self.settings.master, self._connect_store, owner=f"trtllm rank {self.tp_rank}")

    def _connect_store(self) -> Any:
        from tidekv.config import StoreConfig
        from tidekv.store import Store

        config = StoreConfig(rpc_timeout_s=self.settings.store_timeout_s,
                             failover_timeout_s=self.settings.store_timeout_s)
        return Store.connect(self.settings.master or "", segment_size=self.settings.store_segment_size,
                             config=config, engine=self.engine)

    def register_kv_caches(self, kv_cache_tensor: Any) -> None:
        # One pool tensor, blocks on dim 0: each block is one contiguous run of every layer.
        self.layout = KVLayout.from_tensors({"pool": kv_cache_tensor}, self.block_size, self.model_tag)
        for address, length in self.layout.memory_ranges():
            self.engine.register((address, length), location=self.layout.location)
        _local_layout[:] = [self.layout]
        logger.info("tidekv TensorRT-LLM connector: rank %d, transfer engine %s, store %s; KV pool of %d blocks",
                    self.tp_rank, self.engine.name, self.settings.master or "none",
                    self.layout.layers[0].num_blocks if self.layout.layers else 0)

    def start_load_kv(self, stream: Any) -> None:
        meta = self.get_connector_meta()
        if meta is None or not meta.loads or self.layout is None:
            return
        store = self._link.try_now() if self._link is not None else None
        missing: set[int]
        if store is None:
            missing = {b for job in meta.loads for b in job.blocks}
        else:
            try:
                missing = load_blocks(store, self.layout, self.tp_rank, meta.loads)
            except TidekvError as exc:
                missing = {b for job in meta.loads for b in job.blocks}
                if self._link is not None:
                    self._link.lost(exc)
        if missing:
            self._load_errors |= missing
            logger.error("tidekv: %d blocks promised from the store could not be loaded; TensorRT-LLM's connector "
                         "API cannot recompute them", len(missing))

    def wait_for_layer_load(self, layer_idx: int, stream: Any) -> None:
        """Loads are whole and synchronous (start_load_kv): nothing to wait for per layer."""

    def save_kv_layer(self, layer_idx: int, stream: Any) -> None:
        """Blocks are saved whole after the forward (wait_for_save)."""

    def wait_for_save(self, stream: Any) -> None:
        meta = self.get_connector_meta()
        if meta is None:
            return
        forward_done = self._forward_done(stream)
        for job in meta.saves:
            if self._link is None or self.layout is None:
                self._saves.mark_saved(job.request_id)
            else:
                self._saves.submit(job.request_id, self._save, job, forward_done)

    def get_finished(self, finished_gen_req_ids: list[int],
                     started_loading_req_ids: list[int]) -> tuple[list[int], list[int]]:
        done = self._saves.finished({str(r) for r in finished_gen_req_ids})
        return [int(r) for r in done], []  # loads are synchronous: none ever starts asynchronously

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed since the last call (for TensorRT-LLM versions that ask)."""
        out, self._load_errors = self._load_errors, set()
        return out

    def shutdown(self) -> None:
        self._saves.shutdown()
        if self._link is not None:
            self._link.close()
        self.engine.close()

    def _forward_done(self, stream: Any) -> Any:
        if self.layout is None or not self.layout.location.startswith("cuda"):
            return None
        import torch

        event = torch.cuda.Event()
        event.record(stream)
        return event

    def _save(self, job: BlockJob, forward_done: Any) -> None:
        assert self.layout is not None and self._link is not None
        if forward_done is not None:
            forward_done.synchronize()
        store = self._link.try_now()
        if store is None:
            return
        try:
            save_blocks(store, self.layout, self.tp_rank, job)
        except TidekvError as exc:
            logger.warning("tidekv: saving %d blocks of request %s failed: %s", len(job.blocks), job.request_id, exc)
            self._link.lost(exc)
