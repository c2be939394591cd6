"""Every code block of the README and the docs site runs (``docs/``), and shows what it prints.

The rules, for whoever writes a page:

- A ```` ```python ```` block runs. The blocks of one page run in order, in one namespace
  (``__name__ == "__main__"``), in a fresh interpreter per page whose working directory is
  a new temporary one (the repository is on ``sys.path``; ``REPO`` names it).
- A ```` ```text ```` block right after a python block, marked ``<!-- docs: output -->``,
  is what that block prints: compared line by line, trailing spaces ignored; ``...`` stands
  for any text within a line, and a line of ``...`` alone for any lines.
- ``<!-- docs: pytest -->`` before a python block: the block is a test file, run by pytest.
- ``<!-- docs: skip (why) -->`` before a block: not run, and the reason is required (it
  needs torchrun, a GPU, a file the reader has...).
- ```` ```bash ```` and ```` ```console ```` blocks need a marker: ``skip (why)``, or
  ``<!-- docs: shell -->`` to run them with bash in the temporary directory (``python``
  there is the interpreter running the tests).
- Other blocks (``text`` reports, tables of output) are shown, not run.

The pages run where the ``[docs]`` extra is installed, as the site is built there: CI's
first cell (``.ci/run``), and ``pip install -e ".[docs]"`` locally. Each page starts an
interpreter that imports torch (a minute or two of CPU for the whole site), which the
other cells, whose torch the rest of the suite covers, leave out.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])

_FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w+-]*)[^\n]*$")
_MARKER = re.compile(r"^\s*<!-- docs: (?P<what>output|pytest|shell|skip)(?: \((?P<why>.+)\))? -->\s*$")
_RUN_AS_SHELL = ("bash", "console", "sh", "shell")


@dataclass
class Block:
    lang: str
    code: str
    line: int  # of the opening fence, 1-based
    marker: str | None
    why: str | None


def blocks_of(path: Path) -> list[Block]:
    lines = path.read_text(encoding="utf-8").splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        indent, start = m.group("indent"), i
        body = []
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i])
            i += 1
        j = start - 1
        while j >= 0 and not lines[j].strip():
            j -= 1
        mark = _MARKER.match(lines[j]) if j >= 0 else None
        code = textwrap.dedent("\n".join(b[len(indent) :] if b.startswith(indent) else b for b in body))
        what, why = (mark.group("what"), mark.group("why")) if mark else (None, None)
        out.append(Block(m.group("lang"), code + "\n", start + 1, what, why))
        i += 1
    return out


def matches(expected: str, got: str) -> bool:
    """``got`` fits ``expected``, where ``...`` is any text in a line and a ``...`` line any lines."""
    parts = []
    for line in expected.rstrip("\n").splitlines():
        if line.strip() == "...":
            parts.append(r"(?:.*\n)*?")
        else:
            parts.append(".*?".join(re.escape(p) for p in line.rstrip().split("...")) + r"[ \t]*\n")
    got = "\n".join(line.rstrip() for line in got.rstrip("\n").splitlines()) + "\n"
    return re.fullmatch("".join(parts), got, re.DOTALL) is not None


_DRIVER = r"""
import json, sys, traceback
page, blocks = sys.argv[1], json.load(open(sys.argv[2]))
namespace = {"__name__": "__main__"}
for i, (line, code) in enumerate(blocks):
    print(f"\0BLOCK {i}\0", end="", flush=True)
    exec(compile(code, f"{page}, block at line {line}", "exec"), namespace)
    sys.stdout.flush()
"""


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=600, check=False)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["REPO"] = str(ROOT)
    # `python` in a shell block is the interpreter running the tests (a venv not activated too)
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    return env


@pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None,
    reason="the docs' examples run where the docs extra is installed: pip install -e '.[docs]' (CI's first cell)",
)
@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_code_block_of_the_page_runs(page: Path, tmp_path: Path) -> None:
    blocks = blocks_of(page)
    where = page.relative_to(ROOT)
    for b in blocks:  # the markers' own rules first: every block that is not run says why
        if b.marker == "skip":
            assert b.why, f"{where}:{b.line}: a skipped block says why: <!-- docs: skip (why) -->"
        if b.lang in _RUN_AS_SHELL:
            assert b.marker in ("skip", "shell"), f"{where}:{b.line}: a {b.lang} block needs `skip (why)` or `shell`"
    python = [(i, b) for i, b in enumerate(blocks) if b.lang == "python" and b.marker not in ("skip", "pytest")]
    if python:
        (tmp_path / "blocks.json").write_text(json.dumps([(b.line, b.code) for _, b in python]))
        (tmp_path / "driver.py").write_text(_DRIVER)
        proc = _run([sys.executable, "driver.py", str(where), "blocks.json"], tmp_path)
        assert proc.returncode == 0, f"{where}: a block failed\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        printed = proc.stdout.split("\0BLOCK ")[1:]
        assert len(printed) == len(python)
        for (i, b), out in zip(python, printed, strict=True):
            out = out.split("\0", 1)[1]
            following = blocks[i + 1] if i + 1 < len(blocks) else None
            if following is not None and following.marker == "output":
                assert matches(following.code, out), (
                    f"{where}:{b.line}: printed\n{out}\nwhere the page shows (line {following.line})\n{following.code}"
                )
    for b in blocks:
        if b.lang == "python" and b.marker == "pytest":
            (tmp_path / "test_page_block.py").write_text(b.code)
            (tmp_path / "pytest.ini").write_text("[pytest]\n")
            pytest_cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_page_block.py"]
            proc = _run(pytest_cmd, tmp_path)
            assert proc.returncode == 0, f"{where}:{b.line}: the test block failed\n{proc.stdout[-5000:]}"
        if b.lang in _RUN_AS_SHELL and b.marker == "shell":
            proc = _run(["bash", "-euo", "pipefail", "-c", b.code], tmp_path)
            assert proc.returncode == 0, f"{where}:{b.line}: the shell block failed\n{proc.stdout}\n{proc.stderr}"


def test_the_collector_reads_markers_and_outputs() -> None:
    page = ROOT / "tests" / "scripts" / "docs_page_sample.md"
    blocks = blocks_of(page)
    assert [(b.lang, b.marker) for b in blocks] == [
        ("python", None),
        ("text", "output"),
        ("python", "skip"),
        ("bash", "shell"),
    ]
    assert blocks[2].why == "needs a GPU"
    assert blocks[0].code == 'for i in range(3):\n    print(f"line {i}")\n'  # dedented out of its list item
    assert matches("line 0\n...\nline 2\n", "line 0\nline 1\nline 2\n")
    assert matches("took ... s\n", "took 0.25 s  \n")
    assert not matches("line 0\nline 2\n", "line 0\nline 1\nline 2\n")
