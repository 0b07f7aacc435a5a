"""What the scheduler side tells the worker side each step, and what workers tell the scheduler
at start-up. Plain dataclasses (vLLM pickles them between processes)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata, KVConnectorMetadata


@dataclass
class PullJob:
    """Decode side: pull a finished prefill's blocks into our blocks, then confirm to the prefill.

    ``is_sync``: copy before this step's forward (vLLM scheduled the request with the pulled
    tokens as computed), else in the background (reported from get_finished). No blocks: only
    confirm, so the prefill frees its hold at once.
    """

    request_id: str
    local_blocks: list[int]
    remote_engine: str
    remote_blocks: list[int]
    remote_layout: dict[str, Any]
    remote_request_id: str
    confirm_address: str
    is_sync: bool = False


@dataclass
class StoreJob:
    """Load (before the forward) or save (after it) blocks under their store keys."""

    request_id: str
    blocks: list[int]
    keys: list[str]  # one block key per block


@dataclass
class TidekvMetadata(KVConnectorMetadata):
    pulls: list[PullJob] = field(default_factory=list)
    loads: list[StoreJob] = field(default_factory=list)
    saves: list[StoreJob] = field(default_factory=list)
    holds: list[str] = field(default_factory=list)  # prefill: finished requests whose blocks we hold
    preempted: list[str] = field(default_factory=list)
    idle: bool = False  # the step schedules no tokens (vLLM steps anyway while blocks are held)


@dataclass
class TidekvHandshake(KVConnectorHandshakeMetadata):
    engine: str
    layout: dict[str, Any]
    confirm_address: str
