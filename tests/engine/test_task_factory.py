"""Ranks on a loop with a task factory of its own: eager tasks, and a factory replaced while the ranks run.

The engine counts a rank's tasks through the loop's task factory, to tell a blocked rank
from a busy one. ``asyncio.eager_task_factory`` (Python 3.12+) runs a task's first step
inside ``create_task``, before the caller gets the task; a rank may also set a factory
of its own in the middle of ``spawn``. Neither may turn a live rank into a reported
deadlock, nor hide a real one.
"""

from __future__ import annotations

import asyncio
import gc
import sys
import time
import weakref
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import torch

import aiocoll
from aiocoll import Comm

needs_eager = pytest.mark.skipif(sys.version_info < (3, 12), reason="asyncio.eager_task_factory is new in Python 3.12")
FAST = 5.0  # seconds: a deadlock reported at once, not at the timeout

RankFn = Callable[[Comm], Coroutine[Any, Any, Any]]


def _eager_spawn(fn: RankFn, world: int, timeout: float = 60.0) -> list[Any]:
    """``spawn_async`` on a loop whose task factory is ``asyncio.eager_task_factory``."""

    async def main() -> list[Any]:
        loop = asyncio.get_running_loop()
        loop.set_task_factory(asyncio.eager_task_factory)  # type: ignore[attr-defined]
        try:
            return await aiocoll.spawn_async(fn, world=world, timeout=timeout)
        finally:
            assert loop.get_task_factory() is asyncio.eager_task_factory  # type: ignore[attr-defined]

    return asyncio.run(main())


def _counting_factory(made: list[str]) -> Any:
    """A task factory of a user's, which notes the name of each coroutine it makes a task of."""

    def factory(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any], **kwargs: Any) -> asyncio.Task[Any]:
        made.append(coro.__qualname__)
        return asyncio.Task(coro, loop=loop, **kwargs)

    return factory


# -- an eager factory set before spawn_async ----------------------------------------


@needs_eager
def test_a_rank_that_waits_in_its_first_step_is_not_deadlocked() -> None:
    # rank 0's task runs to its all_reduce inside create_task, before rank 1's task exists
    async def fn(comm: Comm) -> float:
        if comm.rank == 1:
            await asyncio.sleep(0.01)
        t = torch.full((2,), float(comm.rank + 1))
        await comm.all_reduce(t)
        return t[0].item()

    assert _eager_spawn(fn, world=2) == [3.0, 3.0]


@needs_eager
def test_a_task_that_waits_in_its_first_step_keeps_its_rank_live() -> None:
    # the helper waits in recv before create_task returns; rank 0's own task goes on
    async def fn(comm: Comm) -> list[float]:
        got = torch.zeros(1)
        if comm.rank == 0:
            helper = asyncio.create_task(_recv(comm, got, src=1))
            await asyncio.sleep(0.05)
            await comm.send(torch.full((1,), 5.0), dst=1)
            await helper
        else:
            await comm.recv(got, src=0)
            await comm.send(got * 2, dst=0)
        return got.tolist()

    assert _eager_spawn(fn, world=2) == [[10.0], [5.0]]


async def _recv(comm: Comm, t: torch.Tensor, src: int) -> None:
    await comm.recv(t, src=src)


@needs_eager
def test_deadlock_in_a_gather_of_eager_tasks_is_reported_at_once() -> None:
    # every gathered op waits before the gather is awaited (its tasks started eagerly)
    async def fn(comm: Comm) -> None:
        t = torch.ones(1)
        if comm.rank == 0:
            await asyncio.gather(comm.all_reduce(t), comm.recv(torch.empty(1), src=1))
        else:
            await comm.all_reduce(t)

    start = time.monotonic()
    with pytest.raises(aiocoll.DeadlockError) as info:
        _eager_spawn(fn, world=2)
    assert time.monotonic() - start < FAST
    assert "rank 0: blocked in recv(float32[1], src=1, tag=0)" in str(info.value)


