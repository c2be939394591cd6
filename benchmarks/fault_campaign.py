"""A fault campaign through torch's C++ consumers of aiocoll's works: a failing rank never crashes the process.

Run from the repository root::

    python benchmarks/fault_campaign.py                    # the whole matrix
    python benchmarks/fault_campaign.py --subset ci        # what the test suite runs
    python benchmarks/fault_campaign.py --consumers ddp,fsdp2 --entries spawn,run
    python benchmarks/fault_campaign.py --entries torchrun --consumers ddp   # torch's own, for reference

Each case is one consumer (DDP with its default hook, a registered fp16 hook or small
buckets; FSDP2; tensor parallelism; functional collectives; DTensor redistribution;
pipelining; asynchronous DCP save: ``_fault_cases.py``), one fault of rank 1 (an error, a
``sys.exit(3)``, a collective the others do not call) at one step (the first, a later one,
mid-backward, the optimizer step), run on 3 ranks through one entry point, each in a
subprocess of its own:

- ``spawn``: ``aiocoll.spawn`` of a plain function (sync ranks taking turns);
- ``parallel``: the same with ``sync_ranks="parallel"``;
- ``run``: ``aiocoll run --nproc-per-node 3`` of a torchrun script;
- ``pytest``: a ``@pytest.mark.world(3)`` test, followed by a passing one in the same run;
- ``harness``: a ``MultiProcessTestCase`` test under ``aiocoll.testing.replace_process_harness()``,
  followed by a passing one;
- ``torchrun`` (not in the default set): the script of ``run`` under torchrun, for reference.

A case passes when its process ends by itself within ``--deadline``, with an exit status
that is not a signal and not 0, and its output names the failing rank and its error (and,
for ``pytest`` and ``harness``, the next test still passed). The table prints each case's
verdict and seconds; the exit status is 1 if any case failed. A case that cannot test
what it stands for is left out, its cell "n/a", the reason under the table
(``NOT_APPLICABLE``).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _fault_cases import CONSUMERS, FAILING_RANK, STEPS_OF  # noqa: E402

WORLD = 3
FAULTS = ("raise", "exit", "mismatch")
ENTRIES = ("spawn", "parallel", "run", "pytest", "harness")
ALL_ENTRIES = (*ENTRIES, "torchrun")

# A representative subset, for the test suite (tests/conformance/test_fault_campaign.py): every entry
# point, every fault, DDP at the steps that crashed, and each other kind of consumer once.
CI_SUBSET: tuple[tuple[str, str, str, str], ...] = (
    ("ddp", "raise", "later", "spawn"),
    ("ddp", "exit", "later", "run"),
    ("ddp", "raise", "backward", "pytest"),
    ("ddp", "mismatch", "later", "harness"),
    ("ddp", "raise", "later", "parallel"),
    ("ddp_fp16_hook", "raise", "optimizer", "spawn"),
    ("ddp_small_buckets", "exit", "backward", "spawn"),
    ("fsdp2", "raise", "backward", "spawn"),
    ("tensor_parallel", "mismatch", "later", "spawn"),
    ("functional_collectives", "raise", "later", "spawn"),
    ("pipelining", "raise", "backward", "spawn"),
    ("dcp_async_save", "exit", "later", "harness"),
)

# Cases that cannot test what they stand for, and why (the table shows them as n/a).
_THREADS_WITHOUT_C10D = (
    "a thread a rank starts under spawn and the pytest plugin sees no torch.distributed "
    "(dist.is_initialized() is False there), so DCP saves as one process"
)
NOT_APPLICABLE: dict[tuple[str, str], str] = {
    ("dcp_async_save", "spawn"): _THREADS_WITHOUT_C10D,
    ("dcp_async_save", "parallel"): _THREADS_WITHOUT_C10D,
    ("dcp_async_save", "pytest"): _THREADS_WITHOUT_C10D,
}

_SPAWN = """
import sys
sys.path.insert(0, {here!r})
import aiocoll, _fault_cases
aiocoll.spawn(lambda comm: _fault_cases.run(), world={world}{options})
"""

_SCRIPT = """
import sys
sys.path.insert(0, {here!r})
import torch.distributed as dist, _fault_cases
dist.init_process_group("gloo")
_fault_cases.run()
dist.destroy_process_group()
"""

_PYTEST = """
import sys
sys.path.insert(0, {here!r})
import pytest, torch, torch.distributed as dist, _fault_cases

