"""Tenants of one master: who they are, what they may spend, and the namespace each lives in.

A master started with a tenants file (``tidekv master --tenants-file FILE``, TOML) serves several
tenants from one index. A client names its tenant in the authentication Greeting
(``TIDEKV_TENANT``; ``tidekv.auth``) and proves that tenant's secret (its ``secret_file``, or
the master's own secret for a tenant without one); every request on that connection then acts
inside the tenant's namespace. The master prefixes what the tenant names - keys, client ids,
segment names - with ``\\0<tenant>\\0`` before anything else sees them, and strips it from what
it sends back, so the rest of the master (objects, segments, journal, replication) works on
plain names and a tenant can name nothing outside its namespace. Clients without a tenant (the
*default* tenant, the operator's) keep plain names; names beginning with a NUL byte are refused
from them once tenants exist, as they would reach into a tenant's namespace.

Where a tenant's objects live: on segments its own clients mounted, and, for a tenant that
shares the master's secret (no ``secret_file``: its engines can reach the operator's), on the
default tenant's segments too. A tenant with a secret of its own is isolated on the data path
as well: its engines and everyone else's refuse each other's connections, and nothing it stores
is placed where another tenant's process holds it.

``quota`` bounds the bytes a tenant's objects occupy (every replica, pending puts included):
a put beyond it first evicts the tenant's own least recently used objects, and fails with
``OutOfSpaceError`` naming the quota when that is not enough. Neither a put nor the quota's
eviction ever evicts another tenant's object.

The file::

    [tenants.alice]
    secret_file = "/etc/tidekv/alice.secret"   # optional: the master's secret otherwise
    quota = "64 GiB"                            # optional: unlimited otherwise

Neighbours: ``master`` (each connection's ``Namespace``, and its ``Tenancy``), ``objects``
(usage and quotas), ``segments`` (placement), ``tidekv.auth`` (the Greeting's tenant).
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
from tidekv.config import parse_size, read_secret_file
from tidekv.errors import ConfigError
from tidekv.store.wire import protocol as p
from tidekv.store.wire.names import DEFAULT, SEP, check_name, owns, plain, prefix, tenant_of

if TYPE_CHECKING:
    from tidekv.metrics import Registry
    from tidekv.store.master.objects import ObjectTable
    from tidekv.store.master.segments import Segment, SegmentTable

@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    secret: str | None = field(default=None, repr=False)  # None: the master's secret
    quota_bytes: int | None = None  # None: unlimited

    @property
    def shares_pool(self) -> bool:
        """Whether its objects may be placed on the default tenant's segments too."""
        return self.secret is None


def load(path: str, master_secret: str | None) -> dict[str, Tenant]:
    """Reads a tenants file (see the module docstring).

    Raises:
        ConfigError: it cannot be read or parsed, names a bad tenant or an unknown setting, a
            secret file cannot be read or is empty, a quota is not a size, or a tenant has a
            secret of its own while the master has none (its clients would prove a secret to a
            master that lets anyone else in without one).
    """
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"tenants file {path!r} cannot be read: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"tenants file {path!r} is not valid TOML: {exc}") from None
    unknown = set(doc) - {"tenants"}
    if unknown:
        raise ConfigError(f"tenants file {path!r}: unknown table(s) {sorted(unknown)}; tenants go under [tenants.NAME]")
    table = doc.get("tenants", {})
    if not isinstance(table, dict) or not table:
        raise ConfigError(f"tenants file {path!r} names no tenant; add a [tenants.NAME] table per tenant")
    out: dict[str, Tenant] = {}
    for name, settings in table.items():
        check_name(name, f"tenants file {path!r}: table")
        if not isinstance(settings, dict):
            raise ConfigError(f"tenants file {path!r}: tenants.{name} must be a table")
        unknown = set(settings) - {"secret_file", "quota"}
        if unknown:
            raise ConfigError(f"tenants file {path!r}: tenants.{name} has unknown setting(s) {sorted(unknown)}; "
                              "known: secret_file, quota")
        secret = None
        if "secret_file" in settings:
            secret = read_secret_file(str(settings["secret_file"]), f"tenants.{name}.secret_file")
            if master_secret is None:
                raise ConfigError(f"tenants file {path!r}: tenant {name!r} has a secret of its own but the master "
                                  "has none (TIDEKV_SECRET): anyone could connect as the default tenant; give the "
                                  "master a secret too")
            if secret == master_secret:
                raise ConfigError(f"tenants file {path!r}: tenant {name!r}'s secret is the master's; leave out "
                                  "secret_file for a tenant that shares it")
        quota = None
        if "quota" in settings:
            quota = parse_size(settings["quota"], f"tenants file {path!r}: tenants.{name}.quota", minimum=1)
        out[name] = Tenant(name, secret, quota)
    secrets = [t.secret for t in out.values() if t.secret is not None]
    if len(set(secrets)) != len(secrets):
        raise ConfigError(f"tenants file {path!r}: two tenants have the same secret; a secret names one tenant")
    return out