@needs_eager
def test_eager_tasks_done_in_their_first_step_leave_the_counts_right() -> None:
    # 50 tasks end inside create_task; a deadlock after them is still seen at once
    async def noop() -> int:
        return 1

    async def fn(comm: Comm) -> None:
        done = [asyncio.create_task(noop()) for _ in range(50)]
        assert all(t.done() for t in done)  # the factory did run them eagerly
        await comm.barrier()
        if comm.rank == 0:
            await comm.recv(torch.empty(1), src=1)

    start = time.monotonic()
    with pytest.raises(aiocoll.DeadlockError):
        _eager_spawn(fn, world=2)
    assert time.monotonic() - start < FAST


# -- a factory set by a rank while the world runs -----------------------------------


def _replace_factory(factory: Any) -> None:
    asyncio.get_running_loop().set_task_factory(factory)


async def _helper_sends_late(comm: Comm) -> None:
    await asyncio.sleep(0.05)
    await comm.send(torch.full((1,), 7.0), dst=1)


def test_tasks_made_by_a_factory_set_in_a_rank_keep_it_live() -> None:
    # rank 0 waits in recv while a task made through the new factory has yet to send:
    # every rank looks blocked for 50 ms, and none is
    made: list[str] = []

    async def fn(comm: Comm) -> float:
        got = torch.zeros(1)
        if comm.rank == 0:
            _replace_factory(_counting_factory(made))
            helper = asyncio.create_task(_helper_sends_late(comm))
            await comm.recv(got, src=1)
            await helper
            await asyncio.create_task(_nothing())  # made through the new factory still
        else:
            await comm.recv(got, src=0)
            await comm.send(got + 1, dst=0)
        return got.item()

    assert aiocoll.spawn(fn, world=2, loop="asyncio") == [8.0, 7.0]
    assert {"_helper_sends_late", "_nothing"} <= set(made)


async def _nothing() -> None:
    pass


def test_deadlock_after_a_rank_set_a_factory() -> None:
    # rank 0's task waits for a helper made through its own factory, which waits in a
    # recv that rank 1 (returned) never answers
    async def fn(comm: Comm) -> None:
        if comm.rank == 0:
            _replace_factory(_counting_factory([]))
            await asyncio.create_task(_recv(comm, torch.empty(1), src=1))

    start = time.monotonic()
    if sys.version_info >= (3, 12):
        with pytest.raises(aiocoll.DeadlockError) as info:
            aiocoll.spawn(fn, world=2, loop="asyncio", timeout=60.0)
        assert time.monotonic() - start < FAST
        assert "rank 1: returned" in str(info.value)
    else:
        # Python 3.11 cannot tell whose tasks they are: the timeout reports it, and says why
        with pytest.raises(aiocoll.CollectiveTimeoutError) as timed_out:
            aiocoll.spawn(fn, world=2, loop="asyncio", timeout=1.0)
        notes = "\n".join(timed_out.value.__notes__)
        assert "task factory was replaced while the ranks ran" in notes


@needs_eager
def test_an_eager_factory_set_in_a_rank() -> None:
    # what a user of spawn does to get eager tasks: set the factory in the rank itself
    async def fn(comm: Comm) -> list[float]:
        _replace_factory(asyncio.eager_task_factory)  # type: ignore[attr-defined]
        t = torch.ones(1)
        got = torch.zeros(1)
        peer = 1 - comm.rank
        helper = asyncio.create_task(_recv(comm, got, src=peer))
        assert not helper.done()  # it waits in its recv already
        await asyncio.sleep(0.02 * comm.rank)
        await asyncio.gather(comm.send(t * (comm.rank + 1), dst=peer), comm.all_reduce(t))
        await helper
        return [t.item(), got.item()]

    assert aiocoll.spawn(fn, world=2, loop="asyncio") == [[2.0, 2.0], [2.0, 1.0]]


@needs_eager
def test_two_tasks_that_park_before_any_check_are_counted_once() -> None:
    # both wait in recv before the engine first looks: its totals were off by one
    async def fn(comm: Comm) -> float:
        if comm.rank == 0:
            _replace_factory(asyncio.eager_task_factory)  # type: ignore[attr-defined]
            a, b = torch.zeros(1), torch.zeros(1)
            helpers = [asyncio.create_task(_recv(comm, a, 1)), asyncio.create_task(_recv(comm, b, 1))]
            await asyncio.sleep(0.05)  # every rank looks blocked meanwhile
            await comm.send(torch.ones(1), dst=1)
            await asyncio.gather(*helpers)
            return a.item() + b.item()
        x = torch.zeros(1)
        await comm.recv(x, src=0)
        await comm.send(x, dst=0)
        await comm.send(x * 2, dst=0)
        return x.item()

    assert aiocoll.spawn(fn, world=2, loop="asyncio") == [3.0, 1.0]


