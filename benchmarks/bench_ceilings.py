"""The ceilings of the design: how fast any asyncio or thread-per-rank all_reduce could be here, against the PG.

Run from the repository root (with the venv that has torch and aiocoll installed)::

    python benchmarks/bench_ceilings.py                 # W = 4, 64, 1024, 5 repeats, about 2-3 minutes
    python benchmarks/bench_ceilings.py --quick         # smoke run: W = 4, 2 repeats, a few seconds
    python benchmarks/bench_ceilings.py --worlds 4 16 --repeats 3 --json /tmp/ceilings.json

Why: the project's performance targets (the suite's: async ranks >= 25x faster than torch's threaded process
group at W=4, >= 50x at W=1024 and <= 2x the floor there; sync ranks >= 2x faster at W=4, >= 10x at W=64) are
only worth chasing if the design can reach them at all on this machine, in CPython 3.11 with the GIL. This
benchmark measures, for a 1-element float32 all_reduce, the least each design can do, with everything an
implementation adds (checks, diagnostics, the flight recorder, torch.distributed's dispatch) stripped away, and
prints each as a ratio against the threaded PG, so a target can be compared with its ceiling.

Systems, all in this one process:

* ``threaded PG``: torch's test-only threaded process group through ``dist.all_reduce``, as the suite measures
  it (``_harness.run_threaded_pg`` + ``timed_dist_all_reduce``): one thread per rank.
* ``bare asyncio``: the least an asyncio design can do. W tasks on one loop (uvloop when importable, else
  asyncio; the output says which); each op, every task appends its tensor and a fresh ``loop.create_future()``
  to shared lists, the last arrival does ``torch.stack(ts).sum(0)`` and ``torch._foreach_copy_`` into all W
  tensors and sets every future's result, and every task awaits its future. Nothing else.
* ``bare threads``: the least a thread-per-rank design can do. W threads; a ``threading.Lock`` guards the shared
  arrival lists; each thread blocks on its own pre-acquired lock (a binary semaphore) until the last arrival,
  which runs the same torch op, releases it.
* ``bare turns``: the least aiocoll's own sync design can do. W threads take turns, one running at a time:
  an arriving rank appends its tensor and, unless it is the last, hands the turn to the next ready rank
  (woken on its own CPU, as aiocoll's ``SameCpu`` does) and sleeps; the last arrival runs the torch op.
* ``W*dist overhead``: one thread calling ``dist.all_reduce`` W times per op on a world-size-1 process group
  whose ``allreduce`` returns an already completed Work: the serial Python cost that W sync ranks pay in
  ``torch.distributed`` under the GIL, whatever their rendezvous. W sync ranks' op cannot take less than this
  (plus their rendezvous), so PG/(W*dist overhead) bounds how much faster than the PG any sync design can be.
* ``floor``: the suite's floor, the least torch work for the op in one thread: W-way sum + W ``copy_``, the
  faster of ``stack(ts).sum(0)`` and chained ``add_``. The bare systems' own torch op (stack-sum +
  ``_foreach_copy_``) is timed alongside it and reported below the table for reference.
* ``aiocoll async`` / ``aiocoll sync``: ``aiocoll.spawn`` with its defaults, as the suite runs them.

The thread-per-rank systems (threaded PG, bare threads, aiocoll sync) are capped at ``--max-thread-world``
ranks (default 256): a 1024-thread world takes seconds per op and setup; their cells above it say "capped".

Timing is the suite's: per-op time is rank 0's wall time (``time.perf_counter``) around its own timed loop, after
a checked first op (every system asserts its first result, so a broken system cannot report a fast time) and a
warm-up, divided by the iterations; iteration counts come from a budget of rank-operations per measurement. The
machine is shared and noisy, so all systems run in one process run, alternating within each repeat (A B C A B
C ...), and the table shows medians over the repeats and ratios of medians.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import gc
import json
import os
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from _harness import (
    C10D_GLOBALS,
    Unavailable,
    positive_int,
    print_report,
    run_threaded_pg,
    start_and_join,
    timed_comm_all_reduce,
    timed_dist_all_reduce,
    timed_loop,
)

# bench_suite is a script, but importing it only defines things: the report helpers are shared so that both
# benchmarks describe the machine and format numbers alike.
from bench_suite import aiocoll_config, fmt_ratio, fmt_seconds, machine_info, source_info, source_line, warmup_for

import aiocoll

PG = "threaded PG"
BARE_ASYNC = "bare asyncio"
BARE_THREADS = "bare threads"
BARE_TURNS = "bare turns"
DIST = "W*dist overhead"
FLOOR = "floor"
ASYNC = "aiocoll async"
SYNC = "aiocoll sync"
# the order they take turns in, and columns
SYSTEMS = (PG, BARE_ASYNC, BARE_THREADS, BARE_TURNS, DIST, FLOOR, ASYNC, SYNC)
THREAD_SYSTEMS = (PG, BARE_THREADS, BARE_TURNS, SYNC)  # one OS thread per rank: capped at --max-thread-world

# Rank-operations (iterations x W) per measurement, by system: roughly the same wall time at every W, ~0.3-4 s
# per sample here. Per rank and op (a trial run), the bare asyncio ranks and the floor cost ~1.5-2.5 us, one
# dist.all_reduce on a completed group ~4 us, aiocoll's async ranks ~6-15 us, bare threads ~15 us, the threaded
# PG ~35 us and the sync ranks ~60-120 us. The whole default run takes ~2-3 minutes.
RANK_OPS = {
    PG: 32_000,
    BARE_ASYNC: 160_000,
    BARE_THREADS: 48_000,
    BARE_TURNS: 48_000,
    DIST: 160_000,
    FLOOR: 160_000,
    ASYNC: 80_000,
    SYNC: 32_000,
}
MIN_ITERS = 5
MAX_ITERS = 40_000
QUICK_ITERS = 20
DEFAULT_WORLDS = (4, 64, 1024)
QUICK_WORLDS = (4,)
DEFAULT_REPEATS = 5
QUICK_REPEATS = 2
DEFAULT_MAX_THREAD_WORLD = 256
JOIN_TIMEOUT = 300.0  # seconds to wait for the bare threads before declaring them stuck

RATIOS = (  # column name, numerator, denominator (ratios of medians)
    ("PG/bare-async", PG, BARE_ASYNC),
    ("PG/bare-threads", PG, BARE_THREADS),
    ("PG/bare-turns", PG, BARE_TURNS),
    ("PG/aiocoll-async", PG, ASYNC),
    ("PG/aiocoll-sync", PG, SYNC),
    ("PG/W*dist", PG, DIST),
    ("bare-async/floor", BARE_ASYNC, FLOOR),
    ("aiocoll-async/floor", ASYNC, FLOOR),
)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def loop_choice() -> tuple[str, Callable[[], asyncio.AbstractEventLoop]]:
    """The loop bare asyncio runs on: uvloop when importable (what aiocoll's ``loop="auto"`` picks too)."""
    try:
        import uvloop
    except ImportError:
        return "asyncio", asyncio.new_event_loop
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return "uvloop", factory


def check_sum(system: str, rank: int, t: torch.Tensor, expected: int) -> None:
    if t.item() != expected:
        raise AssertionError(f"{system} rank {rank}: all_reduce gave {t.item()}, expected {expected}")


# -- bare asyncio ----------------------------------------------------------------------------------------


def bare_async_op(world: int, iters: int, factory: Callable[[], asyncio.AbstractEventLoop]) -> float:
    """Seconds per op of W tasks meeting on shared lists, as seen by rank 0."""
    warmup = warmup_for(iters)

    async def main() -> float:
        loop = asyncio.get_running_loop()
        # Two parallel lists rather than one list of (tensor, future) pairs: one tuple fewer per rank and op.
        # (One future shared by all the ranks of an op would be cheaper still: ~5% at W=4, ~20-25% at W=64
        # and 1024 in a trial run here. The per-rank future is what the ceiling is defined with, and what a
        # design with per-rank results or errors needs.)
        ts: list[torch.Tensor] = []
        futs: list[asyncio.Future[None]] = []

        def arrive(t: torch.Tensor) -> asyncio.Future[None]:
            nonlocal ts, futs
            fut = loop.create_future()
            ts.append(t)
            futs.append(fut)
            if len(ts) == world:
                # Fresh lists for the next op before waking anyone: the woken ranks arrive again at once.
                done_ts, done_futs = ts, futs
                ts, futs = [], []
                s = torch.stack(done_ts).sum(0)
                torch._foreach_copy_(done_ts, [s] * world)
                for f in done_futs:
                    f.set_result(None)
            return fut  # the last arrival's is already done: awaiting it does not yield

        async def rank_fn(rank: int) -> float:
            t = torch.ones(1)
            await arrive(t)
            check_sum(BARE_ASYNC, rank, t, world)
            t.zero_()  # sums of zeros from here on: no overflow to inf over thousands of ops
            for _ in range(warmup):
                await arrive(t)
            start = time.perf_counter()
            for _ in range(iters):
                await arrive(t)
            return time.perf_counter() - start

        # A failing rank fails gather; Runner.close then cancels the ranks left waiting on their futures.
        elapsed = await asyncio.gather(*(rank_fn(rank) for rank in range(world)))
        return elapsed[0]

    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main()) / iters


