"""A Mooncake-compatible transfer engine: the API of ``mooncake.engine.TransferEngine`` over tidekv,
so engines that drive Mooncake directly run unpatched (``tidekv-mooncake-shim`` makes ``import
mooncake.engine`` resolve here).

The shape is Mooncake's on purpose: several names per operation, integer status codes (0 =
success, -1 = failure; batch id 0 = failure), ``(address, length)`` memory; all funnel into one
path building ``TransferRequest``s. A data-path method never raises where Mooncake returns a
code: it logs the typed tidekv error (peer, op, byte range) and returns -1. Only
``P2PHANDSHAKE`` metadata is supported; the session id ``host:rpc_port`` is the tidekv engine
name. Notifications, ``transfer_*_on_cuda`` and a few topology calls are not provided.

Neighbours: ``tidekv.transfer.engine`` (the engine underneath), ``tidekv.config.TransferConfig``
(its settings, still read from ``TIDEKV_*`` variables). Thread-safety: every method may be called
from any thread, as with Mooncake. This module imports neither torch nor any engine.
Design notes: docs/design-compat.md#tidekvcompatmooncake
"""

from __future__ import annotations

import ctypes
import dataclasses
import enum
import itertools
import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

from tidekv.config import TransferConfig, TransportKind
from tidekv.errors import EngineClosedError, TidekvError, TransferTimeoutError
from tidekv.transfer.batch import TransferHandle, TransferOp, TransferRequest
from tidekv.transfer.engine import TransferEngine as _TidekvEngine
from tidekv.transfer.region import Region, location_of_address

logger = logging.getLogger(__name__)

P2P_HANDSHAKE = "P2PHANDSHAKE"
"""The only metadata-server value supported: peers exchange descriptors directly."""

_OK = 0
_FAILED = -1
_IN_PROGRESS = 0
_DONE = 1
_TIMED_OUT = -2
_NO_BATCH = 0


class TransferOpcode(enum.IntEnum):
    """Mooncake's opcode enum (``mooncake.engine.TransferOpcode``)."""

    READ = 0
    WRITE = 1


_OPS = {TransferOpcode.READ: TransferOp.READ, TransferOpcode.WRITE: TransferOp.WRITE}


def _split_hostname(local_hostname: str) -> tuple[str, int]:
    """"host" -> (host, 0); "host:port" -> (host, port); "[v6]:port" -> (v6, port)."""
    host, sep, port = local_hostname.rpartition(":")
    if sep and port.isdigit() and host and (host.count(":") == 0 or host.startswith("[")):
        return host.strip("[]"), int(port)
    return local_hostname.strip("[]"), 0


def _transport_for(protocol: str) -> TransportKind:
    if os.environ.get("MC_FORCE_TCP") == "1" or protocol == "tcp":
        return TransportKind.TCP
    return TransportKind.AUTO


_FABRIC_PROVIDERS = {"rdma": "verbs", "efa": "efa"}
"""Mooncake's RDMA protocols, as the fabric transport's libfabric providers."""


def transfer_config_for(protocol: str, device_names: str = "") -> TransferConfig:
    """The TransferConfig a Mooncake protocol and NIC list ask for: "tcp" forces tcp, "rdma" and
    "efa" pick fabric's provider, and the devices ("mlx5_0,mlx5_1", Mooncake's ``device_name`` /
    ``rdma_devices``) become ``fabric_nics``. ``TIDEKV_*`` variables set win over both.

    Raises:
        ConfigError: the environment, or the device list, is invalid.
    """
    transport = _transport_for(protocol)
    config = TransferConfig.from_env(transport=transport)
    if protocol not in _FABRIC_PROVIDERS or transport is not TransportKind.AUTO:
        if device_names:
            logger.debug("mooncake compat: device names %r not used by protocol %r", device_names, protocol)
        return config
    changes = {}
    if not config.fabric_provider:
        changes["fabric_provider"] = _FABRIC_PROVIDERS[protocol]
    if device_names and not config.fabric_nics:
        changes["fabric_nics"] = device_names
    return dataclasses.replace(config, **changes)


