"""aiocoll inside code that uses anyio: on anyio's asyncio backend, and what trio users get.

On the asyncio backend (plain asyncio or uvloop, through the ``loop`` fixture):
``anyio.run`` around ``spawn_async``, anyio task groups inside ranks, cancel scopes around
the whole world and around one rank's collective, ``fail_after`` in a rank. With trio
(``anyio.run(..., backend="trio")``), aiocoll cannot run on trio's loop; the tests show the
error a trio user gets and the way that works: ``spawn`` in a worker thread.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

import aiocoll
from aiocoll import Comm, WorldAbortedError

T = TypeVar("T")

FAST = 5.0  # seconds: "at once", with room for a loaded machine


def _run(loop: str, main: Callable[[], Awaitable[T]]) -> T:
    """``anyio.run(main)`` on the asyncio backend, with uvloop when ``loop`` says so."""
    return anyio.run(main, backend="asyncio", backend_options={"use_uvloop": loop == "uvloop"})


@dataclass
class _Snapshot:
    """What a world must leave as it found it (taken inside the running loop)."""

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

    def new_tasks(self) -> set[asyncio.Task[Any]]:
        return asyncio.all_tasks() - self.tasks

    def new_threads(self) -> set[threading.Thread]:
        # aiocoll's rank threads; anyio keeps its idle worker threads for reuse
        return {t for t in set(threading.enumerate()) - self.threads if t.name.startswith("aiocoll")}

    def check(self) -> None:
        assert not self.new_tasks(), f"tasks left behind: {self.new_tasks()}"
        assert asyncio.get_running_loop().get_task_factory() is self.factory
        assert not self.new_threads(), f"threads left behind: {self.new_threads()}"
        assert c10d._world is self.c10d_world
        assert not dist.is_initialized()


async def _rank_of(comm: Comm) -> int:
    await comm.barrier()
    return comm.rank


# -- (a) anyio around spawn_async, anyio task groups inside ranks ----------------------


async def _streams(comm: Comm) -> dict[str, Any]:
    """Helpers in an anyio task group, each with a group of its own, run collectives
    concurrently with the rank's own task (groups keep separate call sequences)."""
    streams = [await comm.new_group(list(range(comm.world_size))) for _ in range(3)]
    out: dict[str, Any] = {}

    async def summing(g: Comm) -> None:
        total = torch.zeros(1)
        for step in range(5):
            t = torch.tensor([float(g.rank + step)])
            await g.all_reduce(t)
            total += t
        out["sum"] = total.item()

    async def gathering(g: Comm) -> None:
        out["gathered"] = await g.all_gather_object({"rank": g.rank})

    async def broadcasting(g: Comm, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        t = torch.tensor([float(g.rank)])
        work = g.broadcast(t, src=2)  # issued before the task reports itself started
        task_status.started()
        await work
        out["broadcast"] = t.item()

    async with anyio.create_task_group() as tg:
        s0, s1, s2 = streams
        assert s0 is not None and s1 is not None and s2 is not None  # noqa: PT018
        await tg.start(broadcasting, s2)
        tg.start_soon(summing, s0)
        tg.start_soon(gathering, s1)
        # the rank's own task runs collectives on the world meanwhile, and blocking
        # work goes to anyio's worker threads
        doubled = await anyio.to_thread.run_sync(lambda: 2 * comm.rank)
        t = torch.tensor([float(doubled)])
        await comm.all_reduce(t)
        out["world"] = t.item()
    return out


def test_anyio_run_around_spawn_async_with_task_groups_in_ranks(loop: str) -> None:
    async def main() -> list[dict[str, Any]]:
        before = _Snapshot.take()
        results = await aiocoll.spawn_async(_streams, world=4)
        before.check()
        return results

    results = _run(loop, main)
    n = 4
    for r in results:
        assert r["sum"] == sum(n * step + n * (n - 1) / 2 for step in range(5))
        assert r["gathered"] == [{"rank": i} for i in range(n)]
        assert r["broadcast"] == 2.0
        assert r["world"] == 2 * n * (n - 1) / 2


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_in_an_anyio_pytest_test(anyio_backend: str) -> None:
    before = _Snapshot.take()
    assert await aiocoll.spawn_async(_rank_of, world=3) == [0, 1, 2]
    before.check()


# -- (b) a cancel scope around spawn_async ---------------------------------------------


def test_cancel_scope_around_spawn_async_cancels_the_world(loop: str) -> None:
    got: dict[int, BaseException] = {}
    started: set[int] = set()

    async def fn(comm: Comm) -> None:
        started.add(comm.rank)
        try:
            if comm.rank == 0:
                await anyio.sleep(100)
            elif comm.rank == 1:
                await comm.recv(torch.empty(1), src=0)
            else:
                await comm.all_reduce(torch.ones(1))
        except BaseException as e:
            got[comm.rank] = e
            raise

    async def main() -> None:
        before = _Snapshot.take()
        t0 = time.monotonic()
        with anyio.move_on_after(0.2) as scope:
            await aiocoll.spawn_async(fn, world=4)
        assert scope.cancelled_caught
        assert time.monotonic() - t0 < FAST
        before.check()
        # the loop is fit for another world
        assert await aiocoll.spawn_async(_rank_of, world=2) == [0, 1]
        before.check()

    _run(loop, main)
    assert started == {0, 1, 2, 3}
    for r in range(4):
        assert isinstance(got[r], asyncio.CancelledError), f"rank {r} got {got[r]!r}"


async def _task_group_in_rank(comm: Comm) -> None:
    async with anyio.create_task_group() as tg:
        tg.start_soon(anyio.sleep, 100)
        await comm.all_reduce(torch.ones(1))


async def _cleanup_in_rank(comm: Comm) -> None:
    try:
        await comm.all_reduce(torch.ones(1))
    finally:
        # a clean-up that takes a few loop turns (e.g. closing a connection)
        with anyio.CancelScope(shield=True):
            for _ in range(5):
                await anyio.lowlevel.checkpoint()


@pytest.mark.parametrize("body", [_task_group_in_rank, _cleanup_in_rank], ids=["task-group", "cleanup"])
def test_cancel_scope_waits_for_ranks_still_finishing(loop: str, body: Callable[[Comm], Awaitable[None]]) -> None:
    finished: list[int] = []

    async def fn(comm: Comm) -> None:
        try:
            if comm.rank == 0:
                await anyio.sleep(100)
            await body(comm)
        finally:
            finished.append(comm.rank)

    async def main() -> None:
        before = _Snapshot.take()
        with anyio.move_on_after(0.1):
            await aiocoll.spawn_async(fn, world=3)
        left = before.new_tasks()
        finished_in_time = sorted(finished)
        if left:  # do not leave them to the next test
            await asyncio.wait(left)
        assert not left, f"spawn_async returned with ranks still running: {left}"
        assert finished_in_time == [0, 1, 2]

    _run(loop, main)


# Run in a child process: the rank threads it leaves behind run on against torn-down state.
_THREADS_SCRIPT = """
import threading, anyio, torch, torch.distributed as dist, aiocoll

release = threading.Event()

def fn(comm):
    if comm.rank == 0:
        release.wait(5)  # busy outside a collective: a thread cannot be interrupted
    dist.all_reduce(torch.ones(1))

async def main():
    before = set(threading.enumerate())
    with anyio.move_on_after(0.1):
        await aiocoll.spawn_async(fn, world=3)
    running = [t.name for t in set(threading.enumerate()) - before if t.name.startswith("aiocoll")]
    release.set()
    print("rank threads running after spawn_async returned:", sorted(running))

anyio.run(main)
"""


def test_cancel_scope_waits_for_rank_threads() -> None:
    r = subprocess.run([sys.executable, "-c", _THREADS_SCRIPT], capture_output=True, text=True, timeout=120)
    assert "rank threads running after spawn_async returned:" in r.stdout, r.stdout + r.stderr
    assert "rank threads running after spawn_async returned: []" in r.stdout, r.stdout + r.stderr
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr, r.stderr


# -- (c) a rank leaves a collective through a cancel scope -----------------------------


def test_rank_leaving_a_collective_with_move_on_after_aborts_the_others(loop: str) -> None:
    got: dict[int, BaseException] = {}
    left_at: list[float] = []

    async def fn(comm: Comm) -> str:
        try:
            if comm.rank == 0:
                with anyio.move_on_after(0.05):
                    await comm.all_reduce(torch.ones(1))
                left_at.append(time.monotonic())
                return "gave up"
            if comm.rank == 1:
                await anyio.sleep(100)  # the slow peer
            await comm.all_reduce(torch.ones(1))
            return "reduced"
        except BaseException as e:
            got[comm.rank] = e
            raise

    t0 = time.monotonic()
    with pytest.raises(WorldAbortedError) as ei:
        _run(loop, lambda: aiocoll.spawn_async(fn, world=3, timeout=10))
    elapsed = time.monotonic() - t0

    # the report names the rank that left, and what it left
    assert ei.value.rank == 0
    assert str(ei.value).startswith("rank 0 was cancelled while waiting in all_reduce(float32[1]")
    assert any("ranks [1, 2] were aborted because of it" in n for n in ei.value.__notes__)
    # rank 2, waiting in the collective, is released with an error naming rank 0 ...
    assert isinstance(got[2], WorldAbortedError), f"rank 2 got {got[2]!r}"
    assert got[2].rank == 0
    assert "rank 0 was cancelled while waiting in all_reduce" in str(got[2])
    # ... and rank 1, busy elsewhere, is cancelled
    assert isinstance(got[1], asyncio.CancelledError), f"rank 1 got {got[1]!r}"
    assert 0 not in got
    # at once: when rank 0 gave up, not at the 10 s collective timeout
    assert left_at
    assert elapsed >= 0.05
    assert elapsed < FAST


# -- (d) anyio.fail_after in a rank ----------------------------------------------------


def test_fail_after_in_a_rank_is_the_root_cause(loop: str) -> None:
    async def fn(comm: Comm) -> None:
        if comm.rank == 2:
            with anyio.fail_after(0.05):
                await comm.all_reduce(torch.ones(1))
        if comm.rank == 1:
            await anyio.sleep(100)
        await comm.all_reduce(torch.ones(1))

    t0 = time.monotonic()
    with pytest.raises(TimeoutError) as ei:
        _run(loop, lambda: aiocoll.spawn_async(fn, world=3, timeout=10))
    assert time.monotonic() - t0 < FAST
    assert type(ei.value) is TimeoutError  # anyio's, not aiocoll's CollectiveTimeoutError
    assert "aiocoll: raised on rank 2 of a world of 3" in ei.value.__notes__
    assert "aiocoll: ranks [0, 1] were aborted because of it" in ei.value.__notes__


# -- failures inside anyio task groups -------------------------------------------------


async def _helper_raises(comm: Comm) -> None:
    async with anyio.create_task_group() as tg:

        async def helper() -> None:
            if comm.rank == 1:
                raise KeyError("helper failed")
            await comm.barrier()

        tg.start_soon(helper)


def test_helper_failure_in_a_task_group_reaches_spawn(loop: str) -> None:
    t0 = time.monotonic()
    with pytest.raises(ExceptionGroup) as ei:  # anyio's task group wraps what its tasks raise
        _run(loop, lambda: aiocoll.spawn_async(_helper_raises, world=3, timeout=10))
    assert time.monotonic() - t0 < FAST
    assert ei.group_contains(KeyError, match="helper failed")
    assert "aiocoll: raised on rank 1 of a world of 3" in ei.value.__notes__


def test_task_group_report_tells_aborted_ranks_from_the_failed_one(loop: str) -> None:
    with pytest.raises(ExceptionGroup) as ei:
        _run(loop, lambda: aiocoll.spawn_async(_helper_raises, world=3, timeout=10))
    notes = ei.value.__notes__
    assert "aiocoll: ranks [0, 2] raised the same ExceptionGroup" not in notes
    assert "aiocoll: ranks [0, 2] were aborted because of it" in notes


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="aiocoll limitation: a rank whose task waits on a task group (anyio's or asyncio's) is "
    "never counted as blocked, so a deadlock among its helpers is reported at the collective "
    "timeout, as CollectiveTimeoutError, instead of at once as DeadlockError",
)
def test_deadlock_among_task_group_helpers_is_reported_at_once() -> None:
    async def fn(comm: Comm) -> None:
        async with anyio.create_task_group() as tg:

            async def helper() -> None:
                if comm.rank == 0:
                    await comm.recv(torch.empty(1), src=1)  # rank 1 never sends
                await comm.barrier()

            tg.start_soon(helper)

    with pytest.raises(ExceptionGroup) as ei:
        _run("asyncio", lambda: aiocoll.spawn_async(fn, world=2, timeout=0.5))
    assert ei.group_contains(aiocoll.DeadlockError), repr(ei.value.exceptions)


