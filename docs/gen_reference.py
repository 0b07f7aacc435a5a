"""Writes the generated reference pages of the docs site from the code: ``reference/cli.md`` from
the ``tidekv`` command's argparse parsers and ``settings.md`` from the settings' declarations
(``tidekv.config``). ``--check`` writes nothing and exits 1 naming each page that is not current
(``tests/test_docs.py`` runs it).

Run from the repository root: ``python docs/gen_reference.py [--check]``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
WIDTH = "100"
"""Columns argparse formats help for (it reads $COLUMNS), so the page is the same on every machine."""


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return list(action.choices.items())
    return []


def cli_markdown() -> str:
    """Every ``tidekv`` command's ``--help``, one section each, nested commands under theirs."""
    os.environ["COLUMNS"] = WIDTH
    from tidekv.cli import build_parser

    root = build_parser([])
    out = ["# Command line: `tidekv`\n",
           "Generated from the parsers by `python docs/gen_reference.py`; every command also answers `--help`.\n",
           "Plugin commands (`tidekv-sglang`'s and the others an installed plugin adds) show their help when "
           "named: `tidekv COMMAND --help`.\n",
           "## tidekv\n", "```text\n" + root.format_help() + "```\n"]

    def walk(prefix: str, parser: argparse.ArgumentParser, level: int) -> None:
        for name, sub in _subcommands(parser):
            title = f"{prefix} {name}"
            out.append(f"{'#' * level} {title}\n")
            if sub.add_help:
                out.append("```text\n" + sub.format_help() + "```\n")
            else:
                out.append("A plugin's command: `" + title + " --help` shows its options where it is installed.\n")
            walk(title, sub, min(level + 1, 4))

    walk("tidekv", root, 2)
    return "\n".join(out)


def settings_markdown() -> str:
    from tidekv.config import settings_markdown as render

    return render()


PAGES = {"reference/cli.md": cli_markdown, "settings.md": settings_markdown}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a page is not current")
    args = parser.parse_args(argv)
    stale = []
    for name, render in PAGES.items():
        text, path = render(), DOCS / name
        if args.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(name)
        else:
            path.write_text(text)
    if stale:
        print(f"not current: {', '.join(stale)}; regenerate with python docs/gen_reference.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
