"""The package's modules and the imports between them, read from the source (nothing is imported).

Shared by the tests of the package's shape (``test_structure``) and of its packaging
(``test_packaging``): a module is named by its dotted path (``aiocoll._engine._world``), and a
relative import is resolved against the package that holds the module.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "aiocoll"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the package by dotted name; a package's ``__init__.py`` is the package's name."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = [root.name, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


@dataclass(frozen=True)
class Import:
    """One module importing another: ``typing_only`` when it sits under ``if TYPE_CHECKING:``."""

    source: str
    target: str
    typing_only: bool
    line: int


def _typing_only_nodes(tree: ast.AST) -> set[int]:
    return {
        id(n)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and ast.unparse(block.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
        for stmt in block.body
        for n in ast.walk(stmt)
    }


def imports(name: str, path: Path, known: dict[str, Path]) -> list[Import]:
    """The package's modules that ``name`` (at ``path``) imports anywhere: at the top, in a function, for types.

    ``from .x import y`` counts as an import of ``x.y`` where that is a module, else of ``x``;
    ``import aiocoll.x.y`` as one of ``aiocoll.x.y`` (and so of what it runs first: its packages).
    """
    tree = ast.parse(path.read_text(encoding="utf-8"))
    typing_only = _typing_only_nodes(tree)
    here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out: list[Import] = []

    def add(target: str, node: ast.stmt) -> None:
        while target not in known and "." in target:
            target = target.rsplit(".", 1)[0]
        if target in known and target != name:
            out.append(Import(name, target, id(node) in typing_only, node.lineno))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == PACKAGE:
                    add(alias.name, node)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                if node.level > len(here):
                    raise ValueError(f"{path}: a relative import reaches outside the package")
                base = here[: len(here) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            elif node.module is not None and node.module.split(".")[0] == PACKAGE:
                module = node.module
            else:
                continue
            for alias in node.names:
                add(f"{module}.{alias.name}" if f"{module}.{alias.name}" in known else module, node)
    return out


def graph(root: Path = ROOT) -> dict[str, list[Import]]:
    """Every module's imports of the package's other modules."""
    known = modules(root)
    return {name: imports(name, path, known) for name, path in known.items()}
