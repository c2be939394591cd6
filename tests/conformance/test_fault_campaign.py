"""A representative subset of the fault campaign (``benchmarks/fault_campaign.py``): a failing rank never crashes.

Each case runs one of torch's C++ consumers of aiocoll's works (DDP three ways, FSDP2,
tensor parallelism, functional collectives, pipelining, a background DCP save) on 3 ranks
through one entry point (``spawn`` in turns and in parallel, ``aiocoll run``, the pytest
plugin, the process-harness drop-in), with rank 1 raising, exiting or calling a
collective the others do not, each in a process of its own. It must end by itself, with
an exit status that is neither a signal nor 0, and a report naming rank 1 and its fault;
under pytest, the next test of the run still passes. Before the futures failed in C++,
every DDP case here ended with SIGSEGV. The whole matrix is the script's, run by hand.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from fault_campaign import CI_SUBSET, Case, run_case


@pytest.mark.parametrize("case", [Case(*c) for c in CI_SUBSET], ids=lambda c: c.name)
def test_a_failing_rank_is_reported_and_never_crashes(case: Case) -> None:
    result = run_case(case, deadline=180)
    assert result.ok, (
        f"{case.name}: {', '.join(result.problems)} (exit status {result.returncode}, {result.seconds:.1f} s)\n"
        + result.output[-8000:]
    )


def test_the_campaign_s_check_catches_a_crash_a_hang_and_a_silent_end() -> None:
    # what the verdicts rest on: a signal, a hang, exit 0 and a report that does not name the fault
    from fault_campaign import check

    case = Case("ddp", "raise", "later", "pytest")
    said = "rank 1 fails on purpose (later, step 2)\naiocoll: raised on rank 1 of a world of 3\n1 failed, 1 passed"
    assert check(case, 1, said) == ()
    assert check(case, -11, said)[0] == "SIGNAL SIGSEGV"
    assert check(case, None, said)[0] == "HANG"
    assert check(case, 0, said)[0] == "exit 0"
    assert check(case, 1, said.replace("fails on purpose", "failed"))[0] == "no raise in report"
    assert check(case, 1, said.replace("1 failed, 1 passed", "1 failed"))[0] == "next test not passed"
