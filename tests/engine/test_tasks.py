"""``aiocoll._engine._tasks`` on a bare loop: the task factory's counting and the gather accounting, with no world.

The engine's end-to-end behaviour (deadlocks found in gathers, task groups, eager
factories) is tested through ``spawn`` in ``test_failures.py`` and ``test_task_factory.py``;
here a fake rank (the counts ``RankState`` keeps) shows what the module itself does.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from aiocoll import _patches
from aiocoll._engine import _tasks
from aiocoll._engine._tasks import RankTasks
from aiocoll._engine._world import TASK_TRACKING


class FakeRank:
    """A rank's counts, as ``RankState`` keeps them."""

    def __init__(self) -> None:
        self.live = 0
        self.parked = 0

    def _change(self, dlive: int, dparked: int) -> None:
        self.live += dlive
        self.parked += dparked


@pytest.fixture
def loop() -> Any:
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


def test_a_task_made_for_a_rank_is_live_until_it_ends(loop: asyncio.AbstractEventLoop) -> None:
    rank = FakeRank()
    tasks = RankTasks(rank, loop)
    current: list[RankTasks | None] = [None]  # main, made below, is nobody's
    undo = _tasks.install(loop, lambda: current[0])
    try:
        assert loop.get_task_factory() is _tasks.task_factory

        async def main() -> None:
            current[0] = tasks  # the rank runs now
            release = asyncio.Event()
            helper = asyncio.ensure_future(release.wait())
            assert rank.live == 1  # from before its first step
            assert helper in tasks.helpers
            current[0] = None  # no rank current: a task made now is nobody's
            other = asyncio.ensure_future(asyncio.sleep(0))
            assert other not in tasks.helpers
            assert rank.live == 1
            release.set()
            await asyncio.gather(helper, other)
            await asyncio.sleep(0)  # its done callback
            assert rank.live == 0
            assert tasks.helpers == set()

        loop.run_until_complete(main())
    finally:
        undo()
    assert loop.get_task_factory() is None  # put back as found


def test_installs_nest_and_the_factory_found_is_called_and_put_back(loop: asyncio.AbstractEventLoop) -> None:
    made: list[Any] = []

    def theirs(lp: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Task[Any]:
        task = asyncio.Task(coro, loop=lp, **kwargs)
        made.append(task)
        return task

    loop.set_task_factory(theirs)
    _patches.acquire(TASK_TRACKING, loop)
    _patches.acquire(TASK_TRACKING, loop)  # a second world on the loop
    _patches.release(TASK_TRACKING, loop)
    assert loop.get_task_factory() is _tasks.task_factory  # the first world still runs

    async def main() -> None:
        await asyncio.ensure_future(asyncio.sleep(0))

    loop.run_until_complete(main())
    assert len(made) == 2  # main, and the task it made: both through the factory found
    _patches.release(TASK_TRACKING, loop)
    assert loop.get_task_factory() is theirs


def _own_task(loop: asyncio.AbstractEventLoop, rank: FakeRank, tasks: RankTasks, coro: Any) -> asyncio.Task[Any]:
    """The rank's own task: counted live by the engine (as spawn does), not by the factory."""
    undo = _tasks.install(loop, lambda: None)
    try:
        task = loop.create_task(coro)
    finally:
        undo()
    tasks.task = task
    rank._change(1, 0)
    task.add_done_callback(lambda _: rank._change(-1, 0))
    return task


def test_a_task_awaiting_a_gather_of_the_ranks_own_tasks_counts_as_parked(loop: asyncio.AbstractEventLoop) -> None:
    rank = FakeRank()
    tasks = RankTasks(rank, loop)
    ops = [loop.create_future(), loop.create_future()]  # two collectives that wait

    async def op(i: int) -> None:
        await ops[i]

    async def main() -> None:
        await asyncio.gather(op(0), op(1))  # its two tasks are made by the factory: the rank's

    async def drive() -> None:
        task = _own_task(loop, rank, tasks, main())
        undo = _tasks.install(loop, lambda: tasks)
        try:
            for _ in range(3):
                await asyncio.sleep(0)
            assert rank.live == 3  # its task and the gather's two
            rank._change(0, 2)  # both park in their ops (what the engine's parked_one counts)
            tasks.look_for_gatherers()
            assert rank.parked == 3  # the gathering task can do nothing before they end
            assert tasks.gathering == {task: 2}
            for f in ops:
                f.set_result(None)
            rank._change(0, -2)  # they run again (the engine's unparked)
            await task
            await asyncio.sleep(0)
            assert tasks.gathering == {}  # the gather's last task, ending, said so
            assert (rank.live, rank.parked) == (0, 0)
        finally:
            undo()

    loop.run_until_complete(drive())


def test_a_gather_that_waits_for_something_else_is_not_parked(loop: asyncio.AbstractEventLoop) -> None:
    rank = FakeRank()
    tasks = RankTasks(rank, loop)
    op = loop.create_future()
    timer = loop.create_future()  # not the rank's: it may complete by itself

    async def waits_op() -> None:
        await op

    async def main() -> None:
        await asyncio.gather(waits_op(), timer)

    async def drive() -> None:
        task = _own_task(loop, rank, tasks, main())
        undo = _tasks.install(loop, lambda: tasks)
        try:
            for _ in range(3):
                await asyncio.sleep(0)
            rank._change(0, 1)  # its helper parks in the op
            tasks.look_for_gatherers()
            assert tasks.gathering == {}  # the gather also waits for the timer: not parked
            assert rank.parked == 1
            op.set_result(None)
            timer.set_result(None)
            rank._change(0, -1)
            await task
        finally:
            undo()

    loop.run_until_complete(drive())
