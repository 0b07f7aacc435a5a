"""Configuration of tidekv components: one frozen dataclass per component, validated on creation.

Environment variables use the prefix ``TIDEKV_`` and are read only by ``from_env()``; an invalid
value is an error, never a silent fallback. Neighbours: ``tidekv.transfer.engine`` consumes
TransferConfig; the CLI builds it from flags.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import functools
import inspect
import itertools
import os
import re
import ssl
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from tidekv.errors import ConfigError
from tidekv.values import (  # noqa: F401  (re-exported: tidekv.config is where callers find them)
    ETCD_SCHEME,
    POOL_SEPARATOR,
    MasterAddress,
    PoolAddress,
    format_size,
    parse_etcd_endpoints,
    parse_host_port,
    parse_size,
)

ENV_PREFIX = "TIDEKV_"

T = TypeVar("T")


class TransportKind(enum.Enum):
    """Which transport carries requests to a peer."""

    AUTO = "auto"  #: shared memory for same-host peers, tcp otherwise
    TCP = "tcp"  #: always tcp (e.g. to measure the cross-host path on one machine)
    SHM = "shm"  #: same-host only; requests to other hosts fail
    CUDA = "cuda"  #: same-host GPU memory only; requests with host memory on both sides fail
    FABRIC = "fabric"  #: always fabric (one-sided RDMA through libfabric); peers it cannot reach fail


_TYPES: dict[str, tuple[type, ...]] = {
    "int": (int,),
    "float": (int, float),
    "bool": (bool,),
    "str": (str,),
    "str | None": (str, type(None)),
    "TransportKind": (TransportKind,),
}


def _check_types(config: Any) -> None:
    """Raises ConfigError naming the first field whose value has the wrong type."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        allowed = _TYPES.get(str(f.type))
        if allowed is None:
            continue
        wrong_bool = isinstance(value, bool) and bool not in allowed
        if wrong_bool or not isinstance(value, allowed):
            names = " or ".join("None" if t is type(None) else t.__name__ for t in allowed)
            raise ConfigError(f"{f.name}={value!r} has type {type(value).__name__}; expected {names}")


@dataclass(frozen=True, slots=True)
class Setting:
    """What a config field declares beside its type, default and docstring (its help): the values
    it takes, and for TransferConfig the native engine option it sets. Everything else -- the
    check, the environment variable, the command-line flag, the reference page -- derives from it."""

    low: float | None = None
    high: float | None = None
    choices: tuple[str, ...] | None = None
    native: str | None = None
    """TransferConfig: the ``EngineOptions`` field it sets (default: its own name; ``*_s`` fields
    set ``*_ms``)."""


def setting(default: Any, low: float | None = None, high: float | None = None, *,
            choices: tuple[str, ...] | None = None, native: str | None = None, repr: bool = True) -> Any:
    """Declares a config field whose value must be in ``low..high`` (or one of ``choices``)."""
    return field(default=default, repr=repr, metadata={"setting": Setting(low, high, choices, native)})


def setting_of(f: dataclasses.Field[Any]) -> Setting:
    """The declaration of a field (an empty one for a field declared by its default alone)."""
    return f.metadata.get("setting") or _NO_SETTING


_NO_SETTING = Setting()


def _check_settings(config: Any) -> None:
    """Raises ConfigError naming the first field whose value has the wrong type or is outside
    its declared range or choices."""
    _check_types(config)
    for f in dataclasses.fields(config):
        declared = setting_of(f)
        value = getattr(config, f.name)
        if declared.choices is not None and value not in declared.choices:
            raise ConfigError(f"{f.name}={value!r} is invalid; allowed {', '.join(declared.choices)}")
        if declared.low is not None and declared.high is not None and not declared.low <= value <= declared.high:
            raise ConfigError(f"{f.name}={value!r} is out of range; allowed {declared.low}..{declared.high}")


FABRIC_MAX_NICS = 8
"""NICs one engine's fabric transport stripes over (native/fabric/fabric_wire.h, kMaxRails)."""


