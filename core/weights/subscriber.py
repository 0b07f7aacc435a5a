"""Subscriber: the rollout-engine side of weight broadcast.

``pull(version)`` asks the publisher for the layout and a place in the fan-out tree, then reads
the version chunk by chunk into a staging buffer registered with its own transfer engine --
from its parent receiver when it has one (polling the parent's progress counter, one-sidedly),
else from the publisher. While it pulls and afterwards (until its next pull) it serves what it
holds to its own children. Nothing is handed to the caller before every byte of one version is
in place and verified, so a failed pull never leaves a mix of versions behind.

Failures: a parent that dies, stalls or moves on to another version is bypassed (the chunks
are read from the publisher instead); a publisher that dies fails the pull with
PublisherUnavailableError; a version freed mid-pull fails it with VersionChangedError.

Neighbours: ``publisher.Publisher`` is the other end; ``layout`` unpacks; ``protocol`` is the wire.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from tidekv.channel import Client
from tidekv.config import WeightsConfig, parse_host_port
from tidekv.errors import (
    ConfigError,
    EngineClosedError,
    PublisherUnavailableError,
    SegmentNotRegisteredError,
    TransferError,
    VersionChangedError,
    VersionPendingError,
)
from tidekv.hostaddr import advertised_host
from tidekv.transfer import Region, TransferEngine, TransferOp, TransferRequest
from tidekv.weights import layout
from tidekv.weights import protocol as p

logger = logging.getLogger(__name__)

_NAP_MIN_S = 0.0001  # polling a source for progress: first wait ...
_NAP_MAX_S = 0.002  # ... doubling up to this (a 16 MiB chunk takes a few ms to copy)


@dataclass(frozen=True)
class PulledWeights:
    """One complete version. ``tensors`` are views into the subscriber's staging buffer: valid
    until its next ``pull`` or ``close`` (copy them, or load them into a model, before that)."""

    version: int
    tensors: dict[str, Any]
    seconds: float  #: wall time of the pull
    from_parent_bytes: int  #: bytes read from another receiver rather than the publisher

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        return iter(self.tensors.items())

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


class Subscriber:
    """Pulls weights versions from a Publisher.

    Example::

        sub = Subscriber("10.0.0.1:5555")
        weights = sub.pull()                         # the latest version
        model.load_weights(weights)                  # iterable of (name, tensor)
        sub.pull(7, into=model.state_dict())         # or copy straight into given tensors

    Args:
        publisher: the publisher's control address, "host:port" (``Publisher.address``).
        host: address this receiver's transfer engine listens on (its children read from it);
            default ``$TIDEKV_HOST``, else the local address that routes to the publisher.
        config: settings for the control channel (timeouts); chunking and fan-out come from
            the publisher. Default ``WeightsConfig.from_env()``.
        engine: a transfer engine to use (default: a new one on ``host``, closed with this).
    """

    def __init__(
        self,
        publisher: str,
        *,
        host: str | None = None,
        config: WeightsConfig | None = None,
        engine: TransferEngine | None = None,
    ) -> None:
        self.config = config if config is not None else WeightsConfig.from_env()
        publisher_host, _ = parse_host_port(publisher, "publisher address")  # before an engine exists to leak
        self._own_engine = engine is None
        self.engine = engine if engine is not None else TransferEngine(host=advertised_host(host, [publisher_host]))
        # The engine's secret guards the control channel too: one setting per process.
        self._control = Client(publisher, p.SPEC, self.config.rpc_timeout_s, secret=self.engine.config.secret)
        self._header = self.engine.register(bytearray(layout.HEADER_BYTES))
        self._staging: Region | None = None
        self._lock = threading.Lock()
        self._closed = False

    def versions(self) -> list[int]:
        """Versions the publisher holds now, oldest first.

        Raises:
            PublisherUnavailableError: the publisher did not answer.
        """
        return self._control.call(p.Versions())

    def pull(self, version: int | None = None, *, into: Mapping[str, Any] | None = None, wait_s: float = 0.0) -> PulledWeights:
        """Pulls one complete version (None = the latest).

        Args:
            version: which version.
            wait_s: how long to wait for ``version`` to be published when it is not yet
                (so engines can be told to pull before the trainer publishes; the pull then
                streams chunks while the trainer copies them in).
            into: destination tensors by name; each is overwritten with the pulled tensor of
                that name (shapes and dtypes must match). Names absent from ``into`` are only
                returned as views.

        Raises:
            VersionNotFoundError: the publisher does not hold that version.
            PublisherUnavailableError: the publisher did not answer or died mid-pull.
            VersionChangedError: the version was freed while being pulled (lease ran out).
            ConfigError: ``into`` names an unknown tensor or one of another shape or dtype.
        """
        with self._lock:
            if self._closed:
                raise EngineClosedError("weights subscriber is closed")
            started = time.perf_counter()
            manifest = self._describe(version, wait_s)
            if into is not None:
                _check_into(into, manifest.tensors)
            staging = self._staging_for(manifest.total_bytes)
            layout.write_header(staging.view(), manifest.version, 0, layout.STATE_FILLING)
            plan = self._control.call(p.Join(manifest.version, self.engine.name, staging.address))
            ok = False
            try:
                from_parent = self._fetch(manifest, plan, staging)
                ok = True
            finally:
                if not ok:
                    layout.set_progress(staging.view(), 0, layout.STATE_FAILED)
                self._leave(plan.lease, ok)
            buffer = layout.buffer_tensor(staging.view())
            tensors = dict(layout.unpack(buffer, manifest.tensors))
            if into is not None:
                for name, dst in into.items():
                    dst.copy_(tensors[name])
            return PulledWeights(manifest.version, tensors, time.perf_counter() - started, from_parent)

    def _describe(self, version: int | None, wait_s: float) -> p.Manifest:
        """The publisher's manifest of ``version``, asking again until it is published or ``wait_s`` passes."""
        deadline = time.monotonic() + wait_s
        nap = 0.001
        while True:
            try:
                return self._control.call(p.Describe(version))
            except VersionPendingError:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise
                time.sleep(min(nap, left))
                nap = min(2 * nap, 0.05)  # a long wait (the trainer still training) asks 20 times a second

    def close(self) -> None:
        """Frees the staging buffer (children still reading it fall back to the publisher). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._control.close()
        if self._own_engine:
            self.engine.close()
        else:
            for region in (self._staging, self._header):
                if region is not None:
                    self.engine.unregister(region)

    def __enter__(self) -> Subscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the data path -------------------------------------------------------------------

    def _staging_for(self, size: int) -> Region:
        if self._staging is not None and self._staging.length >= size:
            return self._staging
        if self._staging is not None:
            self.engine.unregister(self._staging)
            self._staging = None
        self._staging = self.engine.allocate(size)
        return self._staging

    def _fetch(self, manifest: p.Manifest, plan: p.Plan, staging: Region) -> int:
        """Reads every chunk into ``staging``; returns the bytes that came from the parent.

        Both kinds of source are polled the same way: their header says how many chunks they
        hold (a parent while it pulls, the publisher while it copies the snapshot in).
        """
        chunks = layout.chunk_ranges(manifest.total_bytes, plan.chunk_bytes)
        version = manifest.version
        parent = (plan.parent, plan.parent_addr) if plan.parent else None
        publisher = (plan.publisher, plan.snapshot_addr)
        done = from_parent = 0
        last_progress = time.monotonic()
        nap = _NAP_MIN_S
        while done < len(chunks):
            source = parent or publisher
            held = self._held(source, version, len(chunks), is_parent=parent is not None)
            if held is None:  # only a parent gets here: the publisher's failures raise
                parent, last_progress = None, time.monotonic()
                continue
            if held <= done:
                if time.monotonic() - last_progress <= plan.stall_timeout_s:
                    time.sleep(nap)  # back off: pollers must not starve the copy they wait for
                    nap = min(2 * nap, _NAP_MAX_S)
                    continue
                if parent is None:
                    raise PublisherUnavailableError(
                        f"publisher {plan.publisher} made no progress on weights version {version} for {plan.stall_timeout_s} s")
                logger.warning("parent %s stalled for %.1f s; reading from the publisher", parent[0], plan.stall_timeout_s)
                parent, last_progress = None, time.monotonic()
                continue
            batch = chunks[done : min(held, done + plan.window)]
            peer, base = source
            bases = plan.sources if source is publisher and plan.sources else None
            requests = [r for off, n in batch for r in _chunk_requests(staging.address, off, n, peer, base, bases, manifest.tensors)]
            try:
                if requests:  # (a range of alignment padding alone needs no copy)
                    self.engine.transfer(requests).wait()
            except (TransferError, KeyError) as exc:
                if parent is None:
                    raise _publisher_error(plan.publisher, version, exc) from exc
                logger.warning("reading from parent %s failed (%s); reading from the publisher", parent[0], exc)
                parent, last_progress = None, time.monotonic()
                continue
            if parent is not None:
                if self._held(parent, version, len(chunks), is_parent=True) is None:
                    parent = None  # the parent moved on while we copied: these chunks are suspect
                    continue
                from_parent += sum(n for _, n in batch)
            done += len(batch)
            last_progress, nap = time.monotonic(), _NAP_MIN_S
            layout.set_progress(staging.view(), done, layout.STATE_FILLING)
        self._check_source(plan, version)
        layout.set_progress(staging.view(), len(chunks), layout.STATE_COMPLETE)
        return from_parent

    def _read_header(self, peer: str, addr: int) -> tuple[int, int, int]:
        self.engine.transfer([TransferRequest(TransferOp.READ, self._header.address, layout.HEADER_BYTES, peer, addr)]).wait()
        return layout.read_header(self._header.view())

    def _held(self, source: tuple[str, int], version: int, chunks: int, *, is_parent: bool) -> int | None:
        """Chunks of ``version`` the source holds. A parent that cannot serve (gone, failed,
        moved on) gives None; a publisher that cannot raises."""
        peer, addr = source
        try:
            got, done, state = self._read_header(peer, addr)
        except (TransferError, ConfigError, KeyError) as exc:
            if not is_parent:
                raise _publisher_error(peer, version, exc) from exc
            logger.warning("parent %s unreachable (%s); reading from the publisher", peer, exc)
            return None
        if got != version or state == layout.STATE_FAILED:
            if not is_parent:
                raise VersionChangedError(f"weights version {version} was freed by the publisher while being pulled")
            return None
        return chunks if state == layout.STATE_COMPLETE else done

    def _check_source(self, plan: p.Plan, version: int) -> None:
        """The publisher's snapshot must still be ``version`` after we copied (seqlock)."""
        try:
            got, _, state = self._read_header(plan.publisher, plan.snapshot_addr)
        except (TransferError, KeyError) as exc:
            raise _publisher_error(plan.publisher, version, exc) from exc
        if got != version or state != layout.STATE_COMPLETE:
            raise VersionChangedError(f"weights version {version} was freed by the publisher while being pulled")

    def _leave(self, lease: int, ok: bool) -> None:
        try:
            self._control.call(p.Leave(lease, ok), timeout_s=min(1.0, self.config.rpc_timeout_s))
        except PublisherUnavailableError:
            logger.warning("publisher did not acknowledge the end of pull (lease %d); it expires by itself", lease)


