"""Mooncake's ``mooncake_client`` command (``mooncake.cli_client``): a standing store client that
contributes its memory (``--global_segment_size``) to the pool of the master at
``--master_server_address`` until SIGINT or SIGTERM, for Mooncake's "dummy client" mode.

In that mode an application's client (``MooncakeDistributedStore.setup_dummy(mem_pool_size,
local_buffer_size, server_address)``) has no memory of its own and names this process at
``--host:--port``. tidekv's ``setup_dummy`` attaches to a master at that address, so this command
relays the connections it accepts there to the master: the dummy's requests reach the master, and
its bytes go directly between its engine and the holders, this process's segment among them.

Flags are read as ``mooncake_master``'s are (gflags style, through its ``parse_flags``).
Mooncake's flags without a counterpart here (offload, the client HTTP server, tenants) are
refused, naming the flag, when set to anything but their defaults; ``--threads``,
``--http_port``, ``--start_offload_rpc_server`` and ``--metadata_server`` are accepted and select
nothing; ``--protocol rdma``/``efa`` and ``--device_names`` select fabric and its NICs. Differences: ``--host`` defaults to
``$TIDEKV_HOST``, else the address that routes to the master (Mooncake: 0.0.0.0; tidekv
refuses to advertise a wildcard), ``--port=0`` takes a free
port (logged), and with an ``etcd://`` master or a sharded pool there is no relay (a dummy client
then names the master itself; likewise with TLS to the master, which a byte relay cannot vouch for).
Neighbours: ``tidekv.compat.mooncake_store`` (the client this runs; ``setup_dummy``),
``tidekv.compat.mooncake_master`` (the master's command).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tidekv.compat.mooncake_master import Flag, parse_bool, parse_flags, parse_int, read_command_line
from tidekv.compat.mooncake_store import MooncakeDistributedStore, master_address
from tidekv.errors import ConfigError
from tidekv.hostaddr import advertised_host
from tidekv.values import PoolAddress, format_size, parse_host_port, parse_size

logger = logging.getLogger(__name__)

PROG = "mooncake_client"


@dataclass(frozen=True, slots=True)
class ClientSettings:
    """What ``mooncake_client``'s flags ask for (defaults: Mooncake's, but ``host``)."""

    host: str = ""
    """This client's address: its engine's, and where dummy clients attach ("": ``$TIDEKV_HOST``,
    else the address that routes to the master; loopback when the master is on loopback)."""
    port: int = 50052
    """Port dummy clients attach to (0: a free one)."""
    master_server_address: str = "127.0.0.1:50051"
    """The master: "host:port", or "etcd://h1:2379;h2:2379"."""
    metadata_server: str = "http://127.0.0.1:8080/metadata"
    """Mooncake's metadata service; not used."""
    global_segment_size: int = 4 << 30
    """Bytes contributed to the pool (4 GiB)."""
    local_buffer_size: int = 0
    """Bytes of staging memory (0; tidekv stages through 1 MiB at least)."""
    protocol: str = "tcp"
    """Mooncake's transport; tidekv picks shm or tcp per peer (``MC_FORCE_TCP=1``: tcp)."""
    device_names: str = ""
    """RDMA devices; not used."""
    enable_offload: bool = False
    """Keep what the master evicts on local disk (tidekv's disk tier, in
    ``MOONCAKE_OFFLOAD_FILE_STORAGE_PATH``: ``mooncake_config.offload_disk``)."""


def _text(_: str, text: str) -> str:
    return text


def _size(name: str, text: str) -> int:
    return parse_size(text, f"--{name}")


FLAGS: dict[str, Flag] = {
    "host": Flag("host", _text, "address of this client's engine and of the port dummy clients attach to "
                 "(default: $TIDEKV_HOST, else the address that routes to the master; Mooncake: 0.0.0.0)"),
    "port": Flag("port", parse_int, "port dummy clients attach to, relayed to the master (default 50052; 0: free)"),
    "master_server_address": Flag("master_server_address", _text, "the master (default 127.0.0.1:50051)"),
    "metadata_server": Flag("metadata_server", _text, "accepted, not used (tidekv's engines handshake directly)"),
    "global_segment_size": Flag("global_segment_size", _size, "memory contributed to the pool (default 4 GB)"),
    "local_buffer_size": Flag("local_buffer_size", _size, "staging memory (default 0: tidekv takes 1 MiB)"),
    "protocol": Flag("protocol", _text, "tcp (default): tidekv picks shm or tcp per peer; rdma or efa: fabric "
                     "where it runs"),
    "device_names": Flag("device_names", _text, "with --protocol rdma or efa, the NICs fabric stripes over "
                         "(mlx5_0,mlx5_1; fabric_nics)"),
    "tenant_id": Flag(None, _text, "\"default\" only"),
    "enable_offload": Flag("enable_offload", parse_bool, "keep evicted objects on local disk, in "
                           "$MOONCAKE_OFFLOAD_FILE_STORAGE_PATH (tidekv's disk tier)", True),
    "start_offload_rpc_server": Flag(None, parse_bool, "accepted; with --enable_offload tidekv always serves "
                                     "other clients' reads of its disk", True),
    "enable_http_server": Flag(None, parse_bool, "false only", True),
    "http_port": Flag(None, parse_int, "accepted, no effect (with --enable_http_server)"),
    "threads": Flag(None, parse_int, "accepted, no effect"),
}
"""The Mooncake client flags this command takes; any other is refused."""

