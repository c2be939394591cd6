"""A torch.distributed group's own timeout, and ``monitored_barrier``, as gloo keeps them.

What gloo does was measured on torch 2.13 with three gloo processes under torchrun: an
op pending past its group's timeout raises "Timed out waiting 1000ms ..."; the group is
then unusable for every member, while the other groups go on; ``monitored_barrier``'s
rank 0 names the first rank that did not come, the ranks that came get an error.
"""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

import aiocoll
import aiocoll._engine._grouptimeouts
from aiocoll import Comm


def _error(fn: Any) -> str | None:
    """What ``fn()`` raised, as "Type: first line" (None if nothing)."""
    try:
        fn()
    except Exception as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0]}"
    return None


def test_an_op_past_its_group_s_timeout_fails_and_breaks_that_group_only() -> None:
    def fn(comm: Comm) -> dict[str, Any]:
        g = dist.new_group(timeout=timedelta(seconds=0.2))
        out: dict[str, Any] = {}
        if comm.rank == 0:
            # the others wait in the world's barrier, not in g: only g's timeout ends this
            start = time.monotonic()
            try:
                dist.barrier(group=g)
            except RuntimeError as e:  # gloo's errors are RuntimeErrors, and torch code catches them so
                out["timed out"] = (type(e).__name__, str(e).splitlines()[0], time.monotonic() - start)
        dist.barrier()
        out["broken"] = _error(lambda: dist.all_reduce(torch.ones(1), group=g))
        t = torch.ones(1)
        dist.all_reduce(t)  # the world's group goes on
        out["world"] = t.item()
        return out

    r0, r1, r2 = aiocoll.spawn(fn, world=3)
    kind, line, waited = r0["timed out"]
    assert kind == "GroupTimeoutError"
    # torch's own tests look for " (Timed out|closed|timeout) " (distributed_test.py)
    assert line.startswith("barrier #0 on group '1': Timed out waiting 200 ms"), line
    assert "ranks [0] arrived, ranks [1, 2] did not" in line
    assert waited >= 0.2
    for r in (r0, r1, r2):
        assert r["broken"] is not None
        assert r["broken"].startswith("GroupTimeoutError: group '1' is broken:")
        assert "barrier #0 on group '1' timed out on ranks [0]" in r["broken"]
        assert r["world"] == 3.0


def test_a_recv_past_its_group_s_timeout_fails_and_breaks_the_group() -> None:
    def fn(comm: Comm) -> str | None:
        g = dist.new_group(timeout=timedelta(seconds=0.1))
        got = None
        if comm.rank == 0:
            got = _error(lambda: dist.recv(torch.zeros(1), src=1, group=g))
        dist.barrier()
        if comm.rank == 1:
            got = _error(lambda: dist.send(torch.ones(1), dst=0, group=g))
        return got

    r0, r1 = aiocoll.spawn(fn, world=2)
    assert r0 is not None
    assert r0.startswith("GroupTimeoutError: rank 0: Timed out waiting 100 ms"), r0
    assert " in recv(float32[1], src=1, tag=0) on group '1' at " in r0
    assert "; rank 1 did not match it (blocked in barrier() #0 on group '0' at " in r0
    assert r1 is not None
    assert r1.startswith("GroupTimeoutError: group '1' is broken: recv(float32[1], src=1, tag=0)")
    assert r1.endswith("timed out on rank 0 (as gloo's, a group is unusable after a timeout)")


def test_a_deadlock_in_a_group_with_a_timeout_waits_for_it(caplog: pytest.LogCaptureFixture) -> None:
    # every rank waits, but the group's timeout will end rank 0's wait, after which it
    # goes on: as in gloo, that is not a deadlock (a program may catch the timeout)
    def fn(comm: Comm) -> bool:
        g = dist.new_group(timeout=timedelta(seconds=0.1))
        if comm.rank == 0:
            with pytest.raises(aiocoll.GroupTimeoutError):
                dist.all_reduce(torch.ones(1), group=g)
        dist.barrier()
        return True

    with caplog.at_level(logging.WARNING, logger="aiocoll"):
        assert aiocoll.spawn(fn, world=2) == [True, True]
    # what looked like a deadlock was said at once
    (told,) = [r.getMessage() for r in caplog.records if "looks like a deadlock" in r.getMessage()]
    assert told.startswith("every live rank waits; a group's own timeout will end the wait of rank 0, which may go on")
    assert "rank 1: blocked in barrier() #0 on group '0'" in told


