"""Renders the benchmark pages' tables and plots from the runs kept as data.

Each benchmark whose runs are kept as data has a file ``docs/benchmarks/data/NAME.jsonl``: the
rows its ``--json`` wrote, one JSON object each, with the run's ``date``, ``commit``,
``machine``, ``command`` and ``run`` number added. Adding a run is appending its rows; this
script then writes ``docs/benchmarks/generated/NAME.md`` (a table the area page includes) and,
where matplotlib is installed, ``docs/benchmarks/img/NAME.png``. ``--check`` writes nothing and
exits 1 naming each table that is not current (``tests/test_docs.py`` runs it).

Runs transcribed from a page's prose or hand-written tables (``TRANSCRIBED``) keep every number as
the page stated it: their files are read with ``Decimal``, so ``0.60`` prints as ``0.60``, and a
field the page did not state is ``null`` (or absent) and prints as "—". Where the page gave only the
lowest and highest of several runs, the field is that pair and the row's ``run`` is ``null`` with
``runs`` saying how many.

Run from the repository root: ``python docs/gen_benchmarks.py [--check]``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from collections.abc import Callable, Iterable
from decimal import Decimal
from pathlib import Path
from typing import Any

BENCHMARKS = Path(__file__).resolve().parent / "benchmarks"
Rows = list[dict[str, Any]]


def _load(name: str) -> Rows:
    path = BENCHMARKS / "data" / f"{name}.jsonl"
    parse_float = Decimal if name in TRANSCRIBED else float
    return [json.loads(line, parse_float=parse_float) for line in path.read_text().splitlines() if line.strip()]


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


def _scatter(path: Path, series: dict[str, tuple[list[Any], list[Any], str]],
             line: tuple[float, str | None, str] | None, xlabel: str, ylabel: str, title: str,
             log2_x: bool = False) -> None:
    """A benchmark page's plot: a scatter per series (label -> xs, ys, color) and a horizontal
    line (y, label, style) unless ``line`` is None, saved as a PNG without a timestamp, so an
    unchanged plot is unchanged."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2))
    for label, (xs, ys, color) in series.items():
        ax.scatter([x if isinstance(x, str) else float(x) for x in xs], [float(y) for y in ys], color=color,
                   label=label)
    if line is not None:
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
             "draining GB/s | ratio | CPU s/GB: master, producer, consumer (get_many_into → streaming) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["date"], r["run"])):
        ahead = ((", read-ahead" if r.get("read_ahead") else "")
                 + (f", {r['pairs']} pieces paired" if r.get("pairs") else ""))
        cpu = r.get("cpu_per_gb")
        spent = "—" if cpu is None else ", ".join(f"{cpu['get_many_into'][role]:.2f} → {cpu['streaming'][role]:.2f}"
                                                  for role in ("master", "producer", "consumer"))
        lines.append(f"| {r['date']} | {r['commit']} | {r['run']} | {r['items']} × {r['size_bytes'] >> 20} MiB, "
                     f"{r['batch']} a call{ahead} | {r['get_many_into_gbps']:.2f} | {r['channel_gbps']:.2f} | "
                     f"{r['ratio']:.2f}× | {r['producer_gbps']:.2f} | {r['drain_gbps']:.2f} | "
                     f"{r['drain_ratio']:.2f}× | {spent} |")
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
            f"{r['acknowledged']} / {r['lost']} / {r['stale']} | "
            f"{r['failover_p50_s']:.2f} / {r['failover_max_s']:.2f} s | "
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
    lines = ["| date | commit | run | size | path | GB/s | vs raw | p50 ms | p99 ms |",
             "|---|---|---|---|---|---|---|---|---|"]
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


# Runs transcribed from pages: helpers


def _num(value: Any, spec: str = "") -> str:
    """A number as its data holds it: a transcribed one (``Decimal``) exactly as written, another
    formatted by ``spec``, an absent one as "—"."""
    if value is None:
        return "—"
    if isinstance(value, Decimal):
        return str(value)
    return format(value, spec)


def _span(pair: list[Any] | None, spec: str = "") -> str:
    """The lowest and highest of several runs, as "lo–hi"; "—" when absent."""
    return "—" if pair is None else f"{_num(pair[0], spec)}–{_num(pair[1], spec)}"


def _slash(values: Iterable[Any], suffix: str = "", spec: str = "") -> str:
    """Values of several runs in one cell, "a / b"; "—" when none is known."""
    values = list(values)
    if all(v is None for v in values):
        return "—"
    return " / ".join(_num(v, spec) for v in values) + suffix


