"""Packaging: the sdist and the wheel build, hold what they should, declare what the code needs.

The wheel is installed with ``pip install --no-deps --target`` and imported from there
(torch comes from this environment): a full install into a fresh virtualenv re-installs
torch, which is too slow for the suite; ``.ci/run`` does that.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import textwrap
import tomllib
import zipfile
from email.message import Message
from email.parser import Parser
from pathlib import Path

import _layout as layout
import pytest

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
NAME, VERSION = PROJECT["name"], PROJECT["version"]
# every module of every subpackage, as a path inside the package
MODULES = sorted(p.relative_to(ROOT / "aiocoll").as_posix() for p in (ROOT / "aiocoll").rglob("*.py"))

pytestmark = pytest.mark.skipif(importlib.util.find_spec("build") is None, reason="build is part of the [test] extra")


def _run(*cmd: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{' '.join(cmd)} failed:\n{r.stdout}\n{r.stderr}"
    return r


@pytest.fixture(scope="module")
def dists(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(sdist, wheel), built as ``python -m build`` builds them: the wheel from the sdist.

    From a copy of the tree, as the build writes ``*.egg-info`` where it runs; without
    isolation, so it needs no index (pyproject's build requirements are in [test]).
    """
    tmp = tmp_path_factory.mktemp("packaging")
    src = tmp / "src"
    junk = shutil.ignore_patterns(
        ".git", ".venv*", "*.egg-info", "build", "dist", "__pycache__", ".*_cache", ".hypothesis"
    )
    shutil.copytree(ROOT, src, ignore=junk)
    out = tmp / "dist"
    _run(sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(src), cwd=tmp)
    (sdist,) = out.glob("*.tar.gz")
    (wheel,) = out.glob("*.whl")
    return sdist, wheel


def _metadata(wheel: Path) -> Message:
    with zipfile.ZipFile(wheel) as z:
        return Parser().parsestr(z.read(f"{NAME}-{VERSION}.dist-info/METADATA").decode())


def test_file_names(dists: tuple[Path, Path]) -> None:
    sdist, wheel = dists
    assert sdist.name == f"{NAME}-{VERSION}.tar.gz"
    assert wheel.name == f"{NAME}-{VERSION}-py3-none-any.whl"


def test_wheel_contents(dists: tuple[Path, Path]) -> None:
    with zipfile.ZipFile(dists[1]) as z:
        names = set(z.namelist())
    info = f"{NAME}-{VERSION}.dist-info/"
    package = {n for n in names if not n.startswith(info)}
    # every module, the typing marker, and nothing else: no tests, no caches
    assert package == {f"aiocoll/{m}" for m in MODULES} | {"aiocoll/py.typed"}
    assert {f"{info}METADATA", f"{info}WHEEL", f"{info}RECORD", f"{info}licenses/LICENSE"} <= names


