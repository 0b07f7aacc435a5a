"""Mooncake's store API (``mooncake.store``) over ``tidekv.Store``: ``MooncakeDistributedStore``,
``ReplicateConfig``, ``MooncakeHostMemAllocator`` and the descriptor types, with Mooncake's
signatures and return conventions, so code written for Mooncake's store runs on tidekv unchanged
(``tidekv-mooncake-shim`` makes ``import mooncake.store`` resolve here).

Integers at this boundary are Mooncake's contract (0 = success, negative = Mooncake's
``ErrorCode``; ``get`` of a missing key returns ``b""``). Every method is translation only: it
calls one ``tidekv.Store`` method and turns the typed error it raises into Mooncake's code through
``mooncake_types.error_code`` (one table). A method never raises where Mooncake returns a code.
Where the semantics differ (leases, puts of existing keys, unsupported ``setup`` arguments raise
``TypeError``, ``ReplicateConfig`` fields without effect): the design notes below.

Neighbours: ``tidekv.store.client.store`` (the Store underneath), ``tidekv.compat.mooncake`` (the
transfer engine, whose ``get_engine()`` ``setup`` can share), ``tidekv.config.parse_size``.
Thread-safety: as ``tidekv.Store``, every method may be called from any thread.
Design notes: docs/design-compat.md#tidekvcompatmooncake_store
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Callable, Sequence
from typing import Any

from tidekv.compat.mooncake import _split_hostname, transfer_config_for
from tidekv.compat.mooncake_admin import AdminMethods
from tidekv.compat.mooncake_config import SETUP_ENV_VARIABLES as _ENV_KEYS
from tidekv.compat.mooncake_config import SETUP_KEYS as _DICT_ALIASES
from tidekv.compat.mooncake_config import offload_disk, offload_enabled
from tidekv.compat.mooncake_tensors import TensorMethods
from tidekv.compat.mooncake_types import (
    BufferHandle,
    Descriptor,
    DiskDescriptor,
    ErrorCode,
    MemoryDescriptor,
    ReplicaDescriptor,
    ReplicateConfig,
    error_code,
    placement,
)
from tidekv.config import ETCD_SCHEME, POOL_SEPARATOR, StoreConfig, parse_size
from tidekv.errors import ConfigError, ObjectLeasedError, ObjectNotFoundError, TidekvError
from tidekv.logs import WarnEvery
from tidekv.store.client.store import ObjectInfo, Store
from tidekv.store.wire.keys import key_bytes
from tidekv.store.wire.protocol import Status
from tidekv.transfer.engine import TransferEngine as _TidekvEngine

logger = logging.getLogger(__name__)

_STATUS_ERRORS = {Status.NOT_FOUND: ObjectNotFoundError, Status.LEASED: ObjectLeasedError}
_REMOVE_BATCH = 1024
"""Keys per remove request of ``remove_all`` / ``remove_by_regex``."""
"""Per-key outcomes of a batch remove, as the errors a single remove raises (then ``error_code``)."""

_warn_failures = WarnEvery(10.0)


def _log_failure(op: str, exc: TidekvError) -> None:
    if isinstance(exc, ObjectNotFoundError):
        logger.debug("mooncake store compat: %s: %s", op, exc)
        return
    held_back = _warn_failures.due()
    if held_back is not None:
        logger.warning("mooncake store compat: %s failed (%s): %s%s", op, error_code(exc), exc,
                       f" ({held_back} similar failures not logged)" if held_back else "")


def _replicas(info: ObjectInfo) -> list[ReplicaDescriptor]:
    out = [ReplicaDescriptor(MemoryDescriptor(Descriptor(loc.addr, loc.length, loc.engine))) for loc in info.locations]
    if info.disk is not None:
        d = info.disk
        out.append(ReplicaDescriptor(None, DiskDescriptor(f"{d.disk}@{d.offset}", info.size_bytes, d.address)))
    return out


# ---- the store ----------------------------------------------------------------------------

MOONCAKE_CLUSTER = "mooncake_cluster"
"""Mooncake's default ``cluster_id`` (``MC_STORE_CLUSTER_ID``): the tidekv cluster name that an
``etcd://`` master address means (``mooncake_master --enable_ha`` campaigns under the same)."""

