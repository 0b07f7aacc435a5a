"""``tidekv bench transfer``: the transfer engine measured against baselines of the same run.

A target helper process (``tidekv.helper_process``) allocates a region and waits; this process
times READ and WRITE, single requests and batches, over tcp (forced), shm and, when asked, fabric,
each row next to its baseline (``baselines``) and, with ``--compare mooncake`` / ``nixl``, the
same workload through ``mooncake_te`` / ``nixl_te``. Each row reports GB/s, p50/p99 latency and
the ratio to its baseline (same-run ratios, since absolute numbers drift between runs);
``tidekv.report`` prints the table, the JSON lines and the plot.
Design notes: docs/design-bench.md#tidekvbenchtransfer
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import enum
import functools
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, TypeVar

from tidekv import report
from tidekv.bench import nixl_te
from tidekv.bench.bars import evaluate_bars
from tidekv.bench.baselines import MemcpyBaseline, SocketBaseline
from tidekv.bench.mooncake_te import MooncakeDriver, check_available
from tidekv.bench.timing import Budget, Summary, measure, summarize
from tidekv.bench.workload import Workload, region_bytes_for
from tidekv.config import TransferConfig, TransportKind
from tidekv.errors import ConfigError, TidekvError
from tidekv.helper_process import HelperProcess, send_ready, serve
from tidekv.report import Column, Row, Series, format_size, parse_size
from tidekv.transfer.batch import TransferOp, TransferRequest
from tidekv.transfer.engine import TransferEngine

logger = logging.getLogger(__name__)

LATENCY_ROW_MAX_BYTES = 64 << 10
"""Single requests up to this size are latency rows: their ratio compares p50, not GB/s."""
DEFAULT_SIZES = (4 << 10, 64 << 10, 1 << 20, 16 << 20)
QUICK_SIZES = (4 << 10, 1 << 20)
DEFAULT_SHM_LARGE_BYTES = 64 << 20
_WAIT_TIMEOUT_S = 120.0
_TRANSPORTS = {"tcp": TransportKind.TCP, "shm": TransportKind.SHM, "fabric": TransportKind.FABRIC}
FABRIC_BASELINE = "tidekv_tcp"
"""The baseline of fabric rows: tidekv's own tcp transport, the path fabric replaces across hosts."""


class Mode(enum.Enum):
    """How many requests one timed iteration submits."""

    SINGLE = "single"  #: one request per transfer()
    BATCH = "batch"  #: --batch-size requests per transfer()


@dataclass(frozen=True, slots=True)
class BenchOptions:
    """What one ``bench transfer`` run measures (built from the command line)."""

    sizes: tuple[int, ...] = DEFAULT_SIZES
    """Request sizes in bytes."""
    shm_large_bytes: int | None = DEFAULT_SHM_LARGE_BYTES
    """Extra size for single shm requests (memory-bandwidth row); None for none. Default 64 MiB."""
    transports: tuple[TransportKind, ...] = (TransportKind.TCP, TransportKind.SHM)
    """Transports of the tidekv rows: TCP (forced), SHM, FABRIC (forced; needs a provider)."""
    ops: tuple[TransferOp, ...] = (TransferOp.READ, TransferOp.WRITE)
    """Ops of the rows. Default READ and WRITE."""
    modes: tuple[Mode, ...] = (Mode.SINGLE, Mode.BATCH)
    """Single requests and/or batches. Default both."""
    batch_size: int = 64
    """Requests per batch in batch rows. Default 64."""
    budget: Budget = dataclasses.field(default_factory=Budget)
    """How long each measurement runs (all rounds together)."""
    rounds: int = 3
    """Each row and its baselines are measured in this many interleaved parts. Default 3."""
    enable_mooncake: bool = False
    """Also run the tcp rows through Mooncake's transfer engine."""
    enable_nixl: bool = False
    """Also run the tcp rows through NIXL over UCX's tcp, and the shm rows through NIXL's default."""
    enable_progress: bool = True
    """Show a progress bar on stderr. Default True."""
    config: TransferConfig = dataclasses.field(default_factory=TransferConfig)
    """Engine settings of both sides (the transport is set per row); socket buffers apply to the baseline."""


@dataclass(frozen=True, slots=True)
class RowSpec:
    """One tidekv row: transport, op, mode and request size."""

    transport: TransportKind
    op: TransferOp
    mode: Mode
    size_bytes: int

    def label(self) -> str:
        return f"{self.transport.value} {self.op.name} {self.mode.value} {format_size(self.size_bytes)}"


