"""``tidekv plan``: what a KV pool for a model and a load costs — store objects, master memory,
master cores, network — worked out before the hardware is bought.

Inputs: the model's KV shape (layers, KV heads, head size, dtype; the engine's block size and
tensor-parallel size), the pool's size, and the load: a prompt rate, a mean prompt length and
the share of prompt tokens found in the pool, or a FAST'25 trace (``--trace``) from which the
rate and lengths are read and the hit rate simulated for a pool of that size (``cache``). The
master's costs default to ``tidekv bench master`` figures (bytes per object; time per key of
Exists, Get and PutStart+PutEnd in requests of 64 keys) and take a run of your own instead.

The model: one store object per block and tensor-parallel rank (``prefix.KEY_SCHEME``); each
prompt looks up each of its full blocks on every rank, reads those found and saves the others.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any

from tidekv.report import Column, format_table
from tidekv.values import format_size, parse_size

DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp8": 1, "int8": 1}


@dataclass(frozen=True)
class ModelShape:
    """What a token's KV cache is made of, and how the engine cuts it."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    block_tokens: int
    tp: int = 1
    mla: bool = False
    """One latent per token instead of K and V per head (MLA): ``kv_heads`` counts 1, K only."""

    @property
    def kv_bytes_per_token(self) -> int:
        return (1 if self.mla else 2) * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def object_bytes(self) -> int:
        """One store object: a block's slice on one rank (every rank holds all of it under MLA)."""
        per_block = self.kv_bytes_per_token * self.block_tokens
        return per_block if self.mla else per_block // self.tp


@dataclass(frozen=True)
class MasterCosts:
    """One master's costs. Defaults: ``tidekv bench master --objects 200000 --seconds 1`` on the
    2-vCPU VM, 2026-12-06 (docs/benchmarks/index.md, "Master under load"); a faster core divides them."""

    bytes_per_object: float = 459.0
    exists_us_per_key: float = 0.65
    get_us_per_key: float = 3.0
    put_us_per_key: float = 11.4


@dataclass(frozen=True)
class Load:
    prompts_per_s: float
    prompt_tokens: float
    """Mean prompt length."""
    hit_rate: float
    """Share of prompt tokens found in the pool (read, not computed)."""


def plan(shape: ModelShape, pool_bytes: int, load: Load, costs: MasterCosts = MasterCosts()) -> dict[str, Any]:
    """The pool's figures (see ``rows``)."""
    objects = pool_bytes // shape.object_bytes
    blocks_per_prompt = math.floor(load.prompt_tokens / shape.block_tokens)
    keys_per_s = load.prompts_per_s * blocks_per_prompt * shape.tp
    gets_per_s, puts_per_s = keys_per_s * load.hit_rate, keys_per_s * (1 - load.hit_rate)
    master_cores = (keys_per_s * costs.exists_us_per_key + gets_per_s * costs.get_us_per_key
                    + puts_per_s * costs.put_us_per_key) / 1e6
    return {
        "kv_bytes_per_token": shape.kv_bytes_per_token,
        "object_bytes": shape.object_bytes,
        "pool_tokens": pool_bytes // shape.kv_bytes_per_token,
        "objects": objects,
        "objects_one_per_run": objects * (1 if shape.mla else 2) * shape.layers,
        "master_memory_bytes": objects * costs.bytes_per_object,
        "keys_per_prompt": blocks_per_prompt * shape.tp,
        "lookups_per_s": keys_per_s,
        "gets_per_s": gets_per_s,
        "puts_per_s": puts_per_s,
        "master_cores": master_cores,
        "network_bytes_per_s": (gets_per_s + puts_per_s) * shape.object_bytes,
    }


def from_trace(path: str, pool_tokens: int, max_requests: int | None) -> Load:
    """The load of a FAST'25 trace: its rate and mean prompt length, and the hit rate of one
    global pool of ``pool_tokens`` over it (``cache.simulate_global``)."""
    from tidekv.trace.cache import simulate_global
    from tidekv.trace.format import load_trace

    requests = load_trace(path, max_requests=max_requests)
    if len(requests) < 2:
        raise SystemExit(f"{path}: a trace of {len(requests)} request(s) has no rate")
    span_s = (requests[-1].timestamp_ms - requests[0].timestamp_ms) / 1e3
    result = simulate_global(requests, pool_tokens)
    return Load(len(requests) / max(span_s, 1e-9), result.input_tokens / len(requests), result.hit_rate)


