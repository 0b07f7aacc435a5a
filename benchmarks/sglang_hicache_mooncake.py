"""``python -m benchmarks.sglang_hicache --compare mooncake``: SGLang's mooncake HiCache backend on the real
Mooncake and on tidekv's drop-in, and tidekv's own backend, side by side: same pages, same run.

Backends, each built by SGLang's ``StorageBackendFactory`` on SGLang's real ``MHATokenToKVPoolHost``
(CPU, ``page_first``) and driven as its cache controller drives them, through the zero-copy v1
calls both have (``batch_set_v1`` / ``batch_get_v1``; the mooncake backend turns them into
``batch_is_exist`` + ``batch_put_from`` and ``batch_get_into`` of a K and a V object per page):

- ``mooncake``: SGLang's ``MooncakeStore`` on Mooncake's wheel ``mooncake-transfer-engine-non-cuda``
  and its ``mooncake_master``;
- ``shim``: the same SGLang class on ``tidekv-mooncake-shim`` (Mooncake's API over tidekv) and
  the drop-in's ``mooncake_master``;
- ``tidekv``: tidekv's own backend (``tidekv_sglang.hicache``) and ``tidekv up``.

Layouts: ``same`` (the pool's only segment is mounted by the SGLang process: Mooncake then copies
with memcpy) and ``other`` (a holder process mounts it: Mooncake goes over loopback tcp, with
``MC_STORE_MEMCPY=0``; tidekv and the shim use shared memory).

Why a separate venv for the real Mooncake: in ``.venv-sglang`` the drop-in owns the ``mooncake``
name, and Mooncake's wheel would overwrite it. ``integration/setup_sglang.sh`` creates
``.venv-sglang-mooncake``: Mooncake's wheel (``--no-deps``) in its own site-packages, plus a
``.pth`` that adds ``.venv-sglang``'s site-packages after it (``site.addsitedir``), so SGLang,
torch and tidekv are the very same installation, and ``import mooncake`` finds the wheel first
(the drop-in's editable finder comes after every sys.path entry). Installing SGLang a second
time would cost minutes and could differ. Each worker reports which ``mooncake.store`` it
imported, and the benchmark refuses a "real" worker that got the drop-in.

Each backend runs in a worker process of its own (``integration/sglang/hicache_bench_worker.py``),
which also starts the pool processes it stores into. Mooncake's transfer engine binds its ports
to 0.0.0.0 whatever it is told, so the real Mooncake's worker first moves into a network
namespace of its own with only ``lo`` (``tidekv.bench.netns``, what ``unshare -n`` does; needs
root), and its master and holder start inside it. A round, per backend: remove the previous
round's pages (untimed; Mooncake's leases, ``--lease-ttl-s`` for all three masters, >= 2 s,
are waited out), fill the source pages, time the set calls, fill the target pages with other
bytes, time the get calls, compare every page read with its source byte for byte (untimed). The
pool holds two rounds, so the warm-up rounds (untimed, checked) touch all its memory first.
Rounds rotate which backend goes first, so passing load hits all alike. Reported: best round
(and the median), GB/s = 10^9 page bytes per second.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from integration.sglang import sglang_rig

LAYOUTS = {"same": "pool in the SGLang process", "other": "pool in another process"}
REAL_PYTHON = sglang_rig.REPO / ".venv-sglang-mooncake" / "bin" / "python"
_START_TIMEOUT_S = 180.0
_ROUND_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Backend:
    name: str
    label: str
    worker_backend: str  # the worker's spec "backend"
    expected_api: str  # what the worker must report it runs


BACKENDS = (
    Backend("mooncake", "SGLang mooncake on Mooncake", "mooncake", "mooncake"),
    Backend("shim", "SGLang mooncake on tidekv (shim)", "mooncake", "shim"),
    Backend("tidekv", "tidekv backend", "tidekv", "tidekv"),
)


@dataclass(frozen=True)
class Bar:
    layout: str
    numerator: str
    denominator: str
    limit: float


BARS = (
    Bar("other", "shim", "mooncake", 3.0), Bar("same", "shim", "mooncake", 1.2),
    Bar("same", "tidekv", "shim", 1.0), Bar("other", "tidekv", "shim", 1.0),
)
"""Issue 18's bars, each for set and get: the shim >= 3x the real Mooncake with the pool in
another process, >= 1.2x in the SGLang process; tidekv's own backend >= the shim in both."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--warmup", type=int, default=2, help="--compare mooncake: untimed rounds first (default 2)")
    p.add_argument("--lease-ttl-s", type=float, default=2.0,
                   help="--compare mooncake: read lease of all three masters, >= 2 (default 2)")
    p.add_argument("--mooncake-python", default=str(REAL_PYTHON),
                   help="--compare mooncake: the interpreter with SGLang and Mooncake's wheel "
                        "(default .venv-sglang-mooncake/bin/python, made by integration/setup_sglang.sh)")
    p.add_argument("--layouts", default="same,other", help="--compare mooncake: same and/or other (default both)")


