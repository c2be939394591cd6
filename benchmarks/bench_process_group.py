"""The cost of awaiting a real process group: aiocoll's async bridge vs blocking torch.distributed.

Starts 2 gloo processes on 127.0.0.1 (this script, re-run per rank). Each measures, in
the same run and in alternating rounds, µs per 1-element ``all_reduce``:

- ``blocking``: ``dist.all_reduce(t)``, torch's plain blocking call;
- ``aiocoll``: ``await comm.all_reduce(t)`` with ``comm = aiocoll.from_process_group(check=False)``
  on a running asyncio loop (issued with async_op=True, completed through a bridged future);
  the bridge alone: ``bench_checks.py`` measures what the cross-process checks add;

and rank 0 prints the medians over rounds, the overhead and the ratio::

    python benchmarks/bench_process_group.py [--iters N] [--rounds R] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
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

WORLD = 2


def _rank_main(rank: int, init: str, iters: int, rounds: int) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, init_method=init, timeout=timedelta(seconds=60))
    t = torch.ones(1)

    def blocking() -> float:
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(t)
        return (time.perf_counter() - t0) / iters * 1e6

    async def bridged(comm: aiocoll.Comm) -> float:
        t0 = time.perf_counter()
        for _ in range(iters):
            await comm.all_reduce(t)
        return (time.perf_counter() - t0) / iters * 1e6

    comm = aiocoll.from_process_group(check=False)  # binds to whichever loop runs its ops
    runners = {"asyncio": asyncio.Runner()}
    if importlib.util.find_spec("uvloop") is not None:
        import uvloop

        runners["uvloop"] = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    for _ in range(max(10, iters // 10)):  # warm up every path
        dist.all_reduce(t)
    for runner in runners.values():
        runner.run(bridged(comm))
    times: dict[str, list[float]] = {"blocking": [], **{name: [] for name in runners}}
    for _ in range(rounds):  # alternate, so that noise hits every path alike
        dist.barrier()
        times["blocking"].append(blocking())
        for name, runner in runners.items():
            dist.barrier()
            times[name].append(runner.run(bridged(comm)))
    for runner in runners.values():
        runner.close()
    dist.barrier()  # both ranks done before either tears down
    dist.destroy_process_group()
    if rank == 0:
        med = {name: statistics.median(ts) for name, ts in times.items()}
        print(f"gloo, {WORLD} processes on 127.0.0.1, 1-element float32 all_reduce, median of {rounds} rounds")
        print(f"{'path':>22} {'iters':>7} {'us per op':>10} {'overhead us':>12} {'vs blocking':>12}")
        for name, us in med.items():
            label = "dist.all_reduce(t)" if name == "blocking" else f"aiocoll on {name}"
            extra = us - med["blocking"]
            print(f"{label:>22} {iters:>7} {us:>10.1f} {extra:>12.1f} {us / med['blocking']:>11.2f}x")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--iters", type=int, default=2000, help="all_reduces per round and path")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds; medians are printed")
    p.add_argument("--quick", action="store_true", help="a smoke run: 20 iterations, 2 rounds")
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--init", help=argparse.SUPPRESS)
    args = p.parse_args()
    iters, rounds = (20, 2) if args.quick else (args.iters, args.rounds)
    if args.rank is not None:
        _rank_main(args.rank, args.init, iters, rounds)
        return
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for _, name in socket.if_nameindex():
        if name in ("lo", "lo0"):
            env.setdefault("GLOO_SOCKET_IFNAME", name)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        init = (Path(tmp) / "store").as_uri()
        cmd = [sys.executable, __file__, "--iters", str(iters), "--rounds", str(rounds), "--init", init]
        procs = [subprocess.Popen([*cmd, "--rank", str(r)], env=env) for r in range(WORLD)]
        codes = [proc.wait(timeout=600) for proc in procs]
    if any(codes):
        sys.exit(f"a rank failed: exit codes {codes}")
    print(f"total time {time.perf_counter() - t0:.1f}s")


if __name__ == "__main__":
    main()
