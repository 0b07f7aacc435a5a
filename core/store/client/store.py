"""Store: the client of the tidekv KV-cache pool.

A Store contributes a segment of its own memory to the pool (``segment_size``; 0 = pure client)
and puts and gets objects by key. The master only says *where*: this client moves the bytes
itself through its TransferEngine (same-host peers: shared memory; others: tcp), by the put and
read protocol of ``object_io`` (two-phase puts, reads under a lease). The zero-copy calls take a
buffer or a list of buffers (parts): the object is then the parts' concatenation, written by
gathering them and read by scattering into them (one transfer request per part and replica).

A pool may be sharded over several master groups (``master`` = "g0=H:P;g1=H:P;..."): the Store
then contributes an equal share of its segment to each group, and every batch call goes to the
groups owning its keys in parallel (``pool``).

Neighbours: ``object_io`` (moving the bytes), ``membership`` (the segment, mounted and
heartbeated; re-mounts after the master lost this client), ``master_client`` (the master,
followed across failovers), ``pool`` (the groups), ``staging`` (scratch memory for bytes
objects), ``tensors``, ``tasks`` and ``segments`` (base classes: the tensor, task and
extra-segment calls). Thread-safe.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from tidekv.config import MasterAddress, PoolAddress, StoreConfig, TlsConfig, TransferConfig
from tidekv.errors import ConfigError, ObjectLeasedError, ObjectNotFoundError, StoreError, TransferError
from tidekv.hostaddr import advertised_host
from tidekv.store.client.disk_reads import DiskReader
from tidekv.store.client.disk_tier import DiskTierParts
from tidekv.store.client.master_client import MasterClient
from tidekv.store.client.membership import Member
from tidekv.store.client.object_io import ObjectIO, Parts, Pieces, Span, batch_error, in_order, span_of, trim
from tidekv.store.client.pool import Pool, pick
from tidekv.store.client.read_buffers import ReadBuffers
from tidekv.store.client.segments import SegmentCalls
from tidekv.store.client.staging import StagingArea
from tidekv.store.client.tasks import TaskCalls
from tidekv.store.client.tensors import TensorCalls
from tidekv.store.wire import names
from tidekv.store.wire import protocol as p
from tidekv.store.wire.keys import Buffer, Key, buffer_span, key_bytes, show_key
from tidekv.store.wire.protocol import Pin, Status
from tidekv.transfer.engine import TransferEngine
from tidekv.transfer.region import Region

logger = logging.getLogger(__name__)

Allocate = Callable[[bytes, int], Any]
"""``get_many_allocated``'s callback: (key, object size) -> the buffer or parts to read it into."""


@dataclasses.dataclass(frozen=True, slots=True)
class ObjectInfo:
    """What the master knows of one complete object (``Store.lookup_many``)."""

    size_bytes: int
    """The object's size."""
    locations: tuple[p.Location, ...]
    """Its replicas: segment, holder engine, address and length of each."""
    disk: p.DiskCopy | None = None
    """Where it is on a holder's disk, when memory no longer holds it (``locations`` empty)."""


@dataclasses.dataclass(frozen=True, slots=True)
class _Group:
    """This Store in one master group: the group's client, this Store's segment there, and the
    put and read protocol against it."""

    rpc: MasterClient
    member: Member
    io: ObjectIO


_CARVE_ALIGN = 4096
"""A segment carved between groups gives each a multiple of this many bytes."""



