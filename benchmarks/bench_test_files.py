"""Whole test files on torch's harnesses against aiocoll's drop-ins, file by file, alternating.

Run from the repository root::

    python benchmarks/bench_test_files.py                      # every file, 3 rounds (about 10 minutes)
    python benchmarks/bench_test_files.py --files c10d opinfo --ops 200 --rounds 5
    python benchmarks/bench_test_files.py --guard              # CI: the threaded files, briefly; exit 1 past 1.5x
    python benchmarks/bench_test_files.py --files - --extra test_dtensor_ops.py   # a test file of your own

What users wait for is whole test files. The files (``_test_files.py``, built from what
torch's wheel ships) are c10d collectives, functional collectives, DTensor and tensor
parallelism, and one DTensor test per operator of torch's ``op_db`` (``--ops``), on
torch's threaded process group (``MultiThreadedTestCase``, ``DTensorOpTestBase``) against
``aiocoll.testing.replace_threaded_pg()``; DTensor tests on torch's multi-process harness
(``DTensorTestBase``: a process per rank, gloo) against ``replace_process_harness()``;
and DTensor, TP and FSDP2 bodies as a pytest file of aiocoll's plugin against the same
bodies on ``MultiThreadedTestCase``, both run by pytest. ``--extra`` adds test files of
your own (torch's, say, fetched at the version installed), run whole on both.

Each round runs every file on both systems, each system in a fresh interpreter, the
order alternating round by round; the table gives medians over the rounds: each file's
wall time (torch imported before), its tests' outcomes, and where the time went:

- ``start``: in ``init_process_group``, and aiocoll's building of the world;
- ``end``: in ``destroy_process_group``, the harness's reset once its threads joined,
  and aiocoll's end of the world (its sessions, and the release of what it made);
- ``collectives``: in the process group's collectives and their works' ``wait``;
- ``compute``: the rest, the tests' own code (and their harness's).

Times in rank threads are averaged over the 4 ranks (they run side by side); times on
the test's own thread and the world's count whole, once where they overlap. A rank that
waits in a collective while the others compute (aiocoll's sync ranks take turns in the
plugin) counts that wait as collectives. A multi-process file on torch's harness has its
time in other processes: its wall time alone.

``--guard`` (CI) runs the threaded files with fewer operators over 3 rounds and exits 1
when aiocoll's total exceeds torch's by more than ``--max-ratio`` (ratio of medians).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import unittest
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SYSTEMS = ("torch", "aiocoll")
PARTS = ("start", "end", "collectives", "compute")
FILES = ("c10d", "funcol", "dtensor", "opinfo", "process", "plugin")
THREADED = ("c10d", "funcol", "dtensor", "opinfo")
HARNESS = {
    ("torch", "process"): "torch processes (gloo)",
    ("torch", "plugin"): "torch threaded PG (pytest)",
    ("aiocoll", "plugin"): "aiocoll plugin (pytest)",
    ("torch", "-"): "torch threaded PG",
    ("aiocoll", "-"): "aiocoll drop-in",
}
GUARD_OPS = 80  # operators of the opinfo file under --guard
WORLD = 4


def _harness(system: str, name: str) -> str:
    return HARNESS.get((system, name), HARNESS[(system, "-")])


# -- the child: every file, on one system ------------------------------------------------------------


class _Parts:
    """Time spent in each part: rank threads' summed (then averaged over the ranks), others' as intervals."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._local = threading.local()
        self.main = threading.main_thread()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.ranks = {p: 0.0 for p in PARTS}
            # the test's thread and the world's overlap (a reset waits for the world's release):
            # their intervals are merged, so that no second is counted twice
            self.whole: dict[str, list[tuple[float, float]]] = {p: [] for p in PARTS}

    def wrap(self, part: str, fn: Callable[..., Any], in_rank: bool = True) -> Callable[..., Any]:
        """``fn``, timed as ``part`` (the outermost part only: an init that runs a barrier is start)."""

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if getattr(self._local, "busy", False):
                return fn(*args, **kwargs)
            self._local.busy = True
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                stop = time.perf_counter()
                self._local.busy = False
                with self._lock:
                    if in_rank and threading.current_thread() is not self.main:
                        self.ranks[part] += stop - start
                    else:
                        self.whole[part].append((start, stop))

        return timed

    def split(self, wall: float) -> dict[str, float]:
        with self._lock:
            out = {p: self.ranks[p] / WORLD + _union(self.whole[p]) for p in PARTS if p != "compute"}
        out["compute"] = max(0.0, wall - sum(out.values()))
        return out


