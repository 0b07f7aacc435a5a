"""The ``tidekv master`` and ``tidekv up`` subcommands.

``master`` serves a store master in the foreground. ``up`` is the embedded default: a master
and a storage segment in one process, no other server (no etcd) — it prints where engines point:
``$TIDEKV_MASTER``, and the exact vLLM and SGLang flags (``engine_flags``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shlex
import signal
import threading
import urllib.parse
from typing import Any

from tidekv.config import (
    ENV_PREFIX,
    ETCD_MASTER_FLAGS,
    EtcdSecurity,
    MasterConfig,
    StoreConfig,
    TlsConfig,
    TransferConfig,
    add_flags,
    parse_etcd_endpoints,
    secret_from_env,
    size_flag,
)
from tidekv.errors import ConfigError
from tidekv.hostaddr import advertised_host, is_loopback
from tidekv.values import format_host_port

logger = logging.getLogger(__name__)

VLLM_CONNECTOR = "TidekvConnector"  # tidekv_vllm's name (a test checks they agree)
SGLANG_BACKEND = {"backend_name": "tidekv", "module_path": "tidekv_sglang.hicache",
                  "class_name": "TidekvHiCacheStorage", "interface_v1": 1}


def engine_flags(master: str) -> dict[str, str]:
    """The command-line flags that point each engine at ``master`` (shell-quoted, one line each)."""
    vllm = {"kv_connector": VLLM_CONNECTOR, "kv_role": "kv_both", "kv_connector_extra_config": {"master": master}}
    sglang = {**SGLANG_BACKEND, "master": master}
    return {
        "vLLM": "--kv-transfer-config " + shlex.quote(json.dumps(vllm, separators=(",", ":"))),
        "SGLang": "--enable-hierarchical-cache --hicache-mem-layout page_first --hicache-storage-backend dynamic "
                  "--hicache-storage-backend-extra-config " + shlex.quote(json.dumps(sglang, separators=(",", ":"))),
    }


def _engine_help(master: str) -> str:
    lines = [f"  {engine + ':':8}{flags}" for engine, flags in engine_flags(master).items()]
    return "\n".join(lines)


_size = size_flag("--segment-size")


def _add_master_flags(parser: argparse.ArgumentParser) -> None:
    """Every MasterConfig setting as a flag (``config.add_flags``: its docstring, default and
    range as help), --etcd-<field> for the EtcdSecurity settings a command line may carry, and
    --config; --host's default depends on the deployment, so it says how."""
    parser.add_argument("--config", metavar="FILE", help="JSON file with any of the settings below (flags win)")
    parser.add_argument("--host", default=None,
                        help="address to bind and advertise ($TIDEKV_MASTER_HOST; default $TIDEKV_HOST, else with "
                             f"--etcd the interface that routes to etcd, else {MasterConfig().host})")
    add_flags(parser, MasterConfig, skip=("host",))
    # Store clients take the same settings as $TIDEKV_ETCD_<FIELD>, which the master reads too
    # (flags win); never the password itself, which a command line would show to anyone.
    add_flags(parser, EtcdSecurity, only=ETCD_MASTER_FLAGS, prefix="etcd_")


def _etcd_security(args: argparse.Namespace, values: dict[str, Any]) -> EtcdSecurity:
    """The config file's "etcd_security" (an object) < $TIDEKV_ETCD_* < --etcd-* flags."""
    from_file = values.get("etcd_security")
    if from_file is not None and not isinstance(from_file, dict):
        raise ConfigError(f"config file {args.config}: etcd_security must be an object of "
                          f"{sorted(f.name for f in dataclasses.fields(EtcdSecurity))}")
    flags = {n: getattr(args, f"etcd_{n}") for n in ETCD_MASTER_FLAGS if getattr(args, f"etcd_{n}", None) is not None}
    if flags and not values.get("etcd"):
        raise ConfigError(f"{', '.join('--etcd-' + n.replace('_', '-') for n in flags)} given without --etcd: "
                          "a lone master uses no etcd")
    return EtcdSecurity.from_env(defaults=from_file, **flags)


def master_config_from_args(args: argparse.Namespace) -> MasterConfig:
    """Defaults < config file < $TIDEKV_MASTER_* variables < flags."""
    names = {f.name for f in dataclasses.fields(MasterConfig)}
    values: dict[str, Any] = {}
    if args.config:
        try:
            with open(args.config) as f:
                values.update(json.load(f))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read config file {args.config}: {exc}") from None
        unknown = set(values) - names
        if unknown:
            raise ConfigError(f"config file {args.config}: unknown setting(s) {sorted(unknown)}; allowed {sorted(names)}")
    env = MasterConfig.from_env(etcd_security=EtcdSecurity())  # that one is layered below
    values.update({n: getattr(env, n) for n in names if f"{ENV_PREFIX}MASTER_{n.upper()}" in os.environ})
    if env.secret is not None:  # TIDEKV_SECRET / TIDEKV_SECRET_FILE, the engines' setting
        values["secret"] = env.secret
    values.update({n: getattr(args, n) for n in names if getattr(args, n, None) is not None})
    values["etcd_security"] = _etcd_security(args, values)
    if "host" not in values:  # $TIDEKV_HOST, else the interface that routes to etcd, else loopback
        etcd = parse_etcd_endpoints(values["etcd"], "etcd") if values.get("etcd") else ()
        values["host"] = advertised_host(None, [urllib.parse.urlsplit(url).hostname or "" for url in etcd])
    return MasterConfig(**values)