@needs_eager
def test_a_factory_set_for_a_moment_and_put_back() -> None:
    # the task made meanwhile is found although the engine's factory is back in place
    async def fn(comm: Comm) -> float:
        got = torch.zeros(1)
        if comm.rank == 0:
            loop = asyncio.get_running_loop()
            old = loop.get_task_factory()
            loop.set_task_factory(asyncio.eager_task_factory)  # type: ignore[attr-defined]
            helper = asyncio.create_task(_recv(comm, got, 1))
            loop.set_task_factory(old)
            await asyncio.sleep(0.05)
            await comm.send(torch.ones(1), dst=1)
            await helper
        else:
            await comm.recv(got, src=0)
            await comm.send(got + 1, dst=0)
        return got.item()

    assert aiocoll.spawn(fn, world=2, loop="asyncio") == [2.0, 1.0]


def test_a_factory_that_wraps_the_engines_and_outlives_the_world() -> None:
    # a tracing factory calls the one it replaced (aiocoll's): a deadlock is still
    # reported, tasks are still made after it, and after the world ends
    made: list[str] = []

    async def fn(comm: Comm) -> str:
        loop = asyncio.get_running_loop()
        if comm.rank == 0:
            inner = loop.get_task_factory()
            assert inner is not None

            def tracing(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any], **kwargs: Any) -> Any:
                made.append(coro.__qualname__)
                return inner(loop, coro, **kwargs)

            loop.set_task_factory(tracing)
        try:
            await comm.recv(torch.empty(1), src=1 - comm.rank)  # both ranks: a deadlock
        except aiocoll.DeadlockError as e:
            caught = type(e).__name__
        await asyncio.create_task(_nothing())
        return caught

    async def main(timeout: float) -> tuple[list[str], float]:
        loop = asyncio.get_running_loop()
        start = time.monotonic()
        try:
            caught = await aiocoll.spawn_async(fn, world=2, timeout=timeout)
            took = time.monotonic() - start
            await asyncio.create_task(_nothing())  # the rank's factory is still the loop's
        finally:
            loop.set_task_factory(None)
        return caught, took

    if sys.version_info >= (3, 12):
        caught, took = asyncio.run(main(timeout=60.0))
        assert caught == ["DeadlockError", "DeadlockError"]
        assert took < FAST
        assert made.count("_nothing") == 3
    else:
        # 3.11 cannot tell that the new factory still counts the tasks: the timeout reports it
        with pytest.raises(aiocoll.CollectiveTimeoutError) as info:
            asyncio.run(main(timeout=1.0))
        assert "task factory was replaced while the ranks ran" in "\n".join(info.value.__notes__)


@needs_eager
def test_deadlock_in_the_first_step_of_every_rank_is_reported_at_once() -> None:
    # the last rank's task blocks inside create_task, as spawn_async makes it
    async def fn(comm: Comm) -> None:
        await comm.recv(torch.empty(1), src=(comm.rank + 1) % comm.world_size)

    start = time.monotonic()
    with pytest.raises(aiocoll.DeadlockError) as info:
        _eager_spawn(fn, world=3)
    assert time.monotonic() - start < FAST
    assert all(f"rank {r}: blocked in recv" in str(info.value) for r in range(3))


@needs_eager
def test_every_rank_sets_a_factory_in_its_first_step() -> None:
    # the rank tasks start eagerly under spawn_async, and each makes tasks that park at once
    async def fn(comm: Comm) -> list[float]:
        _replace_factory(asyncio.eager_task_factory)  # type: ignore[attr-defined]
        other = 1 - comm.rank

        async def recv() -> float:
            x = torch.zeros(1)
            await comm.recv(x, src=other)
            return x.item()

        helpers = [asyncio.create_task(recv()) for _ in range(2)]
        await asyncio.sleep(0.01)
        for i in range(2):
            await comm.send(torch.full((1,), float(i)), dst=other)
        return list(await asyncio.gather(*helpers))

    assert _eager_spawn(fn, world=2) == [[0.0, 1.0], [0.0, 1.0]]