_DICT_DEFAULTS: dict[str, Any] = {"global_segment_size": 16 << 20, "local_buffer_size": 16 << 20, "protocol": "tcp",
                                  "rdma_devices": "", "master_server_addr": "127.0.0.1:50051",
                                  "metadata_server": "P2PHANDSHAKE", "local_hostname": "localhost"}
"""Mooncake's defaults for ``setup(config)`` (its docstring), after the variables."""

_SETUP_KEYS = {"local_hostname", "metadata_server", "global_segment_size", "local_buffer_size", "protocol",
               "rdma_devices", "master_server_addr", "enable_ssd_offload", "ssd_offload_path", "tenant_id",
               "enable_client_http_server", "client_http_port"}
"""The keys ``setup(config)`` reads (Mooncake's; ``ipc_socket_path`` is its dummy client's)."""

"""Key spellings Mooncake's JSON configs use for ``setup(config)`` keys."""


def master_address(text: str) -> str:
    """Mooncake's ``master_server_addr`` as a tidekv master address: "host:port" as it is,
    "etcd://H:P;H:P" (Mooncake's HA form) as tidekv's "etcd://H:P,H:P/CLUSTER" with CLUSTER from
    ``MC_STORE_CLUSTER_ID`` (default "mooncake_cluster"); tidekv's own "g0=H:P;g1=..." (a pool
    sharded over master groups) as it is.

    Raises:
        ConfigError: another scheme (Redis and Kubernetes leader election are Mooncake's only).
    """
    if text.startswith(ETCD_SCHEME):
        hosts = ",".join(h.strip() for h in text[len(ETCD_SCHEME):].replace(";", ",").split(",") if h.strip())
        return f"{ETCD_SCHEME}{hosts}/{os.environ.get('MC_STORE_CLUSTER_ID', MOONCAKE_CLUSTER)}"
    if POOL_SEPARATOR in text:
        return text  # tidekv's own form: several master groups of a sharded pool (PoolAddress)
    if "://" in text:
        raise ConfigError(f"master_server_addr={text!r}: tidekv masters are found at host:port or through etcd "
                          "(etcd://H:P;H:P); redis:// and k8s:// leader election are not supported")
    return text