# -- bare threads ----------------------------------------------------------------------------------------


def bare_threads_op(world: int, iters: int) -> float:
    """Seconds per op of W threads meeting on lock-guarded lists, as seen by rank 0.

    Each thread waits on its own lock, acquired once up front and released by the last arrival: acquire()
    blocks in C without the GIL, and the lock is held again when it returns, ready for the next op. The other
    way the brief allowed, a fresh ``threading.Event`` per rank and op, was slower in a trial run here (W=4:
    ~50 us vs ~33 us per op; W=64: ~1.37 ms vs ~0.88 ms; W=256: 12-20 ms vs ~5 ms): an Event is a Condition
    plus a Lock in Python code, and its set()/wait() take that Condition's lock.
    """
    warmup = warmup_for(iters)
    guard = threading.Lock()
    ts: list[torch.Tensor] = []
    waiters: list[threading.Lock] = []
    elapsed: dict[int, float] = {}
    errors: list[tuple[int, BaseException]] = []
    # Every rank checks its first result and then waits here, so that if one failed all stop together
    # instead of the others waiting forever for its next arrival.
    checked = threading.Barrier(world)

    def arrive(t: torch.Tensor, me: threading.Lock) -> None:
        nonlocal ts, waiters
        with guard:
            ts.append(t)
            waiters.append(me)
            last = len(ts) == world
            if last:
                done_ts, done_waiters = ts, waiters
                ts, waiters = [], []
        if last:
            # Outside the guard: no one else can arrive before being woken, so nothing to guard against.
            s = torch.stack(done_ts).sum(0)
            torch._foreach_copy_(done_ts, [s] * world)
            for w in done_waiters:
                if w is not me:
                    w.release()
        else:
            me.acquire()

    def worker(rank: int) -> None:
        me = threading.Lock()
        me.acquire()
        t = torch.ones(1)
        try:
            arrive(t, me)
            check_sum(BARE_THREADS, rank, t, world)
        except BaseException as e:
            errors.append((rank, e))
        try:
            checked.wait()
        except threading.BrokenBarrierError:
            return
        if errors:
            return
        t.zero_()
        elapsed[rank] = timed_loop(lambda: arrive(t, me), warmup, iters)

    threads: list[threading.Thread] = []
    start_and_join(threads, world, worker, "bare rank", checked.abort, JOIN_TIMEOUT)
    if errors:
        rank, exc = errors[0]
        raise Unavailable(f"failed on rank {rank} of {world}: {type(exc).__name__}: {exc}")
    if any(th.is_alive() for th in threads):  # daemon threads: they die with the process
        raise Unavailable(f"threads still running after {JOIN_TIMEOUT:.0f}s")
    return elapsed[0] / iters