class _Worker:
    def __init__(self, backend: Backend, layout: str, args: argparse.Namespace, shape: sglang_rig.PoolShape,
                 segment_bytes: int, log_dir: Path) -> None:
        self.backend = backend
        is_real = backend.name == "mooncake"
        python = args.mooncake_python if is_real else None
        if is_real and not Path(python).exists():
            raise RuntimeError(f"{python} does not exist; run integration/setup_sglang.sh (it makes "
                               ".venv-sglang-mooncake with Mooncake's wheel)")
        spec = {"backend": backend.worker_backend, "layout": layout, "segment_bytes": segment_bytes,
                "lease_ttl_s": args.lease_ttl_s, "log_dir": str(log_dir), "is_netns": is_real,
                "shape": {"layers": shape.layers, "heads": shape.heads, "head_dim": shape.head_dim,
                          "page_size": shape.page_size, "pages": shape.pages, "dtype": shape.dtype}}
        self.child = sglang_rig.LineChild("hicache_bench_worker.py", spec, log_dir / f"worker-{backend.name}-{layout}.log",
                                          start_timeout_s=_START_TIMEOUT_S, python=python)
        self.hello = self.child.hello
        if self.hello.get("api") != backend.expected_api:
            self.child.stop()
            raise RuntimeError(f"the {backend.name} worker runs {self.hello.get('api')!r} "
                               f"({self.hello.get('mooncake_store')}), not {backend.expected_api!r}")
        self.rounds: list[dict[str, Any]] = []

    def round(self, index: int, args: argparse.Namespace) -> dict[str, Any]:
        return self.child.call("round", timeout_s=_ROUND_TIMEOUT_S, round=index, pages=args.pages, batch=args.batch)


def _why(exc: Exception) -> str:
    text = str(exc).strip()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    error_lines = [ln for ln in lines if "Error" in ln or "error" in ln]
    return (error_lines[-1] if error_lines else lines[0] if lines else type(exc).__name__)[:400]


def _summary(rounds: list[dict[str, Any]], data_bytes: int) -> dict[str, Any]:
    sets, gets = [r["set_s"] for r in rounds], [r["get_s"] for r in rounds]
    return {"set_s": min(sets), "get_s": min(gets), "set_s_all": sets, "get_s_all": gets,
            "set_gb_per_s": data_bytes / min(sets) / 1e9, "get_gb_per_s": data_bytes / min(gets) / 1e9,
            "set_gb_per_s_median": data_bytes / statistics.median(sets) / 1e9,
            "get_gb_per_s_median": data_bytes / statistics.median(gets) / 1e9}


def _run_layout(layout: str, args: argparse.Namespace, shape: sglang_rig.PoolShape, data_bytes: int,
                log_dir: Path) -> dict[str, Any]:
    segment_bytes = 2 * data_bytes + (64 << 20)  # two rounds: the previous one's pages go while this one's come
    out: dict[str, Any] = {"backends": {}, "unavailable": {}}
    with contextlib.ExitStack() as stack:
        workers: list[_Worker] = []
        for backend in BACKENDS:
            print(f"  {layout}: starting {backend.name} ...", flush=True)
            try:
                worker = _Worker(backend, layout, args, shape, segment_bytes, log_dir)
            except Exception as exc:  # noqa: BLE001 - reported, never replaced by a number
                out["unavailable"][backend.name] = _why(exc)
                continue
            stack.callback(worker.child.stop)
            workers.append(worker)
        checks = {w.backend.name: {"all_calls_ok": True, "bytes_equal": True, "pages_checked": 0} for w in workers}
        for r in range(args.warmup + args.rounds):
            shift = r % max(1, len(workers))
            for worker in workers[shift:] + workers[:shift]:
                name = worker.backend.name
                if name in out["unavailable"]:
                    continue
                try:
                    result = worker.round(r, args)
                except Exception as exc:  # noqa: BLE001 - a backend that fails mid-run is reported as such
                    out["unavailable"][name] = f"failed in round {r}: {_why(exc)}"
                    continue
                c = checks[name]
                c["all_calls_ok"] &= result["all_calls_ok"]
                c["bytes_equal"] &= result["bytes_equal"]
                c["pages_checked"] += result["pages_checked"]
                if r >= args.warmup:
                    worker.rounds.append(result)
        for worker in workers:
            name = worker.backend.name
            if name in out["unavailable"]:
                continue
            out["backends"][name] = {**_summary(worker.rounds, data_bytes), **checks[name],
                                     "worker": worker.hello}
    return out


