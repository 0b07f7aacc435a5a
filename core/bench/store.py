"""``tidekv bench store``: the store measured end to end, a master and clients as processes on 127.0.0.1.

Each tidekv configuration (``TidekvStoreDriver``) is a master plus either one client that holds
the only segment and measures (holder ``same``) or a holder and a pure client (``other``), the
client's engine on ``shm`` or forced ``tcp``. Rows are ``store_ops.time_op`` operations; with
``--compare mooncake`` the same rows run through Mooncake's store and through tidekv's drop-in
("shim" columns), interleaved in rounds, each row with its ratios.
Neighbours: ``store_ops`` (what a row times), ``store_report`` (table, bars, plot), ``timing``.
Design notes: docs/design-bench.md#tidekvbenchstore
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import enum
import logging
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Protocol, TypeVar

from tidekv import report
from tidekv.bench.store_ops import TENSOR_OPS, KeyMaker, OpKind, Span, StoreOp, time_op, torch_available
from tidekv.bench.store_report import evaluate_bars, plot, pyplot, table_columns, table_notes
from tidekv.bench.timing import Budget, Summary, summarize
from tidekv.config import MasterConfig, StoreConfig, TransferConfig, TransportKind
from tidekv.errors import ConfigError, TidekvError
from tidekv.helper_process import HelperProcess, send_ready, serve
from tidekv.report import Row, format_size, parse_size
from tidekv.store import MasterServer, Status, Store
from tidekv.transfer.region import Region

logger = logging.getLogger(__name__)

DEFAULT_SIZES = (4 << 10, 1 << 20)
DEFAULT_TENSOR_SIZES = (64 << 20,)
QUICK_TENSOR_SIZES = (1 << 20,)
DEFAULT_BATCH_KEYS = 256
QUICK_BATCH_KEYS = 32
BATCH_OBJECT_BYTES = 1 << 20
DEFAULT_EXISTS_KEYS = 1000
EXISTS_OBJECT_BYTES = 4 << 10
DEFAULT_SEGMENT_BYTES = 1 << 30
QUICK_SEGMENT_BYTES = 256 << 20
_CALL_TIMEOUT_S = 600.0
_BIG_CALL_BYTES = 64 << 20
"""Calls moving at least this much get two warm-up calls in their first round (first-touch faults)."""
_TRANSPORT_LABELS = {TransportKind.AUTO: "shm", TransportKind.TCP: "tcp"}
_TRANSPORTS = {label: kind for kind, label in _TRANSPORT_LABELS.items()}


class Holder(enum.Enum):
    """Which process holds the only segment of the pool."""

    SAME = "same"  #: the measuring client itself
    OTHER = "other"  #: a holder process; the measuring client is a pure client


@dataclass(frozen=True, slots=True)
class StoreBenchOptions:
    """What one ``bench store`` run measures (built from the command line)."""

    holders: tuple[Holder, ...] = (Holder.SAME, Holder.OTHER)
    """Process layouts measured, one after the other. Default same, other."""
    transports: tuple[TransportKind, ...] = (TransportKind.AUTO, TransportKind.TCP)
    """AUTO ("shm": shared memory allowed) and/or TCP (forced)."""
    ops: tuple[OpKind, ...] = tuple(OpKind)
    """Operations measured in every layout. Default all."""
    sizes: tuple[int, ...] = DEFAULT_SIZES
    """Object sizes of the single-key put/get rows. Default 4 KiB, 1 MiB."""
    tensor_sizes: tuple[int, ...] = DEFAULT_TENSOR_SIZES
    """Bytes of the float32 tensors of the put_tensor/get_tensor rows. Default 64 MiB."""
    batch_keys: int = DEFAULT_BATCH_KEYS
    """Keys per put_many_from/get_many_into call (of 1 MiB each). Default 256."""
    exists_keys: int = DEFAULT_EXISTS_KEYS
    """Keys per exists_many call. Default 1000."""
    segment_bytes: int = DEFAULT_SEGMENT_BYTES
    """Size of the pool's only segment (tidekv and Mooncake alike). Default 1 GiB."""
    budget: Budget = dataclasses.field(default_factory=Budget)
    """How long each measurement runs (all rounds together)."""
    rounds: int = 3
    """Each row is measured in this many parts, interleaved across tidekv and Mooncake. Default 3."""
    enable_mooncake: bool = False
    """Also run every row through Mooncake's store and through the drop-in (--compare mooncake)."""
    enable_progress: bool = True
    """Show a progress bar on stderr."""
    transfer_config: TransferConfig = dataclasses.field(default_factory=TransferConfig)
    """Engine settings of the measuring clients (the transport is set per configuration)."""

    def __post_init__(self) -> None:
        if self.batch_keys < 1 or self.exists_keys < 1:
            raise ConfigError(f"--batch-keys={self.batch_keys} and --exists-keys={self.exists_keys} must be >= 1")
        if self.rounds < 1:
            raise ConfigError(f"--rounds={self.rounds} must be >= 1")
        need = max([self.batch_keys * BATCH_OBJECT_BYTES, *self.sizes, *self.tensor_sizes]) * 2
        if self.segment_bytes < need:
            raise ConfigError(f"--segment-size={format_size(self.segment_bytes)} is too small; a batch row needs "
                              f"at least {format_size(need)} (twice one call, for removal to catch up)")


