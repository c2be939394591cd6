"""torch's multi-process test harness against ``aiocoll.testing.replace_process_harness()``, file by file.

Run from the repository root, on test files of torch's own (``test/distributed/tensor/...``,
fetched at a version that runs on the installed torch) or of your project::

    python benchmarks/bench_process_harness.py test_redistribute.py test_dtensor.py
    python benchmarks/bench_process_harness.py test_dtensor.py -k "DTensorTest\\." --mode aiocoll

Each file runs twice, each time in a fresh interpreter: once on torch's harness (a process
per rank, gloo over loopback), once in-process on aiocoll. Only the classes that start
processes run (``MultiProcessTestCase`` and ``MultiProcContinuousTest`` subclasses, not
their local-tensor variants, which run in one process anyway). The table shows, per file,
the tests that passed, failed and were skipped on each harness, the wall time of each,
how many of the tests that pass on torch's harness also pass in-process, and the
speed-up; then every test whose outcome differs, and those aiocoll ran in processes
(or skipped) because they need processes of their own.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import unittest
from collections.abc import Sequence
from pathlib import Path
from typing import Any

MODES = ("torch", "aiocoll")


# -- the child: one file, one harness --------------------------------------------------------


class _Outcomes(unittest.TestResult):
    """Each test's outcome: "pass", "fail" or "skip"."""

    def __init__(self) -> None:
        super().__init__()
        self.outcomes: dict[str, str] = {}
        self.seconds: dict[str, float] = {}
        self._start = 0.0

    def startTest(self, test: unittest.TestCase) -> None:
        super().startTest(test)
        self._start = time.monotonic()
        print(f"  {test.id()} ...", end="", file=sys.stderr, flush=True)

    def _set(self, test: unittest.TestCase, outcome: str) -> None:
        self.outcomes[test.id()] = outcome
        self.seconds[test.id()] = time.monotonic() - self._start
        print(f" {outcome} ({self.seconds[test.id()]:.1f} s)", file=sys.stderr, flush=True)

    def addSuccess(self, test: unittest.TestCase) -> None:
        super().addSuccess(test)
        self._set(test, "pass")

    def addFailure(self, test: unittest.TestCase, err: Any) -> None:
        super().addFailure(test, err)
        self._set(test, "fail")

    def addError(self, test: unittest.TestCase, err: Any) -> None:
        super().addError(test, err)
        self._set(test, "fail")

    def addSkip(self, test: unittest.TestCase, reason: str) -> None:
        super().addSkip(test, reason)
        self._set(test, "skip")

    def addExpectedFailure(self, test: unittest.TestCase, err: Any) -> None:
        super().addExpectedFailure(test, err)
        self._set(test, "pass")

    def addUnexpectedSuccess(self, test: unittest.TestCase) -> None:
        super().addUnexpectedSuccess(test)
        self._set(test, "fail")


def _process_classes(module: Any) -> list[type[unittest.TestCase]]:
    """The module's own test classes that start processes on torch's harness."""
    from torch.testing._internal import common_distributed

    bases = tuple(
        getattr(common_distributed, name)
        for name in ("MultiProcessTestCase", "MultiProcContinuousTest")
        if hasattr(common_distributed, name)
    )
    out = []
    for obj in vars(module).values():
        if not (isinstance(obj, type) and issubclass(obj, bases) and obj.__module__ == module.__name__):
            continue
        # the local-tensor variants run every rank in one process on any harness
        if any(b.__name__.startswith("Local") for b in obj.__mro__):
            continue
        out.append(obj)
    return out


def run_child(path: str, mode: str, pattern: str, fallback: str = "processes") -> dict[str, Any]:
    sys.path.insert(0, str(Path(path).resolve().parent))
    harness = None
    if mode == "aiocoll":
        import aiocoll.testing

        harness = aiocoll.testing.replace_process_harness(fallback=fallback)  # type: ignore[arg-type]
    name = Path(path).stem
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # (spawned processes import it by name)
    spec.loader.exec_module(module)
    suite = unittest.TestSuite()
    loader = unittest.TestLoader()
    for cls in _process_classes(module):
        for test in loader.loadTestsFromTestCase(cls):
            if re.search(pattern, test.id()):
                suite.addTest(test)
    result = _Outcomes()
    start = time.monotonic()
    suite.run(result)
    wall = time.monotonic() - start
    return {
        "mode": mode,
        "wall": wall,
        "outcomes": result.outcomes,
        "seconds": result.seconds,
        "fallbacks": [] if harness is None else [list(f) for f in harness.fallbacks],
        "fallback": fallback,
    }


# -- the parent: both harnesses, and the table ------------------------------------------------