# -- bare turns ------------------------------------------------------------------------------------------


def _same_cpu() -> Callable[[int], None] | None:
    """``pin(tid)``: restrict thread ``tid`` to the calling thread's CPU (None where the OS cannot)."""
    if not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2:
        return None
    try:
        getcpu = ctypes.CDLL(None).sched_getcpu
    except (OSError, AttributeError):
        return None

    def pin(tid: int) -> None:
        os.sched_setaffinity(tid, (getcpu(),))

    return pin


def bare_turns_op(world: int, iters: int) -> float:
    """Seconds per op of W threads that take turns (aiocoll's sync ranks' design), as seen by rank 0.

    One thread runs at a time. An arriving rank appends its tensor; unless it is the last, it hands the turn
    to the next ready rank (releases that rank's lock) and sleeps on its own. The last arrival runs the torch
    op, makes every other rank ready, and goes on: one hand-over per rank and op, no lock around the lists
    (only the thread holding the turn touches them) and no GIL contention. As aiocoll does (``SameCpu``), a
    hand-over wakes the next thread on the CPU of the one that hands over, which frees it once awake.
    """
    warmup = warmup_for(iters)
    pin = _same_cpu()
    tids = [0] * world
    wake = [threading.Lock() for _ in range(world)]
    for lock in wake:
        lock.acquire()
    ts: list[torch.Tensor] = []
    waiting: list[int] = []
    ready: deque[int] = deque()
    elapsed: dict[int, float] = {}
    errors: list[tuple[int, BaseException]] = []

    def pass_turn() -> None:
        if ready:
            nxt = ready.popleft()
            if pin is not None:
                pin(tids[nxt])
            wake[nxt].release()

    def arrive(rank: int, t: torch.Tensor) -> None:
        nonlocal ts
        ts.append(t)
        if len(ts) == world:
            s = torch.stack(ts).sum(0)
            torch._foreach_copy_(ts, [s] * world)
            ts = []
            ready.extend(waiting)
            waiting.clear()
            return
        waiting.append(rank)
        pass_turn()
        wake[rank].acquire()
        if pin is not None:
            os.sched_setaffinity(0, cpus)

    cpus = os.sched_getaffinity(0) if pin is not None else set()

    def worker(rank: int) -> None:
        tids[rank] = threading.get_native_id()
        if rank:
            wake[rank].acquire()  # the first turn (rank 0 starts with it)
        t = torch.ones(1)
        try:
            arrive(rank, t)
            check_sum(BARE_TURNS, rank, t, world)
            t.zero_()
            elapsed[rank] = timed_loop(lambda: arrive(rank, t), warmup, iters)
        except BaseException as e:  # the others would wait for it forever: the run is lost either way
            errors.append((rank, e))
        pass_turn()  # ended: the next ready rank runs

    ready.extend(range(1, world))
    threads: list[threading.Thread] = []
    # (if a thread cannot be started, those waiting for their turn are daemons: they die with the process)
    start_and_join(threads, world, worker, "turns rank", lambda: None, JOIN_TIMEOUT)
    if errors:
        rank, exc = errors[0]
        raise Unavailable(f"failed on rank {rank} of {world}: {type(exc).__name__}: {exc}")
    if any(th.is_alive() for th in threads):
        raise Unavailable(f"threads still running after {JOIN_TIMEOUT:.0f}s")
    return elapsed[0] / iters