def test_torch_s_default_timeout_is_not_a_group_s_own() -> None:
    # torch fills in 30 minutes when none is asked for: the world's timeout (here: none)
    # applies, and with it deadlocks reported at once, not after an hour
    def fn(comm: Comm) -> list[object]:
        return [
            dist.new_group(timeout=t)._comm.group.own_timeout  # type: ignore[attr-defined]
            for t in (None, timedelta(minutes=30), timedelta(seconds=5))
        ]

    stretch = aiocoll._engine._grouptimeouts.slowdown(2)
    assert aiocoll.spawn(fn, world=2, timeout=None)[0] == [None, None, (5.0, 5.0 * stretch)]


def test_a_real_deadlock_is_still_reported_at_once() -> None:
    def fn(comm: Comm) -> None:
        dist.new_group(timeout=timedelta(seconds=30))  # a group with a timeout, unused
        if comm.rank == 0:
            dist.barrier()

    start = time.monotonic()
    with pytest.raises(aiocoll.AiocollError, match=r"rank 1|deadlock"):
        aiocoll.spawn(fn, world=2)
    assert time.monotonic() - start < 10


def test_a_group_timeout_no_shorter_than_the_world_s_changes_nothing() -> None:
    # the world's own timeout fires first, with the world's report, and breaks no group
    def fn(comm: Comm) -> None:
        g = dist.new_group(timeout=timedelta(seconds=60))
        if comm.rank == 0:
            dist.barrier(group=g)
        else:
            time.sleep(1.5)  # busy (not waiting): only a timeout can end rank 0's wait
            dist.barrier(group=g)

    with pytest.raises(aiocoll.CollectiveTimeoutError) as info:
        aiocoll.spawn(fn, world=2, timeout=0.3)
    assert not isinstance(info.value, aiocoll.GroupTimeoutError)
    assert "timed out after 0.3s" in str(info.value)


# -- monitored_barrier -----------------------------------------------------------------


def test_monitored_barrier_passes_when_all_come() -> None:
    def fn(comm: Comm) -> float:
        t = torch.ones(1)
        dist.all_reduce(t)
        dist.monitored_barrier(timeout=timedelta(seconds=5))
        dist.monitored_barrier(timeout=timedelta(seconds=5), wait_all_ranks=True)
        g = dist.new_group([0, 1])
        if comm.rank != 2:
            dist.monitored_barrier(g, timeout=timedelta(seconds=5))
        else:  # not a member: torch warns and returns
            with pytest.warns(UserWarning, match="does not belong to the given group"):
                dist.monitored_barrier(g, timeout=timedelta(seconds=5))
        dist.all_reduce(t)
        return t.item()

    assert aiocoll.spawn(fn, world=3) == [9.0, 9.0, 9.0]


def test_monitored_barrier_names_the_rank_that_did_not_come() -> None:
    def fn(comm: Comm) -> str | None:
        other = dist.new_group()  # where the ranks meet afterwards: the default group breaks
        got = None
        if comm.rank != 1:
            got = _error(lambda: dist.monitored_barrier(timeout=timedelta(seconds=0.2)))
        dist.barrier(group=other)
        return got

    r0, r1, r2 = aiocoll.spawn(fn, world=3)
    assert r0 == "GroupTimeoutError: [Rank 0]: Rank 1 failed to pass monitoredBarrier in 200 ms"
    assert r1 is None
    assert r2 == (
        "GroupTimeoutError: Rank 2 successfully reached monitoredBarrier, but received errors while waiting "
        "for send/recv from rank 0. Please check rank 0 logs for faulty rank."
    )


def test_monitored_barrier_waiting_for_all_names_every_rank_that_did_not_come() -> None:
    def fn(comm: Comm) -> str | None:
        if comm.rank == 0:
            return _error(lambda: dist.monitored_barrier(timeout=timedelta(seconds=0.1), wait_all_ranks=True))
        return None

    assert aiocoll.spawn(fn, world=3)[0] == (
        "GroupTimeoutError: [Rank 0]: Ranks 1, 2 failed to pass monitoredBarrier in 100 ms"
    )


def test_monitored_barrier_with_no_time_left() -> None:
    def fn(comm: Comm) -> str | None:
        g = dist.new_group()
        if comm.rank == 0:
            return _error(lambda: g.monitored_barrier(timedelta(0)))  # the group's own method, as torch's tests call it
        return None

    assert aiocoll.spawn(fn, world=2)[0] == "GroupTimeoutError: Rank 0 timed out in monitoredBarrier after 0 ms."


def test_monitored_barrier_on_an_async_rank_is_refused() -> None:
    async def fn(comm: Comm) -> str | None:
        await asyncio.sleep(0)
        return _error(lambda: dist.monitored_barrier(timeout=timedelta(seconds=1)))

    for got in aiocoll.spawn(fn, world=2):
        assert got is not None
        assert got.startswith("BlockingCallError: torch.distributed.monitored_barrier on rank")
