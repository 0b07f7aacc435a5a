"""Mooncake's ``mooncake_master`` command line over a tidekv master.

The Mooncake drop-in (``plugins/mooncake``) installs a ``mooncake_master`` console script that
runs this, so deployment scripts written for Mooncake start a tidekv master unchanged. Flags are
read the way Mooncake's gflags reads them (``--flag=value``, ``--flag value``, one or two dashes,
``--flag`` / ``--noflag`` for booleans) and mapped onto ``MasterConfig``; a flag tidekv has no
counterpart for is refused naming it, never ignored. Mooncake's defaults hold where they differ
from tidekv's (lease 10 s, eviction watermark 0.90), except the address: the master binds
127.0.0.1 unless ``--rpc_address`` says otherwise (Mooncake binds 0.0.0.0). Settings not
covered by a flag still come from ``TIDEKV_MASTER_*`` variables.

Neighbours: ``tidekv.store.cli`` (``tidekv master``, the same server under tidekv's flags),
``tidekv.config.MasterConfig``, ``tidekv.compat.mooncake_store`` (whose ``etcd://`` master
addresses name the same cluster as ``--cluster_id``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from tidekv.compat.mooncake_store import MOONCAKE_CLUSTER
from tidekv.config import ENV_PREFIX, MasterConfig, field_docs, parse_etcd_endpoints
from tidekv.errors import ConfigError

logger = logging.getLogger(__name__)

T = TypeVar("T")

PROG = "mooncake_master"

_TRUE, _FALSE = ("true", "1", "yes", "t", "y"), ("false", "0", "no", "f", "n")


def parse_bool(name: str, text: str) -> bool:
    """A gflags boolean (true/false, 1/0, yes/no, t/f, y/n)."""
    lowered = text.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ConfigError(f"--{name}={text!r} is not a boolean (true or false)")


def parse_int(name: str, text: str) -> int:
    try:
        return int(text, 10)
    except ValueError:
        raise ConfigError(f"--{name}={text!r} is not an integer") from None


def _float(name: str, text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"--{name}={text!r} is not a number") from None


_DURATION_UNITS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def _lease_s(name: str, text: str) -> float:
    """Mooncake's lease flag: milliseconds, or a number with ms, s, m or h."""
    t = text.strip().lower()
    for unit in ("ms", "s", "m", "h"):
        if t.endswith(unit) and t[: -len(unit)].strip().isdigit():
            return int(t[: -len(unit)]) * _DURATION_UNITS[unit]
    if t.isdigit():
        return int(t) * 1e-3
    raise ConfigError(f"--{name}={text!r} is not a duration (milliseconds, or a number with ms, s, m or h)")


def _etcd(name: str, text: str) -> str:
    """Mooncake's "h1:2379;h2:2379" as tidekv's "http://h1:2379,http://h2:2379"."""
    items = [i.strip() for i in text.replace(";", ",").split(",") if i.strip()]
    if not items:
        raise ConfigError(f"--{name}={text!r} names no etcd endpoint")
    return ",".join(parse_etcd_endpoints(",".join(items), f"--{name}"))


def _ha_backend(name: str, text: str) -> str:
    if text.strip() != "etcd":
        raise ConfigError(f"--{name}={text!r}: tidekv masters elect their leader through etcd only")
    return "etcd"


@dataclass(frozen=True, slots=True)
class Flag:
    """One Mooncake flag: the setting it sets (here a MasterConfig field; None: consumed here) and its parser."""

    field: str | None
    parse: Callable[[str, str], Any]
    help: str = ""
    """What --help says; "" = the MasterConfig field's own docstring (its declaration)."""
    is_bool: bool = False


FLAGS: dict[str, Flag] = {
    "port": Flag("port", parse_int, "RPC port (Mooncake's legacy name of --rpc_port)"),
    "rpc_port": Flag("port", parse_int, "RPC port (default 50051)"),
    "rpc_address": Flag("host", lambda _, t: t, "address to bind and advertise (default 127.0.0.1; Mooncake: 0.0.0.0)"),
    "default_kv_lease_ttl": Flag("lease_ttl_s", _lease_s, "read lease, ms or with ms/s/m/h (default 10000)"),
    "eviction_high_watermark_ratio": Flag("high_watermark", _float),
    "eviction_ratio": Flag("eviction_ratio", _float),
    "client_ttl": Flag("client_ttl_s", _float),
    "put_start_release_timeout_sec": Flag("put_timeout_s", _float),
    "metrics_port": Flag("metrics_port", parse_int),
    "enable_ha": Flag(None, parse_bool, "elect a leader among masters through etcd (with --etcd_endpoints)", True),
    "ha_backend_type": Flag(None, _ha_backend, "leader election backend: etcd only"),
    "etcd_endpoints": Flag("etcd", _etcd, "etcd endpoints, host:port separated by ';'"),
    "ha_backend_connstring": Flag("etcd", _etcd, "the same as --etcd_endpoints, for --ha_backend_type=etcd"),
    "cluster_id": Flag("cluster", lambda _, t: t),
    "enable_offload": Flag(None, parse_bool, "accepted: tidekv's master always indexes its holders' disks", True),
    "promotion_on_hit": Flag("disk_promote", parse_bool, "bring objects read from a holder's disk back to its "
                             "memory (default false; tidekv's disk_promote)", True),
    "offload_on_evict": Flag(None, parse_bool, "spill to disk only under memory pressure (default false: every "
                             "put goes to its holder's disk; tidekv's disk_write_through off / all)", True),
}
"""The Mooncake flags tidekv's master serves; every other flag is refused."""

