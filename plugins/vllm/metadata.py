"""What the scheduler side tells the worker side each step, and what workers tell the scheduler
at start-up. Plain dataclasses (vLLM pickles them between processes)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata, KVConnectorMetadata

from tidekv.kvcache.contract import RankEndpoint
from tidekv.kvcache.prefix_reuse import BlockJob


@dataclass
class PullJob:
    """Decode side: pull a finished prefill's blocks into our blocks, then confirm to the prefill.

    Every worker gets the same job; rank r pulls from ``remote_ranks[r]`` and confirms there.
    ``is_sync``: copy before this step's forward (vLLM scheduled the request with the pulled
    tokens as computed), else in the background (reported from get_finished). No blocks: only
    confirm, so the prefill frees its hold at once. ``error``: the prefill's params could not be
    honoured (another protocol version, another TP size...): every local block is reported as
    a load error, so vLLM's kv_load_failure_policy recomputes or fails the request.
    """

    request_id: str
    local_blocks: list[int]
    remote_blocks: list[int]
    remote_ranks: list[RankEndpoint]
    remote_request_id: str
    is_sync: bool = False
    error: str | None = None


@dataclass
class TidekvMetadata(KVConnectorMetadata):
    pulls: list[PullJob] = field(default_factory=list)
    loads: list[BlockJob] = field(default_factory=list)  # store -> blocks, before the forward
    saves: list[BlockJob] = field(default_factory=list)  # blocks -> store, after it
    holds: list[str] = field(default_factory=list)  # prefill: finished requests whose blocks we hold
    preempted: list[str] = field(default_factory=list)
    idle: bool = False  # the step schedules no tokens (vLLM steps anyway while blocks are held)


@dataclass
class TidekvHandshake(KVConnectorHandshakeMetadata):
    """One worker's transfer engine, KV layout and hold table, sent to the scheduler at start-up."""

    tp_rank: int
    engine: str
    layout: dict[str, Any]
    confirm_address: str
