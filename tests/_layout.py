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


# The layers, from the bottom up (docs/design.md, "The layers on disk"): a module imports its
# own layer's modules and those of the layers below it, never one above. A package stands for
# every module in it.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "foundation",
        (
            "aiocoll._errors",
            "aiocoll._patches",
            "aiocoll._paths",
            "aiocoll._stats",
            "aiocoll._current",
            "aiocoll._collector",
            "aiocoll._watchdog",
        ),
    ),
    ("torch internals", ("aiocoll._torch",)),
    ("a rank's process", ("aiocoll._process",)),
    ("op semantics", ("aiocoll._ops",)),
    ("the API's objects", ("aiocoll._work", "aiocoll._comm")),
    ("engine", ("aiocoll._engine",)),
    ("diagnostics", ("aiocoll._diagnostics",)),
    ("torch.distributed", ("aiocoll._c10d",)),
    ("real process groups", ("aiocoll._bridge",)),
    ("a world's run", ("aiocoll._lifecycle",)),
    ("spawn", ("aiocoll._spawn",)),
    ("torch's harnesses", ("aiocoll._harness",)),
    ("aiocoll run", ("aiocoll._cli",)),
    ("the faces", ("aiocoll", "aiocoll.testing", "aiocoll.pytest_plugin", "aiocoll.__main__")),
)


def layer_of(module: str) -> int:
    """The index in LAYERS of the layer that holds ``module`` (the longest entry that names it or its package)."""
    best, at = "", -1
    for i, (_, members) in enumerate(LAYERS):
        for m in members:
            inside = module.startswith(m + ".") and m != "aiocoll"  # the package's face holds only itself
            if (module == m or inside) and len(m) > len(best):
                best, at = m, i
    if at < 0:
        raise LookupError(f"{module} is in no layer: add it to LAYERS (and to docs/design.md)")
    return at


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


def runtime(g: dict[str, list[Import]]) -> dict[str, set[str]]:
    """The modules each module imports when it runs (those under ``TYPE_CHECKING`` left out)."""
    return {m: {i.target for i in found if not i.typing_only} for m, found in g.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The modules that import each other in a loop: each strongly connected component of more
    than one module, sorted (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                out.append(sorted(part))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def _defined(tree: ast.AST) -> set[str]:
    """The attribute names the module's classes define (methods, class attributes, slots, ``self.x = ...``)."""
    out: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.ClassDef) and not any("Protocol" in ast.unparse(b) for b in n.bases):
            for b in n.body:
                if isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    out.add(b.name)
                elif isinstance(b, ast.AnnAssign) and isinstance(b.target, ast.Name):
                    out.add(b.target.id)
                elif isinstance(b, ast.Assign):
                    for t in b.targets:
                        if (
                            isinstance(t, ast.Name)
                            and t.id == "__slots__"
                            and isinstance(b.value, (ast.Tuple, ast.List))
                        ):
                            out |= {
                                e.value
                                for e in b.value.elts
                                if isinstance(e, ast.Constant) and isinstance(e.value, str)
                            }
                        elif isinstance(t, ast.Name):
                            out.add(t.id)
        elif (
            isinstance(n, ast.Attribute)
            and isinstance(n.ctx, ast.Store)
            and isinstance(n.value, ast.Name)
            and n.value.id in ("self", "cls")
        ):
            out.add(n.attr)
    return out


def private_uses_across_layers(root: Path = ROOT) -> list[str]:
    """``x._name`` where ``_name`` is an attribute that only modules of another layer define.

    Read from the text: ``self``'s own and submodules are left out, and a name that no module of
    aiocoll defines (torch's, the standard library's) is not aiocoll's to count. Within a layer a
    leading underscore is private to the layer (the engine's modules share ``EngineWork``'s
    fields); across layers, what one reads of another has a public name.
    """
    known = modules(root)
    trees = {m: ast.parse(p.read_text(encoding="utf-8")) for m, p in known.items()}
    owners: dict[str, set[str]] = {}
    for m, tree in trees.items():
        for name in _defined(tree):
            owners.setdefault(name, set()).add(m)
    short = {m.rsplit(".", 1)[-1] for m in known}
    out = []
    for m, tree in trees.items():
        # the names this module binds by importing (a module's alias, ``from .. import _torch``)
        bound = {
            a.asname or a.name.split(".")[0]
            for n in ast.walk(tree)
            if isinstance(n, (ast.Import, ast.ImportFrom))
            for a in n.names
        }
        for n in ast.walk(tree):
            if not (isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__")):
                continue
            if isinstance(n.value, ast.Name) and (
                n.value.id in ("self", "cls") or (n.attr in short and n.value.id in bound)  # (a submodule)
            ):
                continue
            defining = owners.get(n.attr, set())
            if not defining or m in defining:
                continue
            try:
                if any(layer_of(d) == layer_of(m) for d in defining):
                    continue
            except LookupError:  # a tree without these layers
                continue
            out.append(f"{m}:{n.lineno}: {ast.unparse(n)}")
    return sorted(out)


def _back_up(i: Import) -> bool:
    try:
        return layer_of(i.target) > layer_of(i.source)
    except LookupError:  # a tree laid out otherwise (an older, flat one): no layers to hold
        return False


def figures(root: Path = ROOT) -> dict[str, object]:
    """The layout's figures: sizes, ``Any`` and ``Protocol`` counts, and import circles.

    ``Any`` counts the name in the syntax tree (``Any``, ``typing.Any``), not the word; a
    ``Protocol`` class is one with ``Protocol`` (generic or not) among its bases.
    """
    known = modules(root)
    lines = {m: len(p.read_text(encoding="utf-8").splitlines()) for m, p in known.items()}
    anys = protocols = 0
    for path in known.values():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Name) and node.id == "Any") or (
                isinstance(node, ast.Attribute) and node.attr == "Any"
            ):
                anys += 1
            elif isinstance(node, ast.ClassDef) and any("Protocol" in ast.unparse(b) for b in node.bases):
                protocols += 1
    g = {name: imports(name, path, known) for name, path in known.items()}
    run = runtime(g)
    typed = {m: {i.target for i in found} for m, found in g.items()}
    return {
        "modules": len(known),
        "top-level modules": len(list(root.glob("*.py"))),
        "subpackages": len(list(root.glob("*/__init__.py"))),
        "modules over 800 lines": sorted(f"{m} ({n})" for m, n in lines.items() if n > 800),
        "Any": anys,
        "Protocol classes": protocols,
        "run-time import circles": [len(c) for c in cycles(run)],
        "imports that run back up the layers": sorted(
            f"{i.source} -> {i.target}" for found in g.values() for i in found if _back_up(i)
        )
        if any(root.glob("*/__init__.py"))
        else "no layers on disk",
        "circles with the types named for the checker": [len(c) for c in cycles(typed)],
        "private names used across layers": private_uses_across_layers(root),
    }


if __name__ == "__main__":  # python tests/_layout.py [PACKAGE_DIR]: the figures of a checkout
    import sys

    for key, value in figures(Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else ROOT).items():
        print(f"{key}: {value}")