MOONCAKE_DEFAULTS: dict[str, Any] = {"lease_ttl_s": 10.0, "high_watermark": 0.90, "cluster": MOONCAKE_CLUSTER,
                                     "disk_write_through": "all", "disk_promote": False}
"""Mooncake's defaults where they differ from MasterConfig's (a TIDEKV_MASTER_* variable wins over them)."""


def _help(flag: Flag) -> str:
    """A flag's help: its own text, else its MasterConfig field's docstring with the default this
    command applies (Mooncake's where it differs)."""
    if flag.help or flag.field is None:
        return flag.help
    default = MOONCAKE_DEFAULTS.get(flag.field, getattr(MasterConfig(), flag.field))
    text = field_docs(MasterConfig)[flag.field].replace("``", "").rstrip(".")
    return f"{text} (default {default})"


def usage() -> str:
    width = max(len(n) for n in FLAGS) + 2
    lines = [f"usage: {PROG} [--flag=value ...]  (Mooncake's master flags, served by a tidekv master)", ""]
    lines += [f"  --{name:<{width}}{_help(flag)}" for name, flag in FLAGS.items()]
    lines += ["", "Any other flag is refused. Other settings: TIDEKV_MASTER_* variables (tidekv master --help)."]
    return "\n".join(lines)


def parse_flags(argv: Sequence[str], flags: Mapping[str, Flag] = FLAGS, prog: str = PROG) -> dict[str, Any]:
    """gflags-style arguments -> {flag name: parsed value}, for ``prog``'s ``flags`` (default:
    this command's; ``mooncake_client`` passes its own).

    Raises:
        ConfigError: naming the first flag that is unknown, unsupported, malformed or lacks a value.
    """
    values: dict[str, Any] = {}
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if not arg.startswith("-") or arg in ("-", "--"):
            raise ConfigError(f"{prog}: unexpected argument {arg!r}; flags look like --name=value")
        name, has_value, text = arg.lstrip("-").partition("=")
        flag = flags.get(name)
        negated = flags.get(name[2:]) if flag is None and name.startswith("no") and not has_value else None
        if negated is not None and negated.is_bool:
            values[name[2:]] = False
            continue
        if flag is None:
            raise ConfigError(f"{prog}: flag --{name} is not supported by tidekv's {prog} (supported: "
                              f"{', '.join('--' + n for n in flags)}; {prog} --help)")
        if not has_value:
            if flag.is_bool:
                values[name] = True
                continue
            if i >= len(args):
                raise ConfigError(f"{prog}: flag --{name} needs a value")
            text = args[i]
            i += 1
        values[name] = flag.parse(name, text)
    return values


def master_config(argv: Sequence[str], environ: dict[str, str] | None = None) -> MasterConfig:
    """The MasterConfig Mooncake's flags ask for: Mooncake's defaults < TIDEKV_MASTER_* < flags.

    Raises:
        ConfigError: a flag is refused (see ``parse_flags``), or the settings are out of range.
    """
    env = os.environ if environ is None else environ
    flags = parse_flags(argv)
    if flags.pop("enable_ha", False):
        if "etcd_endpoints" not in flags and "ha_backend_connstring" not in flags:
            raise ConfigError(f"{PROG}: --enable_ha needs --etcd_endpoints (or --ha_backend_connstring)")
    elif "etcd_endpoints" in flags or "ha_backend_connstring" in flags:
        raise ConfigError(f"{PROG}: --etcd_endpoints is used only with --enable_ha")
    flags.pop("ha_backend_type", None)
    flags.pop("enable_offload", None)
    overrides = {k: v for k, v in MOONCAKE_DEFAULTS.items() if f"{ENV_PREFIX}MASTER_{k.upper()}" not in env}
    on_evict = flags.pop("offload_on_evict", None)
    if on_evict is not None:
        overrides["disk_write_through"] = "off" if on_evict else "all"
    for name, value in flags.items():
        field = FLAGS[name].field
        assert field is not None
        overrides[field] = value
    names = {f.name for f in dataclasses.fields(MasterConfig)}
    return MasterConfig.from_env(env, **{k: v for k, v in overrides.items() if k in names})


def read_command_line(argv: Sequence[str] | None, prog: str, usage_text: Callable[[], str],
                      parse: Callable[[list[str]], T]) -> T | int:
    """What a Mooncake command's flags ask for (``parse``), after logging is set up; or its exit
    status: 0 once ``--help`` printed the usage, 2 once a refused flag was named on stderr."""
    from tidekv.logs import configure_logging

    args = sys.argv[1:] if argv is None else list(argv)
    if any(a.lstrip("-") in ("help", "helpfull", "h") for a in args):
        print(usage_text())
        return 0
    configure_logging()
    try:
        return parse(args)
    except ConfigError as exc:
        print(f"{exc}" if str(exc).startswith(prog) else f"{prog}: {exc}", file=sys.stderr)
        return 2


def main(argv: Sequence[str] | None = None) -> int:
    """Runs a tidekv master in the foreground from Mooncake's flags; 2 for refused flags."""
    from tidekv.store.cli import exposure_warning
    from tidekv.store.master.server import MasterServer

    config = read_command_line(argv, PROG, usage, master_config)
    if isinstance(config, int):
        return config
    warning = exposure_warning(config.host, PROG, config.secret)
    if warning:
        logger.warning(warning)
    logger.info("%s: tidekv master on %s:%d (lease %.3g s, watermark %.2f, client ttl %.3g s%s)", PROG,
                config.host, config.port, config.lease_ttl_s, config.high_watermark, config.client_ttl_s,
                f", etcd {config.etcd} cluster {config.cluster}" if config.etcd else "")
    MasterServer(config).serve_forever()
    return 0
