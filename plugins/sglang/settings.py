"""Settings of the tidekv HiCache backend: the keys of SGLang's
``--hicache-storage-backend-extra-config`` that are ours, validated.

SGLang passes the whole extra config to the backend, including the keys it routes on or reads
itself; those are accepted and ignored here (``SGLANG_KEYS``). Any other unknown key is an error,
so a typo never silently falls back to a default. Neighbours: ``hicache`` builds the store client
from these settings; ``tidekv.config`` holds the transfer and store settings underneath.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tidekv.config import TransportKind, parse_size, secret_from_env
from tidekv.errors import ConfigError
from tidekv.hostaddr import is_wildcard
from tidekv.kvcache.settings import MASTER_ENV, check_master_address, resolve_master

SGLANG_KEYS = frozenset({
    # routing of the dynamic backend factory and the controller's zero-copy switch
    "backend_name", "module_path", "class_name", "interface_v1",
    # read by SGLang's cache controller (normally popped before the backend sees them)
    "prefetch_threshold", "prefetch_timeout_base", "prefetch_timeout_per_ki_token",
    "hicache_storage_pass_prefix_keys", "tp_lcm_size",
})
"""Extra-config keys that belong to SGLang, not to tidekv."""

@dataclass(frozen=True, slots=True)
class HiCacheSettings:
    """tidekv's keys in ``--hicache-storage-backend-extra-config``."""

    master: str
    """Store master "host:port" (``tidekv up`` prints it). Default: $TIDEKV_MASTER; required."""
    segment_size: int = 0
    """Bytes of host memory each SGLang rank contributes to the pool (int or "4GiB"; units are
    binary however written, "4GB" = 4 GiB, as ``tidekv.config.parse_size`` reads them). Default 0:
    the rank only uses memory others contribute (e.g. the ``tidekv up`` process)."""
    engine_host: str | None = None
    """Address the rank's transfer engine listens on and advertises; other pool members must
    reach it. Default ``$TIDEKV_HOST``, else the local address that routes to the master
    (``tidekv.hostaddr``)."""
    engine_port: int = 0
    """Port of the rank's transfer engine (0 = any free); tensor-parallel rank r takes
    engine_port + r. Default 0."""
    transport: str = "auto"
    """auto (shared memory to same-host peers, tcp otherwise), tcp or shm. Default auto."""
    replicas: int = 1
    """Copies of each page, on distinct segments (best effort). Default 1 (1..16)."""
    rpc_timeout_s: float = 5.0
    """A master that does not answer within this time fails the call (pages are then recomputed). Default 5 s."""
    secret: str | None = None
    """Shared secret of the transfer engines and the master; every pool member must use the same.
    Default ``$TIDEKV_SECRET`` (or ``$TIDEKV_SECRET_FILE``'s contents), else None."""
    extra_backend_tag: str | None = None
    """Extra key prefix to separate tenants sharing one pool (as with SGLang's mooncake backend). Default None."""

    def __post_init__(self) -> None:
        check_master_address("master", self.master)
        if self.engine_host is not None and (not isinstance(self.engine_host, str) or is_wildcard(self.engine_host)):
            raise ConfigError(f"engine_host={self.engine_host!r} must be this host's address as peers reach it "
                              "(not a wildcard), or unset")
        if isinstance(self.engine_port, bool) or not isinstance(self.engine_port, int) or not 0 <= self.engine_port <= 65535:
            raise ConfigError(f"engine_port={self.engine_port!r} must be 0..65535")
        if self.transport not in {k.value for k in TransportKind}:
            raise ConfigError(f"transport={self.transport!r} is invalid; allowed {[k.value for k in TransportKind]}")
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int) or not 1 <= self.replicas <= 16:
            raise ConfigError(f"replicas={self.replicas!r} must be an integer 1..16")
        if isinstance(self.rpc_timeout_s, bool) or not isinstance(self.rpc_timeout_s, (int, float)) \
                or not 0.01 <= self.rpc_timeout_s <= 600:
            raise ConfigError(f"rpc_timeout_s={self.rpc_timeout_s!r} must be 0.01..600 seconds")
        if self.secret is not None and (not isinstance(self.secret, str) or not self.secret):
            raise ConfigError("secret must be a non-empty string (or absent)")
        if self.extra_backend_tag is not None and (not isinstance(self.extra_backend_tag, str)
                                                   or not self.extra_backend_tag):
            raise ConfigError(f"extra_backend_tag={self.extra_backend_tag!r} must be a non-empty string (or absent)")

    @classmethod
    def from_extra_config(cls, extra_config: Mapping[str, Any] | None,
                          environ: Mapping[str, str] | None = None) -> HiCacheSettings:
        """Builds the settings from SGLang's extra config (SGLang's own keys are skipped).

        Raises:
            ConfigError: an unknown key (the message lists the allowed ones), a bad value, or no
                master in the config nor in $TIDEKV_MASTER.
        """
        values = {k: v for k, v in dict(extra_config or {}).items() if k not in SGLANG_KEYS}
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ConfigError(f"unknown tidekv HiCache setting(s) {unknown} in --hicache-storage-backend-extra-config; "
                              f"allowed {sorted(names)} (plus SGLang's own {sorted(SGLANG_KEYS)})")
        master = resolve_master(values, environ=environ)
        if "secret" not in values:  # like the master: the extra config's, else the environment's
            values["secret"] = secret_from_env(environ)
        if master is None:
            raise ConfigError(f"no tidekv master: put \"master\": \"host:port\" in "
                              f"--hicache-storage-backend-extra-config or set ${MASTER_ENV} "
                              "(start one with `tidekv up`)")
        values["master"] = master
        if "segment_size" in values:
            values["segment_size"] = parse_size(values["segment_size"], "segment_size")
        return cls(**values)
