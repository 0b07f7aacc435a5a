"""Renders the benchmark pages' tables and plots from the runs kept as data.

Each benchmark whose runs are kept as data has a file ``docs/benchmarks/data/NAME.jsonl``: the
rows its ``--json`` wrote, one JSON object each, with the run's ``date``, ``commit``,
``machine``, ``command`` and ``run`` number added. Adding a run is appending its rows; this
script then writes ``docs/benchmarks/generated/NAME.md`` (a table the area page includes) and,
where matplotlib is installed, ``docs/benchmarks/img/NAME.png``. ``--check`` writes nothing and
exits 1 naming each table that is not current (``tests/test_docs.py`` runs it).

Run from the repository root: ``python docs/gen_benchmarks.py [--check]``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

BENCHMARKS = Path(__file__).resolve().parent / "benchmarks"
Rows = list[dict[str, Any]]


def _load(name: str) -> Rows:
    path = BENCHMARKS / "data" / f"{name}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _runs(rows: Rows) -> dict[tuple[str, str, str, int], Rows]:
    """Rows by run: (date, commit, command, run number)."""
    out: dict[tuple[str, str, str, int], Rows] = defaultdict(list)
    for row in rows:
        out[(row["date"], row["commit"], row["command"], row["run"])].append(row)
    return out


def _table(lines: list[str], rows: Rows) -> str:
    """A rendered table: its lines, then the commands its rows came from."""
    commands = sorted({r["command"] for r in rows})
    return "\n".join(lines) + "\n\nCommands: " + "; ".join(f"`{c}`" for c in commands) + ".\n"


def _scatter(path: Path, series: dict[str, tuple[list[Any], list[float], str]],
             line: tuple[float, str | None, str], xlabel: str, ylabel: str, title: str, log2_x: bool = False) -> None:
    """A benchmark page's plot: a scatter per series (label -> xs, ys, color) and a horizontal
    line (y, label, style), saved as a PNG without a timestamp, so an unchanged plot is unchanged."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2))
    for label, (xs, ys, color) in series.items():
        ax.scatter(xs, ys, color=color, label=label)
    y, label, style = line
    ax.axhline(y, color="grey", linewidth=0.8, linestyle=style, label=label)
    ax.legend(fontsize=8)
    if log2_x:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(fig)


def master_load_groups(rows: Rows) -> tuple[str, Callable[[Path], None]]:
    """A pool sharded over master groups against one master, per prompt length."""
    lines = ["| prompts of | master's loop | date | commit | run | one master, µs CPU/key | "
             "sharded, µs CPU/key (all masters) | groups | capacity, sharded / one |",
             "|---|---|---|---|---|---|---|---|---|"]
    points: dict[tuple[str, int], list[float]] = defaultdict(list)
    load = [r for r in rows if "groups" in r]
    for (date, commit, _, run), group in sorted(_runs(load).items(),
                                                key=lambda kv: (kv[1][0]["blocks"], kv[1][0]["loop"], kv[0])):
        one = next(r for r in group if r["groups"] == 1)
        sharded = next(r for r in group if r["groups"] > 1)
        blocks, loop = one["blocks"], one["loop"]
        points[(loop, blocks)].append(sharded["capacity_vs_one_group"])
        lines.append(f"| 1–{blocks:,} blocks | {loop} | {date} | {commit} | {run} | "
                     f"{one['master_cpu_us_per_key']:.2f} | {sharded['master_cpu_us_per_key']:.2f} | "
                     f"{sharded['groups']} | {sharded['capacity_vs_one_group']:.2f}× |")
    costs = [r for r in rows if "batch" in r]
    lines += ["", "What a request costs the master before its keys (the same runs' last line: one client sending "
              "`Exists` requests one at a time, µs of master CPU per request; each run measures both loops):", "",
              "| date | commit | after the load run of | run | keys per request | asyncio | uvloop |",
              "|---|---|---|---|---|---|---|"]
    by_run: dict[tuple[str, str, str, int, int], dict[str, float]] = defaultdict(dict)
    for r in costs:
        by_run[(r["date"], r["commit"], r["command"], r["run"], r["batch"])][r["loop"]] = r["master_cpu_us_per_request"]
    for (date, commit, command, run, batch), by_loop in sorted(by_run.items(), key=lambda kv: (kv[0][4], kv[0])):
        blocks = re.search(r"--blocks (\d+)", command)
        after = f"1–{int(blocks.group(1)):,} blocks" if blocks else "—"
        after += ", master on asyncio" if "TIDEKV_EVENT_LOOP=asyncio" in command else ""
        lines.append(f"| {date} | {commit} | {after} | {run} | {batch} | {by_loop.get('asyncio', float('nan')):.1f} | "
                     f"{by_loop.get('uvloop', float('nan')):.1f} |")
    text = _table(lines, rows)

    def plot(path: Path) -> None:
        series = {f"master on {loop}": ([b for (lp, b), values in points.items() if lp == loop for _ in values],
                                        [v for (lp, _), values in points.items() if lp == loop for v in values],
                                        color) for loop, color in (("asyncio", "tab:orange"), ("uvloop", "tab:blue"))}
        _scatter(path, series, (1.0, None, "-"), "blocks per prompt, at most", "capacity, sharded / one master",
                 "A pool over master groups (each run a point)", log2_x=True)

    return text, plot


