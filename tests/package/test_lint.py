"""The project's own promises about its code: ruff clean, formatted, mypy strict."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)


needs_ruff = pytest.mark.skipif(importlib.util.find_spec("ruff") is None, reason="ruff is part of the [test] extra")


@needs_ruff
def test_ruff_check() -> None:
    r = _run(sys.executable, "-m", "ruff", "check", "aiocoll", "tests", "examples", "benchmarks", "docs/screenshots.py")
    assert r.returncode == 0, r.stdout + r.stderr


@needs_ruff
def test_ruff_format() -> None:
    r = _run(
        sys.executable,
        "-m",
        "ruff",
        "format",
        "--check",
        "aiocoll",
        "tests",
        "examples",
        "benchmarks",
        "docs/screenshots.py",
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_mypy_strict() -> None:
    pytest.importorskip("mypy", reason="mypy is part of the [test] extra")
    r = _run(sys.executable, "-m", "mypy")
    assert r.returncode == 0, r.stdout + r.stderr