@pytest.mark.world({world})
def test_fault(comm):
    _fault_cases.run()

@pytest.mark.world({world})
def test_next(comm):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == {world}
"""

_HARNESS_CONFTEST = """
import aiocoll.testing
aiocoll.testing.replace_process_harness()
"""

_HARNESS = """
import sys
sys.path.insert(0, {here!r})
import torch, torch.distributed as dist, _fault_cases
from torch.testing._internal.common_distributed import MultiProcessTestCase

class FaultTest(MultiProcessTestCase):
    @property
    def world_size(self):
        return {world}

    def setUp(self):
        super().setUp()
        self._spawn_processes()

    def _init(self):
        store = dist.FileStore(self.file_name, self.world_size)
        dist.init_process_group("gloo", store=store, rank=self.rank, world_size=self.world_size)

    def test_fault(self):
        self._init()
        _fault_cases.run()
        dist.destroy_process_group()

    def test_next(self):
        self._init()
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == {world}
        dist.destroy_process_group()
"""


@dataclass(frozen=True)
class Case:
    consumer: str
    fault: str
    step: str
    entry: str

    @property
    def name(self) -> str:
        return f"{self.consumer}/{self.fault}/{self.step}/{self.entry}"


@dataclass(frozen=True)
class Result:
    case: Case
    returncode: int | None  # None: killed at the deadline
    seconds: float
    output: str
    problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.problems

    def cell(self) -> str:
        if self.ok:
            return f"ok {self.seconds:.1f}s"
        return self.problems[0]


def cases(
    consumers: Iterable[str] = CONSUMERS,
    faults: Iterable[str] = FAULTS,
    steps: Iterable[str] | None = None,
    entries: Iterable[str] = ENTRIES,
) -> list[Case]:
    """Every combination asked for, each consumer at the steps it has."""
    out = []
    for consumer in consumers:
        for fault in faults:
            for step in STEPS_OF[consumer]:
                if steps is None or step in steps:
                    out.extend(
                        Case(consumer, fault, step, entry)
                        for entry in entries
                        if (consumer, entry) not in NOT_APPLICABLE
                    )
    return out


def ci_subset() -> list[Case]:
    return [Case(*c) for c in CI_SUBSET]


def _command(case: Case, work: Path) -> list[str]:
    """Write the case's files into ``work``; the command that runs it there."""
    fill = {"here": str(HERE), "world": WORLD}
    if case.entry in ("spawn", "parallel"):
        options = ', sync_ranks="parallel"' if case.entry == "parallel" else ""
        return [sys.executable, "-c", _SPAWN.format(options=options, **fill)]
    if case.entry in ("run", "torchrun"):
        (work / "train.py").write_text(_SCRIPT.format(**fill))
        launcher = ["-m", "aiocoll", "run"] if case.entry == "run" else ["-m", "torch.distributed.run"]
        return [sys.executable, *launcher, "--nproc-per-node", str(WORLD), "train.py"]
    pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "-W", "default"]
    if case.entry == "pytest":
        (work / "test_case.py").write_text(_PYTEST.format(**fill))
        return [*pytest, "test_case.py"]
    if case.entry == "harness":
        (work / "conftest.py").write_text(_HARNESS_CONFTEST)
        (work / "test_case.py").write_text(_HARNESS.format(**fill))
        return [*pytest, "test_case.py"]
    raise ValueError(f"unknown entry {case.entry!r}")


# what the report must say of rank 1's fault, whatever the entry point's wording
_ERROR_SAID = {
    "raise": re.compile(r"rank 1 fails on purpose"),
    "exit": re.compile(r"exit ?code:? 3|exited with (exit )?code 3|exit status 3|SystemExit: 3"),
    "mismatch": re.compile(r"different collectives|CollectiveMismatchError|DeadlockError"),
}
_RANK_SAID = re.compile(rf"(rank|process|Process) {FAILING_RANK}\b")


def check(case: Case, returncode: int | None, output: str) -> tuple[str, ...]:
    """What is wrong with a case's end, if anything (the first problem is the table's cell)."""
    problems = []
    if returncode is None:
        problems.append("HANG")
    elif returncode < 0:
        problems.append(f"SIGNAL {signal.Signals(-returncode).name}")
    elif returncode == 0:
        problems.append("exit 0")
    if not _ERROR_SAID[case.fault].search(output):
        problems.append(f"no {case.fault} in report")
    if not _RANK_SAID.search(output):
        problems.append("no rank in report")
    ran_next = re.search(r"\b1 failed, 1 passed\b", output)
    if case.entry in ("pytest", "harness") and returncode is not None and returncode > 0 and not ran_next:
        problems.append("next test not passed")
    return tuple(problems)