@dataclass(frozen=True, slots=True)
class TransferConfig:
    """Settings of one TransferEngine.

    Every field can be set from the environment as ``TIDEKV_<FIELD>`` (upper case) through
    ``TransferConfig.from_env()``.
    """

    transport: TransportKind = TransportKind.AUTO
    """Transport selection (auto, tcp, shm, cuda, fabric)."""
    connections_per_peer: int = setting(4, 1, 64, native="tcp.connections_per_peer")
    """tcp connections opened to each peer; slices are striped over them."""
    worker_threads: int = setting(4, 1, 256)
    """Threads that run transfer tasks."""
    slice_size_bytes: int = setting(256 << 10, 4096, 256 << 20, native="slice_bytes")
    """tcp cuts requests into slices of this size and stripes them over the peer's connections (a
    1 MiB request then moves on four at once); fabric into pieces of this size but at least 1 MiB,
    all in flight at once."""
    io_timeout_s: float = setting(30.0, 0.1, 3600, native="io_timeout_ms")
    """A socket that makes no progress for this long fails its requests."""
    socket_buffer_bytes: int = setting(4 << 20, 0, 1 << 30)
    """SO_SNDBUF/SO_RCVBUF asked for each socket (the kernel caps it)."""
    secret: str | None = setting(None, repr=False)
    """Shared secret; peers without it are refused at handshake, and peers that do not prove it
    are refused by ours. From the environment: ``TIDEKV_SECRET``, or ``TIDEKV_SECRET_FILE`` naming
    a file that holds it (``secret_from_env``). None = no check."""
    max_regions: int = setting(4096, 1, 1 << 20)
    """Capacity of the registered-region table."""
    unregister_timeout_s: float = setting(5.0, 0, 600, native="unregister_timeout_ms")
    """How long unregister() waits for a same-host peer's copy in flight."""
    inline_bytes: int = setting(1 << 20, 0, 1 << 30)
    """Same-host batches up to this size are copied before transfer() returns (on the calling
    thread: about 25 µs for 1 MiB, less than the deferred path's kernel timer costs on a VM, where
    arming and stopping it took 15 µs of a 1 MiB copy's 40)."""
    shm_parallelism: int = setting(2, 1, 64, native="shm.parallelism")
    """Threads that share one large same-host batch."""
    stream_copy_bytes: int = setting(8 << 20, 0, 1 << 50, native="shm.stream_copy_bytes")
    """Same-host batches of at least this many bytes are copied with streaming (non-temporal)
    stores, which bypass the caches: about 2x memcpy per thread once a batch outgrows them
    (``python benchmarks/copy_probe.py``). 0 = never."""
    enable_cross_memory_attach: bool = setting(True, native="shm.enable_cross_memory_attach")
    """Allow same-host peers to copy registered memory with process_vm_readv/writev."""
    busy_poll_us: int = setting(100, 0, 100_000, native="tcp.reply_spin_us")
    """tcp: poll for a reply (or the next frame) this long before sleeping; one thread per
    process at a time. Trades a little CPU for latency. 0 = never."""
    server_threads: int = setting(4, 1, 256, native="tcp.server_threads")
    """Threads that serve peers' tcp data connections (however many are open)."""
    handshake_timeout_s: float = setting(5.0, 0.05, 600, native="handshake_timeout_ms")
    """An incoming connection that has not finished its handshake by then is dropped."""
    idle_timeout_s: float = setting(300.0, 0.5, 86400, native="idle_timeout_ms")
    """A tcp data connection idle this long is closed by the server; clients retire theirs after
    half of it. Set it alike on every engine."""
    max_connections: int = setting(1024, 1, 1 << 20)
    """Incoming connections held at once (handshaking or serving); more are refused."""
    max_connections_per_peer: int = setting(64, 1, 4096)
    """Of which one peer engine may hold (it opens connections_per_peer)."""
    fabric_provider: str = setting("", native="fabric.provider")
    """The libfabric provider of the fabric transport (one-sided RDMA), as ``fi_info -l`` names
    it: "verbs" (InfiniBand/RoCE), "efa" (AWS), or a software one ("tcp", slower than the tcp
    transport: for testing). Set it alike on every engine. Default "": verbs, then efa, where
    present (with neither, fabric is unavailable and tcp carries cross-host requests)."""
    fabric_nics: str = setting("", native="fabric.nics")
    """The NICs fabric stripes over, comma-separated, as ``fi_info -p PROVIDER`` names their
    domains ("mlx5_0,mlx5_1"; for the tcp provider, interfaces), at most 8; "all": every one the
    provider offers (loopback aside). Default "": for verbs and efa every NIC with an active
    port, for a software provider the one of the engine's host address. Rail k reaches the peer's
    rail k, so name them in the same order on every host. A request goes over the NICs on its
    memory's NUMA node (all of them where none is, or the node is unknown)."""

    def __post_init__(self) -> None:
        if not isinstance(self.transport, TransportKind):
            raise ConfigError(f"transport={self.transport!r} is invalid; allowed {[k.value for k in TransportKind]}")
        _check_settings(self)
        if self.max_connections_per_peer < self.connections_per_peer:
            raise ConfigError(
                f"max_connections_per_peer={self.max_connections_per_peer} is below connections_per_peer="
                f"{self.connections_per_peer}: a peer of the same settings could not open its connections"
            )
        if self.secret is not None and not self.secret:
            raise ConfigError("secret='' is invalid; use None for no secret")
        nics = [name.strip() for name in self.fabric_nics.split(",") if name.strip()]
        if len(nics) > FABRIC_MAX_NICS or len(set(nics)) != len(nics) or ("all" in nics and len(nics) > 1):
            raise ConfigError(f"fabric_nics={self.fabric_nics!r} is invalid; name up to {FABRIC_MAX_NICS} different "
                              "NICs, comma-separated, or 'all'")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> TransferConfig:
        """Builds a config from ``TIDEKV_*`` variables; keyword overrides win over the environment.

        Raises:
            ConfigError: a variable holds a value its field cannot take.
        """
        env = environ if environ is not None else os.environ
        if "secret" not in overrides:
            overrides = {**overrides, "secret": secret_from_env(env)}
        return _from_env(cls, env, overrides)


SECRET_FILE_VARIABLE = ENV_PREFIX + "SECRET_FILE"


def secret_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """The shared secret every tidekv component uses (transfer engines, master, weights, PD):
    ``TIDEKV_SECRET``, or the contents of the file ``TIDEKV_SECRET_FILE`` names (trailing
    whitespace stripped), or None.

    Raises:
        ConfigError: both are set, the file cannot be read, or it is empty.
    """
    env = environ if environ is not None else os.environ
    secret, path = env.get(ENV_PREFIX + "SECRET"), env.get(SECRET_FILE_VARIABLE)
    if path is None:
        if secret is not None and not secret:
            raise ConfigError(f"{ENV_PREFIX}SECRET is set but empty; unset it for no secret")
        return secret
    if secret is not None:
        raise ConfigError(f"{ENV_PREFIX}SECRET and {SECRET_FILE_VARIABLE} are both set; set one")
    return read_secret_file(path, SECRET_FILE_VARIABLE)


def read_secret_file(path: str, what: str) -> str:
    """The secret a file holds (trailing whitespace stripped); ``what`` names the setting that
    gave the path. Raises ConfigError when it cannot be read or is empty."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read().rstrip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{what}={path!r} cannot be read: {exc}") from None
    if not text:
        raise ConfigError(f"{what}={path!r} is empty")
    return text


def _parse(name: str, raw: str, kind: Any) -> Any:
    """Parses env var ``name`` for a field annotated ``kind`` (a string: annotations are lazy)."""
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
        raise ConfigError(f"{name}={raw!r} is not a valid {kind}") from None
    raise ConfigError(f"{name} cannot be set from the environment")


def _from_env(cls: type[T], environ: Mapping[str, str], overrides: Mapping[str, Any], prefix: str = ENV_PREFIX) -> T:
    values = _env_values(cls, environ, prefix)
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = set(overrides) - names
    if unknown:
        raise ConfigError(f"unknown setting(s) {sorted(unknown)}; allowed {sorted(names)}")
    values.update(overrides)
    return cls(**values)


def _env_values(cls: type, environ: Mapping[str, str], prefix: str) -> dict[str, Any]:
    """The fields of ``cls`` that ``prefix<FIELD>`` variables set, parsed (not yet validated together)."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        raw = environ.get(prefix + f.name.upper())
        if raw is not None and f.name.endswith("_bytes") and f.type in (int, "int"):
            try:
                values[f.name] = int(raw, 0)
            except ValueError:  # "16MB" as well as 16777216 (or 0x1000000)
                values[f.name] = parse_size(raw, prefix + f.name.upper())
        elif raw is not None:
            values[f.name] = _parse(prefix + f.name.upper(), raw, f.type)
    return values


