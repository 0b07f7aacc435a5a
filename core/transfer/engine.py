"""TransferEngine: one-sided batch READ/WRITE between registered memory of processes and hosts.

This class owns the native engine (``tidekv._native.Engine``): its listener, its registered
regions, its peers and transports (tcp, same-host shm; the engine picks one per request), and its
worker threads. Neighbours:
``region`` (what can be registered), ``batch`` (requests and handles), ``directory`` (how peer
names become descriptors), ``tidekv.config.TransferConfig`` (settings).

Thread-safety: every method may be called from any thread. Ownership: registered memory stays
the caller's; it must outlive its registration and every batch that touches it.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Sequence
from typing import Any

from tidekv import _native
from tidekv.config import TransferConfig, native_options
from tidekv.errors import ConfigError, EngineClosedError, TransferError
from tidekv.hostaddr import advertised_host
from tidekv.transfer.batch import TransferHandle, TransferRequest
from tidekv.transfer.directory import DirectDirectory, PeerDirectory
from tidekv.transfer.region import Region, memory_of

logger = logging.getLogger(__name__)

def _native_options(host: str, port: int, config: TransferConfig) -> _native.EngineOptions:
    o = native_options(config, _native.EngineOptions())  # every setting, as TransferConfig declares it
    o.host = host
    o.port = port
    return o


def _shut_down(native: _native.Engine, log_stop: threading.Event, log_thread: threading.Thread) -> None:
    native.close()
    log_stop.set()
    log_thread.join(timeout=2)
    for level, message in native.drain_log(0):
        logger.log(level, "%s", message)


def _pump_native_log(native_ref: weakref.ref[Any], stop: threading.Event) -> None:
    while not stop.is_set():
        native = native_ref()
        if native is None:
            return
        records = native.drain_log(200)
        del native
        for level, message in records:
            logger.log(level, "%s", message)


class TransferEngine:
    """A transfer engine bound to ``host:port``; its ``name`` is how peers address it.

    Example::

        engine = TransferEngine()                      # 127.0.0.1, any free port
        buf = engine.allocate(1 << 20)                 # shared memory, same-host peers map it
        engine.transfer([TransferRequest(TransferOp.READ, buf.address, 4096,
                                         "127.0.0.1:50051", peer_addr)]).wait()

    Args:
        host: address to listen on and to advertise; default ``$TIDEKV_HOST``, else 127.0.0.1
            (``tidekv.hostaddr``: a wildcard is refused, peers would dial themselves).
        port: port to listen on; 0 picks a free one.
        config: settings; default ``TransferConfig.from_env()``.
        directory: how peer names become descriptors; default: ask the peer directly.

    Raises:
        ConfigError: the host/port cannot be bound or a setting is invalid.
    """

    def __init__(
        self,
        host: str | None = None,
        port: int = 0,
        config: TransferConfig | None = None,
        directory: PeerDirectory | None = None,
    ) -> None:
        if not 0 <= port <= 65535:
            raise ConfigError(f"port={port} is out of range; allowed 0..65535")
        self.config = config if config is not None else TransferConfig.from_env()
        self._native = _native.Engine(_native_options(advertised_host(host), port, self.config))
        self._lock = threading.Lock()
        self._regions: dict[int, Region] = {}
        self._closed = False
        self._directory: PeerDirectory = directory if directory is not None else DirectDirectory(self._native)
        self._directory.publish(self.name, self._native.descriptor())
        self._log_stop = threading.Event()
        self._log_thread = threading.Thread(
            target=_pump_native_log,
            args=(weakref.ref(self._native), self._log_stop),
            name=f"tidekv-log-{self.name}",
            daemon=True,
        )
        self._log_thread.start()
        # Runs on close(), on garbage collection, or at interpreter exit, whichever comes first:
        # a daemon thread still inside native code at exit would abort the process.
        self._finalizer = weakref.finalize(self, _shut_down, self._native, self._log_stop, self._log_thread)
        logger.info("transfer engine %s started (transport=%s)", self.name, self.config.transport.value)

    @property
    def name(self) -> str:
        """This engine's address as peers use it: "host:port"."""
        return self._native.name

    @property
    def descriptor(self) -> bytes:
        """Opaque descriptor peers need to reach this engine (what a PeerDirectory stores)."""
        return self._native.descriptor()

    @property
    def protocol_version(self) -> int:
        """Version of the wire protocol; peers must speak the same one."""
        return self._native.protocol_version

    def register(self, obj: Any, location: str | None = None) -> Region:
        """Registers memory that peers may read and write.

        Args:
            obj: a writable buffer-protocol object (bytearray, numpy array, mmap), a torch tensor
                on the CPU or a GPU, an object with ``__cuda_array_interface__`` or a DLPack CUDA
                tensor, or an explicit ``(address, length)`` pair.
            location: "cpu" or "cuda:N"; taken from the object when it says (a tensor's
                device), needed for an ``(address, length)`` pair in GPU memory.

        Returns:
            The Region (the engine keeps ``obj`` alive while it is registered).

        Raises:
            ConfigError: the object cannot be registered, overlaps a registered region, is not
                where ``location`` says, or is GPU memory where no transport moves it (no CUDA
                driver: see ``tidekv doctor``).
        """
        self._check_open()
        address, length, owner, where = memory_of(obj, location)
        self._native.register(address, length, where)
        region = Region(address, length, where, False, owner)
        with self._lock:
            self._regions[address] = region
        logger.debug("engine %s registered %#x +%d (%s)", self.name, address, length, where)
        return region

    def allocate(self, size: int, *, huge: bool = False) -> Region:
        """Allocates ``size`` bytes of engine-owned memory, registered.

        By default the memory is shared (a memfd): same-host peers map it and copy with plain
        memcpy. ``huge=True`` takes private memory on transparent huge pages instead; same-host
        peers reach it by cross-memory attach (where ptrace rules allow it, else over tcp). On
        VMs that make idle 4 KiB pages slow to read, huge pages keep cold reads at full speed.
        Free it with ``unregister``; ``close`` frees whatever is left.

        Raises:
            ConfigError: size is not positive or the memory cannot be had.
        """
        self._check_open()
        if size <= 0:
            raise ConfigError(f"allocate(size={size}) needs size > 0")
        address = self._native.allocate(size, huge)
        region = Region(address, size, "cpu", True, None)
        with self._lock:
            self._regions[address] = region
        return region

    def unregister(self, region: Region) -> None:
        """Unregisters a region; peers are refused from then on (frees it if allocated here).

        Waits for copies into the region already in flight (see TransferConfig.unregister_timeout_s).

        Raises:
            SegmentNotRegisteredError: the region is not registered on this engine.
        """
        self._check_open()
        self._native.unregister(region.address)
        with self._lock:
            self._regions.pop(region.address, None)

    def region_of(self, address: int, length: int) -> Region | None:
        """The registered region holding ``[address, address + length)``, or None: lets a call
        use caller memory in place when it is registered and register it only when not."""
        with self._lock:
            for region in self._regions.values():
                if region.address <= address and address + length <= region.address + region.length:
                    return region
        return None

    def region_proof(self, region: Region, context: bytes) -> bytes:
        """This process's proof that ``region`` is its own memory, bound to ``context`` (32 bytes).

        The proof is an HMAC under a key that never leaves this engine's process. A third party
        asks this engine's listener whether it vouches for it (``_native.check_region_proof``),
        so a process that names another engine's memory cannot prove it. The store's mounts use
        it (``tidekv.store.wire.mount_proof``).

        Raises:
            SegmentNotRegisteredError: the region is not registered on this engine.
        """
        self._check_open()
        return self._native.region_proof(context, region.address, region.length)

    def transfer(self, requests: Sequence[TransferRequest]) -> TransferHandle:
        """Submits a batch of requests; returns at once with a handle (``wait()`` to block).

        Peers named for the first time are looked up through the directory (a handshake each)
        before anything is submitted.

        Raises:
            SegmentNotRegisteredError: a local range is not registered on this engine.
            ConfigError: a request is malformed (length 0, bad op, bad peer name).
            PeerUnavailableError, ProtocolVersionError, AuthenticationError: a new peer could
                not be reached or refused us.
        """
        # (No _check_open(): the native submit refuses a closed engine itself, and this is the hot path.)
        reqs = requests if isinstance(requests, list) else list(requests)
        batch = self._native.submit(reqs)
        if isinstance(batch, list):  # the names of peers not known yet; nothing was submitted
            for peer in batch:
                self.connect(peer)
            batch = self._native.submit(reqs)
            if isinstance(batch, list):  # connect() adds peers for good: only a bug gets here
                raise EngineClosedError(f"peers {batch} vanished from engine {self.name} after connect()")
        return TransferHandle(batch, reqs)

    def connect(self, peer: str) -> str:
        """Looks up ``peer`` now (instead of on first transfer).

        Returns:
            The transport host-memory requests to it take ("shm" for a same-host peer, "tcp"
            otherwise, or the forced one); "none" when no transport reaches it (a forced
            transport that cannot: its requests fail, naming why).

        Raises:
            PeerUnavailableError, ProtocolVersionError, AuthenticationError: as for transfer().
        """
        self._check_open()
        try:
            descriptor = self._directory.lookup(peer)
        except TransferError as exc:
            if exc.peer is None:
                exc.peer = peer  # (raised by the native handshake, which names it in the message only)
            raise
        self._native.add_peer(peer, descriptor)
        reachable = self._native.peer_transports(peer)
        transport = reachable[0] if reachable else "none"
        logger.info("engine %s connected to peer %s via %s (reachable by %s)", self.name, peer, transport,
                    ", ".join(reachable) or "nothing")
        return transport

    def transports(self) -> list[tuple[str, bool, str]]:
        """Every transport of this build as (name, available, why or what it runs on)."""
        return [(name, available, reason) for name, available, reason in self._native.transports()]

    def stats(self) -> dict[str, int]:
        """Counters of this engine: bytes moved, batches, connections, refused frames."""
        return dict(self._native.stats())

    def close(self) -> None:
        """Stops the listener and workers and frees allocated memory. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._finalizer()
        logger.info("transfer engine %s closed", self.name)

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError(f"transfer engine {self.name} is closed")