def plan(opts: StoreBenchOptions) -> list[StoreOp]:
    """The operations of every configuration, in the order they are measured."""
    specs: list[StoreOp] = []
    for kind in opts.ops:
        if kind in (OpKind.PUT, OpKind.GET):
            specs += [StoreOp(kind, size) for size in opts.sizes]
        elif kind in TENSOR_OPS:
            specs += [StoreOp(kind, size) for size in opts.tensor_sizes]
        elif kind in (OpKind.PUT_MANY_FROM, OpKind.GET_MANY_INTO):
            specs.append(StoreOp(kind, BATCH_OBJECT_BYTES, opts.batch_keys))
        elif kind == OpKind.EXISTS:
            specs.append(StoreOp(kind, EXISTS_OBJECT_BYTES))
        else:
            specs.append(StoreOp(kind, EXISTS_OBJECT_BYTES, opts.exists_keys))
    return specs


# ---- tidekv processes ---------------------------------------------------------------------


class _TidekvClient:
    """``store_ops.KVClient`` over a tidekv ``Store`` and a region of its engine."""

    def __init__(self, store: Store, buffer: Region) -> None:
        self._store = store
        self.buffer_address = buffer.address
        self.buffer_bytes = buffer.length

    def put(self, key: str, value: bytes) -> None:
        self._store.put(key, value)

    def get(self, key: str) -> int:
        return len(self._store.get(key))

    def put_many_from(self, keys: Sequence[str], spans: Sequence[Span]) -> None:
        self._store.put_many_from(keys, spans)

    def get_many_into(self, keys: Sequence[str], spans: Sequence[Span]) -> None:
        sizes = self._store.get_many_into(keys, spans)
        wrong = [(k, got) for k, got, (_, n) in zip(keys, sizes, spans) if got != n]
        if wrong:
            raise TidekvError(f"get_many_into of {len(keys)} keys: {len(wrong)} missing or of the wrong size, "
                              f"first {wrong[0]}")

    def exists(self, key: str) -> bool:
        return self._store.exists(key)

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        return self._store.exists_many(keys)

    def put_tensor(self, key: str, tensor: Any) -> None:
        self._store.put_tensor(key, tensor)

    def get_tensor(self, key: str) -> int:
        t = self._store.get_tensor(key)
        return t.numel() * t.element_size()

    def remove_many(self, keys: Sequence[str]) -> None:
        statuses = self._store.remove_many(keys, force=True)
        bad = [(k, s) for k, s in zip(keys, statuses) if s != Status.OK]
        if bad:
            raise TidekvError(f"remove_many of {len(keys)} keys: {len(bad)} failed, first {bad[0]}")