def plan(opts: BenchOptions) -> list[RowSpec]:
    """The rows of a run, in the order they are measured (small sizes first)."""
    specs = [RowSpec(t, op, mode, size) for size in opts.sizes for mode in opts.modes for op in opts.ops
             for t in opts.transports]
    if TransportKind.SHM in opts.transports and opts.shm_large_bytes and opts.shm_large_bytes not in opts.sizes:
        specs += [RowSpec(TransportKind.SHM, op, Mode.SINGLE, opts.shm_large_bytes) for op in opts.ops]
    return specs


def _target_main(conn: Connection, region_bytes: int, config: TransferConfig) -> None:
    with TransferEngine(config=config) as engine:
        region = engine.allocate(region_bytes)
        ctypes.memset(region.address, 0x5A, region_bytes)
        send_ready(conn, (engine.name, region.address))
        serve(conn)


class _TidekvInitiator:
    """One engine per transport in this process, each with a local region, all aimed at the target."""

    def __init__(self, opts: BenchOptions, peer: str, remote_address: int, region_bytes: int) -> None:
        self.peer, self.remote_address = peer, remote_address
        self._engines: dict[TransportKind, tuple[TransferEngine, int]] = {}
        kinds = list(opts.transports)
        if TransportKind.FABRIC in kinds and TransportKind.TCP not in kinds:
            kinds.append(TransportKind.TCP)  # the fabric rows' baseline
        try:
            for kind in kinds:
                engine = TransferEngine(config=dataclasses.replace(opts.config, transport=kind))
                self._engines[kind] = (engine, 0)
                got = engine.connect(peer)
                if got != kind.value:
                    raise TidekvError(f"engine {engine.name} reaches target {peer} via {got}, not {kind.value}; "
                                      f"the {kind.value} rows would measure the wrong path")
                region = engine.allocate(region_bytes)
                ctypes.memset(region.address, 0x5A, region_bytes)
                self._engines[kind] = (engine, region.address)
        except BaseException:
            self.close()
            raise

    def measure(self, kind: TransportKind, workload: Workload, budget: Budget) -> list[float]:
        engine, local = self._engines[kind]
        requests = [TransferRequest(workload.op, local + off, workload.size_bytes, self.peer, self.remote_address + off)
                    for off in workload.offsets()]
        return measure(lambda: engine.transfer(requests).wait(_WAIT_TIMEOUT_S), budget)

    def close(self) -> None:
        for engine, _ in self._engines.values():
            engine.close()


def _is_latency_row(spec: RowSpec) -> bool:
    return spec.mode == Mode.SINGLE and spec.size_bytes <= LATENCY_ROW_MAX_BYTES


def _ratio(ours: Summary, other: Summary, by_p50: bool) -> float:
    return other.p50_us / ours.p50_us if by_p50 else ours.gbps / other.gbps


def _row(spec: RowSpec, count: int, ours: Summary, baseline: str, base: Summary, mooncake: Summary | None,
         has_mooncake: bool, nixl: Summary | None = None, has_nixl: bool = False) -> Row:
    by_p50 = _is_latency_row(spec)
    row: Row = {
        "transport": spec.transport.value, "op": spec.op.name, "mode": spec.mode.value,
        "size_bytes": spec.size_bytes, "requests": count, "iterations": ours.iterations,
        "gbps": ours.gbps, "p50_us": ours.p50_us, "p99_us": ours.p99_us,
        "baseline": baseline, "baseline_gbps": base.gbps, "baseline_p50_us": base.p50_us,
        "baseline_p99_us": base.p99_us, "ratio_by": "p50" if by_p50 else "gbps", "ratio": _ratio(ours, base, by_p50),
    }
    if has_mooncake:
        row.update({
            "mooncake_gbps": mooncake.gbps if mooncake else None,
            "mooncake_p50_us": mooncake.p50_us if mooncake else None,
            "mooncake_p99_us": mooncake.p99_us if mooncake else None,
            "ratio_mooncake": _ratio(ours, mooncake, by_p50) if mooncake else None,
        })
    if has_nixl:
        row.update({
            "nixl_ucx": _NIXL_UCX.get(spec.transport),
            "nixl_gbps": nixl.gbps if nixl else None,
            "nixl_p50_us": nixl.p50_us if nixl else None,
            "nixl_p99_us": nixl.p99_us if nixl else None,
            "ratio_nixl": _ratio(ours, nixl, by_p50) if nixl else None,
        })
    return row


