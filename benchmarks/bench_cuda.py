"""all_reduce and all_gather on CUDA tensors, W ranks on one GPU: aiocoll against the GPU floor and torch's threaded PG.

Run from the repository root on a machine with a GPU::

    python benchmarks/bench_cuda.py                          # W 4 and 8; 1 element, 16 MB, 256 MB a rank
    python benchmarks/bench_cuda.py --worlds 4 --sizes 16MB --repeats 5
    python benchmarks/bench_cuda.py --quick --device cpu     # smoke test, anywhere

Systems, each timed by rank 0 over ``iters`` ops after a checked first op and a warm-up,
ending with ``torch.cuda.synchronize()`` so the GPU's work is counted; the table shows
the median over ``--repeats`` repeats, the systems alternating within each repeat:

* ``floor``: the least the GPU must do, on one stream in one thread: for all_reduce one
  stacked sum of the W inputs and W copies of it; for all_gather one concatenation into
  the first output and W - 1 copies of it.
* ``threaded PG``: torch's test-only threaded process group, W threads calling
  ``dist.all_reduce`` / ``dist.all_gather_into_tensor`` on CUDA tensors.
* ``aiocoll async``: ``aiocoll.spawn`` with W async ranks, each ``await comm.all_reduce(t)``
  (the op runs on a side stream; the await ends once its event has fired).
* ``aiocoll sync``: ``aiocoll.spawn`` with W sync ranks calling ``dist.*`` (each call
  returns once the op is enqueued, as with NCCL).

Ratios: ``async/floor``, ``sync/floor`` (the target at 256 MB: at most 1.2x) and
``PG/async``, ``PG/sync`` (above 1: aiocoll is faster). A system that cannot run prints
``n/a`` and the reason below the table.
"""

from __future__ import annotations

import argparse
import gc
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from _harness import print_report, run_threaded_pg

import aiocoll

SYSTEMS = ("floor", "threaded PG", "aiocoll async", "aiocoll sync")
SIZES = {"1": 1, "16MB": 4 << 20, "256MB": 64 << 20}  # float32 elements a rank
ITERS = {1: 200, 4 << 20: 40, 64 << 20: 10}
OPS = ("all_reduce", "all_gather")
# torch 2.13 renamed all_gather_into_tensor (the old name warns)
_all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _check(op: str, rank: int, world: int, out: torch.Tensor, numel: int) -> None:
    """The first op's result: all_reduce of (rank + 1) sums to W(W+1)/2; all_gather puts rank i's i at i."""
    want = [world * (world + 1) / 2] * 2 if op == "all_reduce" else [0.0, float(world - 1)]
    got = out[[0, -1]].tolist()
    if got != want:
        raise AssertionError(f"{op} on rank {rank} of {world}: got {got} at the ends, expected {want}")


