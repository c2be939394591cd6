"""The package's shape: its layers on disk, in order, and no import cycles among its modules.

Every import counts, wherever it is: at the top, inside a function (a cycle hidden in a
function is still two modules that need each other at run time), or under
``if TYPE_CHECKING:`` for the layer order (a type named from a layer above is a layer that
knows of the one above it). Cycles count run-time imports only: under ``TYPE_CHECKING`` a
module names a type for the checker, and that is how it says what it needs of another
instead of a mirror Protocol.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from _layout import LAYERS, ROOT, cycles, figures, graph, imports, layer_of, modules, runtime


def test_the_graph_sees_every_kind_of_import(tmp_path: Path) -> None:
    # the reader itself: imports at the top, in functions and for types; relative ones resolved
    # against the module's own package, a package's face counted as its own module
    pkg = tmp_path / "aiocoll"
    for rel in (
        "__init__.py",
        "_ops/__init__.py",
        "_ops/_cuda.py",
        "_engine/__init__.py",
        "_engine/_world.py",
        "_engine/_faults.py",
        "_bridge/__init__.py",
        "_bridge/_hybrid.py",
        "_bridge/_pg.py",
        "_spawn.py",
    ):
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text("", encoding="utf-8")
    src = pkg / "_engine" / "_world.py"
    src.write_text(
        "from typing import TYPE_CHECKING\n"
        "import aiocoll\n"
        "from .. import _ops as ops\n"
        "from ._faults import Fault\n"
        "if TYPE_CHECKING:\n"
        "    from .._bridge._hybrid import HybridWorld\n"
        "def f():\n"
        "    from .._ops import _cuda\n"
        "    import aiocoll._bridge._pg\n"
        "    from aiocoll._spawn import spawn\n"
        "    from .. import Comm\n",
        encoding="utf-8",
    )
    found = {(i.target, i.typing_only) for i in imports("aiocoll._engine._world", src, modules(pkg))}
    assert found == {
        ("aiocoll", False),
        ("aiocoll._ops", False),
        ("aiocoll._engine._faults", False),
        ("aiocoll._bridge._hybrid", True),
        ("aiocoll._ops._cuda", False),
        ("aiocoll._bridge._pg", False),
        ("aiocoll._spawn", False),
    }
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []
    assert layer_of("aiocoll._engine._world") == layer_of("aiocoll._engine") > layer_of("aiocoll._ops._cuda")
    with pytest.raises(LookupError):
        layer_of("aiocoll._nowhere")


def test_known_modules_are_seen() -> None:
    g = runtime(graph())
    assert {"aiocoll._engine._world", "aiocoll._comm", "aiocoll._bridge._pg", "aiocoll._ops._cuda"} <= set(g)
    assert "aiocoll._engine._world" in g["aiocoll._lifecycle._driver"]  # a guard: the parse finds real edges


def test_every_module_has_a_layer_and_every_layer_has_modules() -> None:
    names = modules()
    for m in names:
        layer_of(m)  # raises for a module in no layer
    for title, members in LAYERS:
        for member in members:
            assert any(m == member or m.startswith(member + ".") for m in names), f"{title}: {member} is not there"


def test_at_least_four_layers_are_packages_and_the_top_level_stays_small() -> None:
    subpackages = [p.parent for p in ROOT.glob("*/__init__.py")]
    top_level = list(ROOT.glob("*.py"))
    assert len(subpackages) >= 4, subpackages
    assert len(top_level) <= 20, sorted(p.name for p in top_level)


def test_no_import_cycles() -> None:
    found = cycles(runtime(graph()))
    assert not found, "modules that import each other in a loop: " + "; ".join(", ".join(c) for c in found)


def test_no_module_imports_from_a_layer_above() -> None:
    # the layers hold on disk: run-time imports and the types named for the checker alike (a
    # layer that must ask something of one above says what in a Protocol of its own)
    up = []
    for found in graph().values():
        for i in found:
            if layer_of(i.target) <= layer_of(i.source):
                continue
            kind = "names a type of" if i.typing_only else "imports"
            up.append(
                f"{i.source}:{i.line} ({LAYERS[layer_of(i.source)][0]}) {kind} {i.target} "
                f"({LAYERS[layer_of(i.target)][0]})"
            )
    assert not up, "imports that run back up the layers:\n" + "\n".join(up)


def _imports_module(path: Path, name: str) -> bool:
    """Whether ``path`` imports the top-level module ``name`` anywhere (``import name``, ``from name import ...``)."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == name for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == name:
            return True
    return False


