"""Each setting is declared once (``tidekv.config``: a field, its docstring, its range): the checks,
the flags of ``tidekv master``/``tidekv up``, the Mooncake master's flag map, the native engine's
options and the reference page (docs/settings.md) all derive from it. These tests fail when one
side loses or gains a setting the other does not have."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import re
from pathlib import Path

import pytest
from tidekv import _native, config
from tidekv.compat import mooncake_master
from tidekv.config import ENV_PREFIXES, EtcdSecurity, MasterConfig, TransferConfig
from tidekv.errors import ConfigError
from tidekv.store import cli as store_cli

ROOT = Path(__file__).resolve().parents[1]
NATIVE_ONLY = {"host", "port", "defer_bytes", "defer_grace_us"}
"""EngineOptions fields that are no setting: the engine's address (its constructor's arguments)
and two tuning constants of the same-host path that no user sets."""


def _flags(command: str) -> set[str]:
    parser = argparse.ArgumentParser()
    store_cli.add_parsers(parser.add_subparsers())
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    return {opt for action in sub._actions for opt in action.option_strings if opt.startswith("--")} - {"--help"}


@pytest.mark.parametrize("command", ["master", "up"])
def test_every_master_setting_is_a_flag_and_every_flag_a_setting(command: str) -> None:
    master = {f.name for f in dataclasses.fields(MasterConfig)} - {"secret", "etcd_security"}  # never on a command line
    etcd = {"etcd_" + name for name in config.ETCD_MASTER_FLAGS}
    expected = {"--" + name.replace("_", "-") for name in master | etcd} | {"--config"}
    if command == "up":
        expected |= {"--segment-size", "--engine-host", "--engine-port", "--selftest", "--disk-paths", "--disk-size"}
    assert _flags(command) == expected
    assert set(config.ETCD_MASTER_FLAGS) <= {f.name for f in dataclasses.fields(EtcdSecurity)} - {"password"}


def test_mooncake_flags_name_master_settings() -> None:
    fields = {f.name for f in dataclasses.fields(MasterConfig)}
    for name, flag in mooncake_master.FLAGS.items():
        assert flag.field is None or flag.field in fields, name
        assert mooncake_master._help(flag), f"--{name} has no help"
    assert set(mooncake_master.MOONCAKE_DEFAULTS) <= fields


def test_every_setting_has_a_docstring_and_a_checked_range() -> None:
    for cls in ENV_PREFIXES:
        docs = config.field_docs(cls)
        for f in dataclasses.fields(cls):
            assert docs.get(f.name), f"{cls.__name__}.{f.name} has no docstring (its help)"
            declared = config.setting_of(f)
            if declared.low is not None:  # the declared range is what the constructor enforces
                with pytest.raises(ConfigError, match=f"{f.name}=.* is out of range"):
                    cls(**{f.name: type(declared.high)(declared.high * 2 + 1)})


def test_the_native_options_are_the_declared_settings() -> None:
    """Every TransferConfig field sets one native EngineOptions field with the same default, and
    every native field is one of them (or named in NATIVE_ONLY); the stub says the same."""
    native = _native.EngineOptions()
    attributes = config.native_option_names(native)
    declared = {}
    for f in dataclasses.fields(TransferConfig):
        name = config.native_name(f)
        assert name in attributes, f"TransferConfig.{f.name} sets EngineOptions.{name}, which does not exist"
        value = functools.reduce(getattr, name.split("."), native)
        assert value == config.native_value(f, f.default), f"defaults differ for {f.name}"
        declared[name] = f.name
    assert attributes - NATIVE_ONLY == set(declared), "an EngineOptions field no TransferConfig field declares"


def test_the_reference_page_is_current() -> None:
    page = (ROOT / "docs" / "settings.md").read_text()
    assert page == config.settings_markdown(), "regenerate: tidekv doctor --settings-reference > docs/settings.md"


def test_every_variable_the_code_reads_is_declared() -> None:
    """A ``"TIDEKV_..."`` string in the library, a plugin or the native code names a config field's
    variable, a prefix of one, or one of ``OTHER_VARIABLES``."""
    declared = {config.variable_of(cls, f.name) for cls in ENV_PREFIXES for f in dataclasses.fields(cls)}
    declared |= set(config.OTHER_VARIABLES)
    found: dict[str, Path] = {}
    for folder in ("core", "plugins", "native"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in (".py", ".cpp", ".h") and "bench" not in path.parts:
                for name in re.findall(r'"(TIDEKV_[A-Z0-9_]*[A-Z0-9])"', path.read_text(errors="replace")):
                    found.setdefault(name, path)
    unknown = {name: str(path.relative_to(ROOT)) for name, path in found.items() if name not in declared}
    assert not unknown, f"undeclared variables (add them to config.OTHER_VARIABLES or a config class): {unknown}"


def test_the_c_abi_reads_the_declared_settings() -> None:
    header = (ROOT / "plugins" / "trtllm" / "capi" / "settings.gen.h").read_text()
    assert header == config.capi_settings_header(), \
        "regenerate: tidekv doctor --settings-reference capi > plugins/trtllm/capi/settings.gen.h"
