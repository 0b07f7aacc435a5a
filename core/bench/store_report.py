"""Reporting of ``bench store``: its table columns and notes, its performance bars, its bar chart.

The rows come from ``store.run_bench`` (one per holder, transport and op; Mooncake's numbers
and the ratio on the same row). ``STORE_BARS`` are the targets of the store issue, checked on
same-run ratios to Mooncake and printed, never enforced. Neighbours: ``tidekv.report`` (tables, JSON),
``bars`` (the ``Bar`` type).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tidekv.bench.bars import Bar
from tidekv.errors import ConfigError
from tidekv.report import Column, Row, format_size

if TYPE_CHECKING:
    from tidekv.bench.store import StoreBenchOptions

logger = logging.getLogger(__name__)


def _rate(value: float) -> str:
    for scale, unit in ((1e6, "M"), (1e3, "k")):
        if value >= scale:
            return f"{value / scale:.3g}{unit}"
    return f"{value:.3g}"


def table_columns(has_mooncake: bool) -> list[Column]:
    """Columns of the text table (the JSON rows carry every key)."""
    columns = [
        Column("holder", "holder", align="<"), Column("transport", "transport", align="<"),
        Column("op", "op", align="<"),
        Column("keys", "keys"), Column("size_bytes", "size", format_size), Column("p50_us", "p50 us", ".1f"),
        Column("p99_us", "p99 us", ".1f"), Column("gbps", "GB/s", ".3f"), Column("keys_per_s", "keys/s", _rate),
    ]
    if has_mooncake:
        columns += [Column("mooncake_transport", "mc path", align="<"), Column("mooncake_p50_us", "mc p50 us", ".1f"),
                    Column("mooncake_p99_us", "mc p99 us", ".1f"), Column("mooncake_gbps", "mc GB/s", ".3f"),
                    Column("mooncake_keys_per_s", "mc keys/s", _rate), Column("ratio_mooncake", "vs mc", ".2f"),
                    Column("shim_p50_us", "shim p50 us", ".1f"), Column("shim_gbps", "shim GB/s", ".3f"),
                    Column("shim_keys_per_s", "shim keys/s", _rate),
                    Column("ratio_shim_mooncake", "shim vs mc", ".2f"), Column("ratio_by", "by", align="<")]
    return columns


def table_notes(opts: StoreBenchOptions) -> list[str]:
    """Lines under the table: how to read it."""
    notes = [
        "",
        "holder same: the measuring client mounts the pool's only segment; holder other: another process mounts it "
        "and the measuring client is a pure client. Every process (master, holder, client) is its own.",
        "transport shm: tidekv's auto transport (shared memory to same-host peers, to itself included); tcp: forced, "
        "even to itself.",
        "put/get: bytes API, one key per call; put_many_from/get_many_into: registered memory, one call of "
        f"{opts.batch_keys} keys; exists: one key per call; exists_many: {opts.exists_keys} keys per call. "
        "Puts use fresh keys, removed untimed every 64 MiB.",
        "p50/p99: latency of one call; GB/s: 10^9 payload bytes/s over all timed calls; "
        "keys/s: keys over all timed calls.",
    ]
    if opts.enable_mooncake:
        notes += [
            "mc: mooncake.store.MooncakeDistributedStore, its mooncake_master, protocol tcp, P2PHANDSHAKE, "
            "same process layout. Mooncake has no shared-memory mode: tidekv's shm rows compare with the same "
            "Mooncake numbers as its tcp rows. With the holder in the client's own process Mooncake copies with "
            "memcpy (mc path memcpy); with the holder in another process its bytes go over tcp.",
            "shim: the same Mooncake-API client on tidekv's drop-in (tidekv.compat.mooncake_store, what "
            "tidekv-mooncake-shim installs as mooncake.store, and its mooncake_master), same layout, tidekv's auto "
            "transport (shared memory to same-host peers), so its numbers are the same on a holder's shm and tcp rows.",
            "vs mc > 1 means tidekv is better: by p50, Mooncake p50 / tidekv p50; "
            "by gbps or keys_per_s, tidekv / Mooncake. shim vs mc: the same, the shim's over Mooncake's. "
            f"Rows and Mooncake were measured interleaved in {opts.rounds} round(s).",
        ]
    return notes


_K4 = 4 << 10
STORE_BARS: tuple[Bar, ...] = (
    Bar({"holder": "other", "op": "get", "size_bytes": _K4}, "ratio_mooncake", 2.0,
        meaning="get 4 KiB p50 <= 0.5x Mooncake's, holder in another process"),
    Bar({"holder": "other", "op": "put", "size_bytes": _K4}, "ratio_mooncake", 2.0,
        meaning="put 4 KiB p50 <= 0.5x Mooncake's, holder in another process"),
    Bar({"holder": "other", "op": "get_many_into", "transport": "shm"}, "ratio_mooncake", 3.0,
        meaning="get_many_into, holder in another process, shm >= 3x Mooncake"),
    Bar({"holder": "other", "op": "get_many_into", "transport": "tcp"}, "ratio_mooncake", 1.5,
        meaning="get_many_into, holder in another process, tcp forced >= 1.5x Mooncake"),
    Bar({"op": "exists"}, "ratio_mooncake", 2.0, meaning="exists >= 2x Mooncake's ops/s"),
    Bar({"op": "exists_many"}, "ratio_mooncake", 1.0, meaning="exists_many >= 1x Mooncake's keys/s"),
    Bar({"holder": "other", "op": "put_tensor", "size_bytes": 64 << 20, "transport": "shm"}, "ratio_mooncake", 1.5,
        meaning="put_tensor 64 MiB, holder in another process, >= 1.5x Mooncake"),
    Bar({"holder": "other", "op": "get_tensor", "size_bytes": 64 << 20, "transport": "shm"}, "ratio_mooncake", 1.5,
        meaning="get_tensor 64 MiB, holder in another process, >= 1.5x Mooncake"),
)


def evaluate_bars(rows: Sequence[Row], bars: Sequence[Bar] = STORE_BARS) -> list[str]:
    """One "PASS ..." or "FAIL ..." line per (bar, matching row)."""
    lines = []
    for bar in bars:
        for row in rows:
            if not bar.matches(row):
                continue
            value = float(row[bar.key])
            ok = value >= bar.limit if bar.is_lower_bound else value <= bar.limit
            label = f"holder {row['holder']} {row['transport']} {row['op']} {format_size(row['size_bytes'])}"
            lines.append(f"  {'PASS' if ok else 'FAIL'}  {label:<38} vs mc {value:.2f} "
                         f"{'>=' if bar.is_lower_bound else '<='} {bar.limit:g}  ({bar.meaning})")
    return lines


# title, rows (by their ratio_by), tidekv value, Mooncake value, log scale
_PANELS = (("p50 latency, us (lower is better)", "p50", "p50_us", "mooncake_p50_us", True),
           ("GB/s (higher is better)", "gbps", "gbps", "mooncake_gbps", False),
           ("keys/s (higher is better)", "keys_per_s", "keys_per_s", "mooncake_keys_per_s", True))


def plot(path: str, rows: Sequence[Row], has_mooncake: bool) -> None:
    """Saves grouped bars, one panel per metric (p50, GB/s, keys/s), one group per (op, size, holder).

    Raises:
        ConfigError: matplotlib is missing.
        OSError: the file cannot be written.
    """
    plt = pyplot()
    panels = [(title, [r for r in rows if r["ratio_by"] == by], y, mc_y, is_log)
              for title, by, y, mc_y, is_log in _PANELS]
    panels = [p for p in panels if p[1]]
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 3.8 * len(panels)), squeeze=False)
    for ax, (title, in_panel, y, mc_y, is_log) in zip(axes[:, 0], panels):
        groups = list(dict.fromkeys((r["op"], r["size_bytes"], r["keys"], r["holder"]) for r in in_panel))
        series = [(f"tidekv {t}", {g: r[y] for r in in_panel if r["transport"] == t
                                   for g in [(r["op"], r["size_bytes"], r["keys"], r["holder"])]})
                  for t in dict.fromkeys(r["transport"] for r in in_panel)]
        if has_mooncake:
            series.append(("mooncake (tcp / memcpy)", {(r["op"], r["size_bytes"], r["keys"], r["holder"]): r[mc_y]
                                                       for r in in_panel if r.get(mc_y) is not None}))
            shim_y = "shim_" + mc_y.removeprefix("mooncake_")
            series.append(("shim (Mooncake's API on tidekv)", {(r["op"], r["size_bytes"], r["keys"], r["holder"]):
                                                               r[shim_y] for r in in_panel
                                                               if r.get(shim_y) is not None}))
        width = 0.8 / len(series)
        for i, (label, values) in enumerate(series):
            xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
            ax.bar(xs, [values.get(g, 0.0) for g in groups], width, label=label)
        ax.set_xticks(range(len(groups)), [f"{op}\n{f'{k} x ' if k > 1 else ''}{format_size(s)}\nholder {h}"
                                           for op, s, k, h in groups], fontsize="small")
        if is_log:
            ax.set_yscale("log")
        ax.set_title(title)
        ax.grid(True, axis="y", which="both", alpha=0.3)
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle(f"tidekv bench store ({os.cpu_count()} CPUs; master, holder and client processes on 127.0.0.1)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    logger.info("wrote plot to %s", path)


def pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--plot needs matplotlib, which is not installed; run `pip install matplotlib` "
                          "(tidekv's plot extra)") from None
    return plt