def _union(intervals: list[tuple[float, float]]) -> float:
    """Seconds covered by ``intervals``, each second once."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


_COLLECTIVES = (
    "allreduce",
    "allreduce_coalesced",
    "allgather",
    "allgather_coalesced",
    "_allgather_base",
    "all_gather_single",
    "allgather_into_tensor_coalesced",
    "broadcast",
    "scatter",
    "gather",
    "reduce",
    "reduce_scatter",
    "_reduce_scatter_base",
    "reduce_scatter_single",
    "reduce_scatter_tensor_coalesced",
    "alltoall",
    "alltoall_base",
    "all_to_all_single",
    "barrier",
    "send",
    "recv",
    "recv_anysource",
)


def _instrument(parts: _Parts, system: str) -> None:
    """Time the parts on ``system``'s classes (after its harness replacement, if any)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.multi_threaded_pg import ProcessLocalGroup

    for name in ("init_process_group", "destroy_process_group"):
        setattr(dist, name, parts.wrap("start" if name.startswith("init") else "end", getattr(dist, name)))
    groups: list[type] = [ProcessLocalGroup]
    if system == "aiocoll":
        from aiocoll._c10d import _backend as _c10d
        from aiocoll._lifecycle import _driver

        groups.append(_c10d.AiocollProcessGroup)
        _c10d.AiocollWork.wait = parts.wrap("collectives", _c10d.AiocollWork.wait)  # type: ignore[method-assign]
        # the world's own thread: building the world, and at its end its sessions and release
        _c10d.release = parts.wrap("end", _c10d.release, in_rank=False)
        run = _driver.WorldRun
        run._build = parts.wrap("start", run._build, in_rank=False)  # type: ignore[method-assign]
        run._end_sessions = parts.wrap("end", run._end_sessions, in_rank=False)  # type: ignore[method-assign]
    for cls in groups:
        for name in _COLLECTIVES:
            if name in vars(cls):
                setattr(cls, name, parts.wrap("collectives", vars(cls)[name]))
    # the harness's reset, once its threads joined (aiocoll's replacement ends its world there)
    reset = vars(ProcessLocalGroup)["reset"]
    ProcessLocalGroup.reset = classmethod(parts.wrap("end", reset.__func__, in_rank=False))  # type: ignore[assignment]


class _Outcomes(unittest.TestResult):
    def __init__(self) -> None:
        super().__init__()
        self.passed = 0

    def addSuccess(self, test: unittest.TestCase) -> None:
        super().addSuccess(test)
        self.passed += 1

    def addExpectedFailure(self, test: unittest.TestCase, err: Any) -> None:
        super().addExpectedFailure(test, err)
        self.passed += 1

    def counts(self) -> list[int]:
        failed = len(self.failures) + len(self.errors) + len(self.unexpectedSuccesses)
        return [self.passed, failed, len(self.skipped)]

    def problems(self) -> list[str]:
        return [f"{t.id()}: {tb.strip().splitlines()[-1][:300]}" for t, tb in self.failures + self.errors]


def _load_extra(path: str) -> list[unittest.TestCase]:
    """The tests of a test file of one's own (torch's, say), as ``python FILE`` would run them."""
    sys.path.insert(0, str(Path(path).resolve().parent))
    name = Path(path).stem
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # (torch's multi-process harness imports it by name)
    spec.loader.exec_module(module)
    return list(unittest.TestLoader().loadTestsFromModule(module))


def _run_unittest(tests: Sequence[unittest.TestCase]) -> tuple[float, list[int], list[str]]:
    suite = unittest.TestSuite(tests)
    result = _Outcomes()
    start = time.perf_counter()
    suite.run(result)
    return time.perf_counter() - start, result.counts(), result.problems()


