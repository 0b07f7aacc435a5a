"""``tidekv bench store``: a --quick run end to end (real master, holder and client processes on
loopback), its JSON rows and plot, the Mooncake comparison where the wheel is installed, cleanup
of every process on Ctrl-C, and ``time_op``'s key hygiene against a pure-Python store.

The runs are smoke tests of the bench, not of performance: they check the rows' schema, that
every number is positive, and that each ratio is the one the table promises.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from tidekv.bench import store_ops
from tidekv.bench.store_ops import KeyMaker, OpKind, StoreOp, time_op
from tidekv.bench.timing import Budget
from tidekv.cli import main

REQUIRED = {"holder", "transport", "op", "size_bytes", "keys", "iterations", "p50_us", "p99_us", "gbps",
            "keys_per_s", "ratio_by"}
POSITIVE = ("size_bytes", "keys", "iterations", "p50_us", "p99_us", "keys_per_s")
MOONCAKE_KEYS = {"mooncake_transport", "mooncake_p50_us", "mooncake_p99_us", "mooncake_gbps", "mooncake_keys_per_s",
                 "ratio_mooncake", "shim_p50_us", "shim_p99_us", "shim_gbps", "shim_keys_per_s", "ratio_shim_mooncake"}
QUICK_BATCH_KEYS = 32
RUN_TIMEOUT_S = 120


def _bench(args: list[str], timeout_s: float = RUN_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tidekv", "--log-level", "WARNING", "bench", "store", *args],
                          capture_output=True, text=True, timeout=timeout_s)


def _read_rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _has_mooncake() -> bool:
    try:
        from tidekv.bench.mooncake_store import check_available

        check_available()
    except Exception:  # noqa: BLE001 - any failure means the comparison cannot run here
        return False
    return True


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path, str]:
    out = tmp_path_factory.mktemp("bench-store")
    args = ["--quick", "--no-progress", "--json", str(out / "rows.jsonl")]
    has_plot = importlib.util.find_spec("matplotlib") is not None
    if has_plot:
        args += ["--plot", str(out / "store.png")]
    started = time.monotonic()
    done = _bench(args)
    assert done.returncode == 0, f"bench failed:\n{done.stdout}\n{done.stderr}"
    assert time.monotonic() - started < 40, "a --quick run must stay under 40 s"
    return _read_rows(out / "rows.jsonl"), out, done.stdout


def _check_positive(row: dict[str, Any], keys: Sequence[str]) -> None:
    for key in keys:
        value = row[key]
        assert isinstance(value, (int, float)) and value > 0 and math.isfinite(value), (key, row)


def test_quick_run_covers_every_row(quick_run: tuple[list[dict[str, Any]], Path, str]) -> None:
    rows, _, _ = quick_run
    shapes = {(r["holder"], r["transport"], r["op"], r["size_bytes"], r["keys"]) for r in rows}
    per_config = {("put", 4096, 1), ("put", 1 << 20, 1), ("get", 4096, 1), ("get", 1 << 20, 1),
                  ("put_many_from", 1 << 20, QUICK_BATCH_KEYS), ("get_many_into", 1 << 20, QUICK_BATCH_KEYS),
                  ("exists", 4096, 1), ("exists_many", 4096, 1000), ("put_tensor", 1 << 20, 1),
                  ("get_tensor", 1 << 20, 1)}
    expected = {(h, t, *shape) for h in ("same", "other") for t in ("shm", "tcp") for shape in per_config}
    assert shapes == expected
    assert len(rows) == len(expected)


def test_quick_rows_schema_and_values(quick_run: tuple[list[dict[str, Any]], Path, str]) -> None:
    rows, _, stdout = quick_run
    assert "holder same" in stdout and "keys/s" in stdout
    for row in rows:
        assert row.keys() >= REQUIRED, row
        assert not row.keys() & MOONCAKE_KEYS, f"Mooncake keys without --compare mooncake: {row}"
        _check_positive(row, POSITIVE)
        assert row["p99_us"] >= row["p50_us"]
        is_exists = row["op"] in ("exists", "exists_many")
        if is_exists:
            assert row["gbps"] is None and row["ratio_by"] == "keys_per_s"
        else:
            _check_positive(row, ("gbps",))
            assert row["ratio_by"] == ("p50" if row["op"] in ("put", "get", "put_tensor", "get_tensor") else "gbps")
            # keys/s and GB/s come from the same calls: one is the other times the object size.
            assert row["gbps"] * 1e9 == pytest.approx(row["keys_per_s"] * row["size_bytes"], rel=1e-6)


def test_quick_plot_is_a_png(quick_run: tuple[list[dict[str, Any]], Path, str]) -> None:
    if importlib.util.find_spec("matplotlib") is None:
        pytest.skip("matplotlib is not installed (pip install matplotlib); --plot was not exercised")
    _, out, _ = quick_run
    assert (out / "store.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_mooncake_without_wheel_says_how_to_install(monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "mooncake.store", None)  # what an uninstalled wheel looks like to import
    assert main(["bench", "store", "--quick", "--compare", "mooncake"]) == 2
    err = capsys.readouterr().err
    assert "pip install mooncake-transfer-engine-non-cuda" in err and "libibverbs1" in err


def test_compare_mooncake_adds_its_numbers_and_bars(tmp_path: Path) -> None:
    if not _has_mooncake():
        pytest.skip("Mooncake wheel mooncake-transfer-engine-non-cuda (or its mooncake_master, or libibverbs1) "
                    "is not installed")
    out = tmp_path / "rows.jsonl"
    done = _bench(["--quick", "--no-progress", "--compare", "mooncake", "--holders", "other",
                   "--ops", "get,get_many_into,exists,get_tensor", "--sizes", "4K", "--json", str(out)])
    assert done.returncode == 0, f"bench failed:\n{done.stdout}\n{done.stderr}"
    assert "performance bars" in done.stdout
    rows = _read_rows(out)
    assert {(r["transport"], r["op"]) for r in rows} == {(t, op) for t in ("shm", "tcp")
                                                         for op in ("get", "get_many_into", "exists", "get_tensor")}
    for row in rows:
        assert row.keys() >= REQUIRED | MOONCAKE_KEYS, row
        assert row["mooncake_transport"] == "tcp"
        _check_positive(row, ("mooncake_p50_us", "mooncake_p99_us", "mooncake_keys_per_s", "ratio_mooncake",
                              "shim_p50_us", "shim_p99_us", "shim_keys_per_s", "ratio_shim_mooncake"))
        if row["ratio_by"] == "p50":
            assert row["ratio_mooncake"] == pytest.approx(row["mooncake_p50_us"] / row["p50_us"])
            assert row["ratio_shim_mooncake"] == pytest.approx(row["mooncake_p50_us"] / row["shim_p50_us"])
        elif row["ratio_by"] == "gbps":
            assert row["ratio_mooncake"] == pytest.approx(row["gbps"] / row["mooncake_gbps"])
            assert row["ratio_shim_mooncake"] == pytest.approx(row["shim_gbps"] / row["mooncake_gbps"])
        else:
            assert row["ratio_mooncake"] == pytest.approx(row["keys_per_s"] / row["mooncake_keys_per_s"])
            assert row["ratio_shim_mooncake"] == pytest.approx(row["shim_keys_per_s"] / row["mooncake_keys_per_s"])
    # The shim is one configuration per holder: the same numbers on the shm and tcp rows.
    by_op = {}
    for row in rows:
        by_op.setdefault(row["op"], set()).add(row["shim_p50_us"])
    assert all(len(values) == 1 for values in by_op.values()), by_op
    assert "shim p50 us" in done.stdout and "shim vs mc" in done.stdout
    bar_lines = [line for line in done.stdout.splitlines() if line.lstrip().startswith(("PASS", "FAIL"))]
    assert len(bar_lines) == 6, done.stdout  # get 4 KiB, get_many_into and exists, each for shm and tcp


def _children(pid: int) -> set[int]:
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.add(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the bench's children through /proc (Linux)")
def test_ctrl_c_stops_every_process_the_bench_started() -> None:
    args = ["--quick", "--no-progress", "--min-time", "5", "--holders", "other"]
    if _has_mooncake():
        args += ["--compare", "mooncake"]
    bench = subprocess.Popen([sys.executable, "-m", "tidekv", "--log-level", "WARNING", "bench", "store", *args],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        # Per tidekv transport a master, holder and client, multiprocessing's resource tracker, and
        # with Mooncake its master, holder and client, and as many for the shim.
        want = 2 * 3 + 1 + 6 * ("--compare" in args)
        deadline = time.monotonic() + 60
        children: set[int] = set()
        while time.monotonic() < deadline and bench.poll() is None:
            children |= _children(bench.pid)
            grandchildren = {g for c in children for g in _children(c)}
            if len(children | grandchildren) >= want:
                break
            time.sleep(0.2)
        assert bench.poll() is None, f"bench ended early:\n{bench.communicate()}"
        assert len(children) >= want, f"the bench started only {sorted(children)} within 60 s"
        time.sleep(1.0)  # into the timed rows
        children |= _children(bench.pid)
        os.killpg(bench.pid, signal.SIGINT)  # what a Ctrl-C at the terminal does
        _, err = bench.communicate(timeout=60)
    finally:
        if bench.poll() is None:
            os.killpg(bench.pid, signal.SIGKILL)
            bench.wait()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(_alive(c) for c in children):
        time.sleep(0.2)
    left = [c for c in children if _alive(c)]
    assert not left, f"processes left running after Ctrl-C: {left}\nbench stderr:\n{err}"
    assert bench.returncode in (1, 130), (bench.returncode, err)


class _DictStore:
    """A pure-Python KVClient: objects in a dict, with the high-water mark of objects held."""

    def __init__(self, buffer_bytes: int) -> None:
        self.objects: dict[str, int] = {}
        self.most_held = 0
        self.buffer_address = 1 << 20  # never dereferenced: spans are only recorded
        self.buffer_bytes = buffer_bytes

    def _add(self, key: str, size: int) -> None:
        assert key not in self.objects, f"key {key} put twice: puts must use fresh keys"
        self.objects[key] = size
        self.most_held = max(self.most_held, len(self.objects))

    def put(self, key: str, value: bytes) -> None:
        self._add(key, len(value))

    def get(self, key: str) -> int:
        return self.objects.get(key, 0)

    def put_many_from(self, keys: Sequence[str], spans: Sequence[tuple[int, int]]) -> None:
        for key, (address, size) in zip(keys, spans):
            assert self.buffer_address <= address and address + size <= self.buffer_address + self.buffer_bytes
            self._add(key, size)

    def get_many_into(self, keys: Sequence[str], spans: Sequence[tuple[int, int]]) -> None:
        assert all(self.objects.get(k) == n for k, (_, n) in zip(keys, spans))

    def exists(self, key: str) -> bool:
        return key in self.objects

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        return [k in self.objects for k in keys]

    def remove_many(self, keys: Sequence[str]) -> None:
        for key in keys:
            del self.objects[key]

    def put_tensor(self, key: str, tensor: object) -> None:
        self._add(key, tensor.numel() * tensor.element_size())

    def get_tensor(self, key: str) -> int:
        return self.objects.get(key, 0)


@pytest.mark.parametrize("op", [StoreOp(OpKind.PUT, 4096), StoreOp(OpKind.PUT, 1 << 20),
                                StoreOp(OpKind.GET, 1 << 20), StoreOp(OpKind.PUT_MANY_FROM, 1 << 20, 8),
                                StoreOp(OpKind.GET_MANY_INTO, 1 << 20, 8), StoreOp(OpKind.EXISTS, 4096),
                                StoreOp(OpKind.EXISTS_MANY, 4096, 100), StoreOp(OpKind.PUT_TENSOR, 1 << 20),
                                StoreOp(OpKind.GET_TENSOR, 1 << 20)], ids=lambda op: op.kind.value)
def test_time_op_leaves_the_store_empty_and_bounded(op: StoreOp, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store_ops, "POOL_CHUNK_BYTES", 16 << 20)
    client = _DictStore(8 << 20)
    samples = time_op(client, op, Budget.fixed(40, warmup_iterations=3), KeyMaker("test"))
    assert len(samples) == 40 and all(s >= 0 for s in samples)
    assert client.objects == {}, "time_op must remove every object it put"
    # Puts are removed every 16 MiB: never more than one chunk (or one call) held at once.
    assert client.most_held * op.size_bytes <= max(16 << 20, op.size_bytes * op.keys, 1000 * op.size_bytes)


def test_time_op_refuses_a_small_buffer() -> None:
    from tidekv.errors import ConfigError

    with pytest.raises(ConfigError, match="registered buffer"):
        time_op(_DictStore(1 << 20), StoreOp(OpKind.PUT_MANY_FROM, 1 << 20, 8), Budget.fixed(1), KeyMaker("t"))
