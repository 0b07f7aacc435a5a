"""Configuration of tidekv components: one frozen dataclass per component, validated on creation.

Environment variables use the prefix ``TIDEKV_`` and are read only by ``from_env()``; an invalid
value is an error, never a silent fallback. Neighbours: ``tidekv.transfer.engine`` consumes
TransferConfig; the CLI builds it from flags.
"""

from __future__ import annotations

import dataclasses
import enum
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from tidekv.errors import ConfigError

ENV_PREFIX = "TIDEKV_"

T = TypeVar("T")


class TransportKind(enum.Enum):
    """Which transport carries requests to a peer."""

    AUTO = "auto"  #: shared memory for same-host peers, tcp otherwise
    TCP = "tcp"  #: always tcp (e.g. to measure the cross-host path on one machine)
    SHM = "shm"  #: same-host only; requests to other hosts fail


def _check_range(name: str, value: int | float, low: int | float, high: int | float) -> None:
    if not (low <= value <= high):
        raise ConfigError(f"{name}={value!r} is out of range; allowed {low}..{high}")


@dataclass(frozen=True, slots=True)
class TransferConfig:
    """Settings of one TransferEngine.

    Every field can be set from the environment as ``TIDEKV_<FIELD>`` (upper case) through
    ``TransferConfig.from_env()``.
    """

    transport: TransportKind = TransportKind.AUTO
    """Transport selection (auto, tcp, shm). Default auto."""
    connections_per_peer: int = 4
    """tcp connections opened to each peer; slices are striped over them. Default 4 (1..64)."""
    worker_threads: int = 4
    """Threads that run transfer tasks. Default 4 (1..256)."""
    slice_size_bytes: int = 1 << 20
    """Large requests are cut into slices of this size for striping. Default 1 MiB (4 KiB..256 MiB)."""
    io_timeout_s: float = 30.0
    """A socket that makes no progress for this long fails its requests. Default 30 s (0.1..3600)."""
    socket_buffer_bytes: int = 4 << 20
    """SO_SNDBUF/SO_RCVBUF asked for each socket (the kernel caps it). Default 4 MiB."""
    secret: str | None = field(default=None, repr=False)
    """Shared secret; peers without it are refused at handshake. Default None (no check)."""
    max_regions: int = 4096
    """Capacity of the registered-region table. Default 4096 (1..1048576)."""
    unregister_timeout_s: float = 5.0
    """How long unregister() waits for a same-host peer's copy in flight. Default 5 s (0..600)."""
    inline_bytes: int = 64 << 10
    """Same-host batches up to this size are copied before transfer() returns. Default 64 KiB."""
    shm_parallelism: int = 2
    """Threads that share one large same-host batch. Default 2 (1..64)."""
    enable_cross_memory_attach: bool = True
    """Allow same-host peers to copy registered memory with process_vm_readv/writev. Default True."""

    def __post_init__(self) -> None:
        if not isinstance(self.transport, TransportKind):
            raise ConfigError(f"transport={self.transport!r} is invalid; allowed {[k.value for k in TransportKind]}")
        _check_range("connections_per_peer", self.connections_per_peer, 1, 64)
        _check_range("worker_threads", self.worker_threads, 1, 256)
        _check_range("slice_size_bytes", self.slice_size_bytes, 4096, 256 << 20)
        _check_range("io_timeout_s", self.io_timeout_s, 0.1, 3600)
        _check_range("socket_buffer_bytes", self.socket_buffer_bytes, 0, 1 << 30)
        _check_range("max_regions", self.max_regions, 1, 1 << 20)
        _check_range("unregister_timeout_s", self.unregister_timeout_s, 0, 600)
        _check_range("inline_bytes", self.inline_bytes, 0, 1 << 30)
        _check_range("shm_parallelism", self.shm_parallelism, 1, 64)
        if self.secret is not None and not self.secret:
            raise ConfigError("secret='' is invalid; use None for no secret")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> TransferConfig:
        """Builds a config from ``TIDEKV_*`` variables; keyword overrides win over the environment.

        Raises:
            ConfigError: a variable holds a value its field cannot take.
        """
        return _from_env(cls, environ if environ is not None else os.environ, overrides)


def _parse(name: str, raw: str, kind: Any) -> Any:
    try:
        if kind is bool or kind == "bool":
            lowered = raw.strip().lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if kind in (int, "int"):
            return int(raw, 0)
        if kind in (float, "float"):
            return float(raw)
        if kind in ("str | None", "str"):
            return raw
        if isinstance(kind, type) and issubclass(kind, enum.Enum):
            return kind(raw.strip().lower())
        if kind == "TransportKind":
            return TransportKind(raw.strip().lower())
    except ValueError:
        raise ConfigError(f"{ENV_PREFIX}{name.upper()}={raw!r} is not a valid {kind}") from None
    raise ConfigError(f"{ENV_PREFIX}{name.upper()} cannot be set from the environment")


def _from_env(cls: type[T], environ: Mapping[str, str], overrides: Mapping[str, Any]) -> T:
    values: dict[str, Any] = {}
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        raw = environ.get(ENV_PREFIX + f.name.upper())
        if raw is not None:
            values[f.name] = _parse(f.name, raw, f.type)
    unknown = set(overrides) - names
    if unknown:
        raise ConfigError(f"unknown setting(s) {sorted(unknown)}; allowed {sorted(names)}")
    values.update(overrides)
    return cls(**values)
