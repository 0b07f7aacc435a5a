"""Mooncake's store API alone, pool in the caller's process: Mooncake's wheel vs tidekv's drop-in.

What ``benchmarks/sglang_hicache.py --compare mooncake`` (pool in the SGLang process) measures
through SGLang, without SGLang: ``batch_put_from`` / ``batch_get_into`` of ``--objects`` x 1 MiB
(default 256, one call each) between a registered buffer and the only segment, which the calling
process mounts (``global_segment_size``): Mooncake then copies with memcpy, the drop-in through
its engine's shm link to itself. The registered buffer is memory of a chosen kind (``--sources``):

- ``shared``: ``MAP_SHARED | MAP_ANONYMOUS`` on 4 KiB pages, what SGLang's CPU host pool
  (``kv_buffer``) is on this machine (``/dev/zero (deleted)`` in smaps, not THP-eligible);
- ``private``: private anonymous memory with ``MADV_NOHUGEPAGE`` (4 KiB pages);
- ``huge``: private anonymous memory on a 2 MiB boundary with ``MADV_HUGEPAGE``;
- ``numpy``: a numpy array (numpy advises huge pages for large arrays).

The objects alternate between two halves of the buffer, as SGLang's page_first pool hands out a
page's K and V; gets land in another part of it, compared byte for byte afterwards (untimed).
Each implementation runs in a process of its own with its own master (Mooncake's in
``--mooncake-python``, default ``.venv-sglang-mooncake``, inside a network namespace with only
``lo``: its engine binds 0.0.0.0; needs root). Leases are ``--lease-ttl-s``; after each round its
objects are removed once the lease ran out (untimed). Rounds alternate which implementation goes
first; per source and op the best and the median round are printed, GB/s = 10^9 bytes per
second, and the drop-in / Mooncake ratio of each. ``--probe`` adds the bare copies of one thread
in this process, same bytes and source kinds, into private huge-page memory: ``memmove`` vs
``process_vm_writev`` into this very process (the kernel's cross-memory copy, which the drop-in
used for its own huge-page segment until its shm link copied a same-process peer in place).

    .venv-sglang/bin/python benchmarks/mooncake_store_api.py [--objects 256] [--rounds 8]
        [--sources shared,numpy] [--probe] [--json FILE]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MOONCAKE_PYTHON = ROOT / ".venv-sglang-mooncake" / "bin" / "python"
OBJECT_BYTES = 1 << 20
HUGE_BYTES = 2 << 20
SOURCES = ("shared", "private", "huge", "numpy")
IMPLEMENTATIONS = ("mooncake", "shim")
_MADV_HUGEPAGE, _MADV_NOHUGEPAGE = 14, 15
_libc = ctypes.CDLL(None, use_errno=True)


def host_buffer(kind: str, size: int) -> tuple[Any, int]:
    """(what keeps the memory alive, its address): ``size`` bytes of ``kind``, written once."""
    if kind == "numpy":
        import numpy as np

        array = np.full(size, 1, dtype=np.uint8)
        return array, int(array.ctypes.data)
    flags = (mmap.MAP_SHARED if kind == "shared" else mmap.MAP_PRIVATE) | mmap.MAP_ANONYMOUS
    m = mmap.mmap(-1, size + HUGE_BYTES, flags=flags)
    view = (ctypes.c_char * len(m)).from_buffer(m)
    address = ctypes.addressof(view)
    if kind == "huge":
        address = (address + HUGE_BYTES - 1) // HUGE_BYTES * HUGE_BYTES
    advice = {"huge": _MADV_HUGEPAGE, "private": _MADV_NOHUGEPAGE}.get(kind)
    if advice is not None:
        _libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(size), advice)
    ctypes.memset(address, 1, size)
    return (m, view), address


def object_addresses(base: int, objects: int) -> list[int]:
    """``objects`` x 1 MiB alternating between two halves starting at ``base`` (K, V, K, V, ...)."""
    half = (objects + 1) // 2 * OBJECT_BYTES
    return [base + (i % 2) * half + (i // 2) * OBJECT_BYTES for i in range(objects)]


# ---- one implementation, in a process of its own ------------------------------------------


def serve(api_name: str, objects: int, sources: list[str], lease_ttl_s: float) -> None:
    """One JSON command per stdin line (``{"source": S, "round": R}``), one JSON answer each."""
    if api_name == "mooncake":
        from tidekv.bench.netns import enter_loopback_netns

        enter_loopback_netns()  # first: before any socket or thread exists
    from tidekv.bench.mooncake_store import MooncakeApi, MooncakePool, _setup

    api = MooncakeApi(api_name)
    data = objects * OBJECT_BYTES
    part = (objects + 1) // 2 * OBJECT_BYTES * 2  # both halves of one direction
    segment = 2 * data + (64 << 20)
    pool = MooncakePool(api, True, segment, tempfile.mkdtemp(prefix=f"tidekv-store-api-{api_name}-"),
                        lease_ttl_s=lease_ttl_s)
    store = _setup(api, pool.master, segment, 64 << 20)
    buffers = {}
    for kind in sources:
        keep, base = host_buffer(kind, 2 * part)
        if store.register_buffer(base, 2 * part) != 0:
            raise RuntimeError(f"{api_name}: register_buffer of the {kind} buffer failed")
        buffers[kind] = (keep, object_addresses(base, objects), object_addresses(base + part, objects))
    print(json.dumps({"api": api_name, "master": pool.master}), flush=True)
    sizes = [OBJECT_BYTES] * objects
    for line in sys.stdin:
        cmd = json.loads(line)
        _, src, dst = buffers[cmd["source"]]
        for i, address in enumerate(src):
            ctypes.memset(address, (cmd["round"] * 7 + i) % 251, 64)  # each round's bytes differ
        keys = [f"{cmd['source']}-{cmd['round']}-{i}" for i in range(objects)]
        t0 = time.perf_counter()
        codes = store.batch_put_from(keys, src, sizes)
        t1 = time.perf_counter()
        got = store.batch_get_into(keys, dst, sizes)
        t2 = time.perf_counter()
        is_equal = all(ctypes.string_at(s, OBJECT_BYTES) == ctypes.string_at(d, OBJECT_BYTES) for s, d in zip(src, dst))
        time.sleep(lease_ttl_s + 0.2)  # Mooncake's remove_all keeps leased objects
        store.remove_all()
        print(json.dumps({"put_s": t1 - t0, "get_s": t2 - t1, "is_ok": all(c == 0 for c in codes)
                          and all(n == OBJECT_BYTES for n in got) and is_equal}), flush=True)
    store.close()
    pool.close()


class _Child:
    def __init__(self, api_name: str, args: argparse.Namespace) -> None:
        python = args.mooncake_python if api_name == "mooncake" else sys.executable
        if not Path(python).exists():
            raise SystemExit(f"{python} does not exist; run integration/setup_sglang.sh")
        fd, self.log_path = tempfile.mkstemp(prefix=f"tidekv-store-api-{api_name}-", suffix=".log")
        self.proc = subprocess.Popen(
            [python, __file__, "--serve", api_name, "--objects", str(args.objects), "--sources", args.sources,
             "--lease-ttl-s", str(args.lease_ttl_s)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=fd, text=True)
        os.close(fd)
        self.hello = self._answer()

    def _answer(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            raise SystemExit(f"the worker died (log {self.log_path}):\n{Path(self.log_path).read_text()[-3000:]}")
        return dict(json.loads(line))

    def round(self, source: str, index: int) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"source": source, "round": index}) + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def stop(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


# ---- the bare copy probe ----------------------------------------------------------------


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def probe(objects: int, sources: list[str], rounds: int) -> dict[str, dict[str, float]]:
    """Per source kind: best seconds of one thread copying ``objects`` x 1 MiB into private
    huge-page memory with memmove and with process_vm_writev into this process."""
    writev = _libc.process_vm_writev
    writev.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.POINTER(_Iovec),
                       ctypes.c_ulong, ctypes.c_ulong]
    writev.restype = ctypes.c_ssize_t
    pid, local, remote = os.getpid(), (_Iovec * 1)(), (_Iovec * 1)()
    part = (objects + 1) // 2 * OBJECT_BYTES * 2
    _keep_dst, dst = host_buffer("huge", part)
    out = {}
    for kind in sources:
        keep, base = host_buffer(kind, part)
        src = object_addresses(base, objects)
        times: dict[str, list[float]] = {"memmove": [], "process_vm_writev": []}
        for r in range(rounds):
            for how in (("memmove", "process_vm_writev") if r % 2 == 0 else ("process_vm_writev", "memmove")):
                t0 = time.perf_counter()
                for i, address in enumerate(src):
                    if how == "memmove":
                        ctypes.memmove(dst + i * OBJECT_BYTES, address, OBJECT_BYTES)
                        continue
                    local[0].base, local[0].len = address, OBJECT_BYTES
                    remote[0].base, remote[0].len = dst + i * OBJECT_BYTES, OBJECT_BYTES
                    if writev(pid, local, 1, remote, 1, 0) != OBJECT_BYTES:
                        raise OSError(ctypes.get_errno(), "process_vm_writev into this process failed")
                times[how].append(time.perf_counter() - t0)
        out[kind] = {how: min(t) for how, t in times.items()}
        del keep
    return out


# ---- main --------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--objects", type=int, default=256, help="1 MiB objects per call (default 256)")
    p.add_argument("--rounds", type=int, default=8, help="timed rounds per source and implementation (default 8)")
    p.add_argument("--sources", default="shared,numpy",
                   help=f"buffer kinds, of {', '.join(SOURCES)} (default shared,numpy)")
    p.add_argument("--lease-ttl-s", type=float, default=2.0, help="read lease of both masters, >= 2 (default 2)")
    p.add_argument("--mooncake-python", default=str(MOONCAKE_PYTHON), help="interpreter with Mooncake's wheel")
    p.add_argument("--probe", action="store_true",
                   help="also the bare one-thread copies (memmove vs process_vm_writev)")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    p.add_argument("--serve", choices=IMPLEMENTATIONS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    sources = [s.strip() for s in args.sources.split(",") if s.strip()]
    if not sources or any(s not in SOURCES for s in sources):
        p.error(f"--sources {args.sources!r}: use some of {', '.join(SOURCES)}")
    if args.objects < 1 or args.rounds < 1 or args.lease_ttl_s < 2.0:
        p.error("--objects and --rounds must be >= 1, --lease-ttl-s >= 2 (Mooncake's gets fail with -707 below)")
    if args.serve:
        serve(args.serve, args.objects, sources, args.lease_ttl_s)
        return 0
    data = args.objects * OBJECT_BYTES
    children = {name: _Child(name, args) for name in IMPLEMENTATIONS}
    results: dict[str, Any] = {"objects": args.objects, "object_bytes": OBJECT_BYTES, "rounds": args.rounds,
                               "sources": {}}
    is_ok = True
    try:
        for kind in sources:
            runs: dict[str, list[dict[str, Any]]] = {name: [] for name in IMPLEMENTATIONS}
            for r in range(args.rounds + 1):  # round 0 warms up, untimed
                order = IMPLEMENTATIONS if r % 2 == 0 else IMPLEMENTATIONS[::-1]
                for name in order:
                    out = children[name].round(kind, r)
                    is_ok &= bool(out["is_ok"])
                    if r:
                        runs[name].append(out)
            results["sources"][kind] = {
                name: {f"{op}_s_best": min(x[f"{op}_s"] for x in rs) for op in ("put", "get")}
                | {f"{op}_s_median": statistics.median(x[f"{op}_s"] for x in rs) for op in ("put", "get")}
                | {f"{op}_s_all": [x[f"{op}_s"] for x in rs] for op in ("put", "get")}
                for name, rs in runs.items()}
    finally:
        for child in children.values():
            child.stop()
    if args.probe:
        results["probe"] = probe(args.objects, sources, args.rounds)
    print(f"{args.objects} x 1 MiB per call, pool in the caller's process; best of {args.rounds} rounds "
          f"(median in brackets), GB/s")
    print(f"{'buffer':<9}{'op':<5}{'Mooncake':>16}{'drop-in':>16}{'drop-in/Mooncake':>19}")
    for kind, found in results["sources"].items():
        for op in ("put", "get"):
            m, s = found["mooncake"], found["shim"]
            print(f"{kind:<9}{op:<5}{data / m[f'{op}_s_best'] / 1e9:>9.2f} ({data / m[f'{op}_s_median'] / 1e9:5.2f})"
                  f"{data / s[f'{op}_s_best'] / 1e9:>9.2f} ({data / s[f'{op}_s_median'] / 1e9:5.2f})"
                  f"{m[f'{op}_s_best'] / s[f'{op}_s_best']:>12.2f}x ({m[f'{op}_s_median'] / s[f'{op}_s_median']:.2f}x)")
    for kind, found in results.get("probe", {}).items():
        print(f"probe, one thread, {kind} buffer -> private huge pages: "
              f"memmove {data / found['memmove'] / 1e9:.2f} GB/s, "
              f"process_vm_writev into this process {data / found['process_vm_writev'] / 1e9:.2f} GB/s")
    print("bytes compared: " + ("all equal, every call ok" if is_ok else "FAILED"))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0 if is_ok else 1


if __name__ == "__main__":
    sys.exit(main())
