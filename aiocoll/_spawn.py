"""``spawn`` and ``spawn_async``: run a rank function on every rank of a new world."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar, Unpack, overload

from ._c10d import _belongings
from ._comm import Comm
from ._lifecycle._config import DEFAULT_RECORD, DEFAULT_TIMEOUT, SpawnOptions, WorldConfig, WorldOptions, loop_factory
from ._lifecycle._driver import WorldRun

__all__ = ["DEFAULT_RECORD", "DEFAULT_TIMEOUT", "SeedFailure", "find_failing_seed", "spawn", "spawn_async"]

T = TypeVar("T")


@overload
def spawn(fn: Callable[[Comm], Coroutine[Any, Any, T]], world: int, **options: Unpack[SpawnOptions]) -> list[T]: ...


@overload
def spawn(fn: Callable[[Comm], T], world: int, **options: Unpack[SpawnOptions]) -> list[T]: ...


def spawn(fn: Callable[[Comm], Any], world: int, **options: Unpack[SpawnOptions]) -> list[Any]:
    """Run ``fn(comm)`` on ``world`` ranks of a new event loop; return their results in rank order.

    ``async def fn``: each rank is an asyncio task on the loop. Plain ``def fn``: each
    rank runs in its own thread, and its collectives (``comm``'s, or torch.distributed's)
    complete on the loop. With ``torch_distributed`` (the default), each rank has
    torch.distributed initialised with backend "aiocoll" (default group = the world),
    torn down afterwards.

    If a rank raises, every other rank is released at once (``WorldAbortedError`` in a
    collective; async ranks busy elsewhere are cancelled) and ``spawn`` re-raises the
    first failure, noting its rank. A rank's ``sys.exit(n)`` is its process's: 0 returns
    None early, another code fails the world with ``RankExitedError``.

    The keywords, all optional, with their defaults: ``timeout=300.0``, ``loop="auto"``,
    ``torch_distributed=True``, ``record=64``, ``trace=None``, ``faults=()``,
    ``schedule_seed=None``, ``prefix_output=False``, ``process_group=None``,
    ``sync_ranks="turns"``; a type checker sees them as ``SpawnOptions``.

    ``timeout`` bounds how long a rank may wait in one collective (None: no bound).
    ``loop`` is ``"auto"`` (uvloop when installed), ``"asyncio"``, ``"uvloop"`` or a
    loop factory.

    Diagnostics: the flight recorder keeps each rank's last ``record`` operations (0:
    off) and a failure's report shows them side by side; ``trace="run.json"`` records
    everything and writes a Chrome/Perfetto trace, even when the run fails. ``faults``
    (``Fault.fail/hang/delay``) make chosen ranks fail, hang or straggle at chosen
    operations. ``schedule_seed`` perturbs, reproducibly, the order in which ready ranks
    run and any-source receives match, to shake out order-dependent bugs.
    ``prefix_output`` prefixes what each rank prints or logs with ``[rank N]``.

    ``sync_ranks`` (plain ``def fn`` only): ``"turns"`` (the default) runs one rank
    thread at a time, handing over whenever a rank waits for a collective, so that each
    rank has its own random generators (torch's, ``random``'s and NumPy's, as in its own
    process), runs in an order that repeats (and that ``schedule_seed`` varies) and
    deadlocks are reported at once. ``"parallel"`` lets the threads run at once, sharing
    the generators: for code that makes ranks wait for each other outside
    torch.distributed (a ``threading.Barrier``, a queue, a store's ``get``).

    ``process_group`` makes a *hybrid world* over a real torch.distributed group of M
    processes (each calls ``spawn`` alike): process p runs ranks ``p*world//M`` up to
    ``(p+1)*world//M - 1`` and gets their results; collectives among ranks of several
    processes exchange every rank's call over the group and compute exactly what a flat
    world of ``world`` ranks would. For tests and simulations of large worlds::

        dist.init_process_group("gloo")                      # under torchrun, 2 processes
        results = aiocoll.spawn(fn, world=1024, process_group=dist.group.WORLD)  # 512 here

    >>> import torch, aiocoll
    >>> async def worker(comm):
    ...     t = torch.ones(2) * comm.rank
    ...     await comm.all_reduce(t)
    ...     return t.tolist()
    >>> aiocoll.spawn(worker, world=4)
    [[6.0, 6.0], [6.0, 6.0], [6.0, 6.0], [6.0, 6.0]]
    """
    loop = options.pop("loop", "auto")
    run = WorldRun(fn, WorldConfig.of(world, options, caller="spawn"))
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        raise RuntimeError(
            "aiocoll.spawn() was called from a running event loop; use 'await aiocoll.spawn_async(...)' there instead"
        )
    if _in_trio():
        raise RuntimeError(
            "aiocoll.spawn() would block trio's event loop until the world ends; "
            "run it in a worker thread: await trio.to_thread.run_sync(aiocoll.spawn, fn, world)"
        )
    # the world's engine dies by the scope's collection, a few ms: this frame lets it go first
    with _belongings.world_scope(collect=True), asyncio.Runner(loop_factory=loop_factory(loop)) as runner:
        try:
            results = runner.run(run.run())
        finally:
            del run
    return results


@overload
async def spawn_async(
    fn: Callable[[Comm], Coroutine[Any, Any, T]], world: int, **options: Unpack[WorldOptions]
) -> list[T]: ...


@overload
async def spawn_async(fn: Callable[[Comm], T], world: int, **options: Unpack[WorldOptions]) -> list[T]: ...


async def spawn_async(fn: Callable[[Comm], Any], world: int, **options: Unpack[WorldOptions]) -> list[Any]:
    """The awaitable twin of ``spawn``: runs the ranks on the running loop.

    For callers already inside a loop, e.g. a pytest-asyncio test::

        async def test_sum():
            results = await aiocoll.spawn_async(worker, world=4)

    >>> import asyncio, aiocoll
    >>> async def worker(comm):
    ...     return await comm.all_gather_object(comm.rank * 10)
    >>> async def main():
    ...     return await aiocoll.spawn_async(worker, world=3)
    >>> asyncio.run(main())
    [[0, 10, 20], [0, 10, 20], [0, 10, 20]]
    """
    run = WorldRun(fn, WorldConfig.of(world, options, caller="spawn_async"))
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        raise RuntimeError(
            "aiocoll.spawn_async() needs a running asyncio event loop (aiocoll runs on asyncio or "
            "uvloop, including anyio's asyncio backend). From trio, run a world in a worker thread: "
            "await trio.to_thread.run_sync(aiocoll.spawn, fn, world)"
        ) from None
    with _belongings.world_scope(asyncio.get_running_loop(), collect=True):
        try:
            results = await run.run()
        finally:
            del run
    return results


def _in_trio() -> bool:
    """Whether the caller runs in a trio task (without importing trio when it is not in use)."""
    trio = sys.modules.get("trio")
    if trio is None:
        return False
    try:
        trio.lowlevel.current_task()
    except RuntimeError:
        return False
    return True


@dataclass(frozen=True)
class SeedFailure:
    """The first seed under which ``find_failing_seed`` saw the function fail, and how.

    Replay it with the same seed::

        found = aiocoll.find_failing_seed(worker, world=4)
        if found is not None:
            print(found.seed, found.error)
            aiocoll.spawn(worker, world=4, schedule_seed=found.seed)  # fails the same way
    """

    seed: int
    error: BaseException


def find_failing_seed(
    fn: Callable[[Comm], object], world: int, seeds: Iterable[int] = range(100), **options: Unpack[SpawnOptions]
) -> SeedFailure | None:
    """Run ``spawn(fn, world, schedule_seed=s)`` for each seed; the first that fails, or None.

    An order-dependent bug (an any-source ``recv`` assumed to come from one rank, a race
    on shared Python state) shows under some schedules only; the seed replays it::

        found = aiocoll.find_failing_seed(worker, world=4, seeds=range(200))
        if found:
            aiocoll.spawn(worker, world=4, schedule_seed=found.seed)   # the same failure

    >>> import torch, aiocoll
    >>> async def racy(comm):                 # assumes rank 1's message comes first
    ...     if comm.rank == 0:
    ...         t = torch.zeros(1)
    ...         assert await comm.recv(t) == 1, "rank 2 came first"
    ...         await comm.recv(t)
    ...     else:
    ...         await comm.send(torch.ones(1), dst=0)
    >>> found = aiocoll.find_failing_seed(racy, world=3, seeds=range(50))
    >>> found is not None and isinstance(found.error, AssertionError)
    True
    """
    for seed in seeds:
        options["schedule_seed"] = seed
        try:
            spawn(fn, world, **options)
        except Exception as e:
            return SeedFailure(seed, e)
    return None