def _reached(g: dict[str, set[str]], start: str) -> set[str]:
    """The modules ``start`` imports, and those they import, and so on (``start`` too)."""
    seen, todo = {start}, [start]
    while todo:
        for dep in g.get(todo.pop(), ()):
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def test_the_world_that_stands_for_processes_knows_no_test_harness(tmp_path: Path) -> None:
    # `aiocoll run` and its mp.spawn run on _procworld, which is no test harness's: neither they nor
    # anything they import imports unittest or the harness's modules (torch itself imports unittest,
    # so sys.modules cannot tell: the imports are read)
    g = runtime(graph())
    names = modules()
    harness = {m for m in names if layer_of(m) == layer_of("aiocoll._harness")} | {"aiocoll.testing"}
    for entry in ("aiocoll._lifecycle._procworld", "aiocoll._cli._run", "aiocoll._cli._mpspawn"):
        reached = _reached(g, entry)
        assert not reached & harness, f"{entry} reaches {sorted(reached & harness)}"
        users = sorted(m for m in reached if _imports_module(names[m], "unittest"))
        assert not users, f"{entry} reaches modules that import unittest: {users}"
    # a guard: the check sees an import of unittest where there is one, at the top or in a function
    assert _imports_module(names["aiocoll._harness._harness"], "unittest")
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from unittest import mock\n", encoding="utf-8")
    assert _imports_module(src, "unittest")
    assert "aiocoll._lifecycle._procworld" in g["aiocoll._harness._harness"]
    assert "aiocoll._lifecycle._procworld" in g["aiocoll._cli._run"]


def test_only_current_keeps_the_slots_that_say_which_rank_runs() -> None:
    # one context variable and one thread-local, in _current: a module that needs a rank's
    # own state declares a Facet there, rather than a thread-local or context variable of its own
    makers = {"local", "ContextVar"}
    found = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            named = None
            if isinstance(node, ast.Call):
                named = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            elif isinstance(node, ast.ClassDef):
                bases = [b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", None) for b in node.bases]
                named = next((b for b in bases if b in makers), None)
            if named in makers:
                found.append(name)
    assert found == ["aiocoll._current", "aiocoll._current"], found


def test_the_layout_keeps_its_sizes() -> None:
    # the bounds the move into layers reached (`python tests/_layout.py` prints the figures):
    # no module too long to read whole, `Any` kept for what is truly dynamic, and a Protocol
    # only at a seam
    found = figures()
    assert found["modules over 800 lines"] == []
    anys, protocols = found["Any"], found["Protocol classes"]
    assert isinstance(anys, int)
    assert anys <= 150
    assert isinstance(protocols, int)
    assert protocols <= 8


def test_the_pytest_plugin_imports_the_watchdog_as_pytest_loads_it() -> None:
    # the watchdog writes to stderr as it was when first imported: the plugin must import it at
    # its top, which pytest runs as it loads its plugins, before it captures fd 2 for a test
    tree = ast.parse(modules()["aiocoll.pytest_plugin"].read_text(encoding="utf-8"))
    names = {
        (node.module or "") + ":" + alias.name
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and node.level == 1
        for alias in node.names
    }
    assert ":_watchdog" in names, sorted(names)
