"""tidekv bench weights: one trainer process publishes ~1 GiB of transformer-shaped tensors to
1, 2 and 4 receiver processes on 127.0.0.1; the same tensors go out with torch.distributed
broadcast (gloo backend, one broadcast per tensor, as RL trainers do) in the same run.

Update time = from the trainer starting the update (tidekv: publish's snapshot copy included)
to the last receiver holding every byte. Two publish modes: "snapshot" copies the tensors
first (the trainer may go on at once); "in-place" serves the trainer's tensors directly (no
copy; the trainer waits for the receivers, as gloo's broadcast makes it wait too). Each round
publishes a new version; the median round is reported, with the ratio gloo / tidekv and how
the time grows with receivers.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

from tidekv.errors import ConfigError
from tidekv.report import Column, format_size, format_table, parse_size, progress

# (hidden, ffn, vocab): a 1B-class Llama; the small one keeps tests of the bench quick
_MODELS = [(2048, 5632, 32000), (256, 704, 4000)]


def transformer_shapes(total_bytes: int, element_size: int = 2) -> list[tuple[str, tuple[int, ...]]]:
    """Llama-like (name, shape) pairs -- embeddings, per-layer attention/MLP/norms, lm_head --
    with as many layers as fit in ``total_bytes`` (at least one)."""
    h, f, v = next((m for m in _MODELS if 4 * m[2] * m[0] * element_size <= total_bytes), _MODELS[-1])
    layer = [("self_attn.q_proj.weight", (h, h)), ("self_attn.k_proj.weight", (h // 4, h)),
             ("self_attn.v_proj.weight", (h // 4, h)), ("self_attn.o_proj.weight", (h, h)),
             ("mlp.gate_proj.weight", (f, h)), ("mlp.up_proj.weight", (f, h)), ("mlp.down_proj.weight", (h, f)),
             ("input_layernorm.weight", (h,)), ("post_attention_layernorm.weight", (h,))]
    per_layer = sum(_numel(s) for _, s in layer) * element_size
    fixed = (2 * v * h + h) * element_size
    layers = max(1, (total_bytes - fixed) // per_layer)
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (v, h))]
    for i in range(layers):
        shapes += [(f"model.layers.{i}.{n}", s) for n, s in layer]
    shapes += [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]
    return shapes


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _make_tensors(total_bytes: int, seed: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g).to(torch.bfloat16) for name, shape in transformer_shapes(total_bytes)}


def _checksum(tensors: dict[str, Any]) -> float:
    return float(sum(t.float().sum().item() for t in tensors.values()))


# -- tidekv -------------------------------------------------------------------------------

def _tidekv_receiver(conn: Any, address: str, fanout: int) -> None:
    from tidekv.config import WeightsConfig
    from tidekv.weights import Subscriber

    with Subscriber(address, config=WeightsConfig(fanout=fanout)) as sub:
        conn.send("ready")
        while (msg := conn.recv()) is not None:
            weights = sub.pull(msg, wait_s=60.0)
            end = time.monotonic()
            conn.send((end, weights.from_parent_bytes, _checksum(weights.tensors) if msg == 1 else None, weights.seconds))


def _run_tidekv(tensors: dict[str, Any], receivers: int, rounds: int, fanout: int, in_place: bool,
                bar: Any) -> tuple[list[float], list[float], float, int]:
    from tidekv.config import WeightsConfig
    from tidekv.weights import Publisher

    ctx = multiprocessing.get_context("spawn")
    with Publisher(tensors, config=WeightsConfig(fanout=fanout)) as pub:
        procs, conns = [], []
        for _ in range(receivers):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_tidekv_receiver, args=(child, pub.address, fanout), daemon=True)
            proc.start()
            procs.append(proc)
            conns.append(parent)
        try:
            for c in conns:
                _expect(c.recv(), "ready")
            totals, publishes, checksum, relayed = [], [], 0.0, 0
            for version in range(1, rounds + 2):  # version 1 warms up (first mappings, page faults)
                t0 = time.monotonic()
                for c in conns:  # receivers wait for the version and stream it while it is copied in
                    c.send(version)
                pub.publish(version, in_place=in_place)
                publishes.append(time.monotonic() - t0)
                results = [c.recv() for c in conns]
                if in_place:
                    pub.retire(version)
                if os.environ.get("TIDEKV_BENCH_DEBUG"):
                    print(version, "publish", publishes[-1], "pulls", [round(r[3], 3) for r in results], flush=True)
                if version > 1:
                    totals.append(max(r[0] for r in results) - t0)
                    relayed += sum(r[1] for r in results)
                else:
                    publishes.pop()
                    checksum = results[0][2]
                    if any(r[2] != checksum for r in results):
                        raise RuntimeError("tidekv receivers disagree on the pulled bytes")
                bar.update(1)
            for c in conns:
                c.send(None)
        finally:
            for proc in procs:
                proc.join(timeout=30)
                if proc.is_alive():
                    proc.kill()
    return totals, publishes, checksum, relayed // rounds


# -- gloo ---------------------------------------------------------------------------------

def _gloo_rank(rank: int, world: int, port: int, total_bytes: int, rounds: int, conn: Any) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    if rank == 0:
        tensors = _make_tensors(total_bytes, seed=1)
    else:
        tensors = {n: torch.empty(s, dtype=torch.bfloat16) for n, s in transformer_shapes(total_bytes)}
    times = []
    for _ in range(rounds + 1):  # the first round warms up (connections)
        dist.barrier()
        t0 = time.monotonic()
        for t in tensors.values():
            dist.broadcast(t, src=0)
        dist.barrier()
        times.append(time.monotonic() - t0)
    conn.send((times[1:], _checksum(tensors)))
    dist.destroy_process_group()


def _run_gloo(total_bytes: int, receivers: int, rounds: int, bar: Any) -> tuple[list[float], float]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    procs, conns = [], []
    for rank in range(receivers + 1):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_gloo_rank, args=(rank, receivers + 1, port, total_bytes, rounds, child), daemon=True)
        proc.start()
        procs.append(proc)
        conns.append(parent)
    try:
        results = [c.recv() for c in conns]
    finally:
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
    if len({r[1] for r in results}) != 1:
        raise RuntimeError("gloo ranks disagree on the broadcast bytes")
    bar.update(rounds)
    return results[0][0], results[0][1]


def _expect(got: Any, want: str) -> None:
    if got != want:
        raise RuntimeError(f"receiver process failed: {got!r}")


MODES = ("snapshot", "in-place")


def run(total_bytes: int, receivers: Sequence[int], rounds: int, fanout: int, show_progress: bool = True,
        modes: Sequence[str] = MODES) -> list[dict[str, Any]]:
    """Runs the bench; returns one row per receiver count and publish mode."""
    import torch

    torch.set_num_threads(1)
    tensors = _make_tensors(total_bytes, seed=1)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    rows: list[dict[str, Any]] = []
    with progress((len(modes) * (rounds + 1) + rounds) * len(receivers), "bench weights", enabled=show_progress) as bar:
        for n in receivers:
            gloo, gloo_sum = _run_gloo(total_bytes, n, rounds, bar)
            t_gloo = statistics.median(gloo)
            for mode in modes:
                ours, publishes, our_sum, relayed = _run_tidekv(tensors, n, rounds, fanout, mode == "in-place", bar)
                if abs(our_sum - gloo_sum) > 1e-6 * max(1.0, abs(gloo_sum)):
                    raise RuntimeError(f"tidekv and gloo delivered different bytes (checksums {our_sum} vs {gloo_sum})")
                t_ours = statistics.median(ours)
                rows.append({
                    "receivers": n, "mode": mode, "bytes": nbytes, "tensors": len(tensors), "fanout": fanout,
                    "tidekv_s": t_ours, "publish_s": statistics.median(publishes), "gloo_s": t_gloo,
                    "speedup": t_gloo / t_ours, "tidekv_gbps": nbytes / t_ours / 1e9, "gloo_gbps": nbytes / t_gloo / 1e9,
                    "relayed_bytes": relayed,
                })
    for row in rows:
        base = next(r for r in rows if r["mode"] == row["mode"])
        row["tidekv_growth"] = row["tidekv_s"] / base["tidekv_s"]
        row["gloo_growth"] = row["gloo_s"] / base["gloo_s"]
    return rows


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = sub.add_parser(
        "weights",
        help="RL weight update: tidekv publish/pull vs torch.distributed gloo broadcast",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--size", default="1G", help="bytes of tensors to send (default 1G)")
    parser.add_argument("--receivers", default="1,2,4", help="receiver counts, comma-separated (default 1,2,4)")
    parser.add_argument("--rounds", type=int, default=3, help="updates per measurement; the median counts (default 3)")
    parser.add_argument("--fanout", type=int, default=0,
                        help="tidekv distribution tree: children per node, 0 = all read the publisher (default 0)")
    parser.add_argument("--modes", default=",".join(MODES),
                        help="publish modes: snapshot (copy, then serve), in-place (serve the trainer's tensors) (default both)")
    parser.add_argument("--json", metavar="FILE", help="write one JSON object per row to FILE")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    counts = [int(x) for x in args.receivers.split(",") if x.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = set(modes) - set(MODES)
    if unknown:
        raise ConfigError(f"--modes {sorted(unknown)} unknown; allowed {list(MODES)}")
    rows = run(parse_size(args.size), counts, args.rounds, args.fanout, show_progress=not args.no_progress, modes=modes)
    cols = [
        Column("receivers", "receivers"),
        Column("mode", "mode", align="<"),
        Column("tidekv_s", "tidekv s", ".3f"),
        Column("publish_s", "(publish s)", ".3f"),
        Column("gloo_s", "gloo s", ".3f"),
        Column("speedup", "gloo/tidekv", ".2f"),
        Column("tidekv_gbps", "tidekv GB/s", ".2f"),
        Column("gloo_gbps", "gloo GB/s", ".2f"),
        Column("tidekv_growth", "tidekv vs 1 rx", ".2f"),
        Column("gloo_growth", "gloo vs 1 rx", ".2f"),
    ]
    title = (f"weight update, {format_size(rows[0]['bytes'])} in {rows[0]['tensors']} bf16 tensors, "
             f"fanout={args.fanout}, median of {args.rounds} rounds")
    barred = [r for r in rows if r["receivers"] in (2, 4)]
    verdict = [f"{r['mode']} x{r['receivers']}: {'PASS' if r['speedup'] >= 2 else 'FAIL'}" for r in barred]
    notes = ["bar: gloo/tidekv >= 2 at 2 and 4 receivers" + (" -- " + ", ".join(verdict) if verdict else "")]
    print(format_table(rows, cols, title=title, notes=notes))
    if args.json:
        with open(args.json, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
    return 0