class TransferEngine:
    """``mooncake.engine.TransferEngine``, backed by one ``tidekv.TransferEngine``.

    Construct, then ``initialize(...)`` (returns 0) before anything else; until then every
    method returns its failure code. Registered memory stays the caller's and must outlive its
    registration, as with Mooncake.
    """

    TransferOpcode = TransferOpcode

    def __init__(self) -> None:
        self._engine: _TidekvEngine | None = None
        self._lock = threading.Lock()
        self._regions: dict[int, Region] = {}
        self._managed: dict[int, Region] = {}
        self._batches: dict[int, TransferHandle] = {}
        self._batch_ids = itertools.count(1)

    # ---- set-up -------------------------------------------------------------------------

    def initialize(self, local_hostname: str, metadata_server: str, protocol: str = "tcp",
                   device_name: str = "") -> int:
        """Starts the engine on ``local_hostname``; returns 0, or -1 (logged) on failure."""
        if self._engine is not None:
            logger.error("mooncake compat: initialize() called twice (engine %s already runs)", self._engine.name)
            return _FAILED
        if metadata_server != P2P_HANDSHAKE:
            logger.error("mooncake compat: metadata server %r is not supported; tidekv peers handshake directly, "
                         "pass %r", metadata_server, P2P_HANDSHAKE)
            return _FAILED
        host, port = _split_hostname(local_hostname)
        try:
            config = transfer_config_for(protocol, device_name)
            self._engine = _TidekvEngine(host=host, port=port, config=config)
        except TidekvError as exc:
            logger.error("mooncake compat: cannot start a transfer engine on %r (protocol %r): %s",
                         local_hostname, protocol, exc)
            return _FAILED
        logger.info("mooncake compat: engine %s up for protocol %r (tidekv transport %s)",
                    self._engine.name, protocol, config.transport.value)
        if protocol in _FABRIC_PROVIDERS:
            for name, available, reason in self._engine.transports():
                if name == "fabric" and not available:
                    logger.warning("mooncake compat: protocol %r asks for RDMA, but the fabric transport cannot run "
                                   "here (%s): peers on other hosts are reached over tcp", protocol, reason)
        return _OK

    def initialize_ext(self, local_hostname: str, metadata_server: str, protocol: str, device_name: str,
                       metadata_type: str) -> int:
        """``initialize`` with an explicit metadata type; only P2P handshake is supported."""
        if metadata_server != P2P_HANDSHAKE:
            logger.error("mooncake compat: metadata server %s://%s is not supported; pass %r",
                         metadata_type, metadata_server, P2P_HANDSHAKE)
            return _FAILED
        return self.initialize(local_hostname, metadata_server, protocol, device_name)

    def get_rpc_port(self) -> int:
        """The port peers reach this engine on; the session id is ``f"{host}:{port}"``."""
        engine = self._require()
        return int(engine.name.rpartition(":")[2])

    def get_engine(self) -> _TidekvEngine:
        """The underlying ``tidekv.TransferEngine`` (Mooncake returns its opaque inner engine here)."""
        return self._require()

    def send_probe(self, peer_server_name: str) -> int:
        """Handshakes with ``peer_server_name`` afresh; 0 if it answers, else -1."""
        try:
            self._require().connect(peer_server_name)
            return _OK
        except TidekvError as exc:
            logger.info("mooncake compat: probe of %s failed: %s", peer_server_name, exc)
            return _FAILED

    # ---- memory -------------------------------------------------------------------------

    def register_memory(self, buffer_addr: int, capacity: int, location: str = "*") -> int:
        """Registers ``[buffer_addr, buffer_addr + capacity)`` for peers; 0 or -1."""
        return self.batch_register_memory([buffer_addr], [capacity], location)

    def unregister_memory(self, buffer_addr: int) -> int:
        """Unregisters the region starting at ``buffer_addr``; 0 or -1."""
        return self.batch_unregister_memory([buffer_addr])

    def batch_register_memory(self, buffer_addresses: Sequence[int], capacities: Sequence[int],
                              location: str = "*") -> int:
        """Registers several regions; 0 if all were registered, else -1 (the others stay registered)."""
        engine = self._engine
        if engine is None or len(buffer_addresses) != len(capacities):
            return self._misuse("batch_register_memory", len(buffer_addresses), len(capacities))
        if not (location == "*" or location.startswith(("cpu", "cuda"))):
            logger.error("mooncake compat: cannot register memory at location %r (use '*', 'cpu:N' or 'cuda:N')",
                         location)
            return _FAILED
        status = _OK
        for address, length in zip(buffer_addresses, capacities):
            where = "cpu" if location.startswith("cpu") else location
            try:
                if where == "*":
                    where = location_of_address(int(address))
                region = engine.register((int(address), int(length)), location=where)
            except TidekvError as exc:
                logger.error("mooncake compat: register_memory(%#x, %d) failed: %s", address, length, exc)
                status = _FAILED
                continue
            with self._lock:
                self._regions[region.address] = region
        return status

    def batch_unregister_memory(self, buffer_addresses: Sequence[int]) -> int:
        """Unregisters several regions by start address; 0 if all were registered, else -1."""
        engine = self._engine
        if engine is None:
            return self._misuse("batch_unregister_memory")
        status = _OK
        for address in buffer_addresses:
            with self._lock:
                region = self._regions.pop(int(address), None)
            if region is None:
                logger.error("mooncake compat: unregister_memory(%#x): no region registered at that address", address)
                status = _FAILED
                continue
            try:
                engine.unregister(region)
            except TidekvError as exc:
                logger.error("mooncake compat: unregister_memory(%#x) failed: %s", address, exc)
                status = _FAILED
        return status

    def allocate_managed_buffer(self, length: int) -> int:
        """Allocates registered memory (shared with same-host peers); its address, or 0 on failure."""
        engine = self._engine
        if engine is None:
            self._misuse("allocate_managed_buffer")
            return 0
        try:
            region = engine.allocate(int(length))
        except TidekvError as exc:
            logger.error("mooncake compat: allocate_managed_buffer(%d) failed: %s", length, exc)
            return 0
        with self._lock:
            self._managed[region.address] = region
        return region.address

    def free_managed_buffer(self, buffer_addr: int, length: int) -> int:
        """Frees memory from ``allocate_managed_buffer``; 0 or -1."""
        engine = self._engine
        with self._lock:
            region = self._managed.pop(int(buffer_addr), None)
        if engine is None or region is None:
            logger.error("mooncake compat: free_managed_buffer(%#x, %d): not a managed buffer", buffer_addr, length)
            return _FAILED
        try:
            engine.unregister(region)
        except TidekvError as exc:
            logger.error("mooncake compat: free_managed_buffer(%#x) failed: %s", buffer_addr, exc)
            return _FAILED
        return _OK

    @staticmethod
    def write_bytes_to_buffer(dest_address: int, src_bytes: bytes, length: int) -> int:
        """Copies ``length`` bytes of ``src_bytes`` to ``dest_address``; 0, or -1 if too few bytes."""
        if length < 0 or length > len(src_bytes):
            logger.error("mooncake compat: write_bytes_to_buffer: length %d, but %d bytes given", length, len(src_bytes))
            return _FAILED
        ctypes.memmove(dest_address, src_bytes, length)
        return _OK

    @staticmethod
    def read_bytes_from_buffer(source_address: int, length: int) -> bytes:
        """The ``length`` bytes at ``source_address``."""
        return ctypes.string_at(source_address, length)

    # ---- synchronous transfers ----------------------------------------------------------

    def transfer_sync_write(self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int,
                            transport_hint: str = "") -> int:
        """One WRITE of local ``buffer`` to the peer's address; blocks; 0 or -1."""
        return self._sync(target_hostname, TransferOp.WRITE, [buffer], [peer_buffer_address], [length])

    def transfer_sync_read(self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int,
                           transport_hint: str = "") -> int:
        """One READ of the peer's address into local ``buffer``; blocks; 0 or -1."""
        return self._sync(target_hostname, TransferOp.READ, [buffer], [peer_buffer_address], [length])

    def transfer_sync(self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int,
                      opcode: TransferOpcode | int, notify: Any = None, transport_hint: str = "") -> int:
        """One READ or WRITE by opcode; blocks; 0 or -1. Notifications are not supported (-1)."""
        return self.batch_transfer_sync(target_hostname, [buffer], [peer_buffer_address], [length], opcode, notify)

    def batch_transfer_sync_write(self, target_hostname: str, buffers: Sequence[int],
                                  peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                                  transport_hint: str = "") -> int:
        """WRITEs ``buffers[i]`` to ``peer_buffer_addresses[i]`` at one peer; blocks; 0 or -1."""
        return self._sync(target_hostname, TransferOp.WRITE, buffers, peer_buffer_addresses, lengths)

    def batch_transfer_sync_read(self, target_hostname: str, buffers: Sequence[int],
                                 peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                                 transport_hint: str = "") -> int:
        """READs ``peer_buffer_addresses[i]`` into ``buffers[i]`` from one peer; blocks; 0 or -1."""
        return self._sync(target_hostname, TransferOp.READ, buffers, peer_buffer_addresses, lengths)

    def batch_transfer_sync(self, target_hostname: str, buffers: Sequence[int], peer_buffer_addresses: Sequence[int],
                            lengths: Sequence[int], opcode: TransferOpcode | int, notify: Any = None,
                            transport_hint: str = "") -> int:
        """A batch of READs or WRITEs by opcode; blocks; 0 or -1."""
        op = self._op(opcode, notify)
        if op is None:
            return _FAILED
        return self._sync(target_hostname, op, buffers, peer_buffer_addresses, lengths)

    # ---- asynchronous transfers ---------------------------------------------------------

    def batch_transfer_async_write(self, target_hostname: str, buffers: Sequence[int],
                                   peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                                   transport_hint: str = "") -> int:
        """Submits a batch of WRITEs; its batch id, or 0 on failure."""
        return self._submit(target_hostname, TransferOp.WRITE, buffers, peer_buffer_addresses, lengths)

    def batch_transfer_async_read(self, target_hostname: str, buffers: Sequence[int],
                                  peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                                  transport_hint: str = "") -> int:
        """Submits a batch of READs; its batch id, or 0 on failure."""
        return self._submit(target_hostname, TransferOp.READ, buffers, peer_buffer_addresses, lengths)

    def batch_transfer_async(self, target_hostname: str, buffers: Sequence[int], peer_buffer_addresses: Sequence[int],
                             lengths: Sequence[int], opcode: TransferOpcode | int, transport_hint: str = "") -> int:
        """Submits a batch of READs or WRITEs by opcode; its batch id, or 0 on failure."""
        op = self._op(opcode, None)
        if op is None:
            return _NO_BATCH
        return self._submit(target_hostname, op, buffers, peer_buffer_addresses, lengths)

    def transfer_submit_write(self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int,
                              transport_hint: str = "") -> int:
        """Submits one WRITE; its batch id, or 0 on failure."""
        return self._submit(target_hostname, TransferOp.WRITE, [buffer], [peer_buffer_address], [length])

    def get_batch_transfer_status(self, batch_ids: Sequence[int]) -> int:
        """Blocks until every batch finished and forgets them; 0 if all succeeded, else -1."""
        status = _OK
        for batch_id in batch_ids:
            with self._lock:
                handle = self._batches.pop(int(batch_id), None)
            if handle is None:
                logger.error("mooncake compat: unknown batch id %d", batch_id)
                status = _FAILED
                continue
            try:
                handle.wait()
            except TidekvError as exc:
                logger.error("mooncake compat: batch %d failed: %s", batch_id, exc)
                status = _FAILED
        return status

    def transfer_check_status(self, batch_id: int) -> int:
        """Polls a batch: 1 done (forgotten), 0 in progress, -1 failed (forgotten), -2 timed out."""
        with self._lock:
            handle = self._batches.get(int(batch_id))
            if handle is None:
                logger.error("mooncake compat: unknown batch id %d", batch_id)
                return _FAILED
            if not handle.done():
                return _IN_PROGRESS
            del self._batches[int(batch_id)]
        try:
            handle.wait(0)
            return _DONE
        except TransferTimeoutError as exc:
            logger.error("mooncake compat: batch %d timed out: %s", batch_id, exc)
            return _TIMED_OUT
        except TidekvError as exc:
            logger.error("mooncake compat: batch %d failed: %s", batch_id, exc)
            return _FAILED

    # ---- internals ----------------------------------------------------------------------

    def _require(self) -> _TidekvEngine:
        if self._engine is None:
            raise EngineClosedError("mooncake compat: call initialize() first")
        return self._engine

    @staticmethod
    def _misuse(method: str, *sizes: int) -> int:
        if len(set(sizes)) > 1:
            logger.error("mooncake compat: %s got lists of different lengths %s", method, list(sizes))
        else:
            logger.error("mooncake compat: %s called before initialize()", method)
        return _FAILED

    @staticmethod
    def _op(opcode: TransferOpcode | int, notify: Any) -> TransferOp | None:
        if notify is not None:
            logger.error("mooncake compat: transfer notifications are not supported")
            return None
        try:
            return _OPS[TransferOpcode(int(opcode))]
        except ValueError:
            logger.error("mooncake compat: opcode %r is neither READ (0) nor WRITE (1)", opcode)
            return None

    def _requests(self, target: str, op: TransferOp, buffers: Sequence[int], peer_addresses: Sequence[int],
                  lengths: Sequence[int]) -> list[TransferRequest] | None:
        if self._engine is None or not len(buffers) == len(peer_addresses) == len(lengths):
            self._misuse(f"{op.name} batch", len(buffers), len(peer_addresses), len(lengths))
            return None
        # Mooncake accepts empty slices (SGLang can produce them); tidekv refuses length 0.
        return [TransferRequest(op, int(b), int(n), target, int(r))
                for b, r, n in zip(buffers, peer_addresses, lengths) if n > 0]

    def _sync(self, target: str, op: TransferOp, buffers: Sequence[int], peer_addresses: Sequence[int],
              lengths: Sequence[int]) -> int:
        requests = self._requests(target, op, buffers, peer_addresses, lengths)
        if requests is None:
            return _FAILED
        if not requests:
            return _OK
        try:
            # No deadline: the waiting thread runs the batch itself; a stalled peer still fails
            # after TransferConfig.io_timeout_s.
            self._require().transfer(requests).wait()
            return _OK
        except TidekvError as exc:
            logger.error("mooncake compat: %s of %d request(s) to %s failed: %s", op.name, len(requests), target, exc)
            return _FAILED

    def _submit(self, target: str, op: TransferOp, buffers: Sequence[int], peer_addresses: Sequence[int],
                lengths: Sequence[int]) -> int:
        requests = self._requests(target, op, buffers, peer_addresses, lengths)
        if not requests:
            if requests is not None:
                logger.error("mooncake compat: async batch to %s has no non-empty request", target)
            return _NO_BATCH
        try:
            handle = self._require().transfer(requests)
        except TidekvError as exc:
            logger.error("mooncake compat: submitting %s of %d request(s) to %s failed: %s",
                         op.name, len(requests), target, exc)
            return _NO_BATCH
        with self._lock:
            batch_id = next(self._batch_ids)
            self._batches[batch_id] = handle
        return batch_id

    def close(self) -> None:
        """Stops the engine (not in Mooncake's API, where the engine lives until process exit)."""
        if self._engine is not None:
            self._engine.close()
