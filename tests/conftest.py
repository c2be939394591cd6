"""Shared fixtures: every engine test runs on both asyncio and uvloop.

``AIOCOLL_CI_LEAVE_OUT`` (a comma-separated list of markers: ``bench_smoke``, ``launcher``,
``launcher_conformance``, ``script_conformance``, ``processes``) skips those groups of tests, saying so: ``.ci/run``
sets it in each cell, so that the whole matrix stays within its time budget while every
group still runs in at least one cell. Unset (a developer's run), nothing is left out.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

_GROUPS = ("bench_smoke", "launcher", "launcher_conformance", "script_conformance", "processes")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    left_out = [g.strip() for g in os.environ.get("AIOCOLL_CI_LEAVE_OUT", "").split(",") if g.strip()]
    unknown = sorted(set(left_out) - set(_GROUPS))
    if unknown:
        raise pytest.UsageError(f"AIOCOLL_CI_LEAVE_OUT: unknown groups {unknown}; known: {list(_GROUPS)}")
    for item in items:
        for group in left_out:
            if item.get_closest_marker(group) is not None:
                reason = f"AIOCOLL_CI_LEAVE_OUT={group}: this CI cell leaves them to another (.ci/run)"
                item.add_marker(pytest.mark.skip(reason=reason))


LOOPS = ["asyncio"] + (["uvloop"] if importlib.util.find_spec("uvloop") else [])


@pytest.fixture(params=LOOPS)
def loop(request: pytest.FixtureRequest) -> str:
    """The name of the event loop to pass as ``aiocoll.spawn(..., loop=loop)``."""
    return str(request.param)