def _master_main(conn: Connection, config: MasterConfig) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the bench stops its helpers itself, in order
    server = MasterServer(config).start()
    try:
        send_ready(conn, server.address)
        serve(conn)
    finally:
        server.stop()


def _holder_main(conn: Connection, master: str, segment_bytes: int, transfer_config: TransferConfig) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    config = StoreConfig.from_env(segment_size_bytes=segment_bytes)
    with Store.connect(master, config=config, transfer_config=transfer_config) as store:
        send_ready(conn, store.engine.name)
        serve(conn)


def _client_main(conn: Connection, master: str, segment_bytes: int, buffer_bytes: int,
                 transfer_config: TransferConfig, holder_engine: str | None) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    config = StoreConfig.from_env(segment_size_bytes=segment_bytes, prefer_local_segment=True)
    with Store.connect(master, config=config, transfer_config=transfer_config) as store:
        holder = holder_engine or store.engine.name
        path = store.engine.connect(holder)
        expected = _TRANSPORT_LABELS[transfer_config.transport]
        if path != expected:
            raise TidekvError(f"store client engine {store.engine.name} reaches the holder {holder} via {path}, "
                              f"not {expected}; its rows would measure the wrong path")
        client = _TidekvClient(store, store.engine.allocate(buffer_bytes))
        keys = KeyMaker(f"tidekv-{expected}")

        def run(message: tuple[StoreOp, Budget]) -> list[float]:
            return time_op(client, message[0], message[1], keys)

        send_ready(conn, path)
        serve(conn, run)


class _Driver(Protocol):
    """One measured configuration (tidekv's or Mooncake's processes): times ops, then is closed."""

    def measure(self, op: StoreOp, budget: Budget) -> list[float]: ...

    def close(self) -> None: ...


class TidekvStoreDriver:
    """One tidekv configuration: a master, the holder (when another process) and the measuring client.

    Args:
        holder: which process mounts the pool's only segment.
        transport: the measuring client's transport (AUTO: shm to same-host peers; TCP forced).
        segment_bytes: the segment's size.
        buffer_bytes: the client's registered buffer for batch calls.
        transfer_config: engine settings of the measuring client (its transport is replaced).
        log_dir: where every process logs.

    Raises:
        TidekvError: a process failed to start, or the client's path to the holder is not the
            asked transport (the message quotes its log).
    """

    def __init__(self, holder: Holder, transport: TransportKind, segment_bytes: int, buffer_bytes: int,
                 transfer_config: TransferConfig, log_dir: str | Path) -> None:
        label = f"{_TRANSPORT_LABELS[transport]}-{holder.value}"
        with contextlib.ExitStack() as stack:
            master_config = MasterConfig.from_env(host="127.0.0.1", port=0, metrics_port=-1)
            master = stack.enter_context(
                HelperProcess(f"tidekv-master-{label}", _master_main, (master_config,), log_dir))
            holder_engine = None
            if holder == Holder.OTHER:
                holder_config = dataclasses.replace(transfer_config, transport=TransportKind.AUTO)
                holder_process = HelperProcess(f"tidekv-holder-{label}", _holder_main,
                                               (master.hello, segment_bytes, holder_config), log_dir)
                holder_engine = stack.enter_context(holder_process).hello
            client_config = dataclasses.replace(transfer_config, transport=transport)
            client_segment_bytes = segment_bytes if holder == Holder.SAME else 0
            self._client = stack.enter_context(HelperProcess(
                f"tidekv-client-{label}", _client_main,
                (master.hello, client_segment_bytes, buffer_bytes, client_config, holder_engine), log_dir))
            self._stack = stack.pop_all()

    def measure(self, op: StoreOp, budget: Budget) -> list[float]:
        """Latency of each timed call (seconds), timed inside the client process."""
        samples: list[float] = self._client.call((op, budget), _CALL_TIMEOUT_S)
        return samples

    def close(self) -> None:
        """Stops the client, the holder and the master, in that order."""
        self._stack.close()