# -- torch.distributed's own cost ------------------------------------------------------------------------

NULL_BACKEND = "ceilings_done"  # a backend whose every all_reduce is complete on return


class DoneWork(dist.Work):
    """A Work that is complete when created: waiting on it costs only the call."""

    def wait(self, timeout: timedelta | None = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True


class DoneProcessGroup(dist.ProcessGroup):
    """A process group whose ``allreduce`` does nothing but count and return a completed Work.

    World size 1, so "nothing" is the right sum; the count proves every timed call reached it.
    """

    def __init__(self, rank: int, size: int, name: str) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]  # the (rank, size) constructor is not in the stubs
        self._name = name
        self.calls = 0

    @property
    def group_name(self) -> str:  # type: ignore[override]
        return self._name

    def getBackendName(self) -> str:
        return NULL_BACKEND

    def allreduce(self, tensors: Any, opts: Any = None) -> dist.Work:  # type: ignore[override]
        self.calls += 1
        return DoneWork()  # a fresh Work per call, as any real backend must return


created_groups: list[DoneProcessGroup] = []


def create_done_group(opts: Any, backend_options: Any = None) -> DoneProcessGroup:
    """The creator torch.distributed calls for ``NULL_BACKEND`` (extended API)."""
    pg = DoneProcessGroup(int(opts.group_rank), int(opts.group_size), str(opts.group_id))
    created_groups.append(pg)
    return pg