def _bars(layouts: dict[str, Any]) -> list[dict[str, Any]]:
    found = []
    for bar in BARS:
        if bar.layout not in layouts:
            continue
        got = layouts[bar.layout]["backends"]
        for op in ("set", "get"):
            row: dict[str, Any] = {"layout": bar.layout, "op": op, "numerator": bar.numerator,
                                   "denominator": bar.denominator, "limit": bar.limit}
            missing = [n for n in (bar.numerator, bar.denominator) if n not in got]
            if missing:
                reasons = layouts[bar.layout]["unavailable"]
                row.update(ratio=None, status="NOT RUN",
                           reason="; ".join(f"{n}: {reasons.get(n, 'not measured')}" for n in missing))
            else:
                ratio = got[bar.numerator][f"{op}_gb_per_s"] / got[bar.denominator][f"{op}_gb_per_s"]
                row.update(ratio=ratio, status="PASS" if ratio >= bar.limit else "FAIL")
            found.append(row)
    return found


def run(args: argparse.Namespace) -> dict[str, Any]:
    sglang_rig.stub_torchvision()
    layouts = [name.strip() for name in args.layouts.split(",") if name.strip()]
    if not layouts or any(name not in LAYOUTS for name in layouts):
        raise SystemExit(f"--layouts {args.layouts!r}: use same and/or other")
    if args.lease_ttl_s < 2.0:
        raise SystemExit(f"--lease-ttl-s {args.lease_ttl_s}: Mooncake's gets fail with -707 under 2 s")
    shape = sglang_rig.PoolShape(layers=args.layers, heads=args.heads, head_dim=args.head_dim,
                                 page_size=args.page_size, pages=2 * args.pages, dtype=args.dtype)
    data_bytes = args.pages * shape.page_bytes
    results: dict[str, Any] = {
        "mode": "mooncake", "page_bytes": shape.page_bytes, "pages": args.pages, "batch": args.batch,
        "rounds": args.rounds, "warmup": args.warmup, "lease_ttl_s": args.lease_ttl_s,
        "shape": {"layers": args.layers, "kv_heads": args.heads, "head_dim": args.head_dim,
                  "page_size": args.page_size, "dtype": args.dtype, "layout": shape.layout},
        "layouts": {}}
    with tempfile.TemporaryDirectory(prefix="tidekv-hicache-mooncake-") as work:
        for layout in layouts:
            results["layouts"][layout] = _run_layout(layout, args, shape, data_bytes, Path(work))
    results["bars"] = _bars(results["layouts"])
    return results


def print_table(results: dict[str, Any]) -> None:
    s = results["shape"]
    print(f"SGLang host pool pages: {s['layers']} layers x {s['kv_heads']} KV heads x {s['head_dim']} dim x "
          f"{s['page_size']} tokens, {s['dtype']}, {s['layout']} -> {results['page_bytes'] / 2**20:.2f} MiB/page; "
          f"{results['pages']} pages per round, {results['batch']} per call; best of {results['rounds']} rounds "
          f"(median in brackets) after {results['warmup']} warm-up rounds; leases {results['lease_ttl_s']:g} s")
    print(f"{'layout':<27}{'backend':<34}{'set GB/s':>16}{'get GB/s':>16}  checks")
    for layout, found in results["layouts"].items():
        for backend in BACKENDS:
            where = LAYOUTS[layout]
            if backend.name in found["unavailable"]:
                print(f"{where:<27}{backend.label:<34}{'-':>16}{'-':>16}  NOT RUN: {found['unavailable'][backend.name]}")
                continue
            r = found["backends"][backend.name]
            checks = (f"ok ({r['pages_checked']} pages compared)" if r["all_calls_ok"] and r["bytes_equal"]
                      else "FAILED")
            set_text = f"{r['set_gb_per_s']:.2f} ({r['set_gb_per_s_median']:.2f})"
            get_text = f"{r['get_gb_per_s']:.2f} ({r['get_gb_per_s_median']:.2f})"
            print(f"{where:<27}{backend.label:<34}{set_text:>16}{get_text:>16}  {checks}")
    print()
    for layout, found in results["layouts"].items():
        for name, r in found["backends"].items():
            w = r["worker"]
            if "mooncake_store" in w:
                print(f"{layout}/{name}: {w.get('version')}, mooncake.store from {w['mooncake_store']}"
                      + (f", network namespace with {w['netns_interfaces']}" if "netns_interfaces" in w else "")
                      + (f", env {w['env']}" if w.get("env") else ""))
    print("\nperformance bars (issue 18, same-run ratios of best rounds):")
    for bar in results["bars"]:
        what = f"{LAYOUTS[bar['layout']]}: {bar['op']} {bar['numerator']} / {bar['denominator']}"
        if bar["ratio"] is None:
            print(f"  {bar['status']:<8}{what:<52} >= {bar['limit']:g}  ({bar['reason']})")
        else:
            digits = 3 if abs(bar["ratio"] - bar["limit"]) < 0.01 else 2  # 0.999 must not read as 1.00
            print(f"  {bar['status']:<8}{what:<52}{bar['ratio']:>6.{digits}f}x >= {bar['limit']:g}")


def all_checks_ok(results: dict[str, Any]) -> bool:
    return all(r["all_calls_ok"] and r["bytes_equal"] and r["pages_checked"] > 0
               for found in results["layouts"].values() for r in found["backends"].values())