# ---- the run ------------------------------------------------------------------------------


def _is_latency_row(op: StoreOp) -> bool:
    return op.kind in (OpKind.PUT, OpKind.GET, *TENSOR_OPS)


def _ratio_by(op: StoreOp) -> str:
    if _is_latency_row(op):
        return "p50"
    return "keys_per_s" if op.kind in (OpKind.EXISTS, OpKind.EXISTS_MANY) else "gbps"


@dataclass(frozen=True, slots=True)
class _Found:
    summary: Summary
    keys_per_s: float

    @classmethod
    def of(cls, samples: list[float], op: StoreOp) -> _Found:
        summary = summarize(samples, op.bytes_per_call)
        return cls(summary, len(samples) * op.keys / sum(samples))

    def value(self, by: str) -> float:
        if by == "p50":
            return self.summary.p50_us
        return self.summary.gbps if by == "gbps" else self.keys_per_s


def _row(holder: Holder, transport: TransportKind, op: StoreOp, ours: _Found, mooncake: _Found | None,
         shim: _Found | None, has_mooncake: bool) -> Row:
    by = _ratio_by(op)
    moves_bytes = op.bytes_per_call > 0
    row: Row = {
        "holder": holder.value, "transport": _TRANSPORT_LABELS[transport], "op": op.kind.value,
        "size_bytes": op.size_bytes, "keys": op.keys, "iterations": ours.summary.iterations,
        "p50_us": ours.summary.p50_us, "p99_us": ours.summary.p99_us,
        "gbps": ours.summary.gbps if moves_bytes else None, "keys_per_s": ours.keys_per_s, "ratio_by": by,
    }
    if has_mooncake:
        row.update({
            "mooncake_transport": "tcp" if holder == Holder.OTHER else "memcpy",
            "mooncake_p50_us": mooncake.summary.p50_us if mooncake else None,
            "mooncake_p99_us": mooncake.summary.p99_us if mooncake else None,
            "mooncake_gbps": mooncake.summary.gbps if mooncake and moves_bytes else None,
            "mooncake_keys_per_s": mooncake.keys_per_s if mooncake else None,
            "ratio_mooncake": _ratio(ours, mooncake, by) if mooncake else None,
            "shim_p50_us": shim.summary.p50_us if shim else None,
            "shim_p99_us": shim.summary.p99_us if shim else None,
            "shim_gbps": shim.summary.gbps if shim and moves_bytes else None,
            "shim_keys_per_s": shim.keys_per_s if shim else None,
            "ratio_shim_mooncake": _ratio(shim, mooncake, by) if shim and mooncake else None,
        })
    return row


def _ratio(ours: _Found, other: _Found, by: str) -> float:
    """> 1 when tidekv is better: a shorter p50, or more GB/s or keys/s."""
    if by == "p50":
        return other.value(by) / ours.value(by)
    return ours.value(by) / other.value(by)


def _round_budget(part: Budget, op: StoreOp, round_index: int) -> Budget:
    if op.bytes_per_call < _BIG_CALL_BYTES:
        return part
    # A big call's first round touches pages no call touched yet; its timing would say so.
    return dataclasses.replace(part, warmup_iterations=2 if round_index == 0 else 1, warmup_time_s=600.0)


def _measure_interleaved(op: StoreOp, drivers: Sequence[tuple[str, _Driver]], opts: StoreBenchOptions,
                         bar: Any, where: str) -> dict[str, _Found]:
    """Measures each driver in ``opts.rounds`` parts, rotating who goes first, so load that comes
    and goes (another process, a CPU frequency change) hits tidekv and Mooncake alike."""
    samples: dict[str, list[float]] = {name: [] for name, _ in drivers}
    for r in range(opts.rounds):
        part = _round_budget(opts.budget.split(opts.rounds, r), op, r)
        shift = r % len(drivers)
        for name, driver in list(drivers[shift:]) + list(drivers[:shift]):
            bar.set_postfix_str(f"{name} {where}: {_op_label(op)} ({r + 1}/{opts.rounds})")
            samples[name] += driver.measure(op, part)
            bar.update(1)
    return {name: _Found.of(values, op) for name, values in samples.items()}


