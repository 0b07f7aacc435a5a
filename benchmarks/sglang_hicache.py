"""HiCache L3 throughput on SGLang-shaped pages: the tidekv backend (``batch_set_v1`` /
``batch_get_v1``, zero-copy) vs SGLang's built-in file backend (``HiCacheFile``), same pages, same run;
with ``--compare mooncake``, SGLang's mooncake backend on the real Mooncake and on tidekv's drop-in
next to tidekv's backend, in both process layouts (``sglang_hicache_mooncake``, whose docstring
says how).

Both backends are built by SGLang's own ``StorageBackendFactory`` and fed from SGLang's real
``MHATokenToKVPoolHost`` (CPU, ``page_first`` layout) exactly as its cache controller feeds them:
- tidekv (``interface_v1``): ``batch_set_v1(hashes, host_indices)`` / ``batch_get_v1(hashes, host_indices)``;
- file (the controller's generic path): ``batch_set(hashes, [pool.get_data_page(i)])`` and
  ``batch_get(hashes, [pool.get_dummy_flat_data_page()])`` + ``pool.set_from_flat_data_page``.
Calls carry ``--batch`` pages (SGLang's STORAGE_BATCH_SIZE is 128). The tidekv pool is ``tidekv up``
(a master plus one segment) in a child process on this host; the file backend writes to a fresh
directory under ``--file-dir`` (its filesystem is printed) and is measured twice: each
round's files are fsynced before the reads (untimed, so no writeback competes with them), then read
from the page cache (its best case, while its data fits in free RAM) or, after
``posix_fadvise(DONTNEED)``, from the disk (an L3 larger than RAM). Each round stores new pages (both
backends skip keys they already hold), then reads them back; every page read is checked byte for
byte against its source outside the timed region. Reported: best round, pages/s and GB/s.

The default page geometry (32 layers x 8 KV heads x 128 dim x 16 tokens, bf16) makes 2 MiB pages.

Usage (from the repo root):
       .venv-sglang/bin/python -m benchmarks.sglang_hicache [--pages 256] [--rounds 3] [--json FILE]
       .venv-sglang/bin/python -m benchmarks.sglang_hicache --compare mooncake [--pages 128] [--rounds 5] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import sglang_hicache_mooncake
from integration.sglang import sglang_rig

BAR_GET_RATIO = 3.0
"""The issue's bar: tidekv's get throughput at least this multiple of the file backend's."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compare", choices=["file", "mooncake"], default="file",
                   help="file: tidekv vs HiCacheFile (default); mooncake: SGLang's mooncake backend on Mooncake and "
                        "on tidekv's drop-in, and tidekv's backend, in both process layouts")
    p.add_argument("--pages", type=int, default=None,
                   help="pages stored and read per round (default 256; --compare mooncake 128)")
    p.add_argument("--batch", type=int, default=128, help="pages per backend call (SGLang: 128)")
    p.add_argument("--rounds", type=int, default=None,
                   help="timed rounds per backend; the best is reported (default 3; --compare mooncake 5)")
    p.add_argument("--layers", type=int, default=32, help="model layers (default 32)")
    p.add_argument("--heads", type=int, default=8, help="KV heads on this rank (default 8)")
    p.add_argument("--head-dim", type=int, default=128, help="head dimension (default 128)")
    p.add_argument("--page-size", type=int, default=16, help="tokens per page (default 16)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--file-dir", default=tempfile.gettempdir(), help="where HiCacheFile writes (default: the temp dir)")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    sglang_hicache_mooncake.add_arguments(p)
    args = p.parse_args(argv)
    if args.pages is None:
        args.pages = 128 if args.compare == "mooncake" else 256
    if args.rounds is None:
        args.rounds = 5 if args.compare == "mooncake" else 3
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    for name in ("pages", "batch", "rounds", "layers", "heads", "head_dim", "page_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def _rounds(args: argparse.Namespace, pool: Any, set_batch: Any, get_batch: Any, prepare: Any = None,
            after_set: Any = None) -> dict[str, Any]:
    """Runs ``args.rounds`` rounds of set-all-then-get-all; returns the best timings and the checks."""
    src = list(range(args.pages))
    dst = list(range(args.pages, 2 * args.pages))
    best_set = best_get = float("inf")
    all_ok, all_equal = True, True
    for r in range(args.rounds):
        hashes = sglang_rig.page_hashes(args.pages, seed=1000 + r)
        sglang_rig.fill_pages(pool, src, seed=r)
        if prepare is not None:
            prepare()
        t0 = time.perf_counter()
        for i in range(0, args.pages, args.batch):
            all_ok &= set_batch(hashes[i:i + args.batch], src[i:i + args.batch])
        best_set = min(best_set, time.perf_counter() - t0)
        if after_set is not None:
            after_set()
        sglang_rig.fill_pages(pool, dst, seed=10_000 + r)  # targets start out different from the sources
        t0 = time.perf_counter()
        for i in range(0, args.pages, args.batch):
            all_ok &= get_batch(hashes[i:i + args.batch], dst[i:i + args.batch])
        best_get = min(best_get, time.perf_counter() - t0)
        all_equal &= all(sglang_rig.page_bytes(pool, s) == sglang_rig.page_bytes(pool, d) for s, d in zip(src, dst))
    return {"set_s": best_set, "get_s": best_get, "all_calls_ok": bool(all_ok), "bytes_equal": bool(all_equal)}


