"""Plain in-process metrics: counters, gauges and histograms, rendered as Prometheus text.

No server dependency: an exporter (the master's HTTP endpoint) calls ``render()``. Not
thread-safe beyond the GIL's atomicity of single integer updates, which is all they need.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable

LATENCY_BUCKETS_S = (50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 100e-3, 1.0)


class Counter:
    __slots__ = ("name", "help", "values")

    def __init__(self, name: str, help: str) -> None:
        self.name, self.help = name, help
        self.values: dict[tuple[tuple[str, str], ...], float] = {}

    def inc(self, amount: float = 1, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        self.values[key] = self.values.get(key, 0) + amount

    def get(self, **labels: str) -> float:
        return self.values.get(tuple(sorted(labels.items())), 0)

    def render(self) -> Iterable[str]:
        yield f"# HELP {self.name} {self.help}"
        yield f"# TYPE {self.name} counter"
        for key, value in sorted(self.values.items()) or [((), 0)]:
            yield f"{self.name}{_labels(key)} {_num(value)}"


class Gauge:
    """A value read from a callback at render time (``fn`` returns {labels-tuple: value}).

    ``kind="counter"`` exports a callback-read monotonic total as a Prometheus counter.
    """

    __slots__ = ("name", "help", "fn", "kind")

    def __init__(self, name: str, help: str, fn: Callable[[], dict[tuple[tuple[str, str], ...], float]],
                 kind: str = "gauge") -> None:
        self.name, self.help, self.fn, self.kind = name, help, fn, kind

    def render(self) -> Iterable[str]:
        yield f"# HELP {self.name} {self.help}"
        yield f"# TYPE {self.name} {self.kind}"
        for key, value in sorted(self.fn().items()):
            yield f"{self.name}{_labels(key)} {_num(value)}"


class Histogram:
    __slots__ = ("name", "help", "buckets", "series")

    def __init__(self, name: str, help: str, buckets: tuple[float, ...] = LATENCY_BUCKETS_S) -> None:
        self.name, self.help, self.buckets = name, help, buckets
        self.series: dict[tuple[tuple[str, str], ...], list[float]] = {}  # counts..., sum, count

    def observe(self, value: float, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        s = self.series.get(key)
        if s is None:
            s = self.series[key] = [0.0] * (len(self.buckets) + 2)
        i = bisect.bisect_left(self.buckets, value)
        if i < len(self.buckets):
            s[i] += 1
        s[-2] += value
        s[-1] += 1

    def render(self) -> Iterable[str]:
        yield f"# HELP {self.name} {self.help}"
        yield f"# TYPE {self.name} histogram"
        for key, s in sorted(self.series.items()):
            cumulative = 0.0
            for bound, count in zip(self.buckets, s):
                cumulative += count
                yield f"{self.name}_bucket{_labels(key + (('le', _num(bound)),))} {_num(cumulative)}"
            yield f"{self.name}_bucket{_labels(key + (('le', '+Inf'),))} {_num(s[-1])}"
            yield f"{self.name}_sum{_labels(key)} {s[-2]!r}"
            yield f"{self.name}_count{_labels(key)} {_num(s[-1])}"


class Registry:
    def __init__(self) -> None:
        self._metrics: list[Counter | Gauge | Histogram] = []

    def counter(self, name: str, help: str) -> Counter:
        return self._add(Counter(name, help))

    def gauge(self, name: str, help: str, fn: Callable[[], dict[tuple[tuple[str, str], ...], float]],
              kind: str = "gauge") -> Gauge:
        return self._add(Gauge(name, help, fn, kind))

    def histogram(self, name: str, help: str, buckets: tuple[float, ...] = LATENCY_BUCKETS_S) -> Histogram:
        return self._add(Histogram(name, help, buckets))

    def render(self) -> str:
        """Prometheus text exposition format 0.0.4."""
        lines: list[str] = []
        for m in self._metrics:
            lines.extend(m.render())
        return "\n".join(lines) + "\n"

    def _add(self, metric):  # type: ignore[no-untyped-def]
        self._metrics.append(metric)
        return metric


def _labels(key: tuple[tuple[str, str], ...]) -> str:
    if not key:
        return ""
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in key)
    return "{" + inner + "}"


def _escape(v: str) -> str:
    return str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _num(v: float) -> str:
    if isinstance(v, float) and math.isinf(v):
        return "+Inf"
    if float(v).is_integer():
        return str(int(v))
    return repr(float(v))
