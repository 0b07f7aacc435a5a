"""Mooncake's ``mooncake.mooncake_config``: ``MooncakeConfig``, the settings Mooncake's store
clients are set up from, read from a JSON file or from ``MOONCAKE_*`` variables (LMCache's and
vLLM's Mooncake integrations load theirs through it), with Mooncake's fields, defaults and
errors (``ValueError``: ``ConfigError`` is one).

Sizes go through tidekv's one size parser (``tidekv.config.parse_size``), which reads what
Mooncake's reads ("16MB", "1.5g", "4 GB", ints; binary units), and also "16MiB". Differences: a
bool or a fractional float is refused (Mooncake reads True as 1 and truncates 2.5 to 2; an
integral float such as the JSON number 3.2e9 is taken by both), and sizes given as text to the
constructor are parsed (Mooncake's raises TypeError for them).

This module is also where the ``MOONCAKE_*`` variables are named: ``ENV_VARIABLES`` (for
``MooncakeConfig.load_from_env``) and ``SETUP_ENV_VARIABLES`` (the same names under the keys of
``MooncakeDistributedStore.setup(config)``). Neighbours: ``tidekv.compat.mooncake_store`` (the
store these settings set up), ``tidekv.values`` (the parsers).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from tidekv.errors import ConfigError
from tidekv.values import parse_size

logger = logging.getLogger(__name__)

DEFAULT_GLOBAL_SEGMENT_SIZE = 3355443200
"""Mooncake's default segment a client contributes: 3.125 GiB."""
DEFAULT_LOCAL_BUFFER_SIZE = 1 << 30
"""Mooncake's default local (staging) buffer: 1 GiB."""

CONFIG_PATH_VARIABLE = "MOONCAKE_CONFIG_PATH"
"""Names the JSON file ``load_from_env`` reads; without it the ``MOONCAKE_*`` variables are read."""

ENV_VARIABLES: dict[str, str] = {
    "local_hostname": "MOONCAKE_LOCAL_HOSTNAME", "metadata_server": "MOONCAKE_TE_META_DATA_SERVER",
    "global_segment_size": "MOONCAKE_GLOBAL_SEGMENT_SIZE", "local_buffer_size": "MOONCAKE_LOCAL_BUFFER_SIZE",
    "protocol": "MOONCAKE_PROTOCOL", "device_name": "MOONCAKE_DEVICE", "master_server_address": "MOONCAKE_MASTER",
    "enable_ssd_offload": "MOONCAKE_OFFLOAD_ENABLED", "ssd_offload_path": "MOONCAKE_OFFLOAD_FILE_STORAGE_PATH",
    "tenant_id": "MOONCAKE_TENANT_ID", "enable_client_http_server": "MOONCAKE_ENABLE_CLIENT_HTTP_SERVER",
    "client_http_port": "MOONCAKE_CLIENT_HTTP_PORT",
}
"""``MooncakeConfig`` field -> the variable ``load_from_env`` reads it from (Mooncake's names)."""

SETUP_KEYS = {"device_name": "rdma_devices", "master_server_address": "master_server_addr"}
"""The fields ``MooncakeDistributedStore.setup(config)`` spells otherwise in its dict."""

SETUP_ENV_VARIABLES: dict[str, str] = {
    SETUP_KEYS.get(name, name): ENV_VARIABLES[name]
    for name in ("local_hostname", "metadata_server", "global_segment_size", "local_buffer_size", "protocol",
                 "device_name", "master_server_address")}
"""``setup(config)`` keys and the ``MOONCAKE_*`` variables that fill them when a key is absent."""

KNOWN_PROTOCOLS = frozenset({"tcp", "rdma", "efa", "nvmeof", "nvlink", "musa", "nvlink_intra", "hip", "barex", "cxl",
                             "ascend", "ub", "ubshmem", "maca", "sunrise_link", "rpc_only"})
"""Mooncake's transports and store modes; another protocol is passed on with a warning, as in Mooncake."""

_REQUIRED = ("local_hostname", "metadata_server", "master_server_address")
"""Fields a config file must have, non-empty."""

_TRUE = ("true", "1", "yes", "on", "enable")
_FALSE = ("false", "0", "no", "off", "disable")


