"""Store fixtures: masters and store clients in child processes, stores in this one.

``spawn_master(**MasterConfig fields)`` starts a master process on port 0 (or a given port);
``spawn_agent(address, segment_size, **StoreConfig fields)`` starts a store client process;
``connect(address, segment_size, **StoreConfig fields)`` opens a Store in the test process.
Everything is closed, stopped or killed at teardown, stores first. A failed test gets every
child's stderr (master and client logs) appended to its report. Neighbours: ``procs`` (the
process driver), ``master_main`` and ``agent_main`` (the children).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.store.cluster_rig import TcpRelay
from tests.store.procs import AgentProcess, ChildProcess, MasterProcess
from tidekv.config import StoreConfig
from tidekv.store import Store
from tidekv.bench.etcd_server import MISSING, EtcdServer, etcd_binary

_CHILDREN = pytest.StashKey[list[ChildProcess]]()
_ETCDS = pytest.StashKey[list[EtcdServer]]()

STORE_DEFAULTS: dict[str, Any] = {"staging_size_bytes": 16 << 20, "heartbeat_interval_s": 0.2, "rpc_timeout_s": 5.0}
"""Client settings for tests: small staging, heartbeats fast enough for second-scale liveness tests."""


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for child in item.stash.get(_CHILDREN, []):
            report.sections.append((f"{child.name} (pid {child.pid}) stderr", child.log_text()))
        for server in item.stash.get(_ETCDS, []):
            report.sections.append((f"etcd {server.url} logs", server.log_text()))


def _children(request: pytest.FixtureRequest) -> list[ChildProcess]:
    if _CHILDREN not in request.node.stash:
        request.node.stash[_CHILDREN] = []
    return request.node.stash[_CHILDREN]


SpawnMaster = Callable[..., MasterProcess]
SpawnAgent = Callable[..., AgentProcess]
Connect = Callable[..., Store]


@pytest.fixture
def spawn_master(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SpawnMaster]:
    """Factory: ``spawn_master(**MasterConfig fields)`` starts a master process (port 0 unless given)."""
    started: list[MasterProcess] = []
    counter = itertools.count()

    def spawn(**config: Any) -> MasterProcess:
        n = next(counter)
        master = MasterProcess(config, tmp_path / f"master-{n}.log", name=f"master-{n}")
        started.append(master)
        _children(request).append(master)
        return master

    yield spawn
    for master in started:
        master.stop()


@pytest.fixture
def master(spawn_master: SpawnMaster) -> MasterProcess:
    """A master process with default settings on port 0."""
    return spawn_master()


@pytest.fixture
def spawn_agent(request: pytest.FixtureRequest, tmp_path: Path, spawn_master: SpawnMaster) -> Iterator[SpawnAgent]:
    """Factory: ``spawn_agent(address, segment_size=0, **StoreConfig fields)`` starts a client process."""
    started: list[AgentProcess] = []
    counter = itertools.count()

    def spawn(address: str, segment_size: int = 0, **store: Any) -> AgentProcess:
        n = next(counter)
        agent = AgentProcess(address, segment_size, {**STORE_DEFAULTS, **store}, tmp_path / f"agent-{n}.log",
                             name=f"agent-{n}")
        started.append(agent)
        _children(request).append(agent)
        return agent

    yield spawn
    for agent in started:
        agent.stop()


@pytest.fixture
def connect(spawn_master: SpawnMaster) -> Iterator[Connect]:
    """Factory: ``connect(address, segment_size=0, **StoreConfig fields)`` opens a Store here."""
    stores: list[Store] = []

    def open_store(address: str, segment_size: int = 0, **store: Any) -> Store:
        st = Store.connect(address, segment_size=segment_size, config=StoreConfig(**{**STORE_DEFAULTS, **store}))
        stores.append(st)
        return st

    yield open_store
    for st in stores:
        st.close()


def _etcd_server(request: pytest.FixtureRequest, work_dir: Path, members: int) -> Iterator[EtcdServer]:
    if etcd_binary() is None:
        pytest.skip(MISSING)
    work_dir.mkdir()
    server = EtcdServer(work_dir, members)
    request.node.stash.setdefault(_ETCDS, []).append(server)
    yield server
    server.stop()


@pytest.fixture
def etcd(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[EtcdServer]:
    """A real etcd of one member on free 127.0.0.1 ports with its own data directory (skips only
    if the binary is missing)."""
    yield from _etcd_server(request, tmp_path / "etcd", 1)


@pytest.fixture
def etcd3(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[EtcdServer]:
    """A real etcd cluster of three members, as ``etcd`` (it survives the loss of any one)."""
    yield from _etcd_server(request, tmp_path / "etcd3", 3)


@pytest.fixture
def relays() -> Iterator[Callable[[str], TcpRelay]]:
    """Factory: ``relays(target)`` forwards a fresh 127.0.0.1 port to ``target`` until cut."""
    made: list[TcpRelay] = []

    def make(target: str) -> TcpRelay:
        relay = TcpRelay(target)
        made.append(relay)
        return relay

    yield make
    for relay in made:
        relay.close()
