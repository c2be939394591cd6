"""Every public name is documented, and the examples in the docstrings run."""

from __future__ import annotations

import ast
import doctest
import importlib
import inspect
import itertools
import pkgutil
from pathlib import Path
from types import ModuleType

import pytest

import aiocoll
import aiocoll.testing
from aiocoll import Comm, Work

PUBLIC = [name for name in aiocoll.__all__ if name != "__version__"]
TESTING_PUBLIC = list(aiocoll.testing.__all__)

# every module of the package but the demo (``python -m aiocoll``)
MODULES = sorted(
    ["aiocoll"] + [m.name for m in pkgutil.walk_packages(aiocoll.__path__, "aiocoll.") if m.name != "aiocoll.__main__"]
)
# the modules that hold the public API's runnable examples: they must keep some
WITH_EXAMPLES = {
    f"aiocoll.{m}"
    for m in (
        "_c10d._backend",
        "_comm",
        "_engine._rank",
        "_engine._engine_comm",
        "_errors",
        "_ops",
        "_spawn",
        "_stats",
        "_work",
    )
}


def _public_methods(cls: type) -> list[str]:
    """Public methods and properties defined on ``cls`` itself."""
    return sorted(
        name
        for name, member in vars(cls).items()
        if not name.startswith("_") and (inspect.isfunction(member) or isinstance(member, property))
    )


def _attribute_doc(name: str) -> str | None:
    """The docstring under a module-level ``name = ...`` in some module of aiocoll (constants have no __doc__)."""
    for path in sorted(Path(aiocoll.__file__).parent.rglob("*.py")):
        for node, nxt in itertools.pairwise(ast.parse(path.read_text(encoding="utf-8")).body):
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, ast.AnnAssign):
                targets = [node.target]
            else:
                continue
            named = any(isinstance(t, ast.Name) and t.id == name for t in targets)
            if named and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
                return str(nxt.value.value)
    return None


def _doc(obj: object) -> str:
    # the object's own docstring: inspect.getdoc would fall back on a base class's
    member = obj.fget if isinstance(obj, property) else obj
    return (getattr(member, "__doc__", None) or "").strip()


@pytest.mark.parametrize("name", PUBLIC)
def test_public_name_is_documented(name: str) -> None:
    obj = getattr(aiocoll, name)
    if inspect.isclass(obj) or callable(obj):
        doc = _doc(obj)
        assert doc, f"aiocoll.{name} has no docstring"
        assert ">>>" in doc or "::" in doc, f"aiocoll.{name}'s docstring has no example"
    else:
        assert _attribute_doc(name), f"aiocoll.{name} has no docstring under its assignment"


@pytest.mark.parametrize("name", TESTING_PUBLIC)
def test_testing_name_is_documented(name: str) -> None:
    assert _doc(getattr(aiocoll.testing, name)), f"aiocoll.testing.{name} has no docstring"


def test_replace_threaded_pg_has_an_example() -> None:
    # a code block, not a doctest: running torch's harness takes its test case classes
    assert "::" in _doc(aiocoll.testing.replace_threaded_pg)
    assert "::" in _doc(aiocoll.testing.replace_process_harness)


@pytest.mark.parametrize(
    ("cls", "name"),
    [
        (cls, name)
        for cls in (Comm, Work, aiocoll.testing.ThreadedPGReplacement, aiocoll.testing.ProcessHarnessReplacement)
        for name in _public_methods(cls)
    ],
    ids=lambda x: x.__name__ if isinstance(x, type) else str(x),
)
def test_public_method_is_documented(cls: type, name: str) -> None:
    assert _doc(vars(cls)[name]), f"{cls.__name__}.{name} has no docstring"


def test_the_method_lists_are_not_empty() -> None:
    # a guard on the parametrisation above: it must see the methods it is meant to check
    assert {"all_reduce", "recv", "new_group", "split", "global_rank", "group_name"} <= set(_public_methods(Comm))
    assert {"wait", "done", "result", "exception", "describe"} <= set(_public_methods(Work))


@pytest.mark.parametrize("module", MODULES)
def test_doctests(module: str) -> None:
    mod: ModuleType = importlib.import_module(module)
    failures, tried = doctest.testmod(mod, report=True)
    assert failures == 0, f"{failures} of {tried} doctest examples in {module} failed (see the captured stdout)"
    if module in WITH_EXAMPLES:
        assert tried > 0, f"{module} lost its doctest examples"