@needs_eager
def test_deadlock_in_a_task_awaited_after_an_eager_factory_set_in_a_rank() -> None:
    # the task parks in its first step, found then; its rank awaits it a moment later
    async def fn(comm: Comm) -> None:
        _replace_factory(asyncio.eager_task_factory)  # type: ignore[attr-defined]
        await asyncio.create_task(_recv(comm, torch.zeros(1), src=1 - comm.rank))

    start = time.monotonic()
    with pytest.raises(aiocoll.DeadlockError):
        aiocoll.spawn(fn, world=2, loop="asyncio", timeout=60.0)
    assert time.monotonic() - start < FAST


@needs_eager
def test_a_factory_set_in_the_first_step_of_an_eager_task() -> None:
    # rank 0's helper runs inside the engine's factory call and makes a task out of sight
    async def fn(comm: Comm) -> float:
        got = torch.zeros(1)
        if comm.rank == 0:
            await asyncio.sleep(0.05)  # rank 1 waits in recv meanwhile

            async def helper() -> None:
                loop = asyncio.get_running_loop()
                old = loop.get_task_factory()
                loop.set_task_factory(asyncio.eager_task_factory)  # type: ignore[attr-defined]
                out_of_sight = asyncio.create_task(_recv(comm, torch.zeros(1), src=1))
                loop.set_task_factory(old)
                await comm.recv(got, src=1)
                await out_of_sight

            task = asyncio.create_task(helper())
            await comm.send(torch.ones(1), dst=1)  # rank 0's own task can still act
            await task
        else:
            await comm.recv(got, src=0)
            await comm.send(got + 1, dst=0)
            await comm.send(got + 2, dst=0)
        return got.item()

    assert _eager_spawn(fn, world=2) in ([2.0, 1.0], [3.0, 1.0])


@needs_eager
def test_worlds_after_one_whose_rank_left_a_wrapping_factory() -> None:
    # the wrapper stays on the loop and calls the engine's factory: later worlds neither
    # recurse nor lose the eager factory set before the first one
    async def fn(comm: Comm) -> int:
        if comm.rank == 0:
            loop = asyncio.get_running_loop()
            inner = loop.get_task_factory()
            assert inner is not None

            def tracing(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any], **kwargs: Any) -> Any:
                return inner(loop, coro, **kwargs)

            loop.set_task_factory(tracing)
        await comm.barrier()
        return await asyncio.create_task(_one())

    async def main() -> list[Any]:
        loop = asyncio.get_running_loop()
        loop.set_task_factory(asyncio.eager_task_factory)  # type: ignore[attr-defined]
        try:
            out = [await aiocoll.spawn_async(fn, world=2)]
            out.append(asyncio.create_task(_one()).done())  # eager still
            out.append(await aiocoll.spawn_async(fn, world=2))
            out.append(asyncio.create_task(_one()).done())
            await asyncio.sleep(0)
            return out
        finally:
            loop.set_task_factory(None)

    assert asyncio.run(main()) == [[1, 1], True, [1, 1], True]


async def _one() -> int:
    return 1


@needs_eager
def test_tasks_made_out_of_sight_do_not_outlive_the_world() -> None:
    ran: list[int] = []

    async def fn(comm: Comm) -> None:
        _replace_factory(asyncio.eager_task_factory)  # type: ignore[attr-defined]

        async def late() -> None:
            await asyncio.sleep(0.2)
            ran.append(comm.rank)

        asyncio.create_task(late())  # noqa: RUF006 (left running on purpose)

    async def main() -> None:
        await aiocoll.spawn_async(fn, world=2)
        await asyncio.sleep(0.4)
        asyncio.get_running_loop().set_task_factory(None)

    asyncio.run(main())
    assert ran == []


# -- worlds one after another on one loop ---------------------------------------------


def _leave_a_wrapper(calls: list[int], wrap_coro: bool = False) -> None:
    """Set a factory that calls the one it found (aiocoll's), as a tracing library would; it is left on the loop."""
    loop = asyncio.get_running_loop()
    inner = loop.get_task_factory()
    assert inner is not None

    def tracing(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any], **kwargs: Any) -> Any:
        calls.append(1)
        return inner(loop, _traced(coro) if wrap_coro else coro, **kwargs)

    loop.set_task_factory(tracing)