_ONLY_DEFAULT: dict[str, tuple[Any, str]] = {
    "tenant_id": ("default", "tidekv's Mooncake drop-in has no tenants"),
    "enable_http_server": (False, "tidekv's store client has no HTTP server (the master exports metrics)"),
}
"""Flags served at their default only: the value, and why another is refused."""


def usage() -> str:
    width = max(len(n) for n in FLAGS) + 2
    lines = [f"usage: {PROG} [--flag=value ...]  (Mooncake's standing client, served by a tidekv store client)", ""]
    lines += [f"  --{name:<{width}}{flag.help}" for name, flag in FLAGS.items()]
    return "\n".join(lines)


def client_settings(argv: Sequence[str]) -> ClientSettings:
    """The settings Mooncake's client flags ask for.

    Raises:
        ConfigError: a flag is refused (see ``mooncake_master.parse_flags``), or the port is out of range.
    """
    values: dict[str, Any] = {}
    for name, value in parse_flags(argv, FLAGS, PROG).items():
        only, why = _ONLY_DEFAULT.get(name, (value, ""))
        if value != only:
            raise ConfigError(f"{PROG}: --{name}={value!r} is refused: {why} (only {only!r} is served)")
        field = FLAGS[name].field
        if field is not None:
            values[field] = value
    settings = dataclasses.replace(ClientSettings(), **values)
    if not 0 <= settings.port < 65536:
        raise ConfigError(f"{PROG}: --port={settings.port} is out of range; allowed 0 to 65535")
    master = PoolAddress.parse(master_address(settings.master_server_address), "--master_server_address")
    return dataclasses.replace(settings, host=advertised_host(settings.host, master.hosts, setting="--host"))


def join_pool(settings: ClientSettings) -> MooncakeDistributedStore:
    """A store client holding ``global_segment_size`` bytes of the pool (``MooncakeDistributedStore.setup``).

    Raises:
        ConfigError: the client could not join (the log says why), naming Mooncake's code.
    """
    store = MooncakeDistributedStore()
    code = store.setup(settings.host, settings.metadata_server, settings.global_segment_size,
                       settings.local_buffer_size, settings.protocol, settings.device_names,
                       settings.master_server_address, enable_ssd_offload=settings.enable_offload)
    if code != 0:
        raise ConfigError(f"{PROG}: could not join the pool of master {settings.master_server_address} "
                          f"(Mooncake code {code}; the log above says why)")
    return store


def relay_target(master: str) -> tuple[str, int] | None:
    """The lone master's (host, port) that dummy clients' connections go to; None for masters a
    relay cannot follow (an etcd cluster's leader, a pool sharded over several groups).

    Raises:
        ConfigError: ``master`` is no master address (see ``mooncake_store.master_address``).
    """
    pool = PoolAddress.parse(master_address(master), "--master_server_address")
    address = pool.groups[0][1].address if len(pool.groups) == 1 else None
    return None if address is None else parse_host_port(address, "--master_server_address")


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copies ``reader`` to ``writer`` until either side ends, then closes ``writer``."""
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    except ConnectionError:
        pass  # the peer went away: the connection ends, as it would without the relay
    finally:
        writer.close()


async def serve(settings: ClientSettings, stop: asyncio.Event) -> None:
    """Relays dummy clients' connections on ``host:port`` to the master until ``stop`` is set.

    Raises:
        OSError: ``host:port`` cannot be bound.
    """
    master = relay_target(settings.master_server_address)
    if master is None:
        logger.warning("%s: master %s is not one host:port, so --port is not served; dummy clients attach to the "
                       "master itself", PROG, settings.master_server_address)
        await stop.wait()
        return

    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*master)
        except OSError as exc:
            logger.warning("%s: cannot reach master %s:%d for a dummy client: %s", PROG, *master, exc)
            writer.close()
            return
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))

    server = await asyncio.start_server(relay, settings.host, settings.port)
    port = server.sockets[0].getsockname()[1]
    logger.info("%s: dummy clients attach at %s:%d (relayed to master %s:%d)", PROG, settings.host, port, *master)
    async with server:
        await stop.wait()


async def _run(settings: ClientSettings) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await serve(settings, stop)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the client until SIGINT or SIGTERM; 2 for refused flags, 1 when it cannot join or listen."""
    from tidekv import eventloop

    settings = read_command_line(argv, PROG, usage, client_settings)
    if isinstance(settings, int):
        return settings
    try:
        store = join_pool(settings)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 1
    logger.info("%s: holding %s of the pool of master %s as segment %s", PROG,
                format_size(settings.global_segment_size), settings.master_server_address, store.get_hostname())
    try:
        eventloop.run(_run(settings))
    except OSError as exc:
        print(f"{PROG}: cannot listen on {settings.host}:{settings.port}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    finally:
        store.close()
        logger.info("%s: left the pool", PROG)
    return 0


if __name__ == "__main__":
    sys.exit(main())
