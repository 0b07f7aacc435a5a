"""The master's HTTP endpoints: Prometheus text on /metrics, JSON on /health."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request

import pytest

from tests.store.conftest import Connect, SpawnAgent
from tests.store.procs import MasterProcess

_SAMPLE = re.compile(r'^[a-zA-Z_:][a-zA-Z0-9_:]*(\{([a-zA-Z_][a-zA-Z0-9_]*="[^"]*",?)*\})? -?[0-9.e+Inf-]+$')


def _http_get(master: MasterProcess, path: str) -> tuple[int, str, str]:
    url = f"http://127.0.0.1:{master.metrics_port}{path}"
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.headers["Content-Type"], resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.headers["Content-Type"], err.read().decode()


def test_metrics_are_prometheus_text(master: MasterProcess, spawn_agent: SpawnAgent, connect: Connect) -> None:
    holder = spawn_agent(master.address, 1 << 20)
    st = connect(master.address)
    st.put("a", b"x" * 100)
    st.put("b", b"y" * 1000)
    st.get("a")
    status, ctype, text = _http_get(master, "/metrics")
    assert status == 200 and ctype.startswith("text/plain; version=")
    lines = text.splitlines()
    assert "# TYPE tidekv_keys gauge" in lines
    values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines if not line.startswith("#")}
    assert values["tidekv_keys"] == 2
    spare = st.stats()["segments"][holder.segment]["spare"]  # st's slot for its next put (protocol.Spare)
    assert values[f'tidekv_segment_used_bytes{{segment="{holder.segment}"}}'] == 128 + 1024 + spare
    assert values[f'tidekv_segment_capacity_bytes{{segment="{holder.segment}"}}'] == 1 << 20
    assert values['tidekv_master_requests_total{type="Get"}'] >= 1
    for line in lines:
        assert line.startswith("# HELP ") or line.startswith("# TYPE ") or _SAMPLE.match(line), line


def test_health_is_json(master: MasterProcess, connect: Connect) -> None:
    st = connect(master.address, segment_size=1 << 20)
    st.put("k", b"v")
    status, ctype, text = _http_get(master, "/health")
    assert status == 200 and ctype == "application/json"
    health = json.loads(text)
    assert health["status"] == "ok" and health["master"] == master.address
    assert health["master_id"] == master.master_id
    assert (health["keys"], health["clients"]) == (1, 1)
    assert health["segments"][st.segment_name]["capacity"] == 1 << 20
    assert "gc" not in health, "a master started inside another program leaves its collector alone"


@pytest.mark.parametrize("path", ["/", "/nope", "/metricsx"])
def test_unknown_paths_are_404(master: MasterProcess, path: str) -> None:
    status, _, text = _http_get(master, path)
    assert status == 404 and "/metrics" in text
