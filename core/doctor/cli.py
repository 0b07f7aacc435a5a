"""The ``tidekv doctor`` subcommand: prints the report, exits 0 only when every available transport passed.

Progress goes to stderr, the report to stdout (with ``--json``, one JSON document and nothing
else). Neighbours: ``report`` (what is printed), ``tidekv.cli`` (which registers this).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from tidekv.doctor.report import diagnose, render_text, to_json
from tidekv.doctor.selftest import DEFAULT_SIZE_BYTES

EXIT_OK = 0
EXIT_FAILED = 1


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    doctor = sub.add_parser(
        "doctor",
        help="check this host: transports, settings, and a two-process self-test",
        description="Print what tidekv finds here: its version; each transport (tcp, shm, cuda, fabric) as "
        "available or unavailable and why (cross-memory attach, Yama, seccomp, libcuda, RDMA libraries and "
        "devices); host facts (transparent huge pages, Yama ptrace_scope, open-file limit); every setting's "
        "effective value and whether it came from the default or a TIDEKV_* variable (secrets show as "
        "'(set)'). Then, for each available transport, start a target engine in a child process and write "
        f"and read {DEFAULT_SIZE_BYTES >> 20} MiB of random bytes through it, compared byte for byte. "
        "Exit status: 0 when every available transport passed, 1 when one failed or a setting is invalid.",
    )
    doctor.add_argument("--json", action="store_true",
                        help="print one JSON document on stdout and nothing else there (progress stays on stderr)")
    doctor.add_argument("--timeout-s", type=_positive_seconds, default=30.0,
                        help="bound on each self-test step: starting the target, each transfer (default 30)")
    doctor.add_argument("--settings-reference", nargs="?", const="markdown", choices=("markdown", "capi"),
                        help="print the reference of every setting and TIDEKV_* variable (markdown: docs/settings.md; "
                        "capi: the C ABI's reader, plugins/trtllm/capi/settings.gen.h) and exit, checking nothing")
    doctor.set_defaults(func=run)


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return value


def run(args: argparse.Namespace) -> int:
    """Diagnoses, prints the report, and returns the exit status."""
    if args.settings_reference:
        from tidekv.config import capi_settings_header, settings_markdown

        print(settings_markdown() if args.settings_reference == "markdown" else capi_settings_header(), end="")
        return EXIT_OK
    library = logging.getLogger("tidekv")
    level = library.level
    if args.log_level is None and "TIDEKV_LOG_LEVEL" not in os.environ:
        library.setLevel(logging.WARNING)  # the self-test's engines log start and stop at INFO
    try:
        report = diagnose(timeout_s=args.timeout_s, progress=_progress)
    finally:
        library.setLevel(level)
    if args.json:
        print(json.dumps(to_json(report), indent=2))
    else:
        print(render_text(report))
    return EXIT_OK if report.is_ok else EXIT_FAILED


def _progress(line: str) -> None:
    print(f"doctor: {line}", file=sys.stderr, flush=True)