ETCD_ENV_PREFIX = ENV_PREFIX + "ETCD_"
ETCD_MASTER_FLAGS = ("ca_file", "cert_file", "key_file", "user", "password_file")
"""The EtcdSecurity fields ``tidekv master`` takes as ``--etcd-<field>`` flags: every one but
``password``, which a command line would show to anyone who lists processes."""
_ETCD_PASSWORD_FIELDS = frozenset({"password", "password_file"})


@dataclass(frozen=True, slots=True)
class EtcdSecurity:
    """How tidekv reaches a secured etcd: TLS (a CA, a client certificate) and an etcd user.

    One set of settings for both sides of ``tidekv.store.ha.etcd``: the masters of a cluster
    (``tidekv master --etcd-ca-file ...``, or ``TIDEKV_ETCD_<FIELD>``) and the store clients that
    find the leader through ``etcd://H:P/NAME`` (``TIDEKV_ETCD_<FIELD>``: their address has room
    for nothing else). Defaults: plain http, no user.
    """

    ca_file: str | None = None
    """PEM CAs etcd's certificate is checked against (its host name or IP must match the URL).
    Set, etcd is spoken to over https, ``etcd://`` addresses included. None: http, or the system's
    CAs for a master given https:// URLs."""
    cert_file: str | None = None
    """PEM certificate presented to etcd, for an etcd that requires one (``--client-cert-auth``);
    with ``key_file``. With etcd's authentication on as well, it must carry no Common Name: etcd's
    JSON gateway, which tidekv speaks, refuses such certificates then."""
    key_file: str | None = None
    """PEM private key of ``cert_file``."""
    user: str | None = None
    """etcd user to authenticate as (for an etcd with ``auth enable``); its role needs read and
    write on the keys under ``/tidekv/``. None = no authentication."""
    password: str | None = setting(None, repr=False)
    """The user's password, from ``TIDEKV_ETCD_PASSWORD`` (never a flag)."""
    password_file: str | None = None
    """File that holds the user's password (trailing whitespace stripped); read again each time
    tidekv authenticates, so a rotated password is picked up. Or the password itself in
    TIDEKV_ETCD_PASSWORD: never on a command line."""

    def __post_init__(self) -> None:
        _check_settings(self)
        if (self.cert_file is None) != (self.key_file is None):
            raise ConfigError(f"cert_file={self.cert_file!r}, key_file={self.key_file!r}: give both or neither; "
                              f"set {self.how_to_set('cert_file')} and {self.how_to_set('key_file')}")
        for name in ("ca_file", "cert_file", "key_file", "password_file"):
            _check_readable(name, getattr(self, name))
        if self.user == "":
            raise ConfigError("user='' is invalid; use None for no etcd authentication")
        if self.password is not None and self.password_file is not None:
            raise ConfigError(f"password and password_file={self.password_file!r} are both set; set one")
        if self.password == "":
            raise ConfigError("password='' is invalid; an etcd user has a password")
        has_password = self.password is not None or self.password_file is not None
        if self.user is not None and not has_password:
            raise ConfigError(f"user={self.user!r} has no password; set {self.how_to_set('password')}")
        if self.user is None and has_password:
            raise ConfigError(f"an etcd password is set but no user; set {self.how_to_set('user')}")
        if self.password_file is not None:
            read_secret_file(self.password_file, "password_file")

    @property
    def is_tls(self) -> bool:
        """True when etcd is reached over https because a CA or client certificate is given."""
        return self.ca_file is not None or self.cert_file is not None

    @property
    def scheme(self) -> str:
        """The scheme of etcd URLs given without one: "https" with TLS files, else "http"."""
        return "https" if self.is_tls else "http"

    def check_urls(self, urls: tuple[str, ...], what: str) -> None:
        """Raises ConfigError naming ``what`` when TLS files are set but a URL is http://."""
        plain = [u for u in urls if u.startswith("http://")]
        if self.is_tls and plain:
            raise ConfigError(f"{what}={','.join(urls)!r}: {', '.join(plain)} is plain http, but the etcd TLS "
                              "files (ca_file, cert_file) are set; use https:// URLs")

    def cluster_urls(self, address: MasterAddress) -> tuple[str, ...]:
        """The client URLs of the etcd members an ``etcd://H:P[,H:P]/NAME`` address names."""
        return tuple(f"{self.scheme}://{url.partition('://')[2]}" for url in address.etcd_endpoints)

    def client_context(self) -> ssl.SSLContext:
        """The TLS context etcd is reached with (the system's CAs when ``ca_file`` is None).

        Raises:
            ConfigError: a file holds no usable PEM certificate or key.
        """
        try:
            context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.ca_file)
            if self.cert_file is not None:
                context.load_cert_chain(self.cert_file, self.key_file)
        except (ssl.SSLError, OSError) as exc:
            raise ConfigError(f"etcd TLS files ca_file={self.ca_file!r}, cert_file={self.cert_file!r}, "
                              f"key_file={self.key_file!r} cannot be loaded: {exc}") from None
        return context

    def read_password(self) -> str:
        """The user's password (from ``password_file``, read now). Raises ConfigError as
        ``read_secret_file`` does; ``AssertionError`` when there is no user."""
        if self.password is not None:
            return self.password
        assert self.password_file is not None, "read_password() is for a user with a password"
        return read_secret_file(self.password_file, "password_file")

    @staticmethod
    def how_to_set(name: str) -> str:
        """Where an operator gives field ``name``: its variable and, for masters, its flag."""
        if name in _ETCD_PASSWORD_FIELDS:
            return (f"{ETCD_ENV_PREFIX}PASSWORD_FILE or {ETCD_ENV_PREFIX}PASSWORD "
                    "(tidekv master: --etcd-password-file)")
        return f"{ETCD_ENV_PREFIX}{name.upper()} (tidekv master: --etcd-{name.replace('_', '-')})"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, *, defaults: Mapping[str, Any] | None = None,
                 **overrides: Any) -> EtcdSecurity:
        """Builds the settings: ``defaults`` (a config file's) < ``TIDEKV_ETCD_*`` < ``overrides``
        (flags). A layer that gives the password either way replaces both of the layers below.

        Raises:
            ConfigError: a setting is unknown or invalid, or the settings do not go together.
        """
        env = environ if environ is not None else os.environ
        names = {f.name for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for layer in (defaults or {}, _env_values(cls, env, ETCD_ENV_PREFIX), overrides):
            unknown = set(layer) - names
            if unknown:
                raise ConfigError(f"unknown etcd setting(s) {sorted(unknown)}; allowed {sorted(names)}")
            if _ETCD_PASSWORD_FIELDS & layer.keys():
                values = {k: v for k, v in values.items() if k not in _ETCD_PASSWORD_FIELDS}
            values.update(layer)
        return cls(**values)


DEFAULT_MAX_BATCH_KEYS = 2048
"""The master's default max_batch_keys; clients that never say hello split their batches at it."""


@dataclass(frozen=True, slots=True)
class MasterConfig:
    """Settings of the store master (``tidekv master``); env vars ``TIDEKV_MASTER_<FIELD>``."""

    host: str = "127.0.0.1"
    """Address the RPC and HTTP listeners bind to."""
    port: int = setting(50051, 0, 65535)
    """RPC port (0 = any free port)."""
    metrics_port: int = setting(9003, -1, 65535)
    """HTTP port for /metrics and /health (0 = any free port, -1 = off)."""
    client_ttl_s: float = setting(10.0, 0.1, 86400)
    """A client silent this long is dead: its puts are reclaimed and its segments unmounted, or
    suspended (see ``suspend_grace_s``)."""
    suspend_grace_s: float = setting(60.0, 0.0, 86400)
    """How long the segments of a client declared dead stay suspended: their objects unreadable
    but kept, given back when the same holder process re-mounts (a paused or partitioned holder
    comes back), dropped after this. 0 = unmount at once."""
    lease_ttl_s: float = setting(5.0, 0.0, 3600)
    """Read lease granted by get; eviction and remove skip leased objects."""
    put_timeout_s: float = setting(60.0, 0.1, 86400)
    """A put not ended within this time is reclaimed (its space freed, its key usable)."""
    high_watermark: float = setting(0.95, 0.1, 1.0)
    """Usage ratio that starts background eviction."""
    eviction_ratio: float = setting(0.05, 0.0, 0.5)
    """Fraction of capacity freed below the watermark per eviction round."""
    disk_spill_at: float = setting(0.85, 0.0, 1.0)
    """Usage ratio of the pool's memory from which holders with disks spill their oldest objects
    to disk ahead of eviction (``store.master.disks``): an evicted object with a disk copy stays in
    the pool."""
    disk_write_through: str = setting("pinned", choices=("off", "pinned", "all"))
    """Which objects go to their holder's disk as soon as they are put, pressure or not: pinned
    ones, all (a holder's restart then loses none of its objects), or only spills under pressure."""
    disk_promote: bool = True
    """Bring objects read from a holder's disk back to its memory, into free bytes only and only
    while the pool is below ``disk_spill_at``."""
    disk_grace_s: float = setting(3600.0, 0.0, 30 * 86400)
    """How long the disks of a holder that went silent stay indexed (their objects misses) for it
    to come back and report them; dropped after."""
    max_key_bytes: int = setting(4096, 1, 1 << 20)
    """Longest key accepted."""
    max_message_bytes: int = setting(64 << 20, 1024, 1 << 31)
    """Largest RPC message accepted; larger ones are refused."""
    max_batch_keys: int = setting(DEFAULT_MAX_BATCH_KEYS, 1, 1 << 24)
    """Most keys one request may name; more are refused, and clients send larger batches in parts
    of this many. It bounds how long one request holds the master's event loop (and so delays
    everyone's heartbeats): with 65536 keys the largest admitted requests delayed a heartbeat by
    0.7 s here, with 2048 (of 4 KiB keys) by under 40 ms (``tests/store/test_master_stall.py``)."""
    frame_timeout_s: float = setting(30.0, 0.05, 3600)
    """A connection that sends nothing this long in the middle of a request is closed."""
    max_buffered_bytes: int = setting(256 << 20, 1 << 16, 1 << 40)
    """Bytes of unfinished requests the master holds over all connections; the connection that
    would pass it is closed."""
    max_pending_puts: int = setting(16384, 1, 1 << 24)
    """Puts one client may have started and not yet ended (each holds its bytes until put_end or
    ``put_timeout_s``); a PutStart beyond it is refused with ``LimitExceededError``."""
    max_spare_bytes: int = setting(256 << 10, 0, 1 << 30)
    """A client putting one object of at most this size gets a spare: a slot of the same size
    reserved for its next put, which then takes one round trip to the master instead of two
    (``store.master.objects``). Each client holds at most one; reclaimed after ``put_timeout_s`` unused.
    0 = no spares."""
    max_connections: int = setting(4096, 1, 1 << 20)
    """Client connections open at once; more are closed as they come, with a logged reason."""
    verify_mounts: str = setting("auto", choices=("auto", "on", "off"))
    """Whether a mount must prove its memory is the mounting process's own: the master asks the
    named engine to vouch for the client's proof (``tidekv.store.wire.mount_proof``) and refuses the
    mount otherwise. "on", "off", or "auto" (default): on when the master has a secret (without
    one anyone may do anything, and engines may be out of the master's reach)."""
    tick_s: float = setting(0.1, 0.001, 10)
    """Period of housekeeping (liveness, reclaim, eviction)."""
    busy_poll_us: int = setting(200, 0, 100_000)
    """After a request, poll this long for the next before sleeping (0 = never spin)."""
    state_dir: str | None = None
    """Directory of the master's journal (every index change, written before it is acknowledged):
    a lone master restarted on it comes back with every object. None = no journal (a restart
    starts empty)."""
    fold_log_bytes: int = setting(64 << 20, 4096, 1 << 40)
    """With ``state_dir``: the journal's log is folded into a new snapshot (by a forked child, the
    master serving on) once it outgrows this and ``fold_log_ratio`` times the last snapshot, which
    bounds what a restart replays."""
    fold_log_ratio: float = setting(0.5, 0.01, 100.0)
    """With ``state_dir``: a fold also waits for the log to outgrow this many times the last
    snapshot's bytes. A log replays several times slower per byte than a snapshot (the master
    benchmarks' restart rows), so this bounds a restart against one from the snapshot alone; lower
    bounds it tighter at the price of more folds, each a forked child writing the whole index."""
    etcd: str = ""
    """etcd client URLs ("http://H:P[,...]", or https:// for an etcd that serves TLS, see
    ``etcd_security``): the master campaigns for leadership of ``cluster`` and stands by when
    another leads. Empty = a lone master."""
    cluster: str = "tidekv"
    """Name of the cluster of masters in etcd (with ``etcd``)."""
    etcd_security: EtcdSecurity = field(default_factory=EtcdSecurity)
    """How the master reaches a secured etcd (TLS, an etcd user): flags ``--etcd-ca-file`` and
    the like; ``from_env`` reads ``TIDEKV_ETCD_*``, as store clients do."""
    leader_ttl_s: int = setting(3, 2, 60)
    """TTL of the leader's etcd lease: a dead leader is replaced after at most this long."""
    sync_timeout_s: float = setting(1.0, 0.05, 60)
    """A standby that has not confirmed a change this long after it was sent is dropped from the
    in-sync set (recorded in etcd first), so it can no longer become leader."""
    min_standbys: int = setting(1, 0, 8)
    """A leader acknowledges a change only once at least this many standbys hold it (and every
    in-sync one): with 1, losing the leader right after its promotion, before a standby caught
    up, loses nothing; changes wait meanwhile. 0 = a leader alone may acknowledge."""
    tls_cert_file: str | None = None
    """PEM certificate chain the master presents: with ``tls_key_file``, its RPC (and the
    replication stream) runs over TLS. None = plain TCP."""
    tls_key_file: str | None = None
    """PEM private key of ``tls_cert_file``."""
    tls_ca_file: str | None = None
    """PEM CAs that sign the clients' (and standbys') certificates: when set, every peer must
    present one (mutual TLS). A standby also checks its leader against them."""
    tenants_file: str | None = None
    """TOML file naming the master's tenants (``tidekv.store.master.tenants``): each in a namespace of
    its own, with its own secret and a quota if the file gives them. None = no tenants (every
    client shares one namespace)."""
    secret: str | None = setting(None, repr=False)
    """Shared secret every client and standby must prove (``tidekv.auth``); the master proves it
    to them too. ``from_env`` takes the transfer engines' setting (``TIDEKV_SECRET`` or
    ``TIDEKV_SECRET_FILE``), so one variable secures a whole deployment. None: anyone who reaches
    the port is served."""

    def __post_init__(self) -> None:
        _check_settings(self)
        if not isinstance(self.etcd_security, EtcdSecurity):
            raise ConfigError(f"etcd_security={self.etcd_security!r} is not an EtcdSecurity")
        if self.etcd:
            self.etcd_security.check_urls(self.etcd_urls(), "etcd")
            if self.state_dir:
                raise ConfigError("state_dir and etcd exclude each other: in a cluster the standbys hold the "
                                  "index (drop state_dir, or run a lone master)")
            MasterAddress.parse(f"etcd://127.0.0.1:1/{self.cluster}", "cluster")
            if self.host in ("0.0.0.0", "::", ""):
                raise ConfigError(f"host={self.host!r}: a master in an etcd cluster registers its address for "
                                  "clients to reach; bind a reachable address, not a wildcard")
        if self.secret is not None and not self.secret:
            raise ConfigError("secret='' is invalid; use None for no secret")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ConfigError("tls_cert_file and tls_key_file go together: give both (TLS) or neither (plain TCP)")
        if self.tls_ca_file is not None and self.tls_cert_file is None:
            raise ConfigError("tls_ca_file (mutual TLS) needs the master's own tls_cert_file and tls_key_file")
        for name in ("tls_cert_file", "tls_key_file", "tls_ca_file", "tenants_file"):
            _check_readable(name, getattr(self, name))

    def etcd_urls(self) -> tuple[str, ...]:
        """etcd's client URLs from ``etcd`` (those without a scheme take etcd_security's). Raises ConfigError."""
        return parse_etcd_endpoints(self.etcd, "etcd", self.etcd_security.scheme)

    def server_tls(self) -> ssl.SSLContext | None:
        """The TLS context the master serves with, or None for plain TCP."""
        if self.tls_cert_file is None:
            return None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.tls_cert_file, self.tls_key_file)
        if self.tls_ca_file is not None:
            context.load_verify_locations(self.tls_ca_file)
            context.verify_mode = ssl.CERT_REQUIRED
        return context

    def standby_tls(self) -> ssl.SSLContext | None:
        """The context a standby of this configuration connects to its leader with."""
        if self.tls_cert_file is None:
            return None
        return TlsConfig(True, self.tls_ca_file, self.tls_cert_file, self.tls_key_file).client_context()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> MasterConfig:
        """Builds a config from ``TIDEKV_MASTER_*`` variables (the secret from ``TIDEKV_SECRET`` or
        ``TIDEKV_SECRET_FILE``, etcd_security from ``TIDEKV_ETCD_*``); keyword overrides win."""
        env = environ if environ is not None else os.environ
        if ENV_PREFIX + "MASTER_SECRET" in env:
            raise ConfigError(f"{ENV_PREFIX}MASTER_SECRET is not a setting: the master takes {ENV_PREFIX}SECRET "
                              f"(or {SECRET_FILE_VARIABLE}), as the transfer engines do")
        if "secret" not in overrides:
            overrides = {**overrides, "secret": secret_from_env(env)}
        if "etcd_security" not in overrides:
            overrides = {**overrides, "etcd_security": EtcdSecurity.from_env(env)}
        return _from_env(cls, env, overrides, prefix=ENV_PREFIX + "MASTER_")


