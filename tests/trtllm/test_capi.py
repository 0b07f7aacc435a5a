"""libtransfer_engine.so, tidekv's Mooncake C API, as TensorRT-LLM's MooncakeTransferAgent uses it.

The C program ``agent_harness.c`` (compiled here with gcc against the built library) replays
the agent's call sequence between two processes on 127.0.0.1 and checks every byte against a
shadow copy; this module starts the processes, once per transport, and prints both programs'
output when one fails. The exported symbols are checked against Mooncake's header, and the
benchmark of the bar (``benchmarks/trtllm_abi.py``) is run small.
"""

from __future__ import annotations

import ctypes
import os
import select
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent

# Every function of Mooncake's mooncake-transfer-engine/include/transfer_engine_c.h, main branch
# of 2026-08-22 (commit 3b5a594): the 24 of Mooncake 0.3.x plus discoverTopology,
# warmupEfaSegment, getNicLoadStats, enableGracefulShutdown and showLinks added since.
MOONCAKE_FUNCTIONS = [
    "createTransferEngine", "discoverTopology", "getLocalIpAndPort", "installTransport", "uninstallTransport",
    "openSegment", "openSegmentNoCache", "closeSegment", "warmupEfaSegment", "removeLocalSegment",
    "destroyTransferEngine", "registerLocalMemory", "unregisterLocalMemory", "registerLocalMemoryBatch",
    "unregisterLocalMemoryBatch", "allocateBatchID", "submitTransfer", "submitTransferWithNotify",
    "getNotifsFromEngine", "freeNotifsMsgBuf", "genNotifyInEngine", "getTransferStatus", "freeBatchID",
    "syncSegmentCache", "getNicLoadStats", "enableGracefulShutdown", "showLinks",
]
# What TensorRT-LLM's agent calls (13-15 by version; ../shared/reference/trtllm-mooncake-agent.md).
AGENT_FUNCTIONS = [
    "createTransferEngine", "destroyTransferEngine", "getLocalIpAndPort", "openSegment", "registerLocalMemory",
    "unregisterLocalMemory", "allocateBatchID", "submitTransfer", "submitTransferWithNotify", "getTransferStatus",
    "freeBatchID", "genNotifyInEngine", "getNotifsFromEngine", "freeNotifsMsgBuf", "syncSegmentCache",
]
TIDEKV_FUNCTIONS = ["tidekv_last_error"]


def _library() -> Path:
    from tidekv_trtllm import LIBRARY_NAME, library_dir

    try:
        return library_dir() / LIBRARY_NAME
    except FileNotFoundError as exc:
        pytest.skip(f"libtransfer_engine.so is not built ({exc})")


@pytest.fixture(scope="module")
def library() -> Path:
    return _library()


@pytest.fixture(scope="module")
def harness(library: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("gcc") is None:
        pytest.skip("gcc is not installed: the C harness cannot be compiled")
    from tidekv_trtllm import header_dir

    exe = tmp_path_factory.mktemp("trtllm") / "agent_harness"
    subprocess.run(["gcc", "-std=c11", "-O2", "-Wall", "-Wextra", "-Werror", f"-I{header_dir()}",
                    str(HERE / "agent_harness.c"), f"-L{library.parent}", "-ltransfer_engine", "-o", str(exe)],
                   check=True, capture_output=True, text=True)
    return exe


def _dynamic_symbols(library: Path) -> dict[str, str]:
    if shutil.which("nm") is None:
        pytest.skip("nm (binutils) is not installed")
    out = subprocess.run(["nm", "-D", "--defined-only", str(library)], check=True, capture_output=True, text=True)
    symbols = {}
    for line in out.stdout.splitlines():
        parts = line.split()
        if len(parts) == 3:
            symbols[parts[2]] = parts[1]
    return symbols


def test_exports_every_function_of_mooncakes_header(library: Path) -> None:
    symbols = _dynamic_symbols(library)
    missing = [f for f in MOONCAKE_FUNCTIONS if symbols.get(f) != "T"]
    assert not missing, f"not exported as functions: {missing}"
    assert set(AGENT_FUNCTIONS) <= set(MOONCAKE_FUNCTIONS)
    # Nothing else leaks: tidekv's engine and the C++ runtime's inline symbols stay local.
    assert sorted(symbols) == sorted(MOONCAKE_FUNCTIONS + TIDEKV_FUNCTIONS)


def test_library_has_mooncakes_soname_and_no_python(library: Path) -> None:
    if shutil.which("readelf") is None:
        pytest.skip("readelf (binutils) is not installed")
    dynamic = subprocess.run(["readelf", "-d", str(library)], check=True, capture_output=True, text=True).stdout
    assert "Library soname: [libtransfer_engine.so]" in dynamic
    assert "libpython" not in dynamic  # loaded into TensorRT-LLM's C++ processes, with or without Python


def test_cli_prints_the_library_directory(library: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "tidekv", "trtllm-lib"], check=True, capture_output=True, text=True)
    assert Path(out.stdout.strip()) == library.parent


