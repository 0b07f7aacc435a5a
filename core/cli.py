"""The ``tidekv`` command: one subcommand per job, each with its own ``--help``.

Subcommands register themselves through small ``add_parser(subparsers)`` functions in the
modules that implement them, so this file only wires them together. Plugins add theirs through
the ``tidekv.commands`` entry points (``PLUGIN_COMMANDS``) and are imported only when one of
their commands runs.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

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


PLUGIN_COMMANDS = "tidekv.commands"
"""The entry-point group through which plugins add subcommands: ``<command> = "<module>:<function>"``
(pyproject.toml), where ``<function>(subparsers)`` adds the command's parser as the ``add_parser``
functions here do. ``tidekv --help`` lists such a command with the summary line of ``<module>``'s
docstring, read without importing the plugin."""


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser of the ``tidekv`` command.

    Args:
        argv: the arguments it is about to parse (default: ``sys.argv[1:]``): a plugin command
            named there is loaded with its real parser, the others are listed only.
    """
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
    from tidekv.trace import plan as trace_plan

    trace_plan.add_parser(sub)
    from tidekv.doctor import cli as doctor_cli

    doctor_cli.add_parser(sub)
    _add_plugin_commands(sub, sys.argv[1:] if argv is None else argv)
    return parser


def _add_plugin_commands(sub: argparse._SubParsersAction, argv: Sequence[str]) -> None:  # type: ignore[type-arg]
    """Adds every installed plugin's commands: the real parser of one named in ``argv`` (it runs,
    or shows its ``--help``), a placeholder for the others that only lists them in ``tidekv --help``.

    Raises:
        argparse.ArgumentError: two commands have the same name.
    """
    from importlib.metadata import entry_points

    for entry in entry_points(group=PLUGIN_COMMANDS):
        if entry.name in argv:
            entry.load()(sub)
        else:
            sub.add_parser(entry.name, help=_module_summary(entry.module), add_help=False)


def _module_summary(module: str) -> str:
    """The summary of ``module``'s docstring (its first paragraph), read from its source file without
    importing it or its package; lower-cased and without its final period, like the other
    commands' help lines. "" when the source cannot be read (the command is then listed bare)."""
    import ast
    import importlib.util

    top, *rest = module.split(".")
    spec = importlib.util.find_spec(top)
    if spec is None:
        return ""
    if not rest:
        candidates = [Path(spec.origin)] if spec.origin else []
    elif spec.submodule_search_locations:
        location = Path(next(iter(spec.submodule_search_locations)), *rest)
        candidates = [location.with_name(location.name + ".py"), location / "__init__.py"]
    else:
        return ""
    for path in candidates:
        try:
            docstring = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        except (OSError, SyntaxError, ValueError):
            continue
        summary = " ".join((docstring or "").partition("\n\n")[0].split()).rstrip(".")
        return summary[:1].lower() + summary[1:]
    return ""


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser(argv)
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
