"""The rest of the ``mooncake`` package the drop-in serves (``tidekv.compat``): ``MooncakeConfig``,
the async store, the buffer pool, the HTTP metadata server, ``mooncake_client`` (dummy-client
mode) and the modules it does not serve, against real tidekv masters on 127.0.0.1.

Where Mooncake's own module runs without Mooncake's servers (its config, its metadata server, its
async wrapper), the same test body runs against it too: in this venv ``import mooncake`` is
Mooncake's wheel, so a difference in behaviour shows as a failing ``mooncake`` case.
``test_mooncake_shim`` checks that the installed shim serves these modules and commands.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tidekv.bench.ports import free_port
from tidekv.compat import mooncake_client, mooncake_metadata_server
from tidekv.compat.mooncake_async import MooncakeDistributedStoreAsync
from tidekv.compat.mooncake_buffer_pool import BufferPool, RegisteredBufferPool
from tidekv.compat.mooncake_config import MooncakeConfig
from tidekv.compat.mooncake_store import MooncakeDistributedStore
from tidekv.compat.mooncake_unserved import NOT_SERVED, not_served
from tidekv.errors import ConfigError

from tests.store.payload import payload
from tests.store.procs import MasterProcess, wait_until

MIB = 1 << 20
REPO = Path(__file__).resolve().parents[2]
NO_SPACE = -200


def implementation(name: str, compat_module: str, mooncake_module: str) -> Any:
    """tidekv's drop-in module (``tidekv.compat.<compat_module>``) or Mooncake's (``mooncake.<mooncake_module>``)."""
    if name == "mooncake":
        return pytest.importorskip(f"mooncake.{mooncake_module}", reason="Mooncake's wheel is not installed")
    return importlib.import_module(f"tidekv.compat.{compat_module}")


def accepts(port: int) -> bool:
    """Whether something listens on 127.0.0.1:``port``."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


@pytest.fixture
def master(tmp_path: Path) -> Iterator[MasterProcess]:
    process = MasterProcess({"lease_ttl_s": 2.0}, tmp_path / "master.log")
    yield process
    process.stop()


# ---- MooncakeConfig -------------------------------------------------------------------------


@pytest.fixture(params=["tidekv", "mooncake"])
def config_cls(request: pytest.FixtureRequest) -> type:
    cls: type = implementation(request.param, "mooncake_config", "mooncake_config").MooncakeConfig
    return cls


def write_config(tmp_path: Path, values: dict[str, Any]) -> str:
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps(values))
    return str(path)


REQUIRED = {"local_hostname": "node1", "metadata_server": "P2PHANDSHAKE", "master_server_address": "10.0.0.1:50051"}


def test_config_file_with_every_field(config_cls: Any, tmp_path: Path) -> None:
    path = write_config(tmp_path, {**REQUIRED, "global_segment_size": "16MB", "local_buffer_size": 1 << 20,
                                   "protocol": "RDMA", "device_name": "mlx5_0", "enable_ssd_offload": "on",
                                   "ssd_offload_path": "/nvme", "tenant_id": "t1", "enable_client_http_server": 1,
                                   "client_http_port": "9400"})
    config = config_cls.from_file(path)
    assert (config.local_hostname, config.metadata_server, config.master_server_address) == \
        ("node1", "P2PHANDSHAKE", "10.0.0.1:50051")
    assert (config.global_segment_size, config.local_buffer_size) == (16 * MIB, MIB)
    assert (config.protocol, config.device_name) == ("rdma", "mlx5_0")  # lower-cased, as Mooncake's engine matches
    assert (config.enable_ssd_offload, config.ssd_offload_path, config.tenant_id) == (True, "/nvme", "t1")
    assert (config.enable_client_http_server, config.client_http_port) == (True, 9400)


def test_config_file_defaults(config_cls: Any, tmp_path: Path) -> None:
    config = config_cls.from_file(write_config(tmp_path, {**REQUIRED, "tenant_id": None, "ssd_offload_path": None}))
    assert (config.global_segment_size, config.local_buffer_size) == (3355443200, 1 << 30)
    assert (config.protocol, config.device_name, config.enable_ssd_offload, config.ssd_offload_path) == \
        ("tcp", "", False, "")
    assert (config.tenant_id, config.enable_client_http_server, config.client_http_port) == ("default", False, 9300)


