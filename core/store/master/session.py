"""``Session``: one client connection as the master sees it, and what it may say on it.

A request naming a client must come on the connection that client said hello on, so no
connection acts for another client; a mount naming an engine on loopback from another host is
refused with what to set instead. Neighbours: ``service`` (which checks every request against
its session), ``connection`` (which makes one per connection), ``tenants`` (the namespace).
"""

from __future__ import annotations

from tidekv.hostaddr import HOST_VARIABLE, is_loopback
from tidekv.store.master import tenants as t
from tidekv.store.wire import names
from tidekv.store.wire import protocol as p


class Session:
    """One client connection as the master sees it: the tenant it proved it acts for, the client
    it said hello as, and the key listing it is paging through (``ListKeys``)."""

    __slots__ = ("__weakref__", "client_id", "listing", "listed", "namespace", "peer_host")

    def __init__(self, tenant: str = names.DEFAULT, peer_host: str | None = None) -> None:
        self.client_id: str | None = None  # as the master names it (in the tenant's namespace)
        self.listing: list[bytes] | None = None  # the keys present when the listing started
        self.listed = 0  # how many of them earlier pages covered
        self.namespace = t.Namespace(tenant)
        self.peer_host = peer_host  # the address the connection came from (None: in-process)

    @property
    def tenant(self) -> str:
        return self.namespace.tenant

    def refusal(self, body: object, client_id: str) -> str:
        """Why a request naming ``client_id`` may not come on this connection ("" when it may)."""
        kind = type(body).__name__
        if isinstance(body, p.Hello):
            if self.client_id not in (None, client_id):
                return f"this connection said hello as client {self.client_id!r}; it cannot say hello as {client_id!r}"
            return ""
        if self.client_id is None:
            return f"{kind} names client {client_id!r}, but this connection has not said hello; say hello first"
        if self.client_id != client_id:
            return (f"{kind} names client {client_id!r}, but this connection said hello as {self.client_id!r}; "
                    "a connection acts for its own client only")
        return ""

    def engine_refusal(self, engine: str) -> str:
        """Why a mount from this connection may not name ``engine`` ("" when it may): an engine on
        loopback named by a client on another host, which no other host could reach (worse: each
        would dial a process of its own host)."""
        host = engine.rpartition(":")[0]
        if self.peer_host is None or is_loopback(self.peer_host) or not is_loopback(host):
            return ""
        return (f"the segment's engine {engine} listens on loopback, but this client connected from "
                f"{self.peer_host}: no other host can reach it. Let the engine listen on this host's address: "
                f"leave the store's host (vLLM/SGLang: engine_host) unset, so that tidekv takes the interface "
                f"that routes to the master, or set ${HOST_VARIABLE}={self.peer_host}")
