"""Mooncake comparison of ``bench store``: the same rows through ``MooncakeDistributedStore``.

Mooncake's own store and tidekv's drop-in are driven alike (``MooncakeApi``), so a row shows what
the same Mooncake-API code gets on each. ``MooncakePool`` starts the master (and a holder process
when the pool is in another process); ``MooncakeStoreDriver`` adds the measuring client, over tcp
with P2PHANDSHAKE, timing ``store_ops.time_op`` rows and checking every int return code. Helpers
of a holder in another process run with ``MC_STORE_MEMCPY=0`` (``memcpy_env``); read leases stay
>= ``MIN_LEASE_TTL_S`` (shorter ones make Mooncake's gets fail). Mooncake logs to stderr, so its
processes log to files that errors quote. Neighbours: ``store`` runs it next to tidekv's rows;
``mooncake_te`` is the transfer-engine comparison and owns the install hint.
Design notes: docs/design-bench.md#tidekvbenchmooncake_store
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from tidekv.bench import mooncake_te
from tidekv.bench.mooncake_te import INSTALL_HINT
from tidekv.bench.ports import free_port
from tidekv.bench.store_ops import KeyMaker, Span, StoreOp, time_op
from tidekv.bench.timing import Budget
from tidekv.errors import ConfigError, TidekvError
from tidekv.helper_process import HelperProcess, send_ready, serve

logger = logging.getLogger(__name__)

MASTER_EXECUTABLE = "mooncake_master"
LOCAL_BUFFER_BYTES = 64 << 20
"""Mooncake's client-side buffer for put/get of bytes objects (local_buffer_size)."""
_HOST = "127.0.0.1"
_MASTER_READY_TIMEOUT_S = 30.0
_CALL_TIMEOUT_S = 600.0
_LOG_TAIL_BYTES = 4000
_PR_SET_PDEATHSIG = 1
MIN_LEASE_TTL_S = 2.0
"""Mooncake's read leases shorter than this fail its gets with -707 (measured on 0.3.13.post1)."""


class MooncakeApi(enum.Enum):
    """Which implementation of Mooncake's store API a driver runs."""

    MOONCAKE = "mooncake"  #: Mooncake's wheel: ``mooncake.store`` and its ``mooncake_master``
    SHIM = "shim"  #: tidekv's drop-in: ``tidekv.compat.mooncake_store`` and ``tidekv.compat.mooncake_master``

    def store_class(self) -> Any:
        """The ``MooncakeDistributedStore`` class of this implementation (imported now)."""
        if self == MooncakeApi.SHIM:
            from tidekv.compat.mooncake_store import MooncakeDistributedStore
        else:
            from mooncake.store import MooncakeDistributedStore
        return MooncakeDistributedStore


def memcpy_env(is_holder_in_client: bool) -> dict[str, str]:
    """The environment a Mooncake client gets in this layout: ``MC_STORE_MEMCPY=0`` when the holder
    is another process (bytes go over tcp), nothing otherwise (Mooncake's default memcpy)."""
    return {} if is_holder_in_client else {"MC_STORE_MEMCPY": "0"}


def master_executable() -> str:
    """Path of ``mooncake_master``: next to this Python (a venv's bin), else on PATH.

    Raises:
        ConfigError: not found; the message says how to install it.
    """
    beside = Path(sys.executable).parent / MASTER_EXECUTABLE
    if beside.is_file():
        return str(beside)
    found = shutil.which(MASTER_EXECUTABLE)
    if found is None:
        raise ConfigError(f"--compare mooncake needs {MASTER_EXECUTABLE}, which is neither next to {sys.executable} "
                          f"nor on PATH; {INSTALL_HINT}")
    return found


def check_available() -> None:
    """Imports Mooncake's ``mooncake.store`` and finds its ``mooncake_master``, to fail before a long run.

    Raises:
        ConfigError: the wheel or a library it needs is missing, or ``mooncake`` here is tidekv's
            drop-in; the message says how to install.
    """
    mooncake_te.check_available("mooncake.store")
    import mooncake

    if getattr(mooncake, "IS_TIDEKV_SHIM", False):
        raise ConfigError(f"--compare mooncake needs Mooncake's own wheel, but `mooncake` here is tidekv's drop-in "
                          f"({mooncake.__file__}); run it from an environment with {mooncake_te.WHEEL} instead")
    master_executable()


