"""What ``tidekv doctor`` finds: version, host facts, transports, settings with their sources, self-tests.

``diagnose()`` gathers a ``Report``; ``to_json()`` and ``render_text()`` are its two faces. Nothing
here decides how to print or exit; ``cli`` does. Settings come from defaults and ``TIDEKV_*``
variables only: the library reads no config file (``tidekv master --config FILE`` is the one
command that does, for the master alone), so no setting has a file source. Neighbours:
``selftest`` (the two-process checks), ``tidekv.transfer.transports`` (the catalog),
``tidekv.config.settings_sources`` (values and where they came from).
"""

from __future__ import annotations

import dataclasses
import enum
import os
import platform
import resource
import sys
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tidekv import __version__
from tidekv.config import ENV_PREFIX, ENV_PREFIXES, PoolAddress, TransferConfig, settings_sources
from tidekv.doctor.selftest import Progress, SelfTestResult, SelfTestState, TargetMemory, run_selftests
from tidekv.errors import ConfigError
from tidekv.hostaddr import HOST_VARIABLE, advertised_host, default_route_source, is_loopback
from tidekv.kvcache.settings import CONNECTOR_CONFIG_ENV, MASTER_ENV
from tidekv.transfer import memory, topology, transports
from tidekv.transfer.transports import TransportStatus

CONFIG_FILE_NOTE = ("no config file is read: defaults and TIDEKV_* variables only "
                    "(`tidekv master --config FILE` is the master's own)")

OTHER_VARIABLES = {
    ENV_PREFIX + "LOG_LEVEL": "log level of tidekv commands",
    ENV_PREFIX + "MASTER": "store master host:port the engine plugins connect to",
    ENV_PREFIX + "BENCH_DEBUG": "benchmarks print per-request detail",
    ENV_PREFIX + "BUILD_JOBS": "parallel compile jobs when building the native module",
    HOST_VARIABLE: "the address every tidekv listener of a process binds and advertises (tidekv.hostaddr)",
    CONNECTOR_CONFIG_ENV: "the KV connector's settings as JSON, for TensorRT-LLM (its config has no room for them)",
}
"""TIDEKV_* variables read outside the config classes, and what each does."""


@dataclass(frozen=True, slots=True)
class HostFact:
    """One fact about this host that the transports depend on."""

    name: str
    value: str
    note: str


@dataclass(frozen=True, slots=True)
class Setting:
    """One field of a component's config: its effective value and where it came from."""

    name: str
    value: Any
    """As the config holds it (enums as their value; secrets as "(set)")."""
    source: str
    """"default" or "env TIDEKV_<NAME>"."""


@dataclass(frozen=True, slots=True)
class ComponentSettings:
    """The settings of one component (TransferConfig, ...), or why they cannot be built."""

    component: str
    env_prefix: str
    settings: tuple[Setting, ...]
    error: str | None = None


@dataclass(frozen=True, slots=True)
class Report:
    """Everything ``tidekv doctor`` found."""

    version: str
    python: str
    native_module: str
    host: tuple[HostFact, ...]
    transports: tuple[TransportStatus, ...]
    components: tuple[ComponentSettings, ...]
    other_variables: tuple[tuple[str, str, str], ...]
    """(variable, value, what it does) for the TIDEKV_* variables set outside the config classes."""
    unrecognised_variables: tuple[str, ...]
    """TIDEKV_* variables set that nothing reads (typos, settings of another version)."""
    selftests: tuple[SelfTestResult, ...]
    problems: tuple[str, ...]
    """What is wrong besides a failed self-test (e.g. an invalid variable)."""

    @property
    def is_ok(self) -> bool:
        """True when every available transport passed its self-test and nothing else is wrong."""
        return not self.problems and all(r.state is not SelfTestState.FAILED for r in self.selftests)


def diagnose(environ: Mapping[str, str] | None = None, *, timeout_s: float = 30.0,
             progress: Progress | None = None) -> Report:
    """Gathers the report: probes, settings, and a self-test over every available transport.

    Args:
        environ: the environment to read settings from; default ``os.environ``.
        timeout_s: bound on each self-test step.
        progress: called with one line per step.
    """
    env = os.environ if environ is None else environ
    problems = []
    components = tuple(_component(cls, env) for cls in ENV_PREFIXES)
    problems += [f"{c.component}: {c.error}" for c in components if c.error]
    try:
        config = TransferConfig.from_env(env)
    except ConfigError:
        config = TransferConfig()
        problems.append("transports were probed and self-tested with TransferConfig's defaults, "
                        "because the environment's TransferConfig is invalid (above)")
    statuses = tuple(transports.catalog(config))
    selftests = tuple(run_selftests(statuses, config, timeout_s=timeout_s, progress=progress))
    return Report(
        version=__version__,
        python=f"{platform.python_version()} ({sys.executable})",
        native_module=_native_module(),
        host=(*host_facts(), address_fact(env), *nic_facts(config, env)),
        transports=statuses,
        components=components,
        other_variables=tuple((name, env[name], what) for name, what in OTHER_VARIABLES.items() if name in env),
        unrecognised_variables=tuple(unrecognised_variables(env)),
        selftests=selftests,
        problems=tuple(problems),
    )