class MooncakeDistributedStore(TensorMethods, AdminMethods):
    """Mooncake's store client over ``tidekv.Store``; call ``setup`` (or ``setup_dummy``) first."""

    def __init__(self) -> None:
        self._store: Store | None = None
        self._engine: _TidekvEngine | None = None  # ours to close; None when shared or not set up
        self._buffers: dict[int, Any] = {}  # address -> Region, from register_buffer
        self._lock = threading.Lock()

    # ---- setup and lifecycle ---------------------------------------------------------------

    def setup(self, *args: Any, **kwargs: Any) -> int:
        """``setup(local_hostname, metadata_server, global_segment_size, local_buffer_size,
        protocol, rdma_devices, master_server_addr, engine=None, enable_ssd_offload=False,
        ssd_offload_path="", tenant_id="default", enable_client_http_server=False,
        client_http_port=9300)`` or ``setup(config: dict)``; 0 on success, else a negative code.

        Raises:
            TypeError: an argument Mooncake has but tidekv cannot honour (named), or one
                Mooncake does not have.
        """
        if len(args) == 1 and not kwargs and isinstance(args[0], dict):
            return self._setup_from_dict(args[0])
        return self._setup(*args, **kwargs)

    def setup_dummy(self, mem_pool_size: int, local_buffer_size: int, server_address: str) -> int:
        """Attaches to the tidekv master at ``server_address`` with no memory of its own (the
        pool is the server's; ``mem_pool_size`` is not used). 0, or a negative code."""
        return self._connect("setup_dummy", server_address, "127.0.0.1", 0, 0, local_buffer_size, None)

    def close(self) -> int:
        """Unmounts this client's segment (its objects leave the pool) and disconnects; 0."""
        with self._lock:
            store, engine, self._store, self._engine = self._store, self._engine, None, None
            self._buffers.clear()
        if store is not None:
            self._release_all(store)
            store.close()
            self._close_mapped()
        if engine is not None:
            engine.close()
        return int(ErrorCode.OK)

    def health_check(self) -> int:
        """0 healthy, 1 not set up (or closed), 2 master unreachable."""
        store = self._store
        if store is None:
            return 1
        try:
            store.stats()
        except TidekvError:
            return 2
        return 0

    @property
    def local_buffer_size(self) -> int:
        """Bytes of this client's staging buffer (``setup``'s ``local_buffer_size``, at least
        1 MiB); 0 before setup."""
        store = self._store
        return 0 if store is None else store.config.staging_size_bytes

    def get_hostname(self) -> str:
        """This client's segment name (its engine's name without a segment): the value to put in
        ``ReplicateConfig.preferred_segment`` for "here"; "" before setup."""
        store = self._store
        if store is None:
            return ""
        return store.segment_name or store.engine.name

    # ---- registered memory -----------------------------------------------------------------

    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        """Registers host memory for the zero-copy calls; 0, or a negative code."""
        def run(store: Store) -> int:
            region = store.register((buffer_ptr, size))
            with self._lock:
                self._buffers[buffer_ptr] = region
            return 0
        return self._code("register_buffer", run)

    def unregister_buffer(self, buffer_ptr: int) -> int:
        """0, or -600 for an address ``register_buffer`` was not given."""
        def run(store: Store) -> int:
            with self._lock:
                region = self._buffers.pop(buffer_ptr, None)
            if region is None:
                raise ConfigError(f"buffer at {buffer_ptr:#x} is not registered; register_buffer() it first")
            store.unregister(region)
            return 0
        return self._code("unregister_buffer", run)

    # ---- bytes objects ---------------------------------------------------------------------

    def put(self, key: str, value: Any, config: ReplicateConfig | None = None) -> int:
        """Stores ``value`` (any buffer); 0 also when the key exists (its bytes stay)."""
        return self._code("put", lambda s: s.put(key, value, **placement(config)))

    def put_parts(self, key: str, *parts: Any, config: ReplicateConfig | None = None) -> int:
        """Stores the concatenation of ``parts``; 0 or a negative code."""
        return self._code("put_parts", lambda s: s.put(key, b"".join(bytes(memoryview(p)) for p in parts),
                                                       **placement(config)))

    def upsert_parts(self, key: str, *parts: Any, config: ReplicateConfig | None = None) -> int:
        """Stores the concatenation of ``parts``, replacing the key's bytes if it exists."""
        return self._code("upsert_parts", lambda s: s.upsert(key, b"".join(bytes(memoryview(p)) for p in parts),
                                                          **placement(config)))

    def put_from_with_metadata(self, key: str, buffer_ptr: int, metadata_buffer_ptr: int, size: int,
                               metadata_size: int, config: ReplicateConfig | None = None) -> int:
        """Stores [metadata][data] from two registered buffers as one object (Mooncake's order),
        gathered with no copy; 0 or a negative code."""
        parts = [(metadata_buffer_ptr, metadata_size), (buffer_ptr, size)]
        return self._code("put_from_with_metadata", lambda s: s.put_from(key, [p for p in parts if p[1]],
                                                                         **placement(config)))

    def put_batch(self, keys: list[str], values: list[Any], config: ReplicateConfig | None = None) -> int:
        """Stores several objects; 0, or the code of the first key that failed."""
        return self._code("put_batch", lambda s: s.put_many(keys, values, **placement(config)))

    def upsert(self, key: str, value: Any, config: ReplicateConfig | None = None) -> int:
        """Stores ``value``, replacing the key's bytes if it exists; 0 or a negative code."""
        return self._code("upsert", lambda s: s.upsert(key, value, **placement(config)))

    def upsert_batch(self, keys: list[str], values: list[Any], config: ReplicateConfig | None = None) -> int:
        return self._code("upsert_batch", lambda s: s.put_many(keys, values, upsert=True, **placement(config)))

    def get(self, key: str) -> bytes:
        """The key's bytes; ``b""`` when it is missing or the read failed."""
        return self.get_batch([key])[0]

    def get_batch(self, keys: list[str]) -> list[bytes]:
        """Each key's bytes, ``b""`` where missing; all ``b""`` when the batch failed."""
        def run(store: Store) -> list[bytes]:
            return [b"" if v is None else v for v in store.get_many(keys)]
        out = self._call("get_batch", run)
        return [b""] * len(keys) if isinstance(out, int) else out

    def get_buffer(self, key: str) -> BufferHandle | None:
        """The key's bytes as a BufferHandle; None when missing or the read failed."""
        return self.batch_get_buffer([key])[0]

    def batch_get_buffer(self, keys: list[str]) -> list[BufferHandle | None]:
        def run(store: Store) -> list[BufferHandle | None]:
            return [None if v is None else BufferHandle(v) for v in store.get_many(keys)]
        out = self._call("batch_get_buffer", run)
        return [None] * len(keys) if isinstance(out, int) else out

    # ---- metadata ----------------------------------------------------------------------------

    def is_exist(self, key: str) -> int:
        """1 present, 0 absent, -1 error; a present object gets a read lease (as in Mooncake)."""
        return self.batch_is_exist([key])[0]

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        """Per key 1 present, 0 absent; all -1 when the lookup failed. Leases what it finds."""
        out = self._call("batch_is_exist", lambda s: [0 if i is None else 1 for i in s.lookup_many(keys)])
        return [-1] * len(keys) if isinstance(out, int) else out

    def get_size(self, key: str) -> int:
        """The object's size, -704 when missing, or another negative code. Leases it."""
        def run(store: Store) -> int:
            info = store.lookup_many([key])[0]
            return int(ErrorCode.OBJECT_NOT_FOUND) if info is None else info.size_bytes
        return self._code("get_size", run)

    def get_replica_desc(self, key: str) -> list[ReplicaDescriptor]:
        return self.batch_get_replica_desc([key]).get(key, [])

    def batch_get_replica_desc(self, keys: list[str]) -> dict[str, list[ReplicaDescriptor]]:
        """Key -> its replicas, for the keys found (leased, as Mooncake's GetReplicaList does)."""
        def run(store: Store) -> dict[str, list[ReplicaDescriptor]]:
            return {k: _replicas(i) for k, i in zip(keys, store.lookup_many(keys)) if i is not None}
        out = self._call("batch_get_replica_desc", run)
        return {} if isinstance(out, int) else out

    def remove(self, key: str, force: bool = False) -> int:
        """0, -704 missing, -706 leased by a reader (``force=True`` removes anyway)."""
        return self.batch_remove([key], force)[0]

    def batch_remove(self, keys: list[str], force: bool = False) -> list[int]:
        def run(store: Store) -> list[int]:
            statuses = store.remove_many(keys, force=force)
            return [error_code(_STATUS_ERRORS[s]) if s in _STATUS_ERRORS else 0 for s in statuses]
        out = self._call("batch_remove", run)
        return [out] * len(keys) if isinstance(out, int) else out

    def remove_all(self, force: bool = False) -> int:
        """Removes every object; returns how many (or a negative code). Objects a reader holds a
        lease on stay unless ``force`` (Mooncake leaves them silently; this logs how many)."""
        return self._remove_matching("remove_all", None, force)

    def remove_by_regex(self, regex_pattern: str, force: bool = False) -> int:
        """Removes every object whose key matches ``regex_pattern`` (``re.search``, as Mooncake's
        std::regex_search); returns how many, -600 for a pattern that does not compile."""
        try:
            pattern = re.compile(regex_pattern)
        except (re.error, TypeError) as exc:
            logger.error("mooncake store compat: remove_by_regex(%r): not a regular expression: %s", regex_pattern, exc)
            return int(ErrorCode.INVALID_PARAMS)
        return self._remove_matching("remove_by_regex", pattern, force)

    def _remove_matching(self, op: str, pattern: re.Pattern[str] | None, force: bool) -> int:
        def run(store: Store) -> int:
            removed = leased = 0
            batch: list[bytes] = []

            def flush() -> None:
                nonlocal removed, leased
                statuses = store.remove_many(batch, force=force)
                removed += sum(1 for st in statuses if st is Status.OK)
                leased += sum(1 for st in statuses if st is Status.LEASED)
                batch.clear()

            for key in store.keys():
                if pattern is None or pattern.search(key.decode("utf-8", "surrogateescape")):
                    batch.append(key)
                    if len(batch) >= _REMOVE_BATCH:
                        flush()
            if batch:
                flush()
            if leased:
                logger.warning("mooncake store compat: %s() left %d object(s) a reader holds a lease on (force=True "
                               "removes them too); removed %d", op, leased, removed)
            return removed
        return int(self._call(op, run))

    # ---- zero-copy ---------------------------------------------------------------------------

    def put_from(self, key: str, buffer_ptr: int, size: int, config: ReplicateConfig | None = None) -> int:
        """Stores ``size`` bytes of registered memory at ``buffer_ptr``; 0 or a negative code."""
        return self.batch_put_from([key], [buffer_ptr], [size], config)[0]

    def batch_put_from(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int],
                       config: ReplicateConfig | None = None) -> list[int]:
        """Per key 0 (also for a key that exists: its bytes stay) or a negative code."""
        return self._put_many(keys, _pairs(keys, buffer_ptrs, sizes), config, upsert=False)

    def batch_put_from_multi_buffers(self, keys: list[str], all_buffer_ptrs: list[list[int]],
                                     all_sizes: list[list[int]], config: ReplicateConfig | None = None) -> list[int]:
        """As batch_put_from; each object is the concatenation of its buffers."""
        return self._put_many(keys, _parts(keys, all_buffer_ptrs, all_sizes), config, upsert=False)

    def upsert_from(self, key: str, buffer_ptr: int, size: int, config: ReplicateConfig | None = None) -> int:
        return self.batch_upsert_from([key], [buffer_ptr], [size], config)[0]

    def batch_upsert_from(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int],
                          config: ReplicateConfig | None = None) -> list[int]:
        return self._put_many(keys, _pairs(keys, buffer_ptrs, sizes), config, upsert=True)

    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        """Reads the object into registered memory: its size, or -704 / -600 (buffer too small)
        / -707 (lease expired) / another negative code."""
        return self.batch_get_into([key], [buffer_ptr], [size])[0]

    def batch_get_into(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]) -> list[int]:
        """Per key the bytes read, or a negative code as for get_into."""
        return self._get_many(keys, _pairs(keys, buffer_ptrs, sizes))

    def batch_get_into_multi_buffers(self, keys: list[str], all_buffer_ptrs: list[list[int]],
                                     all_sizes: list[list[int]], prefer_alloc_in_same_node: bool = False) -> list[int]:
        """As batch_get_into; each object fills its buffers in order."""
        return self._get_many(keys, _parts(keys, all_buffer_ptrs, all_sizes))

    def get_into_ranges(self, buffer_ptrs: list[int], all_keys: list[list[str]],
                        all_dst_offsets: list[list[list[int]]], all_src_offsets: list[list[list[int]]],
                        all_sizes: list[list[list[int]]]) -> list[list[list[int]]]:
        """For buffer ``i``, key ``j`` of ``all_keys[i]`` and range ``k``: the object's bytes
        ``[src, src + size)`` go to ``buffer_ptrs[i] + dst``. Per range the bytes read, or a
        negative code (-704 missing, -600 a range past the object's end or lists of unequal
        shape, -707 lease expired, ...). Where a key appears more than once and one of its
        ranges fails, all of them report that failure."""
        shape = [[len(s) for s in per_key] for per_key in all_sizes]
        flat_keys: list[str] = []
        flat_ranges: list[list[tuple[int, tuple[int, int]]]] = []
        try:
            for i, ptr in enumerate(buffer_ptrs):
                for j, key in enumerate(all_keys[i]):
                    dst, src, sizes = all_dst_offsets[i][j], all_src_offsets[i][j], all_sizes[i][j]
                    if not len(dst) == len(src) == len(sizes):
                        raise IndexError
                    flat_keys.append(key)
                    flat_ranges.append([(s, (ptr + d, n)) for d, s, n in zip(dst, src, sizes)])
            if len(flat_keys) != sum(len(per_key) for per_key in shape) or len(all_keys) != len(buffer_ptrs):
                raise IndexError
        except IndexError:
            logger.error("mooncake store compat: get_into_ranges: its lists differ in shape")
            return [[[int(ErrorCode.INVALID_PARAMS)] * n for n in per_key] for per_key in shape]
        out = self._call("get_into_ranges", lambda s: _read_into(
            s, flat_keys, flat_ranges, lambda st, k, r: st.get_ranges_into(k, r)))
        codes = [out] * len(flat_keys) if isinstance(out, int) else out
        results, n = [], 0
        for per_key in shape:
            rows = []
            for _ in per_key:
                code, ranges = codes[n], flat_ranges[n]
                rows.append([length if code >= 0 else code for _, (_, length) in ranges])
                n += 1
            results.append(rows)
        return results

    # ---- internals ---------------------------------------------------------------------------

    def _setup(self, local_hostname: str, metadata_server: str, global_segment_size: int, local_buffer_size: int,
               protocol: str, rdma_devices: str, master_server_addr: str, engine: Any = None,
               enable_ssd_offload: bool = False, ssd_offload_path: str = "", tenant_id: str = "default",
               enable_client_http_server: bool = False, client_http_port: int = 9300) -> int:
        for name, asked, why in (("tenant_id", tenant_id != "default", "no tenants"),
                                 ("enable_client_http_server", enable_client_http_server, "no client HTTP server")):
            if asked:
                raise TypeError(f"setup() got an unsupported keyword argument '{name}': tidekv's Mooncake "
                                f"drop-in has {why}")
        if metadata_server != "P2PHANDSHAKE":
            logger.info("mooncake store compat: metadata_server %r is not used (tidekv engines handshake directly)",
                        metadata_server)
        shared = engine if isinstance(engine, _TidekvEngine) else None
        if engine is not None and shared is None:
            logger.warning("mooncake store compat: engine %r is not a tidekv TransferEngine; starting one", engine)
        host, port = _split_hostname(local_hostname)
        disk = ssd_offload_path if offload_enabled(enable_ssd_offload) else None
        return self._connect("setup", master_server_addr, host, port, global_segment_size, local_buffer_size, shared,
                             disk, protocol, rdma_devices)

    def _setup_from_dict(self, config: dict[str, Any]) -> int:
        values: dict[str, Any] = {}
        for key, value in config.items():
            values[_DICT_ALIASES.get(key, key)] = value
        unused = sorted(set(values) - _SETUP_KEYS)
        if unused:
            logger.warning("mooncake store compat: setup(config) does not use key(s) %s", unused)
        values = {k: v for k, v in values.items() if k in _SETUP_KEYS}
        for key, variable in _ENV_KEYS.items():
            if key not in values and variable in os.environ:
                values[key] = os.environ[variable]
        for key, default in _DICT_DEFAULTS.items():
            values.setdefault(key, default)
        try:
            return self._setup(**values)
        except TypeError as exc:
            logger.error("mooncake store compat: setup(config) refused: %s", exc)
            return int(ErrorCode.INVALID_PARAMS)

    def _connect(self, op: str, master: str, host: str, port: int, segment_size: Any, buffer_size: Any,
                 engine: _TidekvEngine | None, offload: str | None = None, protocol: str = "tcp",
                 devices: str = "") -> int:
        if self._store is not None:
            logger.error("mooncake store compat: %s() called on a store that is set up; close() it first", op)
            return int(ErrorCode.INVALID_PARAMS)
        own: _TidekvEngine | None = None
        try:
            config = StoreConfig.from_env(segment_size_bytes=parse_size(segment_size, "global_segment_size"),
                                          staging_size_bytes=max(parse_size(buffer_size, "local_buffer_size"), 1 << 20),
                                          **self._disk_settings(offload))
            address = master_address(master)
            if engine is None:
                # The store's "tcp" (its default) leaves same-host peers on shm; "rdma"/"efa" pick fabric.
                transfer = transfer_config_for("" if protocol == "tcp" else protocol, devices)
                engine = own = _TidekvEngine(host=host, port=port, config=transfer)
            store = Store.connect(address, config=config, engine=engine)
        except TidekvError as exc:
            if own is not None:
                own.close()
            logger.error("mooncake store compat: %s() failed: %s", op, exc)
            return error_code(exc)
        with self._lock:
            self._store, self._engine = store, own
        logger.info("mooncake store compat: %s() connected to master %s (segment %s, %d bytes)", op, address,
                    store.segment_name or "none", config.segment_size_bytes)
        return int(ErrorCode.OK)

    @staticmethod
    def _disk_settings(offload: str | None) -> dict[str, Any]:
        """StoreConfig fields of SSD offload in ``offload`` ("": Mooncake's variable), or none."""
        if offload is None:
            return {}
        path, size = offload_disk(offload)
        return {"disk_paths": path, "disk_size_bytes": size}

    def _call(self, op: str, run: Callable[[Store], Any]) -> Any:
        """``run(store)``, or the Mooncake code of the tidekv error it raised."""
        store = self._store
        if store is None:
            logger.error("mooncake store compat: %s() before setup()", op)
            return int(ErrorCode.INTERNAL_ERROR)
        try:
            return run(store)
        except TidekvError as exc:
            _log_failure(op, exc)
            return error_code(exc)

    def _code(self, op: str, run: Callable[[Store], Any]) -> int:
        out = self._call(op, run)
        return out if isinstance(out, int) else int(ErrorCode.OK)

    def _one(self, op: str, run: Callable[[Store], Any]) -> Any:
        """``run``'s tensor, or None when it failed (Mooncake's get convention)."""
        out = self._call(op, run)
        return None if isinstance(out, int) else out

    def _per_key(self, op: str, keys: Sequence[str], run: Callable[[Store], Any]) -> list[int]:
        """Per key 0, or the code of its entry in the batch error ``run`` raised."""
        def codes(store: Store) -> list[int]:
            try:
                run(store)
            except TidekvError as exc:
                failed = exc.failed_keys
                if not failed:  # not a batch's per-key failure
                    raise
                _log_failure(op, exc)
                return [error_code(failed[b]) if (b := key_bytes(k)) in failed else 0 for k in keys]
            return [0] * len(keys)
        out = self._call(op, codes)
        return [out] * len(keys) if isinstance(out, int) else out

    def _put_many(self, keys: list[str], buffers: Sequence[Any] | None, config: ReplicateConfig | None,
                  upsert: bool) -> list[int]:
        if buffers is None:
            logger.error("mooncake store compat: batch put: keys, buffers and sizes differ in length")
            return [int(ErrorCode.INVALID_PARAMS)] * len(keys)
        # Mooncake refuses an empty object alone; tidekv refuses the batch that holds one.
        empty = {i for i, b in enumerate(buffers) if not any(n for _, n in (b if isinstance(b, list) else [b]))}
        todo = [i for i in range(len(keys)) if i not in empty]

        some = [keys[i] for i in todo]
        out = self._per_key("batch_put_from", some, lambda s: s.put_many_from(
            some, [buffers[i] for i in todo], upsert=upsert, **placement(config))) if todo else []
        done = dict(zip(todo, out))
        return [done.get(i, int(ErrorCode.INVALID_PARAMS)) for i in range(len(keys))]

    def _get_many(self, keys: list[str], buffers: Sequence[Any] | None) -> list[int]:
        if buffers is None:
            logger.error("mooncake store compat: batch get: keys, buffers and sizes differ in length")
            return [int(ErrorCode.INVALID_PARAMS)] * len(keys)

        def run(store: Store) -> list[int]:
            return _read_into(store, keys, buffers)
        out = self._call("batch_get_into", run)
        return [out] * len(keys) if isinstance(out, int) else out