def _die_with_parent() -> None:
    # Runs in the child between fork and exec: a SIGKILLed bench must not leave a master behind.
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _master_command(api: MooncakeApi, rpc_port: int, lease_ttl_s: float | None) -> list[str]:
    flags = [f"--rpc_port={rpc_port}", f"--rpc_address={_HOST}", f"--metrics_port={free_port(_HOST)}"]
    if lease_ttl_s is not None:
        flags.append(f"--default_kv_lease_ttl={round(lease_ttl_s * 1000)}")
    if api == MooncakeApi.SHIM:  # its flags are Mooncake's; it refuses the three below, which it has no use for
        return [sys.executable, "-c", "import sys; from tidekv.compat.mooncake_master import main; sys.exit(main())",
                *flags]
    return [master_executable(), *flags, f"--metrics_host={_HOST}", "--enable_http_metadata_server=false",
            "--enable_metric_reporting=false"]


class MooncakeMaster:
    """A ``mooncake_master`` process on free ports of 127.0.0.1 (RPC and metrics HTTP).

    Args:
        log_dir: folder for ``<api>-master.log``.
        api: Mooncake's own master, or the drop-in's (a tidekv master behind Mooncake's flags).
        lease_ttl_s: ``--default_kv_lease_ttl``; None leaves the master's default (10 s).

    Raises:
        ConfigError: the executable is missing, or the lease is under ``MIN_LEASE_TTL_S``.
        TidekvError: it exited or did not listen within 30 s (the message quotes its log).
    """

    def __init__(self, log_dir: str | Path, api: MooncakeApi = MooncakeApi.MOONCAKE,
                 lease_ttl_s: float | None = None) -> None:
        if lease_ttl_s is not None and lease_ttl_s < MIN_LEASE_TTL_S:
            raise ConfigError(f"lease_ttl_s={lease_ttl_s} is under {MIN_LEASE_TTL_S} s; Mooncake's gets then fail "
                              "with -707")
        self.api = api
        self.rpc_port = free_port(_HOST)
        self.log_path = Path(log_dir) / f"{api.value}-master.log"
        command = _master_command(api, self.rpc_port, lease_ttl_s)
        with open(self.log_path, "wb") as log:
            # Its own session: a Ctrl-C at the terminal reaches the bench, which stops it in order.
            self._process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                             start_new_session=True, preexec_fn=_die_with_parent)
        try:
            self._wait_listening()
        except BaseException:
            self.stop()
            raise
        logger.info("%s mooncake_master (pid %s) listening on %s", api.value, self._process.pid, self.address)

    @property
    def address(self) -> str:
        """Where clients connect: "host:port"."""
        return f"{_HOST}:{self.rpc_port}"

    @property
    def pid(self) -> int:
        """The master's process id (its CPU time: ``/proc/<pid>/stat``)."""
        return self._process.pid

    def _wait_listening(self) -> None:
        deadline = time.monotonic() + _MASTER_READY_TIMEOUT_S
        while True:
            if self._process.poll() is not None:
                raise self._failure(f"exited with code {self._process.returncode}")
            with contextlib.suppress(OSError), socket.create_connection((_HOST, self.rpc_port), timeout=0.5):
                return
            if time.monotonic() > deadline:
                raise self._failure(f"did not listen on {self.address} within {_MASTER_READY_TIMEOUT_S:.0f} s")
            time.sleep(0.05)

    def _failure(self, what: str) -> TidekvError:
        try:
            with open(self.log_path, "rb") as f:
                tail = f.read()[-_LOG_TAIL_BYTES:].decode("utf-8", "replace")
        except OSError:
            tail = ""
        return TidekvError(f"{MASTER_EXECUTABLE} (pid {self._process.pid}) {what}\n"
                           f"--- last lines of {self.log_path} ---\n{tail}")

    def stop(self, timeout_s: float = 10.0) -> None:
        """Terminates the master (kills it if it lingers). Idempotent."""
        if self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("mooncake_master (pid %s) ignored SIGTERM; killing it", self._process.pid)
                self._process.kill()
                self._process.wait(timeout_s)


