"""Publisher: the trainer side of weight broadcast.

``publish(version)`` copies the current tensors into a fresh buffer registered with the transfer
engine (the snapshot; the trainer may change its tensors right after) and makes it pullable.
Receivers learn the layout and their place in the fan-out tree over a small control channel
(``tidekv.channel``, authenticated with the engine's secret), then read the bytes one-sidedly --
the publisher's CPU does nothing per byte.

A snapshot is immutable until freed. The newest ``keep_versions`` snapshots stay; older ones are
freed once no pull holds a lease on them (leases run out after ``lease_s``).

Neighbours: ``subscriber.Subscriber`` is the other end; ``layout`` packs; ``protocol`` is the wire.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from tidekv.channel import ErrorKind, Peer, Refused, Server
from tidekv.config import WeightsConfig
from tidekv.errors import ConfigError, EngineClosedError, VersionNotFoundError
from tidekv.hostaddr import advertised_host
from tidekv.transfer import Region, TransferEngine
from tidekv.weights import layout
from tidekv.weights import protocol as p

logger = logging.getLogger(__name__)


@dataclass
class _Receiver:
    name: str
    staging_addr: int
    lease: int
    failed: bool = False


@dataclass
class _Version:
    number: int
    region: Region
    specs: list[p.TensorSpec]
    total_bytes: int
    sources: list[int] = field(default_factory=list)  # in place: each tensor's address; [] = snapshot
    leases: dict[int, float] = field(default_factory=dict)  # lease id -> deadline (monotonic)
    receivers: list[_Receiver] = field(default_factory=list)  # join order = tree order


class Publisher:
    """Publishes versions of a set of named tensors to any number of subscribers.

    Example::

        pub = Publisher(model.state_dict())          # this host's address (tidekv.hostaddr), free port
        pub.publish(1)                               # snapshot; pullable at pub.address
        ... train ...
        pub.publish(2)

    Args:
        tensors: a state dict or (name, tensor) pairs (torch tensors; GPU ones are copied to
            host memory at publish time). The same objects are read again at every publish.
        host: address to listen on and advertise (control socket and transfer engine); default
            ``$TIDEKV_HOST``, else the default route's interface, else 127.0.0.1 (``tidekv.hostaddr``).
        port: control socket port; 0 picks a free one.
        config: settings; default ``WeightsConfig.from_env()``.
        engine: a transfer engine to use (default: a new one on ``host``, closed with this).

    Raises:
        ConfigError: bad tensors, settings, or the port cannot be bound.
    """

    def __init__(
        self,
        tensors: Mapping[str, Any] | Iterable[tuple[str, Any]],
        *,
        host: str | None = None,
        port: int = 0,
        config: WeightsConfig | None = None,
        engine: TransferEngine | None = None,
    ) -> None:
        self.config = config if config is not None else WeightsConfig.from_env()
        host = advertised_host(host, None)  # subscribers are on other hosts, by design
        self._pairs = layout.named_tensors(tensors)
        self._own_engine = engine is None
        self.engine = engine if engine is not None else TransferEngine(host=host)
        self._lock = threading.Lock()
        self._versions: dict[int, _Version] = {}
        self._spare: list[Region] = []  # buffers of freed versions, reused by publish
        self._in_place_regions: dict[int, Region] = {}  # storage address -> region, for in-place versions
        self._leases = itertools.count(1)
        self._closed = False
        # The engine's secret guards the control channel too (``tidekv.auth``): one setting per process.
        try:
            self._server = Server(p.SPEC, host, port, self._handle, secret=self.engine.config.secret,
                                  tick=self._collect)
        except ConfigError:
            if self._own_engine:
                self.engine.close()
            raise
        self.address = self._server.address
        logger.info("weights publisher at %s (engine %s)", self.address, self.engine.name)

    def publish(self, version: int | None = None, tensors: Mapping[str, Any] | Iterable[tuple[str, Any]] | None = None,
                *, in_place: bool = False) -> int:
        """Snapshots the tensors as ``version`` and makes it pullable; returns the version.

        The version is pullable as soon as the copy starts: receivers already pulling it read
        each chunk once it is in place, so the copy and the pulls overlap.

        With ``in_place=True`` there is no snapshot: receivers read the tensors themselves (CPU,
        contiguous; registered once), which saves a copy of the whole model per update. The
        tensors must not change until ``retire(version)`` -- or use ``with pub.serve(version):``.
        A pull still copying when the version is retired fails with VersionChangedError, so a
        receiver never keeps a mix.

        Args:
            version: a number greater than every published one; None = the last one + 1.
            tensors: replaces the set of tensors from now on (names, shapes or dtypes may change).
            in_place: serve the tensors where they are instead of a snapshot.

        Raises:
            ConfigError: the version is not new, or ``tensors`` is malformed (or, in place, not
                contiguous CPU tensors).
        """
        self._check_open()
        if tensors is not None:
            self._pairs = layout.named_tensors(tensors)
        with self._lock:
            last = max(self._versions, default=0)
        number = last + 1 if version is None else version
        if not isinstance(number, int) or number <= last:
            raise ConfigError(f"version {version!r} must be an int greater than the last published ({last})")
        specs, total = layout.plan_layout(self._pairs)
        if in_place:
            return self._publish_in_place(number, specs, total)
        self._collect(keep=self.config.keep_versions - 1)
        region = self._buffer(total)
        view = region.view()
        layout.write_header(view, number, 0, layout.STATE_FILLING)
        with self._lock:  # pullable from now on: receivers stream chunks as they are copied in
            self._versions[number] = _Version(number, region, specs, total)
        chunk = self.config.chunk_bytes

        def progress(end: int) -> None:
            layout.set_progress(view, (end - layout.HEADER_BYTES) // chunk, layout.STATE_FILLING)

        try:
            layout.pack(layout.buffer_tensor(view), specs, self._pairs, progress, piece_bytes=chunk)
        except BaseException:
            layout.set_progress(view, 0, layout.STATE_FAILED)
            with self._lock:
                self._versions.pop(number, None)
                self._spare.append(region)
            raise
        layout.set_progress(view, len(layout.chunk_ranges(total, chunk)), layout.STATE_COMPLETE)
        self._collect()
        logger.debug("published weights version %d (%d tensors, %.1f MiB)", number, len(specs), total / 2**20)
        return number

    def _publish_in_place(self, number: int, specs: list[p.TensorSpec], total: int) -> int:
        sources = [self._registered(name, tensor) if spec.nbytes else 0 for (name, tensor), spec in zip(self._pairs, specs)]
        header = self.engine.allocate(layout.HEADER_BYTES)
        layout.write_header(header.view(), number, len(layout.chunk_ranges(total, self.config.chunk_bytes)), layout.STATE_COMPLETE)
        with self._lock:
            self._versions[number] = _Version(number, header, specs, total, sources=sources)
        logger.debug("serving weights version %d in place (%d tensors)", number, len(specs))
        return number

    def _registered(self, name: str, tensor: Any) -> int:
        """Address of ``tensor`` inside a registered region (its whole storage, registered once)."""
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ConfigError(f"in-place publishing needs contiguous CPU tensors; {name!r} is not (publish a snapshot instead)")
        storage = tensor.untyped_storage()
        base, size = storage.data_ptr(), storage.nbytes()
        region = self._in_place_regions.get(base)
        if region is None or region.length != size:
            if region is not None:
                self.engine.unregister(region)
            region = self._in_place_regions[base] = self.engine.register((base, size))
        return region.address + (tensor.data_ptr() - base)

    def retire(self, version: int) -> None:
        """Ends in-place serving of ``version``: from now on the tensors may change.

        Raises:
            VersionNotFoundError: ``version`` is not being served in place.
        """
        with self._lock:
            v = self._versions.get(version)
            if v is None or not v.sources:
                raise VersionNotFoundError(f"weights version {version} is not being served in place")
            del self._versions[version]
        layout.write_header(v.region.view(), 0, 0, layout.STATE_FAILED)  # pulls still copying fail their check
        self.engine.unregister(v.region)

    @contextlib.contextmanager
    def serve(self, version: int | None = None) -> Iterator[int]:
        """Serves the tensors in place as ``version`` for the duration of the block::

            with pub.serve(7):
                update_every_engine(7)        # their pulls read the trainer's tensors directly
            optimizer.step()                  # safe: version 7 is retired
        """
        number = self.publish(version, in_place=True)
        try:
            yield number
        finally:
            self.retire(number)

    def versions(self) -> list[int]:
        """Versions that can be pulled now, oldest first."""
        with self._lock:
            return sorted(self._versions)

    def close(self) -> None:
        """Stops serving and frees every snapshot. Pulls in flight fail. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._server.close()
        with self._lock:
            regions = [v.region for v in self._versions.values()] + self._spare + list(self._in_place_regions.values())
            self._versions, self._spare, self._in_place_regions = {}, [], {}
        if self._own_engine:
            self.engine.close()  # frees every buffer it allocated
        else:
            for region in regions:
                self.engine.unregister(region)

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- control plane -------------------------------------------------------------------

    def _handle(self, req: p.Request, peer: Peer) -> object:
        """Answers one subscriber's request (on the channel's thread)."""
        with self._lock:
            if isinstance(req, p.Versions):
                return sorted(self._versions)
            if isinstance(req, p.Describe):
                number = max(self._versions, default=None) if req.version is None else req.version
                v = self._versions.get(number) if number is not None else None
                if v is None:
                    pending = req.version is None or req.version > max(self._versions, default=0)
                    raise Refused(ErrorKind.PENDING if pending else ErrorKind.NOT_FOUND, self._missing(req.version))
                return p.Manifest(v.number, v.specs, v.total_bytes)
            if isinstance(req, p.Join):
                v = self._versions.get(req.version)
                if v is None:
                    raise Refused(ErrorKind.NOT_FOUND, self._missing(req.version))
                return self._join(v, req)
            self._leave(req)
            return None

    def _missing(self, version: int | None) -> str:
        held = sorted(self._versions)
        if version is None:
            return "nothing published yet"
        return f"weights version {version} is not held by the publisher (held: {held})"

    def _join(self, v: _Version, req: p.Join) -> p.Plan:
        lease = next(self._leases)
        v.leases[lease] = time.monotonic() + self.config.lease_s
        v.receivers.append(_Receiver(req.receiver, req.staging_addr, lease))
        parent: _Receiver | None = None
        if self.config.fanout:
            node = len(v.receivers)  # the publisher is node 0
            while node > 0:
                node = (node - 1) // self.config.fanout
                if node == 0 or not v.receivers[node - 1].failed:
                    break
            parent = v.receivers[node - 1] if node > 0 else None
        return p.Plan(
            lease=lease,
            chunk_bytes=self.config.chunk_bytes,
            window=self.config.window,
            stall_timeout_s=self.config.stall_timeout_s,
            publisher=self.engine.name,
            snapshot_addr=v.region.address,
            sources=v.sources,
            parent=parent.name if parent else None,
            parent_addr=parent.staging_addr if parent else 0,
        )

    def _leave(self, req: p.Leave) -> None:
        for v in self._versions.values():
            if v.leases.pop(req.lease, None) is not None:
                if not req.ok:  # later joiners are not sent to a receiver that failed
                    for r in v.receivers:
                        if r.lease == req.lease:
                            r.failed = True
                return

    def _buffer(self, size: int) -> Region:
        """A snapshot buffer of at least ``size`` bytes: a freed one reused, or a new one.

        Reuse keeps the steady state free of page faults and new mappings at the receivers; it
        is safe because a freed buffer's header no longer names its version (readers re-check).
        """
        with self._lock:
            fits = [r for r in self._spare if r.length >= size]
            if fits:
                region = min(fits, key=lambda r: r.length)
                self._spare.remove(region)
                return region
            spare, self._spare = self._spare, []
        for region in spare:  # none fits: the tensors grew; drop the old sizes
            self.engine.unregister(region)
        return self.engine.allocate(size)

    def _collect(self, keep: int | None = None) -> None:
        """Frees versions beyond ``keep`` (default keep_versions) that no live lease holds."""
        now = time.monotonic()
        doomed: list[_Version] = []
        with self._lock:
            newest = sorted((n for n, v in self._versions.items() if not v.sources), reverse=True)
            for number in newest[self.config.keep_versions if keep is None else keep :]:
                v = self._versions[number]
                v.leases = {k: d for k, d in v.leases.items() if d > now}
                if not v.leases:
                    doomed.append(self._versions.pop(number))
        for v in doomed:
            layout.write_header(v.region.view(), 0, 0, layout.STATE_FAILED)  # readers' seqlock check fails
            with self._lock:
                self._spare.append(v.region)
            logger.debug("freed weights version %d", v.number)

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError("weights publisher is closed")
