"""Configuration of tidekv components: one frozen dataclass per component, validated on creation.

Environment variables use the prefix ``TIDEKV_`` and are read only by ``from_env()``; an invalid
value is an error, never a silent fallback. Neighbours: ``tidekv.transfer.engine`` consumes
TransferConfig; the CLI builds it from flags.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from tidekv.errors import ConfigError
from tidekv.values import (  # noqa: F401  (re-exported: tidekv.config is where callers find them)
    ETCD_SCHEME,
    MasterAddress,
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
    """Transport selection (auto, tcp, shm, cuda, fabric). Default auto."""
    connections_per_peer: int = 4
    """tcp connections opened to each peer; slices are striped over them. Default 4 (1..64)."""
    worker_threads: int = 4
    """Threads that run transfer tasks. Default 4 (1..256)."""
    slice_size_bytes: int = 256 << 10
    """tcp cuts requests into slices of this size and stripes them over the peer's connections (a
    1 MiB request then moves on four at once); fabric into pieces of this size but at least 1 MiB,
    all in flight at once. Default 256 KiB (4 KiB..256 MiB)."""
    io_timeout_s: float = 30.0
    """A socket that makes no progress for this long fails its requests. Default 30 s (0.1..3600)."""
    socket_buffer_bytes: int = 4 << 20
    """SO_SNDBUF/SO_RCVBUF asked for each socket (the kernel caps it). Default 4 MiB."""
    secret: str | None = field(default=None, repr=False)
    """Shared secret; peers without it are refused at handshake, and peers that do not prove it
    are refused by ours. From the environment: ``TIDEKV_SECRET``, or ``TIDEKV_SECRET_FILE`` naming
    a file that holds it (``secret_from_env``). Default None (no check)."""
    max_regions: int = 4096
    """Capacity of the registered-region table. Default 4096 (1..1048576)."""
    unregister_timeout_s: float = 5.0
    """How long unregister() waits for a same-host peer's copy in flight. Default 5 s (0..600)."""
    inline_bytes: int = 1 << 20
    """Same-host batches up to this size are copied before transfer() returns (on the calling
    thread: about 25 µs for 1 MiB, less than the deferred path's kernel timer costs on a VM, where
    arming and stopping it took 15 µs of a 1 MiB copy's 40). Default 1 MiB."""
    shm_parallelism: int = 2
    """Threads that share one large same-host batch. Default 2 (1..64)."""
    stream_copy_bytes: int = 8 << 20
    """Same-host batches of at least this many bytes are copied with streaming (non-temporal)
    stores, which bypass the caches: about 2x memcpy per thread once a batch outgrows them
    (``python benchmarks/copy_probe.py``). Default 8 MiB (0 = never)."""
    enable_cross_memory_attach: bool = True
    """Allow same-host peers to copy registered memory with process_vm_readv/writev. Default True."""
    busy_poll_us: int = 100
    """tcp: poll for a reply (or the next frame) this long before sleeping; one thread per
    process at a time. Trades a little CPU for latency. Default 100 µs (0 = never)."""
    server_threads: int = 4
    """Threads that serve peers' tcp data connections (however many are open). Default 4 (1..256)."""
    handshake_timeout_s: float = 5.0
    """An incoming connection that has not finished its handshake by then is dropped. Default 5 s."""
    idle_timeout_s: float = 300.0
    """A tcp data connection idle this long is closed by the server; clients retire theirs after
    half of it. Set it alike on every engine. Default 300 s (0.5..86400)."""
    max_connections: int = 1024
    """Incoming connections held at once (handshaking or serving); more are refused. Default 1024."""
    max_connections_per_peer: int = 64
    """Of which one peer engine may hold (it opens connections_per_peer). Default 64 (1..4096)."""
    fabric_provider: str = ""
    """The libfabric provider of the fabric transport (one-sided RDMA), as ``fi_info -l`` names
    it: "verbs" (InfiniBand/RoCE), "efa" (AWS), or a software one ("tcp", slower than the tcp
    transport: for testing). Set it alike on every engine. Default "": verbs, then efa, where
    present (with neither, fabric is unavailable and tcp carries cross-host requests)."""

    def __post_init__(self) -> None:
        if not isinstance(self.transport, TransportKind):
            raise ConfigError(f"transport={self.transport!r} is invalid; allowed {[k.value for k in TransportKind]}")
        _check_types(self)
        _check_range("connections_per_peer", self.connections_per_peer, 1, 64)
        _check_range("worker_threads", self.worker_threads, 1, 256)
        _check_range("slice_size_bytes", self.slice_size_bytes, 4096, 256 << 20)
        _check_range("io_timeout_s", self.io_timeout_s, 0.1, 3600)
        _check_range("socket_buffer_bytes", self.socket_buffer_bytes, 0, 1 << 30)
        _check_range("max_regions", self.max_regions, 1, 1 << 20)
        _check_range("unregister_timeout_s", self.unregister_timeout_s, 0, 600)
        _check_range("inline_bytes", self.inline_bytes, 0, 1 << 30)
        _check_range("shm_parallelism", self.shm_parallelism, 1, 64)
        _check_range("stream_copy_bytes", self.stream_copy_bytes, 0, 1 << 50)
        _check_range("busy_poll_us", self.busy_poll_us, 0, 100_000)
        _check_range("server_threads", self.server_threads, 1, 256)
        _check_range("handshake_timeout_s", self.handshake_timeout_s, 0.05, 600)
        _check_range("idle_timeout_s", self.idle_timeout_s, 0.5, 86400)
        _check_range("max_connections", self.max_connections, 1, 1 << 20)
        _check_range("max_connections_per_peer", self.max_connections_per_peer, 1, 4096)
        if self.max_connections_per_peer < self.connections_per_peer:
            raise ConfigError(
                f"max_connections_per_peer={self.max_connections_per_peer} is below connections_per_peer="
                f"{self.connections_per_peer}: a peer of the same settings could not open its connections"
            )
        if self.secret is not None and not self.secret:
            raise ConfigError("secret='' is invalid; use None for no secret")

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

    One set of settings for both sides of ``tidekv.store.etcd``: the masters of a cluster
    (``tidekv master --etcd-ca-file ...``, or ``TIDEKV_ETCD_<FIELD>``) and the store clients that
    find the leader through ``etcd://H:P/NAME`` (``TIDEKV_ETCD_<FIELD>``: their address has room
    for nothing else). Defaults: plain http, no user.
    """

    ca_file: str | None = None
    """PEM CAs etcd's certificate is checked against (its host name or IP must match the URL).
    Set, etcd is spoken to over https, ``etcd://`` addresses included. Default None: http, or the
    system's CAs for a master given https:// URLs."""
    cert_file: str | None = None
    """PEM certificate presented to etcd, for an etcd that requires one (``--client-cert-auth``);
    with ``key_file``. With etcd's authentication on as well, it must carry no Common Name: etcd's
    JSON gateway, which tidekv speaks, refuses such certificates then. Default None."""
    key_file: str | None = None
    """PEM private key of ``cert_file``. Default None."""
    user: str | None = None
    """etcd user to authenticate as (for an etcd with ``auth enable``); its role needs read and
    write on the keys under ``/tidekv/``. Default None (no authentication)."""
    password: str | None = field(default=None, repr=False)
    """The user's password, from ``TIDEKV_ETCD_PASSWORD`` (never a flag). Default None."""
    password_file: str | None = None
    """File that holds the user's password (trailing whitespace stripped); read again each time
    tidekv authenticates, so a rotated password is picked up. Default None."""

    def __post_init__(self) -> None:
        _check_types(self)
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
    """Address the RPC and HTTP listeners bind to. Default 127.0.0.1."""
    port: int = 50051
    """RPC port (0 = any free port). Default 50051."""
    metrics_port: int = 9003
    """HTTP port for /metrics and /health (0 = any free port, -1 = off). Default 9003."""
    client_ttl_s: float = 10.0
    """A client silent this long is dead: its puts are reclaimed and its segments unmounted, or
    suspended (see ``suspend_grace_s``). Default 10 s."""
    suspend_grace_s: float = 60.0
    """How long the segments of a client declared dead stay suspended: their objects unreadable
    but kept, given back when the same holder process re-mounts (a paused or partitioned holder
    comes back), dropped after this. 0 = unmount at once. Default 60 s (0..86400)."""
    lease_ttl_s: float = 5.0
    """Read lease granted by get; eviction and remove skip leased objects. Default 5 s."""
    put_timeout_s: float = 60.0
    """A put not ended within this time is reclaimed (its space freed, its key usable). Default 60 s."""
    high_watermark: float = 0.95
    """Usage ratio that starts background eviction. Default 0.95 (0.1..1.0)."""
    eviction_ratio: float = 0.05
    """Fraction of capacity freed below the watermark per eviction round. Default 0.05 (0..0.5)."""
    max_key_bytes: int = 4096
    """Longest key accepted. Default 4096 bytes."""
    max_message_bytes: int = 64 << 20
    """Largest RPC message accepted; larger ones are refused. Default 64 MiB."""
    max_batch_keys: int = DEFAULT_MAX_BATCH_KEYS
    """Most keys one request may name; more are refused, and clients send larger batches in parts
    of this many. It bounds how long one request holds the master's event loop (and so delays
    everyone's heartbeats): with 65536 keys the largest admitted requests delayed a heartbeat by
    0.7 s here, with 2048 (of 4 KiB keys) by under 40 ms (``tests/store/test_master_stall.py``).
    Default 2048."""
    frame_timeout_s: float = 30.0
    """A connection that sends nothing this long in the middle of a request is closed. Default 30 s."""
    max_buffered_bytes: int = 256 << 20
    """Bytes of unfinished requests the master holds over all connections; the connection that
    would pass it is closed. Default 256 MiB."""
    max_pending_puts: int = 16384
    """Puts one client may have started and not yet ended (each holds its bytes until put_end or
    ``put_timeout_s``); a PutStart beyond it is refused with ``LimitExceededError``. Default 16384."""
    max_spare_bytes: int = 256 << 10
    """A client putting one object of at most this size gets a spare: a slot of the same size
    reserved for its next put, which then takes one round trip to the master instead of two
    (``store.objects``). Each client holds at most one; reclaimed after ``put_timeout_s`` unused.
    Default 256 KiB (0 = no spares)."""
    max_connections: int = 4096
    """Client connections open at once; more are closed as they come, with a logged reason. Default 4096."""
    verify_mounts: str = "auto"
    """Whether a mount must prove its memory is the mounting process's own: the master asks the
    named engine to vouch for the client's proof (``tidekv.store.mount_proof``) and refuses the
    mount otherwise. "on", "off", or "auto" (default): on when the master has a secret (without
    one anyone may do anything, and engines may be out of the master's reach)."""
    tick_s: float = 0.1
    """Period of housekeeping (liveness, reclaim, eviction). Default 0.1 s."""
    busy_poll_us: int = 200
    """After a request, poll this long for the next before sleeping (0 = never spin). Default 200 µs."""
    state_dir: str | None = None
    """Directory of the master's journal (every index change, written before it is acknowledged):
    a lone master restarted on it comes back with every object. None = no journal (a restart
    starts empty). Default None."""
    etcd: str = ""
    """etcd client URLs ("http://H:P[,...]", or https:// for an etcd that serves TLS, see
    ``etcd_security``): the master campaigns for leadership of ``cluster`` and stands by when
    another leads. Empty = a lone master. Default empty."""
    cluster: str = "tidekv"
    """Name of the cluster of masters in etcd (with ``etcd``). Default "tidekv"."""
    etcd_security: EtcdSecurity = field(default_factory=EtcdSecurity)
    """How the master reaches a secured etcd (TLS, an etcd user): flags ``--etcd-ca-file`` and
    the like; ``from_env`` reads ``TIDEKV_ETCD_*``, as store clients do. Default: http, no user."""
    leader_ttl_s: int = 3
    """TTL of the leader's etcd lease: a dead leader is replaced after at most this long. Default 3 s (2..60)."""
    sync_timeout_s: float = 1.0
    """A standby that has not confirmed a change this long after it was sent is dropped from the
    in-sync set (recorded in etcd first), so it can no longer become leader. Default 1 s."""
    min_standbys: int = 1
    """A leader acknowledges a change only once at least this many standbys hold it (and every
    in-sync one): with 1, losing the leader right after its promotion, before a standby caught
    up, loses nothing; changes wait meanwhile. 0 = a leader alone may acknowledge. Default 1 (0..8)."""
    tls_cert_file: str | None = None
    """PEM certificate chain the master presents: with ``tls_key_file``, its RPC (and the
    replication stream) runs over TLS. Default None (plain TCP)."""
    tls_key_file: str | None = None
    """PEM private key of ``tls_cert_file``. Default None."""
    tls_ca_file: str | None = None
    """PEM CAs that sign the clients' (and standbys') certificates: when set, every peer must
    present one (mutual TLS). A standby also checks its leader against them. Default None."""
    tenants_file: str | None = None
    """TOML file naming the master's tenants (``tidekv.store.tenants``): each in a namespace of
    its own, with its own secret and a quota if the file gives them. None = no tenants (every
    client shares one namespace). Default None."""
    secret: str | None = field(default=None, repr=False)
    """Shared secret every client and standby must prove (``tidekv.auth``); the master proves it
    to them too. ``from_env`` takes the transfer engines' setting (``TIDEKV_SECRET`` or
    ``TIDEKV_SECRET_FILE``), so one variable secures a whole deployment. Default None (anyone
    who reaches the port is served)."""

    def __post_init__(self) -> None:
        _check_types(self)
        _check_range("port", self.port, 0, 65535)
        _check_range("leader_ttl_s", self.leader_ttl_s, 2, 60)
        _check_range("sync_timeout_s", self.sync_timeout_s, 0.05, 60)
        _check_range("min_standbys", self.min_standbys, 0, 8)
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
        _check_range("metrics_port", self.metrics_port, -1, 65535)
        _check_range("client_ttl_s", self.client_ttl_s, 0.1, 86400)
        _check_range("suspend_grace_s", self.suspend_grace_s, 0.0, 86400)
        _check_range("lease_ttl_s", self.lease_ttl_s, 0.0, 3600)
        _check_range("put_timeout_s", self.put_timeout_s, 0.1, 86400)
        _check_range("high_watermark", self.high_watermark, 0.1, 1.0)
        _check_range("eviction_ratio", self.eviction_ratio, 0.0, 0.5)
        _check_range("max_key_bytes", self.max_key_bytes, 1, 1 << 20)
        _check_range("max_message_bytes", self.max_message_bytes, 1024, 1 << 31)
        _check_range("max_batch_keys", self.max_batch_keys, 1, 1 << 24)
        _check_range("frame_timeout_s", self.frame_timeout_s, 0.05, 3600)
        _check_range("max_buffered_bytes", self.max_buffered_bytes, 1 << 16, 1 << 40)
        _check_range("max_connections", self.max_connections, 1, 1 << 20)
        _check_range("max_pending_puts", self.max_pending_puts, 1, 1 << 24)
        _check_range("max_spare_bytes", self.max_spare_bytes, 0, 1 << 30)
        if self.verify_mounts not in ("auto", "on", "off"):
            raise ConfigError(f"verify_mounts={self.verify_mounts!r}: choose auto, on or off")
        _check_range("tick_s", self.tick_s, 0.001, 10)
        _check_range("busy_poll_us", self.busy_poll_us, 0, 100_000)
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
    """Connect to the master over TLS (it must serve with ``--tls-cert-file``). Default off."""
    ca_file: str | None = None
    """PEM CAs the master's certificate is checked against (its host name or IP must match the
    address the client dials). Default None: the system's CAs."""
    cert_file: str | None = None
    """PEM certificate this client presents, for a master that requires one (mutual TLS). Default None."""
    key_file: str | None = None
    """PEM private key of ``cert_file``. Default None."""

    def __post_init__(self) -> None:
        _check_types(self)
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

    segment_size_bytes: int = 0
    """Memory this client contributes to the pool (0 = pure client). Default 0."""
    staging_size_bytes: int = 64 << 20
    """Registered scratch memory for put()/get() of bytes objects. Default 64 MiB."""
    replicas: int = 1
    """Copies of each object, on distinct segments (best effort). Default 1 (1..16)."""
    heartbeat_interval_s: float = 1.0
    """How often the client tells the master it is alive. Default 1 s."""
    rpc_timeout_s: float = 5.0
    """A master that does not answer one request within this time is taken as gone (the client
    looks for the leader again, see ``failover_timeout_s``). Default 5 s."""
    failover_timeout_s: float = 15.0
    """How long a request that may be retried (see ``MasterClient``) keeps looking for a master
    that answers - the leader after a failover, a restarted master - before it raises
    MasterUnavailableError or MasterNotReadyError. 0 = one attempt. Default 15 s."""
    rpc_busy_poll_us: int = 50
    """Poll this long for the master's reply before sleeping (0 = sleep at once): a reply takes
    ~20 µs, and waking a sleeping thread on a VM costs about as much again. Default 50 µs."""
    prefer_local_segment: bool = True
    """Put replicas in this client's own segment first when it has room. Default True."""
    segment_memory: str = "auto"
    """What backs the segment: "shared" (a memfd that same-host peers map), "huge" (private memory
    on transparent huge pages that same-host peers read by cross-memory attach; reads stay fast
    after the memory sat idle, which 4 KiB pages do not on some VMs) or "auto" (huge where THP
    is on and processes of one user may attach to each other's memory - process_vm_readv allowed,
    Yama's ptrace_scope 0 or absent, the engine's enable_cross_memory_attach on - else shared).
    Default auto."""

    def __post_init__(self) -> None:
        _check_types(self)
        if self.segment_memory not in SEGMENT_MEMORY:
            raise ConfigError(f"segment_memory={self.segment_memory!r} is not one of {', '.join(SEGMENT_MEMORY)}")
        _check_range("segment_size_bytes", self.segment_size_bytes, 0, 1 << 46)
        _check_range("staging_size_bytes", self.staging_size_bytes, 4096, 1 << 40)
        _check_range("replicas", self.replicas, 1, 16)
        _check_range("heartbeat_interval_s", self.heartbeat_interval_s, 0.01, 3600)
        _check_range("rpc_timeout_s", self.rpc_timeout_s, 0.01, 3600)
        _check_range("failover_timeout_s", self.failover_timeout_s, 0, 3600)
        _check_range("rpc_busy_poll_us", self.rpc_busy_poll_us, 0, 100_000)

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

    chunk_bytes: int = 16 << 20
    """Unit of transfer and of fan-out: a receiver serves a chunk on once it holds it. Default 16 MiB."""
    fanout: int = 0
    """Children per node of the distribution tree: the publisher serves ``fanout`` receivers, each
    of them ``fanout`` more, and so on (1 = a chain). 0 = every receiver reads from the publisher
    (best on one host, where reads are memory copies). Default 0."""
    window: int = 4
    """Chunks one receiver keeps in flight. Default 4."""
    keep_versions: int = 2
    """Published versions the publisher keeps readable (older ones are freed once no pull holds
    them). Default 2."""
    lease_s: float = 300.0
    """How long a receiver's pull may hold a version before the publisher may free it. Default 300 s."""
    stall_timeout_s: float = 10.0
    """A parent receiver that makes no progress for this long is bypassed: the child reads the
    rest from the publisher. Default 10 s."""
    rpc_timeout_s: float = 10.0
    """A publisher that does not answer a control request within this time is unavailable. Default 10 s."""

    def __post_init__(self) -> None:
        _check_types(self)
        _check_range("chunk_bytes", self.chunk_bytes, 4096, 1 << 34)
        _check_range("fanout", self.fanout, 0, 1024)
        _check_range("window", self.window, 1, 1024)
        _check_range("keep_versions", self.keep_versions, 1, 1024)
        _check_range("lease_s", self.lease_s, 0.1, 86400)
        _check_range("stall_timeout_s", self.stall_timeout_s, 0.01, 3600)
        _check_range("rpc_timeout_s", self.rpc_timeout_s, 0.01, 3600)

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