def _setup(api: MooncakeApi, master: str, segment_bytes: int, local_buffer_bytes: int) -> Any:
    store = api.store_class()()
    rc = store.setup(_HOST, "P2PHANDSHAKE", segment_bytes, local_buffer_bytes, "tcp", "", master)
    if rc != 0:
        raise TidekvError(f"MooncakeDistributedStore.setup({_HOST!r}, 'P2PHANDSHAKE', global_segment_size="
                          f"{segment_bytes}, local_buffer_size={local_buffer_bytes}, 'tcp', '', {master!r}) "
                          f"returned {rc}")
    return store


class _MooncakeClient:
    """``store_ops.KVClient`` over a MooncakeDistributedStore; turns its int codes into errors."""

    def __init__(self, store: Any, buffer_bytes: int) -> None:
        self._store = store
        self._buffer = (ctypes.c_char * buffer_bytes)()
        self.buffer_address = ctypes.addressof(self._buffer)
        self.buffer_bytes = buffer_bytes
        ctypes.memset(self.buffer_address, 0x5A, buffer_bytes)  # fault it in now, not in a timed call
        rc = store.register_buffer(self.buffer_address, buffer_bytes)
        if rc != 0:
            raise TidekvError(f"mooncake register_buffer({self.buffer_address:#x}, {buffer_bytes}) returned {rc}")

    def put(self, key: str, value: bytes) -> None:
        rc = self._store.put(key, value)
        if rc != 0:
            raise TidekvError(f"mooncake put({key!r}, {len(value)} bytes) returned {rc}")

    def get(self, key: str) -> int:
        return len(self._store.get(key))  # b"" when missing; time_op checks the size

    def put_many_from(self, keys: Sequence[str], spans: Sequence[Span]) -> None:
        codes = self._store.batch_put_from(list(keys), [a for a, _ in spans], [n for _, n in spans])
        _check(codes, keys, lambda rc, n: rc == 0, "batch_put_from", spans)

    def get_many_into(self, keys: Sequence[str], spans: Sequence[Span]) -> None:
        got = self._store.batch_get_into(list(keys), [a for a, _ in spans], [n for _, n in spans])
        _check(got, keys, lambda rc, n: rc == n, "batch_get_into", spans)

    def exists(self, key: str) -> bool:
        rc = self._store.is_exist(key)
        if rc < 0:
            raise TidekvError(f"mooncake is_exist({key!r}) returned {rc}")
        return bool(rc == 1)

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        codes = self._store.batch_is_exist(list(keys))
        bad = [rc for rc in codes if rc < 0]
        if bad:
            raise TidekvError(f"mooncake batch_is_exist of {len(keys)} keys: {len(bad)} returned errors, "
                              f"first {bad[0]}")
        return [rc == 1 for rc in codes]

    def put_tensor(self, key: str, tensor: Any) -> None:
        rc = self._store.put_tensor(key, tensor)
        if rc != 0:
            raise TidekvError(f"mooncake put_tensor({key!r}, {tuple(tensor.shape)}) returned {rc}")

    def get_tensor(self, key: str) -> int:
        t = self._store.get_tensor(key)  # None when missing; time_op checks the size
        return 0 if t is None else t.numel() * t.element_size()

    def remove_many(self, keys: Sequence[str]) -> None:
        codes = self._store.batch_remove(list(keys), True)
        bad = [(k, rc) for k, rc in zip(keys, codes) if rc != 0]
        if bad:
            raise TidekvError(f"mooncake batch_remove of {len(keys)} keys: {len(bad)} failed, first {bad[0]}")


def _check(codes: Sequence[int], keys: Sequence[str], ok: Any, what: str, spans: Sequence[Span]) -> None:
    bad = [(k, rc) for k, rc, (_, n) in zip(keys, codes, spans) if not ok(rc, n)]
    if bad or len(codes) != len(keys):
        raise TidekvError(f"mooncake {what} of {len(keys)} keys: {len(bad)} failed, first {bad[:1]} "
                          f"({len(codes)} results)")