def host_facts() -> list[HostFact]:
    """Transparent huge pages, Yama, seccomp, the open-file limit, kernel and CPUs."""
    thp = memory.thp_mode()
    scope = memory.yama_ptrace_scope()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    cpus = len(os.sched_getaffinity(0))
    scope_notes = {0: "any process of the same user may attach", 1: "a process may attach to its descendants "
                   "and to processes that allow it (engines do)", 2: "only CAP_SYS_PTRACE may attach",
                   3: "no process may attach"}
    return [
        HostFact("transparent huge pages", thp or "absent",
                 "store segments may use huge pages (segment_memory auto)" if memory.thp_enabled()
                 else "off: store segments use shared memory (segment_memory auto)"),
        HostFact("yama ptrace_scope", "absent" if scope is None else str(scope),
                 "no Yama: processes of one user may attach" if scope is None else scope_notes.get(scope, "unknown")),
        HostFact("seccomp", transports.seccomp_mode(), "a filter may forbid process_vm_readv (see shm)"),
        HostFact("open files (RLIMIT_NOFILE)", f"{_limit(soft)} soft, {_limit(hard)} hard",
                 "each tcp peer takes connections_per_peer sockets on both ends"),
        HostFact("kernel", platform.release(), platform.machine()),
        HostFact("cpus", str(cpus), "usable by this process" if cpus != 2 else
                 "usable by this process; vLLM's CPU backend with a KV connector keeps no core back for its "
                 "scheduler on two: run it with VLLM_CPU_NUM_OF_RESERVED_CPU=1 (docs/guides/vllm.md)"),
    ]


def address_fact(environ: Mapping[str, str]) -> HostFact:
    """The address a listener of this host binds and advertises when its own setting is unset,
    and why (``tidekv.hostaddr``): what peers on other hosts will be told to dial."""
    master = environ.get(MASTER_ENV, "")
    try:
        if environ.get(HOST_VARIABLE):
            return HostFact("listen address", advertised_host(None, (), environ=environ), f"from ${HOST_VARIABLE}")
        if master:
            toward = PoolAddress.parse(master, f"${MASTER_ENV}").hosts
            value = advertised_host(None, toward, environ=environ)
            why = (f"the master (${MASTER_ENV}={master}) is on loopback: every peer must be on this host"
                   if is_loopback(value) else f"the interface that routes to the master (${MASTER_ENV}={master})")
            return HostFact("listen address", value, why)
        found = default_route_source()
        return HostFact("listen address", f"127.0.0.1 / {found or '127.0.0.1'}",
                        "no master named: a TransferEngine or lone master listens on loopback, an engine plugin "
                        f"without a master on the default route's interface; set ${HOST_VARIABLE} or ${MASTER_ENV}")
    except ConfigError as exc:
        return HostFact("listen address", "?", str(exc))


def nic_facts(config: TransferConfig, environ: Mapping[str, str], sysfs: str = "/sys") -> list[HostFact]:
    """Which NICs fabric sends each memory over (``tidekv.transfer.topology``): the NICs
    ``fabric_nics`` names, else the RDMA devices with an active port; nothing without NICs."""
    names = [n.strip() for n in config.fabric_nics.split(",") if n.strip() and n.strip() != "all"]
    if not names:
        names = [d for d in transports.rdma_devices() if " ACTIVE" in transports.describe_rdma_device(d)]
    nics = topology.find_nics(names, environ, sysfs)
    rows = topology.memory_nic_map(nics, topology.numa_nodes(sysfs), topology.find_gpus(sysfs))
    facts = [HostFact(f"fabric: {memory}", used, why) for memory, used, why in rows]
    missing = [name for name in names if name not in {nic.name for nic in nics}]
    if missing:
        facts.append(HostFact("fabric: NICs not found", ", ".join(missing),
                              "fabric_nics names them, but sysfs has no such RDMA device or interface"))
    return facts


def unrecognised_variables(environ: Mapping[str, str]) -> list[str]:
    """TIDEKV_* variables that no config class and no command reads."""
    known = set(OTHER_VARIABLES)
    for cls, prefix in ENV_PREFIXES.items():
        known |= {prefix + f.name.upper() for f in dataclasses.fields(cls)}
    return sorted(name for name in environ if name.startswith(ENV_PREFIX) and name not in known)


