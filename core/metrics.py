"""tidekv's metrics, exported through prometheus_client: one registry per server (master, proxy).

Each server keeps a ``prometheus_client.CollectorRegistry`` of its own rather than the
process-wide default: one process may run several masters (``tidekv up``, tests), and their
series must not clash. ``render`` is prometheus_client's exposition.

The counters and histograms are updated from the server's one event loop, so an update is a
plain addition: prometheus_client's own metric types take a lock per update, which cost a
quarter of the master's time per single-key get (``tidekv bench master``). They are exported as
prometheus_client metric families at scrape time, as are ``gauge``s, which call a function for
values the server already holds (keys, bytes per segment). Engine plugins do not use this module:
inside an engine, tidekv's metrics go through the engine's own registry (vLLM: ``tidekv_vllm.stats``).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Sequence

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

LATENCY_BUCKETS_S = (50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 100e-3, 1.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST
"""The Content-Type of ``Registry.render()``'s text (Prometheus text exposition)."""

Labels = tuple[tuple[str, str], ...]
"""One series' labels as ((name, value), ...), the key of a gauge function's answer."""


class Registry:
    """A server's metrics. ``counter(...).labels(type="Get").inc()`` and
    ``histogram(...).labels(...).observe(s)``, as with prometheus_client; bind a child once
    (``labels``) where a path counts on every request."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._collectors: list[_Family | _Read] = []

    def counter(self, name: str, help: str, labels: Sequence[str] = ()) -> Counter:
        if not name.endswith("_total"):
            raise ValueError(f"metric {name}: a counter's name ends in _total")
        return self._add(Counter(name, help, tuple(labels)))

    def histogram(self, name: str, help: str, labels: Sequence[str] = (),
                  buckets: Sequence[float] = LATENCY_BUCKETS_S) -> Histogram:
        return self._add(Histogram(name, help, tuple(labels), tuple(buckets)))

    def gauge(self, name: str, help: str, fn: Callable[[], dict[Labels, float]], kind: str = "gauge") -> None:
        """Exports what ``fn()`` returns at each scrape ({labels: value}); ``kind="counter"`` for a
        monotonic total the server counts itself."""
        if kind not in ("gauge", "counter"):
            raise ValueError(f"metric {name}: kind must be 'gauge' or 'counter', not {kind!r}")
        if kind == "counter" and not name.endswith("_total"):
            raise ValueError(f"metric {name}: a counter's name ends in _total")
        self._add(_Read(name, help, fn, CounterMetricFamily if kind == "counter" else GaugeMetricFamily))

    def render(self) -> str:
        return generate_latest(self.registry).decode()

    def catalogue(self) -> list[tuple[str, str, str, tuple[str, ...]]]:
        """Every metric this registry exports: (name, type, help, label names), in registration
        order; a gauge's label names are those of its values now (none while it has none)."""
        out = []
        for collector in self._collectors:
            if isinstance(collector, _Family):
                kind = "histogram" if isinstance(collector, Histogram) else "counter"
                out.append((collector.name, kind, collector.help, collector.labelnames))
            else:
                [family] = collector.collect()
                labels = tuple(next((s.labels for s in family.samples), {}))
                out.append((collector.name, family.type, collector.help, labels))
        return out

    def _add(self, collector):  # type: ignore[no-untyped-def]
        self.registry.register(collector)
        self._collectors.append(collector)
        return collector


class _Family(Collector):
    """Series by label values; a child per series, made on first use."""

    def __init__(self, name: str, help: str, labelnames: tuple[str, ...]) -> None:
        self.name, self.help, self.labelnames = name, help, labelnames
        self._children: dict[tuple[str, ...], _Count | _Observed] = {}
        if not labelnames:
            self._children[()] = self._child()  # exported from the start, at 0

    def labels(self, **values: str) -> _Count | _Observed:
        if len(values) != len(self.labelnames) or not all(n in values for n in self.labelnames):
            raise ValueError(f"metric {self.name} has labels {self.labelnames}, not {tuple(values)}")
        key = tuple(str(values[n]) for n in self.labelnames)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self._child()
        return child

    def _child(self) -> _Count | _Observed:
        raise NotImplementedError

    def describe(self) -> Iterable[Metric]:
        return [self._family()]

    def _family(self) -> Metric:
        raise NotImplementedError


class Counter(_Family):
    def labels(self, **values: str) -> _Count:
        return super().labels(**values)  # type: ignore[return-value]

    def inc(self, amount: float = 1) -> None:
        """Counts a series without labels."""
        self.labels().inc(amount)

    def _child(self) -> _Count:
        return _Count()

    def _family(self) -> Metric:
        return CounterMetricFamily(self.name, self.help, labels=self.labelnames)

    def collect(self) -> Iterable[Metric]:
        family = self._family()
        for key, child in list(self._children.items()):
            family.add_metric(key, child.value)  # type: ignore[union-attr]
        return [family]


class Histogram(_Family):
    def __init__(self, name: str, help: str, labelnames: tuple[str, ...], buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self._bounds = [floatToGoString(b) for b in buckets] + ["+Inf"]
        super().__init__(name, help, labelnames)

    def labels(self, **values: str) -> _Observed:
        return super().labels(**values)  # type: ignore[return-value]

    def _child(self) -> _Observed:
        return _Observed(self.buckets)

    def _family(self) -> Metric:
        return HistogramMetricFamily(self.name, self.help, labels=self.labelnames)

    def collect(self) -> Iterable[Metric]:
        family = self._family()
        for key, child in list(self._children.items()):
            cumulative, buckets = 0, []
            for bound, count in zip(self._bounds, child.counts):  # type: ignore[union-attr]
                cumulative += count
                buckets.append((bound, cumulative))
            family.add_metric(key, buckets, child.sum)  # type: ignore[union-attr]
        return [family]


class _Count:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1) -> None:
        self.value += amount


class _Observed:
    __slots__ = ("buckets", "counts", "sum")

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last: above every bound
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value


class _Read(Collector):
    def __init__(self, name: str, help: str, fn: Callable[[], dict[Labels, float]], family: type[Metric]) -> None:
        self.name, self.help, self.fn, self.family = name, help, fn, family

    def describe(self) -> Iterable[Metric]:
        return [self.family(self.name, self.help)]  # type: ignore[call-arg]

    def collect(self) -> Iterable[Metric]:
        values = self.fn()
        names = [k for k, _ in next(iter(values), ())]
        family = self.family(self.name, self.help, labels=names)  # type: ignore[call-arg]
        for key, value in values.items():
            family.add_metric([v for _, v in key], value)  # type: ignore[attr-defined]
        return [family]
