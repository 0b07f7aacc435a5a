"""Scheduler side of TidekvConnector (vLLM's engine-core process): decides which tokens come
from outside (a prefill instance, or the store), which blocks to save, and what to hold.

Side-effect-free lookups in get_num_new_matched_tokens; per-step decisions are handed to the
workers through TidekvMetadata. A store that cannot be reached only disables reuse (with a
warning) until it answers again (``tidekv.kvcache.store_link``): the engine keeps serving by
recomputing. A decode request that ends before its pull was planned (aborted: its client or
the proxy hung up) releases the prefill's hold on its blocks at once.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from tidekv.errors import TidekvError
from tidekv.kvcache import contract, ranks
from tidekv.kvcache.contract import KVHandoff, RankEndpoint
from tidekv.kvcache.handoff import Releaser, ReleaseReason, pull_end, pulled_blocks
from tidekv.kvcache.layout import KVLayout
from tidekv.kvcache.prefix_reuse import PrefixReuse
from tidekv.kvcache.ranks import RankedKeys
from tidekv.kvcache.settings import KVConnectorConfig
from tidekv.kvcache.store_link import StoreLink, lookup_client
from tidekv.logs import WarnEvery
from tidekv_vllm.metadata import PullJob, TidekvHandshake, TidekvMetadata

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

_WARN_EVERY_S = 30.0


class TidekvScheduler:
    def __init__(self, vllm_config: VllmConfig, settings: KVConnectorConfig, engine_id: str) -> None:
        self.settings = settings
        self.engine_id = engine_id
        self.block_size = vllm_config.cache_config.block_size
        self.model_tag = f"{vllm_config.model_config.model}|{vllm_config.model_config.dtype}"
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.endpoints: list[RankEndpoint] = []  # every rank's, rank 0 first (what a decode pulls from)
        self.keys: RankedKeys | None = None  # every rank's store keys
        self._link: StoreLink | None = None
        self._releaser: Releaser | None = None  # made on first use: most engines never need it
        self._refusal_warnings: dict[type, WarnEvery] = {}  # one throttle per kind of refusal
        self._pulls: dict[str, PullJob] = {}
        self._holds: list[str] = []
        if settings.master and (settings.save or settings.load):
            self._link = StoreLink(settings.master, self._connect_store, owner="scheduler")
        # Store lookups, loads and saves of blocks: the same rules as every engine's connector.
        self._reuse = PrefixReuse(self.block_size, self._link, load=settings.load, save=settings.save)

    # ---- start-up -----------------------------------------------------------------------

    def set_handshake(self, metadata: dict[int, Any]) -> None:
        """Every worker's handshake (tp rank -> TidekvHandshake); raises ConfigError unless each
        rank of the engine reported (a PD pull or a stored prefix would miss a rank's share)."""
        shakes = {rank: s for rank, s in metadata.items() if isinstance(s, TidekvHandshake)}
        if not shakes:
            return
        ordered = ranks.by_rank(shakes, self.tp_size)
        self.endpoints = [RankEndpoint(s.engine, s.layout, s.confirm_address) for s in ordered]
        self.keys = RankedKeys.of(self.model_tag, [KVLayout.from_wire(s.layout) for s in ordered], self.block_size)
        self._reuse.keys = self.keys
        logger.info("tidekv: engine %s has %d tensor-parallel rank(s) on transfer engines %s", self.engine_id,
                    self.tp_size, [e.engine for e in self.endpoints])

    @property
    def namespaces(self) -> list[str] | None:
        """Every rank's store-key namespace, rank 0 first (what the proxy's store policy routes by)."""
        return list(self.keys.namespaces) if self.keys is not None else None

    def _connect_store(self) -> Any:
        # The scheduler only asks which blocks exist: a master client, no engine (lookup_client).
        return lookup_client(self.settings.master or "", f"vllm-scheduler-{self.engine_id}",
                             self.settings.store_timeout_s, self.settings.secret)

    @property
    def _store(self) -> Any:
        """The store client while its master answers, else None (no lookups, no saves)."""
        return self._link.store if self._link is not None else None

    # ---- per request --------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        prompt = list(request.prompt_token_ids or [])
        if contract.is_handoff(params):
            count = self._pull_end(len(prompt), self._read_handoff(request)[0]) - num_computed_tokens
            return (count, not self.settings.is_sync_load) if count > 0 else (0, False)
        tokens = self._reuse.matched_tokens(prompt, num_computed_tokens)
        return (tokens, False) if tokens > 0 else (0, False)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if contract.is_handoff(params):
            assert params is not None
            handoff, error = self._read_handoff(request)
            params["do_remote_prefill"] = False  # pull once, even if this is called again
            if error is not None:
                self._warn_refusal(request.request_id, error)
            remote = list(handoff.block_ids) if handoff is not None else []
            local: list[int] = []
            if num_external_tokens > 0:
                # By block position, not by "unhashed" blocks: a sync load's blocks are already
                # in the prefix cache (hashed) when this runs; an async load's are not.
                span = pulled_blocks(self._pull_end(len(request.prompt_token_ids or []), handoff),
                                     num_external_tokens, self.block_size)
                local = list(blocks.get_block_ids()[0][span])
                remote = remote[span] if handoff is not None else []
            else:
                remote = []  # nothing to pull (a local hit covers it): only release the prefill's hold
            self._pulls[request.request_id] = PullJob(
                request.request_id,
                local,
                remote,
                list(handoff.ranks) if handoff is not None else [],
                handoff.request_id if handoff is not None else "",
                is_sync=self.settings.is_sync_load or not local,
                error=None if error is None else str(error),
            )
        else:
            self._reuse.expect_load(request.request_id, num_external_tokens)

    def _read_handoff(self, request: Request) -> tuple[KVHandoff | None, TidekvError | None]:
        """The prefill's contract in the request's params, or why this engine cannot pull it."""
        try:
            handoff = contract.from_params(request.kv_transfer_params or {})
            contract.check_pullable(handoff, tp_size=self.tp_size, block_size=self.block_size)
        except TidekvError as exc:
            return None, exc
        return handoff, None

    def _warn_refusal(self, request_id: str, error: TidekvError) -> None:
        throttle = self._refusal_warnings.setdefault(type(error), WarnEvery(_WARN_EVERY_S))
        held_back = throttle.due()
        if held_back is not None:
            logger.warning("request %s: refusing to pull its KV (kv_load_failure_policy decides its fate): %s "
                           "(%d similar refusals not logged)", request_id, error, held_back)

    def _pull_end(self, prompt_len: int, handoff: KVHandoff | None) -> int:
        if handoff is None:
            # Params we cannot honour still claim the tokens a pull would have brought: the
            # worker reports their blocks as failed loads, so vLLM's kv_load_failure_policy
            # (recompute or fail) decides the request's fate, never a mis-read.
            return pull_end(prompt_len, prompt_len, -(-prompt_len // self.block_size), self.block_size,
                            is_sync=self.settings.is_sync_load)
        return pull_end(prompt_len, handoff.num_tokens, len(handoff.block_ids), self.block_size,
                        is_sync=self.settings.is_sync_load)

    def build_connector_meta(self, out: SchedulerOutput) -> TidekvMetadata:
        meta = TidekvMetadata()
        meta.pulls = list(self._pulls.values())
        self._pulls.clear()
        meta.holds, self._holds = self._holds, []
        meta.preempted = sorted(getattr(out, "preempted_req_ids", None) or ())
        meta.idle = out.total_num_scheduled_tokens == 0
        for req in out.scheduled_new_reqs:
            rid = req.req_id
            # vLLM counts the store's tokens among the computed ones: the engine's own are the rest.
            local = req.num_computed_tokens - self._reuse.external_tokens(rid)
            load = self._reuse.start(rid, list(req.prompt_token_ids or []), list(req.block_ids[0]), local)
            if load is not None:
                meta.loads.append(load)
            self._add_save(meta, rid, req.num_computed_tokens + out.num_scheduled_tokens.get(rid, 0))
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            self._reuse.extend(rid, list(new_ids[0]) if new_ids else [],
                               is_resumed=rid in getattr(cached, "resumed_req_ids", set()))
            self._add_save(meta, rid, cached.num_computed_tokens[i] + out.num_scheduled_tokens.get(rid, 0))
        for rid in out.finished_req_ids:
            self._reuse.forget(rid)
        return meta

    def _add_save(self, meta: TidekvMetadata, rid: str, computed_after_step: int) -> None:
        job = self._reuse.plan_save(rid, computed_after_step)
        if job is not None:
            meta.saves.append(job)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        delay = self._reuse.finish(rid)  # its saves must end before vLLM frees its blocks
        result: dict[str, Any] | None = None
        if contract.is_handoff(request.kv_transfer_params):
            # A decode request that ends with its pull never planned (update_state_after_alloc
            # clears the flag): nothing will ever read the prefill's blocks for it.
            self._release_prefill(request)
        if contract.wants_remote_decode(request.kv_transfer_params) and self.endpoints and block_ids:
            from vllm.v1.request import RequestStatus

            if request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
                delay = True
                self._holds.append(rid)
                saving = bool(self.settings.master and self.settings.save and self._store is not None)
                result = contract.to_params(KVHandoff(
                    request_id=rid,
                    engine_id=self.engine_id,
                    block_ids=list(block_ids),
                    num_tokens=request.num_computed_tokens,
                    block_size=self.block_size,
                    tp_size=self.tp_size,
                    ranks=self.endpoints,
                    # Where this instance saves the prompt's blocks (rank r's in the store segment
                    # of rank r's engine, if it contributes one): `tidekv proxy --policy store`
                    # routes by them.
                    prefix_namespaces=self.namespaces if saving else None,
                ))
        return delay, result

    def _release_prefill(self, request: Request) -> None:
        handoff, _ = self._read_handoff(request)
        if handoff is None:
            return
        if self._releaser is None:
            self._releaser = Releaser(self.settings.secret)
        logger.info("request %s ended before pulling its KV (%s); telling prefill %s to free its blocks",
                    request.request_id, request.status.name, handoff.engine_id)
        self._releaser.release_handoff(handoff, ReleaseReason.DECODE_ENDED,
                                       f"decode request {request.request_id} ended ({request.status.name}) before "
                                       "its pull")

    def shutdown(self) -> None:
        if self._link is not None:
            self._link.close()
        if self._releaser is not None:
            self._releaser.close()
