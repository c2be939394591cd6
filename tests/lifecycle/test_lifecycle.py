"""Lifecycle: spawn and spawn_async leave nothing behind, cancellation, KeyboardInterrupt, nesting.

The spawn_async tests run their own loop (asyncio or uvloop, through the ``loop`` fixture)
with asyncio.Runner, plus a few pytest-asyncio tests to show it works there.
"""

from __future__ import annotations

import asyncio
import functools
import sys
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

import aiocoll
from aiocoll import Comm, DeadlockError, WorldAbortedError

T = TypeVar("T")
RankFn = Callable[[Comm], Coroutine[Any, Any, Any]]

FAST = 5.0


def _loop_factory(loop: str) -> Callable[[], asyncio.AbstractEventLoop]:
    if loop == "uvloop":
        import uvloop

        return uvloop.new_event_loop
    return asyncio.new_event_loop


def _run(loop: str, main: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run ``main()`` on a new loop of the given kind."""
    with asyncio.Runner(loop_factory=_loop_factory(loop)) as runner:
        return runner.run(main())


@dataclass
class _Snapshot:
    """What a spawn must leave as it found it (taken inside the running loop)."""

    tasks: set[asyncio.Task[Any]]
    factory: object
    threads: set[threading.Thread]
    c10d_world: object

    @classmethod
    def take(cls) -> _Snapshot:
        return cls(
            tasks=asyncio.all_tasks(),
            factory=asyncio.get_running_loop().get_task_factory(),
            threads=set(threading.enumerate()),
            c10d_world=c10d._world,
        )

    def check(self) -> None:
        left = asyncio.all_tasks() - self.tasks
        assert not left, f"tasks left behind: {left}"
        assert asyncio.get_running_loop().get_task_factory() is self.factory
        # threads this world started and left (others' threads may end meanwhile: not its doing)
        assert set(threading.enumerate()) <= self.threads
        assert c10d._world is self.c10d_world
        assert not dist.is_initialized()


# -- spawn_async leaves nothing behind -------------------------------------------------


@pytest.mark.asyncio
async def test_spawn_async_in_pytest_asyncio() -> None:
    before = _Snapshot.take()

    async def fn(comm: Comm) -> tuple[int, float]:
        t = torch.tensor([float(comm.rank)])
        await comm.all_reduce(t)
        return comm.rank, t.item()

    assert await aiocoll.spawn_async(fn, world=3) == [(0, 3.0), (1, 3.0), (2, 3.0)]
    before.check()


@pytest.mark.asyncio
async def test_spawn_from_a_running_loop_points_to_spawn_async() -> None:
    ran: list[int] = []

    async def fn(comm: Comm) -> None:
        ran.append(comm.rank)

    with pytest.raises(RuntimeError, match="spawn_async"):
        aiocoll.spawn(fn, world=2)
    assert ran == []
    assert await aiocoll.spawn_async(fn=fn, world=2) == [None, None]
    assert ran == [0, 1]


async def _raises(comm: Comm) -> None:
    if comm.rank == 1:
        raise KeyError("rank 1 failed")
    await comm.barrier()


async def _deadlocks(comm: Comm) -> None:
    if comm.rank == 0:
        await comm.recv(torch.empty(1), src=1)
    await comm.barrier()


async def _mismatches(comm: Comm) -> None:
    await comm.all_reduce(torch.ones(1 + comm.rank))


async def _times_out(comm: Comm) -> None:
    if comm.rank == 1:
        await asyncio.sleep(5)
    await comm.barrier()


async def _bad_argument(comm: Comm) -> None:
    await comm.broadcast(torch.ones(1), src=comm.rank + 5)


async def _helper_fails(comm: Comm) -> None:
    async def helper() -> None:
        await comm.barrier()
        raise KeyError("helper failed")

    await asyncio.create_task(helper())


FAILURES = [
    pytest.param(_raises, KeyError, id="rank-raises"),
    pytest.param(_deadlocks, DeadlockError, id="deadlock"),
    pytest.param(_mismatches, aiocoll.CollectiveMismatchError, id="mismatch"),
    pytest.param(_times_out, aiocoll.CollectiveTimeoutError, id="timeout"),
    pytest.param(_bad_argument, aiocoll.InvalidArgumentError, id="invalid-argument"),
    pytest.param(_helper_fails, KeyError, id="helper-task-raises"),
]


@pytest.mark.parametrize(("fn", "exc"), FAILURES)
def test_spawn_async_leaves_nothing_behind_after_failure(loop: str, fn: RankFn, exc: type[BaseException]) -> None:
    async def main() -> None:
        before = _Snapshot.take()
        t0 = time.monotonic()
        with pytest.raises(exc):
            await aiocoll.spawn_async(fn, world=3, timeout=0.2 if fn is _times_out else 60)
        assert time.monotonic() - t0 < FAST
        before.check()
        # and the loop is fit for another world
        assert await aiocoll.spawn_async(_rank_of, world=2) == [0, 1]
        before.check()

    _run(loop, main)


async def _rank_of(comm: Comm) -> int:
    await comm.barrier()
    return comm.rank


def test_spawn_leaves_no_threads_and_restores_torch_distributed(loop: str) -> None:
    def blocking(x: float) -> float:
        return x * 2

    async def fn(comm: Comm) -> float:
        # torch.distributed is set up for the rank while it runs ...
        assert dist.get_rank() == comm.rank
        v = await asyncio.to_thread(blocking, float(comm.rank))  # uses the loop's executor
        t = torch.tensor([v])
        await comm.all_reduce(t)
        return t.item()

    threads, world = set(threading.enumerate()), c10d._world
    assert aiocoll.spawn(fn, world=3, loop=loop) == [6.0, 6.0, 6.0]
    assert set(threading.enumerate()) <= threads  # none of its threads is left (others may have ended)
    # ... and torn down afterwards
    assert c10d._world is world
    assert not dist.is_initialized()


def test_spawn_restores_sys_excepthook(loop: str) -> None:
    hook = sys.excepthook
    try:
        assert aiocoll.spawn(_rank_of, world=2, loop=loop) == [0, 1]
        assert sys.excepthook is hook
    finally:
        sys.excepthook = hook


def test_custom_task_factory_is_used_and_restored(loop: str) -> None:
    made: list[str] = []

    def factory(lp: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any], **kw: Any) -> asyncio.Task[Any]:
        made.append(getattr(coro, "__qualname__", "?"))
        return asyncio.Task(coro, loop=lp, **kw)

    async def fn(comm: Comm) -> int:
        if comm.rank == 0:
            # a helper task keeps its rank alive for deadlock detection under a custom factory too
            async def helper() -> None:
                await asyncio.sleep(0.02)

            await asyncio.create_task(helper())
        await comm.barrier()
        return comm.rank

    async def main() -> None:
        lp = asyncio.get_running_loop()
        lp.set_task_factory(factory)  # type: ignore[arg-type]
        try:
            before = _Snapshot.take()
            n = len(made)
            assert await aiocoll.spawn_async(fn, world=3) == [0, 1, 2]
            before.check()
            assert len(made) - n >= 4  # three ranks and the helper went through the user's factory
            with pytest.raises(DeadlockError):
                await aiocoll.spawn_async(_deadlocks, world=2)
            before.check()
        finally:
            lp.set_task_factory(None)

    _run(loop, main)


# -- cancellation from outside ----------------------------------------------------------


@pytest.mark.parametrize("how", ["wait_for", "timeout", "task.cancel"])
def test_cancelling_spawn_async_cancels_every_rank(loop: str, how: str) -> None:
    got: dict[int, BaseException] = {}
    started: list[int] = []

    async def fn(comm: Comm) -> None:
        started.append(comm.rank)
        try:
            if comm.rank == 0:
                await asyncio.sleep(100)
            elif comm.rank == 3:
                await comm.recv(torch.empty(1), src=0)
            else:
                await comm.all_reduce(torch.ones(1))
        except BaseException as e:
            got[comm.rank] = e
            raise

    async def main() -> None:
        before = _Snapshot.take()
        t0 = time.monotonic()
        if how == "wait_for":
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(aiocoll.spawn_async(fn, world=4), 0.05)
        elif how == "timeout":
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.05):
                    await aiocoll.spawn_async(fn, world=4)
        else:
            task = asyncio.create_task(aiocoll.spawn_async(fn, world=4))
            while len(started) < 4:  # every rank has started (and waits, or sleeps)
                await asyncio.sleep(0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        assert time.monotonic() - t0 < FAST
        before.check()

    _run(loop, main)
    assert sorted(started) == [0, 1, 2, 3]
    assert sorted(got) == [0, 1, 2, 3]
    for r, e in got.items():
        assert isinstance(e, asyncio.CancelledError), f"rank {r} got {e!r}"


def test_rank_cancelled_in_collective_aborts_the_others(loop: str) -> None:
    got: dict[int, BaseException] = {}

    async def fn(comm: Comm) -> None:
        try:
            if comm.rank == 0:
                async with asyncio.timeout(0.05):
                    await comm.all_reduce(torch.ones(1))
            elif comm.rank == 1:
                await asyncio.sleep(100)
            await comm.all_reduce(torch.ones(1))
        except BaseException as e:
            got[comm.rank] = e
            raise

    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        aiocoll.spawn(fn, world=3, loop=loop, timeout=5.0)
    elapsed = time.monotonic() - t0
    assert isinstance(got[2], WorldAbortedError), f"rank 2 got {got[2]!r}"
    assert got[2].rank == 0
    assert "cancelled" in str(got[2])
    assert isinstance(got[1], asyncio.CancelledError)
    assert elapsed < 4.0  # released when rank 0 gave up, not at the 5 s collective timeout


# -- KeyboardInterrupt -------------------------------------------------------------------


def test_keyboard_interrupt_in_a_rank_propagates_and_stops_everything(loop: str) -> None:
    started: set[int] = set()
    finished: set[int] = set()
    got: dict[int, BaseException] = {}
    all_started = asyncio.Event()

    async def fn(comm: Comm) -> None:
        started.add(comm.rank)
        if len(started) == 3:
            all_started.set()
        try:
            if comm.rank == 1:
                await all_started.wait()
                raise KeyboardInterrupt
            if comm.rank == 0:
                await asyncio.sleep(100)
            await comm.all_reduce(torch.ones(1))
        except BaseException as e:
            got[comm.rank] = e
            raise
        finally:
            finished.add(comm.rank)

    threads, world = set(threading.enumerate()), c10d._world
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        aiocoll.spawn(fn, world=3, loop=loop)
    assert time.monotonic() - t0 < FAST
    assert started == finished == {0, 1, 2}  # every rank ran to its end: none left suspended
    assert isinstance(got[0], asyncio.CancelledError)
    assert isinstance(got[2], WorldAbortedError | asyncio.CancelledError)
    assert set(threading.enumerate()) <= threads  # none of its threads is left (others may have ended)
    assert c10d._world is world
    assert not dist.is_initialized()


# -- results, calling conventions, nesting ----------------------------------------------

TORCH_DISTRIBUTED = [
    pytest.param(False, id="engine"),
    pytest.param(
        True,
        id="torch_distributed",
    ),
]


def test_results_in_rank_order_when_ranks_finish_in_reverse(loop: str) -> None:
    finished: list[int] = []
    done: dict[int, asyncio.Event] = {}

    async def fn(comm: Comm) -> str:
        for r in range(comm.world_size):
            done.setdefault(r, asyncio.Event())
        if comm.rank + 1 < comm.world_size:
            await done[comm.rank + 1].wait()
        finished.append(comm.rank)
        done[comm.rank].set()
        return f"r{comm.rank}"

    assert aiocoll.spawn(fn, world=4, loop=loop) == ["r0", "r1", "r2", "r3"]
    assert finished == [3, 2, 1, 0]


def test_fn_keyword_partial_and_async_callable(loop: str) -> None:
    async def scaled(comm: Comm, *, factor: float) -> float:
        t = torch.tensor([factor])
        await comm.all_reduce(t)
        return t.item()

    class Worker:
        async def __call__(self, comm: Comm) -> int:
            return comm.rank * 10

    assert aiocoll.spawn(fn=functools.partial(scaled, factor=1.5), world=2, loop=loop) == [3.0, 3.0]
    assert aiocoll.spawn(Worker(), world=3, loop=loop) == [0, 10, 20]

    async def main() -> list[int]:
        return await aiocoll.spawn_async(fn=Worker(), world=2)

    assert _run(loop, main) == [0, 10]


def test_world_of_one(loop: str) -> None:
    async def fn(comm: Comm) -> list[object]:
        t = torch.tensor([2.0, 3.0])
        await comm.all_reduce(t, op=dist.ReduceOp.PRODUCT)
        out = [torch.empty(2)]
        await comm.all_gather(out, t)
        await comm.barrier()
        obj = await comm.broadcast_object({"k": 1}, src=0)
        with pytest.raises(aiocoll.InvalidArgumentError):
            comm.send(t, dst=0)  # the only peer is itself
        return [comm.rank, comm.world_size, t.tolist(), out[0].tolist(), obj]

    assert aiocoll.spawn(fn, world=1, loop=loop) == [[0, 1, [2.0, 3.0], [2.0, 3.0], {"k": 1}]]


@pytest.mark.parametrize("td", TORCH_DISTRIBUTED)
def test_nested_spawn_async_inside_a_rank(loop: str, td: bool) -> None:
    async def inner(comm: Comm) -> float:
        t = torch.tensor([float(comm.rank + 1)])
        await comm.all_reduce(t)
        return t.item()

    async def outer(comm: Comm) -> tuple[list[float], float]:
        # the outer rank waits on its inner world: busy, not parked, so no deadlock is seen
        sub = await aiocoll.spawn_async(inner, world=2 + comm.rank, torch_distributed=td)
        t = torch.tensor([float(comm.rank)])
        await comm.all_reduce(t)
        return sub, t.item()

    res = aiocoll.spawn(outer, world=2, loop=loop)
    assert res == [([3.0, 3.0], 1.0), ([6.0, 6.0, 6.0], 1.0)]


@pytest.mark.parametrize("td", TORCH_DISTRIBUTED)
def test_nested_world_failure_stays_inside(loop: str, td: bool) -> None:
    async def inner(comm: Comm) -> None:
        if comm.rank == 1:
            raise KeyError("inner")
        await comm.barrier()

    async def outer(comm: Comm) -> str:
        with pytest.raises(KeyError):
            await aiocoll.spawn_async(inner, world=2, torch_distributed=td)
        await comm.barrier()  # the outer world was not aborted
        return "ok"

    assert aiocoll.spawn(outer, world=2, loop=loop) == ["ok", "ok"]


@pytest.mark.parametrize("td", TORCH_DISTRIBUTED)
def test_two_worlds_in_one_loop_are_independent(loop: str, td: bool) -> None:
    a_failed = asyncio.Event()

    async def a(comm: Comm) -> None:
        if comm.rank == 0:
            raise KeyError("world A")
        await comm.barrier()

    async def b(comm: Comm) -> float:
        # rank 0 waits in the all_reduce while rank 1 waits for world A to fail first
        if comm.rank == 1:
            await a_failed.wait()
        t = torch.ones(1)
        await comm.all_reduce(t)
        return t.item()

    async def c(comm: Comm) -> None:
        if comm.rank == 0:
            return
        await comm.barrier()  # deadlocks in world C only

    async def main() -> None:
        before = _Snapshot.take()

        async def run_a() -> None:
            try:
                await aiocoll.spawn_async(a, world=2, torch_distributed=td)
            finally:
                a_failed.set()

        ra, rb, rc = await asyncio.gather(
            run_a(),
            aiocoll.spawn_async(b, world=2, torch_distributed=td),
            aiocoll.spawn_async(c, world=2, torch_distributed=td),
            return_exceptions=True,
        )
        assert isinstance(ra, KeyError)
        assert rb == [2.0, 2.0]
        assert isinstance(rc, DeadlockError)
        before.check()

    _run(loop, main)


@pytest.mark.parametrize("td", TORCH_DISTRIBUTED)
def test_two_worlds_interleave_collectives(loop: str, td: bool) -> None:
    async def fn(comm: Comm) -> list[float]:
        t = torch.tensor([float(comm.rank)])
        out = []
        for _ in range(3):
            await comm.all_reduce(t)
            out.append(t.item())
            await asyncio.sleep(0)
        return out

    async def main() -> tuple[list[list[float]], list[list[float]]]:
        x, y = await asyncio.gather(
            aiocoll.spawn_async(fn, world=2, torch_distributed=td),
            aiocoll.spawn_async(fn, world=3, torch_distributed=td),
        )
        return x, y

    x, y = _run(loop, main)
    assert x == [[1.0, 2.0, 4.0]] * 2
    assert y == [[3.0, 9.0, 27.0]] * 3


# -- known leaks -------------------------------------------------------------------------


def test_no_helper_task_outlives_a_failed_spawn_async(loop: str) -> None:
    async def fn(comm: Comm) -> None:
        async def helper() -> None:
            await asyncio.sleep(100)

        asyncio.create_task(helper())  # noqa: RUF006 - the leak is the point
        if comm.rank == 0:
            raise KeyError("rank 0")
        await comm.barrier()

    async def main() -> None:
        before = _Snapshot.take()
        with pytest.raises(KeyError):
            await aiocoll.spawn_async(fn, world=2)
        left = asyncio.all_tasks() - before.tasks
        for t in left:
            t.cancel()
        await asyncio.gather(*left, return_exceptions=True)
        assert not left, f"{len(left)} helper task(s) outlived spawn_async"

    _run(loop, main)


def test_sync_ranks_leave_no_threads() -> None:
    def fn(comm: Comm) -> float:
        t = torch.ones(1)
        comm.all_reduce(t).wait()
        return t.item()

    # a race, lost often on asyncio (uvloop's slower wake-up from threads usually hides it):
    # stop at the first leftover thread
    for _ in range(100):
        threads = set(threading.enumerate())
        assert aiocoll.spawn(fn, world=8, loop="asyncio", torch_distributed=False) == [8.0] * 8
        assert set(threading.enumerate()) <= threads  # none of its threads is left (others may have ended)