def _tensors(op: str, rank: int, world: int, numel: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(input, output) of one rank; all_reduce works in place."""
    if op == "all_reduce":
        t = torch.full((numel,), float(rank + 1), device=device)
        return t, t
    return torch.full((numel,), float(rank), device=device), torch.empty(numel * world, device=device)


def floor(op: str, world: int, numel: int, iters: int, device: torch.device) -> float:
    pairs = [_tensors(op, r, world, numel, device) for r in range(world)]
    ins = [i for i, _ in pairs]
    outs = [o for _, o in pairs]

    def once() -> None:
        if op == "all_reduce":
            s = torch.stack(ins).sum(0)
            for o in outs:
                o.copy_(s)
        else:
            torch.cat(ins, out=outs[0])
            for o in outs[1:]:
                o.copy_(outs[0])

    once()
    _check(op, 0, world, outs[0], numel)
    if op == "all_reduce":
        for t in ins:
            t.zero_()
    return _timed(once, iters, device)


def _timed(call: Callable[[], object], iters: int, device: torch.device) -> float:
    """Seconds per ``call()``: one warm-up, then ``iters`` timed, the device's work included."""
    call()
    _sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        call()
    _sync(device)
    return (time.perf_counter() - start) / iters


def _dist_rank(op: str, rank: int, world: int, numel: int, iters: int, device: torch.device) -> float:
    inp, out = _tensors(op, rank, world, numel, device)
    call: Callable[[], object] = (
        (lambda: dist.all_reduce(inp)) if op == "all_reduce" else (lambda: _all_gather_single(out, inp))
    )
    call()
    _check(op, rank, world, out, numel)
    if op == "all_reduce":
        inp.zero_()
    return _timed(call, iters, device)


def threaded_pg(op: str, world: int, numel: int, iters: int, device: torch.device) -> float:
    return run_threaded_pg(world, lambda r: _dist_rank(op, r, world, numel, iters, device))[0]


def aiocoll_sync(op: str, world: int, numel: int, iters: int, device: torch.device) -> float:
    def fn(comm: aiocoll.Comm) -> float:
        return _dist_rank(op, comm.rank, world, numel, iters, device)

    return aiocoll.spawn(fn, world=world)[0]


def aiocoll_async(op: str, world: int, numel: int, iters: int, device: torch.device) -> float:
    async def fn(comm: aiocoll.Comm) -> float:
        inp, out = _tensors(op, comm.rank, world, numel, device)

        async def call() -> None:
            if op == "all_reduce":
                await comm.all_reduce(inp)
            else:
                await comm.all_gather_into_tensor(out, inp)

        await call()
        _check(op, comm.rank, world, out, numel)
        if op == "all_reduce":
            inp.zero_()
        await call()
        _sync(device)
        start = time.perf_counter()
        for _ in range(iters):
            await call()
        _sync(device)
        return (time.perf_counter() - start) / iters

    return aiocoll.spawn(fn, world=world, torch_distributed=False)[0]


def profile(op: str, world: int, numel: int, device: torch.device) -> int:
    """Where each aiocoll system's time goes for one cell: torch.profiler's table, CPU and device."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    for system in ("floor", "aiocoll async", "aiocoll sync"):
        MEASURE[system](op, world, numel, 3, device)  # warm-up
        with torch_profile(activities=activities) as prof:
            took = MEASURE[system](op, world, numel, 10, device)
        print(f"== {system}: {op} W={world} {numel * 4 >> 20} MB, {took * 1e6:,.0f} us per op")
        sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=sort, row_limit=12, max_name_column_width=48))
    return 0


MEASURE = {"floor": floor, "threaded PG": threaded_pg, "aiocoll async": aiocoll_async, "aiocoll sync": aiocoll_sync}


def _cell(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e6:,.0f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "n/a" if a is None or b is None else f"{a / b:.2f}x"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", nargs="+", type=int, default=[4, 8])
    parser.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES))
    parser.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="W 2, the smallest size, 1 repeat, few iterations")
    parser.add_argument(
        "--profile", action="store_true", help="instead: torch.profiler tables of the first cell, each aiocoll system"
    )
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu for a smoke test", file=sys.stderr)
        return 2
    worlds = [2] if args.quick else args.worlds
    sizes = ["1"] if args.quick else args.sizes
    repeats = 1 if args.quick else args.repeats
    if args.profile:
        return profile(args.ops[0], worlds[0], SIZES[sizes[-1]], device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    header = [
        f"{', '.join(args.ops)} on {device.type} tensors ({where}), torch {torch.__version__}: us per op, "
        f"median of {repeats}",
        f"{'op':<11} {'W':>2} {'size':>6} {'iters':>5} "
        + " ".join(f"{s + ' us':>16}" for s in SYSTEMS)
        + f" {'async/floor':>11} {'sync/floor':>10} {'PG/async':>8} {'PG/sync':>8}",
    ]
    rows: list[str] = []
    notes: list[str] = []
    start = time.perf_counter()
    for op in args.ops:
        for world in worlds:
            for size in sizes:
                numel = SIZES[size]
                iters = 3 if args.quick else ITERS[numel]
                times: dict[str, list[float]] = {s: [] for s in SYSTEMS}
                failed: dict[str, str] = {}
                for _ in range(repeats):
                    for system in SYSTEMS:  # alternating: drift in the machine hits every system alike
                        if system in failed:
                            continue
                        gc.collect()
                        try:
                            times[system].append(MEASURE[system](op, world, numel, iters, device))
                        except Exception as e:  # Unavailable, or a system that failed: n/a with why
                            failed[system] = f"{type(e).__name__}: {e}".splitlines()[0][:200]
                        if device.type == "cuda":
                            torch.cuda.empty_cache()
                med = {s: (statistics.median(v) if v and s not in failed else None) for s, v in times.items()}
                for s, why in failed.items():
                    notes.append(f"{op} W={world} {size}: {s} n/a ({why})")
                rows.append(
                    f"{op:<11} {world:>2} {size:>6} {iters:>5} "
                    + " ".join(f"{_cell(med[s]):>16}" for s in SYSTEMS)
                    + f" {_ratio(med['aiocoll async'], med['floor']):>11}"
                    + f" {_ratio(med['aiocoll sync'], med['floor']):>10}"
                    + f" {_ratio(med['threaded PG'], med['aiocoll async']):>8}"
                    + f" {_ratio(med['threaded PG'], med['aiocoll sync']):>8}"
                )
                print(rows[-1], file=sys.stderr, flush=True)
    print_report(header + rows, [("systems that could not run:", notes)])
    print(f"\ntotal time {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
