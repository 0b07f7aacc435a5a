"""The ``tidekv`` command's plugin commands: listed from their entry points without importing the
plugin, loaded with their real parser when run (``tidekv.cli.PLUGIN_COMMANDS``)."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points

from tidekv.cli import PLUGIN_COMMANDS

_HELP_THEN_LOADED = """
import sys
from tidekv.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print("plugin imported:", "tidekv_trtllm" in sys.modules)
"""


def _tidekv(*argv: str) -> str:
    run = subprocess.run([sys.executable, "-c", _HELP_THEN_LOADED, *argv], capture_output=True, text=True,
                         timeout=60, check=True)
    return run.stdout


def test_the_trtllm_command_is_an_entry_point() -> None:
    (entry,) = [e for e in entry_points(group=PLUGIN_COMMANDS) if e.name == "trtllm-lib"]
    assert entry.value == "tidekv_trtllm.cli:add_parser"


def test_help_lists_a_plugin_command_with_its_summary_without_importing_the_plugin() -> None:
    out = _tidekv("--help")
    listing = " ".join(out.split())
    assert "trtllm-lib print the directory of libtransfer_engine.so (TensorRT-LLM's MOONCAKE backend) " \
           "for LD_LIBRARY_PATH" in listing, out
    assert "plugin imported: False" in out


def test_a_plugin_command_has_its_own_help_once_named() -> None:
    out = _tidekv("trtllm-lib", "--help")
    assert "usage: tidekv trtllm-lib [-h] [--header]" in out
    assert "plugin imported: True" in out
