"""The native engine's options, the typed view of them and the Python settings stay one set.

Each option is declared in ``native/common/context.h`` and bound in ``native/engine/bindings.cpp``;
``core/_native.pyi`` types it and ``tidekv.transfer.engine`` fills it from ``TransferConfig``. The
view had drifted once (``stream_copy_bytes`` missing from the stub); these checks fail on the
next drift, naming the option.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
import tidekv
from tidekv import _native
from tidekv.config import TransferConfig, native_option_names
from tidekv.transfer import engine as engine_module

NATIVE_ONLY = {"defer_bytes", "defer_grace_us"}
"""Tuning of the engine's own dispatch, not settings: left at the native defaults."""


def _native_fields() -> set[str]:
    return native_option_names(_native.EngineOptions())


def _stub_fields(class_name: str = "EngineOptions") -> set[str]:
    """The options the stub types on ``class_name``, a section's (typed as another class of the
    stub) by dotted name."""
    stub = Path(tidekv.__file__).with_name("_native.pyi")
    classes = {node.name: node for node in ast.parse(stub.read_text()).body if isinstance(node, ast.ClassDef)}
    names = set()
    for node in classes[class_name].body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            kind = ast.unparse(node.annotation)
            if kind in classes:
                names |= {f"{node.target.id}.{inner}" for inner in _stub_fields(kind)}
            else:
                names.add(node.target.id)
    return names


def test_the_stub_types_every_native_option() -> None:
    native, stub = _native_fields(), _stub_fields()
    assert native - stub == set(), f"core/_native.pyi lacks {sorted(native - stub)}"
    assert stub - native == set(), f"core/_native.pyi types options the engine has not: {sorted(stub - native)}"


def test_the_engine_fills_every_native_option_from_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    native = _native_fields()
    written: set[str] = set()

    class Recording:
        def __init__(self, prefix: str = "") -> None:
            object.__setattr__(self, "prefix", prefix)

        def __getattr__(self, section: str) -> Recording:
            return Recording(f"{self.prefix}{section}.")

        def __setattr__(self, name: str, value: Any) -> None:
            written.add(self.prefix + name)

    monkeypatch.setattr(engine_module._native, "EngineOptions", Recording)
    engine_module._native_options("127.0.0.1", 0, TransferConfig())
    unset = native - NATIVE_ONLY - written
    assert unset == set(), f"tidekv.transfer.engine leaves native options at their C++ defaults: {sorted(unset)}"
    assert written <= native, f"sets options the engine has not: {sorted(written - native)}"


def test_transport_kind_names_exactly_the_native_registry() -> None:
    """``TransportKind`` (what users write) and the native registry (what the engine has) are one
    list: a transport added in ``native/transport/registry.cpp`` fails here until it is named."""
    from tidekv.config import TransportKind
    from tidekv.transfer.transports import built_transports

    registry = [name for name, _, _ in built_transports(TransferConfig())]
    assert [k.value for k in TransportKind] == ["auto", *registry]