def _run_plugin(system: str) -> tuple[float, list[int], list[str]]:
    import pytest
    from _test_files import plugin_file

    class Outcomes:
        def __init__(self) -> None:
            self.counts = [0, 0, 0]
            self.problems: list[str] = []

        def pytest_runtest_logreport(self, report: Any) -> None:
            if report.when == "call" and report.passed:
                self.counts[0] += 1
            elif report.failed:
                self.counts[1] += 1
                self.problems.append(f"{report.nodeid}: {report.longreprtext.strip().splitlines()[-1][:300]}")
            elif report.skipped:
                self.counts[2] += 1

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "test_plugin_file.py").write_text(plugin_file(system))
        (Path(tmp) / "pytest.ini").write_text(f"[pytest]\npythonpath = {HERE}\n")
        probe = Outcomes()
        args = [str(Path(tmp) / "test_plugin_file.py"), "-q", "-p", "no:cacheprovider", "-W", "ignore"]
        args += ["--rootdir", tmp, "-c", str(Path(tmp) / "pytest.ini")]
        start = time.perf_counter()
        pytest.main(args, plugins=[probe])
        return time.perf_counter() - start, probe.counts, probe.problems


def run_child(system: str, files: Sequence[str], extra: Sequence[str], ops: int) -> dict[str, Any]:
    warnings.simplefilter("ignore")  # torch's deprecation notices: not what is measured
    import _test_files

    if system == "aiocoll":
        import aiocoll.testing

        aiocoll.testing.replace_threaded_pg()
        aiocoll.testing.replace_process_harness(fallback="skip")
    parts = _Parts()
    _instrument(parts, system)
    loader = unittest.TestLoader()
    todo: list[tuple[str, Callable[[], tuple[float, list[int], list[str]]]]] = []
    for name in files:
        if name == "plugin":
            todo.append((name, functools.partial(_run_plugin, system)))
        else:
            tests = [t for cls in _test_files.load(name, ops) for t in loader.loadTestsFromTestCase(cls)]
            todo.append((name, functools.partial(_run_unittest, tests)))
    for path in extra:
        todo.append((Path(path).name, functools.partial(_run_unittest, _load_extra(path))))
    out: dict[str, Any] = {}
    for name, run in todo:
        print(f"  {system}: {name} ...", file=sys.stderr, flush=True)
        parts.reset()
        wall, counts, problems = run()
        split = None if (system, name) == ("torch", "process") else parts.split(wall)
        out[name] = {"wall": wall, "counts": counts, "parts": split, "problems": problems[:20]}
        print(f"  {system}: {name}: {wall:.1f} s, pass/fail/skip {counts}", file=sys.stderr, flush=True)
    return out


# -- the parent: rounds, alternating, and the table ---------------------------------------------------


def run_system(system: str, files: Sequence[str], extra: Sequence[str], ops: int, timeout: float) -> dict[str, Any]:
    """Every file on ``system``, in a fresh interpreter."""
    fd, name = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    out = Path(name)
    cmd = [sys.executable, __file__, "--child", system, "--ops", str(ops), "--out", str(out), "--files", *files]
    for path in extra:
        cmd += ["--extra", os.path.abspath(path)]
    # torch's multi-process harness starts its processes by importing the test file's module by name
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])))
    try:
        proc = subprocess.run(cmd, timeout=timeout, check=False, stdout=subprocess.DEVNULL, env=env)
        text = out.read_text()
        if proc.returncode != 0 or not text:
            raise SystemExit(f"{system}: the run ended with exit code {proc.returncode}")
        data: dict[str, Any] = json.loads(text)
    except subprocess.TimeoutExpired as e:
        raise SystemExit(f"{system}: the run took more than {timeout:g} s") from e
    finally:
        out.unlink(missing_ok=True)
    return data


def _median_parts(runs: list[dict[str, Any]]) -> dict[str, float] | None:
    if any(r["parts"] is None for r in runs):
        return None
    return {p: statistics.median(r["parts"][p] for r in runs) for p in PARTS}