@pytest.mark.parametrize("missing", sorted(REQUIRED))
def test_config_file_needs_the_required_fields(config_cls: Any, tmp_path: Path, missing: str) -> None:
    values = {k: v for k, v in REQUIRED.items() if k != missing}
    with pytest.raises(ValueError, match=f"(?i)missing required config field.*{missing}"):
        config_cls.from_file(write_config(tmp_path, values))
    with pytest.raises(ValueError, match=missing):  # present but empty
        config_cls.from_file(write_config(tmp_path, {**values, missing: " "}))


@pytest.mark.parametrize(("text", "size"), [
    ("16MB", 16 * MIB), ("16mb", 16 * MIB), ("16M", 16 * MIB), ("4 GB", 4 << 30), ("1.5g", 3 << 29), ("2k", 2048),
    ("1kb", 1024), ("512", 512), ("512b", 512), ("1t", 1 << 40), (4096, 4096), (0, 0), (3.2e9, 3_200_000_000),
    ("3.2e9", 3_200_000_000),
])
def test_config_sizes(config_cls: Any, tmp_path: Path, text: Any, size: int) -> None:
    config = config_cls.from_file(write_config(tmp_path, {**REQUIRED, "global_segment_size": text}))
    assert config.global_segment_size == size


@pytest.mark.parametrize("text", ["", "lots", "MB", "-1", -5, "1 2MB", "0x10"])
def test_config_sizes_refused(config_cls: Any, tmp_path: Path, text: Any) -> None:
    with pytest.raises(ValueError):
        config_cls.from_file(write_config(tmp_path, {**REQUIRED, "local_buffer_size": text}))


def test_config_size_differences(tmp_path: Path) -> None:
    """What tidekv's size parser reads otherwise than Mooncake's (docs/guides/mooncake.md)."""
    tidekv = implementation("tidekv", "mooncake_config", "mooncake_config").MooncakeConfig
    assert tidekv.from_file(write_config(tmp_path, {**REQUIRED, "global_segment_size": "16MiB"})) \
        .global_segment_size == 16 * MIB
    for value in (True, 2.5):  # Mooncake reads True as 1 and truncates 2.5 to 2
        with pytest.raises(ConfigError, match="global_segment_size"):
            tidekv.from_file(write_config(tmp_path, {**REQUIRED, "global_segment_size": value}))
    assert tidekv("h", "P2PHANDSHAKE", "16MB", 0, "tcp", "", "m:1").global_segment_size == 16 * MIB
    real = pytest.importorskip("mooncake.mooncake_config").MooncakeConfig
    with pytest.raises(ValueError):
        real.from_file(write_config(tmp_path, {**REQUIRED, "global_segment_size": "16MiB"}))
    with pytest.raises(TypeError):
        real("h", "P2PHANDSHAKE", "16MB", 0, "tcp", "", "m:1")


@pytest.mark.parametrize(("text", "value"), [
    ("true", True), ("ON", True), ("enable", True), ("1", True), ("yes", True), (True, True), (1, True),
    ("false", False), ("off", False), ("disable", False), ("0", False), ("", False), (None, False), (0, False),
])
def test_config_booleans(config_cls: Any, tmp_path: Path, text: Any, value: bool) -> None:
    assert config_cls.from_file(write_config(tmp_path, {**REQUIRED, "enable_ssd_offload": text})) \
        .enable_ssd_offload is value


def test_config_refuses_what_is_no_boolean_port_or_protocol(config_cls: Any, tmp_path: Path) -> None:
    for values in ({"enable_client_http_server": "maybe"}, {"client_http_port": "http"}, {"protocol": ""},
                   {"protocol": None}):
        with pytest.raises(ValueError):
            config_cls.from_file(write_config(tmp_path, {**REQUIRED, **values}))