class _Target:
    """The harness in target mode: its segment name, buffer and pid once it printed READY.
    ``prefix``: a command it runs under (a rig host's, tests/multihost)."""

    def __init__(self, exe: Path, env: dict[str, str], prefix: Sequence[str] = ()) -> None:
        self.proc = subprocess.Popen([*prefix, str(exe), "target"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     env=env, text=True)
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], 30)
        line = self.proc.stdout.readline() if ready else ""
        if not line.startswith("READY "):
            self.stop()
            raise AssertionError(f"target did not start: {line!r}; stderr: {self.stderr()}")
        _, self.segment, self.addr, self.size = line.split()

    def stderr(self) -> str:
        if self.proc.poll() is None:
            return "(still running)"
        assert self.proc.stderr is not None
        return self.proc.stderr.read()[-8000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)


@pytest.fixture
def env(library: Path) -> Iterator[dict[str, str]]:
    e = dict(os.environ)
    e.pop("MC_FORCE_TCP", None)
    e.pop("TIDEKV_TRANSPORT", None)
    e["LD_LIBRARY_PATH"] = f"{library.parent}:{e.get('LD_LIBRARY_PATH', '')}"  # as TensorRT-LLM finds it
    e["TIDEKV_IO_TIMEOUT_S"] = "5"  # the bound a dead peer's requests fail within
    yield e


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_agent_sequence_between_two_processes(transport: str, harness: Path, env: dict[str, str]) -> None:
    """Batches of 1, 64 and 1,024 READ/WRITE with random sizes and offsets, byte-exact; batch
    notifications after the data (polled and not); sync messages; the local segment; every
    refusal; several submits into one batch id; the peer killed mid-batch -> STATUS_FAILED."""
    if transport == "tcp":
        env["MC_FORCE_TCP"] = "1"  # how TensorRT-LLM's own tests run Mooncake
    target = _Target(harness, env)
    try:
        run = subprocess.run([str(harness), "initiator", target.segment, target.addr, target.size,
                              str(target.proc.pid)], check=False, capture_output=True, text=True, env=env, timeout=240)
        target.proc.wait(timeout=30)  # killed by the initiator in its last step
        report = f"initiator stdout:\n{run.stdout}\ninitiator stderr:\n{run.stderr[-8000:]}\ntarget stderr:\n{target.stderr()}"
        assert run.returncode == 0, report
        assert "PASSED: 0 failure(s)" in run.stdout, report
        for step in ("ok WRITE x1024 (notify=1)", "ok READ x1024", "ok sync messages", "ok refusals",
                     "ok peer killed"):
            assert step in run.stdout, report
        assert target.proc.returncode == -signal.SIGKILL, report
        assert "NIC priority matrix) are not read; fabric's NICs come from TIDEKV_FABRIC_NICS" in run.stderr, report
    finally:
        target.stop()


def test_benchmark_runs_small(library: Path, tmp_path: Path) -> None:
    """The bar's benchmark end to end (2 rounds; the bar itself is judged on a full run, not here)."""
    import json

    if shutil.which("gcc") is None:
        pytest.skip("gcc is not installed: the C harness cannot be compiled")
    out = tmp_path / "bench.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "trtllm_abi.py"), "--rounds", "2", "--reps", "2", "--json",
                          str(out)], check=False, capture_output=True, text=True, timeout=300)
    assert run.returncode in (0, 1), run.stderr
    result = json.loads(out.read_text())
    for op in ("read", "write"):
        assert result[op]["python_gbps"] > 0 and result[op]["capi_gbps"] > 0
        assert result[op]["passed"] == (result[op]["ratio"] >= 0.9)


