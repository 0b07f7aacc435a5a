"""A MasterService on a fake clock, driven through its wire entry point (no sockets, no sleeping).

``ServiceRig`` encodes each request in an Envelope, passes it to ``MasterService.handle`` and
decodes the reply, so these tests exercise the same decode/dispatch path as the server. Time
only moves when a test calls ``advance``. Neighbours: ``test_master_service`` uses it.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import msgspec
from tidekv.config import MasterConfig
from tidekv.store.master.journal import JournalFile, Mirror
from tidekv.store.master.mount_check import PendingMount
from tidekv.store.master.service import MasterService
from tidekv.store.master.session import Session
from tidekv.store.wire import protocol as p
from tidekv.store.wire.protocol import Pin, Status

SEGMENT_BASE = 0x10_0000_0000


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class RpcFailed(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind, self.message = kind, message


class ServiceRig:
    def __init__(self, **config: Any) -> None:
        self.clock = FakeClock()
        # Its engines are names only: mounts are not checked with them unless a test asks.
        self.config = MasterConfig(**{"port": 0, "metrics_port": -1, "verify_mounts": "off", **config})
        self.service = MasterService(self.config, clock=self.clock)
        # Past its start-up grace: a master with no segment then answers puts with OUT_OF_SPACE,
        # not "not ready" (test_master_service covers the grace itself).
        self.clock.now += self.config.client_ttl_s
        self._ids = itertools.count(1)
        self._bases = itertools.count(SEGMENT_BASE, 1 << 36)
        self.bases: dict[str, int] = {}  # segment name -> its base (a name is always mounted at one base)
        # With tenants: the connection (Session) each client's requests come on, as a tenant's
        # would after its handshake; requests of clients not named here come on none.
        self.sessions: dict[str, Session] = {}

    def as_tenant(self, client: str, tenant: str) -> None:
        """From now on ``client``'s requests come on a connection of ``tenant``."""
        self.sessions[client] = Session(tenant)

    def call(self, body: msgspec.Struct, client: str | None = None) -> Any:
        """Sends ``body`` on ``client``'s connection (default: the one of the client it names)."""
        request_id = next(self._ids)
        session = self.sessions.get(client if client is not None else getattr(body, "client_id", ""))
        answer = self.service.handle(p.encode(p.Envelope(p.PROTOCOL_VERSION, request_id, body)), session)
        if isinstance(answer, PendingMount):  # checked here and now, as the server does off its loop
            try:
                answer.run()
                error: BaseException | None = None
            except Exception as exc:  # noqa: BLE001 - the check's outcome goes to the service
                error = exc
            answer = self.service.checked(answer, error)
        reply = p.decode_reply(answer)
        assert reply.request_id == request_id
        if reply.error_kind:
            raise RpcFailed(reply.error_kind, reply.error)
        return reply.result

    def advance(self, seconds: float, tick: bool = True) -> None:
        self.clock.now += seconds
        if tick:
            self.service.tick()

    # ---- one-line requests ----------------------------------------------------------------

    def hello(self, client: str) -> str:
        return self.call(p.Hello(client, p.PROTOCOL_VERSION))

    def mount(self, client: str, name: str, capacity: int, incarnation: str = "") -> p.MountResult:
        """Mounts ``name`` (engine ``engine-of-<name>``, at the same base every time); without an
        incarnation the segment is unmounted, not suspended, when the client lapses."""
        base = self.bases.setdefault(name, next(self._bases))
        return msgspec.convert(self.call(p.MountSegment(client, name, f"engine-of-{name}", base, capacity, incarnation)),
                               p.MountResult)

    def heartbeat(self, client: str) -> bool:
        return self.call(p.Heartbeat(client))

    def put_start(self, client: str, key: bytes, size: int, *, replicas: int = 1, preferred: str = "",
                  pin: Pin = Pin.NONE, upsert: bool = False) -> p.PutSlot:
        raw = self.call(p.PutStart(client, [key], [size], replicas, preferred, int(pin), upsert))
        return msgspec.convert(raw, list[p.PutSlot])[0]

    def put_end(self, client: str, key: bytes, token: int) -> Status:
        return Status(self.call(p.PutEnd(client, [key], [token]))[0])

    def put(self, client: str, key: bytes, size: int, **kwargs: Any) -> p.PutSlot:
        """put_start + put_end; returns the slot (status OK unless the start was refused)."""
        slot = self.put_start(client, key, size, **kwargs)
        if slot.status == Status.OK:
            assert self.put_end(client, key, slot.token) == Status.OK
        return slot

    def get(self, key: bytes, client: str | None = None) -> p.GetResult:
        lease, raw = self.call(p.Get([key]), client)
        assert lease == self.config.lease_ttl_s
        return msgspec.convert(raw, list[p.GetResult])[0]

    def exists(self, key: bytes, client: str | None = None) -> bool:
        return self.call(p.Exists([key]), client)[0]

    def remove(self, key: bytes, force: bool = False, client: str | None = None) -> Status:
        return Status(self.call(p.Remove([key], force), client)[0])

    def stats(self, client: str | None = None) -> dict[str, Any]:
        return self.call(p.StatsRequest(), client)

    def alive(self, *keys: bytes) -> set[bytes]:
        return {k for k in keys if self.exists(k)}


def flush_journal(rig: ServiceRig, journal: JournalFile) -> None:
    """Appends what ``rig``'s master changed since the last call to ``journal``."""
    _, ops = rig.service.take_ops()
    if ops:
        journal.append(ops)


def reloaded(path: Path) -> ServiceRig:
    """A master (lease 0) serving what the journal in ``path`` holds, as after a restart."""
    journal = JournalFile(path)
    mirror = Mirror(0.0)
    journal.load(mirror, 0.0)
    journal.resume()
    journal.close()
    restored = ServiceRig(lease_ttl_s=0.0)
    restored.service.restore(mirror)
    return restored
