"""Running unittest test cases from pytest, shared by the harness tests (``test_testing``, ``test_process_harness``)."""

from __future__ import annotations

import unittest


def run_case(case: type[unittest.TestCase], *names: str) -> unittest.TestResult:
    """Run the named tests of ``case`` (all of them if none is named) and return the result."""
    loader = unittest.TestLoader()
    suite = unittest.TestSuite([case(n) for n in names]) if names else loader.loadTestsFromTestCase(case)
    result = unittest.TestResult()
    suite.run(result)
    return result


def problems(result: unittest.TestResult) -> str:
    """Every error and failure of ``result``, with its traceback, for an assertion message."""
    return "\n".join(f"{t}: {tb}" for t, tb in result.errors + result.failures)