def test_sdist_contents(dists: tuple[Path, Path]) -> None:
    prefix = f"{NAME}-{VERSION}/"
    with tarfile.open(dists[0]) as t:
        names = {m.name.removeprefix(prefix) for m in t.getmembers() if m.isfile()}
    expected = {"README.md", "CHANGELOG.md", "LICENSE", "pyproject.toml", "PKG-INFO", "aiocoll/py.typed"}
    expected |= {f"aiocoll/{m}" for m in MODULES}
    # what it takes to run the suite from the sdist: conftest.py too, and what the tests run
    for folder in ("tests", "examples", "benchmarks"):
        expected |= {p.relative_to(ROOT).as_posix() for p in (ROOT / folder).rglob("*.py")}
    # the docs site's sources (the suite runs their code blocks) and its configuration
    expected |= {"mkdocs.yml", *(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").rglob("*.md"))}
    expected |= {"tests/scripts/docs_page_sample.md"}
    assert expected <= names, f"missing from the sdist: {sorted(expected - names)}"
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc") or n.startswith((".git/", ".ci/"))]


# Imported only by aiocoll.pytest_plugin, which pytest itself loads (entry point pytest11).
HOST_PROVIDED = {"pytest", "_pytest"}
KNOWN = layout.modules()


def _imports(name: str, path: Path) -> tuple[set[str], set[str], set[str]]:
    """What module ``name`` imports: (third-party names, those under ``except ImportError``, aiocoll's own modules)."""
    plain: set[str] = set()
    guarded: set[str] = set()
    own = {i.target for i in layout.imports(name, path, KNOWN)}

    def visit(node: ast.AST, in_guard: bool) -> None:
        if isinstance(node, ast.Try):
            catches = {ast.unparse(h.type) for h in node.handlers if h.type is not None}
            guard = in_guard or bool(catches & {"ImportError", "ModuleNotFoundError"})
            for stmt in node.body:
                visit(stmt, guard)
            for other in [*node.handlers, *node.orelse, *node.finalbody]:
                visit(other, in_guard)
            return
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        for n in names:
            top = n.partition(".")[0]
            if top != "aiocoll" and top not in sys.stdlib_module_names:
                (guarded if in_guard else plain).add(top)
        for child in ast.iter_child_nodes(node):
            visit(child, in_guard)

    visit(ast.parse(path.read_text(encoding="utf-8")), False)
    return plain, guarded - plain, own


def _requirement(spec: str) -> tuple[str, str | None]:
    """(distribution name, extra or None) of a Requires-Dist line."""
    name = re.match(r"[A-Za-z0-9._-]+", spec)
    assert name is not None, spec
    extra = re.search(r"""extra\s*==\s*["']([^"']+)["']""", spec)
    return name.group(0).lower(), extra.group(1) if extra else None


def test_wheel_metadata(dists: tuple[Path, Path]) -> None:
    meta = _metadata(dists[1])
    assert meta["Name"] == NAME
    assert meta["Version"] == VERSION
    assert meta["Requires-Python"] == PROJECT["requires-python"]
    assert meta["License-Expression"] == "BSD-3-Clause"
    assert meta.get_all("License-File") == ["LICENSE"]
    assert meta["Description-Content-Type"] == "text/markdown"
    # plot: the benchmarks; docs: the site (mkdocs.yml)
    assert set(meta.get_all("Provides-Extra") or []) == {"uvloop", "test", "plot", "docs"}

    reqs = [_requirement(r) for r in meta.get_all("Requires-Dist") or []]
    required = {name for name, extra in reqs if extra is None}
    by_extra = {(name, extra) for name, extra in reqs if extra is not None}
    # Declared honestly: ``import aiocoll`` needs exactly the dependencies, the modules
    # its host loads (the demo, aiocoll.testing, the pytest plugin) need nothing more
    # than those and their host, and every import the code can do without has an extra
    # of its name. (Each import name here is also its distribution's name.)
    imports = {name: _imports(name, path) for name, path in KNOWN.items()}
    core, todo = set(), ["aiocoll"]
    while todo:
        m = todo.pop()
        if m not in core and m in imports:
            core.add(m)
            todo.extend(imports[m][2])
    needed = set().union(*(imports[m][0] for m in core))
    assert "torch" in needed
    assert required == needed, f"import aiocoll needs {sorted(needed)}, the wheel requires {sorted(required)}"
    for m, (plain, guarded, _) in imports.items():
        assert plain <= required | HOST_PROVIDED, f"{m} imports {sorted(plain - required)}, undeclared"
        # (a required dependency imported where a part of it may be missing, as torch's flight
        # recorder's analyzer on an older torch, needs no extra)
        optional = guarded - required
        assert {(n, n) for n in optional} <= by_extra, f"{m} may import {sorted(optional)}: no extra for it"


def test_wheel_installs_and_imports(dists: tuple[Path, Path], tmp_path: Path) -> None:
    site = tmp_path / "site"
    _run(
        sys.executable,
        "-m",
        "pip",
        "install",
        "--no-deps",
        "--no-index",
        "--target",
        str(site),
        str(dists[1]),
        cwd=tmp_path,
    )
    probe = textwrap.dedent(
        """
        import importlib, importlib.metadata, importlib.resources, json, pkgutil, torch, aiocoll, aiocoll.testing

        async def worker(comm):
            t = torch.ones(1)
            await comm.all_reduce(t)
            return t.item()

        print(json.dumps({
            "file": aiocoll.__file__,
            "version": aiocoll.__version__,
            "dist": str(importlib.metadata.distribution("aiocoll").locate_file("")),
            "typed": (importlib.resources.files("aiocoll") / "py.typed").is_file(),
            "spawn": aiocoll.spawn(worker, world=2),
            # every module of every subpackage, imported from the installed copy
            "modules": {
                m.name: importlib.import_module(m.name).__file__
                for m in pkgutil.walk_packages(aiocoll.__path__, "aiocoll.")
                if m.name != "aiocoll.__main__"
            },
        }))
        """
    )
    # cwd is tmp_path, so the source tree is not importable; the wheel's copy is first on the path
    env = {**os.environ, "PYTHONPATH": str(site)}
    r = _run(sys.executable, "-c", probe, cwd=tmp_path, env=env)
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert Path(got["file"]).is_relative_to(site)
    assert Path(got["dist"]).resolve() == site.resolve()
    assert got["version"] == VERSION
    assert got["typed"] is True
    assert got["spawn"] == [2.0, 2.0]
    # a normal install carries every subpackage: each module of the source tree is there, and
    # is imported from the install (a subpackage left out of the wheel would come from nowhere)
    assert set(got["modules"]) == set(KNOWN) - {"aiocoll", "aiocoll.__main__"}
    assert all(Path(f).is_relative_to(site) for f in got["modules"].values()), got["modules"]