_NIXL_UCX = {TransportKind.TCP: "tcp", TransportKind.SHM: "default"}
"""Which NIXL setting a tidekv row is compared with (none for fabric: no RDMA here for UCX either)."""


_Measure = Callable[[Workload, Budget], list[float]]


def _measure_interleaved(spec: RowSpec, work: Workload, drivers: Sequence[tuple[str, _Measure]], opts: BenchOptions,
                         bar: Any) -> dict[str, Summary]:
    """Measures each driver in ``opts.rounds`` interleaved parts, so load that comes and goes
    (another process, a CPU frequency change) hits the row and its baselines alike."""
    samples: dict[str, list[float]] = {name: [] for name, _ in drivers}
    for r in range(opts.rounds):
        part = opts.budget.split(opts.rounds, r)
        shift = r % len(drivers)
        for name, fn in list(drivers[shift:]) + list(drivers[:shift]):
            bar.set_postfix_str(f"{name}: {spec.label()} ({r + 1}/{opts.rounds})")
            samples[name] += fn(work, part)
            bar.update(1)
    found = {name: summarize(values, work.bytes_per_iteration) for name, values in samples.items()}
    logger.debug("%s: %s", spec.label(), found)
    return found


@dataclass(slots=True)
class _Drivers:
    """Everything that measures a row: tidekv's initiator and the baselines, all started."""

    tidekv: _TidekvInitiator
    sockets: SocketBaseline | None
    memcpy: MemcpyBaseline | None
    mooncake: MooncakeDriver | None
    nixl: dict[TransportKind, nixl_te.NixlDriver]

    def for_row(self, spec: RowSpec) -> tuple[str, list[tuple[str, _Measure]]]:
        """The row's baseline name and its drivers (baseline first, tidekv last)."""
        drivers: list[tuple[str, _Measure]] = []
        if spec.transport == TransportKind.TCP:
            assert self.sockets is not None
            baseline = "socket_stream" if spec.mode == Mode.BATCH else "socket_pingpong"
            drivers.append((baseline, self.sockets.measure))
            if self.mooncake is not None:
                drivers.append(("mooncake", self.mooncake.measure))
            if TransportKind.TCP in self.nixl:
                drivers.append(("nixl", self.nixl[TransportKind.TCP].measure))
        elif spec.transport == TransportKind.FABRIC:
            baseline = FABRIC_BASELINE
            drivers.append((baseline, functools.partial(self.tidekv.measure, TransportKind.TCP)))
        else:
            assert self.memcpy is not None
            baseline = "memcpy"
            drivers.append((baseline, self.memcpy.measure))
            if TransportKind.SHM in self.nixl:
                drivers.append(("nixl", self.nixl[TransportKind.SHM].measure))
        drivers.append(("tidekv", functools.partial(self.tidekv.measure, spec.transport)))
        return baseline, drivers


def _start_drivers(stack: contextlib.ExitStack, opts: BenchOptions, specs: Sequence[RowSpec], region_bytes: int,
                   log_dir: str) -> _Drivers:
    """Starts the processes and engines the rows need; ``stack`` stops them."""
    mooncake = None
    if opts.enable_mooncake:
        mooncake = stack.enter_context(contextlib.closing(MooncakeDriver(region_bytes, log_dir)))
    target_config = dataclasses.replace(opts.config, transport=TransportKind.AUTO)
    target = stack.enter_context(HelperProcess("tidekv-target", _target_main, (region_bytes, target_config), log_dir))
    peer, remote_address = target.hello
    tidekv = stack.enter_context(contextlib.closing(_TidekvInitiator(opts, peer, remote_address, region_bytes)))
    sockets = None
    if any(s.transport == TransportKind.TCP for s in specs):
        sockets = stack.enter_context(contextlib.closing(
            SocketBaseline(region_bytes, opts.config.socket_buffer_bytes, log_dir)))
    memcpy = MemcpyBaseline(region_bytes) if any(s.transport == TransportKind.SHM for s in specs) else None
    nixl: dict[TransportKind, nixl_te.NixlDriver] = {}
    if opts.enable_nixl:
        for kind, env in ((TransportKind.TCP, nixl_te.TCP_UCX), (TransportKind.SHM, nixl_te.DEFAULT_UCX)):
            if any(s.transport == kind for s in specs):
                nixl[kind] = stack.enter_context(contextlib.closing(
                    nixl_te.NixlDriver(region_bytes, log_dir, env, f"nixl-{_NIXL_UCX[kind]}")))
    return _Drivers(tidekv, sockets, memcpy, mooncake, nixl)


