"""The benchmark suite: aiocoll against the floor, torch's threaded process group and gloo processes, in one run.

Run from the repository root (with the venv that has torch and aiocoll installed)::

    python benchmarks/bench_suite.py                  # everything, about 6-9 minutes on 2 noisy cores
    python benchmarks/bench_suite.py --quick          # smoke run, well under a minute
    python benchmarks/bench_suite.py --workloads allreduce_1 --worlds 4 64 --systems floor async --repeats 3
    python benchmarks/bench_suite.py --from-json benchmarks/results.json   # table and plot of a saved run

The machine this runs on is shared and noisy, so every system runs in the same process run, alternating
(A B C A B C ...: within each repeat, every system takes its turn at every workload of that world size), and
the table shows medians over the repeats and ratios of medians.

Systems:

* ``floor``: the least torch work for the same bytes, in one thread, no ranks: for an all_reduce of W tensors,
  one W-way sum plus W ``copy_`` (the faster of ``torch.stack(ts).sum(0)`` and chained ``add_`` into a
  scratch tensor, both timed in every sample); for all_gather_into_tensor, W copies of the gathered result,
  one into every rank's output (the inputs into one output's slices, then that output into the W-1 others).
* ``threaded PG``: torch's test-only ``multi_threaded_pg`` as torch's tests use it: one thread per rank,
  thread isolation mode on, ``init_process_group("threaded")`` with a HashStore (see ``_harness.py``).
* ``gloo``: W real processes (``_gloo_worker.py``, which imports only torch) rendezvousing over a FileStore,
  gloo on the loopback interface, ``OMP_NUM_THREADS=1``. One launch per world size and repeat runs all that
  world's workloads; its startup is counted separately (the ``startup`` rows). Capped at ``--gloo-max-world``
  processes (default 16): on this 2-core machine 16 processes take ~20 s to start and 64 took ~110 s and
  ~10 GB of RAM in a trial run. Runs in the first ``--gloo-repeats`` repeats only (default 3).
* ``aiocoll async``: ``aiocoll.spawn(async def fn, world=W)``, ranks are tasks on one loop, ``await comm.*``.
* ``aiocoll sync``: ``aiocoll.spawn(def fn, world=W)``, ranks are threads calling ``dist.*`` on backend
  "aiocoll". Both aiocoll systems use ``spawn``'s defaults as users get them (``loop="auto"``, i.e. uvloop when
  installed; the flight recorder on), which the output states.

Workloads:

* ``allreduce_1``: all_reduce of a 1-element float32 tensor at W = 4, 16, 64, 256, 1024 (``--worlds``);
* ``allreduce_16MB``: all_reduce of 16 MB (4 Mi float32) per rank at W = 4;
* ``allgather_4MB``: all_gather_into_tensor of 4 MB (1 Mi float32) per rank at W = 4;
* ``startup``: from nothing (the modules imported) to every rank past one barrier, at W = 4 and 64: the latest
  rank's time past the barrier minus the time before the world was created (for gloo: before the first
  process was launched, so it includes each process importing torch);
* ``memory``: peak RSS above the baseline, at W = 1024, in a fresh subprocess per system and sample: the
  baseline is the resident set after importing torch, aiocoll and the threaded PG (all of them, for every
  system), the peak is the peak resident set (Linux: ``VmHWM``, reset after the imports) after the world did
  10 one-element all_reduces.

Timing: per-op times are rank 0's wall time (``time.perf_counter``) around its own timed loop, after a checked
first call and a warm-up, divided by the iterations; world setup and teardown are excluded. The cyclic garbage
collector runs between measurements, not during them. Iteration counts come from a budget of rank-operations
per measurement (``--scale`` multiplies them), so that slow systems at large W run few iterations. If a system
cannot run a cell (capped, not importable, failed, timed out) the cell says so and the reason is printed.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _harness import (
    Unavailable,
    positive_int,
    print_report,
    run_threaded_pg,
    timed_comm_all_reduce,
    timed_dist_all_gather,
    timed_dist_all_reduce,
    timed_loop,
)

import aiocoll

HERE = Path(__file__).resolve().parent
GLOO_WORKER = HERE / "_gloo_worker.py"

FLOOR = "floor"
PG = "threaded PG"
GLOO = "gloo"
ASYNC = "aiocoll async"
SYNC = "aiocoll sync"
SYSTEMS = (FLOOR, PG, GLOO, ASYNC, SYNC)
SHORT = {FLOOR: "floor", PG: "pg", GLOO: "gloo", ASYNC: "async", SYNC: "sync"}  # for --systems

AR1 = "allreduce_1"
AR16 = "allreduce_16MB"
AG4 = "allgather_4MB"
STARTUP = "startup"
MEMORY = "memory"
WORKLOADS = (AR1, AR16, AG4, STARTUP, MEMORY)
DESCRIPTION = {
    AR1: "all_reduce, 1 float32 element",
    AR16: "all_reduce, 16 MB per rank",
    AG4: "all_gather_into_tensor, 4 MB per rank",
    STARTUP: "startup: nothing -> every rank past one barrier",
    MEMORY: "peak RSS above the post-import baseline",
}
NUMEL = {AR1: 1, AR16: 4 * 2**20, AG4: 2**20}  # float32 elements per rank
DEFAULT_WORLDS = {AR1: [4, 16, 64, 256, 1024], AR16: [4], AG4: [4], STARTUP: [4, 64], MEMORY: [1024]}
QUICK_WORLDS = {AR1: [4, 16], AR16: [4], AG4: [4], STARTUP: [4], MEMORY: [16]}

# Rank-operations (iterations x W) per measurement of a 1-element all_reduce, by system: roughly the same wall
# time for every W. Per rank and op, the floor and async ranks cost ~1-15 us here, the threaded PG and sync ranks
# ~50-500 us, gloo ~250-600 us.
RANK_OPS = {FLOOR: 40_000, ASYNC: 40_000, SYNC: 8_000, PG: 8_000, GLOO: 2_000}
BIG_ITERS = {AR16: 20, AG4: 50}  # iterations of the large workloads, for every system
MIN_ITERS = 5
MAX_ITERS = 10_000
QUICK_ITERS = 10
DEFAULT_REPEATS = 5
DEFAULT_GLOO_REPEATS = 3
DEFAULT_GLOO_MAX_WORLD = 16
MEMORY_ITERS = 10
SUBPROCESS_TIMEOUT = 600.0  # seconds for one gloo launch or one memory subprocess


@dataclass
class Cell:
    """One system's samples for one workload at one world size."""

    iters: int = 0
    samples: list[float] = field(default_factory=list)  # seconds per op (startup: seconds; memory: MB)
    status: str = "ok"  # "ok", "capped", "n/a" (could not run), "skipped" (not selected)
    note: str = ""
    extra: dict[str, list[float]] = field(default_factory=dict)  # e.g. the floor's two variants

    @property
    def median(self) -> float | None:
        if self.status != "ok" or not self.samples:
            return None
        return statistics.median(self.samples)

    def fail(self, status: str, note: str) -> None:
        self.status, self.note = status, note


