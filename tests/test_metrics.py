"""tidekv.metrics: one prometheus_client registry per server, and gauges read at scrape time."""

from __future__ import annotations

import pytest
from tidekv.metrics import Registry


def _values(text: str) -> dict[str, float]:
    return {line.rpartition(" ")[0]: float(line.rpartition(" ")[2]) for line in text.splitlines()
            if line and not line.startswith("#")}


def test_counters_histograms_and_read_gauges_render_as_prometheus_text() -> None:
    reg = Registry()
    requests = reg.counter("t_requests_total", "requests", ["type"])
    latency = reg.histogram("t_seconds", "latency", ["type"], buckets=(0.1, 1.0))
    held = {"a": 3}
    reg.gauge("t_held", "held", lambda: {(("segment", k),): v for k, v in held.items()})
    reg.gauge("t_lost_total", "lost", lambda: {(): 7}, kind="counter")
    reg.counter("t_auth_failures_total", "failures")
    requests.labels(type="Get").inc(2)
    latency.labels(type="Get").observe(0.5)
    held["b"] = 4  # read at the scrape, not at registration
    text = reg.render()
    values = _values(text)
    assert values['t_requests_total{type="Get"}'] == 2
    assert values['t_seconds_bucket{le="0.1",type="Get"}'] == 0
    assert values['t_seconds_bucket{le="1.0",type="Get"}'] == 1
    assert values['t_held{segment="a"}'] == 3 and values['t_held{segment="b"}'] == 4
    assert values["t_lost_total"] == 7 and "# TYPE t_lost_total counter" in text
    assert values["t_auth_failures_total"] == 0, "a counter without labels is exported before its first count"
    assert values['t_seconds_bucket{le="+Inf",type="Get"}'] == 1 and values['t_seconds_sum{type="Get"}'] == 0.5


def test_two_servers_in_one_process_keep_their_own_series() -> None:
    one, two = Registry(), Registry()
    one.counter("t_requests_total", "requests").inc()
    two.counter("t_requests_total", "requests")  # the same name: no clash across registries
    assert _values(one.render())["t_requests_total"] == 1 and _values(two.render())["t_requests_total"] == 0


def test_a_name_taken_twice_in_one_registry_or_a_counter_without_total_is_refused() -> None:
    reg = Registry()
    reg.gauge("t_keys", "keys", lambda: {(): 1})
    with pytest.raises(ValueError, match="t_keys"):
        reg.gauge("t_keys", "keys again", lambda: {(): 2})
    with pytest.raises(ValueError, match="ends in _total"):
        reg.gauge("t_lost", "lost", lambda: {(): 1}, kind="counter")
    with pytest.raises(ValueError, match="ends in _total"):
        reg.counter("t_lost", "lost")
    with pytest.raises(ValueError, match=r"has labels \('type',\), not \('kind',\)"):
        reg.counter("t_requests_total", "requests", ["type"]).labels(kind="Get")


def test_catalogue_lists_every_metric_with_its_type_and_labels() -> None:
    reg = Registry()
    reg.counter("t_requests_total", "requests", ["type"])
    reg.histogram("t_seconds", "latency", ["type", "tenant"])
    reg.gauge("t_held", "held", lambda: {(("segment", "a"),): 3})
    reg.gauge("t_lost_total", "lost", lambda: {(): 7}, kind="counter")
    reg.gauge("t_empty", "nothing yet", lambda: {})
    assert reg.catalogue() == [("t_requests_total", "counter", "requests", ("type",)),
                               ("t_seconds", "histogram", "latency", ("type", "tenant")),
                               ("t_held", "gauge", "held", ("segment",)),
                               ("t_lost_total", "counter", "lost", ()),
                               ("t_empty", "gauge", "nothing yet", ())]