def test_config_from_variables(config_cls: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {"MOONCAKE_MASTER": "10.0.0.2:50051", "MOONCAKE_LOCAL_HOSTNAME": "10.0.0.3",
                        "MOONCAKE_GLOBAL_SEGMENT_SIZE": "32MB", "MOONCAKE_LOCAL_BUFFER_SIZE": "2097152",
                        "MOONCAKE_PROTOCOL": "TCP", "MOONCAKE_DEVICE": "erdma_0", "MOONCAKE_OFFLOAD_ENABLED": "yes",
                        "MOONCAKE_OFFLOAD_FILE_STORAGE_PATH": "/ssd", "MOONCAKE_TENANT_ID": "t2",
                        "MOONCAKE_ENABLE_CLIENT_HTTP_SERVER": "off", "MOONCAKE_CLIENT_HTTP_PORT": "9301"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("MOONCAKE_CONFIG_PATH", raising=False)
    monkeypatch.delenv("MOONCAKE_TE_META_DATA_SERVER", raising=False)
    config = config_cls.load_from_env()
    assert (config.master_server_address, config.local_hostname, config.metadata_server) == \
        ("10.0.0.2:50051", "10.0.0.3", "P2PHANDSHAKE")
    assert (config.global_segment_size, config.local_buffer_size, config.protocol, config.device_name) == \
        (32 * MIB, 2 * MIB, "tcp", "erdma_0")
    assert (config.enable_ssd_offload, config.ssd_offload_path, config.tenant_id) == (True, "/ssd", "t2")
    assert (config.enable_client_http_server, config.client_http_port) == (False, 9301)


def test_config_from_variables_defaults_and_refusals(config_cls: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("MOONCAKE_CONFIG_PATH", "MOONCAKE_MASTER", "MOONCAKE_LOCAL_HOSTNAME", "MOONCAKE_GLOBAL_SEGMENT_SIZE",
                 "MOONCAKE_LOCAL_BUFFER_SIZE", "MOONCAKE_PROTOCOL", "MOONCAKE_DEVICE", "MOONCAKE_TE_META_DATA_SERVER",
                 "MOONCAKE_OFFLOAD_ENABLED", "MOONCAKE_TENANT_ID", "MOONCAKE_CLIENT_HTTP_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="MOONCAKE_CONFIG_PATH"):
        config_cls.load_from_env()
    monkeypatch.setenv("MOONCAKE_MASTER", "127.0.0.1:50051")
    config = config_cls.load_from_env()
    assert (config.local_hostname, config.global_segment_size, config.local_buffer_size, config.protocol) == \
        ("localhost", 3355443200, 1 << 30, "tcp")
    monkeypatch.setenv("MOONCAKE_GLOBAL_SEGMENT_SIZE", "a lot")
    with pytest.raises(ValueError):
        config_cls.load_from_env()


def test_config_path_variable_wins(config_cls: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MOONCAKE_MASTER", "10.9.9.9:1")
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", write_config(tmp_path, {**REQUIRED, "local_buffer_size": "8mb"}))
    config = config_cls.load_from_env()
    assert (config.master_server_address, config.local_buffer_size) == ("10.0.0.1:50051", 8 * MIB)


# ---- the async store ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["tidekv", "mooncake"])
def test_async_wrappers_run_in_a_thread_and_are_kept(name: str) -> None:
    """Mooncake's wrapper semantics, without a store set up (so Mooncake's runs too)."""
    store = implementation(name, "mooncake_async", "async_store").MooncakeDistributedStoreAsync()
    store.probe = lambda x, *, y: (x, y, threading.get_ident())
    x, y, thread = asyncio.run(store.async_probe(1, y=2))
    assert (x, y) == (1, 2) and thread != threading.get_ident()
    assert "async_probe" in vars(store) and store.async_probe is store.async_probe
    with pytest.raises(AttributeError, match="async_nosuch"):
        store.async_nosuch  # noqa: B018
    with pytest.raises(AttributeError, match="nosuch"):
        store.nosuch  # noqa: B018


def test_async_store_against_a_master(master: MasterProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """Set up from ``MooncakeConfig.load_from_env()`` (as LMCache and vLLM do), then awaited."""
    monkeypatch.delenv("MOONCAKE_CONFIG_PATH", raising=False)
    for name, value in {"MOONCAKE_MASTER": master.address, "MOONCAKE_LOCAL_HOSTNAME": "127.0.0.1",
                        "MOONCAKE_GLOBAL_SEGMENT_SIZE": "16MB", "MOONCAKE_LOCAL_BUFFER_SIZE": "4MB"}.items():
        monkeypatch.setenv(name, value)
    config = MooncakeConfig.load_from_env()
    store = MooncakeDistributedStoreAsync()
    assert store.setup(config.local_hostname, config.metadata_server, config.global_segment_size,
                       config.local_buffer_size, config.protocol, config.device_name,
                       config.master_server_address) == 0
    values = [payload(i, 1000 + i) for i in range(8)]

    async def run() -> None:
        codes = await asyncio.gather(*(store.async_put(f"k{i}", v) for i, v in enumerate(values)))
        assert codes == [0] * len(values)
        assert await asyncio.gather(*(store.async_get(f"k{i}") for i in range(len(values)))) == values
        assert await store.async_batch_is_exist(["k0", "nope"]) == [1, 0]
        assert await store.async_get("nope") == b""
        assert await store.async_upsert("k0", b"new") == 0

    try:
        asyncio.run(run())
        assert store.get("k0") == b"new" and store.get_size("k1") == 1001  # the sync methods stay
    finally:
        assert store.close() == 0


# ---- the buffer pool ------------------------------------------------------------------------


@pytest.fixture
def store(master: MasterProcess) -> Iterator[MooncakeDistributedStore]:
    """A store whose local buffer is 4 MiB: the pool's local buffer, and max_bytes 8 MiB by default."""
    store = MooncakeDistributedStore()
    assert store.setup("127.0.0.1", "P2PHANDSHAKE", 32 * MIB, 4 * MIB, "tcp", "", master.address) == 0
    yield store
    store.close()


def test_pool_leases_for_zero_copy_calls(store: MooncakeDistributedStore) -> None:
    data = payload(1, 300_000)
    assert store.put("k", data) == 0
    pool = BufferPool(store)
    with pool.buffer(MIB) as lease:
        n = store.get_into("k", lease.ptr, lease.size)
        view = lease.buffer[:n]
        assert n == len(data) and bytes(view) == data and lease.size == MIB
        del view
    with pool.acquire(1000) as lease:
        lease.buffer[:] = payload(2, 1000)
        assert store.put_from("from-lease", lease.ptr, lease.size) == 0
    assert store.get("from-lease") == payload(2, 1000)
    pool.close()
    assert RegisteredBufferPool is BufferPool


def test_lease_release_waits_for_its_views(store: MooncakeDistributedStore) -> None:
    pool = BufferPool(store)
    lease = pool.acquire(100)
    view = lease.buffer
    part = view[10:20]
    del view
    with pytest.raises(RuntimeError, match="view"):
        lease.release()
    del part
    lease.release()
    lease.release()  # again: nothing
    with pytest.raises(RuntimeError, match="released"):
        lease.ptr  # noqa: B018
    pool.close()


def test_pool_overflows_then_is_exhausted(store: MooncakeDistributedStore) -> None:
    data = payload(3, 3 * MIB)
    assert store.put("big", data) == 0
    pool = BufferPool(store)  # local 4 MiB, max_bytes 8 MiB
    local = pool.acquire(3 * MIB)
    overflow = pool.acquire(3 * MIB)  # no room left in the local buffer: a buffer of its own
    assert abs(overflow.ptr - local.ptr) >= 3 * MIB
    for lease in (local, overflow):
        assert store.get_into("big", lease.ptr, lease.size) == len(data) and bytes(lease.buffer) == data
    with pytest.raises(RuntimeError, match="exhausted"):
        pool.acquire(3 * MIB, block=False)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="exhausted"):
        pool.acquire(3 * MIB, timeout=0.2)
    assert time.monotonic() - started >= 0.2
    with pytest.raises(RuntimeError, match="max_bytes"):
        pool.acquire(9 * MIB)  # more than the pool may ever hold: at once, even when blocking
    overflow_ptr = overflow.ptr
    overflow.release()
    assert store.unregister_buffer(overflow_ptr) == -600  # released overflow is unregistered
    threading.Timer(0.2, local.release).start()
    again = pool.acquire(6 * MIB, timeout=20)  # waits for the release
    assert store.get_into("big", again.ptr, again.size) == len(data)
    again.release()
    pool.close()


def test_pool_bounds_and_lifecycle(store: MooncakeDistributedStore) -> None:
    pool = BufferPool(store, max_bytes=MIB, max_regions=1, prewarm_size=4096, prewarm_count=2)
    lease = pool.acquire(10)
    with pytest.raises(RuntimeError, match="exhausted"):
        pool.acquire(10, block=False)  # max_regions
    with pytest.raises(RuntimeError, match="active"):
        pool.close()
    lease.release()
    with pool.acquire(0) as empty:
        assert empty.size == 0 and len(empty.buffer) == 0
    pool.close()
    pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool.acquire(10)
    for bad in ({"alignment": 3}, {"min_size_class": 0}, {"max_bytes": -1}, {"default_timeout": -1.0}):
        with pytest.raises(ValueError):
            BufferPool(store, **bad)
    with pytest.raises(RuntimeError, match="setup"):
        BufferPool(MooncakeDistributedStore())


def test_a_failing_with_block_keeps_its_error(store: MooncakeDistributedStore) -> None:
    """A view alive at the end of a ``with`` block that raised: the caller's error comes out, and
    the lease goes back to the pool with its last view."""
    pool = BufferPool(store, max_regions=1)
    views = []
    with pytest.raises(KeyError, match="the caller's"):
        with pool.buffer(100) as lease:
            views.append(lease.buffer)
            raise KeyError("the caller's error")
    del lease
    with pytest.raises(RuntimeError, match="exhausted"):
        pool.acquire(10, block=False)  # the view still holds it
    views.clear()
    pool.acquire(10, block=False).release()
    pool.close()


# ---- the HTTP metadata server ---------------------------------------------------------------


def http(method: str, url: str, body: bytes | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=body, method=method)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def serves(base: str) -> bool:
    try:
        return http("GET", f"{base}/metadata?key=probe")[0] == 404
    except OSError:
        return False


def check_metadata_routes(base: str) -> None:
    """Mooncake's routes, statuses and texts."""
    url = f"{base}/metadata?key="
    assert http("GET", url + "k") == (404, b"metadata not found")
    assert http("PUT", url + "k", b'{"a": 1}') == (200, b"metadata updated")
    assert http("GET", url + "k") == (200, b'{"a": 1}')
    assert http("GET", url + "%20k%20") == (200, b'{"a": 1}')  # keys are stripped
    assert http("PUT", url + "k", b"v2") == (200, b"metadata updated")
    assert http("GET", url + "k") == (200, b"v2")
    assert http("PUT", url + "mooncake/rpc_meta/n1", b"a") == (200, b"metadata updated")
    assert http("PUT", url + "mooncake/rpc_meta/n1", b"b") == (400, b"Duplicate rpc_meta key not allowed")
    assert http("DELETE", url + "k") == (200, b"metadata deleted")
    assert http("DELETE", url + "k") == (404, b"metadata not found")
    assert http("GET", f"{base}/metadata") == (400, b"metadata key is required")
    assert http("POST", url + "k", b"x") == (405, b"Method not allowed")
    assert http("GET", f"{base}/other?key=k")[0] == 404


@pytest.mark.parametrize("name", ["tidekv", "mooncake"])
def test_metadata_server_routes(name: str) -> None:
    module = implementation(name, "mooncake_metadata_server", "http_metadata_server")
    port = free_port()
    server = module.KVBootstrapServer(port, "127.0.0.1")
    server.run()
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: serves(base), 20, f"the {name} metadata server")
        assert server.poll() == module.KVPoll.Success
        check_metadata_routes(base)
    finally:
        server.close()
    assert server.poll() == module.KVPoll.Failed


def test_metadata_server_command(tmp_path: Path) -> None:
    assert mooncake_metadata_server.parse_args([]).host == "127.0.0.1"  # Mooncake: 0.0.0.0
    port = free_port()
    with open(tmp_path / "metadata.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "tidekv.compat.mooncake_metadata_server", "--port", str(port),
                                 "--log-level", "DEBUG"], stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: proc.poll() is not None or serves(base), 30, "mooncake_http_metadata_server")
        assert proc.poll() is None, (tmp_path / "metadata.log").read_text()
        assert http("PUT", f"{base}/metadata?key=a", b"1")[0] == 200 and http("GET", f"{base}/metadata?key=a") == \
            (200, b"1")
        # The port is taken now: a second server says so and exits 1.
        second = subprocess.run([sys.executable, "-m", "tidekv.compat.mooncake_metadata_server", f"--port={port}"],
                                capture_output=True, text=True, timeout=60, cwd=REPO, check=False)
        assert second.returncode == 1 and f"cannot listen on 127.0.0.1:{port}" in second.stderr, second.stderr
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0, (tmp_path / "metadata.log").read_text()


# ---- mooncake_client ------------------------------------------------------------------------


def test_client_flags() -> None:
    settings = mooncake_client.client_settings(
        ["--host=10.0.0.1", "--port", "0", "-global_segment_size=1GB", "--local_buffer_size", "16MB",
         "--master_server_address=10.0.0.2:50051", "--protocol=rdma", "--device_names=mlx5_0", "--threads=8",
         "--http_port=9400", "--nostart_offload_rpc_server", "--tenant_id=default", "--noenable_offload",
         "--metadata_server=P2PHANDSHAKE"])
    assert settings == mooncake_client.ClientSettings(
        host="10.0.0.1", port=0, global_segment_size=1 << 30, local_buffer_size=16 * MIB,
        master_server_address="10.0.0.2:50051", protocol="rdma", device_names="mlx5_0", metadata_server="P2PHANDSHAKE")
    defaults = mooncake_client.client_settings([])
    assert (defaults.host, defaults.port, defaults.global_segment_size, defaults.master_server_address) == \
        ("127.0.0.1", 50052, 4 << 30, "127.0.0.1:50051")


@pytest.mark.parametrize(("argv", "needle"), [
    (["--enable_http_server=true"], "--enable_http_server=True is refused"),
    (["--tenant_id=t1"], "--tenant_id='t1' is refused"),
    (["--use_mmap_arena_allocator"], "flag --use_mmap_arena_allocator is not supported"),
    (["--global_segment_size=lots"], "--global_segment_size='lots' is not a size"),
    (["--port=70000"], "--port=70000 is out of range"),
])
def test_client_refusals_name_the_flag(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert mooncake_client.main(argv) == 2
    assert needle in capsys.readouterr().err


def test_client_relays_to_a_lone_master_only() -> None:
    assert mooncake_client.relay_target("10.0.0.2:50051") == ("10.0.0.2", 50051)
    assert mooncake_client.relay_target("etcd://10.0.0.3:2379;10.0.0.4:2379") is None  # the leader moves
    assert mooncake_client.relay_target("g0=10.0.0.2:1;g1=10.0.0.3:1") is None  # a sharded pool


def test_client_help_lists_its_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert mooncake_client.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"--{name}" in out for name in mooncake_client.FLAGS)


def test_client_holds_the_memory_dummy_clients_use(master: MasterProcess, tmp_path: Path) -> None:
    """A dummy client names mooncake_client's --port (as with Mooncake); its objects land in
    mooncake_client's segment, the only memory in the pool."""
    direct = MooncakeDistributedStore()  # attached to the master itself, for a view from outside
    assert direct.setup_dummy(0, MIB, master.address) == 0
    assert direct.put("before", b"x") == NO_SPACE  # no memory in the pool yet
    port = free_port()
    log_path = tmp_path / "client.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "tidekv.compat.mooncake_client", f"--port={port}",
                                 f"--master_server_address={master.address}", "--global_segment_size=16MB",
                                 "--local_buffer_size", "1MB"], stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    dummy = MooncakeDistributedStore()
    try:
        wait_until(lambda: proc.poll() is not None or accepts(port), 30, "mooncake_client to take dummy clients")
        assert proc.poll() is None, log_path.read_text()
        assert dummy.setup_dummy(0, MIB, f"127.0.0.1:{port}") == 0
        data = payload(4, 2 * MIB)
        assert dummy.put("k", data) == 0 and dummy.get("k") == data and direct.get("k") == data
        (replica,) = dummy.get_replica_desc("k")
        holder = replica.get_memory_descriptor().buffer_descriptor.transport_endpoint
        assert holder not in (dummy.get_hostname(), direct.get_hostname())
        assert dummy.close() == 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0, log_path.read_text()
        text = log_path.read_text()
        assert f"dummy clients attach at 127.0.0.1:{port}" in text and "left the pool" in text, text
        wait_until(lambda: direct.is_exist("k") == 0, 20, "the client's objects to leave with its segment")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        dummy.close()
        direct.close()


# ---- modules not served ---------------------------------------------------------------------


@pytest.mark.parametrize("module", sorted(NOT_SERVED))
def test_unserved_modules_say_what_to_use(module: str) -> None:
    error = not_served(module)
    assert isinstance(error, ImportError) and error.name == module
    assert "not provided by tidekv's Mooncake drop-in" in str(error)
    assert "Store.put_tensor" in str(error) and "MooncakeDistributedStore" in str(error)


def test_mooncake_clients_host_is_the_one_peers_can_reach(monkeypatch: pytest.MonkeyPatch) -> None:
    from tidekv.compat.mooncake_client import client_settings

    monkeypatch.delenv("TIDEKV_HOST", raising=False)
    assert client_settings(["--master_server_address=127.0.0.1:50051"]).host == "127.0.0.1"  # every peer on loopback
    monkeypatch.setenv("TIDEKV_HOST", "10.1.2.3")
    assert client_settings(["--master_server_address=10.9.9.9:50051"]).host == "10.1.2.3"
    assert client_settings(["--host=10.4.5.6"]).host == "10.4.5.6"
    with pytest.raises(ConfigError, match="wildcard"):
        client_settings(["--host=0.0.0.0"])
