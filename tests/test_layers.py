"""The layers of the tree: the library (``core/``) imports neither its tool layer (``tidekv.bench``,
which only the ``tidekv`` command loads) nor the engine plugins. Checked on the source's import
statements, so a lazy import inside a function counts too."""

from __future__ import annotations

import ast
from pathlib import Path

CORE = Path(__file__).resolve().parents[1] / "core"
TOOL_LAYER = ("tidekv.bench",)
PLUGINS = ("tidekv_vllm", "tidekv_sglang", "tidekv_trtllm")


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _within(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def test_the_library_imports_neither_the_tool_layer_nor_the_plugins() -> None:
    library = [p for p in sorted(CORE.rglob("*.py")) if p.parent.name != "bench" and p != CORE / "cli.py"]
    assert library, CORE
    offenders = {str(p.relative_to(CORE)): sorted(n for n in _imports(p) if _within(n, TOOL_LAYER + PLUGINS))
                 for p in library}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_command_imports_no_plugin() -> None:
    assert sorted(n for n in _imports(CORE / "cli.py") if _within(n, PLUGINS)) == []


STORE = CORE / "store"
STORE_SIDES = {
    "wire": ("tidekv.store.client", "tidekv.store.master", "tidekv.store.ha"),
    "client": ("tidekv.store.master",),
    "master": ("tidekv.store.client",),
}
"""What each side of the store may not import: the messages belong to neither side, and a client
and the master share only them (a client finds the leader through ``ha.etcd``; the master's
``ha`` part may name the client's leader key)."""


def test_each_side_of_the_store_imports_only_the_wire_and_its_own() -> None:
    offenders = {f"{side}/{p.name}": sorted(n for n in _imports(p) if _within(n, forbidden))
                 for side, forbidden in STORE_SIDES.items() for p in sorted((STORE / side).glob("*.py"))}
    assert len(offenders) > 20, offenders
    assert {k: v for k, v in offenders.items() if v} == {}