def test_the_secret_follows_tidekvs_one_setting(library: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """createTransferEngine reads TIDEKV_SECRET / TIDEKV_SECRET_FILE as tidekv.config.secret_from_env
    does: both set, an empty secret or an empty file is refused with a named reason."""
    lib = _c_api(library)
    empty = tmp_path / "empty"
    empty.write_text(" \n")
    good = tmp_path / "secret"
    good.write_text("s3cret\t\n")
    for env, expected in (({"TIDEKV_SECRET": "a", "TIDEKV_SECRET_FILE": str(good)}, "both set"),
                          ({"TIDEKV_SECRET": ""}, "set but empty"),
                          ({"TIDEKV_SECRET_FILE": str(empty)}, "is empty"),
                          ({"TIDEKV_SECRET_FILE": str(good)}, None)):
        for name in ("TIDEKV_SECRET", "TIDEKV_SECRET_FILE"):
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        refusal = _create_or_refusal(lib)
        if expected is None:
            assert refusal is None, refusal
        else:
            assert refusal is not None and expected in refusal, (env, refusal)


@pytest.mark.parametrize(("name", "value", "expected"), [
    ("TIDEKV_SLICE_SIZE_BYTES", "1024", "TIDEKV_SLICE_SIZE_BYTES='1024' is invalid; allowed: an integer in 4096..268435456"),
    ("TIDEKV_HANDSHAKE_TIMEOUT_S", "0.01", "TIDEKV_HANDSHAKE_TIMEOUT_S='0.01' is invalid; allowed: seconds in 0.05..600"),
    ("TIDEKV_ENABLE_CROSS_MEMORY_ATTACH", "maybe", "TIDEKV_ENABLE_CROSS_MEMORY_ATTACH='maybe' is invalid"),
    ("TIDEKV_MAX_CONNECTIONS", "2048", None),
])
def test_every_declared_setting_reaches_the_c_abi(library: Path, monkeypatch: pytest.MonkeyPatch, name: str,
                                                  value: str, expected: str | None) -> None:
    """createTransferEngine reads every TransferConfig variable with its declared range
    (settings.gen.h, generated from tidekv.config), not only the few it once parsed by hand."""
    monkeypatch.setenv(name, value)
    refusal = _create_or_refusal(_c_api(library))
    if expected is None:
        assert refusal is None, refusal
    else:
        assert refusal is not None and expected in refusal, refusal


def test_an_engine_without_a_host_listens_where_other_hosts_reach_it(library: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """With no host given, the engine takes $TIDEKV_HOST, else the default route's interface, as
    tidekv.hostaddr does for a component with no master (it used to take 127.0.0.1, which a peer
    on another host cannot reach); a wildcard is refused, naming where it came from."""
    from tidekv.hostaddr import default_route_source

    lib = _c_api(library)
    lib.getLocalIpAndPort.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]

    def host_of_engine(server: bytes, ip: bytes) -> str:
        engine = lib.createTransferEngine(b"P2PHANDSHAKE", server, ip, 0, 0)
        assert engine, lib.tidekv_last_error()
        try:
            buf = ctypes.create_string_buffer(128)
            assert lib.getLocalIpAndPort(engine, buf, 128) == 0, lib.tidekv_last_error()
            return buf.value.decode().rpartition(":")[0].strip("[]")
        finally:
            lib.destroyTransferEngine(engine)

    monkeypatch.delenv("TIDEKV_HOST", raising=False)
    assert host_of_engine(b"", b"") == (default_route_source() or "127.0.0.1")
    monkeypatch.setenv("TIDEKV_HOST", "127.0.0.1")
    assert host_of_engine(b"", b"") == "127.0.0.1"
    assert host_of_engine(b"127.0.0.1", b"") == "127.0.0.1", "the caller's host wins over $TIDEKV_HOST"
    for server, ip in ((b"0.0.0.0", b""), (b"", b"::")):
        assert not lib.createTransferEngine(b"P2PHANDSHAKE", server, ip, 0, 0)
        assert "is a wildcard" in lib.tidekv_last_error().decode()
    monkeypatch.setenv("TIDEKV_HOST", "0.0.0.0")
    assert not lib.createTransferEngine(b"P2PHANDSHAKE", b"", b"", 0, 0)
    assert "$TIDEKV_HOST='0.0.0.0' is a wildcard" in lib.tidekv_last_error().decode()


def _create_or_refusal(lib: ctypes.CDLL) -> str | None:
    """Creates (and destroys) an engine from the environment; None, or why createTransferEngine refused."""
    engine = lib.createTransferEngine(b"P2PHANDSHAKE", b"127.0.0.1", b"127.0.0.1", 0, 0)
    if not engine:
        return lib.tidekv_last_error().decode()
    lib.destroyTransferEngine(engine)
    return None


class _Request(ctypes.Structure):
    _fields_ = [("opcode", ctypes.c_int), ("source", ctypes.c_void_p), ("target_id", ctypes.c_int32),
                ("target_offset", ctypes.c_uint64), ("length", ctypes.c_uint64)]


class _Status(ctypes.Structure):
    _fields_ = [("status", ctypes.c_int), ("transferred_bytes", ctypes.c_uint64)]


def _c_api(library: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(library))
    lib.createTransferEngine.restype = ctypes.c_void_p
    lib.createTransferEngine.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_uint64,
                                         ctypes.c_int]
    lib.destroyTransferEngine.argtypes = [ctypes.c_void_p]
    lib.openSegment.restype = ctypes.c_int32
    lib.openSegment.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    lib.registerLocalMemory.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p,
                                        ctypes.c_int]
    lib.allocateBatchID.restype = ctypes.c_uint64
    lib.allocateBatchID.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    lib.submitTransfer.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.POINTER(_Request), ctypes.c_size_t]
    lib.getTransferStatus.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t, ctypes.POINTER(_Status)]
    lib.freeBatchID.argtypes = [ctypes.c_void_p, ctypes.c_uint64]
    lib.tidekv_last_error.restype = ctypes.c_char_p
    return lib


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_opening_a_plain_engine_costs_it_no_refused_connection(transport: str, library: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """openSegment of a plain tidekv TransferEngine (no C API endpoint there, as the target of
    benchmarks/trtllm_abi.py) asks what listens there with a descriptor fetch, which every
    engine answers. It used to greet the address as a C API endpoint first and fall back when
    refused: the plain engine's listener refused that greeting (no transport of the endpoint's
    id), counted it as a connection limit and logged "dropped connection ... connection limit
    reached (or no such transport)", once per openSegment."""
    from tidekv import TransferConfig, TransferEngine, TransferOp, TransferRequest
    from tidekv.config import TransportKind

    monkeypatch.setenv("TIDEKV_TRANSPORT", transport)
    lib = _c_api(library)
    size = 1 << 20
    expected = bytes(range(256)) * (size // 256)
    with TransferEngine(config=TransferConfig(transport=TransportKind(transport))) as target:
        remote = target.register(bytearray(expected))
        engine = lib.createTransferEngine(b"P2PHANDSHAKE", b"127.0.0.1", b"127.0.0.1", 0, 0)
        assert engine, lib.tidekv_last_error()
        try:
            local = ctypes.create_string_buffer(size)
            assert lib.registerLocalMemory(engine, ctypes.addressof(local), size, b"cpu", 1) == 0, lib.tidekv_last_error()
            segment = lib.openSegment(engine, target.name.encode())
            assert segment > 0, lib.tidekv_last_error()
            for op in (0, 1):  # READ the pattern, then WRITE it back shifted by one request's length
                half = size // 2
                reqs = (_Request * 2)(_Request(op, ctypes.addressof(local), segment, remote.addr(0) + op * half, half),
                                      _Request(op, ctypes.addressof(local) + half, segment, remote.addr(half) - op * half,
                                               half))
                batch = lib.allocateBatchID(engine, 2)
                assert lib.submitTransfer(engine, batch, reqs, 2) == 0, lib.tidekv_last_error()
                for task in range(2):
                    status = _Status()
                    while True:
                        assert lib.getTransferStatus(engine, batch, task, ctypes.byref(status)) == 0
                        if status.status != 1:  # STATUS_PENDING
                            break
                    assert status.status == 4, (op, task, status.status)  # STATUS_COMPLETED
                assert lib.freeBatchID(engine, batch) == 0
            assert local.raw == expected
            assert bytes(remote.view()) == expected[half:] + expected[:half]
        finally:
            lib.destroyTransferEngine(engine)
        stats = target.stats()
        assert (stats["connections_refused"], stats["connections_limited"]) == (0, 0), stats
        # The same engine is still served by the plain engine's own Python peers.
        with TransferEngine(config=TransferConfig(transport=TransportKind(transport))) as peer:
            buf = peer.register(bytearray(size))
            peer.transfer([TransferRequest(TransferOp.READ, buf.addr(0), size, target.name, remote.addr(0))]).wait(10)
            assert bytes(buf.view()) == expected[half:] + expected[:half]