def _check_readable(name: str, path: str | None) -> None:
    if path is not None and not os.access(path, os.R_OK):
        raise ConfigError(f"{name}={path!r} cannot be read")


@dataclass(frozen=True, slots=True)
class TlsConfig:
    """How a client reaches the store master over TLS (Store, the proxy, the vLLM scheduler, a
    standby); env vars ``TIDEKV_TLS_<FIELD>``. The master's own side is in MasterConfig."""

    enable: bool = False
    """Connect to the master over TLS (it must serve with ``--tls-cert-file``)."""
    ca_file: str | None = None
    """PEM CAs the master's certificate is checked against (its host name or IP must match the
    address the client dials). None: the system's CAs."""
    cert_file: str | None = None
    """PEM certificate this client presents, for a master that requires one (mutual TLS)."""
    key_file: str | None = None
    """PEM private key of ``cert_file``."""

    def __post_init__(self) -> None:
        _check_settings(self)
        if (self.cert_file is None) != (self.key_file is None):
            raise ConfigError("cert_file and key_file go together: give both (mutual TLS) or neither")
        if not self.enable and (self.ca_file or self.cert_file):
            raise ConfigError("TLS files are set but enable is false; set TIDEKV_TLS_ENABLE=1 (or drop the files)")
        for name in ("ca_file", "cert_file", "key_file"):
            _check_readable(name, getattr(self, name))

    def client_context(self) -> ssl.SSLContext | None:
        """The client's TLS context, or None when TLS is off."""
        if not self.enable:
            return None
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.ca_file)
        if self.cert_file is not None:
            context.load_cert_chain(self.cert_file, self.key_file)
        return context

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> TlsConfig:
        """Builds a config from ``TIDEKV_TLS_*`` variables; keyword overrides win."""
        return _from_env(cls, environ if environ is not None else os.environ, overrides, prefix=ENV_PREFIX + "TLS_")