def report(results: dict[str, list[dict[str, Any]]], rounds: int, ops: int) -> tuple[str, dict[str, float]]:
    """The table, and the medians of each system's total over the threaded files."""
    import torch

    names = list(results["torch"][0])
    lines = [
        f"torch {torch.__version__}, Python {sys.version.split()[0]}, {os.cpu_count()} CPUs; {rounds} rounds, the"
        f" systems alternating; opinfo: {ops or 'all'} operators; medians of wall seconds (torch imported before)",
        "",
        f"{'file':<22} {'tests':>5}  {'harness':<27} {'pass/fail/skip':>14} {'wall s':>8}  "
        + "".join(f"{p:>12}" for p in PARTS)
        + f"  {'aiocoll/torch':>13}",
    ]
    problems: list[str] = []
    for name in names:
        walls = {}
        for i, system in enumerate(SYSTEMS):
            runs = [r[name] for r in results[system]]
            walls[system] = statistics.median(r["wall"] for r in runs)
            counts = runs[-1]["counts"]
            split = _median_parts(runs)
            cells = "".join(f"{split[p]:>12.2f}" for p in PARTS) if split else "".join(f"{'-':>12}" for _ in PARTS)
            ratio = f"{walls['aiocoll'] / walls['torch']:>12.2f}x" if system == "aiocoll" else ""
            head = f"{name:<22} {sum(counts):>5}" if i == 0 else f"{'':<22} {'':>5}"
            lines.append(
                f"{head}  {_harness(system, name):<27} {'/'.join(map(str, counts)):>14} {walls[system]:>8.2f}  "
                + cells
                + f"  {ratio}"
            )
            problems += [f"  {system} {p}" for p in runs[-1]["problems"]]
    totals: dict[str, float] = {}
    threaded = [n for n in names if n in THREADED]
    if threaded:
        for system in SYSTEMS:
            totals[system] = statistics.median(sum(r[n]["wall"] for n in threaded) for r in results[system])
        lines += [
            "",
            f"threaded files ({', '.join(threaded)}): torch {totals['torch']:.2f} s, aiocoll {totals['aiocoll']:.2f} s"
            f" (medians of the totals): aiocoll/torch {totals['aiocoll'] / totals['torch']:.2f}x (target 0.8x)",
        ]
    if "process" in names:
        t, a = (statistics.median(r["process"]["wall"] for r in results[s]) for s in SYSTEMS)
        lines.append(f"multi-process file: aiocoll/torch {a / t:.3f}x (target 0.3x)")
    if problems:
        lines += ["", "failures (the last round's):", *problems]
    return "\n".join(lines), totals


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--files", nargs="+", help=f"of {', '.join(FILES)} ('-': none; default: all)")
    parser.add_argument("--extra", action="append", default=[], help="a test file of your own, run whole")
    parser.add_argument("--ops", type=int, help="operators of the opinfo file (0, the default: every one, ~650)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--guard",
        action="store_true",
        help=f"CI: by default the threaded files, {GUARD_OPS} operators; exit 1 past --max-ratio",
    )
    parser.add_argument("--max-ratio", type=float, default=1.5, help="--guard: aiocoll/torch above this fails")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per system and round")
    parser.add_argument("--json", help="also write every run's results here")
    parser.add_argument("--child", choices=SYSTEMS, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    files = [f for f in args.files or (THREADED if args.guard else FILES) if f != "-"]
    if args.ops is None:
        args.ops = GUARD_OPS if args.guard else 0
    unknown = sorted(set(files) - set(FILES))
    if unknown:
        parser.error(f"--files: unknown {unknown}; known: {', '.join(FILES)}")
    if args.child:
        sys.path.insert(0, str(HERE))
        Path(args.out).write_text(json.dumps(run_child(args.child, files, args.extra, args.ops)))
        return 0
    if not files and not args.extra:
        parser.error("no file to run")
    results: dict[str, list[dict[str, Any]]] = {s: [] for s in SYSTEMS}
    start = time.monotonic()
    for r in range(args.rounds):
        order = SYSTEMS if r % 2 == 0 else SYSTEMS[::-1]
        for system in order:
            print(f"round {r + 1}/{args.rounds}: {system}", file=sys.stderr, flush=True)
            results[system].append(run_system(system, files, args.extra, args.ops, args.timeout))
    text, totals = report(results, args.rounds, args.ops)
    print(text)
    print(f"\ntotal time {time.monotonic() - start:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"rounds": args.rounds, "ops": args.ops, "results": results}, indent=1))
    if args.guard:
        ok, line = guard(totals, args.max_ratio)
        print(line)
        return 0 if ok else 1
    return 0


def guard(totals: dict[str, float], max_ratio: float) -> tuple[bool, str]:
    """Whether aiocoll's total over the threaded files is within ``max_ratio`` of torch's; the verdict's line."""
    if not totals:
        return False, "guard: FAIL: no threaded file ran"
    ratio = totals["aiocoll"] / totals["torch"]
    ok = ratio <= max_ratio
    verdict = "PASS" if ok else "FAIL"
    return ok, f"guard: {verdict}: aiocoll/torch {ratio:.2f}x on the threaded files (at most {max_ratio:g}x)"


if __name__ == "__main__":
    raise SystemExit(main())