def dist_overhead_op(world: int, iters: int) -> float:
    """Seconds for W serial ``dist.all_reduce`` calls on the completed group, in this thread."""
    if NULL_BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(NULL_BACKEND, create_done_group, extended_api=True, devices=["cpu"])
    if dist.is_initialized():
        raise Unavailable("this thread already has a default process group")
    # init_process_group wraps sys.excepthook and sets c10d globals that destroy_process_group leaves set;
    # put them back so the other systems (and later repeats) start from the same state.
    saved_excepthook = sys.excepthook
    saved_c10d = {name: getattr(c10d, name) for name in C10D_GLOBALS}
    store = dist.HashStore()  # type: ignore[attr-defined]  # not in torch.distributed's __all__
    dist.init_process_group(NULL_BACKEND, rank=0, world_size=1, store=store)
    try:
        pg = created_groups[-1]
        t = torch.ones(1)
        dist.all_reduce(t)
        check_sum(DIST, 0, t, 1)
        if pg.calls != 1:
            raise AssertionError(f"{DIST}: the all_reduce did not reach the group ({pg.calls} calls)")

        def op() -> None:
            for _ in range(world):
                dist.all_reduce(t)

        warmup = warmup_for(iters)
        seconds = timed_loop(op, warmup, iters)
        if pg.calls != 1 + (warmup + iters) * world:
            raise AssertionError(f"{DIST}: {pg.calls - 1} calls reached the group, expected {(warmup + iters) * world}")
        return seconds / iters
    finally:
        dist.destroy_process_group()
        created_groups.clear()
        sys.excepthook = saved_excepthook
        for name, value in saved_c10d.items():
            setattr(c10d, name, value)


# -- the floor -------------------------------------------------------------------------------------------


def floor_op(world: int, iters: int) -> dict[str, float]:
    """Seconds per op of the suite's two floor variants, and of the bare systems' own torch op.

    The suite's ``floor_all_reduce`` is the same computation, but it does not check its result, and every
    system here must; so it is repeated here, with the first result of each variant checked.
    """
    ts = [torch.ones(1) for _ in range(world)]
    acc = torch.empty(1)

    def stack_sum() -> None:
        res = torch.stack(ts).sum(0)
        for t in ts:
            t.copy_(res)

    def chained_add() -> None:
        if world == 1:
            acc.copy_(ts[0])
        else:
            torch.add(ts[0], ts[1], out=acc)
            for t in ts[2:]:
                acc.add_(t)
        for t in ts:
            t.copy_(acc)

    def stack_sum_foreach() -> None:  # what the bare systems' last arrival does
        s = torch.stack(ts).sum(0)
        torch._foreach_copy_(ts, [s] * world)

    warmup = warmup_for(iters)
    seconds = {}
    for name, fn in (("stack_sum", stack_sum), ("chained_add", chained_add), ("stack_sum_foreach", stack_sum_foreach)):
        for t in ts:
            t.fill_(1.0)
        fn()
        for rank, t in enumerate(ts):
            check_sum(f"{FLOOR} ({name})", rank, t, world)
            t.zero_()
        seconds[name] = timed_loop(fn, warmup, iters) / iters
    return seconds


# -- aiocoll and the threaded PG, as the suite runs them --------------------------------------------------


def threaded_pg_op(world: int, iters: int) -> float:
    warmup = warmup_for(iters)
    return run_threaded_pg(world, lambda rank: timed_dist_all_reduce(rank, world, warmup, iters))[0] / iters


def aiocoll_async_op(world: int, iters: int) -> float:
    warmup = warmup_for(iters)

    async def rank_fn(comm: aiocoll.Comm) -> float:
        return await timed_comm_all_reduce(comm, warmup, iters)

    return aiocoll.spawn(rank_fn, world=world)[0] / iters


def aiocoll_sync_op(world: int, iters: int) -> float:
    warmup = warmup_for(iters)

    def rank_fn(comm: aiocoll.Comm) -> float:
        return timed_dist_all_reduce(comm.rank, world, warmup, iters)

    return aiocoll.spawn(rank_fn, world=world)[0] / iters


