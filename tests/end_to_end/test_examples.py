"""Examples and the demo are run, so they never rot."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_there_are_examples() -> None:
    assert any(p.name == "quickstart.py" for p in EXAMPLES)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(path: Path) -> None:
    r = _run(str(path))
    assert r.returncode == 0, r.stdout + r.stderr


def test_quickstart_output() -> None:
    r = _run(str(ROOT / "examples" / "quickstart.py"))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines == [f"rank {i}: [6.0, 6.0, 6.0, 1.5, 1.5]" for i in range(4)]


def test_demo() -> None:
    r = _run("-m", "aiocoll", "--world", "4")
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    # the live view: frames while the ranks train (each computing or waiting for slower
    # ranks; which, depends on timing), then the last frame once all are done
    waiting = r"waiting in all_reduce\(float32\[4\], op=ReduceOp.SUM\) #\d on group 'world' for ranks \[[\d, ]+\]"
    doing = f"(computing|{waiting})"
    assert re.search(rf"^  rank 3 \[#*\.+\] {doing}$", out, re.MULTILINE), out
    for i in range(4):
        assert f"rank {i} [########] returned" in out
    assert "rank 3: all_reduce=10" in out
    assert "CollectiveMismatchError" in out
    assert "rank 2: broadcast(float32[2], src=0)" in out
    assert "DeadlockError" in out
    assert "rank 3: returned" in out
    assert "µs per op" in out


def test_broken_example_report_reads_well() -> None:
    r = _run(str(ROOT / "examples" / "broken_training.py"))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].endswith("ranks called different collectives as call #4 of group 'world':")
    assert lines[3].startswith("  rank 2: barrier() at ")
    assert lines[3].endswith("broken_training.py:31")
    record = lines[lines.index("aiocoll: flight recorder, the last 8 operations of each rank (oldest first):") :]
    assert record[1].split() == ["call", "rank", "0", "rank", "1", "rank", "2", "rank", "3"]
    rows = [line.split() for line in record[2:] if line.strip()]
    assert [row[1] for row in rows] == ["#0", "#1", "#2", "#3", "#4"]
    cells = " ".join(rows[-1][2:]).split(" MISMATCH")
    assert [c.strip() for c in cells] == ["all_reduce AVG f32[4]"] * 2 + ["barrier", "all_reduce AVG f32[4]", ""]