def rows(figures: dict[str, Any], shape: ModelShape) -> list[dict[str, str]]:
    f = figures
    return [
        {"what": "KV per token", "value": format_size(f["kv_bytes_per_token"])},
        {"what": f"store object (a block of {shape.block_tokens} tokens on one of {shape.tp} rank(s))",
         "value": format_size(f["object_bytes"])},
        {"what": "pool holds, tokens", "value": f"{f['pool_tokens']:,}"},
        {"what": "objects in a full pool", "value": f"{f['objects']:,}"},
        {"what": "  the same, one object per layer run (before key scheme 2)",
         "value": f"{f['objects_one_per_run']:,}"},
        {"what": "master memory", "value": f"{f['master_memory_bytes'] / 1e9:,.2f} GB"},
        {"what": "keys per prompt (every rank)", "value": f"{f['keys_per_prompt']:,}"},
        {"what": "lookups / gets / puts per s", "value":
            f"{f['lookups_per_s']:,.0f} / {f['gets_per_s']:,.0f} / {f['puts_per_s']:,.0f}"},
        {"what": "master cores (one master group's loop is one core)", "value": f"{f['master_cores']:.2f}"},
        {"what": "network, gets + puts", "value": f"{f['network_bytes_per_s'] * 8 / 1e9:,.1f} Gbit/s"},
    ]


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("plan", help="size a KV pool: objects, master memory and cores, network",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="example (a 70B-class model, bf16, 16-token blocks, a 1 TiB pool):\n"
                              "  tidekv plan --layers 80 --kv-heads 8 --head-dim 128 --dtype bf16 --block-tokens 16 "
                              "--pool 1TiB --prompt-rate 20 --prompt-tokens 32768 --hit-rate 0.5")
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--kv-heads", type=int, required=True, help="KV heads (1 with --mla)")
    p.add_argument("--head-dim", type=int, required=True, help="head size (with --mla: the latent's size)")
    p.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bf16", help="KV cache dtype (default bf16)")
    p.add_argument("--block-tokens", type=int, default=16, help="the engine's block size (default 16)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    p.add_argument("--mla", action="store_true", help="MLA: one latent per token, the same on every rank")
    p.add_argument("--pool", type=lambda v: parse_size(v, "--pool", minimum=1), required=True,
                   help="the pool's size, e.g. 1TiB")
    load = p.add_argument_group("load: a rate, length and hit rate, or a trace")
    load.add_argument("--prompt-rate", type=float, help="prompts per second")
    load.add_argument("--prompt-tokens", type=float, help="mean prompt length, tokens")
    load.add_argument("--hit-rate", type=float, help="share of prompt tokens found in the pool (0-1)")
    load.add_argument("--trace", metavar="FILE", help="a FAST'25 trace (JSON lines): rate and lengths read, hit "
                      "rate simulated for a pool of --pool")
    load.add_argument("--max-requests", type=int, default=None, help="only the trace's first N requests")
    costs = p.add_argument_group("the master's costs (default: tidekv bench master on the 2-vCPU VM)")
    costs.add_argument("--bytes-per-object", type=float, default=MasterCosts.bytes_per_object)
    costs.add_argument("--exists-us", type=float, default=MasterCosts.exists_us_per_key)
    costs.add_argument("--get-us", type=float, default=MasterCosts.get_us_per_key)
    costs.add_argument("--put-us", type=float, default=MasterCosts.put_us_per_key)
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    for name in ("layers", "kv_heads", "head_dim", "block_tokens", "tp"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    shape = ModelShape(args.layers, args.kv_heads, args.head_dim, DTYPE_BYTES[args.dtype], args.block_tokens,
                       args.tp, args.mla)
    if shape.object_bytes < 1:
        raise SystemExit("a block's slice per rank is under one byte: check --tp against the shape")
    if args.trace:
        load = from_trace(args.trace, args.pool // shape.kv_bytes_per_token, args.max_requests)
    elif None in (args.prompt_rate, args.prompt_tokens, args.hit_rate):
        raise SystemExit("give --prompt-rate, --prompt-tokens and --hit-rate, or --trace FILE")
    elif not 0 <= args.hit_rate <= 1:
        raise SystemExit(f"--hit-rate {args.hit_rate}: a share, 0 to 1")
    else:
        load = Load(args.prompt_rate, args.prompt_tokens, args.hit_rate)
    costs = MasterCosts(args.bytes_per_object, args.exists_us, args.get_us, args.put_us)
    figures = plan(shape, args.pool, load, costs)
    title = (f"KV pool of {format_size(args.pool)}: {load.prompts_per_s:,.2f} prompts/s of {load.prompt_tokens:,.0f} "
             f"tokens, {load.hit_rate:.0%} of prompt tokens found")
    print(format_table(rows(figures, shape), [Column("what", "", align="<"), Column("value", "", align=">")],
                       title=title))
    return 0