def _summed(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two masters' stats added up: numbers summed, dicts (per segment, per tenant) merged."""
    out = dict(a)
    for name, value in b.items():
        mine = out.get(name)
        if isinstance(value, dict) and isinstance(mine, dict):
            out[name] = _summed(mine, value)
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and \
                isinstance(mine, (int, float)) and not isinstance(mine, bool):
            out[name] = mine + value
        elif name not in out:
            out[name] = value
    return out


class Store(TensorCalls, TaskCalls, SegmentCalls):
    """A connection to a tidekv master plus this process's share of the pool.

    Use ``Store.connect(...)``; close with ``close()`` or a ``with`` block.
    """

    def __init__(
        self,
        master: str | MasterAddress | PoolAddress | Sequence[str],
        config: StoreConfig,
        engine: TransferEngine,
        owns_engine: bool,
        tls: TlsConfig | None = None,
        tenant: str | None = None,
    ) -> None:
        self.config = config
        self.client_id = uuid.uuid4().hex[:16]
        self.engine = engine
        self._owns_engine = owns_engine
        self._pool = Pool(master, self.client_id, timeout_s=config.rpc_timeout_s,
                          failover_timeout_s=config.failover_timeout_s, busy_poll_us=config.rpc_busy_poll_us,
                          register=True, secret=engine.config.secret, tls=tls, tenant=tenant)
        self._closed = threading.Event()
        self._groups: list[_Group] = []
        self._staging: StagingArea | None = None
        self.read_buffers = ReadBuffers(engine)  # memory reads into new tensors land in (channels' takes)
        self._disk: DiskTierParts | None = None
        n = len(self._pool)
        group_config = config if n == 1 else dataclasses.replace(
            config, segment_size_bytes=config.segment_size_bytes // n // _CARVE_ALIGN * _CARVE_ALIGN)
        if config.segment_size_bytes > 0 and group_config.segment_size_bytes == 0:
            self._pool.close()
            raise ConfigError(f"segment_size={config.segment_size_bytes} is too small to carve between {n} master "
                              f"groups ({_CARVE_ALIGN} bytes each at least)")
        try:
            # Memory first: the master declares a client dead after client_ttl_s of silence, and
            # a large segment can take longer than that to fault in.
            for rpc in self._pool.clients:
                member = Member(rpc, engine, self.client_id, group_config)
                self._groups.append(_Group(rpc, member, ObjectIO(rpc, engine, self.client_id, config.replicas,
                                                                 member.count_lease_expiry)))
            self._staging = StagingArea(engine, config.staging_size_bytes)
            if config.disk_paths:
                self._disk = DiskTierParts.open(config, engine, self._staging, n)
            reader = DiskReader(engine, self._staging, config.rpc_timeout_s, engine.config.secret,
                                self._disk.tier if self._disk is not None else None)
            for group in self._groups:
                group.io.disk_reader = reader
            self._reader = reader
            self._pool.connect()
            for group in self._groups:
                group.member.mount()
        except BaseException:
            if self._disk is not None:
                self._disk.close()
            self._pool.close()
            if owns_engine:
                engine.close()
            else:
                self._release_memory()
            raise
        for group in self._groups:
            group.member.start()
        if self._disk is not None:
            self._disk.start(self._groups[0].rpc, self.client_id, config.heartbeat_interval_s, self.segment_name)

    @property
    def segment_name(self) -> str:
        """This client's segment in the pool ("" for a pure client): ``preferred_segment`` names
        it (in a sharded pool, its share in every group has this name)."""
        return self._groups[0].member.segment_name if self._groups else ""

    @property
    def groups(self) -> tuple[str, ...]:
        """The names of the pool's master groups (one for an unsharded pool)."""
        return self._pool.names

    # The first group's parts (an unsharded pool's only ones), for tests and tools.
    @property
    def _rpc(self) -> MasterClient:
        return self._groups[0].rpc

    @property
    def _member(self) -> Member:
        return self._groups[0].member

    @property
    def _io(self) -> ObjectIO:
        return self._groups[0].io

    @classmethod
    def connect(
        cls,
        master: str | MasterAddress | PoolAddress | Sequence[str] = "127.0.0.1:50051",
        segment_size: int | None = None,
        *,
        config: StoreConfig | None = None,
        engine: TransferEngine | None = None,
        transfer_config: TransferConfig | None = None,
        host: str | None = None,
        port: int = 0,
        tls: TlsConfig | None = None,
        tenant: str | None = None,
    ) -> Store:
        """Connects to the master at ``master`` and mounts a segment.

        Args:
            master: a lone master's "host:port", or "etcd://H:P[,H:P...]/CLUSTER" for the
                leader of a cluster of masters (followed across failovers), or several such
                groups sharing the key space, joined by ";" and optionally named
                ("g0=H:P;g1=etcd://H:P/g1"; ``tidekv.config.PoolAddress``).
            segment_size: bytes of this process's memory to contribute (0: pure client);
                overrides ``config.segment_size_bytes``.
            config: client settings (default ``StoreConfig.from_env()``).
            engine: an existing TransferEngine to share (default: a new one on ``host``).
            transfer_config: settings for the new engine.
            host: address the new engine listens on and advertises (peers must reach it there);
                default ``$TIDEKV_HOST``, else the local address that routes to the master
                (loopback for a master on loopback): ``tidekv.hostaddr``.
            port: port the new engine listens on (0: any free one).
            tls: how to reach the master over TLS (default ``TlsConfig.from_env()``: plain TCP
                unless ``TIDEKV_TLS_ENABLE`` is set).
            tenant: the tenant to act for on a master with tenants (``tidekv.store.master.tenants``;
                its secret is the engine's, ``TIDEKV_SECRET``); default ``TIDEKV_TENANT``,
                "" for none.

        Raises:
            MasterUnavailableError: the master does not answer (or TLS with it failed).
            ProtocolVersionError: the master speaks another protocol version.
            AuthenticationError: the master and this store's engine do not share the secret.
        """
        cfg = config if config is not None else StoreConfig.from_env()
        if segment_size is not None:
            cfg = dataclasses.replace(cfg, segment_size_bytes=segment_size)
        owns = engine is None
        tls_config = tls if tls is not None else TlsConfig.from_env()
        tenant = names.tenant_from_env() if tenant is None else tenant and names.check_name(tenant)
        if engine is None:
            address = PoolAddress.parse(master)
            engine = TransferEngine(host=advertised_host(host, address.hosts), port=port, config=transfer_config)
        return cls(master, cfg, engine, owns, tls_config, tenant)

    # ---- bytes API ----------------------------------------------------------------------

    def put(self, key: Key, data: bytes | bytearray | memoryview, *, pin: Pin = Pin.NONE, replicas: int | None = None,
            preferred_segment: str | None = None) -> None:
        """Stores ``data`` under ``key``. Putting an existing key is a successful no-op.

        ``preferred_segment`` names the segment to place the first replica in when it has room
        (a Store's ``segment_name``; default: this client's own when ``prefer_local_segment``).

        Raises:
            OutOfSpaceError: no room even after eviction.
            TransferError: the bytes could not be written (the put was revoked).
            MasterUnavailableError: the master does not answer.
        """
        self.put_many([key], [data], pin=pin, replicas=replicas, preferred_segment=preferred_segment)

    def upsert(self, key: Key, data: bytes | bytearray | memoryview, *, pin: Pin = Pin.NONE,
               replicas: int | None = None, preferred_segment: str | None = None) -> None:
        """Stores ``data`` under ``key``, replacing any existing value atomically."""
        self.put_many([key], [data], pin=pin, replicas=replicas, upsert=True, preferred_segment=preferred_segment)

    def put_many(
        self,
        keys: Sequence[Key],
        values: Sequence[bytes | bytearray | memoryview],
        *,
        pin: Pin = Pin.NONE,
        replicas: int | None = None,
        upsert: bool = False,
        preferred_segment: str | None = None,
    ) -> None:
        """Stores several objects in one master round trip per phase.

        Raises:
            StoreError or TransferError (or a subclass): some keys failed; ``err.failed_keys``
                maps each failed key (as bytes) to its error, the other keys were stored.
        """
        if len(keys) != len(values):
            raise ConfigError(f"put_many got {len(keys)} keys but {len(values)} values")
        views = [memoryview(v).cast("B") for v in values]
        total = sum(v.nbytes for v in views)
        with self._staging.borrow(max(total, 1)) as area:
            spans, offset = [], 0
            for v in views:
                area.view()[offset : offset + v.nbytes] = v
                spans.append([(area.address + offset, v.nbytes)])
                offset += v.nbytes
            self._put([key_bytes(k) for k in keys], spans, pin, replicas, upsert, preferred_segment)

    def get(self, key: Key) -> bytes:
        """Returns the bytes stored under ``key``.

        Raises:
            ObjectNotFoundError: no complete object under ``key``.
            LeaseExpiredError: the read outlived its lease (retry).
            TransferError: no replica could be read.
        """
        out = self.get_many([key])[0]
        if out is None:
            raise ObjectNotFoundError(f"no object under key {show_key(key)}", key=key)
        return out

    def get_many(self, keys: Sequence[Key]) -> list[bytes | None]:
        """Returns each key's bytes, or None for keys that do not exist."""
        all_keys = [key_bytes(k) for k in keys]

        def share(group: int, positions: list[int]) -> list[bytes | None]:
            bkeys, io = pick(all_keys, positions), self._groups[group].io
            lease_deadline, results = io.locate(bkeys)
            total = sum(r.size for r in results if r.status == Status.OK)
            out: list[bytes | None] = [None] * len(bkeys)
            with self._staging.borrow(max(total, 1)) as area:
                spans: list[Pieces | None] = []
                offset = 0
                for r in results:
                    spans.append([(area.address + offset, r.size, 0)] if r.status == Status.OK else None)
                    offset += r.size if r.status == Status.OK else 0
                io.read(bkeys, results, spans, lease_deadline)
                view = area.view()
                for i, span in enumerate(spans):
                    if span is not None:
                        start = span[0][0] - area.address
                        out[i] = bytes(view[start : start + span[0][1]])
            return out

        return self._pool.fan_out(all_keys, share, "get")

    # ---- zero-copy API ------------------------------------------------------------------

    def register(self, buffer: Any) -> Region:
        """Registers memory for put_from/get_into (see TransferEngine.register)."""
        return self.engine.register(buffer)

    def unregister(self, region: Region) -> None:
        self.engine.unregister(region)

    def put_from(self, key: Key, buffer: Buffer | Parts, *, pin: Pin = Pin.NONE, replicas: int | None = None,
                 preferred_segment: str | None = None) -> None:
        """Stores the bytes of a registered buffer, or the concatenation of a list of them (no
        copy on this side)."""
        self._put([key_bytes(key)], [span_of(buffer)], pin, replicas, False, preferred_segment)

    def put_many_from(self, keys: Sequence[Key], buffers: Sequence[Buffer | Parts], *, pin: Pin = Pin.NONE,
                      replicas: int | None = None, upsert: bool = False, preferred_segment: str | None = None) -> None:
        """Batch put_from: one master round trip per phase, one transfer batch. Failures as for
        put_many (``err.failed_keys``)."""
        if len(keys) != len(buffers):
            raise ConfigError(f"put_many_from got {len(keys)} keys but {len(buffers)} buffers")
        self._put([key_bytes(k) for k in keys], [span_of(b) for b in buffers], pin, replicas, upsert,
                        preferred_segment)

    def get_into(self, key: Key, buffer: Buffer | Parts) -> int:
        """Reads the object into a registered buffer (or a list of them, filled in order);
        returns its size.

        Raises:
            ObjectNotFoundError, LeaseExpiredError, TransferError: as for get().
            ConfigError: the buffer is smaller than the object.
        """
        n = self.get_many_into([key], [buffer])[0]
        if n is None:
            raise ObjectNotFoundError(f"no object under key {show_key(key)}", key=key)
        return n

    def get_many_into(self, keys: Sequence[Key], buffers: Sequence[Buffer | Parts]) -> list[int | None]:
        """Batch get_into; returns each object's size, or None for keys that do not exist.

        Raises:
            ConfigError: some buffers are smaller than their objects (nothing was read;
                ``err.failed_keys`` names those keys).
            LeaseExpiredError, StoreError or TransferError: as for get(); ``err.failed_keys``
                names the keys whose bytes were not read.
        """
        if len(keys) != len(buffers):
            raise ConfigError(f"get_many_into got {len(keys)} keys but {len(buffers)} buffers")
        all_keys = [key_bytes(k) for k in keys]
        return self._pool.fan_out(
            all_keys, lambda g, pos: self._get_into(self._groups[g].io, pick(all_keys, pos), pick(buffers, pos)),
            "get")

    def _get_into(self, io: ObjectIO, bkeys: list[bytes], buffers: Sequence[Buffer | Parts]) -> list[int | None]:
        """get_many_into of keys of one group."""
        lease_deadline, results = io.locate(bkeys)
        spans: list[Pieces | None] = []
        too_small: dict[bytes, StoreError | TransferError] = {}
        for key, r, buf in zip(bkeys, results, buffers):
            if r.status != Status.OK:
                spans.append(None)
                continue
            parts = span_of(buf)
            if len(parts) == 1:  # one buffer: no need to cut it into pieces
                address, length = parts[0]
                spans.append([(address, min(length, r.size), 0)])
            else:
                length = sum(n for _, n in parts)
                spans.append(in_order(trim(parts, r.size)))
            if length < r.size:
                too_small[key] = ConfigError(  # type: ignore[assignment]
                    f"buffer of {length} bytes is too small for object {show_key(key)} of {r.size} bytes")
        if too_small:
            raise batch_error("get", too_small)
        io.read(bkeys, results, spans, lease_deadline)
        return [r.size if r.status == Status.OK else None for r in results]

    def get_ranges_into(self, keys: Sequence[Key], ranges: Sequence[Sequence[tuple[int, Buffer]]]) -> list[int | None]:
        """Reads byte ranges of objects into registered buffers, in one lookup and one transfer
        batch: for key ``i``, each ``(offset, buffer)`` of ``ranges[i]`` receives the object's
        bytes ``[offset, offset + len(buffer))``. Returns each object's size, or None for keys
        that do not exist.

        Raises:
            ConfigError: some ranges pass their object's end (nothing was read;
                ``err.failed_keys`` names those keys).
            LeaseExpiredError, StoreError or TransferError: as for get_many_into.
        """
        if len(keys) != len(ranges):
            raise ConfigError(f"get_ranges_into got {len(keys)} keys but {len(ranges)} lists of ranges")
        all_keys = [key_bytes(k) for k in keys]
        return self._pool.fan_out(
            all_keys, lambda g, pos: self._get_ranges(self._groups[g].io, pick(all_keys, pos), pick(ranges, pos)),
            "get")

    def _get_ranges(self, io: ObjectIO, bkeys: list[bytes],
                    ranges: Sequence[Sequence[tuple[int, Buffer]]]) -> list[int | None]:
        """get_ranges_into of keys of one group."""
        lease_deadline, results = io.locate(bkeys)
        pieces: list[Pieces | None] = []
        outside: dict[bytes, StoreError | TransferError] = {}
        for key, r, key_ranges in zip(bkeys, results, ranges):
            if r.status != Status.OK:
                pieces.append(None)
                continue
            mine: Pieces = []
            for offset, buf in key_ranges:
                address, length = buffer_span(buf)
                if offset < 0 or offset + length > r.size:
                    outside[key] = ConfigError(  # type: ignore[assignment]
                        f"range [{offset}, +{length}) is outside object {show_key(key)} of {r.size} bytes")
                elif length > 0:
                    mine.append((address, length, offset))
            pieces.append(mine)
        if outside:
            raise batch_error("get", outside)
        io.read(bkeys, results, pieces, lease_deadline)
        return [r.size if r.status == Status.OK else None for r in results]

    def get_many_allocated(self, keys: Sequence[Key], allocate: Allocate) -> list[Any]:
        """Reads objects whose sizes the caller does not know, in one lookup and one transfer
        batch: ``allocate(key, size)`` returns the registered buffer (or parts) to read each found
        object into, or raises to refuse it. Returns what ``allocate`` returned per key, None for
        keys that do not exist. The tensor calls read through this.

        Raises:
            TidekvError: ``allocate`` refused some keys (nothing was read; ``err.failed_keys``
                names them); else as for get_many_into.
        """
        all_keys = [key_bytes(k) for k in keys]
        return self._pool.fan_out(
            all_keys, lambda g, pos: self._get_allocated(self._groups[g].io, pick(all_keys, pos), allocate), "get")

    def _get_allocated(self, io: ObjectIO, bkeys: list[bytes], allocate: Allocate) -> list[Any]:
        lease_deadline, results = io.locate(bkeys)
        out: list[Any] = [None] * len(bkeys)
        refused: dict[bytes, StoreError | TransferError] = {}
        for i, (key, r) in enumerate(zip(bkeys, results)):
            if r.status == Status.OK:
                try:
                    out[i] = allocate(key, r.size)
                    if sum(n for _, n in span_of(out[i])) < r.size:
                        raise ConfigError(f"allocate() gave a buffer too small for object {show_key(key)} of "
                                          f"{r.size} bytes")
                except (StoreError, TransferError, ConfigError) as exc:
                    refused[key] = exc  # type: ignore[assignment]
        if refused:
            raise batch_error("get", refused)
        spans: list[Pieces | None] = [None if b is None else in_order(trim(span_of(b), r.size))
                                      for b, r in zip(out, results)]
        io.read(bkeys, results, spans, lease_deadline)
        return out

    # ---- metadata API -------------------------------------------------------------------

    def exists(self, key: Key) -> bool:
        return self.exists_many([key])[0]

    def exists_many(self, keys: Sequence[Key]) -> list[bool]:
        """Whether each key holds a complete object (one round trip; grants no lease)."""
        return self._pool.exists_many(keys)

    def exists_leased(self, keys: Sequence[Key]) -> list[bool]:
        """Whether each key holds a complete object, taking a read lease on each that does (see
        ``lookup_many``): what a load planned on the answer needs."""
        return self._pool.exists_leased(keys)

    def lookup_many(self, keys: Sequence[Key]) -> list[ObjectInfo | None]:
        """Each key's size and replicas (None: no complete object), in one round trip. Unlike
        exists_many this takes a read lease on every object found, as get does: for the master's
        lease_ttl_s, remove() without force and eviction leave them alone."""
        all_keys = [key_bytes(k) for k in keys]

        def share(group: int, positions: list[int]) -> list[ObjectInfo | None]:
            _, results = self._groups[group].io.locate(pick(all_keys, positions))
            return [ObjectInfo(r.size, tuple(r.locations), r.disk) if r.status == Status.OK else None for r in results]

        return self._pool.fan_out(all_keys, share, "lookup")

    def locate_many(self, keys: Sequence[Key]) -> list[list[str]]:
        """Names of the transfer engines whose segments hold each key's replicas (empty: no
        complete object); one round trip, grants no lease."""
        return self._pool.locate_many(keys)

    def remove(self, key: Key, *, force: bool = False) -> None:
        """Deletes an object.

        Raises:
            ObjectNotFoundError: no such object.
            ObjectLeasedError: a reader holds a lease (``force=True`` removes anyway).
        """
        status = self.remove_many([key], force=force)[0]
        if status == Status.NOT_FOUND:
            raise ObjectNotFoundError(f"no object under key {show_key(key)}", key=key)
        if status == Status.LEASED:
            raise ObjectLeasedError(f"object {show_key(key)} is leased by a reader; retry later or force=True", key=key)

    def remove_many(self, keys: Sequence[Key], *, force: bool = False) -> list[Status]:
        """Deletes objects; returns per key Status.OK, NOT_FOUND or LEASED."""
        all_keys = [key_bytes(k) for k in keys]
        return self._pool.fan_out(all_keys, lambda g, pos: [
            Status(s) for s in self._groups[g].rpc.call(p.Remove(pick(all_keys, pos), force))], "remove")

    def keys(self, page_keys: int = 1024) -> Iterator[bytes]:
        """Every key of a complete object, as the master held them when the listing began (a key
        removed meanwhile is skipped, one put meanwhile is not listed), in pages of
        ``page_keys`` (at most the master's max_batch_keys). One listing at a time per Store:
        a second ``keys()`` started before the first is exhausted ends the first.

        Raises:
            MasterUnavailableError: the master did not answer.
            ConfigError: the listing was lost (the connection to the master changed, e.g. after a
                failover, or another listing of this Store started): list again.
        """
        for group in self._groups:
            start = True
            while True:
                page, is_last = group.rpc.call(p.ListKeys(start, page_keys))
                start = False
                yield from page
                if is_last:
                    break

    def stats(self) -> dict[str, Any]:
        """The master's view of the pool (keys, segments, usage, evictions) and this engine's
        counters (and, on a holder with disks, its own tier's under ``disk_tier``). In a sharded
        pool the masters' numbers are summed over the groups and each group's own view is under
        ``groups`` (by name)."""
        views = self._pool.call_each(p.StatsRequest())
        out = dict(views[0])
        if len(views) > 1:
            for view in views[1:]:
                out = _summed(out, view)
            out["master_id"] = ",".join(str(v["master_id"]) for v in views)
            out["groups"] = dict(zip(self._pool.names, (dict(v) for v in views)))
        out["transfer"] = self.engine.stats()
        if self._disk is not None and not self._disk.closed:
            tier = self._disk.tier
            out["disk_tier"] = {"paths": tier.paths, "direct": tier.direct, "capacity": tier.capacity, "used": tier.used,
                                "reads_served": self._disk.server.served}
        return out

    # ---- lifecycle ----------------------------------------------------------------------

    def close(self) -> None:
        """Unmounts this client's segment (its objects leave the pool) and disconnects."""
        if self._closed.is_set():
            return
        self._closed.set()
        for group in self._groups:
            group.member.stop()
        if self._disk is not None:
            self._disk.close()
        self._reader.close()
        for group in self._groups:
            try:
                group.rpc.call(p.Disconnect(self.client_id), timeout_s=min(self.config.rpc_timeout_s, 2.0),
                               failover_timeout_s=0)
            except StoreError as exc:
                logger.warning("store client %s: master %s not told of disconnect: %s", self.client_id,
                               group.rpc.address, exc)
        self._pool.close()
        if self._owns_engine:
            self.engine.close()
        else:
            self._release_memory()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals ----------------------------------------------------------------------

    def _release_memory(self) -> None:
        self.read_buffers.close()
        if self._staging is not None:
            self._staging.close()
            self._staging = None
        for group in self._groups:
            group.member.release()

    def _put(self, keys: list[bytes], spans: list[Span], pin: Pin, replicas: int | None, upsert: bool,
             preferred_segment: str | None) -> None:
        preferred = self._placement(preferred_segment)

        def share(group: int, positions: list[int]) -> tuple[()]:
            self._groups[group].io.put(pick(keys, positions), pick(spans, positions), pin, replicas, upsert,
                                       preferred)
            return ()

        self._pool.fan_out(keys, share, "put")

    def _placement(self, preferred_segment: str | None) -> str:
        """The segment a put asks for: the one named, else this client's own where it has one and
        ``prefer_local_segment`` is on ("": any)."""
        if preferred_segment is None:
            return self.segment_name if self.config.prefer_local_segment else ""
        return preferred_segment
