"""``tidekv bench mixed``: one batch whose requests take different transports, against its parts.

Two target processes on this host: one holds engine-allocated shared memory (reached by shm),
the other plain registered memory; the initiator runs with cross-memory attach off, so requests
to the second go over tcp. Each round times the shm half alone, the tcp half alone and both in
one batch; the bar is the mixed batch's rate against the sum of parts (both halves' bytes over
both halves' times added up): per-request dispatch must not cost a mixed batch more than running
its parts one after the other. ``TIDEKV_*`` settings apply to the targets as to the initiator.
Neighbours: ``transfer`` (one transport per row), ``tidekv.helper_process``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import shutil
import sys
import tempfile
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

from tidekv import report
from tidekv.bench.timing import Budget, measure, summarize
from tidekv.config import TransferConfig
from tidekv.errors import ConfigError, TidekvError
from tidekv.helper_process import HelperProcess, send_ready, serve
from tidekv.report import format_size, parse_size
from tidekv.transfer.batch import TransferOp, TransferRequest
from tidekv.transfer.engine import TransferEngine

logger = logging.getLogger(__name__)

BAR_RATIO = 0.9
_WAIT_TIMEOUT_S = 120.0


def _target_main(conn: Connection, region_bytes: int, is_shared: bool) -> None:
    with TransferEngine(config=TransferConfig.from_env()) as engine:
        keep = None
        if is_shared:
            region = engine.allocate(region_bytes)
        else:
            keep = bytearray(region_bytes)
            region = engine.register(keep)
        ctypes.memset(region.address, 0x5A, region_bytes)
        send_ready(conn, (engine.name, region.address))
        serve(conn, lambda message: engine.stats())


def run(size_bytes: int, count: int, rounds: int, budget: Budget, log_dir: str) -> dict[str, Any]:
    """Measures the halves and the mixed batch in `rounds` interleaved parts; returns one result row."""
    region_bytes = size_bytes * count
    with contextlib.ExitStack() as stack:
        near = stack.enter_context(HelperProcess("tidekv-shm-target", _target_main, (region_bytes, True), log_dir))
        far = stack.enter_context(HelperProcess("tidekv-tcp-target", _target_main, (region_bytes, False), log_dir))
        engine = stack.enter_context(TransferEngine(config=TransferConfig.from_env(enable_cross_memory_attach=False)))
        local = engine.allocate(2 * region_bytes)

        def half(target: HelperProcess, base: int) -> list[TransferRequest]:
            peer, remote = target.hello
            return [TransferRequest(TransferOp.READ, local.address + base + i * size_bytes, size_bytes, peer,
                                    remote + i * size_bytes) for i in range(count)]

        parts = {"shm": half(near, 0), "tcp": half(far, region_bytes)}
        parts["mixed"] = parts["shm"] + parts["tcp"]
        engine.transfer(parts["mixed"]).wait(_WAIT_TIMEOUT_S)
        if engine.stats()["shm_bytes"] != region_bytes or far.call("stats", 10)["served_bytes"] != region_bytes:
            raise TidekvError("the mixed batch did not split into an shm half and a tcp half; nothing to measure")
        samples: dict[str, list[float]] = {name: [] for name in parts}
        for r in range(rounds):
            names = list(parts)[r % 3:] + list(parts)[:r % 3]
            for name in names:
                requests = parts[name]
                samples[name] += measure(lambda: engine.transfer(requests).wait(_WAIT_TIMEOUT_S), budget.split(rounds, r))
    found = {name: summarize(values, region_bytes * (2 if name == "mixed" else 1)) for name, values in samples.items()}
    sum_of_parts_s = found["shm"].p50_us + found["tcp"].p50_us
    ratio = sum_of_parts_s / found["mixed"].p50_us
    return {"size_bytes": size_bytes, "requests_per_half": count,
            **{f"{name}_p50_us": s.p50_us for name, s in found.items()},
            **{f"{name}_gbps": s.gbps for name, s in found.items()},
            "ratio": ratio}


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "mixed", help="one batch mixing shm and tcp requests, against its halves run alone",
        description=__doc__.split("\n\n")[0] + "\n\n" + __doc__.split("\n\n")[1],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=parse_size, default=parse_size("1M"), help="request size (default 1M)")
    p.add_argument("--count", type=int, default=16, help="requests per half (default 16)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    p.add_argument("--min-time", type=float, default=0.4, help="seconds of timed iterations per measurement")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    if args.count < 1 or args.rounds < 1:
        print("tidekv bench mixed: --count and --rounds must be >= 1", file=sys.stderr)
        return 2
    log_dir = tempfile.mkdtemp(prefix="tidekv-bench-")
    try:
        row = run(args.size, args.count, args.rounds, Budget(min_time_s=args.min_time), log_dir)
    except (TidekvError, ConfigError, OSError) as e:
        print(f"tidekv bench mixed failed: {e} (helper logs kept in {log_dir})", file=sys.stderr)
        return 1
    shutil.rmtree(log_dir, ignore_errors=True)
    print(format_rows([row]))
    return 0


def format_rows(rows: Sequence[dict[str, Any]]) -> str:
    columns = [report.Column("size_bytes", "size", format_size), report.Column("requests_per_half", "reqs/half"),
               report.Column("shm_p50_us", "shm p50 us", ".1f"), report.Column("tcp_p50_us", "tcp p50 us", ".1f"),
               report.Column("mixed_p50_us", "mixed p50 us", ".1f"), report.Column("mixed_gbps", "mixed GB/s", ".3f"),
               report.Column("ratio", "vs sum", ".2f")]
    lines = [report.format_table(list(rows), columns, title="tidekv bench mixed: READ, half shm, half tcp",
                                 notes=["", "vs sum = (shm p50 + tcp p50) / mixed p50: the mixed batch's rate "
                                            "against its halves run one after the other."])]
    for row in rows:
        ok = row["ratio"] >= BAR_RATIO
        lines.append(f"  {'PASS' if ok else 'FAIL'}  mixed batch {row['ratio']:.2f} >= {BAR_RATIO} x the sum of parts")
    return "\n".join(lines)
