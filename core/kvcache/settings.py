"""Settings of the engine KV connectors (vLLM's ``kv_connector_extra_config``, SGLang's extra
config): one validated dataclass, built from the engine's free-form mapping, and where every
plugin finds the store master (``resolve_master``: the engine's own config, else
``$TIDEKV_MASTER``). Unknown keys are errors, so a typo never silently disables a feature; the
message suggests the closest allowed name. Neighbours: ``tidekv.config`` (the transfer and store
settings underneath), ``plugins/vllm`` and ``plugins/sglang`` (which map their engine's config here).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from tidekv.config import PoolAddress, TransportKind, secret_from_env
from tidekv.errors import ConfigError
from tidekv.hostaddr import HOST_VARIABLE, advertised_host, is_loopback, is_wildcard

LOAD_MODES = ("sync", "async")

CONNECTOR_CONFIG_ENV = "TIDEKV_CONNECTOR_CONFIG"
"""The environment variable holding the connector settings as JSON, for engines whose own config
has no room for them (TensorRT-LLM's ``kv_connector_config``)."""

MASTER_ENV = "TIDEKV_MASTER"
"""The environment variable every tidekv plugin reads the store master's address from when the
engine's own config names none: "host:port" (``tidekv up`` prints it) or "etcd://H:P/CLUSTER", or
several such master groups of a sharded pool joined by ";"."""

def check_master_address(name: str, value: Any) -> str:
    """Returns ``value`` if it names a master: "host:port" (``[v6]:port`` too), a cluster of
    masters in etcd, "etcd://HOST:PORT[,HOST:PORT...]/CLUSTER", or several such groups of a
    sharded pool joined by ";" (``PoolAddress``).

    Raises:
        ConfigError: naming ``name`` (the setting or variable it came from) and the value.
    """
    try:
        PoolAddress.parse(value, name)
    except ConfigError:
        raise ConfigError(f"{name}={value!r} must be 'host:port' of a tidekv master (e.g. 127.0.0.1:50051, "
                          "what `tidekv up` prints) or 'etcd://HOST:PORT[,HOST:PORT...]/CLUSTER' for a cluster "
                          "of masters (several groups of a sharded pool joined by ';')") from None
    return str(value)


def resolve_master(values: Mapping[str, Any], key: str = "master",
                   environ: Mapping[str, str] | None = None) -> str | None:
    """Where a plugin finds the store master: ``values[key]`` (the engine's extra config) when the
    key is there, even as None (no store, whatever the environment says); else ``$TIDEKV_MASTER``
    when set and not empty; else None (no store).

    Raises:
        ConfigError: the address chosen is not "host:port" (naming where it came from).
    """
    if key in values:
        return None if values[key] is None else check_master_address(key, values[key])
    env = os.environ if environ is None else environ
    raw = env.get(MASTER_ENV, "")
    return check_master_address(f"${MASTER_ENV}", raw) if raw else None


def did_you_mean(name: str, allowed: Iterable[str]) -> str:
    """" (did you mean 'x'?)" for the allowed name closest to ``name`` (case-insensitive), else ""."""
    choices = {a.lower(): a for a in allowed}
    close = difflib.get_close_matches(name.lower(), list(choices), n=1, cutoff=0.75)
    return f" (did you mean {choices[close[0]]!r}?)" if close else ""


@dataclass(frozen=True, slots=True)
class KVConnectorConfig:
    master: str | None = None
    """Store master "host:port", or "etcd://H:P[,H:P...]/CLUSTER" for a cluster of masters, or several master
    groups of a sharded pool joined by ";" ("g0=H:P;g1=H:P"): enables store-backed prefix reuse across instances. Default
    ``$TIDEKV_MASTER`` when set (``from_mapping``), else None (off)."""
    store_segment_size: int = 0
    """Bytes of this instance's memory contributed to the store pool. Default 0 (pure client)."""
    save: bool = True
    """Save computed prompt blocks to the store (needs master). Default True."""
    load: bool = True
    """Load the longest stored prefix instead of recomputing it (needs master). Default True."""
    engine_host: str | None = None
    """Address this instance's transfer engine and PD hold table listen on and advertise; peers
    must reach it. Default ``$TIDEKV_HOST``, else the local address that routes to ``master``,
    else (no master) the default route's interface (``listen_host``)."""
    engine_port: int = 0
    """Port of the transfer engine (0 = any free); rank r of a host takes engine_port + r. Default 0."""
    hold_port: int = 0
    """Port of the PD hold table, where decodes tell a prefill to release held blocks (0 = any
    free); rank r of a host takes hold_port + r. Default 0."""
    transport: str = "auto"
    """auto (shared memory to same-host peers), tcp or shm. Default auto."""
    store_timeout_s: float = 2.0
    """A store master that does not answer within this time is skipped (prompts are recomputed). Default 2 s."""
    hold_timeout_s: float = 120.0
    """Prefill frees blocks held for a decode that never pulled them after this long. Default 120 s."""
    secret: str | None = None
    """Shared secret of the transfer engines, the master and the PD release channel (all
    instances must agree). Default ``$TIDEKV_SECRET`` (or ``$TIDEKV_SECRET_FILE``'s contents), else None."""
    load_mode: str = "sync"
    """How a decode pulls a prefill's blocks: "sync" copies them before the forward of the step
    that schedules the request (all prompt tokens but the last come from the prefill); "async"
    copies them in the background and the request waits a step for them (vLLM's
    WAITING_FOR_REMOTE_KVS), which keeps long pulls off other requests' steps. Default sync."""

    def __post_init__(self) -> None:
        if self.master is not None:
            check_master_address("master", self.master)
        if not isinstance(self.store_segment_size, int) or self.store_segment_size < 0:
            raise ConfigError(f"store_segment_size={self.store_segment_size!r} must be an integer >= 0 (bytes)")
        for name in ("save", "load"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}={getattr(self, name)!r} must be true or false")
        if self.engine_host is not None and (not isinstance(self.engine_host, str) or is_wildcard(self.engine_host)):
            raise ConfigError(f"engine_host={self.engine_host!r} must be this host's address as peers reach it "
                              "(not a wildcard), or unset")
        for name in ("engine_port", "hold_port"):
            port = getattr(self, name)
            if not isinstance(port, int) or not 0 <= port <= 65535:
                raise ConfigError(f"{name}={port!r} must be 0..65535")
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
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> KVConnectorConfig:
        """The settings in ``$TIDEKV_CONNECTOR_CONFIG`` (a JSON object of this class's keys;
        unset = every default), through ``from_mapping``.

        Raises:
            ConfigError: the variable is not a JSON object, or a key or value is bad.
        """
        env = os.environ if environ is None else environ
        raw = env.get(CONNECTOR_CONFIG_ENV, "")
        try:
            values = json.loads(raw) if raw else {}
        except ValueError as exc:
            raise ConfigError(f"${CONNECTOR_CONFIG_ENV} is not JSON ({exc}): {raw!r}") from None
        if not isinstance(values, dict):
            raise ConfigError(f"${CONNECTOR_CONFIG_ENV} must be a JSON object of connector settings, not {raw!r}")
        return cls.from_mapping(values, environ=env)

    def listen_host(self, environ: Mapping[str, str] | None = None) -> str:
        """The address the engine and hold table bind and advertise (``tidekv.hostaddr``):
        ``engine_host``, else ``$TIDEKV_HOST``, else the interface routing to the master, else the
        default route's (a PD peer is on another host, by design). Called at start-up, before
        the model loads, so that an address other hosts cannot reach fails there.

        Raises:
            ConfigError: no route to the master, or a loopback address while the master is on
                another host (its decodes and pool members could not reach this instance).
        """
        toward = PoolAddress.parse(self.master).hosts if self.master else None
        host = advertised_host(self.engine_host, toward, setting="engine_host", environ=environ)
        if toward and is_loopback(host) and not all(is_loopback(h) for h in toward):
            raise ConfigError(f"this instance's transfer engine would listen on {host} (engine_host or "
                              f"${HOST_VARIABLE}), loopback, while the store master {self.master} is on another "
                              "host: no other host could pull this instance's KV or read its segment. Leave "
                              f"engine_host and ${HOST_VARIABLE} unset (the interface that routes to the master "
                              "is taken) or set this host's address")
        return host

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any] | None,
                     environ: Mapping[str, str] | None = None) -> KVConnectorConfig:
        """The settings in an engine's extra config; ``master`` from ``resolve_master`` (the
        mapping's, else ``$TIDEKV_MASTER`` in ``environ``, default ``os.environ``).

        Raises:
            ConfigError: an unknown key (naming it, the closest allowed one and all allowed ones)
                or a bad value (naming the setting).
        """
        values = dict(values or {})
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            hints = "".join(did_you_mean(k, names) for k in unknown[:1])
            raise ConfigError(f"unknown tidekv connector setting(s) {unknown}{hints}; allowed {sorted(names)}")
        values["master"] = resolve_master(values, environ=environ)
        if "secret" not in values:  # like the master: the engine's config, else the environment
            values["secret"] = secret_from_env(environ)
        return cls(**values)
