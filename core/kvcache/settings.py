"""Settings of the engine KV connectors (vLLM's ``kv_connector_extra_config``, SGLang's extra
config): one validated dataclass, built from the engine's free-form mapping. Unknown keys are
errors, so a typo never silently disables a feature.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tidekv.config import TransportKind
from tidekv.errors import ConfigError

LOAD_MODES = ("sync", "async")


@dataclass(frozen=True, slots=True)
class KVConnectorConfig:
    master: str | None = None
    """Store master "host:port": enables store-backed prefix reuse across instances. Default None (off)."""
    store_segment_size: int = 0
    """Bytes of this instance's memory contributed to the store pool. Default 0 (pure client)."""
    save: bool = True
    """Save computed prompt blocks to the store (needs master). Default True."""
    load: bool = True
    """Load the longest stored prefix instead of recomputing it (needs master). Default True."""
    engine_host: str = "127.0.0.1"
    """Address this instance's transfer engine listens on; peers must reach it. Default 127.0.0.1."""
    engine_port: int = 0
    """Port of the transfer engine (0 = any free). Default 0."""
    transport: str = "auto"
    """auto (shared memory to same-host peers), tcp or shm. Default auto."""
    store_timeout_s: float = 2.0
    """A store master that does not answer within this time is skipped (prompts are recomputed). Default 2 s."""
    hold_timeout_s: float = 120.0
    """Prefill frees blocks held for a decode that never pulled them after this long. Default 120 s."""
    secret: str | None = None
    """Shared secret of the transfer engines (all instances must agree). Default None."""
    load_mode: str = "sync"
    """How a decode pulls a prefill's blocks: "sync" copies them before the forward of the step
    that schedules the request (all prompt tokens but the last come from the prefill); "async"
    copies them in the background and the request waits a step for them (vLLM's
    WAITING_FOR_REMOTE_KVS), which keeps long pulls off other requests' steps. Default sync."""

    def __post_init__(self) -> None:
        if self.master is not None and (not isinstance(self.master, str) or ":" not in self.master):
            raise ConfigError(f"master={self.master!r} must be 'host:port'")
        if not isinstance(self.store_segment_size, int) or self.store_segment_size < 0:
            raise ConfigError(f"store_segment_size={self.store_segment_size!r} must be an integer >= 0 (bytes)")
        for name in ("save", "load"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}={getattr(self, name)!r} must be true or false")
        if not isinstance(self.engine_port, int) or not 0 <= self.engine_port <= 65535:
            raise ConfigError(f"engine_port={self.engine_port!r} must be 0..65535")
        if self.transport not in {k.value for k in TransportKind}:
            raise ConfigError(f"transport={self.transport!r} is invalid; allowed {[k.value for k in TransportKind]}")
        if not isinstance(self.store_timeout_s, (int, float)) or not 0.01 <= self.store_timeout_s <= 600:
            raise ConfigError(f"store_timeout_s={self.store_timeout_s!r} must be 0.01..600 seconds")
        if not isinstance(self.hold_timeout_s, (int, float)) or not 0.1 <= self.hold_timeout_s <= 86400:
            raise ConfigError(f"hold_timeout_s={self.hold_timeout_s!r} must be 0.1..86400 seconds")
        if self.load_mode not in LOAD_MODES:
            raise ConfigError(f"load_mode={self.load_mode!r} is invalid; allowed {list(LOAD_MODES)}")

    @property
    def is_sync_load(self) -> bool:
        return self.load_mode == "sync"

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any] | None) -> KVConnectorConfig:
        """Raises ConfigError naming unknown keys and the allowed ones."""
        values = dict(values or {})
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ConfigError(f"unknown tidekv connector setting(s) {unknown}; allowed {sorted(names)}")
        return cls(**values)