def run_bench(opts: BenchOptions) -> list[Row]:
    """Runs every row of ``plan(opts)`` with its baselines; returns one row dict per tidekv row.

    Raises:
        ConfigError: --compare mooncake without the Mooncake wheel, or an invalid option.
        TidekvError: a helper process failed (the message quotes its log, which is kept).
    """
    specs = plan(opts)
    if not specs:
        raise ConfigError("nothing to measure: --transports, --ops, --modes and --sizes leave no row")
    if TransportKind.FABRIC in opts.transports:
        check_fabric(opts.config)
    largest_count = opts.batch_size if Mode.BATCH in opts.modes else 1
    region_bytes = region_bytes_for(max(s.size_bytes for s in specs), largest_count)
    steps = sum(2 + (s.transport == TransportKind.TCP and opts.enable_mooncake)
                + (s.transport in _NIXL_UCX and opts.enable_nixl) for s in specs) * opts.rounds
    log_dir = tempfile.mkdtemp(prefix="tidekv-bench-")
    rows: list[Row] = []
    try:
        with contextlib.ExitStack() as stack:
            bar = stack.enter_context(contextlib.closing(
                report.progress(steps, "bench transfer", enabled=opts.enable_progress)))
            bar.set_postfix_str("starting processes")
            drivers = _start_drivers(stack, opts, specs, region_bytes, log_dir)
            for spec in specs:
                baseline, row_drivers = drivers.for_row(spec)
                count = opts.batch_size if spec.mode == Mode.BATCH else 1
                work = Workload(spec.op, spec.size_bytes, count, region_bytes)
                found = _measure_interleaved(spec, work, row_drivers, opts, bar)
                rows.append(_row(spec, count, found["tidekv"], baseline, found[baseline], found.get("mooncake"),
                                 opts.enable_mooncake, found.get("nixl"), opts.enable_nixl))
            bar.close()  # before the helpers' shutdown logs
    except BaseException:
        logger.error("bench transfer stopped; the helper processes' logs are kept in %s", log_dir)
        raise
    shutil.rmtree(log_dir, ignore_errors=True)
    order = {t: i for i, t in enumerate(("tcp", "fabric", "shm"))}
    rows.sort(key=lambda r: (order[r["transport"]], r["op"], r["mode"] != "single", r["size_bytes"]))
    return rows


def table_columns(has_mooncake: bool, has_nixl: bool = False) -> list[Column]:
    """Columns of the text table (the JSON rows carry every key)."""
    columns = [
        Column("transport", "transport", align="<"), Column("op", "op", align="<"), Column("mode", "mode", align="<"),
        Column("requests", "reqs"), Column("size_bytes", "size", format_size), Column("gbps", "GB/s", ".3f"),
        Column("p50_us", "p50 us", ".1f"), Column("p99_us", "p99 us", ".1f"),
        Column("baseline", "baseline", align="<"), Column("baseline_gbps", "base GB/s", ".3f"),
        Column("baseline_p50_us", "base p50 us", ".1f"), Column("ratio", "ratio", ".2f"),
        Column("ratio_by", "by", align="<"),
    ]
    if has_mooncake:
        columns += [Column("mooncake_gbps", "mc GB/s", ".3f"), Column("mooncake_p50_us", "mc p50 us", ".1f"),
                    Column("ratio_mooncake", "vs mc", ".2f")]
    if has_nixl:
        columns += [Column("nixl_ucx", "nixl ucx", align="<"), Column("nixl_gbps", "nixl GB/s", ".3f"),
                    Column("nixl_p50_us", "nixl p50 us", ".1f"), Column("ratio_nixl", "vs nixl", ".2f")]
    return columns