class Namespace:
    """One tenant's names as a connection of that tenant sends and receives them: ``enter``
    moves a request's keys, client ids and segment names into the tenant's namespace (in
    place), ``leave`` takes it out of a reply, ``text`` out of an error message; ``owns``
    tells whether an internal key is the tenant's. The default tenant's are refusals of names
    reaching into a namespace, and no-ops."""

    __slots__ = ("tenant", "_prefix", "_key_prefix", "owns")

    def __init__(self, tenant: str = DEFAULT) -> None:
        self.tenant = tenant
        self._prefix = prefix(tenant)
        self._key_prefix = self._prefix.encode()
        self.owns = owns(tenant)

    def enter(self, body: Any) -> str:
        """Moves the names ``body`` carries into this session's namespace (in place); returns
        why it may not come from this tenant ("" when it may). Only with tenants."""
        pre, kpre = self._prefix, self._key_prefix
        keys = getattr(body, "keys", None)
        if not pre:  # the default tenant: no name may reach into a tenant's namespace
            if keys and any(k[:1] == b"\0" for k in keys):
                return "keys beginning with a NUL byte are reserved for tenants' namespaces on this master"
            names = [getattr(body, f, "") for f in ("client_id", "name", "preferred_segment")]
            names += getattr(body, "segments", None) or []
            if any(n[:1] == SEP for n in names):
                return "client ids and segment names beginning with a NUL character are reserved for tenants"
            return ""
        if keys:
            body.keys = [kpre + k for k in keys]
        if getattr(body, "client_id", None) is not None:
            body.client_id = pre + body.client_id
        if isinstance(body, (p.MountSegment, p.UnmountSegment)):
            body.name = pre + body.name
        elif isinstance(body, (p.PutStart, p.PutBind)) and body.preferred_segment:
            body.preferred_segment = pre + body.preferred_segment
        elif isinstance(body, p.Heartbeat) and body.segments:
            body.segments = [pre + n for n in body.segments]
        elif isinstance(body, p.Repairs) and body.done:
            body.done = [p.RepairResult(kpre + r.key, r.token, r.ok) for r in body.done]
        elif isinstance(body, p.Spills):
            body.disks = [msgspec.structs.replace(d, name=pre + d.name) for d in body.disks]
            body.done = [msgspec.structs.replace(d, key=kpre + d.key, disk=pre + d.disk) for d in body.done]
            body.failed = [kpre + k for k in body.failed]
        elif isinstance(body, p.CreateTask):
            body.targets = [pre + n for n in body.targets]
            body.source = pre + body.source if body.source else ""
        if isinstance(getattr(body, "channel", None), str):  # a channel is named in its tenant's namespace
            body.channel = pre + body.channel
        return ""

    def leave(self, body: Any, result: Any) -> Any:
        """``result`` with this session's namespace taken out of the names it carries."""
        pre = self._prefix
        if not pre:
            return result
        if isinstance(body, (p.PutStart, p.PutBind)):
            for slot in result if isinstance(body, p.PutStart) else [result]:
                slot.locations = self._plain(slot.locations)
                if slot.spare is not None:
                    slot.spare.locations = self._plain(slot.spare.locations)
        elif isinstance(body, p.Get):
            for r in result[1]:
                r.locations = self._plain(r.locations)
                if r.disk is not None:
                    r.disk.disk = r.disk.disk[len(pre):]
        elif isinstance(body, p.Spills):
            n = len(self._key_prefix)
            for item in [*result.tasks, *result.drops, *result.promote]:
                item.key, item.disk = item.key[n:], item.disk[len(pre):]
        elif isinstance(body, p.ListKeys):
            n = len(self._key_prefix)
            result = [k[n:] for k in result[0]], result[1]
        elif isinstance(body, p.Repairs):
            n = len(self._key_prefix)
            for task in result:
                task.key, task.sources = task.key[n:], self._plain(task.sources)
        elif isinstance(body, p.ChannelTake):
            n = len(self._key_prefix)
            for item in result[1]:
                item.key, item.locations = item.key[n:], self._plain(item.locations)
        return result

    def text(self, message: str) -> str:
        """An error message without this session's prefix in the names it quotes."""
        if not self._prefix:
            return message
        return message.replace(repr(self._prefix)[1:-1], "").replace(self._prefix, "")


    def _plain(self, locations: list[p.Location]) -> list[p.Location]:
        pre = self._prefix
        return [p.Location(loc.segment[len(pre):], loc.engine, loc.addr, loc.length)
                if loc.segment.startswith(pre) else loc for loc in locations]