def bench_tidekv(args: argparse.Namespace, shape: sglang_rig.PoolShape, master: str) -> dict[str, Any]:
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    config = sglang_rig.storage_config(sglang_rig.tidekv_extra_config(master))
    backend = StorageBackendFactory.create_backend("dynamic", config, None)
    pool = sglang_rig.make_host_pool(shape)
    backend.register_mem_pool_host(pool)
    try:
        def set_batch(hashes: list[str], pages: list[int]) -> bool:
            return all(backend.batch_set_v1(hashes, sglang_rig.host_indices(pool, pages)))

        def get_batch(hashes: list[str], pages: list[int]) -> bool:
            return all(backend.batch_get_v1(hashes, sglang_rig.host_indices(pool, pages)))

        return _rounds(args, pool, set_batch, get_batch, prepare=backend.clear)
    finally:
        backend.clear()
        backend.close()


def _flush(directory: str, evict: bool) -> None:
    """Writes the backend's files back to the disk (so no writeback competes with the reads) and,
    with ``evict``, drops them from the page cache, so the reads come from the disk."""
    for entry in os.scandir(directory):
        if entry.is_file():
            fd = os.open(entry.path, os.O_RDONLY)
            try:
                os.fsync(fd)
                if evict:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def bench_file(args: argparse.Namespace, shape: sglang_rig.PoolShape, directory: str, cold: bool) -> dict[str, Any]:
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    config = sglang_rig.storage_config({"file_storage_path": directory})
    backend = StorageBackendFactory.create_backend("file", config, None)
    pool = sglang_rig.make_host_pool(shape)

    def set_batch(hashes: list[str], pages: list[int]) -> bool:
        return bool(backend.batch_set(hashes, [pool.get_data_page(p * pool.page_size) for p in pages]))

    def get_batch(hashes: list[str], pages: list[int]) -> bool:
        got = backend.batch_get(hashes, [pool.get_dummy_flat_data_page() for _ in hashes])
        for page, data in zip(pages, got):
            if data is None:
                return False
            pool.set_from_flat_data_page(page * pool.page_size, data)
        return True

    return _rounds(args, pool, set_batch, get_batch, prepare=backend.clear, after_set=lambda: _flush(directory, cold))


def _filesystem(path: str) -> str:
    out = subprocess.run(["df", "-T", path], capture_output=True, text=True)
    lines = out.stdout.strip().splitlines()
    return lines[-1].split()[1] if out.returncode == 0 and len(lines) > 1 else "unknown"