SEGMENT_MEMORY = ("auto", "shared", "huge")
"""Values of StoreConfig.segment_memory."""


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """Settings of a store client (``tidekv.Store``); env vars ``TIDEKV_STORE_<FIELD>``."""

    segment_size_bytes: int = setting(0, 0, 1 << 46)
    """Memory this client contributes to the pool (0 = pure client)."""
    staging_size_bytes: int = setting(64 << 20, 4096, 1 << 40)
    """Registered scratch memory for put()/get() of bytes objects."""
    replicas: int = setting(1, 1, 16)
    """Copies of each object, on distinct segments (best effort)."""
    heartbeat_interval_s: float = setting(1.0, 0.01, 3600)
    """How often the client tells the master it is alive."""
    rpc_timeout_s: float = setting(5.0, 0.01, 3600)
    """A master that does not answer one request within this time is taken as gone (the client
    looks for the leader again, see ``failover_timeout_s``)."""
    failover_timeout_s: float = setting(15.0, 0, 3600)
    """How long a request that may be retried (see ``MasterClient``) keeps looking for a master
    that answers - the leader after a failover, a restarted master - before it raises
    MasterUnavailableError or MasterNotReadyError. 0 = one attempt."""
    rpc_busy_poll_us: int = setting(50, 0, 100_000)
    """Poll this long for the master's reply before sleeping (0 = sleep at once): a reply takes
    ~20 µs, and waking a sleeping thread on a VM costs about as much again."""
    prefer_local_segment: bool = True
    """Put replicas in this client's own segment first when it has room."""
    disk_paths: str = ""
    """Directories (comma-separated, one per device) where this holder keeps a disk tier: objects
    the master evicts from memory spill to a file in each (``store.client.disk``) and stay in the
    pool; a restart with the same paths keeps them. Needs a segment. "" = no disk tier."""
    disk_size_bytes: int = setting(0, 0, 1 << 50)
    """Bytes of each of ``disk_paths`` the disk tier takes (preallocated)."""
    disk_io_threads: int = setting(4, 1, 256)
    """Disk I/Os a holder keeps in flight (spills, and reads of its records)."""
    disk_server_port: int = setting(0, 0, 65535)
    """Port of the disk server a holder with ``disk_paths`` runs on its engine's address, where
    readers on other hosts ask for disk-only objects (0 = any free one)."""
    segment_memory: str = setting("auto", choices=SEGMENT_MEMORY)
    """What backs the segment: "shared" (a memfd that same-host peers map), "huge" (private memory
    on transparent huge pages that same-host peers read by cross-memory attach; reads stay fast
    after the memory sat idle, which 4 KiB pages do not on some VMs) or "auto" (huge where THP
    is on and processes of one user may attach to each other's memory - process_vm_readv allowed,
    Yama's ptrace_scope 0 or absent, the engine's enable_cross_memory_attach on - else shared)."""

    def __post_init__(self) -> None:
        _check_settings(self)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> StoreConfig:
        """Builds a config from ``TIDEKV_STORE_*`` variables; keyword overrides win."""
        return _from_env(cls, environ if environ is not None else os.environ, overrides, prefix=ENV_PREFIX + "STORE_")


