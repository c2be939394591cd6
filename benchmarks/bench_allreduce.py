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
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

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
PG_JOIN_TIMEOUT = 300.0  # seconds to wait for the threaded PG's threads before giving up
# torch.distributed.distributed_c10d globals that init_process_group sets and destroy_process_group leaves set
C10D_GLOBALS = ("_backend", "_default_pg_init_method")

AIOCOLL = "aiocoll asyncio"
UVLOOP = "aiocoll uvloop"
SYNC = "aiocoll sync"
THREADED = "threaded PG"
BACKENDS = (AIOCOLL, UVLOOP, SYNC, THREADED)


class Unavailable(Exception):
    """A backend cannot be measured here; the message says why."""


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
        t = torch.ones(1)
        await comm.all_reduce(t)
        if t.item() != comm.world_size:
            raise AssertionError(f"rank {comm.rank}: all_reduce gave {t.item()}, expected {comm.world_size}")
        t.zero_()
        for _ in range(warmup):
            await comm.all_reduce(t)
        start = time.perf_counter()
        for _ in range(iters):
            await comm.all_reduce(t)
        elapsed = time.perf_counter() - start
        return elapsed if comm.rank == 0 else None

    elapsed = aiocoll.spawn(rank_fn, world=world, loop=loop)[0]
    assert elapsed is not None
    return elapsed / iters


def measure_sync_adapter(world: int, warmup: int, iters: int) -> float:
    """Seconds per ``dist.all_reduce`` through aiocoll's torch.distributed adapter (ranks in threads)."""

    def rank_fn(comm: aiocoll.Comm) -> float:
        return timed_dist_all_reduce(dist.get_rank(), world, warmup, iters)

    return aiocoll.spawn(rank_fn, world=world)[0] / iters


def timed_dist_all_reduce(rank: int, world: int, warmup: int, iters: int) -> float:
    """One rank's part, through torch.distributed: a checked all_reduce, the warm-up, the timed loop."""
    t = torch.ones(1)
    dist.all_reduce(t)
    if t.item() != world:
        raise AssertionError(f"rank {rank}: all_reduce gave {t.item()}, expected {world}")
    t.zero_()
    for _ in range(warmup):
        dist.all_reduce(t)
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(t)
    return time.perf_counter() - start


# -- torch's threaded process group ----------------------------------------------------------------------


def measure_threaded_pg(world: int, warmup: int, iters: int) -> float:
    """Seconds per all_reduce over ``iters`` timed iterations on torch's threaded PG, as seen by rank 0.

    Raises ``Unavailable`` if it cannot be imported, its threads cannot be started or do not finish within
    ``PG_JOIN_TIMEOUT``, or a rank fails (torch's test helper is not ours to debug; the table says n/a).
    """
    try:
        from torch.testing._internal.distributed.multi_threaded_pg import (
            ProcessLocalGroup,
            _install_threaded_pg,
            _uninstall_threaded_pg,
        )
    except ImportError as e:  # e.g. a torch build without torch.distributed
        raise Unavailable(f"torch's threaded process group cannot be imported: {e}") from e

    store = dist.HashStore()
    # All threads meet here before init_process_group: if some cannot be started, aborting this barrier
    # releases the others at once instead of leaving them in the PG's store barrier until its timeout.
    started = threading.Barrier(world)
    elapsed: list[float] = []
    errors: list[tuple[int, BaseException]] = []

    def worker(rank: int) -> None:
        try:
            started.wait()
            dist.init_process_group(
                "threaded", rank=rank, world_size=world, store=store, timeout=timedelta(seconds=PG_JOIN_TIMEOUT)
            )
            try:
                took = timed_dist_all_reduce(rank, world, warmup, iters)
                if rank == 0:
                    elapsed.append(took)
            finally:
                dist.destroy_process_group()
        except BaseException as e:
            errors.append((rank, e))
            ProcessLocalGroup.exception_handle(e)  # wake the ranks waiting in a collective so they exit too

    threads: list[threading.Thread] = []
    # Process-wide state that init_process_group changes and destroy_process_group does not restore: each
    # rank wraps sys.excepthook in another prefixing hook (after a few W=1024 runs, thousands of nested hooks
    # make the next uncaught exception die of RecursionError), and the default PG's backend and init method.
    saved_excepthook = sys.excepthook
    saved_c10d = {name: getattr(c10d, name) for name in C10D_GLOBALS}
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    _install_threaded_pg()
    try:
        try:
            for rank in range(world):
                th = threading.Thread(target=worker, args=(rank,), name=f"threaded-pg rank {rank}", daemon=True)
                th.start()
                threads.append(th)
        except RuntimeError as e:  # "can't start new thread"
            started.abort()
            raise Unavailable(f"could only start {len(threads)} of {world} threads ({e})") from e
        finally:
            deadline = time.monotonic() + PG_JOIN_TIMEOUT
            for th in threads:
                th.join(max(0.0, deadline - time.monotonic()))
        stuck = sum(th.is_alive() for th in threads)
        if stuck:
            ProcessLocalGroup.exception_handle(TimeoutError())
            raise Unavailable(f"{stuck} of {world} threads still running after {PG_JOIN_TIMEOUT:.0f}s")
    finally:
        ProcessLocalGroup.reset()
        _uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
        sys.excepthook = saved_excepthook
        for name, value in saved_c10d.items():
            setattr(c10d, name, value)
    if errors:
        # the root cause, not the SystemExit of the ranks that the PG's terminate event took down
        rank, exc = min(errors, key=lambda item: (isinstance(item[1], SystemExit), item[0]))
        raise Unavailable(f"failed on rank {rank} of {world}: {type(exc).__name__}: {exc}")
    if dist.is_initialized():  # the main thread's world must be untouched
        raise Unavailable("it left a default process group behind in the main thread")
    return elapsed[0] / iters


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


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


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