def run(args: argparse.Namespace) -> dict[str, Any]:
    sglang_rig.stub_torchvision()
    shape = sglang_rig.PoolShape(layers=args.layers, heads=args.heads, head_dim=args.head_dim,
                                 page_size=args.page_size, pages=2 * args.pages, dtype=args.dtype)
    data_bytes = args.pages * shape.page_bytes
    work = tempfile.mkdtemp(prefix="tidekv-hicache-bench-", dir=args.file_dir)
    try:
        # Two rounds' worth: clear() frees a page only once the read lease of the round before
        # has run out (the store never hands out bytes a reader may still be copying).
        segment = f"{2 * data_bytes + (64 << 20)}B"
        with sglang_rig.TidekvUp(Path(work) / "tidekv-up.log", segment) as up:
            tidekv = bench_tidekv(args, shape, up.master)
        file = bench_file(args, shape, os.path.join(work, "hicache-file"), cold=False)
        file_cold = bench_file(args, shape, os.path.join(work, "hicache-file-cold"), cold=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results: dict[str, Any] = {
        "page_bytes": shape.page_bytes, "pages": args.pages, "batch": args.batch, "rounds": args.rounds,
        "shape": {"layers": args.layers, "kv_heads": args.heads, "head_dim": args.head_dim,
                  "page_size": args.page_size, "dtype": args.dtype, "layout": shape.layout},
        "file_dir_fs": _filesystem(args.file_dir), "backends": {}}
    for name, r in (("tidekv", tidekv), ("file", file), ("file_cold", file_cold)):
        results["backends"][name] = {
            **r,
            "set_pages_per_s": args.pages / r["set_s"], "get_pages_per_s": args.pages / r["get_s"],
            "set_gb_per_s": data_bytes / r["set_s"] / 1e9, "get_gb_per_s": data_bytes / r["get_s"] / 1e9,
        }
    t = results["backends"]["tidekv"]
    for name in ("file", "file_cold"):
        f = results["backends"][name]
        results[f"get_ratio_vs_{name}"] = t["get_pages_per_s"] / f["get_pages_per_s"]
        results[f"set_ratio_vs_{name}"] = t["set_pages_per_s"] / f["set_pages_per_s"]
    return results


def print_table(results: dict[str, Any]) -> None:
    s = results["shape"]
    print(f"SGLang host pool pages: {s['layers']} layers x {s['kv_heads']} KV heads x {s['head_dim']} dim x "
          f"{s['page_size']} tokens, {s['dtype']}, {s['layout']} -> {results['page_bytes'] / 2**20:.2f} MiB/page; "
          f"{results['pages']} pages per round, {results['batch']} per call, best of {results['rounds']} rounds; "
          f"file backend on {results['file_dir_fs']}")
    print(f"{'backend':<26}{'set pages/s':>12}{'set GB/s':>10}{'get pages/s':>13}{'get GB/s':>10}  checks")
    for name, label in (("tidekv", "tidekv (batch_*_v1)"), ("file", "HiCacheFile, page cache"),
                        ("file_cold", "HiCacheFile, from disk")):
        r = results["backends"][name]
        checks = "ok" if r["all_calls_ok"] and r["bytes_equal"] else "FAILED"
        print(f"{label:<26}{r['set_pages_per_s']:>12.0f}{r['set_gb_per_s']:>10.2f}{r['get_pages_per_s']:>13.0f}"
              f"{r['get_gb_per_s']:>10.2f}  {checks}")
    for name, label in (("file", "HiCacheFile, page cache"), ("file_cold", "HiCacheFile, from disk")):
        get_ratio = results[f"get_ratio_vs_{name}"]
        print(f"tidekv / {label}: set {results[f'set_ratio_vs_{name}']:.1f}x, get {get_ratio:.1f}x "
              f"(bar get >= {BAR_GET_RATIO:.0f}x: {'met' if get_ratio >= BAR_GET_RATIO else 'NOT met'})")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.compare == "mooncake":
        results = sglang_hicache_mooncake.run(args)
        sglang_hicache_mooncake.print_table(results)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=2)
        return 0 if sglang_hicache_mooncake.all_checks_ok(results) else 1
    results = run(args)
    print_table(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    ok = all(r["all_calls_ok"] and r["bytes_equal"] for r in results["backends"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
