"""tidekv's metrics on prometheus_client, one registry per server (master, proxy).

Each server keeps a ``prometheus_client.CollectorRegistry`` of its own rather than the
process-wide default: one process may run several masters (``tidekv up``, tests), and their
series must not clash. Counters and histograms are prometheus_client's; ``gauge`` registers a
collector that calls a function at scrape time, for values the server already holds (keys,
bytes per segment) and must not copy into a metric on every change.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

LATENCY_BUCKETS_S = (50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 100e-3, 1.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST
"""The Content-Type of ``Registry.render()``'s text (Prometheus text exposition)."""

Labels = tuple[tuple[str, str], ...]
"""One series' labels as ((name, value), ...), the key of a gauge function's answer."""


class Registry:
    """A server's metrics: ``counter`` and ``histogram`` return prometheus_client's own types
    (``.labels(type="Get").inc()``); ``render`` is the text a ``/metrics`` endpoint answers."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()

    def counter(self, name: str, help: str, labels: Sequence[str] = ()) -> Counter:
        return Counter(name, help, labels, registry=self.registry)

    def histogram(self, name: str, help: str, labels: Sequence[str] = (),
                  buckets: Sequence[float] = LATENCY_BUCKETS_S) -> Histogram:
        return Histogram(name, help, labels, registry=self.registry, buckets=buckets)

    def gauge(self, name: str, help: str, fn: Callable[[], dict[Labels, float]], kind: str = "gauge") -> None:
        """Exports what ``fn()`` returns at each scrape ({labels: value}); ``kind="counter"`` for a
        monotonic total the server counts itself."""
        self.registry.register(_Read(name, help, fn, kind))

    def render(self) -> str:
        return generate_latest(self.registry).decode()


class _Read(Collector):
    __slots__ = ("name", "help", "fn", "family")

    def __init__(self, name: str, help: str, fn: Callable[[], dict[Labels, float]], kind: str) -> None:
        if kind not in ("gauge", "counter"):
            raise ValueError(f"metric {name}: kind must be 'gauge' or 'counter', not {kind!r}")
        if kind == "counter" and not name.endswith("_total"):
            raise ValueError(f"metric {name}: a counter's name ends in _total")
        self.name, self.help, self.fn = name, help, fn
        self.family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily

    def describe(self) -> Iterable[Metric]:
        return [self.family(self.name, self.help)]

    def collect(self) -> Iterable[Metric]:
        values = self.fn()
        names = [k for k, _ in next(iter(values), ())]
        family = self.family(self.name, self.help, labels=names)
        for key, value in values.items():
            family.add_metric([v for _, v in key], value)
        return [family]