def run(path: str, mode: str, pattern: str, timeout: float, fallback: str = "processes") -> dict[str, Any]:
    """One file on one harness, in a fresh interpreter."""
    fd, name = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    out = Path(name)
    cmd = [sys.executable, __file__, "--child", mode, "-k", pattern, "--fallback", fallback, "--out", str(out), path]
    print(f"{Path(path).name} on {mode}:", file=sys.stderr, flush=True)
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, timeout=timeout, check=False, stdout=subprocess.DEVNULL)
        code: int | str = proc.returncode
    except subprocess.TimeoutExpired:
        code = "timeout"
    wall = time.monotonic() - start
    text = out.read_text()
    out.unlink()
    if text:
        data: dict[str, Any] = json.loads(text)
    else:
        data = {"mode": mode, "wall": wall, "outcomes": {}, "seconds": {}, "fallbacks": []}
    data["exit"] = code
    data["process_wall"] = wall
    return data


def _counts(outcomes: dict[str, str]) -> str:
    n = {k: sum(1 for v in outcomes.values() if v == k) for k in ("pass", "fail", "skip")}
    return f"{n['pass']}/{n['fail']}/{n['skip']}"


def _breakdown(name: str, torch_outcomes: dict[str, str], a: dict[str, Any]) -> str:
    """What became on aiocoll of the tests that pass on torch's harness: in-process, in processes, failed."""
    fell = {test: re.sub(r"^rank \d+ ", "", why) for test, why in a["fallbacks"]}
    passed = [i for i, o in torch_outcomes.items() if o == "pass"]
    inproc = [i for i in passed if i not in fell and a["outcomes"].get(i) == "pass"]
    failed = [i for i in passed if i not in fell and a["outcomes"].get(i) != "pass"]
    reasons: dict[str, int] = {}
    for i in passed:
        if i in fell:
            reasons[fell[i]] = reasons.get(fell[i], 0) + 1
    moved = sum(reasons.values())
    where = "ran in processes" if a.get("fallback", "processes") == "processes" else "skipped, needing processes"
    text = f"  {name}: of {len(passed)} passing on torch's harness, {len(inproc)} pass in-process, {moved} {where}"
    text += "".join(f"\n      {n}: {why}" for why, n in sorted(reasons.items(), key=lambda kv: -kv[1]))
    return text + f"\n    and {len(failed)} fail in-process" + "".join(f"\n      {i}" for i in failed)


def report(results: dict[str, dict[str, dict[str, Any]]]) -> str:
    lines = [
        "tests that start processes; pass/fail/skip per harness; wall seconds of the test run (torch imported before)",
        f"{'file':<24} {'tests':>5}  {'torch p/f/s':>12} {'wall s':>8}  {'aiocoll p/f/s':>13} {'wall s':>7}"
        f"  {'torch passes kept':>17}  {'speed-up':>8}",
    ]
    details = []
    for name, by_mode in results.items():
        t, a = by_mode.get("torch"), by_mode.get("aiocoll")
        ids = sorted(set().union(*(r["outcomes"] for r in by_mode.values())))
        row = f"{name:<24} {len(ids):>5}"
        row += f"  {_counts(t['outcomes']):>12} {t['wall']:>8.1f}" if t else f"  {'-':>12} {'-':>8}"
        row += f"  {_counts(a['outcomes']):>13} {a['wall']:>7.1f}" if a else f"  {'-':>13} {'-':>7}"
        if t and a:
            passed = [i for i in ids if t["outcomes"].get(i) == "pass"]
            kept = [i for i in passed if a["outcomes"].get(i) == "pass"]
            row += f"  {f'{len(kept)}/{len(passed)}':>17}  {t['wall'] / max(a['wall'], 1e-9):>7.1f}x"
            for i in ids:
                if t["outcomes"].get(i) != a["outcomes"].get(i):
                    details.append(f"  {i}: torch {t['outcomes'].get(i, '-')}, aiocoll {a['outcomes'].get(i, '-')}")
        lines.append(row)
        for mode, r in by_mode.items():
            if r["exit"] not in (0, 1):
                details.append(f"  {name} on {mode}: the run ended with {r['exit']}")
        if t and a:
            lines.append(_breakdown(name, t["outcomes"], a))
        if a:
            details += [f"  {test}: in processes ({why})" for test, why in a["fallbacks"]]
    if details:
        lines += ["", "differences, and tests that need processes of their own:", *details]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("files", nargs="+", help="test files (torch's own, or your project's)")
    parser.add_argument("--mode", choices=("both", *MODES), default="both")
    parser.add_argument("-k", dest="pattern", default="", help="only test ids matching this regular expression")
    parser.add_argument("--timeout", type=float, default=7200, help="seconds per file and harness")
    parser.add_argument(
        "--fallback",
        choices=("processes", "skip"),
        default="processes",
        help="on aiocoll, what becomes of tests that need processes of their own (run them on torch's harness,"
        " or skip them: quicker, when the torch run gives their outcome)",
    )
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        data = run_child(args.files[0], args.child, args.pattern, args.fallback)
        Path(args.out).write_text(json.dumps(data))
        return 0
    modes = MODES if args.mode == "both" else (args.mode,)
    results = {
        Path(f).name: {m: run(os.path.abspath(f), m, args.pattern, args.timeout, args.fallback) for m in modes}
        for f in args.files
    }
    text = report(results)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