Results = dict[tuple[str, int], dict[str, Cell]]  # (workload, world) -> system -> cell


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def clamp_iters(budget: int, world: int, scale: float) -> int:
    return max(MIN_ITERS, min(MAX_ITERS, int(budget * scale) // world))


def warmup_for(iters: int) -> int:
    return max(2, iters // 10)


# -- the floor -------------------------------------------------------------------------------------------


def floor_all_reduce(world: int, numel: int, iters: int) -> tuple[float, float]:
    """Seconds per all_reduce-equivalent: (``stack(ts).sum(0)`` + W copies, chained ``add_`` + W copies)."""
    ts = [torch.ones(numel) for _ in range(world)]
    acc = torch.empty(numel)

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

    warmup = warmup_for(iters)
    return timed_loop(stack_sum, warmup, iters) / iters, timed_loop(chained_add, warmup, iters) / iters


def floor_all_gather(world: int, numel: int, iters: int) -> float:
    """Seconds per all_gather-equivalent: the W inputs into one output's slices, then W-1 copies of that output.

    Like the all_reduce floor's "W copies" of the result, every rank's output is written once: W ranks
    each receive W*numel elements. (Filling a single output would be 1/W of the bytes the op must write.)
    """
    inputs = [torch.full((numel,), float(r)) for r in range(world)]
    outs = [torch.empty(numel * world) for _ in range(world)]
    slices = [outs[0][r * numel : (r + 1) * numel] for r in range(world)]

    def copies() -> None:
        for dst, src in zip(slices, inputs, strict=True):
            dst.copy_(src)
        for out in outs[1:]:
            out.copy_(outs[0])

    return timed_loop(copies, warmup_for(iters), iters) / iters


# -- aiocoll ---------------------------------------------------------------------------------------------


def aiocoll_async_op(workload: str, world: int, iters: int) -> float:
    """Seconds per op on async ranks (``spawn``'s defaults), as seen by rank 0."""
    numel, warmup = NUMEL[workload], warmup_for(iters)

    async def rank_fn(comm: aiocoll.Comm) -> float:
        if workload == AG4:
            inp = torch.full((numel,), float(comm.rank))
            out = torch.empty(numel * world)
            await comm.all_gather_into_tensor(out, inp)
            if out[numel * (world - 1)].item() != world - 1 or out[0].item() != 0:
                raise AssertionError(f"rank {comm.rank}: all_gather_into_tensor gave wrong data")
            for _ in range(warmup):
                await comm.all_gather_into_tensor(out, inp)
            start = time.perf_counter()
            for _ in range(iters):
                await comm.all_gather_into_tensor(out, inp)
            return time.perf_counter() - start
        return await timed_comm_all_reduce(comm, warmup, iters, numel)

    return aiocoll.spawn(rank_fn, world=world)[0] / iters


def dist_op(workload: str, rank: int, world: int, iters: int) -> float:
    """One rank's timed loop through torch.distributed (the sync ranks' and the threaded PG's), in seconds."""
    if workload == AG4:
        return timed_dist_all_gather(rank, world, warmup_for(iters), iters, NUMEL[workload])
    return timed_dist_all_reduce(rank, world, warmup_for(iters), iters, NUMEL[workload])


def aiocoll_sync_op(workload: str, world: int, iters: int) -> float:
    """Seconds per ``dist.*`` op on sync ranks (threads, backend "aiocoll"), as seen by rank 0."""

    def rank_fn(comm: aiocoll.Comm) -> float:
        return dist_op(workload, comm.rank, world, iters)

    return aiocoll.spawn(rank_fn, world=world)[0] / iters


def threaded_pg_op(workload: str, world: int, iters: int) -> float:
    return run_threaded_pg(world, lambda rank: dist_op(workload, rank, world, iters))[0] / iters


def startup_async(world: int) -> float:
    async def rank_fn(comm: aiocoll.Comm) -> float:
        await comm.barrier()
        return time.perf_counter()

    start = time.perf_counter()
    return max(aiocoll.spawn(rank_fn, world=world)) - start


def startup_sync(world: int) -> float:
    def rank_fn(comm: aiocoll.Comm) -> float:
        dist.barrier()
        return time.perf_counter()

    start = time.perf_counter()
    return max(aiocoll.spawn(rank_fn, world=world)) - start


def startup_threaded_pg(world: int) -> float:
    def rank_fn(rank: int) -> float:
        dist.barrier()
        return time.perf_counter()

    start = time.perf_counter()
    return max(run_threaded_pg(world, rank_fn)) - start


# -- gloo processes --------------------------------------------------------------------------------------


def loopback_ifname() -> str | None:
    for _, name in socket.if_nameindex():
        if name in ("lo", "lo0"):
            return name
    return None


def run_gloo(world: int, ops: list[dict[str, Any]]) -> tuple[float, list[float]]:
    """Launch ``world`` gloo processes running ``ops``: (startup seconds, rank 0's seconds per op of each)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if "GLOO_SOCKET_IFNAME" not in env and (lo := loopback_ifname()) is not None:
        env["GLOO_SOCKET_IFNAME"] = lo  # loopback only
    with tempfile.TemporaryDirectory(prefix="aiocoll-bench-gloo-") as tmp_name:
        tmp = Path(tmp_name)
        init_method = (tmp / "store").as_uri()
        spec = json.dumps(ops)
        procs: list[subprocess.Popen[bytes]] = []
        start = time.time()  # wall clock: the workers' times are compared with it
        try:
            for rank in range(world):
                with (tmp / f"rank{rank}.err").open("wb") as err:
                    cmd = [sys.executable, str(GLOO_WORKER), str(rank), str(world), init_method]
                    cmd += [str(tmp / f"rank{rank}.json"), spec]
                    procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err, cwd=tmp))
            deadline = time.monotonic() + SUBPROCESS_TIMEOUT
            for p in procs:
                try:
                    p.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    raise Unavailable(f"{world} gloo processes did not finish in {SUBPROCESS_TIMEOUT:.0f}s") from None
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        failed = [rank for rank, p in enumerate(procs) if p.returncode != 0]
        if failed:
            tail = (tmp / f"rank{failed[0]}.err").read_text(errors="replace").strip().splitlines()[-3:]
            raise Unavailable(f"gloo rank {failed[0]} of {world} failed: {' | '.join(tail)}")
        outs = [json.loads((tmp / f"rank{rank}.json").read_text()) for rank in range(world)]
    startup = max(float(o["past_barrier"]) for o in outs) - start
    return startup, [float(s) for s in outs[0]["seconds_per_op"]]


# -- memory ----------------------------------------------------------------------------------------------


def proc_status_mb(key: str) -> float | None:
    """``VmRSS`` (resident now) or ``VmHWM`` (peak resident) of this process in MB, where /proc has them."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) / 2**10  # kB
    except OSError:
        pass
    return None


def reset_peak_rss() -> None:
    """Make the peak resident set (``VmHWM``) the current one (Linux >= 4.0), where /proc allows it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_rss_mb() -> float:
    # Not ru_maxrss alone: Linux carries it over exec from the parent, so a child started by a process with a
    # large resident set reports at least the parent's. VmHWM belongs to the process's own address space.
    hwm = proc_status_mb("VmHWM")
    if hwm is not None:
        return hwm
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10  # bytes on macOS, KiB elsewhere


def memory_worker(system: str, world: int) -> dict[str, float]:
    """In a fresh process: peak RSS of ``system`` doing ``MEMORY_ITERS`` 1-element all_reduces at ``world``."""
    import torch.testing._internal.distributed.multi_threaded_pg  # noqa: F401  (same baseline for every system)

    gc.collect()
    reset_peak_rss()
    baseline = proc_status_mb("VmRSS") or peak_rss_mb()
    if system == FLOOR:
        floor_all_reduce(world, 1, MEMORY_ITERS)
    elif system == PG:
        threaded_pg_op(AR1, world, MEMORY_ITERS)
    elif system == ASYNC:
        aiocoll_async_op(AR1, world, MEMORY_ITERS)
    elif system == SYNC:
        aiocoll_sync_op(AR1, world, MEMORY_ITERS)
    else:
        raise ValueError(f"no memory measurement for {system!r}")
    peak = peak_rss_mb()
    return {"baseline_mb": baseline, "peak_mb": peak, "delta_mb": peak - baseline}


def measure_memory(system: str, world: int) -> float:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--memory-worker", system, "--memory-world", str(world)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT, check=False)
    except subprocess.TimeoutExpired:
        raise Unavailable(f"the memory subprocess did not finish in {SUBPROCESS_TIMEOUT:.0f}s") from None
    if proc.returncode != 0:
        tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
        raise Unavailable(f"the memory subprocess failed (exit {proc.returncode}): {tail}")
    return float(json.loads(proc.stdout.strip().splitlines()[-1])["delta_mb"])


# -- the schedule ----------------------------------------------------------------------------------------


@dataclass
class Plan:
    worlds: dict[str, list[int]]  # workload -> world sizes
    systems: list[str]
    repeats: int
    gloo_repeats: int
    gloo_max_world: int
    scale: float
    quick: bool


def iters_for(system: str, workload: str, world: int, plan: Plan) -> int:
    if workload in BIG_ITERS:
        return 3 if plan.quick else max(1, int(BIG_ITERS[workload] * plan.scale))
    if plan.quick:
        return QUICK_ITERS
    return clamp_iters(RANK_OPS[system], world, plan.scale)


def new_results(plan: Plan) -> Results:
    results: Results = {}
    for workload in WORKLOADS:
        for world in plan.worlds.get(workload, []):
            cells = {system: Cell() for system in SYSTEMS}
            for system, cell in cells.items():
                if system not in plan.systems:
                    cell.fail("skipped", "not selected (--systems)")
                elif system == FLOOR and workload == STARTUP:
                    cell.fail("skipped", "startup compares the systems with each other")
                elif system == GLOO and workload == MEMORY:
                    cell.fail("capped", f"{world} processes (memory is measured for the in-process systems)")
                elif system == GLOO and world > plan.gloo_max_world:
                    cell.fail("capped", f"{world} processes > --gloo-max-world {plan.gloo_max_world}")
                elif workload not in (STARTUP, MEMORY):
                    cell.iters = iters_for(system, workload, world, plan)
            results[(workload, world)] = cells
    return results


def measure_one(system: str, workload: str, world: int, cell: Cell) -> float:
    """One sample of ``system`` at ``workload``/``world`` (not gloo: see ``gloo_slot``)."""
    if workload == STARTUP:
        return {ASYNC: startup_async, SYNC: startup_sync, PG: startup_threaded_pg}[system](world)
    if system == FLOOR:
        if workload == AG4:
            return floor_all_gather(world, NUMEL[workload], cell.iters)
        stack_sum, chained_add = floor_all_reduce(world, NUMEL[workload], cell.iters)
        cell.extra.setdefault("stack_sum", []).append(stack_sum)
        cell.extra.setdefault("chained_add", []).append(chained_add)
        return min(stack_sum, chained_add)
    op = {ASYNC: aiocoll_async_op, SYNC: aiocoll_sync_op, PG: threaded_pg_op}[system]
    return op(workload, world, cell.iters)


def fmt_sample(workload: str, value: float) -> str:
    return f"{value:.1f} MB" if workload == MEMORY else fmt_seconds(value)


def gloo_slot(world: int, cells: dict[str, Cell], where: str) -> None:
    """One gloo launch at ``world``: one sample for every gloo cell of that world (its startup among them)."""
    op_workloads = [w for w in (AR1, AR16, AG4) if w in cells and cells[w].status == "ok"]
    if not op_workloads and (STARTUP not in cells or cells[STARTUP].status != "ok"):
        return
    ops = [
        {
            "op": "all_gather_into_tensor" if w == AG4 else "all_reduce",
            "numel": NUMEL[w],
            "warmup": warmup_for(cells[w].iters),
            "iters": cells[w].iters,
        }
        for w in op_workloads
    ]
    log(f"{where} {GLOO}: launching {world} processes for {', '.join([STARTUP, *op_workloads])} ...")
    gc.collect()
    try:
        startup, per_op = run_gloo(world, ops)
    except Unavailable as e:
        for cell in cells.values():
            if cell.status == "ok":
                cell.fail("n/a", str(e))
        log(f"{where} {GLOO}: n/a: {e}")
        return
    if STARTUP in cells and cells[STARTUP].status == "ok":
        cells[STARTUP].samples.append(startup)
    for w, seconds in zip(op_workloads, per_op, strict=True):
        cells[w].samples.append(seconds)
    done = ", ".join(f"{w} {fmt_seconds(s)}" for w, s in zip(op_workloads, per_op, strict=True))
    log(f"{where} {GLOO}: startup {fmt_seconds(startup)}, {done}")


def progress(started: float, world: int, rep: int, repeats: int) -> str:
    return f"[{time.perf_counter() - started:6.1f}s] W={world} repeat {rep + 1}/{repeats}"


def run_plan(plan: Plan, results: Results, started: float) -> None:
    op_worlds = sorted({world for (workload, world) in results if workload != MEMORY})
    for world in op_worlds:
        here = [w for w in WORKLOADS if (w, world) in results and w != MEMORY]
        for rep in range(plan.repeats):
            for system in SYSTEMS:
                cells = {w: results[(w, world)][system] for w in here}
                if system == GLOO:
                    if rep < plan.gloo_repeats:
                        gloo_slot(world, cells, progress(started, world, rep, plan.repeats))
                    continue
                for workload, cell in cells.items():
                    if cell.status != "ok":
                        continue
                    where = progress(started, world, rep, plan.repeats)
                    gc.collect()
                    try:
                        value = measure_one(system, workload, world, cell)
                    except Exception as e:  # a failing system is reported in its cell; the others still run
                        why = str(e) if isinstance(e, Unavailable) else f"failed: {type(e).__name__}: {e}"
                        cell.fail("n/a", why)
                        log(f"{where} {system} {workload}: n/a: {why}")
                        continue
                    cell.samples.append(value)
                    log(f"{where} {system} {workload}: {fmt_sample(workload, value)}")
    gc.collect()
    for world in plan.worlds.get(MEMORY, []):
        cells = results[(MEMORY, world)]
        for rep in range(plan.repeats):
            for system, cell in cells.items():
                if cell.status != "ok":
                    continue
                where = progress(started, world, rep, plan.repeats)
                try:
                    value = measure_memory(system, world)
                except Unavailable as e:
                    cell.fail("n/a", str(e))
                    log(f"{where} {system} {MEMORY}: n/a: {e}")
                    continue
                cell.samples.append(value)
                log(f"{where} {system} {MEMORY}: {value:.1f} MB")


# -- the report ------------------------------------------------------------------------------------------


def fmt_seconds(s: float | None) -> str:
    if s is None:
        return "n/a"
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms" if s < 0.1 else f"{s * 1e3:.0f} ms"
    return f"{s * 1e6:.3g} us" if s >= 1e-4 or s < 1e-5 else f"{s * 1e6:.1f} us"


def fmt_value(workload: str, cell: Cell) -> str:
    if cell.status == "skipped":
        return "-"
    if cell.status == "capped":
        return "capped"
    m = cell.median
    if m is None:
        return "n/a"
    return f"{m:.0f} MB" if workload == MEMORY else fmt_seconds(m)


def ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den <= 0:
        return None
    return num / den


def fmt_ratio(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}x" if r < 100 else f"{r:.0f}x"


RATIOS = (  # column name, numerator, denominator
    ("PG/async", PG, ASYNC),
    ("PG/sync", PG, SYNC),
    ("async/floor", ASYNC, FLOOR),
    ("sync/floor", SYNC, FLOOR),
    ("PG/floor", PG, FLOOR),
    ("gloo/floor", GLOO, FLOOR),
)


def cell_ratios(cells: dict[str, Cell]) -> dict[str, float | None]:
    return {name: ratio(cells[a].median, cells[b].median) for name, a, b in RATIOS}


@dataclass
class Target:
    label: str
    workload: str
    world: int
    num: str
    den: str
    kind: str  # "speedup": den / num >= bound; "ratio": num / den <= bound
    bound: float

    def measured(self, results: Results) -> float | None:
        cells = results.get((self.workload, self.world))
        if cells is None:
            return None
        return ratio(cells[self.num].median, cells[self.den].median)

    def describe(self) -> str:
        if self.kind == "speedup":
            return f"{self.den} / {self.num} >= {self.bound:g}"
        return f"{self.num} / {self.den} <= {self.bound:g}"

    def check(self, results: Results) -> tuple[float | None, bool | None]:
        """(the measured value in the target's terms, whether it passes); None where it was not measured."""
        r = self.measured(results)
        if r is None:
            return None, None
        if self.kind == "speedup":  # how many times faster num is than den
            value = 1 / r
            return value, value >= self.bound
        return r, r <= self.bound


TARGETS = (
    Target("async 1-element all_reduce, W=4: >= 25x faster than threaded PG", AR1, 4, ASYNC, PG, "speedup", 25),
    Target("async 1-element all_reduce, W=1024: >= 30x faster than threaded PG", AR1, 1024, ASYNC, PG, "speedup", 30),
    Target("async 1-element all_reduce, W=1024: <= 2x the floor", AR1, 1024, ASYNC, FLOOR, "ratio", 2),
    Target("sync dist.all_reduce, W=4: >= 1.5x faster than threaded PG", AR1, 4, SYNC, PG, "speedup", 1.5),
    Target("sync dist.all_reduce, W=64: >= 2.5x faster than threaded PG", AR1, 64, SYNC, PG, "speedup", 2.5),
    Target("sync dist.all_reduce, W=1024: >= 1.5x faster than threaded PG", AR1, 1024, SYNC, PG, "speedup", 1.5),
    Target("async 16 MB all_reduce, W=4: <= 1.3x the floor", AR16, 4, ASYNC, FLOOR, "ratio", 1.3),
    Target("async 4 MB all_gather_into_tensor, W=4: <= 1.2x the floor", AG4, 4, ASYNC, FLOOR, "ratio", 1.2),
    Target("startup W=64, async ranks: <= 1/3 of threaded PG's", STARTUP, 64, ASYNC, PG, "ratio", 1 / 3),
    Target("startup W=64, sync ranks: no slower than threaded PG", STARTUP, 64, SYNC, PG, "ratio", 1.0),
    Target("memory W=1024, async ranks: below threaded PG's", MEMORY, 1024, ASYNC, PG, "ratio", 1.0),
    Target("memory W=1024, sync ranks: below threaded PG's", MEMORY, 1024, SYNC, PG, "ratio", 1.0),
)


def table_lines(results: Results) -> list[str]:
    headers = ["workload", "W", *SYSTEMS, *(name for name, _, _ in RATIOS)]
    rows = []
    for (workload, world), cells in results.items():
        values = [fmt_value(workload, cells[s]) for s in SYSTEMS]
        rows.append([workload, str(world), *values, *(fmt_ratio(r) for r in cell_ratios(cells).values())])
    widths = [max(len(row[i]) for row in [headers, *rows]) for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        first = cells[0].ljust(widths[0])
        return "  ".join([first, *(c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True))]).rstrip()

    return [line(headers), line(["-" * w for w in widths]), *(line(row) for row in rows)]


def target_lines(results: Results) -> list[str]:
    lines = []
    for t in TARGETS:
        value, ok = t.check(results)
        if value is None:
            verdict, shown = "n/a ", "not measured"
        else:
            verdict = "PASS" if ok else "FAIL"
            shown = f"{value:.3g}" + ("x faster" if t.kind == "speedup" else "x")
        lines.append(f"  {verdict}  {t.label:<66}  measured {shown}  ({t.describe()})")
    return lines


def note_lines(results: Results) -> list[str]:
    notes: dict[str, None] = {}
    for (workload, world), cells in results.items():
        for system, cell in cells.items():
            if cell.status in ("capped", "n/a"):
                notes[f"  {workload} W={world}, {system}: {cell.status}: {cell.note}"] = None
    return list(notes)


def iters_lines(results: Results) -> list[str]:
    lines = []
    for (workload, world), cells in results.items():
        if workload in (STARTUP, MEMORY):
            continue
        parts = [f"{s} {c.iters}x{len(c.samples)}" for s, c in cells.items() if c.status == "ok"]
        lines.append(f"  {workload} W={world}: " + ", ".join(parts))
    return lines


def machine_info() -> dict[str, Any]:
    return {
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "aiocoll": aiocoll.__version__,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def source_info() -> dict[str, Any]:
    """The commit of the aiocoll being measured, and whether its working tree had changes."""
    root = Path(aiocoll.__file__).resolve().parent.parent

    def git(*args: str) -> str:
        try:
            proc = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30, check=False)
        except OSError:
            return ""
        return proc.stdout.strip() if proc.returncode == 0 else ""

    return {
        "aiocoll_path": str(root),
        "commit": git("rev-parse", "HEAD") or None,
        "dirty": bool(git("status", "--porcelain", "--", "aiocoll")),
    }


def source_line(source: dict[str, Any]) -> str:
    commit = source.get("commit") or "unknown commit"
    dirty = " with uncommitted changes to aiocoll/" if source.get("dirty") else ""
    return f"{source.get('aiocoll_path', '?')} at {commit[:12]}{dirty}"


def aiocoll_config() -> str:
    import importlib.util

    loop = "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"
    return f"spawn defaults: loop='auto' (here: {loop}), flight recorder on (record={aiocoll.DEFAULT_RECORD})"


def to_json(results: Results, plan: Plan, wall: float, argv: Sequence[str]) -> dict[str, Any]:
    cells_out = []
    for (workload, world), cells in results.items():
        cells_out.append(
            {
                "workload": workload,
                "description": DESCRIPTION[workload],
                "world": world,
                "unit": "MB" if workload == MEMORY else "s",
                "systems": {
                    s: {
                        "status": c.status,
                        "note": c.note,
                        "iters": c.iters,
                        "samples": c.samples,
                        "median": c.median,
                        **({"variants": c.extra} if c.extra else {}),
                    }
                    for s, c in cells.items()
                },
                "ratios": cell_ratios(cells),
            }
        )
    targets = []
    for t in TARGETS:
        value, ok = t.check(results)
        targets.append({"target": t.label, "rule": t.describe(), "measured": value, "pass": ok})
    return {
        "command": " ".join(["python", "benchmarks/bench_suite.py", *argv]),
        "machine": machine_info(),
        "source": source_info(),
        "aiocoll_config": aiocoll_config(),
        "plan": {
            "systems": plan.systems,
            "worlds": plan.worlds,
            "repeats": plan.repeats,
            "gloo_repeats": plan.gloo_repeats,
            "gloo_max_world": plan.gloo_max_world,
            "scale": plan.scale,
            "quick": plan.quick,
        },
        "wall_time_s": wall,
        "cells": cells_out,
        "targets": targets,
    }


def results_from_json(data: dict[str, Any]) -> Results:
    results: Results = {}
    for c in data["cells"]:
        cells = {}
        for s, d in c["systems"].items():
            cells[s] = Cell(iters=d["iters"], samples=d["samples"], status=d["status"], note=d["note"])
            cells[s].extra = d.get("variants", {})
        results[(c["workload"], c["world"])] = cells
    return results


def report(results: Results, header: list[str]) -> None:
    print_report(
        header,
        [
            (None, table_lines(results)),
            ("Targets (ratios of medians measured in this run):", target_lines(results)),
            ("Not measured:", note_lines(results)),
            ("Iterations per sample x samples:", iters_lines(results)),
        ],
    )


# -- the plot --------------------------------------------------------------------------------------------

COLORS = {FLOOR: "0.45", PG: "tab:red", GLOO: "tab:orange", ASYNC: "tab:blue", SYNC: "tab:green"}


def plot(data: dict[str, Any], path: Path) -> bool:
    """Draw ``data`` (the JSON of a run) into ``path``; False, with a message, if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"no plot: matplotlib is not installed (pip install 'aiocoll[plot]'); {path} not written")
        return False
    results = results_from_json(data)
    fig = plt.figure(figsize=(15, 8.5), layout="constrained")
    grid = fig.add_gridspec(2, 3)
    ax = fig.add_subplot(grid[0, :2])
    for system in SYSTEMS:
        points = [
            (world, cells[system].median)
            for (workload, world), cells in results.items()
            if workload == AR1 and cells[system].median is not None
        ]
        if points:
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, [y * 1e6 for y in ys], "o-", color=COLORS[system], label=system)
    ax.set(xscale="log", yscale="log", xlabel="world size W", ylabel="us per all_reduce (median)")
    ax.set_title("1-element all_reduce: latency vs world size (lower is better)")
    ax.grid(True, which="both", alpha=0.3)
    if ax.get_lines():
        ax.legend()

    def bars(ax: Any, keys: list[tuple[str, int]], scale: float, ylabel: str, title: str, log: bool) -> None:
        labels = [f"W={w}" if len(keys) > 1 else f"{wl} W={w}" for wl, w in keys]
        width = 0.8 / len(SYSTEMS)
        for i, system in enumerate(SYSTEMS):
            xs, ys = [], []
            for j, key in enumerate(keys):
                m = results[key][system].median if key in results else None
                if m is not None:
                    xs.append(j + (i - (len(SYSTEMS) - 1) / 2) * width)
                    ys.append(m * scale)
            if ys:
                rects = ax.bar(xs, ys, width, color=COLORS[system], label=system)
                ax.bar_label(rects, fmt="%.3g", fontsize=7, rotation=90, padding=2)
        ax.set_xticks(range(len(keys)), labels)
        ax.set(ylabel=ylabel, title=title)
        if log:
            ax.set_yscale("log")
        ax.margins(y=0.25)
        ax.grid(True, axis="y", alpha=0.3)

    def keys_of(workload: str) -> list[tuple[str, int]]:
        return [k for k in results if k[0] == workload]

    panels = (
        (grid[0, 2], STARTUP, 1e3, "ms (median)", "startup to every rank past a barrier", True),
        (grid[1, 0], AR16, 1e3, "ms per all_reduce (median)", "all_reduce, 16 MB per rank", False),
        (grid[1, 1], AG4, 1e3, "ms per all_gather (median)", "all_gather_into_tensor, 4 MB per rank", False),
        (grid[1, 2], MEMORY, 1.0, "MB above baseline (median)", "peak memory", False),
    )
    for spec, workload, scale, ylabel, title, log in panels:
        keys = keys_of(workload)
        sub = fig.add_subplot(spec)
        if keys:
            worlds = ", ".join(str(w) for _, w in keys)
            bars(sub, keys, scale, ylabel, f"{title} (W={worlds})" if len(keys) == 1 else title, log)
        else:
            sub.set_axis_off()
            sub.set_title(f"{title}: not measured")
    m = data["machine"]
    fig.suptitle(
        f"aiocoll benchmark suite: {m['cpu_count']} CPUs, torch {m['torch']}, python {m['python']}, {m['date']}; "
        f"medians of interleaved repeats in one run"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot written to {path}")
    return True


# -- command line ----------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument(
        "--systems", nargs="+", choices=list(SHORT.values()), default=list(SHORT.values()), help="default: all"
    )
    parser.add_argument("--worlds", type=positive_int, nargs="+", help="world sizes of allreduce_1 (4 16 64 256 1024)")
    parser.add_argument("--startup-worlds", type=positive_int, nargs="+", help="world sizes of startup (4 64)")
    parser.add_argument("--memory-world", type=positive_int, help="world size of memory (1024)")
    parser.add_argument("--repeats", type=positive_int, help=f"samples per cell (default {DEFAULT_REPEATS})")
    parser.add_argument(
        "--gloo-repeats",
        type=positive_int,
        help=f"gloo runs in the first N repeats only (default {DEFAULT_GLOO_REPEATS})",
    )
    parser.add_argument(
        "--gloo-max-world",
        type=positive_int,
        help=f"largest world of gloo processes (default {DEFAULT_GLOO_MAX_WORLD}; --quick: 4)",
    )
    parser.add_argument("--scale", type=float, default=1.0, help="multiply the iteration counts (default 1)")
    parser.add_argument("--quick", action="store_true", help="smoke run: small worlds, few iterations, 1 repeat")
    parser.add_argument("--json", type=Path, default=HERE / "results.json", help="where to write the results")
    parser.add_argument("--plot", type=Path, default=HERE / "results.png", help="where to draw the plot")
    parser.add_argument("--no-plot", action="store_true", help="do not draw the plot")
    parser.add_argument("--from-json", type=Path, help="print the table and draw the plot of a saved run")
    parser.add_argument("--memory-worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.scale <= 0:
        parser.error("--scale must be positive")
    return args


def make_plan(args: argparse.Namespace) -> Plan:
    base = QUICK_WORLDS if args.quick else DEFAULT_WORLDS
    worlds = {w: list(base[w]) for w in args.workloads}
    if args.worlds and AR1 in worlds:
        worlds[AR1] = args.worlds
    if args.startup_worlds and STARTUP in worlds:
        worlds[STARTUP] = args.startup_worlds
    if args.memory_world and MEMORY in worlds:
        worlds[MEMORY] = [args.memory_world]
    by_short = {v: k for k, v in SHORT.items()}
    repeats = args.repeats or (1 if args.quick else DEFAULT_REPEATS)
    return Plan(
        worlds=worlds,
        systems=[by_short[s] for s in args.systems],
        repeats=repeats,
        gloo_repeats=min(repeats, args.gloo_repeats or DEFAULT_GLOO_REPEATS),
        gloo_max_world=args.gloo_max_world or (4 if args.quick else DEFAULT_GLOO_MAX_WORLD),
        scale=args.scale,
        quick=args.quick,
    )


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.memory_worker:
        print(json.dumps(memory_worker(args.memory_worker, args.memory_world)))
        return 0
    if args.from_json:
        data = json.loads(args.from_json.read_text())
        results = results_from_json(data)
    else:
        plan = make_plan(args)
        results = new_results(plan)
        log(f"bench_suite: {len(results)} cells, {plan.repeats} repeats; progress on stderr, results on stdout")
        started = time.perf_counter()
        run_plan(plan, results, started)
        data = to_json(results, plan, time.perf_counter() - started, argv)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(data, indent=1) + "\n")
    m = data["machine"]
    header = [
        "aiocoll benchmark suite: medians over repeats, systems alternating within each repeat (same run)",
        f"python {m['python']}, torch {m['torch']} ({m['torch_threads']} intra-op threads), aiocoll {m['aiocoll']}, "
        f"{m['cpu_count']} CPUs, {m['platform']}, {m['date']}",
        f"aiocoll systems: {data['aiocoll_config']}",
        f"aiocoll measured: {source_line(data.get('source', {}))}",
        "times are per operation (startup: per world; memory: MB of peak RSS above the post-import baseline);",
        "ratio columns divide medians: PG/async > 1 means async ranks are faster, async/floor is the overhead",
    ]
    report(results, header)
    print()
    if not args.from_json:
        print(f"results written to {args.json}")
    if not args.no_plot:
        plot(data, args.plot)
    print(f"wall time {data['wall_time_s']:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
