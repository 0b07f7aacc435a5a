"""GPU memory through tidekv against the GPU moving the same bytes itself, in one run.

Rows (each the median of ``--reps`` batches after two warm-ups; a target process holds the far
side's memory):

- ``ipc 64x1MiB`` and ``ipc 2000x16KiB``: one batch of READs from another process's GPU memory
  (cuda transport: CUDA IPC, driver copies) against device-to-device copies of the same blocks
  inside one process (torch ``copy_`` when torch has CUDA, else the driver's ``cuMemcpy``).
  Bar: ratio (baseline time / tidekv time) >= 0.8.
- ``staged tcp 64x1MiB``: forced tcp, GPU memory on both sides (staged through pinned host
  memory at each end) against forced tcp between host memory on both sides. Bar: >= 0.7.
- ``vllm hand-off``: a decode pulling 2,000 tokens of a 32-layer, 8-KV-head, 128-dim bf16 cache
  in 16-token blocks (125 blocks x 32 layers x K and V = 8,000 requests of 32 KiB) from a
  prefill's cache, over the cuda transport and over staged tcp: time only.

``python -m tidekv.bench.gpu`` runs it without the CLI's dependencies (what the device check
uses). Neighbours: ``tidekv.bench.gpumem`` (GPU memory without torch), ``integration/gpu_check.sh``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from tidekv.config import TransferConfig, TransportKind
from tidekv.errors import ConfigError
from tidekv.transfer import TransferEngine, TransferOp, TransferRequest

MIB = 1 << 20
KIB = 1 << 10
LAYERS, HEADS, HEAD_DIM, BLOCK_TOKENS, TOKENS = 32, 8, 128, 16, 2000
RUN_BYTES = BLOCK_TOKENS * HEADS * HEAD_DIM * 2  # one block of K (or V) of one layer, bf16: 32 KiB
CACHE_BLOCKS = 256  # per layer, on each side
WAIT_S = 120.0


@dataclass
class Row:
    name: str
    bytes: int
    requests: int
    tidekv_s: float
    baseline: str
    baseline_s: float | None
    ratio: float | None  # baseline_s / tidekv_s: >= 1 means tidekv is as fast
    bar: float | None
    passed: bool | None

    @property
    def gbps(self) -> float:
        return self.bytes / self.tidekv_s / 1e9


def _median(fn: Callable[[], None], reps: int) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class _Target:
    """The far side: a process with GPU and host memory, registered (``--target``)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "tidekv.bench.gpu", "--target"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if not line:
            raise ConfigError(f"the GPU bench's target process exited with {self.proc.wait(timeout=30)}")
        hello = json.loads(line)
        self.name: str = hello["name"]
        self.regions: dict[str, int] = hello["regions"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
        self.proc.wait(timeout=60)


def _target_main() -> None:
    from tidekv.bench.gpumem import DeviceMemory

    gpu = DeviceMemory()
    engine = TransferEngine()
    regions = {}
    for name, size in (("gpu", 64 * MIB), ("kv", _kv_bytes())):
        ptr = gpu.alloc(size)
        gpu.write(ptr, random.Random(1).randbytes(min(size, 64 * MIB)))
        engine.register((ptr, size), location="cuda:0")
        regions[name] = ptr
    regions["host"] = engine.allocate(64 * MIB).address
    print(json.dumps({"name": engine.name, "regions": regions}), flush=True)
    for line in sys.stdin:
        if line.strip() == "quit":
            break
    engine.close()


def _kv_bytes() -> int:
    return LAYERS * 2 * CACHE_BLOCKS * RUN_BYTES


def _cuda_torch() -> Any:
    """torch when it is installed with CUDA (the baseline's copies are then its ``copy_``), else None."""
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def _baseline_copies(gpu: Any, torch: Any, pairs: list[tuple[int, int, int]]) -> tuple[str, Callable[[], None]]:
    """Device-to-device copies of (dst, src, n) in this process: torch's when it has CUDA."""
    if torch is not None:
        storage: dict[int, Any] = {}

        def view(addr: int, n: int) -> Any:
            # A tensor over existing GPU memory, through __cuda_array_interface__.
            class _Array:
                __cuda_array_interface__ = {"data": (addr, False), "shape": (n,), "typestr": "|u1", "version": 3}

            t = torch.as_tensor(_Array(), device="cuda")
            storage[addr] = t
            return t

        views = [(view(d, n), view(s, n)) for d, s, n in pairs]

        def run_torch() -> None:
            for dst, src in views:
                dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()

        return "torch D2D copy_", run_torch

    def run_driver() -> None:
        for d, s, n in pairs:
            gpu.copy(d, s, n)

    return "cuMemcpy D2D", run_driver


def run(reps: int = 10, progress: Callable[[str], None] = lambda line: None) -> list[Row]:
    from tidekv.bench.gpumem import DeviceMemory

    torch = _cuda_torch()
    gpu = DeviceMemory()
    target = _Target()
    auto = TransferEngine()
    tcp = TransferEngine(config=TransferConfig(transport=TransportKind.TCP))
    rows: list[Row] = []
    try:
        local = gpu.alloc(64 * MIB)
        src = gpu.alloc(64 * MIB)
        local_kv = gpu.alloc(_kv_bytes())
        for engine in (auto, tcp):
            engine.register((local, 64 * MIB), location="cuda:0")
            engine.register((local_kv, _kv_bytes()), location="cuda:0")
        host = tcp.allocate(64 * MIB)
        far = target.regions

        def batch(engine: TransferEngine, requests: list[TransferRequest]) -> Callable[[], None]:
            return lambda: engine.transfer(requests).wait(timeout_s=WAIT_S)

        rng = random.Random(3)
        for name, count, size in (("ipc 64x1MiB", 64, MIB), ("ipc 2000x16KiB", 2000, 16 * KIB)):
            slots = list(range(64 * MIB // size))
            rng.shuffle(slots)
            pairs = list(zip(slots[:count], slots[count:2 * count] if 2 * count <= len(slots) else slots[:count]))
            progress(f"{name}: tidekv")
            reqs = [TransferRequest(TransferOp.READ, local + a * size, size, target.name, far["gpu"] + b * size)
                    for a, b in pairs]
            t = _median(batch(auto, reqs), reps)
            progress(f"{name}: baseline")
            label, base = _baseline_copies(gpu, torch, [(local + a * size, src + b * size, size) for a, b in pairs])
            b_s = _median(base, reps)
            rows.append(Row(name, count * size, count, t, label, b_s, b_s / t, 0.8, b_s / t >= 0.8))
        progress("staged tcp 64x1MiB")
        gpu_reqs = [TransferRequest(TransferOp.READ, local + i * MIB, MIB, target.name, far["gpu"] + i * MIB)
                    for i in range(64)]
        host_reqs = [TransferRequest(TransferOp.READ, host.address + i * MIB, MIB, target.name, far["host"] + i * MIB)
                     for i in range(64)]
        t = _median(batch(tcp, gpu_reqs), reps)
        b_s = _median(batch(tcp, host_reqs), reps)
        rows.append(Row("staged tcp 64x1MiB", 64 * MIB, 64, t, "tcp host->host", b_s, b_s / t, 0.7, b_s / t >= 0.7))
        blocks = rng.sample(range(CACHE_BLOCKS), TOKENS // BLOCK_TOKENS + (TOKENS % BLOCK_TOKENS > 0))
        mine = rng.sample(range(CACHE_BLOCKS), len(blocks))
        handoff = []
        for layer in range(LAYERS):
            for kv in range(2):
                base_off = (layer * 2 + kv) * CACHE_BLOCKS * RUN_BYTES
                for a, b in zip(mine, blocks):
                    handoff.append((base_off + a * RUN_BYTES, base_off + b * RUN_BYTES))
        for label, engine in (("vllm hand-off, cuda", auto), ("vllm hand-off, staged tcp", tcp)):
            progress(label)
            reqs = [TransferRequest(TransferOp.READ, local_kv + a, RUN_BYTES, target.name, far["kv"] + b)
                    for a, b in handoff]
            t = _median(batch(engine, reqs), reps)
            rows.append(Row(label, len(reqs) * RUN_BYTES, len(reqs), t, "", None, None, None, None))
    finally:
        auto.close()
        tcp.close()
        target.close()
    return rows


def print_rows(rows: list[Row]) -> None:
    print(f"{'row':28} {'requests':>8} {'MiB':>7} {'tidekv ms':>10} {'GB/s':>7} {'baseline':>16} {'base ms':>8} "
          f"{'ratio':>6} {'bar':>5}")
    for r in rows:
        base = f"{r.baseline_s * 1e3:8.2f}" if r.baseline_s is not None else f"{'':8}"
        ratio = f"{r.ratio:6.2f}" if r.ratio is not None else f"{'':6}"
        bar = ("ok" if r.passed else "MISS") if r.bar is not None else ""
        print(f"{r.name:28} {r.requests:8d} {r.bytes / MIB:7.1f} {r.tidekv_s * 1e3:10.2f} {r.gbps:7.2f} "
              f"{r.baseline:>16} {base} {ratio} {bar:>5}")


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = sub.add_parser("gpu", help="GPU memory: cuda IPC vs in-process D2D copies, staged tcp vs host tcp",
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _arguments(parser)
    parser.set_defaults(func=_main)


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--reps", type=int, default=10, help="timed batches per row; the median counts (default 10)")
    parser.add_argument("--json", metavar="FILE", help="write the rows as one JSON array to FILE")


def _main(args: argparse.Namespace) -> int:
    from tidekv import _native

    available, reason = _native.cuda_driver()
    if not available:
        raise ConfigError(f"tidekv bench gpu needs a CUDA GPU: {reason}")
    rows = run(args.reps, progress=lambda line: print(f"bench gpu: {line}", file=sys.stderr, flush=True))
    print(f"GPU: {reason}")
    print_rows(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) | {"gbps": r.gbps} for r in rows], f, indent=1)
    return 0 if all(r.passed is not False for r in rows) else 1


if __name__ == "__main__":
    if sys.argv[1:] == ["--target"]:
        _target_main()
    else:
        cli = argparse.ArgumentParser(prog="python -m tidekv.bench.gpu", description=__doc__,
                                      formatter_class=argparse.RawDescriptionHelpFormatter)
        _arguments(cli)
        sys.exit(_main(cli.parse_args()))
