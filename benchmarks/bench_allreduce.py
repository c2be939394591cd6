"""Latency of a 1-element ``all_reduce``: aiocoll (asyncio, uvloop) vs torch's threaded process group.

Run from the repository root (with the venv that has torch and aiocoll installed)::

    python benchmarks/bench_allreduce.py                      # worlds 4 16 1024, about a minute on 2 idle cores
    python benchmarks/bench_allreduce.py --worlds 4 16 --repeats 5
    python benchmarks/bench_allreduce.py --iters 500 --pg-iters 100
    python benchmarks/bench_allreduce.py --quick --worlds 4    # smoke test, a few seconds

What it measures, for each world size W:

* ``aiocoll asyncio`` / ``aiocoll uvloop``: ``aiocoll.spawn(fn, world=W, loop=...)`` with W async ranks on
  one event loop, each running ``await comm.all_reduce(t)`` on a 1-element float32 tensor.
* ``aiocoll sync``: the torch.distributed adapter, ``aiocoll.spawn(fn, world=W)`` with a plain ``def fn``: one
  thread per rank calling ``dist.all_reduce(t)`` on backend "aiocoll", completed on aiocoll's loop. Being
  threads like the threaded PG, it runs the threaded PG's (smaller) iteration counts.
* ``threaded PG``: torch's test-only threaded process group
  (``torch.testing._internal.distributed.multi_threaded_pg``), the way torch's own tests use it: one OS thread
  per rank, each calling ``dist.init_process_group("threaded", rank=r, world_size=W, store=HashStore)`` and then
  ``dist.all_reduce(t)``. Every measurement installs a fresh thread-local world and uninstalls it afterwards
  (process groups destroyed, collective state reset, the ``sys.excepthook`` that every rank's
  ``init_process_group`` wraps restored), so world sizes and repeats do not interfere.

Steady state only: inside one world, every rank first checks one all_reduce for correctness, runs the
warm-up iterations, then the K timed iterations. The time is measured by rank 0, with ``time.perf_counter``
around its own timed loop (world setup, spawning tasks or threads and teardown are excluded). Since every
all_reduce is a rendezvous of all ranks, that is the time for the whole world to complete K collectives;
the table shows it divided by K, in microseconds (us) per all_reduce, as the median over ``--repeats``
repeats. The backends' repeats are interleaved, and the cyclic garbage collector is run between
measurements (not during them) so that one measurement's garbage is not charged to the next.

The ratio columns are threaded-PG time / aiocoll time (above 1: aiocoll is faster). The threaded PG at
large W is slow (every collective wakes W threads, which take turns on the GIL), so by default it runs
fewer iterations; the counts used are printed in the ``iters`` column as ``aiocoll/threaded``. If a backend
cannot run (uvloop not installed, threads cannot be started, a timeout), its cell reads ``n/a`` and the
reason is printed below the table.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist
from _harness import Unavailable, positive_int, run_threaded_pg, timed_comm_all_reduce, timed_dist_all_reduce

import aiocoll

DEFAULT_WORLDS = (4, 16, 1024)
# Default iteration counts come from a budget of rank-operations per measurement (iterations x world size),
# so every world size costs about the same wall time: aiocoll costs ~10-20 us per rank per all_reduce on
# this kind of machine, the threaded PG ~50-120 us.
AIOCOLL_RANK_OPS = 40_000
PG_RANK_OPS = 8_000
MIN_ITERS = 10
MAX_ITERS = 10_000
QUICK_ITERS = 20
DEFAULT_REPEATS = 5

AIOCOLL = "aiocoll asyncio"
UVLOOP = "aiocoll uvloop"
SYNC = "aiocoll sync"
THREADED = "threaded PG"
BACKENDS = (AIOCOLL, UVLOOP, SYNC, THREADED)


@dataclass
class Result:
    """The measurements of one backend at one world size."""

    iters: int
    samples: list[float] = field(default_factory=list)  # seconds per all_reduce, one per repeat
    error: str | None = None

    @property
    def median_us(self) -> float | None:
        if self.error is not None or not self.samples:
            return None
        return statistics.median(self.samples) * 1e6


# -- aiocoll ---------------------------------------------------------------------------------------------


def measure_aiocoll(world: int, warmup: int, iters: int, loop: Literal["asyncio", "uvloop"]) -> float:
    """Seconds per all_reduce over ``iters`` timed iterations on one aiocoll world, as seen by rank 0."""

    async def rank_fn(comm: aiocoll.Comm) -> float | None:
        elapsed = await timed_comm_all_reduce(comm, warmup, iters)
        return elapsed if comm.rank == 0 else None

    elapsed = aiocoll.spawn(rank_fn, world=world, loop=loop)[0]
    assert elapsed is not None
    return elapsed / iters


def measure_sync_adapter(world: int, warmup: int, iters: int) -> float:
    """Seconds per ``dist.all_reduce`` through aiocoll's torch.distributed adapter (ranks in threads)."""

    def rank_fn(comm: aiocoll.Comm) -> float:
        return timed_dist_all_reduce(dist.get_rank(), world, warmup, iters)

    return aiocoll.spawn(rank_fn, world=world)[0] / iters


# -- torch's threaded process group ----------------------------------------------------------------------


def measure_threaded_pg(world: int, warmup: int, iters: int) -> float:
    """Seconds per all_reduce over ``iters`` timed iterations on torch's threaded PG, as seen by rank 0.

    Raises ``Unavailable`` if it cannot be imported, its threads cannot be started or do not finish within
    ``PG_JOIN_TIMEOUT``, or a rank fails (torch's test helper is not ours to debug; the table says n/a).
    """
    return run_threaded_pg(world, lambda rank: timed_dist_all_reduce(rank, world, warmup, iters))[0] / iters