def run_case(case: Case, deadline: float = 120.0) -> Result:
    """Run one case in a subprocess of its own, and judge its end."""
    with tempfile.TemporaryDirectory(prefix="aiocoll-fault-") as tmp:
        work = Path(tmp)
        env = {
            **os.environ,
            "FC_CONSUMER": case.consumer,
            "FC_FAULT": case.fault,
            "FC_STEP": case.step,
            "FC_DIR": str(work / "checkpoints"),
            "PYTHONFAULTHANDLER": "",
        }
        env.pop("PYTHONFAULTHANDLER")  # a crash must be seen as the user sees it
        env.pop("PYTEST_XDIST_WORKER", None)
        env.pop("PYTEST_CURRENT_TEST", None)
        command = _command(case, work)
        started = time.monotonic()
        try:
            proc = subprocess.run(
                command, cwd=work, env=env, capture_output=True, text=True, timeout=deadline, check=False
            )
            returncode: int | None = proc.returncode
            output = proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as e:
            returncode = None
            output = _text(e.stdout) + _text(e.stderr)
        seconds = time.monotonic() - started
    return Result(case, returncode, seconds, output, check(case, returncode, output))


def _text(data: bytes | str | None) -> str:
    if data is None:
        return ""
    return data if isinstance(data, str) else data.decode(errors="replace")


def table(results: list[Result], entries: list[str]) -> str:
    by_case = {r.case: r for r in results}
    rows = sorted({(r.case.consumer, r.case.fault, r.case.step) for r in results}, key=_order)
    header = ["consumer", "fault", "step", *entries]
    lines = [
        [*row, *(by_case[Case(*row, e)].cell() if Case(*row, e) in by_case else "" for e in entries)] for row in rows
    ]
    widths = [max(len(x) for x in col) for col in zip(header, *lines, strict=True)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join(fmt.format(*line) for line in [header, *lines])


def _order(row: tuple[str, str, str]) -> tuple[int, int, int]:
    consumer, fault, step = row
    steps = ("first", "later", "backward", "optimizer")
    return list(CONSUMERS).index(consumer), FAULTS.index(fault), steps.index(step)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--subset", choices=["all", "ci"], default="all")
    parser.add_argument("--consumers", default=",".join(CONSUMERS))
    parser.add_argument("--faults", default=",".join(FAULTS))
    parser.add_argument("--steps", default=None, help="comma-separated (default: each consumer's own)")
    parser.add_argument("--entries", default=",".join(ENTRIES), help=f"of {', '.join(ALL_ENTRIES)}")
    parser.add_argument("--jobs", type=int, default=2, help="cases run at once")
    parser.add_argument("--deadline", type=float, default=120.0, help="seconds a case may take")
    parser.add_argument("--verbose", action="store_true", help="print the output of the cases that failed")
    args = parser.parse_args(argv)
    if args.subset == "ci":
        todo = ci_subset()
    else:
        todo = cases(
            args.consumers.split(","),
            args.faults.split(","),
            None if args.steps is None else args.steps.split(","),
            args.entries.split(","),
        )
    asked = {c.entry for c in todo} if args.subset == "ci" else set(args.entries.split(","))
    entries = [e for e in ALL_ENTRIES if e in asked]
    import torch

    print(
        f"fault campaign: {len(todo)} cases, torch {torch.__version__}, Python {sys.version.split()[0]}, {WORLD} ranks"
    )
    started = time.monotonic()
    with ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda c: run_case(c, args.deadline), todo))
    print(table(results, entries))
    for (consumer, entry), why in NOT_APPLICABLE.items():
        if consumer in {c.consumer for c in todo} and entry in entries:
            print(f"n/a: {consumer} through {entry}: {why}")
    failed = [r for r in results if not r.ok]
    print(f"{len(results) - len(failed)}/{len(results)} passed in {time.monotonic() - started:.0f} s")
    for r in failed:
        print(f"\n--- {r.case.name}: {', '.join(r.problems)} (exit status {r.returncode})")
        if args.verbose:
            print(textwrap.indent(r.output[-6000:], "  "))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
