"""Smoke test of the benchmark scripts: they run and print their table. Timings are not checked."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.bench_smoke

BENCH_ALLREDUCE = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_allreduce.py"
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


def _off_on_row(script: str, *args: str) -> tuple[list[str], list[str]]:
    """Run an off-vs-on benchmark (``--quick``): the names and values of its first row's leading columns.

    The row's last three columns (off, on, on/off) are checked here.
    """
    proc = subprocess.run(
        [sys.executable, str(BENCH_ALLREDUCE.parent / script), "--quick", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[1].split()[-5:] == ["off", "us", "on", "us", "on/off"]
    row = lines[2].split()
    off, on, ratio = row[-3:]
    assert float(off) > 0
    assert float(on) > 0
    assert ratio.endswith("x")
    return lines[1].split()[:-5], row[:-3]


def test_bench_recorder_quick() -> None:
    assert _off_on_row("bench_recorder.py", "--worlds", "2") == (["world", "iters"], ["2", "20"])


def test_bench_gather_quick() -> None:
    assert _off_on_row("bench_gather.py") == (["wait", "tasks", "ops"], ["gather", "20", "5"])


BENCH_SUITE = BENCH_ALLREDUCE.parent / "bench_suite.py"
SUITE_SYSTEMS = ["floor", "threaded PG", "gloo", "aiocoll async", "aiocoll sync"]
SUITE_WORKLOADS = ("allreduce_1", "allreduce_16MB", "allgather_4MB", "startup", "memory")


def _run_suite_quick(tmp_path: Path, *extra: str) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    out = tmp_path / "results.json"
    cmd = [sys.executable, str(BENCH_SUITE), "--quick", "--json", str(out), "--plot", str(tmp_path / "r.png"), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, f"exit code {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc, json.loads(out.read_text())


def test_bench_suite_quick(tmp_path: Path) -> None:
    """``--quick`` runs every workload and system once and reports them in the table, targets and JSON."""
    proc, data = _run_suite_quick(tmp_path, "--no-plot")
    lines = proc.stdout.splitlines()
    header = next(line for line in lines if line.startswith("workload"))
    for column in [*SUITE_SYSTEMS, "PG/async", "PG/sync", "async/floor"]:
        assert column in header, proc.stdout
    rows = [tuple(line.split()[:2]) for line in lines if line.startswith(SUITE_WORKLOADS)]
    expected = [("allreduce_1", "4"), ("allreduce_1", "16"), ("allreduce_16MB", "4"), ("allgather_4MB", "4")]
    assert rows == [*expected, ("startup", "4"), ("memory", "16")], proc.stdout
    assert "Targets (ratios of medians measured in this run):" in proc.stdout
    start = lines.index("Targets (ratios of medians measured in this run):") + 1
    verdicts = [line.split()[0] for line in lines[start : lines.index("", start)]]
    assert len(verdicts) == 12  # one line per target of the suite
    assert set(verdicts) <= {"PASS", "FAIL", "n/a"}
    assert "W=4 repeat 1/1 aiocoll async allreduce_1:" in proc.stderr  # progress goes to stderr

    assert set(data) >= {"machine", "plan", "cells", "targets", "wall_time_s", "aiocoll_config", "command"}
    assert data["machine"]["cpu_count"] >= 1
    assert set(data["machine"]) >= {"torch", "python", "platform", "date"}
    assert len(data["cells"]) == 6
    for cell in data["cells"]:
        assert set(cell["systems"]) == set(SUITE_SYSTEMS)
        for name, system in cell["systems"].items():
            where = f"{cell['workload']} W={cell['world']} {name}"
            assert system["status"] in ("ok", "capped", "skipped", "n/a"), where
            if system["status"] == "ok":
                assert len(system["samples"]) == 1, where
                assert all(s > 0 for s in system["samples"]), where
                assert system["median"] > 0, where
            else:
                assert system["median"] is None, where
                assert system["note"], where
        systems = cell["systems"]
        # aiocoll and the threaded PG run every cell of the quick plan; gloo runs at W=4 only, and not for memory
        for name in ("aiocoll async", "aiocoll sync", "threaded PG"):
            assert systems[name]["status"] == "ok", (cell["workload"], cell["world"], systems[name])
        if cell["world"] == 16:  # --quick caps gloo at 4 processes
            assert systems["gloo"]["status"] == "capped"
    assert [t["pass"] for t in data["targets"]].count(None) == 8  # --quick measures the 4 targets at W=4 only
    assert not (tmp_path / "r.png").exists()


def test_bench_suite_plot(tmp_path: Path) -> None:
    """The plot of a small run is written where ``--plot`` says (skipped without matplotlib)."""
    pytest.importorskip("matplotlib")
    _run_suite_quick(tmp_path, "--workloads", "allreduce_1", "--systems", "floor", "async", "--worlds", "2", "4")
    png = (tmp_path / "r.png").read_bytes()
    assert png.startswith(b"\x89PNG")
    assert len(png) > 10_000


def test_bench_suite_without_matplotlib(tmp_path: Path) -> None:
    """Without matplotlib the suite still runs, and says why there is no plot."""
    blocker = tmp_path / "block"
    blocker.mkdir()
    (blocker / "matplotlib.py").write_text("raise ImportError('blocked for the test')\n")
    out = tmp_path / "results.json"
    cmd = [sys.executable, str(BENCH_SUITE), "--quick", "--workloads", "allreduce_1", "--systems", "floor"]
    cmd += ["--worlds", "2", "--json", str(out), "--plot", str(tmp_path / "r.png")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(blocker), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "no plot: matplotlib is not installed" in proc.stdout
    assert not (tmp_path / "r.png").exists()
    assert json.loads(out.read_text())["cells"][0]["systems"]["floor"]["median"] > 0


def test_bench_process_group_quick() -> None:
    script = BENCH_ALLREDUCE.parent / "bench_process_group.py"
    proc = subprocess.run([sys.executable, str(script), "--quick"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # gloo of torch 2.10 prints "[Gloo] Rank 0 is connected to 1 peer ranks..." from each
    # process to the shared stdout, interleaved: the table starts after its title line
    lines = proc.stdout.splitlines()
    title = next((i for i, line in enumerate(lines) if line.startswith("gloo, ")), None)
    assert title is not None, proc.stdout
    assert lines[title + 1].split() == ["path", "iters", "us", "per", "op", "overhead", "us", "vs", "blocking"]
    blocking = [line.split() for line in lines if "dist.all_reduce(t)" in line]
    bridged = [line.split() for line in lines if "aiocoll on asyncio" in line]
    assert blocking, proc.stdout
    assert bridged, proc.stdout
    assert float(blocking[0][2]) > 0
    assert float(bridged[0][4]) > 0
    assert bridged[0][-1].endswith("x")


def test_bench_checks_quick() -> None:
    script = BENCH_ALLREDUCE.parent / "bench_checks.py"
    proc = subprocess.run([sys.executable, str(script), "--quick"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    on = [line.split() for line in proc.stdout.splitlines() if line.strip().startswith("check on ")]
    off = [line.split() for line in proc.stdout.splitlines() if line.strip().startswith("check off ")]
    assert on, proc.stdout
    assert off, proc.stdout
    assert float(on[0][3]) > 0  # us per op, measured
    assert float(off[0][3]) > 0
    assert "the check costs" in proc.stdout


def test_bench_run_checks_quick() -> None:
    script = BENCH_ALLREDUCE.parent / "bench_run_checks.py"
    proc = subprocess.run([sys.executable, str(script), "--quick"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line.split(" | ") for line in proc.stdout.splitlines() if line.startswith("| all_reduce 1 |")]
    assert len(rows) == 1, proc.stdout
    plain, checked, ratio = rows[0][1:4]
    assert float(plain.split()[0]) > 0  # measured, both systems
    assert float(checked.split()[0]) > 0
    assert ratio.rstrip(" |").endswith("x")
    assert "| ddp step |" in proc.stdout


BENCH_CEILINGS = BENCH_ALLREDUCE.parent / "bench_ceilings.py"
CEILING_SYSTEMS = [
    "threaded PG",
    "bare asyncio",
    "bare threads",
    "bare turns",
    "W*dist overhead",
    "floor",
    "aiocoll async",
    "aiocoll sync",
]
CEILING_RATIOS = [
    "PG/bare-async",
    "PG/bare-threads",
    "PG/bare-turns",
    "PG/aiocoll-async",
    "PG/aiocoll-sync",
    "PG/W*dist",
    "bare-async/floor",
    "aiocoll-async/floor",
]


def test_bench_ceilings_quick(tmp_path: Path) -> None:
    """``--quick`` measures every system at W=4 and prints one table row, the targets' lines and the JSON."""
    out = tmp_path / "ceilings.json"
    cmd = [sys.executable, str(BENCH_CEILINGS), "--quick", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, f"exit code {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    lines = proc.stdout.splitlines()
    # columns are two or more spaces apart; cells such as "8.4 us" hold single spaces
    table = [re.split(r"\s{2,}", line.strip()) for line in lines if re.match(r"\s*(W|\d+)\s{2,}", line)]
    assert len(table) == 2, proc.stdout  # the header and the one row of --quick (W=4)
    header, row = table
    assert header == ["W", *CEILING_SYSTEMS, *CEILING_RATIOS], proc.stdout
    assert row[0] == "4"
    for cell in row[1 : 1 + len(CEILING_SYSTEMS)]:  # every system ran: a time, not "n/a" or "capped"
        assert re.fullmatch(r"\d[\d.]* (us|ms|s)", cell), row
        assert float(cell.split()[0]) > 0, row
    for cell in row[1 + len(CEILING_SYSTEMS) :]:
        assert re.fullmatch(r"\d[\d.]*x", cell), row
    # the targets' lines state what the bare designs reach (facts, not PASS/FAIL)
    assert re.search(r"^  bare asyncio: [\d.]+x PG at W=4; target 25x", proc.stdout, re.MULTILINE), proc.stdout
    assert re.search(r"^  bare threads: [\d.]+x PG at W=4; target 2x", proc.stdout, re.MULTILINE), proc.stdout
    assert "bare asyncio loop: " in proc.stdout
    assert "W=4 repeat 2/2 bare threads: " in proc.stderr  # progress goes to stderr

    data = json.loads(out.read_text())
    assert data["plan"]["worlds"] == [4]
    (cell,) = data["cells"]
    assert set(cell["systems"]) == set(CEILING_SYSTEMS)
    for name, system in cell["systems"].items():
        assert system["status"] == "ok", (name, system)
        assert len(system["samples"]) == 2, name
        assert system["median"] > 0, name
    assert set(cell["systems"]["floor"]["variants"]) == {"stack_sum", "chained_add", "stack_sum_foreach"}


def test_bench_process_harness_in_process(tmp_path: Path) -> None:
    """The harness comparison runs a test file's process-starting tests and tabulates them (aiocoll's side only)."""
    script = BENCH_ALLREDUCE.parent / "bench_process_harness.py"
    tests = Path(__file__).resolve().parents[1] / "harness" / "test_process_harness.py"
    out = tmp_path / "r.json"
    cmd = [sys.executable, str(script), str(tests), "-k", r"Basics\.test_(leaves|init)", "--mode", "aiocoll"]
    # the benchmark puts the test file's folder on sys.path; its helpers (_unittest_runs) are in tests/
    path = os.pathsep.join(filter(None, [str(tests.parents[1]), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path)
    proc = subprocess.run([*cmd, "--json", str(out)], capture_output=True, text=True, timeout=300, check=False, env=env)
    assert proc.returncode == 0, f"exit code {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    row = next(line for line in proc.stdout.splitlines() if line.startswith("test_process_harness.py"))
    assert row.split()[:5] == ["test_process_harness.py", "2", "-", "-", "2/0/0"], proc.stdout
    data = json.loads(out.read_text())["test_process_harness.py"]["aiocoll"]
    assert sorted(data["outcomes"].values()) == ["pass", "pass"]
    assert data["exit"] == 0


def test_bench_cuda_quick_on_the_cpu() -> None:
    # the GPU benchmark's own logic (checked first ops, the table) runs anywhere with --device cpu
    proc = subprocess.run(
        [sys.executable, str(BENCH_ALLREDUCE.parent / "bench_cuda.py"), "--quick", "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    header = lines[1].split()
    assert header[:4] == ["op", "W", "size", "iters"]
    rows = [line.split() for line in lines if line.split()[:1] in (["all_reduce"], ["all_gather"])]
    assert [r[:4] for r in rows] == [["all_reduce", "2", "1", "3"], ["all_gather", "2", "1", "3"]]
    for row in rows:
        assert all(float(cell.replace(",", "")) > 0 for cell in row[4:8]), row  # every system ran
        assert all(cell.endswith("x") for cell in row[8:]), row
    assert "could not run" not in proc.stdout


def test_bench_run_quick() -> None:
    bench = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_run.py"
    proc = subprocess.run(
        # (one case: the script's table and ratios; DDP training runs under both launchers in
        # test_run_conformance, and each torchrun start costs 10 s or more on a loaded CI core)
        [sys.executable, str(bench), "--rounds", "1", "--cases", "small"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for row in ("small: torchrun", "small: aiocoll run", "small: aiocoll run --processes", "small: spawn (python -c)"):
        assert re.search(rf"^{re.escape(row)} +\d+\.\d\d ", proc.stdout, re.MULTILINE), proc.stdout
    assert "torchrun / aiocoll run" in proc.stdout
    assert "torchrun / aiocoll run --processes" in proc.stdout
    assert "ddp:" not in proc.stdout


BENCH_TEST_FILES = BENCH_ALLREDUCE.parent / "bench_test_files.py"


def test_bench_test_files_guard(tmp_path: Path) -> None:
    """Two small files, one round, as the CI guard runs them: the table, the verdict, the JSON."""
    out = tmp_path / "r.json"
    cmd = [sys.executable, str(BENCH_TEST_FILES), "--guard", "--files", "c10d", "opinfo", "--ops", "3"]
    cmd += ["--rounds", "1", "--max-ratio", "1000", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, f"exit code {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    lines = proc.stdout.splitlines()
    header = next(line for line in lines if line.startswith("file"))
    assert header.split() == [
        "file", "tests", "harness", "pass/fail/skip", "wall", "s", "start", "end", "collectives", "compute",
        "aiocoll/torch",
    ]  # fmt: skip
    # each file: a row per harness, torch's first; every test passes on both (c10d's 24, one per operator)
    table = [line.split() for line in lines if "torch threaded PG" in line or "aiocoll drop-in" in line]
    assert [row[:5] for row in table[::2]] == [
        ["c10d", "24", "torch", "threaded", "PG"],
        ["opinfo", "3", "torch", "threaded", "PG"],
    ], proc.stdout
    assert [row[:3] for row in table[1::2]] == [["aiocoll", "drop-in", "24/0/0"], ["aiocoll", "drop-in", "3/0/0"]]
    assert [row[5] for row in table[::2]] == ["24/0/0", "3/0/0"], proc.stdout
    assert all(row[-1].endswith("x") for row in table[1::2]), proc.stdout
    assert re.search(r"^threaded files \(c10d, opinfo\): .* aiocoll/torch [\d.]+x", proc.stdout, re.MULTILINE)
    verdict = r"^guard: PASS: aiocoll/torch [\d.]+x on the threaded files \(at most 1000x\)$"
    assert re.search(verdict, proc.stdout, re.MULTILINE), proc.stdout
    assert "round 1/1: torch" in proc.stderr  # progress goes to stderr
    data = json.loads(out.read_text())
    for system in ("torch", "aiocoll"):
        (run,) = data["results"][system]
        assert set(run) == {"c10d", "opinfo"}
        for f in run.values():
            assert f["wall"] > 0
            assert set(f["parts"]) == {"start", "end", "collectives", "compute"}
            assert all(v >= 0 for v in f["parts"].values())


def test_bench_test_files_guard_verdict() -> None:
    """The guard fails past its ratio, and when nothing ran."""
    sys.path.insert(0, str(BENCH_TEST_FILES.parent))
    try:
        from bench_test_files import guard
    finally:
        sys.path.remove(str(BENCH_TEST_FILES.parent))
    assert guard({"torch": 10.0, "aiocoll": 14.0}, 1.5) == (
        True,
        "guard: PASS: aiocoll/torch 1.40x on the threaded files (at most 1.5x)",
    )
    assert guard({"torch": 10.0, "aiocoll": 16.0}, 1.5)[0] is False
    assert guard({}, 1.5)[0] is False
