"""The ``tidekv`` command: one subcommand per job, each with its own ``--help``.

Subcommands register themselves through small ``add_parser(subparsers)`` functions in the
modules that implement them, so this file only wires them together.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import logging

from tidekv import __version__
from tidekv.errors import TidekvError
from tidekv.logs import configure_logging


def _engines_epilog() -> str:
    """How engines use tidekv: the vLLM connector and its JSON, the SGLang backend."""
    import dataclasses
    import textwrap

    from tidekv.kvcache.settings import MASTER_ENV, KVConnectorConfig
    from tidekv.store.cli import engine_flags

    keys = textwrap.fill(", ".join(f"{f.name} ({f.default!r})" for f in dataclasses.fields(KVConnectorConfig)),
                         width=92, initial_indent="    ", subsequent_indent="    ")
    flags = engine_flags("HOST:PORT")
    return f"""\
engines (install tidekv into the engine's environment):
  vLLM: the KV connector TidekvConnector (registered by tidekv's vllm.general_plugins entry
  point), for PD disaggregation behind `tidekv proxy` and prefix reuse through the store:
    python -m vllm.entrypoints.openai.api_server --model M {flags["vLLM"]}
  kv_role: kv_both, kv_producer (prefill) or kv_consumer (decode). kv_connector_extra_config
  keys (default; unknown ones are refused, by a server before its model loads):
{keys}
  Without "master" (null: no store) the connector reads ${MASTER_ENV}.
  SGLang: HiCache storage backend (its "master" also defaults to ${MASTER_ENV}):
    {flags["SGLang"]}
  `tidekv up` starts a pool and prints these flags with its address."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tidekv",
        description="tidekv: KV-cache transfer engine and distributed KV store for disaggregated LLM serving.",
        epilog=_engines_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"tidekv {__version__}")
    parser.add_argument("--log-level", default=None, help="DEBUG, INFO, WARNING or ERROR (default: INFO or $TIDEKV_LOG_LEVEL)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    from tidekv.store import cli as store_cli

    store_cli.add_parsers(sub)

    bench = sub.add_parser("bench", help="measure tidekv against same-run baselines", description="Benchmarks.")
    bench_sub = bench.add_subparsers(dest="bench", metavar="BENCH")
    bench_sub.required = True
    from tidekv.bench import transfer as bench_transfer

    bench_transfer.add_parser(bench_sub)
    from tidekv.bench import master_scale

    master_scale.add_parser(bench_sub)
    from tidekv.bench import store as bench_store

    bench_store.add_parser(bench_sub)
    from tidekv.bench import weights as bench_weights

    bench_weights.add_parser(bench_sub)
    from tidekv.bench import mixed as bench_mixed

    bench_mixed.add_parser(bench_sub)
    from tidekv.bench import failover as bench_failover

    bench_failover.add_parser(bench_sub)
    from tidekv.bench import gpu as bench_gpu

    bench_gpu.add_parser(bench_sub)
    from tidekv import proxy as proxy_cli

    proxy_cli.add_parser(sub)
    from tidekv.trace import cli as trace_cli

    trace_cli.add_parser(sub)
    from tidekv.doctor import cli as doctor_cli

    doctor_cli.add_parser(sub)
    from tidekv_trtllm import cli as trtllm_cli

    trtllm_cli.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    try:
        result = args.func(args)
    except TidekvError as exc:
        logging.getLogger("tidekv").error("%s", exc)
        return 2
    except KeyboardInterrupt:
        return 130
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
