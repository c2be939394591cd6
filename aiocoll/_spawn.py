"""``spawn`` and ``spawn_async``: run a rank function on every rank of a new world."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Coroutine
from typing import Any, Literal, TypeVar

from ._comm import Comm
from ._engine import Phase, RankState, World, install_task_tracking, rank_var
from ._errors import InvalidArgumentError, WorldAbortedError

__all__ = ["DEFAULT_TIMEOUT", "spawn", "spawn_async"]

T = TypeVar("T")

DEFAULT_TIMEOUT = 300.0
"""Seconds a rank may wait in one collective before ``CollectiveTimeoutError``."""

LoopChoice = Literal["auto", "asyncio", "uvloop"] | Callable[[], asyncio.AbstractEventLoop]


def spawn(
    fn: Callable[[Comm], Coroutine[Any, Any, T]],
    world: int,
    *,
    timeout: float | None = DEFAULT_TIMEOUT,
    loop: LoopChoice = "auto",
) -> list[T]:
    """Run ``async def fn(comm)`` on ``world`` ranks of a new event loop; return their results.

    Each rank is an asyncio task; results come back in rank order. If a rank raises,
    every other rank is released at once (``WorldAbortedError`` in a collective, else
    cancelled) and ``spawn`` re-raises the first failure, noting its rank.

    ``timeout`` bounds how long a rank may wait in one collective (None: no bound).
    ``loop`` is ``"auto"`` (uvloop when installed), ``"asyncio"``, ``"uvloop"`` or a
    loop factory.

    >>> import torch, aiocoll
    >>> async def worker(comm):
    ...     t = torch.ones(2) * comm.rank
    ...     await comm.all_reduce(t)
    ...     return t.tolist()
    >>> aiocoll.spawn(worker, world=4)
    [[6.0, 6.0], [6.0, 6.0], [6.0, 6.0], [6.0, 6.0]]
    """
    _check(fn, world, timeout)
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        raise RuntimeError(
            "aiocoll.spawn() was called from a running event loop; use 'await aiocoll.spawn_async(...)' there instead"
        )
    with asyncio.Runner(loop_factory=_loop_factory(loop)) as runner:
        return runner.run(spawn_async(fn, world, timeout=timeout))


async def spawn_async(
    fn: Callable[[Comm], Coroutine[Any, Any, T]],
    world: int,
    *,
    timeout: float | None = DEFAULT_TIMEOUT,
) -> list[T]:
    """The awaitable twin of ``spawn``: runs the ranks on the running loop.

    For callers already inside a loop, e.g. a pytest-asyncio test::

        async def test_sum():
            results = await aiocoll.spawn_async(worker, world=4)
    """
    _check(fn, world, timeout)
    loop = asyncio.get_running_loop()
    w = World(world, loop, timeout)
    undo = install_task_tracking(loop)
    failures: list[tuple[int, BaseException]] = []
    try:
        tasks = [
            loop.create_task(_run_rank(w, st, fn, failures), name=f"aiocoll rank {st.rank}/{world}") for st in w.ranks
        ]
        for st, t in zip(w.ranks, tasks, strict=True):
            # Count each rank live from now, not from its first step: a rank whose task
            # has not started yet is not absent.
            st.task = t
            st.enter()
            t.add_done_callback(st._task_done)
        try:
            await asyncio.wait(tasks)
        except asyncio.CancelledError:
            # Cancelled from outside (KeyboardInterrupt, a cancel scope): take every
            # rank down with us and wait for them, so nothing outlives the call.
            for t in tasks:
                t.cancel()
            await asyncio.wait(tasks)
            raise
    finally:
        undo()
    for t in tasks:
        if not t.cancelled():
            t.exception()  # mark retrieved: the failures are reported below, once
    if failures:
        raise _report(w, failures)
    return [t.result() for t in tasks]


async def _run_rank(
    w: World,
    st: RankState,
    fn: Callable[[Comm], Coroutine[Any, Any, T]],
    failures: list[tuple[int, BaseException]],
) -> T:
    rank_var().set(st)  # this task's context only; tasks it creates inherit it
    try:
        result = await fn(Comm(w, w.group, st.rank))
    except BaseException as e:
        st.phase = Phase.FAILED
        failures.append((st.rank, e))
        if not _secondary(e):
            w.abort(st.rank, e)
        raise
    st.phase = Phase.RETURNED
    return result


def _secondary(e: BaseException) -> bool:
    """Whether ``e`` only reports another rank's failure (an abort or its cancellation)."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, (WorldAbortedError, asyncio.CancelledError)):
            return True
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return False


def _report(w: World, failures: list[tuple[int, BaseException]]) -> BaseException:
    """The exception ``spawn`` raises: the first root cause, annotated with its rank."""
    roots = [(r, e) for r, e in failures if not _secondary(e)]
    if not roots:
        return failures[0][1]
    rank, exc = roots[0]
    notes = [f"aiocoll: raised on rank {rank} of a world of {w.size}"]
    same = [r for r, e in roots[1:] if type(e) is type(exc) and str(e) == str(exc)]
    if same:
        notes.append(f"aiocoll: ranks {same} raised the same {type(exc).__name__}")
    for r, e in roots[1:]:
        if r not in same:
            notes.append(f"aiocoll: rank {r} also failed: {type(e).__name__}: {e}")
    aborted = sorted(r for r, e in failures if _secondary(e))
    if aborted:
        notes.append(f"aiocoll: ranks {aborted} were aborted because of it")
    for n in notes:
        exc.add_note(n)
    return exc


def _check(fn: object, world: object, timeout: object) -> None:
    if not callable(fn):
        raise InvalidArgumentError(f"spawn: argument 'fn' must be callable, got {type(fn).__name__}")
    if not _is_async(fn):
        raise InvalidArgumentError(
            f"spawn: argument 'fn' must be an 'async def fn(comm)' function, got {fn!r}; "
            "plain functions (sync ranks in threads) are not supported yet"
        )
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise InvalidArgumentError(f"spawn: argument 'world' must be a positive int, got {world!r}")
    if timeout is not None and (not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout > 0):
        raise InvalidArgumentError(
            f"spawn: argument 'timeout' must be a positive number of seconds or None, got {timeout!r}"
        )


def _is_async(fn: object) -> bool:
    # also async callable objects, whose __call__ is the coroutine function
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


def _loop_factory(choice: LoopChoice) -> Callable[[], asyncio.AbstractEventLoop]:
    if callable(choice):
        return choice
    if choice == "asyncio":
        return asyncio.new_event_loop
    if choice in ("auto", "uvloop"):
        try:
            import uvloop
        except ImportError:
            if choice == "uvloop":
                raise InvalidArgumentError(
                    "spawn: loop='uvloop' but uvloop is not installed (pip install 'aiocoll[uvloop]')"
                ) from None
            return asyncio.new_event_loop
        return uvloop.new_event_loop
    raise InvalidArgumentError(
        f"spawn: argument 'loop' must be 'auto', 'asyncio', 'uvloop' or a loop factory, got {choice!r}"
    )
