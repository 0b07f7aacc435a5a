"""One backend of ``benchmarks/sglang_hicache.py --compare mooncake``, in a process of its own: the
SGLang rank (a real host pool and the backend SGLang's ``StorageBackendFactory`` builds) and the
pool that backend stores into.

Run as ``python hicache_bench_worker.py '<json spec>'`` by the benchmark (through
``sglang_rig.LineChild``). Spec: ``backend`` ("mooncake": SGLang's own ``MooncakeStore`` on
whichever ``mooncake`` package this interpreter imports, Mooncake's wheel or tidekv's drop-in;
"tidekv": tidekv's own backend), ``layout`` ("same": the pool's only segment is mounted by this
process, the SGLang one; "other": a holder process mounts it), ``shape`` (``PoolShape`` fields),
``segment_bytes``, ``lease_ttl_s``, ``log_dir`` and ``is_netns`` (first move into a network
namespace of its own, loopback only: Mooncake's engine binds 0.0.0.0 whatever it is told).

The pool is started here, so that it shares this process's namespace:
- mooncake: ``tidekv.bench.mooncake_store.MooncakePool``, the master of the same implementation
  as the ``mooncake`` imported (Mooncake's ``mooncake_master`` or the drop-in's), plus for
  "other" a holder process; the backend mounts ``global_segment_size`` itself for "same".
- tidekv: ``tidekv up`` with the segment for "other", without one for "same" (the backend's
  ``segment_size`` then mounts it here).

The first stdout line is the hello (which ``mooncake`` was imported, from where; the master).
Then one JSON command per stdin line, one JSON answer each:
``{"cmd": "round", "round": R, "pages": P, "batch": B}``: removes the previous round's pages
(``clear()``, untimed; Mooncake keeps leased objects, so it waits until they are gone), fills
pages 0..P-1 of the host pool from a seed, times ``batch_set_v1`` of them in calls of B pages,
fills pages P..2P-1 with other bytes, times ``batch_get_v1`` into them, then compares every page
read with its source byte for byte. EOF on stdin stops the pool and exits.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import sglang_rig

_CLEAR_TIMEOUT_S = 30.0


def _mooncake_version(api: Any) -> str:
    from importlib import metadata

    from tidekv.bench.mooncake_store import MooncakeApi
    from tidekv.bench.mooncake_te import WHEEL

    dist = "tidekv-mooncake-shim" if api == MooncakeApi.SHIM else WHEEL
    try:
        return f"{dist} {metadata.version(dist)}"
    except metadata.PackageNotFoundError:
        return f"{dist} (version unknown)"


class Rank:
    """The backend under test and its host pool, plus the pool processes it stores into."""

    def __init__(self, spec: dict[str, Any], stack: contextlib.ExitStack) -> None:
        from sglang.srt.mem_cache.storage import StorageBackendFactory

        self.shape = sglang_rig.PoolShape(**spec["shape"])
        self.pool = sglang_rig.make_host_pool(self.shape)
        layout, segment, log_dir = spec["layout"], spec["segment_bytes"], Path(spec["log_dir"])
        is_same = layout == "same"
        self.hello: dict[str, Any] = {"backend": spec["backend"], "layout": layout}
        if spec["backend"] == "mooncake":
            import mooncake
            import mooncake.store
            from tidekv.bench.mooncake_store import MooncakeApi, MooncakePool

            api = MooncakeApi.SHIM if getattr(mooncake, "IS_TIDEKV_SHIM", False) else MooncakeApi.MOONCAKE
            pool = MooncakePool(api, is_same, segment, log_dir, lease_ttl_s=spec["lease_ttl_s"])
            stack.callback(pool.close)
            os.environ.update(pool.env)  # MC_STORE_MEMCPY=0 when the holder is another process
            extra = sglang_rig.mooncake_extra_config(pool.master, global_segment_size=segment if is_same else 0)
            config = sglang_rig.storage_config(extra, is_mla=self.shape.is_mla)
            self.backend = StorageBackendFactory.create_backend("mooncake", config, self.pool)
            stack.callback(self.backend.store.close)  # SGLang's close() leaves it to the destructor
            self.hello.update(api=api.value, mooncake_store=mooncake.store.__file__, version=_mooncake_version(api),
                              master=pool.master, holder=pool.holder, env=pool.env)
        else:
            up = sglang_rig.TidekvUp(log_dir / f"tidekv-up-{layout}.log", "0" if is_same else f"{segment}B",
                                     ("--lease-ttl-s", str(spec["lease_ttl_s"])))
            stack.enter_context(up)
            settings = {"segment_size": segment} if is_same else {}
            config = sglang_rig.storage_config(sglang_rig.tidekv_extra_config(up.master, **settings),
                                               is_mla=self.shape.is_mla)
            self.backend = StorageBackendFactory.create_backend("dynamic", config, None)
            stack.callback(self.backend.close)
            self.hello.update(api="tidekv", master=up.master, engine=self.backend.store.engine.name)
        self.backend.register_mem_pool_host(self.pool)
        self.lease_ttl_s: float = spec["lease_ttl_s"]
        self._previous: list[str] = []
        self._last_access = 0.0

    def _clear(self) -> float:
        """Removes the previous round's pages; returns how long it waited for them to go.

        Mooncake's ``remove_all`` leaves objects under a read lease, and its ``is_exist`` grants
        one: so it waits out the lease since the last access before clearing, and again after
        each check that still finds pages.
        """
        t0 = time.perf_counter()
        deadline = t0 + _CLEAR_TIMEOUT_S
        while self._previous:
            time.sleep(max(0.0, self._last_access + self.lease_ttl_s + 0.1 - time.perf_counter()))
            self.backend.clear()
            if self.backend.batch_exists(self._previous) == 0:
                break
            self._last_access = time.perf_counter()
            if self._last_access > deadline:
                raise RuntimeError(f"clear() left pages of the previous round for {_CLEAR_TIMEOUT_S:.0f} s")
        return time.perf_counter() - t0

    def round(self, index: int, pages: int, batch: int) -> dict[str, Any]:
        clear_s = self._clear()
        src, dst = list(range(pages)), list(range(pages, 2 * pages))
        hashes = sglang_rig.page_hashes(pages, seed=1000 + index)
        sglang_rig.fill_pages(self.pool, src, seed=index)
        is_ok = True
        t0 = time.perf_counter()
        for i in range(0, pages, batch):
            is_ok &= all(self.backend.batch_set_v1(hashes[i:i + batch], sglang_rig.host_indices(self.pool,
                                                                                               src[i:i + batch])))
        set_s = time.perf_counter() - t0
        self._previous = hashes
        sglang_rig.fill_pages(self.pool, dst, seed=10_000 + index)  # targets start out different from the sources
        t0 = time.perf_counter()
        for i in range(0, pages, batch):
            is_ok &= all(self.backend.batch_get_v1(hashes[i:i + batch], sglang_rig.host_indices(self.pool,
                                                                                               dst[i:i + batch])))
        get_s = time.perf_counter() - t0
        self._last_access = time.perf_counter()
        equal = sum(sglang_rig.page_bytes(self.pool, s) == sglang_rig.page_bytes(self.pool, d)
                    for s, d in zip(src, dst))
        return {"set_s": set_s, "get_s": get_s, "all_calls_ok": bool(is_ok), "pages_checked": len(dst),
                "pages_equal": equal, "bytes_equal": equal == len(dst), "clear_wait_s": clear_s}


def main() -> int:
    spec = json.loads(sys.argv[1])
    if spec.get("is_netns"):
        from tidekv.bench.netns import enter_loopback_netns, interfaces

        enter_loopback_netns()  # first: before any socket or thread exists
        netns_interfaces = interfaces()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sglang_rig.stub_torchvision()
    with contextlib.ExitStack() as stack:
        rank = Rank(spec, stack)
        if spec.get("is_netns"):
            rank.hello["netns_interfaces"] = netns_interfaces
        print(json.dumps(rank.hello), flush=True)
        for line in sys.stdin:
            cmd = json.loads(line)
            try:
                if cmd["cmd"] != "round":
                    raise ValueError(f"unknown command {cmd['cmd']!r}")
                reply: dict[str, Any] = {"ok": True, **rank.round(cmd["round"], cmd["pages"], cmd["batch"])}
            except Exception as exc:  # noqa: BLE001 - reported to the benchmark
                traceback.print_exc()
                reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            print(json.dumps(reply), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
