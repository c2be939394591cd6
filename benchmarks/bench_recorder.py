"""Overhead of the flight recorder on a 1-element ``all_reduce``: ``record=0`` (off) vs the default.

Run from the repository root::

    python benchmarks/bench_recorder.py              # worlds 4 and 64, about 20 s on 2 idle cores
    python benchmarks/bench_recorder.py --quick      # smoke test

Both settings run in the same process, alternating (off, on, off, on, ...), and the table shows
medians over the repeats and the ratio on/off. The target is at most 1.05 at world 4. The time is
measured by rank 0 around its own loop of timed all_reduces, after a warm-up; the cyclic garbage
collector runs between measurements, not during them.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Sequence

import torch

import aiocoll


def measure(world: int, iters: int, record: int) -> float:
    """Seconds per all_reduce with the given recorder setting, as seen by rank 0."""

    async def fn(comm: aiocoll.Comm) -> float:
        t = torch.ones(1)
        for _ in range(max(10, iters // 10)):
            await comm.all_reduce(t)
        start = time.perf_counter()
        for _ in range(iters):
            await comm.all_reduce(t)
        return time.perf_counter() - start

    return aiocoll.spawn(fn, world=world, record=record, loop="asyncio")[0] / iters


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[4, 64])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="few iterations, 1 repeat")
    args = parser.parse_args(argv)
    repeats = 1 if args.quick else args.repeats
    print("1-element all_reduce, us per collective, recorder off (record=0) vs on (the default)")
    print(f"{'world':>6}  {'iters':>6}  {'off us':>9}  {'on us':>9}  {'on/off':>7}")
    for world in args.worlds:
        iters = 20 if args.quick else max(50, 20_000 // world)
        off: list[float] = []
        on: list[float] = []
        for _ in range(repeats):
            for record, out in ((0, off), (aiocoll.DEFAULT_RECORD, on)):
                gc.collect()
                out.append(measure(world, iters, record))
        a, b = statistics.median(off) * 1e6, statistics.median(on) * 1e6
        print(f"{world:>6}  {iters:>6}  {a:>9.1f}  {b:>9.1f}  {b / a:>6.3f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