def table_notes(opts: BenchOptions) -> list[str]:
    """Lines under the table: how to read it."""
    notes = [
        "",
        "ratio > 1 means tidekv is better. by gbps: GB/s / baseline GB/s; by p50: baseline p50 / tidekv p50 "
        f"(single requests <= {format_size(LATENCY_ROW_MAX_BYTES)}).",
        "GB/s = 10^9 payload bytes/s over all timed iterations; p50/p99 = latency of one iteration "
        f"(one request, or a whole batch of {opts.batch_size}).",
        "socket_pingpong/socket_stream: plain Python sockets (sendall/recv_into) between two processes on "
        f"127.0.0.1, SO_SNDBUF/SO_RCVBUF {format_size(opts.config.socket_buffer_bytes)}, TCP_NODELAY; "
        "WRITE = send bytes + 1-byte ack, READ = 1-byte request + receive bytes.",
        "memcpy: ctypes.memmove between two preallocated buffers in one process, same sizes and offsets.",
    ]
    if TransportKind.FABRIC in opts.transports:
        notes.append(f"fabric: libfabric provider {fabric_provider_name(opts.config)}, one-sided RMA; baseline "
                     f"{FABRIC_BASELINE} = tidekv's tcp transport in the same run. On a software provider (tcp) "
                     "this is the provider's overhead, not RDMA speed: RDMA figures need RDMA NICs.")
    if opts.enable_mooncake:
        notes.append("mc: mooncake.engine.TransferEngine, protocol tcp, P2PHANDSHAKE, target and initiator in "
                     "their own processes; vs mc follows the same rule as ratio.")
    if opts.enable_nixl:
        notes.append("nixl: NIXL's Python agent, UCX backend, numpy host memory, target and initiator in their own "
                     "processes, one transfer handle per shape posted again each iteration; ucx tcp = UCX_TLS=tcp "
                     "UCX_NET_DEVICES=lo (beside tcp rows), default = UCX's own choice, cross-memory attach here "
                     "(beside shm rows); vs nixl follows the same rule as ratio.")
    return notes


def plot(path: str, rows: Sequence[Row], has_mooncake: bool) -> None:
    """Saves GB/s against request size, one panel per (op, mode).

    Raises:
        ConfigError: matplotlib is missing.
    """
    series = [Series("tidekv tcp", "gbps", {"transport": "tcp"}),
              Series("socket (same run)", "baseline_gbps", {"transport": "tcp"}, "s--"),
              Series("tidekv fabric", "gbps", {"transport": "fabric"}, "d-."),
              Series("tidekv shm", "gbps", {"transport": "shm"}),
              Series("memcpy (same run)", "baseline_gbps", {"transport": "shm"}, "s--")]
    if has_mooncake:
        series.append(Series("mooncake tcp", "mooncake_gbps", {"transport": "tcp"}, "^:"))
    if any(row.get("nixl_gbps") for row in rows):
        series += [Series("nixl ucx tcp", "nixl_gbps", {"transport": "tcp"}, "v:"),
                   Series("nixl ucx default", "nixl_gbps", {"transport": "shm"}, "v:")]
    report.plot_rows(path, rows, x="size_bytes", series=series, panel_by=("op", "mode"),
                     title=f"tidekv bench transfer ({os.cpu_count()} CPUs, same-run baselines)",
                     x_label="request size", y_label="GB/s", x_format=format_size)


def check_fabric(config: TransferConfig) -> None:
    """Refuses fabric rows where the fabric transport cannot run, with the engine's reason.

    Raises:
        ConfigError: fabric is unavailable with these settings (no provider, no libfabric).
    """
    from tidekv.transfer.transports import built_transports

    for name, available, reason in built_transports(config):
        if name == "fabric" and not available:
            raise ConfigError(f"--transports fabric: the fabric transport cannot run here: {reason} "
                              "(--fabric-provider tcp runs it on libfabric's software tcp provider)")


def fabric_provider_name(config: TransferConfig) -> str:
    """The provider the fabric rows run on, as the engine reports it."""
    from tidekv.transfer.transports import built_transports

    for name, available, reason in built_transports(config):
        if name == "fabric" and available:
            return reason.split(" ")[1] if reason.startswith("provider ") else reason
    return config.fabric_provider or "(none)"


T = TypeVar("T")