def _pairs(keys: list[str], buffer_ptrs: list[int], sizes: list[int]) -> list[tuple[int, int]] | None:
    """Per key (address, size); None when the lists differ in length."""
    if not len(keys) == len(buffer_ptrs) == len(sizes):
        return None
    return list(zip(buffer_ptrs, sizes))


def _parts(keys: list[str], all_buffer_ptrs: list[list[int]],
           all_sizes: list[list[int]]) -> list[list[tuple[int, int]]] | None:
    """Per key its buffers as (address, size) parts; None when the lists differ in shape."""
    if not len(keys) == len(all_buffer_ptrs) == len(all_sizes) or \
            any(len(p) != len(s) for p, s in zip(all_buffer_ptrs, all_sizes)):
        return None
    return [list(zip(ptrs, sizes)) for ptrs, sizes in zip(all_buffer_ptrs, all_sizes)]


Reader = Callable[[Store, list[str], Sequence[Any]], list[int | None]]
"""``Store.get_many_into`` or ``Store.get_ranges_into``: per key the object's size or None."""


def _read_into(store: Store, keys: list[str], buffers: Sequence[Any], read: Reader | None = None) -> list[int]:
    """Per key the object's size once read into its buffers (``read``, default get_many_into),
    or Mooncake's code for why not."""
    read = read or (lambda s, k, b: s.get_many_into(k, b))
    try:
        sizes = read(store, keys, buffers)
    except TidekvError as exc:
        failed = exc.failed_keys
        if not failed:  # not a batch's per-key failure
            raise
        _log_failure("batch_get_into", exc)
        codes = {b: error_code(e) for b, e in failed.items()}
        rest = [i for i, k in enumerate(keys) if key_bytes(k) not in codes]
        if isinstance(exc, ConfigError):  # buffers too small: nothing was read, read the others
            done = _read_into(store, [keys[i] for i in rest], [buffers[i] for i in rest], read) if rest else []
        else:  # the others were read (or are missing); their sizes went with the error
            infos = store.lookup_many([keys[i] for i in rest]) if rest else []
            done = [int(ErrorCode.OBJECT_NOT_FOUND) if i is None else i.size_bytes for i in infos]
        out = dict(zip(rest, done))
        return [out[i] if i in out else codes[key_bytes(k)] for i, k in enumerate(keys)]
    return [int(ErrorCode.OBJECT_NOT_FOUND) if n is None else n for n in sizes]