def _size(name: str, value: Any) -> int:
    """A size field: an int, an integral float (a JSON number such as 3.2e9) or a text ("16MB")."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return parse_size(value, name)


def _bool(name: str, value: Any) -> bool:
    """Mooncake's config booleans: a bool, a number, None or "" (false), or one of its words."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return bool(value)
    text = "" if value is None else str(value).strip().lower()
    if text in ("", *_FALSE):
        return False
    if text in _TRUE:
        return True
    raise ConfigError(f"{name}={value!r} is not a boolean; allowed: {', '.join(_TRUE + _FALSE)}")


OFFLOAD_PATH = "/data/file_storage"
"""Mooncake's default SSD offload directory (``MOONCAKE_OFFLOAD_FILE_STORAGE_PATH``)."""
OFFLOAD_MAX_BYTES = 2 << 40
"""Mooncake's default disk limit (``MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES``)."""


def offload_enabled(value: Any) -> bool:
    """``enable_ssd_offload`` as given to setup (a bool, or a config file's word)."""
    return _bool("enable_ssd_offload", value)


def offload_disk(path: str, environ: Any = None) -> tuple[str, int]:
    """Mooncake's SSD offload as tidekv's disk tier: (``disk_paths``, ``disk_size_bytes``).

    The directory is ``path``, else ``MOONCAKE_OFFLOAD_FILE_STORAGE_PATH``, else Mooncake's
    default. The size is ``MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES`` if set; Mooncake's 2 TB
    default is a cap, but tidekv preallocates its file, so without the variable it takes half the
    file system's free space, at most 2 TB (logged).
    """
    env = os.environ if environ is None else environ
    directory = path or env.get("MOONCAKE_OFFLOAD_FILE_STORAGE_PATH") or OFFLOAD_PATH
    limit = env.get("MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES")
    if limit:
        return directory, _size("MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES", limit)
    try:
        free = shutil.disk_usage(directory).free
    except OSError as exc:
        raise ConfigError(f"SSD offload directory {directory!r}: {exc.strerror or exc}; create it first") from None
    size = min(free // 2, OFFLOAD_MAX_BYTES)
    logger.info("mooncake compat: SSD offload in %s takes %d bytes (half its free space; set "
                "MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES to choose)", directory, size)
    return directory, size


def _port(name: str, value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}={value!r} is not a port number") from None


@dataclass
class MooncakeConfig:
    """Settings of a Mooncake store client. Mutable, as Mooncake's (callers may set fields); the
    checks of ``__post_init__`` run when it is made.

    Raises (on construction):
        ConfigError: an empty or non-text protocol, a size that is not one or is negative, an
            empty ``local_hostname``, ``metadata_server`` or ``master_server_address``.
    """

    local_hostname: str
    """This client's address for its transfer engine ("host" or "host:port")."""
    metadata_server: str
    """Mooncake's transfer-engine metadata service ("P2PHANDSHAKE": none); tidekv does not use it."""
    global_segment_size: int
    """Bytes this client contributes to the pool (0: none); text such as "16MB" is parsed."""
    local_buffer_size: int
    """Bytes of registered staging memory for bytes puts and gets; text is parsed."""
    protocol: str
    """Mooncake's transport name, lower-cased ("tcp" or "rdma"; tidekv picks shm or tcp per peer)."""
    device_name: str | None
    """RDMA devices ("mlx5_0", "auto-discovery", ""); tidekv does not use it."""
    master_server_address: str
    """The master: "host:port", or "etcd://h1:2379;h2:2379" for an HA master."""
    enable_ssd_offload: bool = False
    """Mooncake's SSD tier (False); tidekv's drop-in refuses True at setup."""
    ssd_offload_path: str = ""
    """Directory of the SSD tier ("")."""
    tenant_id: str = "default"
    """Mooncake's tenant ("default"); tidekv's drop-in refuses another at setup."""
    enable_client_http_server: bool = False
    """Mooncake's client health/metrics HTTP endpoints (False); refused at setup when True."""
    client_http_port: int = 9300
    """Port of those endpoints (9300)."""

    def __post_init__(self) -> None:
        if not isinstance(self.protocol, str) or not self.protocol.strip():
            raise ConfigError(f"protocol={self.protocol!r} is not a protocol; use a non-empty name such as 'tcp'")
        self.protocol = self.protocol.strip().lower()
        if self.protocol not in KNOWN_PROTOCOLS:
            logger.warning("MooncakeConfig: protocol %r is not one of Mooncake's (%s); passing it on",
                           self.protocol, ", ".join(sorted(KNOWN_PROTOCOLS)))
        self.global_segment_size = _size("global_segment_size", self.global_segment_size)
        self.local_buffer_size = _size("local_buffer_size", self.local_buffer_size)
        for name in _REQUIRED:
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip():
                raise ConfigError(f"{name}={value!r}: this setting must be a non-empty string")

    @staticmethod
    def from_file(file_path: str) -> MooncakeConfig:
        """The settings in a JSON file (Mooncake's keys; absent ones take Mooncake's defaults).

        Raises:
            OSError: the file cannot be read.
            ValueError: it is not JSON (``json.JSONDecodeError``), or a ConfigError: a required
                key is missing, or a value is refused.
        """
        with open(file_path) as f:
            values = json.load(f)
        if not isinstance(values, dict):
            raise ConfigError(f"{file_path}: a Mooncake config file holds one JSON object, not {type(values).__name__}")
        for name in _REQUIRED:
            if name not in values:
                raise ConfigError(f"{file_path}: missing required config field {name!r}")
        return _config(values.get, f"{file_path}: ")

    @staticmethod
    def load_from_env(environ: Mapping[str, str] | None = None) -> MooncakeConfig:
        """The file ``MOONCAKE_CONFIG_PATH`` names, else the ``MOONCAKE_*`` variables (see
        ``ENV_VARIABLES``; ``MOONCAKE_MASTER`` is required then). ``environ``: default ``os.environ``.

        Raises:
            ConfigError: neither variable is set, or a value is refused; as ``from_file``.
        """
        env = os.environ if environ is None else environ
        path = env.get(CONFIG_PATH_VARIABLE)
        if path is not None:
            return MooncakeConfig.from_file(path)
        if not env.get(ENV_VARIABLES["master_server_address"]):
            raise ConfigError(f"Neither the environment variable {CONFIG_PATH_VARIABLE!r} nor "
                              f"{ENV_VARIABLES['master_server_address']!r} is set; set one to say where the master is")
        return _config(lambda name, default=None: env.get(ENV_VARIABLES[name], default), "")


_DEFAULTS: dict[str, Any] = {"local_hostname": "localhost", "metadata_server": "P2PHANDSHAKE",
                             "global_segment_size": DEFAULT_GLOBAL_SEGMENT_SIZE,
                             "local_buffer_size": DEFAULT_LOCAL_BUFFER_SIZE, "protocol": "tcp", "device_name": "",
                             "enable_ssd_offload": False, "ssd_offload_path": "", "tenant_id": "default",
                             "enable_client_http_server": False, "client_http_port": 9300}
"""What ``from_file`` and ``load_from_env`` take for a setting they are not given (Mooncake's)."""


def _config(get: Callable[[str, Any], Any], where: str) -> MooncakeConfig:
    """A MooncakeConfig from ``get(name, default)`` (a file's dict or the variables); refusals
    are prefixed with ``where`` (the file)."""
    def value(name: str) -> Any:
        return get(name, _DEFAULTS.get(name))

    try:
        path, tenant = value("ssd_offload_path"), value("tenant_id")
        return MooncakeConfig(
            local_hostname=value("local_hostname"), metadata_server=value("metadata_server"),
            global_segment_size=_size("global_segment_size", value("global_segment_size")),
            local_buffer_size=_size("local_buffer_size", value("local_buffer_size")),
            protocol=value("protocol"), device_name=value("device_name"),
            master_server_address=value("master_server_address"),
            enable_ssd_offload=_bool("enable_ssd_offload", value("enable_ssd_offload")),
            ssd_offload_path="" if path is None else str(path),
            tenant_id="default" if tenant is None else str(tenant),
            enable_client_http_server=_bool("enable_client_http_server", value("enable_client_http_server")),
            client_http_port=_port("client_http_port", value("client_http_port")))
    except ConfigError as exc:
        if not where:
            raise
        raise ConfigError(f"{where}{exc}") from None