@dataclass(frozen=True, slots=True)
class WeightsConfig:
    """Settings of weight broadcast (``tidekv.weights``); env vars ``TIDEKV_WEIGHTS_<FIELD>``.

    The publisher's values of ``chunk_bytes`` and ``fanout`` are the ones that count: it hands
    them to every receiver in the pull plan.
    """

    chunk_bytes: int = setting(16 << 20, 4096, 1 << 34)
    """Unit of transfer and of fan-out: a receiver serves a chunk on once it holds it."""
    fanout: int = setting(0, 0, 1024)
    """Children per node of the distribution tree: the publisher serves ``fanout`` receivers, each
    of them ``fanout`` more, and so on (1 = a chain). 0 = every receiver reads from the publisher
    (best on one host, where reads are memory copies)."""
    window: int = setting(4, 1, 1024)
    """Chunks one receiver keeps in flight."""
    keep_versions: int = setting(2, 1, 1024)
    """Published versions the publisher keeps readable (older ones are freed once no pull holds
    them)."""
    lease_s: float = setting(300.0, 0.1, 86400)
    """How long a receiver's pull may hold a version before the publisher may free it."""
    stall_timeout_s: float = setting(10.0, 0.01, 3600)
    """A parent receiver that makes no progress for this long is bypassed: the child reads the
    rest from the publisher."""
    rpc_timeout_s: float = setting(10.0, 0.01, 3600)
    """A publisher that does not answer a control request within this time is unavailable."""

    def __post_init__(self) -> None:
        _check_settings(self)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> WeightsConfig:
        """Builds a config from ``TIDEKV_WEIGHTS_*`` variables; keyword overrides win."""
        return _from_env(cls, environ if environ is not None else os.environ, overrides, prefix=ENV_PREFIX + "WEIGHTS_")