_DESCRIPTION = """\
Measures tidekv's transfer engine between two processes on 127.0.0.1 (a target that holds a
region, this process as initiator): READ and WRITE, single requests and batches, tcp (forced)
and shm. In the same run it measures the baselines each row is compared with: plain loopback
sockets between two processes for tcp (a ping-pong for single requests, a stream for batches)
and an in-process memcpy for shm. With --compare mooncake the tcp rows also run through
Mooncake's transfer engine.

Prints a table (GB/s, p50/p99 latency, ratio to the baseline; ratio > 1 means tidekv is
better) and checks the performance bars of the transfer-engine issue on same-run ratios."""


def _csv(convert: Callable[[str], T], what: str) -> Callable[[str], tuple[T, ...]]:
    def parse(text: str) -> tuple[T, ...]:
        try:
            return tuple(convert(item.strip()) for item in text.split(",") if item.strip())
        except ConfigError as e:
            raise argparse.ArgumentTypeError(f"invalid {what} list {text!r}: {e}") from None

    return parse


def _choice(mapping: dict[str, T], what: str) -> Callable[[str], T]:
    def convert(text: str) -> T:
        try:
            return mapping[text.lower()]
        except KeyError:
            raise ConfigError(f"{what} {text!r} is unknown; allowed {', '.join(mapping)}") from None

    return convert


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Adds ``transfer`` to the ``tidekv bench`` subcommands."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "transfer",
        help="tidekv transfers (tcp, shm) against memcpy, raw sockets and optionally Mooncake",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  tidekv bench transfer --quick\n  tidekv bench transfer --json out.jsonl --plot out.png\n"
               "  tidekv bench transfer --compare mooncake   # needs: pip install mooncake-transfer-engine-non-cuda\n"
               "\nEngine settings come from TIDEKV_* variables (TransferConfig.from_env), e.g. "
               "TIDEKV_CONNECTIONS_PER_PEER.",
    )
    p.add_argument("--quick", action="store_true",
                   help="CI-sized run: sizes 4K,1M, no 64 MiB shm row, 0.02 s per measurement")
    p.add_argument("--sizes", type=_csv(parse_size, "size"), default=None, metavar="LIST",
                   help="request sizes, e.g. 4K,64K,1M,16M (the default)")
    p.add_argument("--shm-large-size", type=str, default=None, metavar="SIZE",
                   help="extra size for single shm requests, compared with memcpy (default 64M; 0 = none)")
    p.add_argument("--transports", type=_csv(_choice(_TRANSPORTS, "transport"), "transport"), default=None,
                   metavar="LIST", help="tcp (forced even between same-host peers), shm and/or fabric (one-sided "
                                        "RDMA through libfabric, forced; compared with tidekv's tcp) "
                                        "(default tcp,shm)")
    p.add_argument("--fabric-provider", default=None, metavar="NAME",
                   help="libfabric provider of the fabric rows, both sides: verbs, efa, or tcp (software: "
                        "overhead only, no RDMA speed) (default: $TIDEKV_FABRIC_PROVIDER, else verbs, then efa)")
    p.add_argument("--ops", type=_csv(_choice({o.name.lower(): o for o in TransferOp}, "op"), "op"), default=None,
                   metavar="LIST", help="READ and/or WRITE (default READ,WRITE)")
    p.add_argument("--modes", type=_csv(_choice({m.value: m for m in Mode}, "mode"), "mode"), default=None,
                   metavar="LIST", help="single and/or batch (default single,batch)")
    p.add_argument("--batch-size", type=int, default=64, metavar="N", help="requests per batch (default 64)")
    p.add_argument("--iterations", type=int, default=None, metavar="N",
                   help="exactly N timed iterations per measurement (default: time-based, see --min-time)")
    p.add_argument("--min-time", type=float, default=None, metavar="S",
                   help="seconds of timed iterations per row and per baseline, at least 5 iterations "
                        "(default 0.4; --quick 0.02)")
    p.add_argument("--rounds", type=int, default=None, metavar="N",
                   help="measure each row and its baselines in N interleaved parts, so passing load hits them "
                        "alike (default 3; --quick 1)")
    p.add_argument("--warmup", type=int, default=3, metavar="N", help="untimed iterations first (default 3)")
    p.add_argument("--compare", type=_csv(_choice({"mooncake": "mooncake", "nixl": "nixl"}, "peer"), "peer"),
                   default=(), metavar="LIST",
                   help="mooncake: also run the tcp rows through Mooncake's engine (wheel "
                        "mooncake-transfer-engine-non-cuda); nixl: the tcp rows through NIXL on UCX's tcp and the "
                        "shm rows through NIXL's default (pip install --no-deps nixl-cu12 nixl); both: mooncake,nixl")
    p.add_argument("--json", metavar="FILE", default=None, help="write one JSON object per row (- for stdout)")
    p.add_argument("--plot", metavar="FILE.png", default=None,
                   help="save a plot of GB/s (needs matplotlib: pip install matplotlib (tidekv's plot extra))")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=main)
    return p


