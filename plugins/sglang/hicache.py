"""TidekvHiCacheStorage: SGLang's L3 HiCache storage backend on the tidekv store.

Loaded by SGLang's dynamic backend factory (``--hicache-storage-backend dynamic``, module
``tidekv_sglang.hicache``, class ``TidekvHiCacheStorage``). It turns page hashes into store keys
(``keys``) and host-pool slots into ``(address, length)`` spans (``get_page_buffer_meta``), and
hands both to ``tidekv.store.Store``; the host pool is registered, so ``batch_get_v1`` /
``batch_set_v1`` copy nothing in between. Failures are reported per page ``False`` (or a shorter
hit count) after logging the typed error; only set-up problems raise (``ConfigError``,
``MasterUnavailableError``). Every method is thread-safe: SGLang calls from its scheduler,
prefetch and backup threads concurrently.

Neighbours: ``settings`` (extra-config keys), ``keys`` (page keys), ``tidekv.store.Store``.
Design notes: docs/design-kvcache.md#tidekv_sglanghicache
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from tidekv.config import StoreConfig, TransferConfig, TransportKind
from tidekv.errors import ConfigError, StoreError, TidekvError
from tidekv.kvcache.ranks import rank_port
from tidekv.store import Store
from tidekv_sglang.keys import PageKeys
from tidekv_sglang.settings import HiCacheSettings

logger = logging.getLogger(__name__)

_WARN_EVERY_S = 10.0


class _Throttle:
    """At most one warning per operation every ``_WARN_EVERY_S``; counts the ones it held back."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def warn(self, op: str, message: str, *args: Any) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(op, -_WARN_EVERY_S) < _WARN_EVERY_S:
                self._held[op] = self._held.get(op, 0) + 1
                return
            self._last[op] = now
            held = self._held.pop(op, 0)
        logger.warning(message + (f" ({held} similar warnings suppressed)" if held else ""), *args)


