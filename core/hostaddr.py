"""The address this process is reached at: what every tidekv listener binds and advertises.

An explicit setting wins (a component's own, else ``$TIDEKV_HOST``). Otherwise the address of
the local interface that routes to the peers this process talks to first (its master, an etcd
member), as vLLM's ``get_ip()`` and Mooncake's ``LOCAL_HOSTNAME`` pick it; loopback only when
every peer named is on loopback. With no peer named, a library object (a bare
``TransferEngine``) listens on loopback, while an engine plugin (whose peers are other
machines' by design) takes the interface of the default route. A wildcard ("0.0.0.0", "::") is
refused: a listener advertises the address it binds, and a peer told "0.0.0.0" dials itself.
Neighbours: ``tidekv.values`` (parses "host:port"), ``tidekv.doctor`` (says what was chosen).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
from collections.abc import Mapping, Sequence

from tidekv.errors import ConfigError

logger = logging.getLogger(__name__)

HOST_VARIABLE = "TIDEKV_HOST"
"""The environment variable naming the address every tidekv listener of this process binds and
advertises, unless the component's own setting names one."""

LOOPBACK = "127.0.0.1"

_DEFAULT_ROUTE_PROBE = ("8.8.8.8", "2001:4860:4860::8888")
"""Public addresses whose route is the default route (vLLM's ``get_ip()`` asks the same): a UDP
socket connected to one picks the interface without sending anything."""


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or "localhost") names this machine's loopback."""
    if host.lower() in ("localhost", "localhost.localdomain", "ip6-localhost"):
        return True
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)  # "::ffff:127.0.0.1", as a dual-stack socket names a v4 peer
    return (mapped or address).is_loopback


def is_wildcard(host: str) -> bool:
    """Whether ``host`` is a bind-everything address ("0.0.0.0", "::", "")."""
    if not host:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return False


def route_source(peer: str) -> str:
    """The local address the kernel would send from to reach ``peer`` (an address or a name).

    Raises:
        ConfigError: ``peer`` does not resolve, or no route leads to it.
    """
    try:
        infos = socket.getaddrinfo(peer.strip("[]"), 9, type=socket.SOCK_DGRAM)
    except OSError as exc:
        raise ConfigError(f"cannot resolve {peer!r} to pick the local address that reaches it: {exc}; "
                          f"set ${HOST_VARIABLE} to this host's address") from None
    error: OSError | None = None
    for family, _, _, _, sockaddr in infos:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            try:
                s.connect(sockaddr)  # a route lookup; UDP sends nothing until written to
                return str(s.getsockname()[0])
            except OSError as exc:
                error = exc
    raise ConfigError(f"no route from this host to {peer!r} ({error}); set ${HOST_VARIABLE} to the address "
                      "peers reach this host at")


def default_route_source() -> str | None:
    """The address of the default route's interface, or None when there is no default route."""
    for probe in _DEFAULT_ROUTE_PROBE:
        try:
            return route_source(probe)
        except ConfigError:
            continue
    return None


def advertised_host(explicit: str | None = None, toward: Sequence[str] | None = (), *,
                    setting: str = "host", environ: Mapping[str, str] | None = None) -> str:
    """The address a listener of this process binds and advertises.

    Args:
        explicit: the component's own setting (None or "" = not set).
        toward: the hosts of the peers this process talks to first (a master's, etcd
            members'): loopback when all are loopback, else the local address that routes to the
            first other one. None = the peers are unknown and on other machines (an engine
            plugin with no master): the default route's interface, loopback if there is none.
        setting: the name of the component's setting, for messages.
        environ: where ``$TIDEKV_HOST`` is read (default ``os.environ``).

    Raises:
        ConfigError: a wildcard address (naming where it came from), or no route to a peer.
    """
    env = os.environ if environ is None else environ
    for name, value in ((setting, explicit), (f"${HOST_VARIABLE}", env.get(HOST_VARIABLE))):
        if value is None or value == "":
            continue
        if is_wildcard(value):
            unset = name if name == f"${HOST_VARIABLE}" else f"{name} and ${HOST_VARIABLE}"
            raise ConfigError(f"{name}={value!r} is a wildcard: tidekv advertises the address it listens on, and "
                              "a peer told to dial a wildcard dials itself; give this host's address (e.g. "
                              f"10.0.0.5), or leave {unset} unset to use the interface that routes to the master")
        return value.strip("[]")
    if toward is None:
        found = default_route_source()
        if found is None:
            logger.warning("no default route and no peer named: %s on %s, where peers on other hosts cannot reach "
                           "it; set $%s (or the component's own setting) to this host's address", setting, LOOPBACK,
                           HOST_VARIABLE)
        return found or LOOPBACK
    remote = [h.strip("[]") for h in toward if h and not is_loopback(h)]
    if not remote:
        return "::1" if toward and all(h.strip("[]") == "::1" for h in toward) else LOOPBACK
    return route_source(remote[0])