def _chunk_requests(staging: int, off: int, n: int, peer: str, base: int, sources: list[int] | None,
                    specs: list[p.TensorSpec]) -> list[TransferRequest]:
    """READs that fill [off, off + n) of the staging buffer: one from a flat buffer (a snapshot
    or a parent's copy at ``base``), or one per tensor the range covers when the publisher
    serves its tensors in place (``sources``: each tensor's address; padding is skipped)."""
    if sources is None:
        return [TransferRequest(TransferOp.READ, staging + off, n, peer, base + off)]
    out = []
    for spec, src in zip(specs, sources):
        lo, hi = max(off, spec.offset), min(off + n, spec.offset + spec.nbytes)
        if lo < hi:
            out.append(TransferRequest(TransferOp.READ, staging + lo, hi - lo, peer, src + (lo - spec.offset)))
    return out


def _publisher_error(publisher: str, version: int, exc: BaseException) -> Exception:
    if isinstance(exc, SegmentNotRegisteredError):
        return VersionChangedError(f"weights version {version} was freed by the publisher while being pulled")
    return PublisherUnavailableError(f"reading weights version {version} from publisher {publisher} failed: {exc}")


def _check_into(into: Mapping[str, Any], specs: list[p.TensorSpec]) -> None:
    by_name = {s.name: s for s in specs}
    for name, dst in into.items():
        spec = by_name.get(name)
        if spec is None:
            raise ConfigError(f"into[{name!r}]: the published version has no tensor of that name")
        dtype = str(dst.dtype).removeprefix("torch.")
        if list(dst.shape) != spec.shape or dtype != spec.dtype:
            raise ConfigError(
                f"into[{name!r}] is {dtype}{list(dst.shape)}, the published tensor is {spec.dtype}{spec.shape}"
            )