def to_json(report: Report) -> dict[str, Any]:
    """The report as one JSON-ready document."""
    return {
        "tidekv_version": report.version,
        "python": report.python,
        "native_module": report.native_module,
        "ok": report.is_ok,
        "host": [dataclasses.asdict(f) for f in report.host],
        "transports": [dataclasses.asdict(t) for t in report.transports],
        "settings": {
            "config_file": None,
            "config_file_note": CONFIG_FILE_NOTE,
            "components": [
                {"component": c.component, "env_prefix": c.env_prefix, "error": c.error,
                 "settings": [{"name": s.name, "value": s.value, "source": s.source} for s in c.settings]}
                for c in report.components
            ],
            "other_variables": [{"name": n, "value": v, "meaning": m} for n, v, m in report.other_variables],
            "unrecognised_variables": list(report.unrecognised_variables),
        },
        "selftest": [
            {"transport": r.transport, "memory": r.memory.value, "state": r.state.value, "size_bytes": r.size_bytes,
             "byte_checked": r.is_byte_checked, "write_mib_s": _round(r.write_mib_s),
             "read_mib_s": _round(r.read_mib_s), "detail": r.detail}
            for r in report.selftests
        ],
        "problems": list(report.problems),
    }


def render_text(report: Report, width: int = 100) -> str:
    """The report for a terminal: one section per kind of fact, the verdict last."""
    lines = [f"tidekv {report.version}", f"  python  {report.python}", f"  native  {report.native_module}", "", "host"]
    lines += [f"  {f.name:<27} {f.value:<23} {f.note}" for f in report.host]
    lines += ["", "transports"]
    for t in report.transports:
        head = f"  {t.name:<7} {'available' if t.available else 'unavailable':<12} "
        lines.append(textwrap.fill(t.reason, width, initial_indent=head, subsequent_indent=" " * len(head)))
    lines += ["", "settings", f"  {CONFIG_FILE_NOTE}"]
    for c in report.components:
        lines.append(f"  {c.component} ({c.env_prefix}<FIELD>)")
        if c.error:
            lines.append(f"    INVALID: {c.error}")
        lines += [f"    {s.name:<27} {_show(s.value):<19} {s.source}" for s in c.settings]
    if report.other_variables:
        lines.append("  other variables")
        lines += [f"    {name:<27} {value:<19} {what}" for name, value, what in report.other_variables]
    lines += [f"  {name} is set but nothing reads it (a typo?)" for name in report.unrecognised_variables]
    lines += ["", "self-test (two processes, byte-checked)"]
    if not report.selftests:
        lines.append("  no transport is available to test")
    for r in report.selftests:
        path = _PATHS.get((r.transport, r.memory), f"{r.transport}, {r.memory.value} memory")
        head = f"  {path:<44} {r.state.value.upper():<7}"
        if r.state is SelfTestState.PASSED:
            lines.append(f"{head} {r.size_bytes >> 20} MiB: write {r.write_mib_s:,.0f} MiB/s, "
                         f"read {r.read_mib_s:,.0f} MiB/s, every byte matched")
        else:
            lines.append(f"{head} {r.detail.splitlines()[0] if r.detail else ''}")
            lines += [f"      {line}" for line in r.detail.splitlines()[1:]]
    lines += [""] + [f"problem: {p}" for p in report.problems]
    failed = [f"{r.transport} ({r.memory.value} memory)" for r in report.selftests if r.state is SelfTestState.FAILED]
    if report.is_ok:
        lines.append("OK: every available transport passed its self-test")
    else:
        lines.append(f"NOT OK: {', '.join(failed) + ' failed' if failed else 'see the problems above'}")
    return "\n".join(lines)


_PATHS = {
    ("tcp", TargetMemory.ALLOCATED): "tcp: sockets",
    ("shm", TargetMemory.ALLOCATED): "shm: peer maps allocate() memory",
    ("shm", TargetMemory.REGISTERED): "shm: cross-memory attach, registered memory",
}
"""How each self-test reaches the target's memory, in words."""


def _component(cls: type, environ: Mapping[str, str]) -> ComponentSettings:
    prefix = ENV_PREFIXES[cls]
    try:
        rows = settings_sources(cls, environ)
    except ConfigError as exc:
        return ComponentSettings(cls.__name__, prefix, (), str(exc))
    return ComponentSettings(cls.__name__, prefix, tuple(Setting(n, _plain(v), s) for n, v, s in rows))


def _plain(value: Any) -> Any:
    return value.value if isinstance(value, enum.Enum) else value


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return "-" if value is None else str(value)


def _limit(value: int) -> str:
    return "unlimited" if value == resource.RLIM_INFINITY else str(value)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def _native_module() -> str:
    from tidekv import _native

    return str(getattr(_native, "__file__", "built in"))