class Tenancy:
    """A master's tenants as its service applies them: where each tenant's objects may be
    placed (``pool``, ``may_hold``), the quotas (kept by ``objects``), watermark eviction per
    tenant pool (``evict``), a tenant's view of the stats, the secret its engines hold, and the
    per-tenant metrics. What it is given is the master's own index; it keeps no state of its own
    beyond the tenants and their pools."""

    def __init__(self, tenants: dict[str, Tenant], master_secret: str | None, objects: ObjectTable,
                 segments: SegmentTable, metrics: Registry) -> None:
        self.tenants = tenants
        self._master_secret = master_secret
        self._objects = objects
        self._segments = segments
        objects.quotas = {n: x.quota_bytes for n, x in tenants.items() if x.quota_bytes is not None}
        self._pools = {DEFAULT: frozenset((DEFAULT,))}
        for name, tenant in tenants.items():
            self._pools[name] = frozenset((name, DEFAULT)) if tenant.shares_pool else frozenset((name,))
        self._requests = metrics.counter("tidekv_tenant_requests_total", "RPC requests by tenant and type",
                                         ["tenant", "type"])
        self._quota_refusals = metrics.counter("tidekv_tenant_quota_refusals_total",
                                               "keys of puts refused for the tenant's quota", ["tenant"])
        usage = objects.usage
        metrics.gauge("tidekv_tenant_used_bytes", "bytes a tenant's objects occupy (every replica)",
                      lambda: {(("tenant", n),): usage.get(n, 0) for n in (DEFAULT, *tenants)})
        metrics.gauge("tidekv_tenant_quota_bytes", "a tenant's quota",
                      lambda: {(("tenant", n),): q for n, q in (objects.quotas or {}).items()})

    def pool(self, tenant: str) -> frozenset[str]:
        """The tenants whose segments may hold ``tenant``'s objects."""
        return self._pools[tenant]

    def may_hold(self, key: bytes, segment: Segment) -> bool:
        """Whether ``segment`` may hold a replica of the internal ``key`` (repairs)."""
        return segment.tenant in self._pools[tenant_of(key)]

    def counted(self, tenant: str, kind: str) -> None:
        self._requests.labels(tenant=tenant, type=kind).inc()

    def refused(self, tenant: str, slots: list[p.PutSlot]) -> None:
        """Counts the keys of a put ``tenant``'s quota refused."""
        refused = sum(1 for s in slots if s.status == p.Status.QUOTA)
        if refused:
            self._quota_refusals.labels(tenant=tenant).inc(refused)

    def evict(self, now: float, high: float, low: float) -> None:
        """Watermark eviction: each tenant's own segments by its own objects, and the default
        tenant's segments by the objects of the tenants placed there that have no quota (a
        quota'd one is kept in its bounds by its puts, which evict its own objects). A pool
        above ``high`` (a fraction of its capacity) is brought down to ``low``."""
        unbounded = {DEFAULT} | {n for n, x in self.tenants.items() if x.shares_pool and x.quota_bytes is None}
        for tenant in (DEFAULT, *self.tenants):
            used, cap = self._segments.pool_usage((tenant,))
            if cap and used > high * cap:
                only = (lambda k: tenant_of(k) in unbounded) if tenant == DEFAULT else owns(tenant)
                self._objects.evict(int(used - low * cap), now, only=only)

    def stats(self, namespace: Namespace, master_id: str) -> dict[str, Any]:
        """The master's stats as a tenant sees them: its own keys, clients, segments and bytes."""
        tenant = namespace.tenant
        objects, quotas = self._objects, self._objects.quotas
        assert quotas is not None
        own = [s for s in self._segments.segments.values() if s.tenant == tenant]
        return {
            "master_id": master_id,
            "tenant": tenant,
            "keys": sum(1 for k, m in objects.objects.raw_items()
                        if (type(m) is int or m.put is None) and namespace.owns(k)),
            "clients": sum(1 for c in self._segments.clients if tenant_of(c) == tenant),
            "segments": {plain(s.name): {"engine": s.engine, "capacity": s.capacity, "used": s.used} for s in own},
            "capacity_bytes": sum(s.capacity for s in own),
            "used_bytes": objects.usage.get(tenant, 0),
            "quota_bytes": quotas.get(tenant),
            "shares_pool": self.tenants[tenant].shares_pool,
        }

    def engine_secret(self, tenant: str) -> str | None:
        """The secret the engines of ``tenant``'s clients hold."""
        own = self.tenants[tenant].secret if tenant else None
        return own if own is not None else self._master_secret

    def secrets(self) -> dict[str, str | None]:
        """For ``tidekv.auth.ServerHandshake``: each tenant's own secret (None: the master's)."""
        return {n: x.secret for n, x in self.tenants.items()}