# -- trio ------------------------------------------------------------------------------


def _trio() -> Any:
    return pytest.importorskip("trio", reason="trio is not installed (pip install trio)")


async def _sums(comm: Comm) -> float:
    t = torch.ones(1) * comm.rank
    await comm.all_reduce(t)
    return t.item()


def test_spawn_async_on_trio_says_it_needs_asyncio() -> None:
    _trio()
    ran: list[int] = []

    async def fn(comm: Comm) -> None:
        ran.append(comm.rank)

    with pytest.raises(RuntimeError) as ei:
        anyio.run(aiocoll.spawn_async, fn, 2, backend="trio")
    assert ran == []
    message = str(ei.value)
    assert "asyncio" in message, message
    assert "trio" in message, message


def test_spawn_in_a_trio_task_is_refused() -> None:
    trio = _trio()
    ran: list[int] = []

    async def fn(comm: Comm) -> None:
        ran.append(comm.rank)

    async def main() -> None:
        aiocoll.spawn(fn, 2)  # would block trio's loop until the world ends

    with pytest.raises(RuntimeError, match=r"would block trio's event loop.*trio.to_thread.run_sync"):
        trio.run(main)
    assert ran == []


def test_trio_runs_spawn_in_a_worker_thread() -> None:
    trio = _trio()
    started = threading.Event()
    trio_ran = threading.Event()

    async def waits_for_trio(comm: Comm) -> float:
        if comm.rank == 0:
            started.set()
            # proof that trio's loop runs while the world does: trio sets this (and
            # anyio works in the ranks: their loop is asyncio's)
            assert await anyio.to_thread.run_sync(trio_ran.wait, FAST)
        return await _sums(comm)

    def sync_rank(comm: Comm) -> float:  # plain torch.distributed code runs as well
        t = torch.ones(1) * dist.get_rank()
        dist.all_reduce(t)
        return t.item()

    async def main() -> tuple[list[float], list[float]]:
        results: list[list[float]] = []

        async def world() -> None:
            results.append(await trio.to_thread.run_sync(aiocoll.spawn, waits_for_trio, 4))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(world)
            assert await trio.to_thread.run_sync(started.wait, FAST)
            trio_ran.set()
        sync = await trio.to_thread.run_sync(aiocoll.spawn, sync_rank, 4)
        return results[0], sync

    assert trio.run(main) == ([6.0] * 4, [6.0] * 4)