def _op_label(op: StoreOp) -> str:
    keys = f"{op.keys} x " if op.keys > 1 else ""
    return f"{op.kind.value} {keys}{format_size(op.size_bytes)}"


def run_bench(opts: StoreBenchOptions) -> list[Row]:
    """Runs every operation in every configuration; returns one row per (holder, transport, op).

    Raises:
        ConfigError: --compare mooncake without the Mooncake wheel, or an invalid option.
        TidekvError: a process failed (the message quotes its log; the logs are kept).
    """
    ops = plan(opts)
    if not ops or not opts.holders or not opts.transports:
        raise ConfigError("nothing to measure: --holders, --transports and --ops leave no row")
    buffer_bytes = max([1 << 20, *(op.buffer_bytes for op in ops)])  # the tensor rows register none
    drivers_per_holder = len(opts.transports) + 2 * opts.enable_mooncake
    log_dir = tempfile.mkdtemp(prefix="tidekv-bench-store-")
    rows: list[Row] = []
    with contextlib.ExitStack() as stack:
        bar = stack.enter_context(contextlib.closing(report.progress(
            len(opts.holders) * drivers_per_holder * (1 + len(ops) * opts.rounds), "bench store",
            enabled=opts.enable_progress)))
        for holder in opts.holders:
            where = f"(holder {holder.value})"
            with contextlib.ExitStack() as processes:
                drivers: list[tuple[str, _Driver]] = []
                for kind in opts.transports:
                    name = f"tidekv-{_TRANSPORT_LABELS[kind]}"
                    bar.set_postfix_str(f"starting {name} {where}")
                    driver = TidekvStoreDriver(holder, kind, opts.segment_bytes, buffer_bytes, opts.transfer_config,
                                               log_dir)
                    drivers.append((name, processes.enter_context(contextlib.closing(driver))))
                    bar.update(1)
                if opts.enable_mooncake:
                    from tidekv.bench.mooncake_store import LOCAL_BUFFER_BYTES, MooncakeApi, MooncakeStoreDriver

                    tensors = [op.size_bytes for op in ops if op.kind in TENSOR_OPS]
                    local_buffer = max([LOCAL_BUFFER_BYTES, *(2 * n for n in tensors)])  # Mooncake stages tensors

                    for api in (MooncakeApi.MOONCAKE, MooncakeApi.SHIM):
                        bar.set_postfix_str(f"starting {api.value} {where}")
                        mooncake = MooncakeStoreDriver(holder == Holder.SAME, opts.segment_bytes, buffer_bytes,
                                                       log_dir, api, local_buffer)
                        drivers.append((api.value, processes.enter_context(contextlib.closing(mooncake))))
                        bar.update(1)
                for op in ops:
                    found = _measure_interleaved(op, drivers, opts, bar, where)
                    for kind in opts.transports:
                        rows.append(_row(holder, kind, op, found[f"tidekv-{_TRANSPORT_LABELS[kind]}"],
                                         found.get("mooncake"), found.get("shim"), opts.enable_mooncake))
        bar.close()  # before the helpers' shutdown logs
    shutil.rmtree(log_dir, ignore_errors=True)
    return rows


# ---- command line -------------------------------------------------------------------------

T = TypeVar("T")

_DESCRIPTION = """\
Measures tidekv's store end to end with every part in its own process on 127.0.0.1: a master, the
holder of the pool's only segment, and the measuring client. Configurations: the holder is the
measuring client itself (same) or another process (other); the client's engine may use shared
memory (shm) or is forced to tcp. Rows: put/get p50/p99 at 4 KiB and 1 MiB, put_many_from and
get_many_into of 256 x 1 MiB (GB/s), exists (ops/s) and exists_many of 1000 keys (keys/s).

With --compare mooncake the same rows run through Mooncake's store (its own mooncake_master,
tcp, same process layout) and through the same Mooncake-API client on tidekv's drop-in (shim:
tidekv.compat.mooncake_store and its mooncake_master) in the same run, interleaved with tidekv's,
and each row shows the ratios; the store issue's performance bars are checked on tidekv's."""