# -- driver ----------------------------------------------------------------------------------------------


def auto_iters(budget: int, world: int) -> int:
    return max(MIN_ITERS, min(MAX_ITERS, budget // world))


def warmup_for(iters: int) -> int:
    return max(3, iters // 10)


def run_world(world: int, aio_iters: int, pg_iters: int, repeats: int) -> dict[str, Result]:
    have_uvloop = importlib.util.find_spec("uvloop") is not None
    measure: dict[str, Callable[[], float]] = {
        AIOCOLL: lambda: measure_aiocoll(world, warmup_for(aio_iters), aio_iters, "asyncio"),
        UVLOOP: lambda: measure_aiocoll(world, warmup_for(aio_iters), aio_iters, "uvloop"),
        SYNC: lambda: measure_sync_adapter(world, warmup_for(pg_iters), pg_iters),
        THREADED: lambda: measure_threaded_pg(world, warmup_for(pg_iters), pg_iters),
    }
    results = {name: Result(pg_iters if name in (SYNC, THREADED) else aio_iters) for name in BACKENDS}
    if not have_uvloop:
        results[UVLOOP].error = "uvloop is not installed (pip install 'aiocoll[uvloop]')"
    for _ in range(repeats):
        for name in BACKENDS:
            res = results[name]
            if res.error is not None:
                continue
            gc.collect()
            try:
                res.samples.append(measure[name]())
            except Unavailable as e:
                res.error = str(e)
    gc.collect()
    return results


def fmt_us(us: float | None) -> str:
    if us is None:
        return "n/a"
    return f"{us:,.0f}" if us >= 1000 else f"{us:.1f}"


def fmt_ratio(num: float | None, den: float | None) -> str:
    if num is None or den is None or den == 0:
        return "n/a"
    return f"{num / den:.2f}x"


COLUMNS = (
    ("world", 6),
    ("iters aio/pg", 13),
    (f"{AIOCOLL} us", 19),
    (f"{UVLOOP} us", 18),
    (f"{SYNC} us", 16),
    (f"{THREADED} us", 15),
    ("PG/asyncio", 11),
    ("PG/uvloop", 10),
    ("PG/sync", 8),
)


def table_row(cells: Sequence[str]) -> str:
    return "  ".join(cell.rjust(width) for cell, (_, width) in zip(cells, COLUMNS, strict=True))


def format_row(world: int, results: dict[str, Result]) -> str:
    aio, uv, sync, pg = (results[name].median_us for name in BACKENDS)
    return table_row(
        [
            str(world),
            f"{results[AIOCOLL].iters}/{results[THREADED].iters}",
            fmt_us(aio),
            fmt_us(uv),
            fmt_us(sync),
            fmt_us(pg),
            fmt_ratio(pg, aio),
            fmt_ratio(pg, uv),
            fmt_ratio(pg, sync),
        ]
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Microseconds per 1-element all_reduce: aiocoll (asyncio, uvloop) vs torch's threaded PG.",
    )
    parser.add_argument(
        "--worlds", type=positive_int, nargs="+", default=list(DEFAULT_WORLDS), help="world sizes (default: 4 16 1024)"
    )
    parser.add_argument(
        "--iters",
        type=positive_int,
        help=f"timed all_reduces per aiocoll measurement (default: {AIOCOLL_RANK_OPS} // world, "
        f"clamped to [{MIN_ITERS}, {MAX_ITERS}])",
    )
    parser.add_argument(
        "--pg-iters",
        type=positive_int,
        help=f"timed all_reduces per threaded-PG measurement (default: {PG_RANK_OPS} // world, "
        f"clamped to [{MIN_ITERS}, {MAX_ITERS}])",
    )
    parser.add_argument(
        "--repeats",
        type=positive_int,
        help=f"measurements per cell, the median is shown (default: {DEFAULT_REPEATS})",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke test: {QUICK_ITERS} iterations and 1 repeat unless given explicitly",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.iters = args.iters or QUICK_ITERS
        args.pg_iters = args.pg_iters or QUICK_ITERS
        args.repeats = args.repeats or 1
    args.repeats = args.repeats or DEFAULT_REPEATS
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    print(
        f"all_reduce of a 1-element float32 tensor, us per collective (rank 0's wall time over the timed loop / "
        f"iterations, median of {args.repeats})"
    )
    print(
        f"python {platform.python_version()}, torch {torch.__version__}, aiocoll {aiocoll.__version__}, "
        f"{os.cpu_count()} CPUs, {platform.machine()}"
    )
    print()
    print(table_row([name for name, _ in COLUMNS]))
    print(table_row(["-" * width for _, width in COLUMNS]))
    notes: list[str] = []
    started = time.perf_counter()
    for world in args.worlds:
        aio_iters = args.iters or auto_iters(AIOCOLL_RANK_OPS, world)
        pg_iters = args.pg_iters or auto_iters(PG_RANK_OPS, world)
        results = run_world(world, aio_iters, pg_iters, args.repeats)
        print(format_row(world, results), flush=True)
        notes += [f"  world {world}, {name}: n/a: {res.error}" for name, res in results.items() if res.error]
    print()
    for note in dict.fromkeys(notes):
        print(note)
    print(f"total time {time.perf_counter() - started:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
