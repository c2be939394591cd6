"""Cost of looking into ``asyncio.gather`` and ``await task``: ranks whose ops run in tasks of their own.

Run from the repository root::

    python benchmarks/bench_gather.py            # about 30 s on 2 idle cores
    python benchmarks/bench_gather.py --quick    # smoke test

In a ``gather`` row each rank awaits ``asyncio.gather`` of ``tasks`` tasks that each await
``ops`` 1-element ``all_reduce``s; in an ``await`` row it awaits ``tasks`` tasks one at a
time (``await asyncio.create_task(...)``), each of one ``all_reduce``. With the look on
(the default), a deadlock among them is a ``DeadlockError`` at once; off
(``aiocoll._engine._tasks._GATHER_SCAN = -1``, for this comparison only), it is reported at the
timeout. Both run in the same process, alternating (off, on, off, on, ...); the table
shows the medians over the repeats and the ratio on/off. Ranks that await their ops
themselves, one at a time, never look into a gather: ``bench_ceilings.py`` covers them.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import time
from collections.abc import Sequence

import torch

import aiocoll
from aiocoll._engine import _tasks

SCAN = _tasks._GATHER_SCAN


def measure(world: int, wait: str, tasks: int, ops: int, look: bool) -> float:
    """Seconds per all_reduce (all ranks' share of one), the look into gathers on or off."""

    async def fn(comm: aiocoll.Comm) -> None:
        async def worker() -> None:
            t = torch.ones(1)
            for _ in range(ops):
                await comm.all_reduce(t)

        if wait == "gather":
            await asyncio.gather(*(worker() for _ in range(tasks)))
        else:
            for _ in range(tasks):
                await asyncio.create_task(worker())

    _tasks._GATHER_SCAN = SCAN if look else -1
    try:
        start = time.perf_counter()
        aiocoll.spawn(fn, world=world, loop="asyncio")
        return (time.perf_counter() - start) / (tasks * ops)
    finally:
        _tasks._GATHER_SCAN = SCAN


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--shapes", nargs="+", default=["200x50", "8000x1"], help="TASKSxOPS per rank, gathered")
    parser.add_argument("--awaits", nargs="+", type=int, default=[4000], help="TASKS per rank, awaited in turn")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="one small shape, 1 repeat")
    args = parser.parse_args(argv)
    rows = [("gather", *(int(x) for x in shape.split("x"))) for shape in (["20x5"] if args.quick else args.shapes)]
    rows += [("await", tasks, 1) for tasks in ([20] if args.quick else args.awaits)]
    repeats = 1 if args.quick else args.repeats
    print(f"1-element all_reduces in tasks, world {args.world}, us per collective, the look into them off vs on")
    print(f"{'wait':>6}  {'tasks':>6}  {'ops':>4}  {'off us':>9}  {'on us':>9}  {'on/off':>7}")
    for wait, tasks, ops in rows:
        measure(args.world, wait, tasks, ops, True)  # warm-up
        off: list[float] = []
        on: list[float] = []
        for _ in range(repeats):
            for look, out in ((False, off), (True, on)):
                gc.collect()
                out.append(measure(args.world, wait, tasks, ops, look))
        a, b = statistics.median(off) * 1e6, statistics.median(on) * 1e6
        print(f"{wait:>6}  {tasks:>6}  {ops:>4}  {a:>9.1f}  {b:>9.1f}  {b / a:>6.3f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
