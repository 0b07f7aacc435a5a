"""Print the directory of libtransfer_engine.so (TensorRT-LLM's MOONCAKE backend) for LD_LIBRARY_PATH.

The ``tidekv trtllm-lib`` subcommand, used as ``LD_LIBRARY_PATH=$(tidekv trtllm-lib):$LD_LIBRARY_PATH
trtllm-serve ...`` so that TensorRT-LLM's MOONCAKE cache transceiver loads tidekv's library. The
``tidekv`` command finds ``add_parser`` through the ``tidekv.commands`` entry point
(pyproject.toml) and lists the command with the line above, read without importing this module,
until the command runs. Neighbours: ``tidekv.cli`` (``PLUGIN_COMMANDS``),
``tidekv_trtllm.library_dir``.
"""

from __future__ import annotations

import argparse
import sys

from tidekv_trtllm import LIBRARY_NAME, library_dir


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    cmd = sub.add_parser(
        "trtllm-lib",
        help=f"print the directory of {LIBRARY_NAME} (TensorRT-LLM's MOONCAKE backend) for LD_LIBRARY_PATH",
        description=f"Print the directory holding tidekv's {LIBRARY_NAME}, Mooncake's C API over tidekv. "
        "Put it first on LD_LIBRARY_PATH of trtllm-serve with cache_transceiver_config: {backend: MOONCAKE}, e.g. "
        "LD_LIBRARY_PATH=$(tidekv trtllm-lib):$LD_LIBRARY_PATH. Exit status 1 when the library was not built.",
    )
    cmd.add_argument("--header", action="store_true", help="print the directory of transfer_engine_c.h instead")
    cmd.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.header:
        from tidekv_trtllm import header_dir

        print(header_dir())
        return 0
    try:
        print(library_dir())
    except FileNotFoundError as exc:
        print(f"tidekv trtllm-lib: {exc}", file=sys.stderr)
        return 1
    return 0