def options_from_args(args: argparse.Namespace) -> BenchOptions:
    """Builds the run's options from parsed arguments (--quick fills what was not given).

    Raises:
        ConfigError: an option is out of range.
    """
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size={args.batch_size} must be >= 1")
    if args.rounds is not None and args.rounds < 1:
        raise ConfigError(f"--rounds={args.rounds} must be >= 1")
    if args.iterations is not None and args.iterations < 1:
        raise ConfigError(f"--iterations={args.iterations} must be >= 1")
    if args.iterations is not None:
        budget = Budget.fixed(args.iterations, args.warmup)
    else:
        min_time = args.min_time if args.min_time is not None else (0.02 if args.quick else 0.4)
        budget = Budget(min_time_s=min_time, min_iterations=3 if args.quick else 5, warmup_iterations=args.warmup)
    large_text = args.shm_large_size if args.shm_large_size is not None else ("0" if args.quick else "64M")
    large = None if large_text.strip() in ("0", "none") else parse_size(large_text)
    return BenchOptions(
        sizes=args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES),
        shm_large_bytes=large,
        transports=args.transports or (TransportKind.TCP, TransportKind.SHM),
        ops=args.ops or (TransferOp.READ, TransferOp.WRITE),
        modes=args.modes or (Mode.SINGLE, Mode.BATCH),
        batch_size=args.batch_size,
        budget=budget,
        enable_mooncake="mooncake" in args.compare,
        enable_nixl="nixl" in args.compare,
        enable_progress=not args.no_progress,
        rounds=args.rounds if args.rounds is not None else (1 if args.quick else 3),
        config=TransferConfig.from_env(**({} if args.fabric_provider is None
                                           else {"fabric_provider": args.fabric_provider})),
    )


def _preflight(args: argparse.Namespace) -> BenchOptions:
    """Checks what would otherwise fail only after the run: options, Mooncake, matplotlib, output paths.

    Raises:
        ConfigError: the message says what is wrong and how to fix it.
    """
    opts = options_from_args(args)
    if opts.enable_mooncake:
        check_available()
    if opts.enable_nixl:
        nixl_te.check_available()
    if TransportKind.FABRIC in opts.transports:
        check_fabric(opts.config)
    if args.plot:
        report.require_matplotlib()
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path and path != "-":
            folder = os.path.dirname(os.path.abspath(path))
            if not os.access(folder, os.W_OK):
                raise ConfigError(f"{flag} {path}: folder {folder} does not exist or is not writable")
    return opts


def main(args: argparse.Namespace) -> int:
    """Entry point of ``tidekv bench transfer``; returns the exit status (2: bad options, 1: run failed)."""
    try:
        opts = _preflight(args)
    except ConfigError as e:
        print(f"tidekv bench transfer: {e}", file=sys.stderr)
        return 2
    try:
        rows = run_bench(opts)
    except (TidekvError, OSError) as e:
        print(f"tidekv bench transfer failed: {e}", file=sys.stderr)
        return 1
    budget = opts.budget
    per_row = f"{budget.min_iterations} iterations" if budget.min_time_s == 0 else f"{budget.min_time_s:.2f} s"
    title = (f"tidekv bench transfer: {os.cpu_count()} CPUs, batches of {opts.batch_size}, {per_row} per row "
             f"and per baseline in {opts.rounds} interleaved rounds")
    out = sys.stderr if args.json == "-" else sys.stdout  # stdout then carries nothing but the JSON rows
    table = report.format_table(rows, table_columns(opts.enable_mooncake, opts.enable_nixl), title=title, notes=table_notes(opts))
    print(table, file=out)
    bar_lines = evaluate_bars(rows)
    if bar_lines:
        print("\nperformance bars (same-run ratios):", *bar_lines, sep="\n", file=out)
    if args.json:
        report.write_json_lines(args.json, rows)
    if args.plot:
        plot(args.plot, rows, opts.enable_mooncake)
    return 0
