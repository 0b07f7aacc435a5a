"""The one parser of each kind of value tidekv reads from flags, files and the environment: byte
sizes ("16MB"), "host:port" addresses, and where a store client finds its master (one master, an
etcd cluster, or a pool of several such groups). Every error names the setting the text came
from. Neighbours: ``tidekv.config`` (the settings classes, which validate with these and
re-export them).
"""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass
from typing import Any

from tidekv.errors import ConfigError


def parse_host_port(text: Any, what: str) -> tuple[str, int]:
    """Splits "host:port" (or "[v6]:port") into (host, port): the one address parser of tidekv.

    Raises:
        ConfigError: naming ``what`` (the setting the text came from) and the text.
    """
    host, sep, port = text.rpartition(":") if isinstance(text, str) else ("", "", "")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or any(c.isspace() or c in "[]/" for c in host) or not port.isdigit() \
            or not 0 < int(port) < 65536:
        raise ConfigError(f"{what}={text!r} is not 'host:port' (e.g. 127.0.0.1:50051)")
    return host, int(port)


def format_host_port(host: str, port: int) -> str:
    """"host:port", with an IPv6 address in brackets ("[::1]:5000"): what ``parse_host_port`` reads."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(value: Any, what: str, *, minimum: int = 0) -> int:
    """A byte count from an int or a text such as "4096", "64KiB", "16MB", "1.5g": the one size
    parser of tidekv. Units are binary whichever way they are written (K = KB = KiB = 1024, as
    Mooncake's configs mean them), case-insensitive, with an optional fraction.

    Raises:
        ConfigError: naming ``what`` and the value, when it is not a size or is below ``minimum``.
    """
    size: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    elif isinstance(value, str):
        text = value.strip().lower().removesuffix("ib").removesuffix("b")
        number = text.rstrip("kmgt")
        unit = text[len(number):]
        try:
            if unit in _SIZE_UNITS and number.strip() and not number.strip().startswith(("-", "+")):
                size = int(float(number) * _SIZE_UNITS[unit])
        except ValueError:
            size = None
    if size is None:
        raise ConfigError(f"{what}={value!r} is not a size; use bytes or a number with K, M, G or T (binary "
                          "units: 16MB = 16MiB = 16 << 20), e.g. 4096 or 16MB")
    if size < minimum:
        raise ConfigError(f"{what}={value!r} is out of range; allowed at least {minimum} bytes")
    return size


def format_size(size_bytes: int) -> str:
    """Formats a byte count with the largest binary unit that divides it: "4 KiB", "16 MiB"."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size_bytes >= scale and size_bytes % scale == 0:
            return f"{size_bytes // scale} {unit}"
    return f"{size_bytes} B"


ETCD_SCHEME = "etcd://"


@dataclass(frozen=True, slots=True)
class MasterAddress:
    """Where a store client finds its master: one master's "host:port", or the leader of a
    cluster of masters registered in etcd, written "etcd://HOST:PORT[,HOST:PORT...]/CLUSTER"."""

    address: str | None
    """The lone master's "host:port"; None for an etcd cluster."""
    etcd_endpoints: tuple[str, ...] = ()
    """etcd's client URLs ("http://host:port"), for a cluster (https once TLS settings are given:
    ``tidekv.config.EtcdSecurity.cluster_urls``)."""
    cluster: str = ""
    """The cluster's name in etcd."""

    @classmethod
    def parse(cls, text: Any, what: str = "master") -> MasterAddress:
        """Raises ConfigError naming ``what`` and the text unless it is one of the two forms."""
        if isinstance(text, str) and text.startswith(ETCD_SCHEME):
            hosts, _, cluster = text[len(ETCD_SCHEME):].partition("/")
            if not cluster or not all(c.isalnum() or c in "-_." for c in cluster):
                raise ConfigError(f"{what}={text!r} names no cluster; expected etcd://HOST:PORT[,HOST:PORT...]/NAME "
                                  "(NAME of letters, digits, '-', '_' or '.')")
            endpoints = tuple(f"http://{h}" for h in hosts.split(",") if parse_host_port(h, what))
            return cls(None, endpoints, cluster)
        parse_host_port(text, what)
        return cls(text)

    @property
    def is_cluster(self) -> bool:
        return self.address is None

    @property
    def hosts(self) -> tuple[str, ...]:
        """The hosts a client dials first: the lone master's, or the etcd members'."""
        if self.address is not None:
            return (parse_host_port(self.address, "master")[0],)
        return tuple(urllib.parse.urlsplit(e).hostname or "" for e in self.etcd_endpoints)

    def __str__(self) -> str:
        if self.address is not None:
            return self.address
        return ETCD_SCHEME + ",".join(e[len("http://"):] for e in self.etcd_endpoints) + "/" + self.cluster


POOL_SEPARATOR = ";"


@dataclass(frozen=True, slots=True)
class PoolAddress:
    """Where a store client finds its pool: one master group (a ``MasterAddress``), or several
    that share the key space (``tidekv.store.wire.pool_map``), written as the groups' addresses
    joined by ";", each optionally named: "g0=10.0.0.1:50051;g1=etcd://10.0.0.9:2379/g1". A
    group's name decides which keys it owns, so it must stay the same when the group moves;
    unnamed, a lone master is named by its "host:port" and a cluster by its etcd name."""

    groups: tuple[tuple[str, MasterAddress], ...]
    """(name, address) of each group, in the order given."""

    @classmethod
    def parse(cls, value: Any, what: str = "master") -> PoolAddress:
        """Accepts a PoolAddress, a MasterAddress, a string of either form, or a list of group
        strings. Raises ConfigError naming ``what`` for a malformed group, an empty list or two
        groups of one name."""
        if isinstance(value, PoolAddress):
            return value
        if isinstance(value, MasterAddress):
            return cls(((_group_name(value), value),))
        items = [i for i in value.split(POOL_SEPARATOR) if i.strip()] if isinstance(value, str) \
            else list(value) if value else []
        groups: list[tuple[str, MasterAddress]] = []
        for item in items:
            if isinstance(item, MasterAddress):
                groups.append((_group_name(item), item))
                continue
            text = str(item).strip()
            name, sep, rest = text.partition("=")
            if sep and not name.startswith(ETCD_SCHEME):
                if not name or not all(c.isalnum() or c in "-_.:" for c in name):
                    raise ConfigError(f"{what}={value!r}: group name {name!r} is not letters, digits, "
                                      "'-', '_', '.' or ':'")
                address = MasterAddress.parse(rest.strip(), what)
            else:
                address = MasterAddress.parse(text, what)
                name = _group_name(address)
            groups.append((name, address))
        if not groups:
            raise ConfigError(f"{what}={value!r} names no master; expected HOST:PORT, etcd://HOST:PORT/NAME, "
                              "or several groups joined by ';'")
        names = [n for n, _ in groups]
        if len(set(names)) != len(names):
            raise ConfigError(f"{what}={value!r} names a group twice ({', '.join(names)}); give each a distinct "
                              "NAME=ADDRESS")
        return cls(tuple(groups))

    @property
    def hosts(self) -> tuple[str, ...]:
        """The hosts a client dials first, every group's (``MasterAddress.hosts``)."""
        return tuple(h for _, address in self.groups for h in address.hosts)

    def __str__(self) -> str:
        return POOL_SEPARATOR.join(str(a) if n == _group_name(a) else f"{n}={a}" for n, a in self.groups)


def _group_name(address: MasterAddress) -> str:
    return address.cluster if address.is_cluster else str(address.address)


ETCD_URL_SCHEMES = ("http", "https")


def parse_etcd_endpoints(text: str, what: str = "--etcd", scheme: str = "http") -> tuple[str, ...]:
    """"http[s]://H:P[,http[s]://H:P...]" -> client URLs; an entry without a scheme takes
    ``scheme``. Raises ConfigError naming ``what`` for any other scheme or a bad "host:port"."""
    out = []
    for item in text.split(","):
        given, sep, hostport = item.strip().rpartition("://")
        given = given if sep else scheme
        if given not in ETCD_URL_SCHEMES:
            raise ConfigError(f"{what}={text!r}: {item.strip()!r} is not an etcd client URL; use http://HOST:PORT, "
                              "or https://HOST:PORT for an etcd that serves TLS")
        parse_host_port(hostport, what)
        out.append(f"{given}://{hostport}")
    return tuple(out)