# -- the schedule ----------------------------------------------------------------------------------------


@dataclass
class Cell:
    """One system's samples at one world size."""

    iters: int = 0
    samples: list[float] = field(default_factory=list)  # seconds per op
    status: str = "ok"  # "ok", "capped", "n/a" (failed)
    note: str = ""
    variants: dict[str, list[float]] = field(default_factory=dict)  # the floor's variants, seconds per op

    @property
    def median(self) -> float | None:
        if self.status != "ok" or not self.samples:
            return None
        return statistics.median(self.samples)


Results = dict[int, dict[str, Cell]]  # world -> system -> cell


@dataclass
class Plan:
    worlds: list[int]
    repeats: int
    max_thread_world: int
    quick: bool
    loop_name: str
    loop_factory: Callable[[], asyncio.AbstractEventLoop]


def iters_for(system: str, world: int, plan: Plan) -> int:
    if plan.quick:
        return QUICK_ITERS
    return max(MIN_ITERS, min(MAX_ITERS, RANK_OPS[system] // world))


def new_results(plan: Plan) -> Results:
    results: Results = {}
    for world in plan.worlds:
        cells = {system: Cell(iters=iters_for(system, world, plan)) for system in SYSTEMS}
        for system in THREAD_SYSTEMS:
            if world > plan.max_thread_world:
                cells[system].status = "capped"
                cells[system].note = f"{world} threads > --max-thread-world {plan.max_thread_world}"
        results[world] = cells
    return results


def measure_one(system: str, world: int, cell: Cell, plan: Plan) -> float:
    if system == FLOOR:
        variants = floor_op(world, cell.iters)
        for name, seconds in variants.items():
            cell.variants.setdefault(name, []).append(seconds)
        return min(variants["stack_sum"], variants["chained_add"])  # the suite's floor
    if system == BARE_ASYNC:
        return bare_async_op(world, cell.iters, plan.loop_factory)
    ops: dict[str, Callable[[int, int], float]] = {
        PG: threaded_pg_op,
        BARE_THREADS: bare_threads_op,
        BARE_TURNS: bare_turns_op,
        DIST: dist_overhead_op,
        ASYNC: aiocoll_async_op,
        SYNC: aiocoll_sync_op,
    }
    return ops[system](world, cell.iters)


def run_plan(plan: Plan, results: Results, started: float) -> None:
    for world in plan.worlds:
        for rep in range(plan.repeats):
            for system in SYSTEMS:  # every system takes its turn in every repeat: A B C A B C ...
                cell = results[world][system]
                if cell.status != "ok":
                    continue
                where = f"[{time.perf_counter() - started:6.1f}s] W={world} repeat {rep + 1}/{plan.repeats} {system}"
                gc.collect()  # between measurements, not during them
                try:
                    value = measure_one(system, world, cell, plan)
                except Exception as e:  # a failing system is reported in its cell; the others still run
                    cell.status = "n/a"
                    cell.note = str(e) if isinstance(e, Unavailable) else f"failed: {type(e).__name__}: {e}"
                    log(f"{where}: n/a: {cell.note}")
                    continue
                cell.samples.append(value)
                log(f"{where}: {fmt_seconds(value)} per op ({cell.iters} iters)")


# -- the report ------------------------------------------------------------------------------------------


def median_of(results: Results, world: int, system: str) -> float | None:
    cells = results.get(world)
    return None if cells is None else cells[system].median


def ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den <= 0:
        return None
    return num / den


def fmt_cell(cell: Cell) -> str:
    if cell.status == "capped":
        return "capped"
    return fmt_seconds(cell.median)  # "n/a" when it failed


def table_lines(results: Results) -> list[str]:
    headers = ["W", *SYSTEMS, *(name for name, _, _ in RATIOS)]
    rows = []
    for world, cells in results.items():
        ratios = [fmt_ratio(ratio(cells[a].median, cells[b].median)) for _, a, b in RATIOS]
        rows.append([str(world), *(fmt_cell(cells[s]) for s in SYSTEMS), *ratios])
    widths = [max(len(row[i]) for row in [headers, *rows]) for i in range(len(headers))]
    # Columns are at least two spaces apart, and no cell holds two spaces in a row: split on r"\s{2,}".
    return [
        "  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True))
        for row in [headers, ["-" * w for w in widths], *rows]
    ]


def fmt_x(r: float | None) -> str:
    return "n/a" if r is None else f"{r:.3g}x"


def target_lines(results: Results) -> list[str]:
    """The suite's targets next to what the bare designs reach: facts, not verdicts."""
    lines = []

    def measured(world: int) -> bool:
        if world in results:
            return True
        missing = f"  W={world} was not measured in this run (--worlds)"
        if missing not in lines:  # W=4 has both an async and a sync target
            lines.append(missing)
        return False

    def pg_missing(world: int) -> str:
        cell = results[world][PG]
        return f"threaded PG not measured at W={world} ({cell.status}: {cell.note})"

    # async W=4: >= 25x PG
    if measured(4):
        r, r_aio = (ratio(median_of(results, 4, PG), median_of(results, 4, s)) for s in (BARE_ASYNC, ASYNC))
        if r is None:
            lines.append(f"  bare asyncio at W=4: {pg_missing(4)}; target 25x PG")
        else:
            lines.append(f"  bare asyncio: {fmt_x(r)} PG at W=4; target 25x (aiocoll async: {fmt_x(r_aio)})")
    # async W=1024: >= 50x PG and <= 2x the floor
    if measured(1024):
        bare = median_of(results, 1024, BARE_ASYNC)
        r, r_aio = (ratio(median_of(results, 1024, PG), median_of(results, 1024, s)) for s in (BARE_ASYNC, ASYNC))
        if r is None:
            # Still a fact worth stating: how slow the PG would have to be for the ceiling to reach the target.
            need = "" if bare is None else f"; 50x bare asyncio's {fmt_seconds(bare)} is {fmt_seconds(50 * bare)}"
            lines.append(f"  bare asyncio at W=1024: {pg_missing(1024)}{need}; target 50x PG")
        else:
            lines.append(f"  bare asyncio: {fmt_x(r)} PG at W=1024; target 50x (aiocoll async: {fmt_x(r_aio)})")
        f, f_aio = (ratio(median_of(results, 1024, s), median_of(results, 1024, FLOOR)) for s in (BARE_ASYNC, ASYNC))
        lines.append(f"  bare asyncio: {fmt_x(f)} the floor at W=1024; target <= 2x (aiocoll async: {fmt_x(f_aio)})")
    # sync W=4: >= 2x PG; W=64: >= 10x PG
    for world, target in ((4, 2), (64, 10)):
        if not measured(world):
            continue
        pg = median_of(results, world, PG)
        bare, overhead = median_of(results, world, BARE_THREADS), median_of(results, world, DIST)
        r_sync = ratio(pg, median_of(results, world, SYNC))
        if pg is None or bare is None:
            lines.append(f"  bare threads at W={world}: not measured ({pg_missing(world)}); target {target}x PG")
            continue
        line = f"  bare threads: {fmt_x(ratio(pg, bare))} PG at W={world}; target {target}x"
        line += f" (aiocoll sync: {fmt_x(r_sync)})"
        if overhead is not None:
            # A sync rank pays both, serially under the GIL: the rendezvous and its dist.all_reduce call.
            line += (
                f"; W*dist overhead {fmt_seconds(overhead)} = PG/{ratio(pg, overhead):.3g},"
                f" bare threads + W*dist overhead = PG/{ratio(pg, bare + overhead):.3g}"
            )
        lines.append(line)
    return lines


def note_lines(results: Results) -> list[str]:
    lines = []
    for world, cells in results.items():
        for system, cell in cells.items():
            if cell.status != "ok":
                lines.append(f"  W={world} {system}: {cell.status}: {cell.note}")
    return lines


def torch_op_lines(results: Results) -> list[str]:
    lines = []
    for world, cells in results.items():
        variants = cells[FLOOR].variants
        if cells[FLOOR].status != "ok" or not variants:
            continue
        parts = [f"{name} {fmt_seconds(statistics.median(values))}" for name, values in variants.items()]
        lines.append(f"  W={world}: " + ", ".join(parts))
    return lines


def iters_lines(results: Results) -> list[str]:
    lines = []
    for world, cells in results.items():
        parts = [f"{s} {c.iters}x{len(c.samples)}" for s, c in cells.items() if c.status == "ok"]
        lines.append(f"  W={world}: " + ", ".join(parts))
    return lines


def to_json(results: Results, plan: Plan, wall: float, argv: Sequence[str]) -> dict[str, Any]:
    return {
        "command": " ".join(["python", "benchmarks/bench_ceilings.py", *argv]),
        "machine": machine_info(),
        "source": source_info(),
        "aiocoll_config": aiocoll_config(),
        "bare_asyncio_loop": plan.loop_name,
        "plan": {
            "worlds": plan.worlds,
            "repeats": plan.repeats,
            "max_thread_world": plan.max_thread_world,
            "quick": plan.quick,
        },
        "wall_time_s": wall,
        "cells": [
            {
                "world": world,
                "unit": "s per op",
                "systems": {
                    s: {
                        "status": c.status,
                        "note": c.note,
                        "iters": c.iters,
                        "samples": c.samples,
                        "median": c.median,
                        **({"variants": c.variants} if c.variants else {}),
                    }
                    for s, c in cells.items()
                },
                "ratios": {name: ratio(cells[a].median, cells[b].median) for name, a, b in RATIOS},
            }
            for world, cells in results.items()
        ],
        "targets": target_lines(results),
    }


def report(results: Results, plan: Plan) -> None:
    m = machine_info()
    header = [
        "aiocoll design ceilings: 1-element float32 all_reduce, medians over repeats, systems alternating",
        f"python {m['python']}, torch {m['torch']} ({m['torch_threads']} intra-op threads), aiocoll {m['aiocoll']}, "
        f"{m['cpu_count']} CPUs, {m['platform']}",
        f"bare asyncio loop: {plan.loop_name}; aiocoll systems: {aiocoll_config()}",
        f"aiocoll measured: {source_line(source_info())}",
        "times are per operation; ratio columns divide medians (PG/x > 1: x is faster than the threaded PG)",
    ]
    print_report(
        header,
        [
            (None, table_lines(results)),
            ("The suite's targets for aiocoll, next to the ceilings measured in this run:", target_lines(results)),
            (
                "torch work alone (the floor's variants; stack_sum_foreach is the bare systems' own op):",
                torch_op_lines(results),
            ),
            ("Not measured:", note_lines(results)),
            ("Iterations per sample x samples:", iters_lines(results)),
        ],
    )


# -- command line ----------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--worlds", type=positive_int, nargs="+", help=f"world sizes (default {' '.join(map(str, DEFAULT_WORLDS))})"
    )
    parser.add_argument("--repeats", type=positive_int, help=f"samples per cell (default {DEFAULT_REPEATS})")
    parser.add_argument(
        "--max-thread-world",
        type=positive_int,
        default=DEFAULT_MAX_THREAD_WORLD,
        help=f"largest world of the thread-per-rank systems (default {DEFAULT_MAX_THREAD_WORLD})",
    )
    parser.add_argument(
        "--quick", action="store_true", help=f"smoke run: W=4, {QUICK_ITERS} iterations, {QUICK_REPEATS} repeats"
    )
    parser.add_argument("--json", type=Path, help="also write the results to this JSON file")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    loop_name, loop_factory = loop_choice()
    plan = Plan(
        worlds=args.worlds or list(QUICK_WORLDS if args.quick else DEFAULT_WORLDS),
        repeats=args.repeats or (QUICK_REPEATS if args.quick else DEFAULT_REPEATS),
        max_thread_world=args.max_thread_world,
        quick=args.quick,
        loop_name=loop_name,
        loop_factory=loop_factory,
    )
    results = new_results(plan)
    log(f"bench_ceilings: W={plan.worlds}, {plan.repeats} repeats; progress on stderr, results on stdout")
    started = time.perf_counter()
    run_plan(plan, results, started)
    wall = time.perf_counter() - started
    report(results, plan)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(to_json(results, plan, wall, argv), indent=1) + "\n")
        print()
        print(f"results written to {args.json}")
    print(f"wall time {wall:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