async def _traced(coro: Coroutine[Any, Any, Any]) -> Any:
    return await coro


@pytest.mark.parametrize("wrap_coro", [False, True], ids=["same-coroutine", "wrapped-coroutine"])
def test_a_wrapper_left_by_a_rank_runs_once_per_task_in_later_worlds(wrap_coro: bool) -> None:
    calls: list[int] = []

    async def leave(comm: Comm) -> int:
        if comm.rank == 0:
            _leave_a_wrapper(calls, wrap_coro)
        return await asyncio.create_task(_one())

    async def later(comm: Comm) -> int:
        return await asyncio.create_task(_one())

    async def main() -> list[Any]:
        loop = asyncio.get_running_loop()
        try:
            out: list[Any] = [await aiocoll.spawn_async(leave, world=2)]
            for _ in range(2):  # a world in front of the wrapper, then the wrapper alone
                out.append(await aiocoll.spawn_async(later, world=2))
                calls.clear()
                await asyncio.create_task(_one())
                out.append(len(calls))
            return out
        finally:
            loop.set_task_factory(None)

    assert asyncio.run(main()) == [[1, 1], [1, 1], 1, [1, 1], 1]


@needs_eager
def test_an_eager_factory_set_between_worlds_stays_behind_a_wrapper_left_later() -> None:
    async def probe(comm: Comm) -> bool:
        return asyncio.create_task(_one()).done()  # made eagerly: done at once

    async def leave(comm: Comm) -> None:
        if comm.rank == 0:
            _leave_a_wrapper([])

    async def main() -> list[Any]:
        loop = asyncio.get_running_loop()
        try:
            out: list[Any] = [await aiocoll.spawn_async(probe, world=2)]
            loop.set_task_factory(asyncio.eager_task_factory)  # type: ignore[attr-defined]
            out.append(await aiocoll.spawn_async(probe, world=2))
            await aiocoll.spawn_async(leave, world=2)
            out.append(asyncio.create_task(_one()).done())
            out.append(await aiocoll.spawn_async(probe, world=2))
            await asyncio.sleep(0)
            return out
        finally:
            loop.set_task_factory(None)

    assert asyncio.run(main()) == [[False, False], [True, True], True, [True, True]]


def test_a_loop_whose_factory_refers_to_it_is_not_kept_alive() -> None:
    class Tracer:
        def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
            self.loop = loop

        def factory(self, loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any], **kwargs: Any) -> Any:
            return asyncio.Task(coro, loop=loop, **kwargs)

    async def fn(comm: Comm) -> int:
        return comm.rank

    def one() -> weakref.ref[asyncio.AbstractEventLoop]:
        loop = asyncio.new_event_loop()
        try:
            loop.set_task_factory(Tracer(loop).factory)
            assert loop.run_until_complete(aiocoll.spawn_async(fn, world=2)) == [0, 1]
        finally:
            loop.close()
        return weakref.ref(loop)

    refs = [one() for _ in range(3)]
    gc.collect()
    assert [r() for r in refs] == [None, None, None]


@needs_eager
@pytest.mark.parametrize("how", ["asyncio.Task", "eager factory"])
def test_a_task_made_out_of_sight_by_a_rank_that_returned_still_counts(how: str) -> None:
    # rank 0 returns, leaving a task that sends later; rank 1 waits for it meanwhile
    async def fn(comm: Comm) -> float:
        if comm.rank == 0:

            async def later() -> None:
                await asyncio.sleep(0.1)
                await comm.send(torch.ones(1), dst=1)

            if how == "asyncio.Task":
                asyncio.Task(later())  # (past any factory)
            else:
                _replace_factory(asyncio.eager_task_factory)  # type: ignore[attr-defined]
                asyncio.create_task(later())  # noqa: RUF006
            return 0.0
        x = torch.zeros(1)
        await comm.recv(x, src=0)
        return x.item()

    assert aiocoll.spawn(fn, world=2, loop="asyncio") == [0.0, 1.0]
