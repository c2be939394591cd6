"""The cost of aiocoll's cross-process checks: ``from_process_group(check=True)`` vs ``check=False``.

Starts N gloo processes on 127.0.0.1 (this script, re-run per rank). Each measures, in
the same run and in alternating rounds, µs per 1-element float32 ``all_reduce``:

- ``blocking``: ``dist.all_reduce(t)``, torch's plain blocking call (the reference);
- ``check off``: ``await comm.all_reduce(t)``, ``comm = from_process_group(pg, check=False)``;
- ``check on``: the same with ``check=True`` (the default): every collective first
  all-gathers a 3-int64 fingerprint on a gloo side group, then is issued;
- ``check on, 8 in flight``: 8 all_reduces issued back to back, then awaited (the
  checks of later ops overlap the earlier ops).

The checked and unchecked Comms run on two groups of the same ranks (a group's checks
are on or off for all its Comms). Rank 0 prints the medians over rounds and the ratios::

    python benchmarks/bench_checks.py [--world N] [--iters N] [--rounds R] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import aiocoll


def _rank_main(rank: int, world: int, init: str, iters: int, rounds: int, numel: int) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=init, timeout=timedelta(seconds=60))
    t = torch.ones(numel)
    other = dist.new_group(list(range(world)))
    off = aiocoll.from_process_group(check=False)
    on = aiocoll.from_process_group(other, check=True)

    def blocking() -> float:
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(t)
        return (time.perf_counter() - t0) / iters * 1e6

    async def one_by_one(comm: aiocoll.Comm) -> float:
        t0 = time.perf_counter()
        for _ in range(iters):
            await comm.all_reduce(t)
        return (time.perf_counter() - t0) / iters * 1e6

    async def in_flight(comm: aiocoll.Comm, depth: int = 8) -> float:
        ts = [torch.ones(numel) for _ in range(depth)]
        t0 = time.perf_counter()
        for _ in range(iters // depth):
            works = [comm.all_reduce(x) for x in ts]
            for w in works:
                await w
        return (time.perf_counter() - t0) / (iters // depth * depth) * 1e6

    paths = {
        "check off": lambda: one_by_one(off),
        "check on": lambda: one_by_one(on),
        "check off, 8 in flight": lambda: in_flight(off),
        "check on, 8 in flight": lambda: in_flight(on),
    }
    times: dict[str, list[float]] = {"blocking": [], **{name: [] for name in paths}}
    with asyncio.Runner() as runner:
        for _ in range(max(10, iters // 10)):  # warm up every path (and make the side group)
            dist.all_reduce(t)
        for fn in paths.values():
            runner.run(fn())
        for _ in range(rounds):  # alternate, so that noise hits every path alike
            dist.barrier()
            times["blocking"].append(blocking())
            for name, fn in paths.items():
                dist.barrier()
                times[name].append(runner.run(fn()))
    dist.barrier()
    if rank == 0:
        med = {name: statistics.median(ts) for name, ts in times.items()}
        print(f"gloo, {world} processes on 127.0.0.1, {numel}-element float32 all_reduce, median of {rounds} rounds")
        print(f"{'path':>24} {'iters':>7} {'us per op':>10} {'vs blocking':>12} {'vs check off':>13}")
        for name, us in med.items():
            base = med["check off, 8 in flight"] if "in flight" in name else med["check off"]
            label = "dist.all_reduce(t)" if name == "blocking" else name
            print(f"{label:>24} {iters:>7} {us:>10.1f} {us / med['blocking']:>11.2f}x {us / base:>12.2f}x")
        extra = med["check on"] - med["check off"]
        extra8 = med["check on, 8 in flight"] - med["check off, 8 in flight"]
        print(f"the check costs {extra:.1f} us per op one by one, {extra8:.1f} us with 8 in flight")
    sys.stdout.flush()
    os._exit(0)  # gloo groups torn down by the exit


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=2, help="gloo processes")
    p.add_argument("--iters", type=int, default=1000, help="all_reduces per round and path")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds; medians are printed")
    p.add_argument("--numel", type=int, default=1, help="elements of the float32 tensor all-reduced")
    p.add_argument("--quick", action="store_true", help="a smoke run: 16 iterations, 2 rounds")
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--init", help=argparse.SUPPRESS)
    args = p.parse_args()
    iters, rounds = (16, 2) if args.quick else (args.iters, args.rounds)
    if args.rank is not None:
        _rank_main(args.rank, args.world, args.init, iters, rounds, args.numel)
        return
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for _, name in socket.if_nameindex():
        if name in ("lo", "lo0"):
            env.setdefault("GLOO_SOCKET_IFNAME", name)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        init = (Path(tmp) / "store").as_uri()
        cmd = [sys.executable, __file__, "--world", str(args.world), "--iters", str(iters), "--rounds", str(rounds)]
        cmd += ["--numel", str(args.numel)]
        procs = [subprocess.Popen([*cmd, "--init", init, "--rank", str(r)], env=env) for r in range(args.world)]
        codes = [proc.wait(timeout=600) for proc in procs]
    if any(codes):
        sys.exit(f"a rank failed: exit codes {codes}")
    print(f"total time {time.perf_counter() - t0:.1f}s")


if __name__ == "__main__":
    main()
