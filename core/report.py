"""Reporting of results: text tables, a progress bar, JSON lines and plots.

A result is a list of rows; a row is a plain ``dict`` of JSON-able values. The caller picks
what to show with ``Column``s (tables) and ``Series`` (plots), so every bench (``bench
transfer``, ``bench store``) and the trace tools (``trace analyze``, ``trace replay``) report
the same way without this module knowing their rows. Neighbours: the benches' ``timing``
produces their numbers; each bench module and ``tidekv.trace.replay_report`` build rows.
"""

from __future__ import annotations

import json
import logging
import math
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from tidekv.config import format_size as format_size  # re-exported: the tables' size columns use it
from tidekv.config import parse_size as config_parse_size
from tidekv.errors import ConfigError
from tqdm import tqdm

logger = logging.getLogger(__name__)

Row = dict[str, Any]

def parse_size(text: str) -> int:
    """Parses a positive byte size: "4096", "4K", "64KiB", "16M", "1G" (binary units;
    ``tidekv.config.parse_size``).

    Raises:
        ConfigError: the text is not a positive size.
    """
    return config_parse_size(text, "size", minimum=1)


@dataclass(frozen=True, slots=True)
class Column:
    """One column of a text table.

    Attributes:
        key: the row key shown; a missing key or None shows as "-".
        header: the column title.
        fmt: a format spec (".2f") or a function of the value.
        align: "<" (left) or ">" (right).
    """

    key: str
    header: str
    fmt: str | Callable[[Any], str] = ""
    align: str = ">"

    def render(self, row: Mapping[str, Any]) -> str:
        value = row.get(self.key)
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return "-"
        if callable(self.fmt):
            return self.fmt(value)
        return format(value, self.fmt)


def format_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[Column], *, title: str | None = None,
                 notes: Sequence[str] = ()) -> str:
    """Renders rows as an aligned text table, with an optional title above and notes below."""
    cells = [[c.render(r) for c in columns] for r in rows]
    widths = [max([len(c.header)] + [len(line[i]) for line in cells]) for i, c in enumerate(columns)]

    def line(values: Sequence[str]) -> str:
        return "  ".join(f"{v:{c.align}{w}}" for v, c, w in zip(values, columns, widths, strict=True)).rstrip()

    out = []
    if title:
        out.append(title)
    out.append(line([c.header for c in columns]))
    out.append("  ".join("-" * w for w in widths))
    out.extend(line(values) for values in cells)
    out.extend(notes)
    return "\n".join(out)


def progress(total: int, description: str, *, enabled: bool = True) -> tqdm[Any]:
    """A progress bar on stderr over ``total`` steps; call ``.update()``, ``.set_postfix_str()``, ``.close()``."""
    return tqdm(total=total, desc=description, unit="step", file=sys.stderr, disable=not enabled,
                dynamic_ncols=True, leave=False)


def write_json_lines(path: str | Path, rows: Iterable[Mapping[str, Any]]) -> None:
    """Writes one JSON object per row, one per line; path "-" means stdout.

    Raises:
        OSError: the file cannot be written.
    """
    if str(path) == "-":
        _dump_rows(sys.stdout, rows)
        sys.stdout.flush()
        return
    with open(path, "w", encoding="utf-8") as f:
        _dump_rows(f, rows)
    logger.info("wrote rows to %s", path)


def _dump_rows(f: IO[str], rows: Iterable[Mapping[str, Any]]) -> None:
    for row in rows:
        f.write(json.dumps(row, sort_keys=False) + "\n")


@dataclass(frozen=True, slots=True)
class Series:
    """One line of a plot: the rows matching ``where``, ``y`` against the plot's x key.

    Points with the same x are drawn once (a baseline repeated on several rows).
    """

    label: str
    y: str
    where: Mapping[str, Any] = field(default_factory=dict)
    style: str = "o-"


def require_matplotlib() -> None:
    """Checks that ``plot_rows`` can work, so a bench fails before its run rather than after.

    Raises:
        ConfigError: matplotlib is not installed; the message says how to install it.
    """
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError(
            "--plot needs matplotlib, which is not installed; run `pip install matplotlib` (tidekv's plot extra)"
        ) from None


def plot_rows(path: str | Path, rows: Sequence[Mapping[str, Any]], *, x: str, series: Sequence[Series],
              panel_by: Sequence[str] = (), title: str = "", x_label: str = "", y_label: str = "",
              log_x: bool = True, log_y: bool = True, x_format: Callable[[Any], str] | None = None) -> None:
    """Draws one panel per distinct value of ``panel_by`` keys, each with every ``series``; saves a PNG.

    Raises:
        ConfigError: matplotlib is not installed (install the ``plot`` extra).
        OSError: the file cannot be written.
    """
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels: list[tuple[Any, ...]] = []
    for r in rows:
        key = tuple(r.get(k) for k in panel_by)
        if key not in panels:
            panels.append(key)
    ncols = min(2, len(panels)) or 1
    nrows = max(1, math.ceil(len(panels) / ncols))
    fig, axes = plt.subplots(nrows, ncols, figsize=(6.5 * ncols, 4.2 * nrows), squeeze=False)
    for ax, key in zip(axes.flat, panels, strict=False):  # the grid may have a spare cell
        in_panel = [r for r in rows if tuple(r.get(k) for k in panel_by) == key]
        for s in series:
            points: dict[Any, float] = {}
            for r in in_panel:
                if all(r.get(k) == v for k, v in s.where.items()) and r.get(s.y) is not None and r.get(x) is not None:
                    points.setdefault(r[x], float(r[s.y]))
            if points:
                xs = sorted(points)
                ax.plot(xs, [points[v] for v in xs], s.style, label=s.label)
        ax.set_title(" ".join(str(v) for v in key))
        if log_x:
            ax.set_xscale("log", base=2)
        if log_y:
            ax.set_yscale("log")
        xs_all = sorted({r[x] for r in in_panel if r.get(x) is not None})
        if x_format is not None and xs_all:
            ax.set_xticks(xs_all, [x_format(v) for v in xs_all])
        ax.set_xlabel(x_label or x)
        ax.set_ylabel(y_label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    logger.info("wrote plot to %s", path)
