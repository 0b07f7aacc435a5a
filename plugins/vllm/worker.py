"""Worker side of TidekvConnector (each vLLM worker process): registers the KV cache with a
TransferEngine, pulls a prefill's blocks (decode), holds blocks for a decode (prefill), and
moves blocks to and from the store.

Sync pulls and store loads finish before the forward that needs them (vLLM calls start_load_kv
before the forward in a step with sync loads); async pulls run on the engine's threads and are
reported from get_finished(); store saves run on a background thread after the forward, and
finished requests keep their blocks until their saves are done.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tidekv.config import TransferConfig, TransportKind
from tidekv.errors import TidekvError
from tidekv.kvcache import ranks
from tidekv.kvcache.block_store import SaveQueue, load_blocks, save_blocks
from tidekv.kvcache.handoff import HoldTable, Releaser, ReleaseReason
from tidekv.kvcache.layout import KVLayout
from tidekv.kvcache.prefix_reuse import BlockJob
from tidekv.kvcache.settings import KVConnectorConfig
from tidekv.kvcache.store_link import StoreLink
from tidekv.kvcache.transfer_stats import TransferStats
from tidekv.logs import WarnEvery
from tidekv.transfer import TransferEngine, TransferHandle, TransferOp
from tidekv_vllm.metadata import PullJob, TidekvHandshake, TidekvMetadata

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.01
"""Longest sleep in an idle step while holding blocks; a release ends it at once."""


def cpu_reservation_warning(location: str, omp_threads: int, cpus: int, env: Mapping[str, str]) -> str | None:
    """What to tell a vLLM CPU user whose OpenMP threads took every CPU (None: nothing).

    vLLM's CPU backend binds one spinning OpenMP thread per core and keeps cores back for the
    engine core and the API server; with any ``kv_transfer_config`` it keeps one more
    (``vllm/utils/ompmultiprocessing.py``: "for nixl_connector"). On a host without that many to
    spare it keeps none, and the scheduler, the API server and the connector's threads then
    wait behind spinning threads on every core: on 2 vCPUs decode ran 1.5-7x slower with any
    connector (tidekv's or LMCache's) until ``VLLM_CPU_NUM_OF_RESERVED_CPU=1``
    (``benchmarks/vllm_serve.py``). A binding the user chose is left alone."""
    if location != "cpu" or "VLLM_CPU_NUM_OF_RESERVED_CPU" in env:
        return None
    if env.get("VLLM_CPU_OMP_THREADS_BIND", "auto") not in ("", "auto") or omp_threads < cpus:
        return None
    return (f"vLLM bound {omp_threads} OpenMP threads to all {cpus} CPUs of this host: with a KV connector it "
            "reserves one core more than without, and this host has none to spare, so it reserved none. Its "
            "scheduler, API server and this connector now wait behind spinning threads (decode 1.5-7x slower on "
            "2 vCPUs). Set VLLM_CPU_NUM_OF_RESERVED_CPU=1 (or VLLM_CPU_OMP_THREADS_BIND) for vLLM's usual "
            "reservation; see docs/guides/vllm.md.")


@dataclass
class _Pull:
    job: PullJob
    handle: TransferHandle | None
    error: str | None = None
    nbytes: int = 0
    started: float = field(default_factory=time.perf_counter)


class TidekvWorker:
    """One tensor-parallel rank's side of the connector: its own transfer engine, hold table and
    store client; it moves only its rank's slice of each block (rank ``tp_rank`` of ``tp_size``)."""

    def __init__(self, vllm_config: VllmConfig, settings: KVConnectorConfig, tp_rank: int = 0,
                 tp_size: int = 1, kv_role: str = "kv_both", dp_rank: int = 0) -> None:
        self.settings = settings
        self.kv_role = kv_role
        self.tp_rank = tp_rank
        self.block_size = vllm_config.cache_config.block_size
        self.model_tag = ranks.layout_tag(f"{vllm_config.model_config.model}|{vllm_config.model_config.dtype}",
                                          tp_rank, tp_size)
        config = TransferConfig.from_env(transport=TransportKind(settings.transport), secret=settings.secret)
        port = ranks.rank_port(settings.engine_port, tp_rank, tp_size, dp_rank)
        host = settings.listen_host()
        self.engine = TransferEngine(host, port, config)
        self.holds = HoldTable(host, settings.hold_timeout_s, settings.secret,
                               ranks.rank_port(settings.hold_port, tp_rank, tp_size, dp_rank, "hold_port"))
        self.releaser = Releaser(settings.secret)
        self.layout: KVLayout | None = None
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._pulls: dict[str, _Pull] = {}
        self._load_errors: set[int] = set()
        self._saves = SaveQueue()
        self._save_failures = WarnEvery()
        self.stats = TransferStats()  # drained by the connector's get_kv_connector_stats
        self._link: StoreLink | None = None
        if settings.master and (settings.save or settings.load):
            self._link = StoreLink(settings.master, self._connect_store, owner=f"rank {tp_rank}")

    def _connect_store(self) -> Any:
        from tidekv.config import StoreConfig
        from tidekv.store import Store

        # Loads run inside the forward (start_load_kv): a master that does not answer within
        # store_timeout_s fails the load (vLLM recomputes) instead of retrying for the store's
        # failover_timeout_s (15 s); the link reconnects in the background and follows a new leader.
        config = StoreConfig(rpc_timeout_s=self.settings.store_timeout_s,
                             failover_timeout_s=self.settings.store_timeout_s)
        return Store.connect(self.settings.master or "", segment_size=self.settings.store_segment_size,
                             config=config, engine=self.engine)

    # ---- start-up -----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv_caches = kv_caches
        self.layout = KVLayout.from_tensors(kv_caches, self.block_size, self.model_tag)
        for address, length in self.layout.memory_ranges():
            self.engine.register((address, length), location=self.layout.location)
        available = [name for name, ok, _ in self.engine.transports() if ok]
        logger.info("tidekv connector: role %s, tp rank %d, transfer engine %s, transport %s (available: %s), "
                    "store %s, load mode %s, hold table %s; KV cache of %d layers, %d blocks, layout %s",
                    self.kv_role, self.tp_rank, self.engine.name, self.settings.transport, ", ".join(available) or "none",
                    f"master {self.settings.master}" if self._link is not None else "none (no store)",
                    self.settings.load_mode, self.holds.address, len(self.layout.layers),
                    self.layout.layers[0].num_blocks if self.layout.layers else 0, self.layout.fingerprint)
        import torch

        warning = cpu_reservation_warning(self.layout.location, torch.get_num_threads(), os.cpu_count() or 1,
                                          os.environ)
        if warning:
            logger.warning("tidekv connector: %s", warning)

    def handshake(self) -> TidekvHandshake:
        assert self.layout is not None, "register_kv_caches() comes first"
        return TidekvHandshake(self.tp_rank, self.engine.name, self.layout.to_wire(), self.holds.address)

    # ---- per step -----------------------------------------------------------------------

    def bind(self, meta: TidekvMetadata) -> None:
        for rid in meta.holds:
            self.holds.hold(rid)

    def handle_preemptions(self, meta: TidekvMetadata) -> None:
        # A preempted request's blocks are reused right away: its saves must finish first.
        for rid in meta.preempted:
            self._saves.wait(rid)

    def start_load(self, meta: TidekvMetadata) -> None:
        now: list[_Pull] = []
        for job in meta.pulls:
            if not job.local_blocks:
                self._finish_pull(_Pull(job, None))
            elif job.is_sync:
                now.append(self._start_pull(job))
            else:
                self._pulls[job.request_id] = self._start_pull(job)
        if meta.loads:
            self._load_from_store(meta.loads)
        for pull in now:
            # No deadline of our own: a batch given up on could still write into blocks vLLM
            # reuses; the engine's io_timeout_s fails a stuck peer instead.
            self._finish_pull(pull, wait=True)

    def save(self, meta: TidekvMetadata) -> None:
        for job in meta.saves:
            if self._link is None or self.layout is None:
                # Nothing to save to, but the scheduler delays freeing the request until every
                # rank reports its saves done: report it.
                self._saves.mark_saved(job.request_id)
            else:
                self._saves.submit(job.request_id, self._save_job, job, self._forward_done())

    def get_finished(self, finished_req_ids: set[str], idle: bool = False) -> tuple[set[str], set[str]]:
        if idle and self.holds.pending and not self._pulls:
            # vLLM steps without pause while blocks are held (it polls us for their release); on
            # a step with nothing else to do, sleep until a release arrives or IDLE_WAIT_S
            # passes, instead of spinning a core that the decode side may need.
            self.holds.wait(IDLE_WAIT_S)
        # A finished request's blocks are freed (reported in ``sending``, exactly once) when
        # nothing needs them any more: neither its decode (a hold, until released or expired)
        # nor its store saves (until done). A request with both waits for both.
        released = self.holds.released()
        saved = self._saves.finished(finished_req_ids)
        sending = {r for r in saved if not self.holds.is_held(r)}  # else: reported when its hold is released
        sending |= {r for r in released if not self._saves.is_waiting(r)}  # else: when its saves end
        recving = set()
        for rid, pull in list(self._pulls.items()):
            if pull.handle is not None and not pull.handle.done():
                continue
            del self._pulls[rid]
            recving.add(rid)
            self._finish_pull(pull)
        return sending, recving

    def _finish_pull(self, pull: _Pull, wait: bool = False) -> None:
        """Records a finished pull (waits for it if ``wait``): its blocks as load errors if it
        failed, else confirms it to the prefill."""
        if pull.handle is not None:
            try:
                pull.handle.wait(None if wait else 0)
            except TidekvError as exc:
                pull.error = str(exc)
        blocks = len(pull.job.local_blocks)
        if blocks:
            self.stats.record("pull", blocks, 0 if pull.error else pull.nbytes, time.perf_counter() - pull.started,
                              blocks if pull.error else 0)
        remote = pull.job.remote_ranks[self.tp_rank] if pull.job.remote_ranks else None
        if pull.error is not None:
            if pull.job.error is None:  # a refusal was logged by the scheduler already
                logger.warning("request %s: pulling KV from %s failed: %s", pull.job.request_id,
                               remote.engine if remote is not None else "the prefill", pull.error)
            self._load_errors.update(pull.job.local_blocks)
            if remote is not None and remote.confirm_address:
                # The batch has ended (failed): nothing reads the prefill's blocks any more, and
                # vLLM recomputes or fails this request, so the prefill need not hold them.
                self.releaser.release(remote.confirm_address, pull.job.remote_request_id, ReleaseReason.PULL_FAILED,
                                      f"decode request {pull.job.request_id}: {pull.error}")
        elif remote is not None and remote.confirm_address:
            self.releaser.release(remote.confirm_address, pull.job.remote_request_id)

    def block_ids_with_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def shutdown(self) -> None:
        self._saves.shutdown()
        if self._link is not None:
            self._link.close()
        self.holds.close()
        self.releaser.close()
        self.engine.close()

    # ---- internals ----------------------------------------------------------------------

    def _start_pull(self, job: PullJob) -> _Pull:
        assert self.layout is not None
        if job.error is not None:
            return _Pull(job, None, job.error)
        # The scheduler checked the prefill's TP size against ours: it has our rank.
        assert len(job.remote_ranks) > self.tp_rank, "a pull without this rank's endpoint"
        try:
            peer = job.remote_ranks[self.tp_rank]
            remote = KVLayout.from_wire(peer.layout)
            self.layout.check_compatible(remote)
            requests = self.layout.block_requests(TransferOp.READ, peer.engine, remote,
                                                  job.local_blocks, job.remote_blocks)
            nbytes = sum(r.length for r in requests)
            return _Pull(job, self.engine.transfer(requests) if requests else None, nbytes=nbytes)
        except TidekvError as exc:
            return _Pull(job, None, str(exc))

    def _load_from_store(self, jobs: list[BlockJob]) -> None:
        assert self.layout is not None
        # The scheduler found these blocks on the master a moment ago: a link still waiting out
        # its backoff tries at once (a load without a client fails its requests).
        store = self._link.try_now() if self._link is not None else None
        owners = {block for job in jobs for block in job.blocks}
        if store is None:
            self._load_errors |= owners
            self.stats.record("load", len(owners), 0, 0.0, len(owners))
            return
        started = time.perf_counter()
        try:
            missing = load_blocks(store, self.layout, self.tp_rank, jobs)
        except TidekvError as exc:
            self.stats.record("load", len(owners), 0, time.perf_counter() - started, len(owners))
            logger.warning("tidekv: loading %d blocks from the store failed (%s); vLLM recomputes them",
                           len(owners), exc)
            self._load_errors.update(owners)
            self._link_lost(exc)
            return
        moved = len(owners - missing)
        self.stats.record("load", len(owners), moved * self.layout.block_bytes, time.perf_counter() - started,
                          len(owners) - moved)
        if missing:
            # The scheduler saw every rank's chunks a moment ago: they were evicted since, or
            # this rank's store client sees another pool.
            logger.warning("tidekv: rank %d: %d of %d blocks to load were not in the store; vLLM recomputes them",
                           self.tp_rank, len(missing), len(owners))
            self._load_errors |= missing

    def _forward_done(self) -> Any:
        """What a save of GPU blocks waits for: the forward's kernels that wrote them (an event on
        the current stream, recorded now; the forward pass itself never waits). None on a CPU cache."""
        if self.layout is None or not self.layout.location.startswith("cuda"):
            return None
        import torch

        event = torch.cuda.Event()
        event.record()
        return event

    def _save_job(self, job: BlockJob, forward_done: Any = None) -> None:
        assert self.layout is not None and self._link is not None
        if forward_done is not None:
            forward_done.synchronize()  # on this saver thread: the blocks hold the forward's output now
        # The scheduler planned this save: its link is up, so ours is worth a try off-schedule.
        store = self._link.try_now()
        blocks = len(job.blocks)
        if store is None:
            self.stats.record("save", blocks, 0, 0.0, blocks)
            return  # this rank's master does not answer: the blocks are recomputed some day
        started = time.perf_counter()
        try:
            save_blocks(store, self.layout, self.tp_rank, job)
            self.stats.record("save", blocks, blocks * self.layout.block_bytes, time.perf_counter() - started)
        except TidekvError as exc:
            self.stats.record("save", blocks, 0, time.perf_counter() - started, blocks)
            # A failed save only costs a future recompute; never the request. A pool without
            # memory (a lone master, store_segment_size 0 everywhere) fails every one: say it
            # once per interval, with the count.
            held_back = self._save_failures.due()
            if held_back is not None:
                logger.warning("tidekv: saving %d blocks of request %s failed: %s%s", len(job.blocks), job.request_id,
                               exc, f" ({held_back} more save(s) failed since the last report)" if held_back else "")
            self._link_lost(exc)

    def _link_lost(self, exc: TidekvError) -> None:
        if self._link is not None:
            self._link.lost(exc)