ENV_PREFIXES: dict[type, str] = {
    TransferConfig: ENV_PREFIX,
    MasterConfig: ENV_PREFIX + "MASTER_",
    StoreConfig: ENV_PREFIX + "STORE_",
    WeightsConfig: ENV_PREFIX + "WEIGHTS_",
    TlsConfig: ENV_PREFIX + "TLS_",
    EtcdSecurity: ETCD_ENV_PREFIX,
}
"""The variable prefix each component's ``from_env()`` reads."""

SECRET_SHOWN_AS = "(set)"
"""What ``settings_sources`` shows instead of a secret's value."""


def settings_sources(cls: type, environ: Mapping[str, str] | None = None) -> list[tuple[str, Any, str]]:
    """Each setting of a component as ``from_env()`` builds it, and where its value came from.

    Args:
        cls: a component's config class (a key of ``ENV_PREFIXES``).
        environ: the environment; default ``os.environ``.

    Returns:
        ``(field, value, source)`` per field, in declaration order; source is "default" or
        "env TIDEKV_<NAME>". A field that holds another component (MasterConfig's etcd_security)
        is left out: that component has rows of its own. A field declared with ``repr=False`` (a secret) shows as
        ``SECRET_SHOWN_AS`` when set, never as its text.

    Raises:
        ConfigError: a variable holds a value its field cannot take (as ``from_env()`` would).
    """
    env = environ if environ is not None else os.environ
    prefix = ENV_PREFIXES[cls]
    config = cls.from_env(env)  # type: ignore[attr-defined]
    rows: list[tuple[str, Any, str]] = []
    for f in dataclasses.fields(config):
        if type(getattr(config, f.name)) in ENV_PREFIXES:  # a composed component: a row set of its own
            continue
        variable = prefix + f.name.upper()
        if f.name == "secret":  # one setting for every component (secret_from_env)
            variable = SECRET_FILE_VARIABLE if SECRET_FILE_VARIABLE in env else ENV_PREFIX + "SECRET"
        value = getattr(config, f.name)
        if not f.repr and value is not None:
            value = SECRET_SHOWN_AS
        rows.append((f.name, value, f"env {variable}" if variable in env else "default"))
    return rows


# ---- derived from the declarations: help text, flags, native options, the reference page ----------

OTHER_VARIABLES: dict[str, str] = {
    "TIDEKV_SECRET": "the shared secret of every component (``secret_from_env``)",
    "TIDEKV_SECRET_FILE": "a file holding it (instead of TIDEKV_SECRET)",
    "TIDEKV_HOST": "this host's address for every listener that is not given one (``tidekv.hostaddr``)",
    "TIDEKV_MASTER": "the store master engines' plugins use when their config names none (HOST:PORT or etcd://)",
    "TIDEKV_TENANT": "the tenant a store client acts as (``tidekv.store.master.tenants``)",
    "TIDEKV_CONNECTOR_CONFIG": "the vLLM connector's settings as a JSON object (``kvcache.settings``)",
    "TIDEKV_LOG_LEVEL": "DEBUG, INFO, WARNING or ERROR for tidekv's loggers and the native engine's (default INFO; "
                        "WARNING in the C ABI, whose stderr is its host program's, TensorRT-LLM's)",
    "TIDEKV_TRANSPORT": "the C ABI's (TensorRT-LLM) forced transport; Python reads it as TransferConfig.transport",
    "TIDEKV_LIBCUDA": "the CUDA driver library to load (default libcuda.so.1)",
    "TIDEKV_EVENT_LOOP": "auto (default: uvloop where it is installed), uvloop or asyncio: the event loop of "
                         "tidekv's servers (``tidekv.eventloop``)",
    "TIDEKV_LIBFABRIC": "the libfabric library to load (default libfabric.so.1)",
    "TIDEKV_FABRIC_CONFIRM_BY_READ": "1: confirm fabric writes by a read even where the provider can deliver-complete (testing)",
    "TIDEKV_FABRIC_NIC_NUMA": "NUMA nodes of fabric's NICs where sysfs does not know them (VMs report -1): "
                              "`mlx5_0=0,mlx5_1=1`",
    "TIDEKV_SHIM": "the Mooncake drop-in's switch (``tidekv.compat``)",
    "TIDEKV_BENCH_DEBUG": "1: the vLLM PD benchmark prints per-hook times",
}
"""Variables read outside the config classes (a test checks that every ``"TIDEKV_..."`` the code
names is one of these or a config field's)."""


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring (the string right below it in the class body), as one paragraph."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, after in itertools.pairwise(body):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def variable_of(cls: type, name: str) -> str:
    """The environment variable of field ``name`` of ``cls`` (``TIDEKV_SECRET`` for every secret)."""
    return ENV_PREFIX + "SECRET" if name == "secret" else ENV_PREFIXES[cls] + name.upper()


def _shown(name: str, value: Any) -> str:
    if isinstance(value, enum.Enum):
        return str(value.value)
    if name.endswith("_bytes") and isinstance(value, int) and value:
        return format_size(value)
    return repr(value) if isinstance(value, str) else str(value)


def allowed_text(cls: type, f: dataclasses.Field[Any]) -> str:
    """What field ``f`` takes, as its help says it ("1..64", "auto, on, off"), or ""."""
    declared = setting_of(f)
    if declared.choices is not None:
        return ", ".join(declared.choices)
    if declared.low is not None:
        return f"{_shown(f.name, declared.low)}..{_shown(f.name, declared.high)}"
    if f.type == "TransportKind":
        return ", ".join(k.value for k in TransportKind)
    return ""