class _Metrics:
    """Pages and GB/s per batch, drained by get_stats() (the fields of SGLang's StorageMetrics)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.prefetch_pgs: list[int] = []
        self.backup_pgs: list[int] = []
        self.prefetch_bandwidth: list[float] = []
        self.backup_bandwidth: list[float] = []

    def record(self, is_get: bool, pages: int, nbytes: int, seconds: float) -> None:
        gbps = nbytes / max(seconds, 1e-9) / 1e9
        with self._lock:
            (self.prefetch_pgs if is_get else self.backup_pgs).append(pages)
            (self.prefetch_bandwidth if is_get else self.backup_bandwidth).append(gbps)

    def drain(self) -> tuple[list[int], list[int], list[float], list[float]]:
        with self._lock:
            out = (self.prefetch_pgs, self.backup_pgs, self.prefetch_bandwidth, self.backup_bandwidth)
            self.prefetch_pgs, self.backup_pgs, self.prefetch_bandwidth, self.backup_bandwidth = [], [], [], []
        return out


class TidekvHiCacheStorage(HiCacheStorage):
    """An SGLang ``HiCacheStorage`` whose pages live in a tidekv store pool.

    Args:
        storage_config: SGLang's ``HiCacheStorageConfig``; ``extra_config`` carries our settings
            (``tidekv_sglang.settings.HiCacheSettings``).
        kwargs: extra keyword arguments from SGLang's factory (unused; ``{}`` in practice).

    Raises:
        ConfigError: a bad or unknown setting, or a parallel layout this backend does not support.
        MasterUnavailableError, ProtocolVersionError: the master cannot be used.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        self.storage_config = storage_config
        self.settings = HiCacheSettings.from_extra_config(storage_config.extra_config)
        self.page_keys = PageKeys.for_rank(storage_config, self.settings.extra_backend_tag)
        self.enable_storage_metrics = storage_config.enable_storage_metrics
        s = self.settings
        transfer = TransferConfig.from_env(transport=TransportKind(s.transport), secret=s.secret)
        store_config = StoreConfig.from_env(rpc_timeout_s=float(s.rpc_timeout_s), replicas=s.replicas)
        self.store = Store.connect(s.master, segment_size=s.segment_size, config=store_config,
                                   transfer_config=transfer, host=s.engine_host,
                                   port=rank_port(s.engine_port, storage_config.tp_rank))
        self.mem_pool_host: Any = None
        self._pool_region: Any = None
        self._written: set[str] = set()
        self._written_lock = threading.Lock()
        self._metrics = _Metrics()
        self._throttle = _Throttle()
        logger.info("tidekv HiCache backend: rank tp=%d pp=%d on master %s (engine %s, segment %d bytes, "
                    "keys %r + hash + %s)", storage_config.tp_rank, storage_config.pp_rank, s.master,
                    self.store.engine.name, s.segment_size, self.page_keys.prefix, list(self.page_keys.suffixes))

    # ---- set-up -------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Registers the host pool's ``kv_buffer`` with the transfer engine (zero-copy v1 path).

        Raises:
            ConfigError: the pool has no single host buffer (hybrid pools) or a layout whose pages
                are not one contiguous span per K/V component (MHA ``layer_first``,
                MLA ``page_first_kv_split``): use ``--hicache-mem-layout page_first`` or
                ``page_first_direct``.
        """
        buffer = getattr(mem_pool_host, "kv_buffer", None)
        if not isinstance(buffer, torch.Tensor):
            raise ConfigError(f"{type(mem_pool_host).__name__} has no single kv_buffer tensor; hybrid host pools are "
                              "not supported by the tidekv HiCache backend")
        layout = getattr(mem_pool_host, "layout", "?")
        ptrs, _ = mem_pool_host.get_page_buffer_meta(torch.arange(mem_pool_host.page_size, dtype=torch.int64))
        if len(ptrs) != self.page_keys.per_page or any(isinstance(p, (list, tuple)) for p in ptrs):
            raise ConfigError(f"--hicache-mem-layout {layout}: a page is {len(ptrs)} buffers in this host pool, the "
                              f"tidekv HiCache backend stores {self.page_keys.per_page} per page; use page_first or "
                              "page_first_direct")
        super().register_mem_pool_host(mem_pool_host)
        self._pool_region = self.store.register(buffer)
        logger.info("tidekv HiCache backend: registered host pool (%s, %s, %d bytes) on engine %s",
                    type(mem_pool_host).__name__, layout, self._pool_region.length, self.store.engine.name)

    def close(self) -> None:
        """Unregisters the host pool and disconnects from the master (SGLang calls it on detach)."""
        if self._pool_region is not None:
            try:
                self.store.unregister(self._pool_region)
            except TidekvError as exc:
                logger.warning("tidekv HiCache backend: unregistering the host pool failed: %s", exc)
            self._pool_region = None
        self.store.close()

    # ---- zero-copy data path (interface_v1) ---------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many pages, from the first, are complete in the store (every K/V object present)."""
        if not keys:
            return 0
        try:
            present = self.store.exists_many(self.page_keys.keys(keys))
        except TidekvError as exc:
            self._throttle.warn("exists", "tidekv HiCache backend: exists of %d pages failed: %s", len(keys), exc)
            return 0
        per_page = self.page_keys.per_page
        for page in range(len(keys)):
            if not all(present[page * per_page:(page + 1) * per_page]):
                return page
        return len(keys)

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Reads each page's objects straight into its host-pool slots; per page, whether it arrived whole."""
        if not keys:
            return []
        names, spans = self._pool_spans(keys, host_indices)
        started = time.perf_counter()
        try:
            sizes = self.store.get_many_into(names, spans)
        except TidekvError as exc:
            self._throttle.warn("get", "tidekv HiCache backend: reading %d pages failed (they are recomputed): %s",
                                len(keys), exc)
            return [False] * len(keys)
        ok = [size == length for size, (_, length) in zip(sizes, spans)]
        results = self._per_page(ok)
        self._record(True, results, spans, started)
        return results

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Writes each page's objects from its host-pool slots; pages already stored are left alone."""
        if not keys:
            return []
        names, spans = self._pool_spans(keys, host_indices)
        started = time.perf_counter()
        ok = self._put(names, lambda: self.store.put_many_from(names, spans))
        results = self._per_page(ok)
        self._record(False, results, spans, started)
        return results

    # ---- tensor data path (SGLang's generic path, without interface_v1) -----------------

    def get(self, key: str, target_location: Any | None = None, target_sizes: Any | None = None) -> torch.Tensor | None:
        """Reads page ``key`` into ``target_location`` (a flat page tensor) or a new uint8 tensor; None if absent."""
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any | None = None,
                  target_sizes: Any | None = None) -> list[torch.Tensor | None]:
        """``get`` for several pages in one store round trip."""
        targets = list(target_locations) if target_locations is not None else [None] * len(keys)
        if len(targets) != len(keys):
            raise ConfigError(f"batch_get got {len(keys)} keys but {len(targets)} target locations")
        if not keys:
            return []
        per_page = self.page_keys.per_page
        try:
            blobs = self.store.get_many(self.page_keys.keys(keys))
        except TidekvError as exc:
            self._throttle.warn("get", "tidekv HiCache backend: reading %d pages failed: %s", len(keys), exc)
            return [None] * len(keys)
        out: list[torch.Tensor | None] = []
        for page, target in enumerate(targets):
            parts = blobs[page * per_page:(page + 1) * per_page]
            out.append(None if any(p is None for p in parts) else self._fill(keys[page], parts, target))
        return out

    def set(self, key: str, value: Any | None = None, target_location: Any | None = None,
            target_sizes: Any | None = None) -> bool:
        """Stores page ``key`` from ``value`` (a flat page tensor, K then V); True if it is stored."""
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any | None = None, target_locations: Any | None = None,
                  target_sizes: Any | None = None) -> bool:
        """``set`` for several pages in one store round trip; True if every page is stored."""
        tensors = list(values) if values is not None else []
        if len(tensors) != len(keys) or any(not isinstance(t, torch.Tensor) for t in tensors):
            logger.error("tidekv HiCache backend: batch_set needs one page tensor per key (%d keys, %d values)",
                         len(keys), len(tensors))
            return False
        if not keys:
            return True
        names, parts = self.page_keys.keys(keys), []
        for key, tensor in zip(keys, tensors):
            flat = _bytes_view(tensor)
            if flat.nbytes % self.page_keys.per_page:
                logger.error("tidekv HiCache backend: page %s of %d bytes cannot be split into %d components",
                             key, flat.nbytes, self.page_keys.per_page)
                return False
            step = flat.nbytes // self.page_keys.per_page
            parts.extend(flat[i * step:(i + 1) * step] for i in range(self.page_keys.per_page))
        return all(self._put(names, lambda: self.store.put_many(names, parts)))

    def exists(self, key: str) -> bool:
        """Whether page ``key`` is complete in the store."""
        return self.batch_exists([key]) == 1

    # ---- housekeeping -------------------------------------------------------------------

    def clear(self) -> None:
        """Removes the pages this backend instance stored.

        The store has no remove-all: pages other instances stored stay until evicted.
        """
        with self._written_lock:
            written, self._written = sorted(self._written), set()
        if written:
            self.store.remove_many(written, force=True)
        logger.info("tidekv HiCache backend: cleared %d objects", len(written))

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` for the batches since the last call (pages, GB/s)."""
        from sglang.srt.observability.metrics_collector import StorageMetrics

        prefetch_pgs, backup_pgs, prefetch_bw, backup_bw = self._metrics.drain()
        return StorageMetrics(prefetch_pgs=prefetch_pgs, backup_pgs=backup_pgs, prefetch_bandwidth=prefetch_bw,
                              backup_bandwidth=backup_bw)

    # ---- internals ----------------------------------------------------------------------

    def _pool_spans(self, keys: Sequence[str], host_indices: torch.Tensor) -> tuple[list[str], list[tuple[int, int]]]:
        """Store keys and host-pool (address, length) spans of ``keys``' pages, in the same order."""
        pool = self.mem_pool_host
        if pool is None or self._pool_region is None:
            raise ConfigError("register_mem_pool_host() must come before batch_get_v1/batch_set_v1")
        if len(host_indices) != len(keys) * pool.page_size:
            raise ConfigError(f"{len(keys)} page keys need {len(keys) * pool.page_size} host indices "
                              f"(page size {pool.page_size}), got {len(host_indices)}")
        ptrs, sizes = pool.get_page_buffer_meta(host_indices)
        return self.page_keys.keys(keys), [(int(p), int(n)) for p, n in zip(ptrs, sizes)]

    def _put(self, names: list[str], put: Any) -> list[bool]:
        """Runs a store put over ``names``; per name, whether it is stored (new or already there)."""
        try:
            put()
            failed: set[str] = set()
        except StoreError as exc:
            failed = _failed_keys(exc, names)
            self._throttle.warn("set", "tidekv HiCache backend: storing %d of %d objects failed: %s",
                                len(failed), len(names), exc)
        except TidekvError as exc:  # a transfer or master failure: no way to tell which keys made it
            failed = set(names)
            self._throttle.warn("set", "tidekv HiCache backend: storing %d objects failed: %s", len(names), exc)
        with self._written_lock:
            self._written.update(n for n in names if n not in failed)
        return [n not in failed for n in names]

    def _per_page(self, ok: list[bool]) -> list[bool]:
        per_page = self.page_keys.per_page
        return [all(ok[i:i + per_page]) for i in range(0, len(ok), per_page)]

    def _record(self, is_get: bool, results: list[bool], spans: list[tuple[int, int]], started: float) -> None:
        if self.enable_storage_metrics:
            self._metrics.record(is_get, sum(results), sum(n for _, n in spans), time.perf_counter() - started)

    def _fill(self, key: str, parts: list[bytes | None], target: Any) -> torch.Tensor | None:
        blob = b"".join(p for p in parts if p is not None)
        if target is None:
            return torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        view = _bytes_view(target)
        if view.nbytes != len(blob):
            logger.error("tidekv HiCache backend: page %s holds %d bytes, the target %d (different model or layout?)",
                         key, len(blob), view.nbytes)
            return None
        view[:] = blob
        return target


def _failed_keys(exc: StoreError, names: list[str]) -> set[str]:
    """The keys a store error names: its ``failed_keys`` (a batch), its ``key`` (one), else all."""
    if exc.failures:
        return {k.decode() if isinstance(k, bytes) else str(k) for k in exc.failed_keys}
    if exc.key is not None:
        return {exc.key.decode() if isinstance(exc.key, bytes) else str(exc.key)}
    return set(names)


def _bytes_view(tensor: torch.Tensor) -> memoryview:
    """A flat writable byte view of a contiguous CPU tensor (no copy)."""
    if not tensor.is_contiguous() or tensor.device.type != "cpu":
        raise ConfigError(f"page tensor must be a contiguous CPU tensor (got {tensor.device}, "
                          f"contiguous={tensor.is_contiguous()})")
    return memoryview(tensor.view(-1).view(torch.uint8).numpy()).cast("B")
