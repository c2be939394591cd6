"""The package's shape: no import cycles among its modules when the code runs.

Every import that runs counts, wherever it is: at the top or inside a function (a cycle
hidden in a function is still two modules that need each other at run time). An import
under ``if TYPE_CHECKING:`` does not: it names a type for the checker and never runs, and
it is how a module says what it needs of another instead of a mirror Protocol.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = "aiocoll"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE
MODULES = sorted(p.stem for p in ROOT.glob("*.py"))


def _imports(path: Path) -> set[str]:
    """The modules of the package that ``path`` imports anywhere ("__init__" for the package itself)."""
    out: set[str] = set()
    tree = ast.parse(path.read_text(encoding="utf-8"))
    typing_only = {
        id(n)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and ast.unparse(block.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
        for stmt in block.body
        for n in ast.walk(stmt)
    }
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == PACKAGE:
                    out.add(parts[1] if len(parts) > 1 else "__init__")
        elif isinstance(node, ast.ImportFrom):
            if node.level > 1:
                pytest.fail(f"{path.name}: a relative import reaches outside the flat package")
            if node.level == 1:
                parts = node.module.split(".") if node.module else []
            elif node.module is not None and node.module.split(".")[0] == PACKAGE:
                parts = node.module.split(".")[1:]
            else:
                continue
            if parts:
                out.add(parts[0])
            else:  # from . import x / from aiocoll import x: a module, or a name of the package's own
                out.update(a.name if a.name in MODULES else "__init__" for a in node.names)
    return out


def _graph() -> dict[str, set[str]]:
    return {m: _imports(ROOT / f"{m}.py") - {m} for m in MODULES}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as [a, b, ..., a], or None if it has none (depth-first search)."""
    WHITE, GREY, BLACK = 0, 1, 2
    color = dict.fromkeys(graph, WHITE)
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        color[m] = GREY
        stack.append(m)
        for dep in sorted(graph.get(m, ())):
            if color.get(dep, BLACK) == GREY:
                return [*stack[stack.index(dep) :], dep]
            if color.get(dep) == WHITE:
                found = visit(dep)
                if found is not None:
                    return found
        stack.pop()
        color[m] = BLACK
        return None

    for m in sorted(graph):
        if color[m] == WHITE:
            found = visit(m)
            if found is not None:
                return found
    return None


def test_the_graph_sees_every_kind_of_import(tmp_path: Path) -> None:
    # the checker itself: imports at the top and in functions count, those under TYPE_CHECKING not
    src = tmp_path / "m.py"
    src.write_text(
        "from typing import TYPE_CHECKING\n"
        "import aiocoll\n"
        "from . import _ops as ops\n"
        "from ._engine import World\n"
        "if TYPE_CHECKING:\n"
        "    from ._faults import Fault\n"
        "else:\n"
        "    from ._hybrid import HybridWorld\n"
        "def f():\n"
        "    from . import _cuda\n"
        "    import aiocoll._pg\n"
        "    from aiocoll._spawn import spawn\n"
        "    from . import Comm\n",
        encoding="utf-8",
    )
    assert _imports(src) == {"__init__", "_ops", "_engine", "_hybrid", "_cuda", "_pg", "_spawn"}
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_known_modules_are_seen() -> None:
    graph = _graph()
    assert {"_engine", "_comm", "_pg", "_cuda", "_device", "_faults"} <= set(graph)
    assert "_engine" in graph["_driver"]  # a guard: the parse finds real edges


def test_no_import_cycles() -> None:
    graph = _graph()
    cycle = _cycle(graph)
    assert cycle is None, "import cycle among aiocoll's modules: " + " -> ".join(cycle or [])


def _imports_module(path: Path, name: str) -> bool:
    """Whether ``path`` imports the top-level module ``name`` anywhere (``import name``, ``from name import ...``)."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == name for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == name:
            return True
    return False


def _reached(graph: dict[str, set[str]], start: str) -> set[str]:
    """The modules ``start`` imports, and those they import, and so on (``start`` too)."""
    seen, todo = {start}, [start]
    while todo:
        for dep in graph.get(todo.pop(), ()):
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def test_the_world_that_stands_for_processes_knows_no_test_harness(tmp_path: Path) -> None:
    # `aiocoll run` and its mp.spawn run on _procworld, which is no test harness's: neither they nor
    # anything they import imports unittest or the harness's modules (torch itself imports unittest,
    # so sys.modules cannot tell: the imports are read)
    graph = _graph()
    harness = {"_harness", "_continuous", "testing"}
    for entry in ("_procworld", "_run", "_mpspawn"):
        reached = _reached(graph, entry)
        assert not reached & harness, f"{entry} reaches {sorted(reached & harness)}"
        users = sorted(m for m in reached if _imports_module(ROOT / f"{m}.py", "unittest"))
        assert not users, f"{entry} reaches modules that import unittest: {users}"
    # a guard: the check sees an import of unittest where there is one, at the top or in a function
    assert _imports_module(ROOT / "_harness.py", "unittest")
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from unittest import mock\n", encoding="utf-8")
    assert _imports_module(src, "unittest")
    assert "_procworld" in graph["_harness"]
    assert "_procworld" in graph["_run"]


def test_only_current_keeps_the_slots_that_say_which_rank_runs() -> None:
    # one context variable and one thread-local, in _current: a module that needs a rank's
    # own state declares a Facet there, rather than a thread-local or context variable of its own
    makers = {"local", "ContextVar"}
    found = []
    for path in sorted(ROOT.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            named = None
            if isinstance(node, ast.Call):
                named = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            elif isinstance(node, ast.ClassDef):
                bases = [b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", None) for b in node.bases]
                named = next((b for b in bases if b in makers), None)
            if named in makers:
                found.append(f"{path.stem}:{node.lineno}")
    assert [f.split(":")[0] for f in found] == ["_current", "_current"], found