def add_flags(parser: Any, cls: type, *, skip: tuple[str, ...] = (), only: tuple[str, ...] | None = None,
              prefix: str = "") -> None:
    """Adds ``--<prefix><field>`` to an argparse parser for each plain field of ``cls`` (not a
    secret, not a composed component, not in ``skip``; only ``only`` when given), with the
    field's docstring, default, range and variable as help; dest ``<prefix><field>`` (dashes
    as underscores); default None (unset: the environment's or the class's value stands)."""
    docs, defaults = field_docs(cls), cls()
    for f in dataclasses.fields(cls):
        value = getattr(defaults, f.name)
        if f.name in skip or (only is not None and f.name not in only) or not f.repr or type(value) in ENV_PREFIXES:
            continue
        kind = str(f.type)
        if f.name.endswith("_bytes") and kind == "int":
            parse: Any = size_flag(f"--{prefix}{f.name}".replace("_", "-"))
        else:
            parse = {"int": int, "float": float}.get(kind, str)
        text = re.sub(r"``(\w+)``", lambda m: f"--{prefix}{m.group(1)}".replace("_", "-")
                      if m.group(1) in docs else m.group(1), docs.get(f.name, ""))
        notes = [f"default {_shown(f.name, value)}"] if value not in (None, "") else []
        allowed = allowed_text(cls, f)
        if allowed and not setting_of(f).choices:
            notes.append(allowed)
        notes.append("$" + variable_of(cls, f.name))
        metavar = {"int": "N", "float": "X"}.get(kind, "FILE" if f.name.endswith("_file") else
                                                  "DIR" if f.name.endswith("_dir") else "TEXT")
        parser.add_argument(f"--{prefix}{f.name}".replace("_", "-"), dest=f"{prefix}{f.name}".replace("-", "_"),
                            type=parse, default=None, choices=setting_of(f).choices,
                            metavar=None if setting_of(f).choices else ("SIZE" if parse not in (int, float, str) else metavar),
                            help=f"{text.rstrip('.')} ({'; '.join(notes)})".replace("%", "%%"))


def size_flag(flag: str) -> Any:
    """An argparse ``type`` reading ``flag``'s value through the one size parser (1024, 64KiB, 4GiB)."""

    def parse(text: str) -> int:
        import argparse

        try:
            return parse_size(text, flag)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def native_options(config: TransferConfig, options: Any) -> Any:
    """Sets every field of the native ``EngineOptions`` that a TransferConfig field declares
    (``Setting.native``; seconds become milliseconds, a transport its name, no secret "")."""
    for f in dataclasses.fields(config):
        *sections, name = native_name(f).split(".")
        target = functools.reduce(getattr, sections, options)  # a transport's own section: options.fabric
        setattr(target, name, native_value(f, getattr(config, f.name)))
    return options


def native_option_names(options: Any) -> set[str]:
    """Every option of a native ``EngineOptions`` by its dotted name ("io_timeout_ms",
    "fabric.provider"): a transport's section is an object of options itself."""
    names = set()
    for name in dir(options):
        if name.startswith("_"):
            continue
        value = getattr(options, name)
        if isinstance(value, (str, int, float, bool)):
            names.add(name)
        elif not callable(value):
            names |= {f"{name}.{inner}" for inner in native_option_names(value)}
    return names


def native_name(f: dataclasses.Field[Any]) -> str:
    """The ``EngineOptions`` field a TransferConfig field sets."""
    return setting_of(f).native or (f.name[:-2] + "_ms" if f.name.endswith("_s") else f.name)


def native_value(f: dataclasses.Field[Any], value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if value is None:
        return ""
    return round(value * 1000) if f.name.endswith("_s") else value


def settings_markdown() -> str:
    """The reference page of every setting and variable (docs/settings.md), from the declarations."""
    lines = ["# Settings", "",
             "Generated from the declarations in `core/config.py` by `tidekv doctor --settings-reference`; a test checks",
             "that this page is current. Each component reads its variables in `from_env()`; flags of",
             "`tidekv master` / `tidekv up` carry the same names (`--lease-ttl-s` for `lease_ttl_s`).", ""]
    for cls in ENV_PREFIXES:
        docs, defaults = field_docs(cls), cls()
        lines += [f"## {cls.__name__}", "", (cls.__doc__ or "").strip().splitlines()[0], "",
                  "| variable | default | allowed | what |", "|---|---|---|---|"]
        for f in dataclasses.fields(cls):
            value = getattr(defaults, f.name)
            if type(value) in ENV_PREFIXES:
                continue
            shown = "(none)" if value in (None, "") else f"`{_shown(f.name, value)}`"
            what = re.sub(r"``([^`]+)``", r"`\1`", docs.get(f.name, "")).replace("|", r"\|")
            lines.append(f"| `{variable_of(cls, f.name)}` | {shown} | {allowed_text(cls, f)} | {what} |")
        lines.append("")
    lines += ["## Other variables", "", "| variable | what |", "|---|---|"]
    lines += [f"| `{name}` | {text} |" for name, text in OTHER_VARIABLES.items()]
    return "\n".join(lines) + "\n"



def capi_settings_header() -> str:
    """The C ABI's reader of every TransferConfig setting (plugins/trtllm/capi/settings.gen.h), from
    the declarations: one call per field, naming its variable, its range and the native field."""
    calls = []
    for f in dataclasses.fields(TransferConfig):
        declared, native, variable = setting_of(f), native_name(f), variable_of(TransferConfig, f.name)
        if f.name in ("transport", "secret"):
            continue  # read by hand: the transports of the build; the secret's two variables
        if f.type == "bool":
            calls.append(f'  r.flag("{variable}", o.{native});')
        elif f.type == "str":
            calls.append(f'  r.text("{variable}", o.{native});')
        elif f.name.endswith("_s"):
            calls.append(f'  r.seconds("{variable}", {declared.low!r}, {declared.high!r}, o.{native});')
        else:
            calls.append(f'  r.integer("{variable}", {int(declared.low or 0)}LL, {int(declared.high or 0)}LL, o.{native});')
    return "\n".join([
        "// Generated from tidekv.config.TransferConfig by `tidekv doctor --settings-reference capi`; a test",
        "// checks it is current. Do not edit: change the declaration in core/config.py.",
        "#pragma once",
        "",
        "#include \"common/context.h\"",
        "",
        "namespace tidekv::capi {",
        "",
        "// Reads every declared setting's TIDEKV_* variable into `o` through `r` (options.cpp's reader,",
        "// which refuses a value outside the declared range, naming the variable).",
        "template <typename Reader>",
        "void read_declared_settings(const Reader& r, EngineOptions& o) {",
        *calls,
        "}",
        "",
        "}  // namespace tidekv::capi",
        "",
    ])