def _holder_main(conn: Connection, api: MooncakeApi, env: dict[str, str], master: str, segment_bytes: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the bench stops its helpers itself, in order
    os.environ.update(env)
    store = _setup(api, master, segment_bytes, 0)
    send_ready(conn, store.get_hostname())
    serve(conn)
    store.close()


def _client_main(conn: Connection, api: MooncakeApi, env: dict[str, str], master: str, segment_bytes: int,
                 buffer_bytes: int, local_buffer_bytes: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.update(env)
    store = _setup(api, master, segment_bytes, local_buffer_bytes)
    client = _MooncakeClient(store, buffer_bytes)
    keys = KeyMaker(api.value)

    def run(message: tuple[StoreOp, Budget]) -> list[float]:
        return time_op(client, message[0], message[1], keys)

    send_ready(conn, store.get_hostname())
    serve(conn, run)
    store.close()


class MooncakePool:
    """Mooncake's master and, when the pool is in another process, the holder mounting its only segment.

    Args:
        api: Mooncake's own store or tidekv's drop-in.
        is_holder_in_client: True: only the master (the client mounts the segment itself);
            False: also a holder process mounting ``segment_bytes``.
        segment_bytes: the holder's segment size (global_segment_size).
        log_dir: where the master and the holder log.
        lease_ttl_s: the master's read lease (None: its default, 10 s).

    Raises:
        ConfigError: Mooncake's wheel or mooncake_master is missing (api MOONCAKE).
        TidekvError: a process failed to start (the message quotes its log).
    """

    def __init__(self, api: MooncakeApi, is_holder_in_client: bool, segment_bytes: int, log_dir: str | Path,
                 lease_ttl_s: float | None = None) -> None:
        if api == MooncakeApi.MOONCAKE:
            check_available()
        self.api = api
        self.env = memcpy_env(is_holder_in_client) if api == MooncakeApi.MOONCAKE else {}
        """What the clients of this pool need in their environment (``memcpy_env``)."""
        with contextlib.ExitStack() as stack:
            master = MooncakeMaster(log_dir, api, lease_ttl_s)
            stack.callback(master.stop)
            self.master = master.address
            self.holder: str | None = None
            """The holder's Mooncake hostname (None: the client holds the segment)."""
            if not is_holder_in_client:
                holder = stack.enter_context(HelperProcess(
                    f"{api.value}-holder", _holder_main, (api, self.env, master.address, segment_bytes), log_dir))
                self.holder = holder.hello
            self._stack = stack.pop_all()

    def close(self) -> None:
        """Stops the holder, then the master."""
        self._stack.close()


class MooncakeStoreDriver:
    """A Mooncake-API pool (``MooncakePool``) and the measuring client on 127.0.0.1, in the bench's layout.

    Args:
        is_holder_in_client: True: the client mounts the only segment (Mooncake then copies with
            memcpy); False: a holder process mounts it and the client is a pure client (tcp).
        segment_bytes: the segment's size (global_segment_size).
        buffer_bytes: the client's registered buffer for batch calls.
        log_dir: where every process logs.
        api: Mooncake's own store (default) or tidekv's drop-in.
        local_buffer_bytes: the client's ``local_buffer_size``: Mooncake serializes a
            ``put_tensor`` there, so it must exceed the largest tensor.

    Raises:
        ConfigError: the wheel or mooncake_master is missing.
        TidekvError: a process failed to start (the message quotes its log).
    """

    def __init__(self, is_holder_in_client: bool, segment_bytes: int, buffer_bytes: int, log_dir: str | Path,
                 api: MooncakeApi = MooncakeApi.MOONCAKE, local_buffer_bytes: int = LOCAL_BUFFER_BYTES) -> None:
        self.name = api.value
        with contextlib.ExitStack() as stack:
            # The shortest lease Mooncake's gets work with, on both masters: the rows remove what they
            # read right away, and the drop-in (like tidekv) frees a removed object's bytes only when
            # its read lease runs out, so 10 s leases kept ~1 GiB of removed objects and the pool
            # evicted the next row's objects before it could read them.
            pool = MooncakePool(api, is_holder_in_client, segment_bytes, log_dir, lease_ttl_s=MIN_LEASE_TTL_S)
            stack.callback(pool.close)
            self._client = stack.enter_context(HelperProcess(
                f"{api.value}-client", _client_main,
                (api, pool.env, pool.master, segment_bytes if is_holder_in_client else 0, buffer_bytes,
                 local_buffer_bytes), log_dir))
            self._stack = stack.pop_all()

    def measure(self, op: StoreOp, budget: Budget) -> list[float]:
        """Latency of each timed call (seconds), timed inside the client process.

        Raises:
            TidekvError: a call failed or the client died (the message quotes its log).
        """
        samples: list[float] = self._client.call((op, budget), _CALL_TIMEOUT_S)
        return samples

    def close(self) -> None:
        """Stops the client, the holder and the master, in that order."""
        self._stack.close()
