"""Shared fixtures: every engine test runs on both asyncio and uvloop."""

from __future__ import annotations

import importlib.util

import pytest

LOOPS = ["asyncio"] + (["uvloop"] if importlib.util.find_spec("uvloop") else [])


@pytest.fixture(params=LOOPS)
def loop(request: pytest.FixtureRequest) -> str:
    """The name of the event loop to pass as ``aiocoll.spawn(..., loop=loop)``."""
    return str(request.param)
