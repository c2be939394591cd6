"""``_worldthread.WorldThread``: a world on a helper thread that its caller can give up on."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
import torch

import aiocoll
from aiocoll._lifecycle._worldthread import WorldThread
from aiocoll._spawn import spawn_async


def test_result_of_a_world_that_ends() -> None:
    def rank(comm: aiocoll.Comm) -> float:
        t = torch.ones(1)
        comm.all_reduce(t).wait()
        return t.item()

    wt: WorldThread[list[Any]] = WorldThread(lambda: spawn_async(rank, 3), "asyncio")
    wt.start()
    assert wt.wait(60)
    assert wt.result() == [3.0, 3.0, 3.0]
    assert wt.error is None
    assert "ended" in repr(wt)


def test_cancel_releases_waiting_ranks_and_shows_where_the_busy_one_is() -> None:
    release = threading.Event()

    def rank(comm: aiocoll.Comm) -> None:
        if comm.rank == 1:
            release.wait(30)  # busy outside any collective: the others wait for it
        comm.barrier().wait()

    wt: WorldThread[list[Any]] = WorldThread(lambda: spawn_async(rank, 3, timeout=None), "asyncio")
    wt.start()
    assert not wt.wait(0.5)
    frames = wt.rank_frames()
    assert sorted(frames) == [0, 1, 2]
    assert frames[1].f_code.co_name == "wait"  # rank 1 is in Event.wait
    wt.cancel()
    assert not wt.wait(0.5)  # rank 1 cannot be stopped: the world waits for it
    release.set()
    assert wt.wait(30)
    with pytest.raises((asyncio.CancelledError, aiocoll.WorldAbortedError)):
        wt.result()
    deadline = time.monotonic() + 10  # the world has ended: its rank threads end soon after
    while wt.rank_frames() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert wt.rank_frames() == {}


def test_cancel_before_the_world_starts() -> None:
    started = []

    async def main() -> None:
        started.append(True)

    wt: WorldThread[None] = WorldThread(main, "asyncio")
    wt.cancel()
    wt.start()
    assert wt.wait(30)
    assert isinstance(wt.error, asyncio.CancelledError)
    assert started == []