def _csv(convert: Callable[[str], T], what: str) -> Callable[[str], tuple[T, ...]]:
    def parse(text: str) -> tuple[T, ...]:
        try:
            return tuple(convert(item.strip()) for item in text.split(",") if item.strip())
        except (ConfigError, KeyError, ValueError) as e:
            raise argparse.ArgumentTypeError(f"invalid {what} list {text!r}: {e}") from None

    return parse


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Adds ``store`` to the ``tidekv bench`` subcommands."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "store",
        help="the store end to end (master, holder, client processes), optionally against Mooncake's store",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  tidekv bench store --quick\n  tidekv bench store --json out.jsonl --plot out.png\n"
               "  tidekv bench store --compare mooncake   # needs: pip install mooncake-transfer-engine-non-cuda\n"
               "  tidekv bench store --tier disk --disk-dir /nvme   # the disk tier against the raw device\n"
               "\nSettings come from TIDEKV_* variables: TransferConfig.from_env (measuring clients), "
               "StoreConfig.from_env (TIDEKV_STORE_*), MasterConfig.from_env (TIDEKV_MASTER_*).",
    )
    p.add_argument("--tier", choices=["memory", "disk"], default="memory",
                   help="memory (default): the pool's gets and puts; disk: the disk tier's spills and disk-hit gets "
                        "against raw O_DIRECT I/O of --disk-dir and SGLang's file backend (uses --sizes, "
                        "--rounds, --quick, --json)")
    p.add_argument("--disk-dir", metavar="DIR", default=None,
                   help="with --tier disk: the directory (device) to measure (default: the temp directory)")
    p.add_argument("--quick", action="store_true",
                   help=f"CI-sized run: batches of {QUICK_BATCH_KEYS} keys, {format_size(QUICK_SEGMENT_BYTES)} "
                        "segments, 0.02 s per measurement, 1 round")
    p.add_argument("--holders", type=_csv(Holder, "holder"), default=None, metavar="LIST",
                   help="same and/or other (default same,other)")
    p.add_argument("--transports", type=_csv(lambda v: _TRANSPORTS[v.lower()], "transport"), default=None,
                   metavar="LIST", help="shm (shared memory allowed) and/or tcp (forced) (default shm,tcp)")
    p.add_argument("--ops", type=_csv(lambda v: OpKind(v.lower()), "op"), default=None, metavar="LIST",
                   help="any of " + ",".join(k.value for k in OpKind) + " (default all; the tensor rows only "
                        "where torch is installed)")
    p.add_argument("--sizes", type=_csv(parse_size, "size"), default=None, metavar="LIST",
                   help="object sizes of the put/get rows (default 4K,1M)")
    p.add_argument("--tensor-sizes", type=_csv(parse_size, "size"), default=None, metavar="LIST",
                   help="bytes of the float32 tensors of the put_tensor/get_tensor rows (default 64M; --quick 1M)")
    p.add_argument("--batch-keys", type=int, default=None, metavar="N",
                   help=f"keys of 1 MiB per put_many_from/get_many_into call (default {DEFAULT_BATCH_KEYS})")
    p.add_argument("--exists-keys", type=int, default=DEFAULT_EXISTS_KEYS, metavar="N",
                   help=f"keys per exists_many call (default {DEFAULT_EXISTS_KEYS})")
    p.add_argument("--segment-size", type=parse_size, default=None, metavar="SIZE",
                   help="size of the pool's only segment (default 1G; --quick 256M)")
    p.add_argument("--min-time", type=float, default=None, metavar="S",
                   help="seconds of timed calls per measurement, at least 5 calls (default 0.4; --quick 0.02)")
    p.add_argument("--rounds", type=int, default=None, metavar="N",
                   help="measure each row in N parts interleaved with the other configurations (default 3; --quick 1)")
    p.add_argument("--warmup", type=int, default=3, metavar="N", help="untimed calls first (default 3)")
    p.add_argument("--compare", choices=["mooncake"], default=None,
                   help="also run every row through Mooncake's store (wheel mooncake-transfer-engine-non-cuda)")
    p.add_argument("--json", metavar="FILE", default=None, help="write one JSON object per row (- for stdout)")
    p.add_argument("--plot", metavar="FILE.png", default=None, help="save a bar chart (needs matplotlib)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=main)
    return p


def options_from_args(args: argparse.Namespace) -> StoreBenchOptions:
    """Builds the run's options from parsed arguments (--quick fills what was not given).

    Raises:
        ConfigError: an option is out of range.
    """
    min_time = args.min_time if args.min_time is not None else (0.02 if args.quick else 0.4)
    return StoreBenchOptions(
        holders=args.holders or (Holder.SAME, Holder.OTHER),
        transports=args.transports or (TransportKind.AUTO, TransportKind.TCP),
        ops=args.ops or default_ops(),
        sizes=args.sizes or DEFAULT_SIZES,
        tensor_sizes=args.tensor_sizes or (QUICK_TENSOR_SIZES if args.quick else DEFAULT_TENSOR_SIZES),
        batch_keys=args.batch_keys or (QUICK_BATCH_KEYS if args.quick else DEFAULT_BATCH_KEYS),
        exists_keys=args.exists_keys,
        segment_bytes=args.segment_size or (QUICK_SEGMENT_BYTES if args.quick else DEFAULT_SEGMENT_BYTES),
        budget=Budget(min_time_s=min_time, min_iterations=3 if args.quick else 5, warmup_iterations=args.warmup),
        rounds=args.rounds if args.rounds is not None else (1 if args.quick else 3),
        enable_mooncake=args.compare == "mooncake",
        enable_progress=not args.no_progress,
        transfer_config=TransferConfig.from_env(),
    )


def default_ops() -> tuple[OpKind, ...]:
    """Every operation; the tensor rows only where torch is installed (they are left out with a
    log line otherwise)."""
    if torch_available():
        return tuple(OpKind)
    logger.info("bench store: torch is not installed, so the put_tensor/get_tensor rows are left out")
    return tuple(k for k in OpKind if k not in TENSOR_OPS)


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main(args: argparse.Namespace) -> int:
    """Entry point of ``tidekv bench store``; returns the exit status."""
    signal.signal(signal.SIGTERM, _raise_interrupt)  # a terminated bench still stops its processes
    if args.tier == "disk":
        from tidekv.bench import disk_tier

        return disk_tier.main(args)
    try:
        opts = options_from_args(args)
        if opts.enable_mooncake:
            from tidekv.bench.mooncake_store import check_available

            check_available()
        if args.plot:
            pyplot()
        rows = run_bench(opts)
    except ConfigError as e:
        print(f"tidekv bench store: {e}", file=sys.stderr)
        return 2
    except TidekvError as e:
        print(f"tidekv bench store failed: {e}", file=sys.stderr)
        return 1
    title = (f"tidekv bench store: {os.cpu_count()} CPUs, segment {format_size(opts.segment_bytes)}, "
             f"{opts.budget.min_time_s:.2f} s per measurement in {opts.rounds} round(s)")
    print(report.format_table(rows, table_columns(opts.enable_mooncake), title=title, notes=table_notes(opts)))
    if opts.enable_mooncake:
        print("\nperformance bars (same-run ratios to Mooncake):")
        print("\n".join(evaluate_bars(rows)))
    else:
        print("\nperformance bars: ratios to Mooncake; run with --compare mooncake to check them")
    if args.json:
        report.write_json_lines(args.json, rows)
    if args.plot:
        plot(args.plot, rows, opts.enable_mooncake)
    return 0