def add_parsers(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    master = sub.add_parser(
        "master",
        help="run a store master (metadata, placement, leases, eviction)",
        description="Run the tidekv store master. Settings come from --config FILE, then $TIDEKV_MASTER_* "
        "variables, then flags. Serves its RPC (framed msgpack over TCP) on --port and Prometheus /metrics + /health on --metrics-port. "
        "With TIDEKV_SECRET set (or TIDEKV_SECRET_FILE naming a file that holds it), every client and standby must "
        "prove that shared secret, and the master proves it to them (challenge-response; it is never sent).",
    )
    _add_master_flags(master)
    master.set_defaults(func=_run_master)

    up = sub.add_parser(
        "up",
        help="run a master plus a storage segment in one process (the embedded default)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Start an all-in-one tidekv pool: a master and one storage segment in this process, with no\n"
        "other server. It prints the master's address and the flags that point engines at it:\n\n"
        f"{_engine_help('HOST:PORT')}\n\n"
        "or set TIDEKV_MASTER=HOST:PORT in the engines' environment (both plugins read it when their\n"
        "config names no master; the config's \"master\" wins). The vLLM connector's other\n"
        "kv_connector_extra_config keys are listed by `tidekv --help`.\n\n"
        "With TIDEKV_SECRET set (or TIDEKV_SECRET_FILE naming a file that holds it), the master, this\n"
        "segment's engine and every client must share it: peers that do not prove it are refused.",
    )
    _add_master_flags(up)
    up.add_argument("--segment-size", type=_size, default=_size("1GiB"),
                    help="memory this process contributes to the pool (default 1GiB)")
    up.add_argument("--disk-paths", default=None, metavar="DIR[,DIR...]",
                    help="keep what the master evicts from memory on these directories' disks, one file each "
                         "(the disk tier; default $TIDEKV_STORE_DISK_PATHS, else none); a restart on the same "
                         "paths keeps the objects")
    up.add_argument("--disk-size", type=size_flag("--disk-size"), default=None,
                    help="bytes of each --disk-paths directory to take, preallocated (e.g. 100GiB)")
    up.add_argument("--engine-host", default=None,
                    help="address the segment's transfer engine listens on and advertises (default $TIDEKV_HOST, "
                         "else the interface that routes to the master's --host)")
    up.add_argument("--engine-port", type=int, default=0,
                    help="port of the segment's transfer engine (default 0: any free port)")
    up.add_argument("--selftest", action="store_true",
                    help="put and get one object through the pool, print the result and exit")
    up.set_defaults(func=_run_up)


def exposure_warning(host: str, what: str, secret: str | None) -> str | None:
    """The warning for a service bound to a non-loopback ``host`` without a secret; None on
    loopback, or with a secret (then every peer must prove it)."""
    if is_loopback(host) or secret:
        return None
    return (f"{what} listens on {host}, beyond this host, and no TIDEKV_SECRET is set: anyone who reaches it "
            "can read, overwrite and remove every object; bind 127.0.0.1, or set TIDEKV_SECRET (or "
            "TIDEKV_SECRET_FILE) on every master, engine and plugin")


def _warn_if_exposed(host: str, what: str) -> None:
    warning = exposure_warning(host, what, secret_from_env())
    if warning:
        logger.warning(warning)


def _run_master(args: argparse.Namespace) -> int:
    from tidekv.store.master.server import MasterServer

    config = master_config_from_args(args)
    _warn_if_exposed(config.host, "tidekv master")
    server = MasterServer(config)
    server.serve_forever()
    return 0


def _run_up(args: argparse.Namespace) -> int:
    from tidekv.store.client.store import Store
    from tidekv.store.master.server import MasterServer

    config = master_config_from_args(args)
    _warn_if_exposed(config.host, "tidekv up's master")
    if args.engine_host:
        _warn_if_exposed(args.engine_host, "tidekv up's segment holder")
    server = MasterServer(config).start(owns_process=True)
    tls = TlsConfig.from_env()
    if config.tls_cert_file and not tls.enable:  # its own segment reaches the master as a standby would
        tls = TlsConfig(True, config.tls_ca_file or config.tls_cert_file,
                        config.tls_cert_file if config.tls_ca_file else None,
                        config.tls_key_file if config.tls_ca_file else None)
    disk = {k: v for k, v in (("disk_paths", args.disk_paths), ("disk_size_bytes", args.disk_size)) if v is not None}
    store = Store.connect(server.address, segment_size=args.segment_size, config=StoreConfig.from_env(**disk),
                          transfer_config=TransferConfig.from_env(), host=args.engine_host, port=args.engine_port,
                          tls=tls)
    try:
        info = {
            "master": server.address,
            "metrics": f"http://{format_host_port(server.config.host, server.metrics_port)}/metrics" if server.metrics_port else None,
            "segment_bytes": args.segment_size,
            "engine": store.engine.name,
            **({"disk_paths": store.config.disk_paths, "disk_bytes": store.config.disk_size_bytes}
               if store.config.disk_paths else {}),
        }
        print("tidekv is up:", json.dumps(info), flush=True)
        print(f"  point engines at the master: TIDEKV_MASTER={server.address} in their environment, or the flags\n"
              f"{_engine_help(server.address)}", flush=True)
        if args.selftest:
            payload = bytes(range(256)) * 4096
            store.put("tidekv-selftest", payload)
            ok = store.get("tidekv-selftest") == payload
            print(f"selftest: put+get of {len(payload)} bytes {'OK' if ok else 'MISMATCH'}", flush=True)
            return 0 if ok else 1
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        print("press Ctrl-C to stop", flush=True)
        stop.wait()
        return 0
    finally:
        store.close()
        server.stop()