def _size(size_bytes: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if size_bytes >= 1 << shift and size_bytes % (1 << shift) == 0:
            return f"{size_bytes >> shift} {unit}"
    return f"{size_bytes} B"


def _when(row: dict[str, Any]) -> str:
    """A run's date, time and commit, "—" for what its page did not state."""
    time = f" {row['time_utc']} UTC" if row.get("time_utc") else ""
    return f"{row['date'] or '—'}{time}, {row['commit'] or '—'}"


def _unique(values: Iterable[Any]) -> list[Any]:
    return list(dict.fromkeys(values))


def _runs_line(rows: Rows, extra: Callable[[dict[str, Any]], str] = lambda r: r.get("conditions", "")) -> str:
    """One line naming the runs of ``rows`` (in their order): when, which commit, and ``extra``; runs
    alike in all three share their words."""
    alike: dict[str, list[str]] = {}
    for run in _unique(r["run"] for r in rows):
        first = next(r for r in rows if r["run"] == run)
        time = f" {first['time_utc']} UTC" if first.get("time_utc") else ""
        note = extra(first)
        words = f"{first['date'] or '—'}{time}, commit {first['commit'] or '—'}" + (f", {note}" if note else "")
        alike.setdefault(words, []).append(str(run))
    parts = [f"{'runs' if len(runs) > 1 else 'run'} {', '.join(runs)}: {words}" for words, runs in alike.items()]
    return "; ".join(parts)[0].upper() + "; ".join(parts)[1:] + "."


def _groups(rows: Rows, key: Callable[[dict[str, Any]], Any]) -> dict[Any, Rows]:
    """Rows by ``key``, in the order each key first appears."""
    out: dict[Any, Rows] = {}
    for row in rows:
        out.setdefault(key(row), []).append(row)
    return out


def transfer_nixl(rows: Rows) -> tuple[str, Callable[[Path], None]]:
    """Batches of 64 against NIXL (and fabric against tidekv's tcp), ratios per run."""
    runs = _unique(r["run"] for r in rows)
    order = " / ".join(str(run) for run in runs)
    lines = [f"| row (batches of 64) | READ, runs {order} | WRITE, runs {order} | bar |", "|---|---|---|---|"]
    groups = _groups(rows, lambda r: (r["transport"], r["size_bytes"], r.get("nixl_ucx")))
    for (transport, size_bytes, ucx), group in groups.items():
        if transport == "fabric":
            label = f"fabric {_size(size_bytes)} vs tidekv tcp"
        else:
            label = f"{transport} {_size(size_bytes)} vs NIXL " + ("`UCX_TLS=tcp`" if ucx == "tcp" else "default")
        bar = group[0]["bar"]
        cells = []
        for op in ("READ", "WRITE"):
            by_run = {r["run"]: r.get("ratio_nixl", r.get("ratio")) for r in group if r["op"] == op}
            values = [by_run.get(run) for run in runs]
            cells.append(" / ".join(f"**{_num(v)}**" if bar is not None and v is not None and v < bar else _num(v)
                                    for v in values))
        lines.append(f"| {label} | {cells[0]} | {cells[1]} | {'—' if bar is None else f'≥ {bar}'} |")
    changes = "".join(f" From run {r['run']}: {r['change']}." for r in rows if r["change"] and r["op"] == "READ"
                      and r["transport"] == "fabric" and r["size_bytes"] == 1 << 20)
    lines += ["", "Bold: below the bar. " + _runs_line(rows, lambda r: "") + changes]
    text = _table(lines, rows)

    def plot(path: Path) -> None:
        fabric = [r for r in rows if r["transport"] == "fabric" and r["size_bytes"] == 1 << 20]
        series = {op: ([r["run"] for r in fabric if r["op"] == op], [r["ratio"] for r in fabric if r["op"] == op],
                       color) for op, color in (("READ", "tab:blue"), ("WRITE", "tab:orange"))}
        _scatter(path, series, (0.5, "bar: 0.5×", "--"), "run", "fabric / tidekv tcp",
                 "64×1 MiB over libfabric's tcp provider")

    return text, plot


_BASELINES = {"socket_pingpong": "socket ping-pong", "socket_stream": "socket stream", "memcpy": "memcpy"}


def transfer_mooncake(rows: Rows) -> tuple[str, Callable[[Path], None]]:
    """Every row of ``bench transfer --compare mooncake``: tidekv, its same-run baseline and Mooncake,
    each cell the runs in order."""
    runs = _unique(r["run"] for r in rows)
    lines = ["| row | tidekv | same-run baseline | ratio | Mooncake | vs Mooncake |", "|---|---|---|---|---|---|"]
    groups = _groups(rows, lambda r: (r["transport"], r["op"], r["mode"], r["size_bytes"], r["requests"]))
    shown = None
    for (transport, op, mode, size_bytes, requests), group in groups.items():
        by_run = {r["run"]: r for r in group}
        cells = [by_run.get(run, {}) for run in runs]
        unit = "p50_us" if "p50_us" in group[0] else "gbps"
        suffix = " µs" if unit == "p50_us" else " GB/s"
        size = f"{requests}×{_size(size_bytes)}" if mode == "batch" else _size(size_bytes)
        label = f"{transport} {op} {mode} {size}" + (", p50" if unit == "p50_us" else "")
        name = _BASELINES.get(group[0]["baseline"], group[0]["baseline"])
        base = ("" if name == shown else f"{name} ") + _slash((c.get(f"baseline_{unit}") for c in cells), suffix)
        shown = name
        ratio = _slash((c.get("ratio") for c in cells), "×")
        mooncake = _slash((c.get(f"mooncake_{unit}") for c in cells), suffix)
        vs = _slash((c.get("ratio_mooncake") for c in cells), "×")
        lines.append(f"| {label} | {_slash((c.get(unit) for c in cells), suffix)} | {base} | {ratio} | {mooncake} | "
                     f"{vs} |")
    lines += ["", f"Each cell: runs {' / '.join(str(run) for run in runs)}. " + _runs_line(rows)]
    text = _table(lines, rows)

    def plot(path: Path) -> None:
        tcp = [r for r in rows if r.get("ratio_mooncake") is not None]
        series = {mode: ([r["run"] for r in tcp if r["mode"] == mode],
                         [r["ratio_mooncake"] for r in tcp if r["mode"] == mode], color)
                  for mode, color in (("single", "tab:blue"), ("batch", "tab:orange"))}
        _scatter(path, series, (1.5, "bar: 1.5×", "--"), "run", "tidekv / Mooncake", "tcp rows against Mooncake")

    return text, plot


def transfer_mixed(rows: Rows) -> tuple[str, Callable[[Path], None]]:
    """One batch half shm, half tcp, against the sum of its halves run alone, per run."""
    bar = Decimal("0.9")
    lines = ["| date | time (UTC) | commit | runs | (shm + tcp p50) / mixed p50, each run | at or above 0.9 | note |",
             "|---|---|---|---|---|---|---|"]
    for (date, time, commit, note), group in _groups(rows, lambda r: (r["date"], r["time_utc"], r["commit"],
                                                                        r["note"])).items():
        ratios = [r["ratio"] for r in group]
        lines.append(f"| {date} | {time} | {commit} | {len(group)} | {', '.join(_num(v) for v in ratios)} | "
                     f"{sum(v >= bar for v in ratios)} of {len(ratios)} | {note or '—'} |")
    ratios = sorted(r["ratio"] for r in rows)
    half = len(ratios) // 2
    middle = ratios[half] if len(ratios) % 2 else (ratios[half - 1] + ratios[half]) / 2
    lines += ["", f"All runs: {sum(v >= bar for v in ratios)} of {len(ratios)} at or above 0.9, median {_num(middle)} "
              f"({', '.join(sorted({_size(r['size_bytes']) for r in rows}))} requests, "
              f"{'/'.join(str(n) for n in _unique(r['requests_per_half'] for r in rows))} per half)."]
    text = _table(lines, rows)

    def plot(path: Path) -> None:
        _scatter(path, {"mixed batch": ([r["run"] for r in rows], [r["ratio"] for r in rows], "tab:blue")},
                 (0.9, "bar: 0.9", "--"), "run", "sum of halves / mixed", "16×1 MiB shm + 16×1 MiB tcp, one batch")

    return text, plot


def weights_gloo(rows: Rows) -> tuple[str, Callable[[Path], None]]:
    """A weight update to N receivers against gloo's broadcast, lowest–highest of the runs."""
    lines = ["| receivers | tidekv snapshot | tidekv in-place | gloo | gloo / snapshot | gloo / in-place |",
             "|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: r["receivers"]):
        lines.append(f"| {r['receivers']} | {_span(r['tidekv_s_snapshot'])} s | {_span(r['tidekv_s_in_place'])} s | "
                     f"{_span(r['gloo_s'])} s | {_span(r['speedup_snapshot'])}× | {_span(r['speedup_in_place'])}× |")
    first = rows[0]
    lines += ["", f"Each cell: lowest–highest of {first['runs']} runs on {first['date']} ({first['conditions']}; "
              f"commit {first['commit'] or '—'}), {first['bytes'] >> 20} MiB in {first['tensors']} tensors."]
    text = _table(lines, rows)

    def plot(path: Path) -> None:
        series = {mode: ([r["receivers"] for r in rows for _ in (0, 1)],
                         [v for r in rows for v in r[f"speedup_{key}"]], color)
                  for mode, key, color in (("snapshot", "snapshot", "tab:blue"),
                                           ("in-place", "in_place", "tab:orange"))}
        _scatter(path, series, (2.0, "bar: 2×", "--"), "receivers", "gloo / tidekv",
                 "A weight update against gloo (lowest and highest run)")

    return text, plot


def mooncake_sglang(rows: Rows) -> tuple[str, Callable[[Path], None]]:
    """SGLang's mooncake backend on Mooncake's wheel, on the drop-in (shim) and tidekv's own backend."""
    lines = ["| run | date, time (UTC), commit | pool | Mooncake set / get GB/s | shim | tidekv backend | "
             "shim / Mooncake | tidekv / shim |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        pool = "in the SGLang process" if r["pool"] == "same" else "in another process"
        change = f" ({r['change']})" if r.get("change") else ""
        lines.append(
            f"| {r['run']} | {_when(r)}{change} | {pool} | "
            f"{_slash((r['mooncake_set_gbps'], r['mooncake_get_gbps']))} | "
            f"{_slash((r['shim_set_gbps'], r['shim_get_gbps']))} | "
            f"{_slash((r['tidekv_set_gbps'], r['tidekv_get_gbps']))} | "
            f"{_slash((r['shim_vs_mooncake_set'], r['shim_vs_mooncake_get']), '×')} | "
            f"{_slash((r['tidekv_vs_shim_set'], r['tidekv_vs_shim_get']), '×')} |")

    def held(pool: str | None, key: str, bar: Decimal) -> str:
        values = [r[f"{key}_{op}"] for r in rows if pool in (None, r["pool"]) for op in ("set", "get")]
        return f"{sum(v >= bar for v in values)} of {len(values)}"

    lines += ["", "Bars, set and get of every run counted: shim ≥ 1.2× Mooncake with the pool in the SGLang process, "
              f"{held('same', 'shim_vs_mooncake', Decimal('1.2'))}; shim ≥ 3× Mooncake with the pool in another "
              f"process, {held('other', 'shim_vs_mooncake', Decimal(3))}; tidekv's backend ≥ the shim, "
              f"{held(None, 'tidekv_vs_shim', Decimal(1))}. GB/s: 10^9 page bytes per second, best round; every run "
              "quiet, holding the benchmarks' lock."]
    text = _table(lines, rows)

    def plot(path: Path) -> None:
        same = [r for r in rows if r["pool"] == "same"]
        series = {op: ([r["run"] for r in same], [r[f"shim_vs_mooncake_{op}"] for r in same], color)
                  for op, color in (("set", "tab:blue"), ("get", "tab:orange"))}
        _scatter(path, series, (1.2, "bar: 1.2×", "--"), "run", "shim / Mooncake",
                 "SGLang's mooncake backend, pool in its process")

    return text, plot


def mooncake_store_api(rows: Rows) -> tuple[str, None]:
    """Mooncake's store API on the drop-in against Mooncake's wheel, per source of the bytes."""
    lines = ["| copy | source | put, drop-in / Mooncake | (median) | get | (median) | when |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        copy = "streaming (default)" if r["copy"] == "streaming" else "memcpy (`TIDEKV_STREAM_COPY_BYTES=0`)"
        when = f"{r['date']} {r['time_utc']} UTC" if r["time_utc"] else f"{r['date']}, {r['note']}"
        lines.append(f"| {copy} | {r['source']} | {_num(r['put_vs_mooncake'])}× | "
                     f"{_num(r['put_vs_mooncake_median'])} | {_num(r['get_vs_mooncake'])}× | "
                     f"{_num(r['get_vs_mooncake_median'])} | {when}, commit {r['commit'] or '—'} |")
    return _table(lines, rows), None


def mooncake_batch_keys(rows: Rows) -> tuple[str, None]:
    """A page as one object of two parts against two objects (SGLang's ``_k`` / ``_v``), per run."""
    lines = ["| pool | run | put: one object / two, median | best | get, median | best |", "|---|---|---|---|---|---|"]
    for r in rows:
        pool = "in the measuring process" if r["layout"] == "same" else "in another process"
        lines.append(f"| {pool} | {r['run']} | {_num(r['put_one_vs_two_median'])}× | "
                     f"{_num(r['put_one_vs_two_best'])} | {_num(r['get_one_vs_two_median'])}× | "
                     f"{_num(r['get_one_vs_two_best'])} |")
    lines += ["", _runs_line(rows)]
    return _table(lines, rows), None


def vllm_pd(rows: Rows) -> tuple[str, Callable[[Path], None]]:
    """The PD hand-off on real vLLM against ExampleConnector, per mode: lowest–highest of its runs, and
    the speedup of every run."""
    lines = ["| mode | runs | date | TTFT pulled / ExampleConnector / recompute | hand-off in the connectors: tidekv "
             "(export + pull) vs ExampleConnector (write + read) | speedup, each run | end to end | speedup |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ttft = ("—" if r.get("ttft_ms_pulled") is None else
                f"{_span(r['ttft_ms_pulled'])} / {_span(r['ttft_ms_example'])} / {_span(r['ttft_ms_recompute'])} ms")
        handoff = ("—" if r.get("handoff_ms") is None else
                   f"{_span(r['handoff_ms'])} ms ({_span(r['export_ms'])} + {_span(r['pull_ms'])}) vs "
                   f"{_span(r['example_handoff_ms'])} ms ({_span(r['example_write_ms'])} + "
                   f"{_span(r['example_read_ms'])})")
        speedups = r["speedups"]
        speedup = f"{_num(min(speedups))}–{_num(max(speedups))}× ({', '.join(_num(v) for v in speedups)})"
        e2e = ("—" if r.get("end_to_end_ms") is None else
               f"{_span(r['end_to_end_ms'])} vs {_span(r['example_end_to_end_ms'])} ms")
        if r.get("end_to_end_speedups"):
            e2e_speedup = ", ".join(f"{_num(v)}×" for v in r["end_to_end_speedups"])
        elif r.get("end_to_end_speedup"):
            e2e_speedup = f"{_span(r['end_to_end_speedup'])}×"
        else:
            e2e_speedup = "—"
        mode = "default (warm)" if r["mode"] == "default" else f"`{r['mode']}`" if r["mode"] == "--idle" else r["mode"]
        lines.append(f"| {mode} | {r['runs']} | {r['date'] or '—'} | {ttft} | {handoff} | **{speedup}** | {e2e} | "
                     f"{e2e_speedup} |")
    lines += ["", "TTFTs and hand-off times: lowest–highest over the mode's runs (TTFT the best of each run's samples, "
              "connector times the median)."]
    text = _table(lines, rows)

    def plot(path: Path) -> None:
        colors = ("tab:blue", "tab:orange", "tab:green")
        series = {(r["mode"] if len(r["mode"]) < 20 else "--idle, earlier"): (list(range(1, len(r["speedups"]) + 1)),
                                                                              r["speedups"], color)
                  for r, color in zip(rows, colors)}
        _scatter(path, series, (5.0, "bar: 5×", "--"), "run", "ExampleConnector / tidekv",
                 "The PD hand-off inside the connectors")

    return text, plot


def vllm_serve(rows: Rows) -> tuple[str, None]:
    """Every column of the online-serving benchmark, per run."""
    lines = ["| run | column | TTFT p50 / p90 / p99 (ms) | TPOT p50 / p99 (ms) | goodput (req/s) | "
             "prompt tokens loaded / request |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['run']} | {r['column']} | "
                     f"{_slash((r['ttft_ms_p50'], r['ttft_ms_p90'], r['ttft_ms_p99']))} | "
                     f"{_slash((r['tpot_ms_p50'], r['tpot_ms_p99']))} | {_num(r['goodput'])} | "
                     f"{_num(r['tokens_loaded_per_request'], ',')} |")
    lines += ["", _runs_line(rows)]
    return _table(lines, rows), None


def vllm_serve_ratios(rows: Rows) -> tuple[str, Callable[[Path], None]]:
    """The ratios of TTFT p50 the online-serving bars are about, per run."""
    runs = [r["run"] for r in rows]
    lines = ["| ratio (TTFT p50) | " + " | ".join(f"run {run}" for run in runs) + " | bar |",
             "|---|" + "---|" * len(runs) + "---|"]

    def store_ref(r: dict[str, Any]) -> str:
        value = _num(r["store_vs_reference"])
        return value if r["store_reference"] == "one-cold" or r["store_vs_reference"] is None else \
            f"{value} (vs `{r['store_reference']}`)"

    def proxy(r: dict[str, Any]) -> str:
        if r["proxy_added_ttft_ms"] is None:
            return "—"
        return f"+{_num(r['proxy_added_ttft_ms'])} / +{_num(r['proxy_added_end_ms'])} ms"

    for label, cell, bar in (("pd / one", lambda r: _num(r["pd_vs_one"]), "≤ 2"),
                             ("pd-mp / one (the old advice)", lambda r: _num(r["pd_mp_vs_one"]), "—"),
                             ("store / one-cold (reuse vs computing)", store_ref, "< 1"),
                             ("store / lmcache", lambda r: _num(r["store_vs_lmcache"]), "≤ 0.8"),
                             ("proxy alone: added TTFT / to the end", proxy, "≤ 2 ms")):
        lines.append(f"| {label} | " + " | ".join(cell(r) for r in rows) + f" | {bar} |")
    lines += ["", _runs_line(rows)]
    text = _table(lines, rows)

    def plot(path: Path) -> None:
        series = {"store / lmcache": (runs, [r["store_vs_lmcache"] for r in rows], "tab:blue")}
        _scatter(path, series, (0.8, "bar: 0.8", "--"), "run", "TTFT p50, store / lmcache",
                 "Reusing KV from tidekv against LMCache")

    return text, plot


def vllm_cpu_reserve(rows: Rows) -> tuple[str, None]:
    """Store-backed servers with and without a core kept back for the connector, per run."""
    lines = ["| run | date, time (UTC) | reservation | TPOT p50 one-cold / store-save / store (ms) | "
             "TTFT p50 store / one-cold |", "|---|---|---|---|---|"]
    for r in rows:
        p90 = ("" if r["tpot_ms_p90_store_save"] is None else
               f" (p90 {_num(r['tpot_ms_p90_store_save'])}, {_num(r['tpot_ms_p90_store'])})")
        lines.append(f"| {r['run']} | {r['date']} {r['time_utc']} | {r['reservation']} | "
                     f"{_slash((r['tpot_ms_p50_one_cold'], r['tpot_ms_p50_store_save'], r['tpot_ms_p50_store']))}"
                     f"{p90} | "
                     f"{_slash((r['ttft_ms_p50_store'], r['ttft_ms_p50_one_cold']))} ms "
                     f"({_num(r['ttft_store_vs_one_cold'])}) |")
    lines += ["", f"Commit: {rows[0]['commit'] or '—'}; {rows[0]['conditions']}."]
    return _table(lines, rows), None


def traces_disk_tier(rows: Rows) -> tuple[str, Callable[[Path], None]]:
    """A pool too small for the workload with and without the disk tier behind it, per run and repeat."""
    lines = ["| run | date, time (UTC), commit | promotion | column | repeat | goodput (req/s) | "
             "SLO attainment (both) | TTFT p50 / p90 (ms) | prefill hit rate: own cache / from store |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['run']} | {_when(r)} | {'on' if r['disk_promote'] else 'off'} | {r['column']} | "
                     f"{r['repeat']} | {_num(r['goodput'])} | {_num(r['slo_attainment_pct'])}% | "
                     f"{_slash((r['ttft_ms_p50'], r['ttft_ms_p90']))} | "
                     f"{_slash((r['hit_rate_own'], r['hit_rate_store']))} |")
    lines += ["", f"Failed requests: {sum(r['failed'] for r in rows)} in all. Every run: "
              f"{'; '.join(_unique(r['conditions'] for r in rows))}."]
    text = _table(lines, rows)

    def plot(path: Path) -> None:
        pairs = _groups(rows, lambda r: (r["run"], r["repeat"]))
        xs = [f"{run}.{repeat}" for run, repeat in pairs]
        ratios = [next(r["goodput"] for r in group if r["column"] == "small_pool_disk") /
                  next(r["goodput"] for r in group if r["column"] == "small_pool") for group in pairs.values()]
        _scatter(path, {"goodput, disk / small pool alone": (xs, ratios, "tab:blue")}, (1.0, "no gain", ":"),
                 "run.repeat", "goodput ratio", "The disk tier behind a small pool, real vLLM")

    return text, plot


def traces_policies(rows: Rows) -> tuple[str, Callable[[Path], None]]:
    """The proxy's policies replaying the conversation trace on real vLLM, per run, column and repeat."""
    lines = ["| run | date, time (UTC), commit | column | repeat | goodput (req/s) | SLO attainment (both) | "
             "TTFT p50 / p90 (ms) | shed (429) | hit rate own / from store | requests to prefill 0 : 1 | "
             "conductor: TTFT estimated / observed (ms), probes (met SLO) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        shed = " ".join([str(r["shed"])] + [f"+{n} {kind}" for kind, n in r["failures"].items()])
        split = "—" if r["requests_to_prefills"] is None else " : ".join(str(n) for n in r["requests_to_prefills"])
        final = r["conductor_final"]
        conductor = "—" if final is None else (f"{final['estimated_ttft_ms']} / {final['observed_ttft_ms']}, "
                                               f"{final['probes']} ({final['probes_met_slo']})")
        lines.append(f"| {r['run']} | {_when(r)} | {r['column']} | {r['repeat']} | {_num(r['goodput'])} | "
                     f"{_num(r['slo_attainment_pct'])}% | {_slash((r['ttft_ms_p50'], r['ttft_ms_p90']))} | {shed} | "
                     f"{_slash((r['hit_rate_own'], r['hit_rate_store']))} | {split} | {conductor} |")
    conditions = []
    for what, group in _groups(rows, lambda r: r["conditions"]).items():
        repeats = _unique(f"{r['run']} repeat {r['repeat']}" for r in group)
        conditions.append(f"{', '.join(repeats)}: {what}")
    lines += ["", "Conditions: " + "; ".join(conditions) + "."]
    text = _table(lines, rows)

    def plot(path: Path) -> None:
        series = {column: ([f"{r['run']}.{r['repeat']}" for r in rows if r["column"] == column],
                           [r["goodput"] for r in rows if r["column"] == column], color)
                  for column, color in (("round_robin", "tab:blue"), ("store", "tab:orange"),
                                        ("conductor", "tab:green"))}
        _scatter(path, series, (13.2, "offered: 13.2 req/s", ":"), "run.repeat", "goodput (req/s)",
                 "Policies on real vLLM, conversation trace")

    return text, plot


def traces_analyze(rows: Rows) -> tuple[str, Callable[[Path], None]]:
    """``tidekv trace analyze`` on the conversation trace: prefix-cache hit rate per capacity and
    placement, and what the run says about the trace and its own speed."""
    caps = [r for r in rows if "capacity" in r]
    lines = ["| capacity (tokens) | global pool | 8 local caches, round robin | 8 local caches, prefix rule |",
             "|---|---|---|---|"]
    for r in caps:
        glob = f"**{_num(r['hit_rate_global'])}**" if r["bar"] else _num(r["hit_rate_global"])
        lines.append(f"| {r['capacity']} | {glob} | {_num(r['hit_rate_local_round_robin'])} | "
                     f"{_num(r['hit_rate_local_prefix'])} |")
    for s in (r for r in rows if "requests" in r):
        saved = {r["capacity"]: r["saved_prefill_tokens_m"] for r in caps if r["saved_prefill_tokens_m"] is not None}
        lines += ["", f"{s['requests']:,} requests, {_num(s['prompt_tokens_m'])}M prompt tokens; the global pool saves "
                  + ", ".join(f"{_num(v)}M prefill tokens "
                              + ("unbounded" if cap == "unbounded" else f"at {cap} tokens")
                              for cap, v in saved.items())
                  + f". Working set per minute: peak {_num(s['working_set_per_minute_peak_m'])}M, mean "
                  f"{_num(s['working_set_per_minute_mean_m'])}M tokens; all distinct blocks "
                  f"{_num(s['distinct_blocks_tokens_m'])}M tokens; 90% of the unbounded hit rate needs a "
                  f"{_num(s['pool_for_90pct_tokens_m'])}M-token global pool "
                  f"(hit rate {_num(s['pool_for_90pct_hit_rate'])})."
                  f" Throughput: {s['simulated_requests']:,} simulated requests in {_num(s['simulated_s'])} s, "
                  f"{_num(s['requests_per_min_m'])}M requests/min (bar: {s['requests_per_min_bar_m']}M). Bold: the "
                  f"hit-rate bars. " + _runs_line([s])]
    text = _table(lines, rows)

    def plot(path: Path) -> None:
        bounded = [r for r in caps if r["capacity_tokens"]]
        series = {label: ([r["capacity_tokens"] / 1e6 for r in bounded], [r[key] for r in bounded], color)
                  for label, key, color in (("global pool", "hit_rate_global", "tab:blue"),
                                            ("8 local, round robin", "hit_rate_local_round_robin", "tab:orange"),
                                            ("8 local, prefix rule", "hit_rate_local_prefix", "tab:green"))}
        unbounded = next(r["hit_rate_global"] for r in caps if not r["capacity_tokens"])
        _scatter(path, series, (float(unbounded), "unbounded", ":"), "capacity, M tokens", "prefix hit rate",
                 "FAST'25 conversation trace", log2_x=True)

    return text, plot


def sglang_hicache(rows: Rows) -> tuple[str, Callable[[Path], None]]:
    """HiCache L3 storage on tidekv against SGLang's file backend, per run."""
    lines = ["| run | date | tidekv set / get GB/s | file (page cache) set / get GB/s | file (disk) set / get GB/s | "
             "get ratio vs page cache | get ratio vs disk |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['run']} | {r['date']} | {_slash((r['tidekv_set_gbps'], r['tidekv_get_gbps']))} | "
                     f"{_slash((r['file_page_cache_set_gbps'], r['file_page_cache_get_gbps']))} | "
                     f"{_slash((r['file_disk_set_gbps'], r['file_disk_get_gbps']))} | "
                     f"{_num(r['get_vs_page_cache'])}x | {_num(r['get_vs_disk'])}x |")
    lines += ["", f"Commit: {rows[0]['commit'] or '—'}; {rows[0]['conditions']}."]
    text = _table(lines, rows)

    def plot(path: Path) -> None:
        series = {"vs page cache": ([r["run"] for r in rows], [r["get_vs_page_cache"] for r in rows], "tab:blue"),
                  "vs disk": ([r["run"] for r in rows], [r["get_vs_disk"] for r in rows], "tab:orange")}
        _scatter(path, series, (3.0, "bar: 3×", "--"), "run", "tidekv get / file backend get",
                 "HiCache L3 on tidekv against the file backend")

    return text, plot


def trtllm_abi(rows: Rows) -> tuple[str, Callable[[Path], None]]:
    """The C ABI against the Python API for the same transfers, per run: medians and each repetition."""
    lines = ["| run | date, time (UTC) | flags | conditions | READ python / C API (GB/s) | "
             "ratio (median; per repetition) | WRITE python / C API (GB/s) | ratio (median; per repetition) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        flags = r["command"].split("trtllm_abi.py", 1)[1].strip()
        lines.append(f"| {r['run']} | {r['date']} {r['time_utc']} | {f'`{flags}`' if flags else 'defaults'} | "
                     f"{r['conditions']} | {_slash((r['read_gbps_python'], r['read_gbps_c']))} | "
                     f"**{_num(r['read_ratio'])}** ({', '.join(_num(v) for v in r['read_ratios'])}) | "
                     f"{_slash((r['write_gbps_python'], r['write_gbps_c']))} | **{_num(r['write_ratio'])}** "
                     f"({', '.join(_num(v) for v in r['write_ratios'])}) |")
    lines += ["", f"Commit: {rows[0]['commit'] or '—'}. Transport auto (cross-memory attach) unless the flags say tcp."]
    text = _table(lines, rows)

    def plot(path: Path) -> None:
        runs = [r["run"] for r in rows]
        series = {"READ": (runs, [r["read_ratio"] for r in rows], "tab:blue"),
                  "WRITE": (runs, [r["write_ratio"] for r in rows], "tab:orange")}
        _scatter(path, series, (0.9, "bar: 0.9×", "--"), "run", "C API / Python (median)", "The TensorRT-LLM C ABI")

    return text, plot


def gpu_bench(rows: Rows) -> tuple[str, None]:
    """``tidekv bench gpu`` on one GPU: lowest–highest of the runs per row."""
    lines = ["| row | tidekv | baseline | ratio (bar) |", "|---|---|---|---|"]
    for r in rows:
        base = "—" if r["baseline"] is None else f"{r['baseline']} {_span(r['baseline_ms'])} ms"
        ratio = "—" if r["ratio"] is None else (f"{_span(r['ratio'])} (≥ {_num(r['bar'])}: "
                                                f"{r['runs_meeting_bar']} of {r['runs']})")
        lines.append(f"| {r['row']} | {_span(r['ms'])} ms ({_span(r['gbps'])} GB/s) | {base} | {ratio} |")
    first = rows[0]
    lines += ["", f"Each cell: lowest–highest of {first['runs']} runs on {first['date']} ({first['machine']}; commit "
              f"{first['commit'] or '—'})."]
    return _table(lines, rows), None


def store_4k(rows: Rows) -> tuple[str, Callable[[Path], None]]:
    """Single-key 4 KiB get and put (and get_many_into) against Mooncake, holder in another process,
    per run, newest first."""
    lines = ["| date, time (UTC), commit | run | transport | get p50: tidekv / Mooncake | put p50: tidekv / Mooncake | "
             "shim get / put p50 | get_many_into |", "|---|---|---|---|---|---|---|"]

    def cell(r: dict[str, Any] | None) -> str:
        if r is None:
            return "—"
        times = "" if r["p50_us"] is None else f"{_slash((r['p50_us'], r['mooncake_p50_us']))} µs "
        return f"{times}({_num(r['ratio_mooncake'])}×)" if times else f"{_num(r['ratio_mooncake'])}×"

    groups = _groups(rows, lambda r: (r["run"], r["transport"]))
    for (run, transport), group in sorted(groups.items(), key=lambda kv: kv[0][0], reverse=True):
        by_op = {r["op"]: r for r in group}
        first = group[0]
        change = f" ({first['change']})" if first.get("change") else ""
        shim = _slash((by_op[op]["shim_p50_us"] if op in by_op else None for op in ("get", "put")), " µs")
        lines.append(f"| {_when(first)}{change} | {run} | {transport} | {cell(by_op.get('get'))} | "
                     f"{cell(by_op.get('put'))} | {shim} | {cell(by_op.get('get_many_into'))} |")
    lines += ["", "In brackets, tidekv against Mooncake: Mooncake's p50 over tidekv's (> 1: tidekv faster; "
              "get_many_into: the same for its batch). The shim: the Mooncake-API client on tidekv's drop-in. "
              "Every run with nothing else running."]
    text = _table(lines, rows)

    def plot(path: Path) -> None:
        tcp = [r for r in rows if r["transport"] == "tcp" and r["op"] in ("get", "put")]
        series = {op: ([r["run"] for r in tcp if r["op"] == op], [r["ratio_mooncake"] for r in tcp if r["op"] == op],
                       color) for op, color in (("put", "tab:blue"), ("get", "tab:orange"))}
        _scatter(path, series, (2.0, "bar: 2×", "--"), "run", "Mooncake p50 / tidekv p50",
                 "4 KiB, transport forced to tcp")

    return text, plot


def store_auth(rows: Rows) -> tuple[str, Callable[[Path], None]]:
    """p50 of puts and gets with a shared secret (and TLS) against an open master, per run."""
    lines = ["| date, time (UTC), commit | run | setup | put p50 / open | get p50 / open |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {_when(r)} | {r['run']} | {r['setup']} | {_num(r['put_vs_open'])}× | "
                     f"{_num(r['get_vs_open'])}× |")
    lines += ["", f"Every run: {rows[0]['conditions']}."]
    text = _table(lines, rows)

    def plot(path: Path) -> None:
        secret = [r for r in rows if r["setup"] == "secret"]
        series = {op: ([r["run"] for r in secret], [r[f"{op}_vs_open"] for r in secret], color)
                  for op, color in (("put", "tab:blue"), ("get", "tab:orange"))}
        _scatter(path, series, (1.05, "bar: 1.05", "--"), "run", "p50 with a secret / open",
                 "What authentication costs a request")

    return text, plot


def store_segment_alloc(rows: Rows) -> tuple[str, None]:
    """A segment's start-up: the engine's allocate against one thread faulting the memory in."""
    runs = _unique(r["run"] for r in rows)
    lines = ["| kind | size | one thread | engine | ratio |", "|---|---|---|---|---|"]
    for (kind, size), group in _groups(rows, lambda r: (r["kind"], r["size"])).items():
        by_run = {r["run"]: r for r in group}
        cells = [by_run.get(run, {}) for run in runs]
        lines.append(f"| {kind} | {size} | {_slash((c.get('one_thread_s') for c in cells), ' s')} | "
                     f"{_slash((c.get('engine_s') for c in cells), ' s')} | "
                     f"{_slash((c.get('ratio') for c in cells), '×')} |")
    lines += ["", f"Each cell: runs {' / '.join(str(run) for run in runs)}, medians of 5. " + _runs_line(rows)]
    return _table(lines, rows), None


def placement(rows: Rows) -> tuple[str, None]:
    """A put's master time as holders grow in number (``benchmarks.placement``), per run."""
    runs = _unique(r["run"] for r in rows)
    lines = ["| segments | PutStart+PutEnd µs/key | allocate µs |", "|---|---|---|"]
    for segments, group in _groups(rows, lambda r: r["segments"]).items():
        by_run = {r["run"]: r for r in group}
        cells = [by_run.get(run, {}) for run in runs]
        lines.append(f"| {segments:,} | {_slash((c.get('put_us_per_key') for c in cells), spec='.1f')} | "
                     f"{_slash((c.get('allocate_us') for c in cells), spec='.1f')} |")
    lines += ["", f"Each cell: runs {' / '.join(str(run) for run in runs)}. " + _runs_line(rows)]
    return _table(lines, rows), None


def fork_writes(rows: Rows) -> tuple[str, None]:
    """Writes into memory while a forked child lives (``benchmarks.fork_writes``), per run."""
    runs = _unique(r["run"] for r in rows)
    lines = ["| memory | alone | child alive | ratio |", "|---|---|---|---|"]
    for memory, group in _groups(rows, lambda r: r["memory"]).items():
        by_run = {r["run"]: r for r in group}
        cells = [by_run.get(run, {}) for run in runs]
        lines.append(f"| `{memory}` | {_slash((c.get('alone_s') for c in cells), ' s', '.3f')} | "
                     f"{_slash((c.get('child_alive_s') for c in cells), ' s', '.3f')} | "
                     f"{_slash((c.get('ratio') for c in cells), '×', '.1f')} |")
    size = _size(rows[0]["bytes"]) if rows else "—"
    lines += ["", f"memset of {size} each. Each cell: runs {' / '.join(str(run) for run in runs)}. "
              + _runs_line(rows)]
    return _table(lines, rows), None


# The master: its scaling bench's rows and its load mode against Mooncake's master


_MASTER_METRICS = ("get ops/s", "put ops/s", "Exists us/key", "Get us/key", "PutStart+PutEnd us/key",
                   "put ops/s, full pool", "standby: snapshot applied", "promotion:", "restart from --state-dir: log",
                   "restart from --state-dir: snapshot", "floor: one dict", "fold:", "standby: longest put applied",
                   "bytes/object",
                   "longest put ms, collector as it comes", "longest put or tick ms, index frozen",
                   "longest get or tick ms, index frozen")
"""The top-level metrics of ``tidekv bench master`` (by the start of their names) in the order it
writes them; an indented metric ("  p99.9 ...") belongs to the one above it in its run, or to the
one its row's ``under`` names. A metric none of these starts goes last."""
_MB = re.compile(r" \(([\d,.]+ MB)\)")
_MASTER_COLUMNS = 9
"""Runs per table at most: an objects count with more runs gets several tables, oldest first, each
taking whole stretches of consecutive runs that gave the same rows where it can."""


def _run_order(date: str | None, run: Any) -> tuple[str, int, Any]:
    """Sort key of a run: its date, then its number (a row of several runs, ``run`` null, first)."""
    if run is None:
        return (date or "", 0, 0)
    return (date or "", 1, run) if isinstance(run, int) else (date or "", 2, str(run))


def _exact(value: Any, spec: str = "", transcribed: bool = True) -> str:
    """A value of a row: a transcribed one as its page wrote it (a number written with an exponent,
    ``25.1e3``, as "25.1 k"), a measured one formatted by ``spec``; a pair as "lo–hi"; none as "—"."""
    if value is None:
        return "—"
    if isinstance(value, list):
        return "–".join(_exact(v, spec, transcribed) for v in value)
    if not transcribed:
        return format(float(value), spec)
    if isinstance(value, Decimal) and value.as_tuple().exponent > 0:
        return f"{value.scaleb(-3)} k"
    return _num(value)


def _master_key(metric: str, parent: str | None) -> tuple[Any, ...]:
    """Where a metric's row goes in the table: after the bench's metrics before it, an indented one
    right after its parent's."""
    def place(name: str) -> int:
        starts = [i for i, m in enumerate(_MASTER_METRICS) if name.startswith(m)]
        return max(starts, key=lambda i: len(_MASTER_METRICS[i])) if starts else len(_MASTER_METRICS)

    if parent is None:
        return (place(metric), metric, 0, "")
    child = 0 if metric.strip().startswith("p99.9") else 1
    return (place(parent), parent, 1 + child, metric)


def master_scale(rows: Rows) -> tuple[str, Callable[[Path], None]]:
    """``tidekv bench master --objects N``, one column per run (oldest first), its metrics as rows,
    a table per objects count; a run may have every metric of the bench or only some."""
    runs: dict[tuple[Any, ...], Rows] = {}
    for row in rows:
        runs.setdefault((row["date"], row.get("time_utc"), row["commit"], row["command"], row["run"],
                         row.get("variant")), []).append(row)
    ordered = sorted(runs.items(), key=lambda kv: (*_run_order(kv[0][0], kv[0][4]), kv[0][1] or ""))
    cells: dict[tuple[Any, ...], dict[tuple[Any, ...], str]] = {}
    labels: dict[tuple[Any, ...], str] = {}
    notes: dict[str, int] = {}
    for run_key, group in ordered:
        parent = None
        for r in group:
            metric = _MB.sub("", r["metric"])
            if not metric.startswith(" "):
                parent = metric
            under = _MB.sub("", r["under"]) if r.get("under") else parent
            key = _master_key(metric, None if not metric.startswith(" ") else under)
            labels[key] = metric if not metric.startswith(" ") else "&emsp;" + metric.strip()
            exact = bool(r.get("transcribed"))
            at_n = _exact(r["at_n"], ",.6g", exact)
            if r.get("at_1k") is None and r.get("ratio") is None:
                text = at_n
            else:
                at_1k = r.get("at_1k")
                spec = ",.0f" if at_1k is not None and not isinstance(at_1k, list) and at_1k >= 100 else ".3g"
                text = f"{_exact(at_1k, spec, exact)} → {at_n}"
                if r.get("ratio") is not None:
                    text += f" ({_exact(r['ratio'], '.2f', exact)}×)"
            size = _MB.search(r["metric"])
            if size:
                text += f" ({size.group(1)})"
            if r.get("note"):
                text += f"<sup>{notes.setdefault(r['note'], len(notes) + 1)}</sup>"
            cells.setdefault(run_key, {})[key] = text
    lines = ["Cells with an arrow: at 1k objects → at the run's count (at N over at 1k). A run's column shows "
             "the rows its page or its `--json` gave; \"—\": not given. Runs are numbered in date order."]
    by_objects = _groups([(k, g) for k, g in ordered], lambda kv: kv[1][0]["objects"])
    for objects, group in sorted(by_objects.items(), key=lambda kv: -kv[0]):
        stretches: list[list[tuple[tuple[Any, ...], Rows]]] = []  # consecutive runs that gave the same rows
        for item in group:
            if stretches and set(cells[stretches[-1][-1][0]]) == set(cells[item[0]]):
                stretches[-1].append(item)
            else:
                stretches.append([item])
        tables: list[list[tuple[tuple[Any, ...], Rows]]] = []
        for alike_runs in stretches:
            size = -(-len(alike_runs) // -(-len(alike_runs) // _MASTER_COLUMNS))  # a long stretch in even pieces
            for start in range(0, len(alike_runs), size):
                piece = alike_runs[start:start + size]
                if tables and len(tables[-1]) + len(piece) <= _MASTER_COLUMNS:
                    tables[-1] += piece
                else:
                    tables.append(list(piece))
        for number, chunk in enumerate(tables, 1):
            commands = _unique(k[3] for k, _ in chunk)
            names = [f"run {k[4]}" if k[4] is not None else "lowest–highest" for k, _ in chunk]
            keys = {key for k, _ in chunk for key in cells[k]}
            keys |= {_master_key(key[1], None) for key in keys if key[2]}  # an indented row's parent
            for key in keys:
                labels.setdefault(key, key[1])
            lines += ["", f"**{objects:,} objects**" + (f" ({number} of {len(tables)})" if len(tables) > 1 else ""),
                      "", "| metric | " + " | ".join(names) + " |", "|---|" + "---|" * len(chunk)]
            for key in sorted(keys):
                lines.append(f"| {labels[key]} | " + " | ".join(cells[k].get(key, "—") for k, _ in chunk) + " |")
            alike: dict[str, list[str]] = {}
            for (date, time, commit, command, run, variant), group_rows in chunk:
                when = f"{date or 'date not given'}{f' {time} UTC' if time else ''}, commit {commit or '—'}"
                words = f"{when}{f', {variant}' if variant else ''}" + (f", `{command}`" if len(commands) > 1 else "")
                if run is None:
                    words += f", lowest–highest of {group_rows[0].get('runs') or 'its'} runs"
                alike.setdefault(words, []).append(str(run) if run is not None else "lowest–highest")
            lines += ["", "; ".join(f"{'Runs' if len(n) > 1 else 'Run'} {', '.join(n)}: {w}" if n != ["lowest–highest"]
                                    else f"Lowest–highest: {w}" for w, n in alike.items()) + "."]
    if notes:
        lines += ["", " ".join(f"<sup>{i}</sup> {note}." for note, i in notes.items())]
    text = _table(lines, rows)

    def plot(path: Path) -> None:
        points: dict[int, tuple[list[int], list[float]]] = {}
        for r in rows:
            if r["metric"] == "bytes/object" and isinstance(r["run"], int) and isinstance(r["at_n"], (int, Decimal,
                                                                                                      float)):
                xs, ys = points.setdefault(r["objects"], ([], []))
                xs.append(r["run"])
                ys.append(float(r["at_n"]))
        colors = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple")
        series = {f"{objects:,} objects": (xs, ys, colors[i % len(colors)])
                  for i, (objects, (xs, ys)) in enumerate(sorted(points.items(), reverse=True))}
        _scatter(path, series, None, "run", "bytes per object (resident)", "The master's memory per object")

    return text, plot


def master_load(rows: Rows) -> tuple[str, None]:
    """``tidekv bench master --load N --compare mooncake``: one line per run (or per range of runs its
    page gave), tidekv's master against Mooncake's."""
    single = [r for r in rows if r.get("groups", 1) == 1 and r.get("master") in ("shim", "mooncake")]
    lines_of = _groups(single, lambda r: (r["date"], r.get("time_utc"), r["commit"], r["run"],
                                          tuple(r.get("of_runs") or ())))

    def order(key: tuple[Any, ...]) -> tuple[Any, ...]:
        date, time, _, run, of_runs = key
        return (*_run_order(date, run if run is not None else max(of_runs, default=0)), run is None, time or "")

    lines = ["| run | date, time (UTC), commit | master's loop | busy poll | tidekv keys/s | tidekv µs CPU/key | "
             "tidekv CPU share | Mooncake keys/s | Mooncake µs CPU/key | Mooncake CPU share | "
             "tidekv / Mooncake: keys per master CPU s | tidekv / Mooncake: keys/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for key in sorted(lines_of, key=order):
        date, time, commit, run, of_runs = key
        group = lines_of[key]
        mine = next((r for r in group if r["master"] == "shim"), {})
        theirs = next((r for r in group if r["master"] == "mooncake"), {})
        if run is not None:
            label = str(run)
        elif of_runs == tuple(range(of_runs[0], of_runs[-1] + 1)):
            label = f"{of_runs[0]}–{of_runs[-1]}, lowest–highest"
        else:
            label = f"{', '.join(str(n) for n in of_runs)}, lowest–highest"
        busy = mine.get("busy_poll_us")
        if busy is None:
            env = re.search(r"TIDEKV_MASTER_BUSY_POLL_US=(\d+)", mine.get("command", ""))
            busy = "default" if not mine else f"{env.group(1)} µs" if env else "default"
        else:
            busy = " / ".join(str(b) for b in busy) + " µs" if isinstance(busy, list) else f"{busy} µs"

        def cell(r: dict[str, Any], field: str, spec: str, suffix: str = "") -> str:
            value = r.get(field)
            return "—" if value is None else _exact(value, spec, bool(r.get("transcribed"))) + suffix

        lines.append(f"| {label} | {date or '—'}{f' {time}' if time else ''}, {commit or '—'} | "
                     f"{mine.get('loop') or '—'} | {busy} | {cell(mine, 'keys_per_s', ',.0f')} | "
                     f"{cell(mine, 'master_cpu_us_per_key', '.2f')} | {cell(mine, 'master_cpu_share', '.2f')} | "
                     f"{cell(theirs, 'keys_per_s', ',.0f')} | {cell(theirs, 'master_cpu_us_per_key', '.2f')} | "
                     f"{cell(theirs, 'master_cpu_share', '.2f')} | "
                     f"{cell(mine, 'keys_per_cpu_s_vs_mooncake', '.2f', '×')} | "
                     f"{cell(mine, 'keys_per_s_vs_mooncake', '.2f', '×')} |")
    lines += ["", "tidekv: its master under Mooncake's store API on tidekv's drop-in; CPU share: the master "
              "process's CPU seconds per second (1 = a core). A \"lowest–highest\" line: the page gave only the "
              "range over those runs. Ratios > 1: tidekv does more."]
    return _table(lines, rows), None


RENDERERS: dict[str, Callable[[Rows], tuple[str, Callable[[Path], None] | None]]] = {
    "ha-failover": ha_failover,
    "store-disk": store_disk,
    "tensor-channel": tensor_channel,
    "master-load-groups": master_load_groups,
    "store-tensors": store_tensors,
    "transfer-nixl": transfer_nixl,
    "transfer-mooncake": transfer_mooncake,
    "transfer-mixed": transfer_mixed,
    "weights-gloo": weights_gloo,
    "mooncake-sglang": mooncake_sglang,
    "mooncake-store-api": mooncake_store_api,
    "mooncake-batch-keys": mooncake_batch_keys,
    "vllm-pd": vllm_pd,
    "vllm-serve": vllm_serve,
    "vllm-serve-ratios": vllm_serve_ratios,
    "vllm-cpu-reserve": vllm_cpu_reserve,
    "traces-disk-tier": traces_disk_tier,
    "traces-policies": traces_policies,
    "traces-analyze": traces_analyze,
    "sglang-hicache": sglang_hicache,
    "trtllm-abi": trtllm_abi,
    "gpu-bench": gpu_bench,
    "store-4k": store_4k,
    "store-auth": store_auth,
    "store-segment-alloc": store_segment_alloc,
    "placement": placement,
    "fork-writes": fork_writes,
    "master-scale": master_scale,
    "master-load": master_load,
}
TRANSCRIBED = {name for name in RENDERERS if name not in ("ha-failover", "store-disk", "tensor-channel",
                                                          "master-load-groups", "store-tensors", "placement",
                                                          "fork-writes")}
"""Data files transcribed from a page's prose or tables: read with ``Decimal``, printed as written."""


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
        if plot is None:
            continue
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