def store_tensors(rows: Rows) -> tuple[str, Callable[[Path], None]]:
    """put_tensor / get_tensor against Mooncake's wheel, per layout and run."""
    lines = ["| date | commit | run | holder | op | size | tidekv (shm) p50 ms | GB/s | Mooncake p50 ms | "
             "GB/s | tidekv vs Mooncake | drop-in vs Mooncake |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    mine = sorted((r for r in rows if r["transport"] == "shm"),
                  key=lambda r: (r["holder"] != "other", r["op"], r["date"], r["run"]))
    points: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for r in mine:
        lines.append(f"| {r['date']} | {r['commit']} | {r['run']} | {r['holder']} | {r['op']} | "
                     f"{r['size_bytes'] >> 20} MiB | {r['p50_us'] / 1e3:.1f} | {r['gbps']:.1f} | "
                     f"{r['mooncake_p50_us'] / 1e3:.1f} | {r['mooncake_gbps']:.2f} | {r['ratio_mooncake']:.2f}× | "
                     f"{r['ratio_shim_mooncake']:.2f}× |")
        if r["holder"] == "other":
            points[r["op"]].append((r["run"], r["ratio_mooncake"]))
    text = _table(lines, rows)

    def plot(path: Path) -> None:
        series = {op: ([x for x, _ in points[op]], [y for _, y in points[op]], color)
                  for op, color in (("put_tensor", "tab:blue"), ("get_tensor", "tab:orange"))}
        _scatter(path, series, (1.5, "bar: 1.5×", "--"), "run", "tidekv / Mooncake (p50)",
                 "64 MiB tensors, pool in another process")

    return text, plot


