"""Smoke test of the benchmark scripts: they run and print their table. Timings are not checked."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH_ALLREDUCE = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_allreduce.py"
COLUMNS = [
    "world",
    "aiocoll asyncio us",
    "aiocoll uvloop us",
    "aiocoll sync us",
    "threaded PG us",
    "PG/asyncio",
    "PG/uvloop",
    "PG/sync",
]


def test_bench_allreduce_quick() -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCH_ALLREDUCE), "--quick", "--worlds", "4"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, f"exit code {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    lines = proc.stdout.splitlines()
    headers = [line for line in lines if line.lstrip().startswith("world")]
    assert len(headers) == 1, proc.stdout
    for column in COLUMNS:
        assert column in headers[0], f"no column {column!r} in the header:\n{proc.stdout}"
    rows = [line.split() for line in lines if line.split()[:1] == ["4"]]
    assert len(rows) == 1, f"expected one row for world 4:\n{proc.stdout}"
    _world, iters, aio, uv, sync, pg, pg_aio, pg_uv, pg_sync = rows[0]
    assert iters == "20/20"
    # aiocoll (asyncio, sync adapter) always runs; the others print "n/a" (with a note) where they cannot
    assert float(aio.replace(",", "")) > 0, rows[0]
    assert float(sync.replace(",", "")) > 0, rows[0]
    for cell in (uv, pg):
        assert cell == "n/a" or float(cell.replace(",", "")) > 0, rows[0]
    for cell in (pg_aio, pg_uv, pg_sync):
        assert cell == "n/a" or cell.endswith("x"), rows[0]
    assert "total time" in proc.stdout


def test_bench_recorder_quick() -> None:
    script = BENCH_ALLREDUCE.parent / "bench_recorder.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--quick", "--worlds", "2"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[1].split() == ["world", "iters", "off", "us", "on", "us", "on/off"]
    world, iters, off, on, ratio = lines[2].split()
    assert (world, iters) == ("2", "20")
    assert float(off) > 0
    assert float(on) > 0
    assert ratio.endswith("x")