def tensor_channel(rows: Rows) -> tuple[str, Callable[[Path], None]]:
    """A tensor channel between two hosts against get_many_into of the same bytes, per run."""
    lines = ["| date | commit | run | tensors | get_many_into GB/s | streaming GB/s | ratio | producer GB/s | "
             "draining GB/s | ratio |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["date"], r["run"])):
        lines.append(f"| {r['date']} | {r['commit']} | {r['run']} | {r['items']} × {r['size_bytes'] >> 20} MiB, "
                     f"{r['batch']} a call | {r['get_many_into_gbps']:.2f} | {r['channel_gbps']:.2f} | "
                     f"{r['ratio']:.2f}× | {r['producer_gbps']:.2f} | {r['drain_gbps']:.2f} | "
                     f"{r['drain_ratio']:.2f}× |")
    text = _table(lines, rows)

    def plot(path: Path) -> None:
        runs = [r["run"] for r in rows]
        series = {"streaming": (runs, [r["ratio"] for r in rows], "tab:blue"),
                  "draining": (runs, [r["drain_ratio"] for r in rows], "tab:orange")}
        _scatter(path, series, (0.8, "bar: 0.8×", "--"), "run", "channel / get_many_into",
                 "1 MiB tensors, host 1 to host 2")

    return text, plot


def ha_failover(rows: Rows) -> tuple[str, Callable[[Path], None]]:
    """Leader kills under load, per run: what was acknowledged and lost, failover times, the HA
    cost on puts and gets, and a lone master's restart."""
    lines = ["| run | kills | acknowledged / lost / stale | failover p50 / max | put p50 HA / single | "
             "get p50 HA / single | restart |", "|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: r["run"]):
        change = f": {r['change']}" if r["change"] else ""
        lines.append(
            f"| {r['run']} ({r['date']} {r['time_utc']} UTC, {r['commit']}{change}) | {r['kills']} | "
            f"{r['acknowledged']} / {r['lost']} / {r['stale']} | {r['failover_p50_s']:.2f} / {r['failover_max_s']:.2f} s | "
            f"{r['put_p50_ms_ha']:.2f} / {r['put_p50_ms_single']:.2f} ms "
            f"({r['put_ratio']:.2f}×) | {r['get_p50_ms_ha']:.3f} / {r['get_p50_ms_single']:.3f} ms "
            f"({r['get_ratio']:.2f}×) | "
            f"{r['restart_objects']:,} objects: {r['restart_s']:.2f} s |")
    text = _table(lines, rows)

    def plot(path: Path) -> None:
        runs = [r["run"] for r in rows]
        series = {"put": (runs, [r["put_ratio"] for r in rows], "tab:blue"),
                  "get": (runs, [r["get_ratio"] for r in rows], "tab:orange")}
        _scatter(path, series, (1.0, "no cost", ":"), "run", "p50 with HA / lone master", "What HA costs a request")

    return text, plot


def store_disk(rows: Rows) -> tuple[str, Callable[[Path], None]]:
    """The disk tier against raw O_DIRECT I/O of the same directory, per size and run."""
    lines = ["| date | commit | run | size | path | GB/s | vs raw | p50 ms | p99 ms |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        vs = f"{r['vs_raw']:.2f}×" if "vs_raw" in r else "-"
        p50 = f"{r['p50_ms']:.2f}" if "p50_ms" in r else "-"
        p99 = f"{r['p99_ms']:.2f}" if "p99_ms" in r else "-"
        lines.append(f"| {r['date']} | {r['commit']} | {r['run']} | {r['size']} | {r['path']} | {r['gb_s']:.2f} | "
                     f"{vs} | {p50} | {p99} |")
    text = _table(lines, rows)
    barred = [r for r in rows if r.get("bar") and r["size_bytes"] == 2 << 20]

    def plot(path: Path) -> None:
        series = {bar: ([r["run"] for r in barred if r["bar"] == bar], [r["vs_raw"] for r in barred if r["bar"] == bar],
                        color) for bar, color in (("spill_vs_raw_write", "tab:blue"),
                                                  ("get_holder_vs_raw_read", "tab:orange"))}
        _scatter(path, series, (0.7, "bar: 0.7×", "--"), "run", "tidekv / raw O_DIRECT", "2 MiB objects, disk tier")

    return text, plot


RENDERERS: dict[str, Callable[[Rows], tuple[str, Callable[[Path], None]]]] = {
    "ha-failover": ha_failover,
    "store-disk": store_disk,
    "tensor-channel": tensor_channel,
    "master-load-groups": master_load_groups,
    "store-tensors": store_tensors,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a table is not current")
    args = parser.parse_args(argv)
    stale = []
    for name, render in RENDERERS.items():
        text, plot = render(_load(name))
        table = BENCHMARKS / "generated" / f"{name}.md"
        if args.check:
            if not table.is_file() or table.read_text() != text:
                stale.append(name)
            continue
        table.parent.mkdir(exist_ok=True)
        table.write_text(text)
        try:
            image = BENCHMARKS / "img" / f"{name}.png"
            image.parent.mkdir(exist_ok=True)
            plot(image)
        except ImportError:
            print(f"{name}: matplotlib is not installed; table written, plot not redrawn", file=sys.stderr)
    if stale:
        print(f"not current: {', '.join(stale)}; regenerate with python docs/gen_benchmarks.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
