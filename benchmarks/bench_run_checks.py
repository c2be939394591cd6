"""The cost of ``aiocoll run``'s checks in processes: checked groups against plain gloo.

Runs this script as the ranks of ``aiocoll run --processes`` (every group the script makes
is checked: each collective first all-gathers a fingerprint on a side group) and of
``aiocoll run --processes --no-checks`` (the groups torch makes: plain gloo, as under
torchrun), alternating, ``--rounds`` times. Each rank measures, after a warm-up:

- µs per blocking ``dist.all_reduce`` of 1, 16 Ki and 1 Mi float32 elements;
- µs per ``dist.broadcast`` of 16 Ki elements;
- ms per DDP training step (forward, backward with its gradient all-reduces, SGD step) of
  a 3-layer MLP, 1.1 M parameters.

Rank 0 prints its numbers as one JSON line; this script prints the medians over rounds
and the ratios checked / plain::

    python benchmarks/bench_run_checks.py [--world N] [--iters N] [--rounds R] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

_MARK = "BENCH_RUN_CHECKS "
SIZES = (1, 16 * 1024, 1024 * 1024)


def _rank_main(iters: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out: dict[str, float] = {}

    def timed(name: str, fn: object, n: int, scale: float = 1e6) -> None:
        assert callable(fn)
        for _ in range(max(2, n // 10)):  # warm-up
            fn()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        out[name] = (time.perf_counter() - t0) / n * scale

    for numel in SIZES:
        t = torch.ones(numel)
        timed(f"all_reduce {numel}", lambda t=t: dist.all_reduce(t), iters if numel < 1e6 else max(5, iters // 20))
    b = torch.ones(16 * 1024)
    timed("broadcast 16384", lambda: dist.broadcast(b, src=0), iters)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(512, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 512),
        torch.nn.ReLU(),
        torch.nn.Linear(512, 64),
    )
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    x = torch.randn(32, 512)

    def step() -> None:
        opt.zero_grad()
        ddp(x).pow(2).mean().backward()
        opt.step()

    timed("ddp step", step, max(5, iters // 20), scale=1e3)
    if rank == 0:
        print(_MARK + json.dumps(out), flush=True)
    dist.destroy_process_group()


def _one_run(world: int, iters: int, checks: bool) -> dict[str, float]:
    cmd = [sys.executable, "-m", "aiocoll", "run", "--processes", "--nproc-per-node", str(world)]
    if not checks:
        cmd.append("--no-checks")
    cmd += [str(Path(__file__).resolve()), "--worker", "--iters", str(iters)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    for line in proc.stdout.splitlines():
        if line.startswith(_MARK):
            result: dict[str, float] = json.loads(line[len(_MARK) :])
            return result
    raise RuntimeError(f"no result from {' '.join(cmd)} (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--iters", type=int, default=400)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="a few iterations, one round (a smoke test)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        _rank_main(args.iters)
        return
    if args.quick:
        args.iters, args.rounds = 40, 1
    runs: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    for _ in range(args.rounds):
        for checks in (False, True):  # alternating, in one run
            runs[checks].append(_one_run(args.world, args.iters, checks))
    names = list(runs[True][0])
    print(f"aiocoll run --processes, {args.world} ranks, gloo on this host, {args.rounds} rounds (medians)")
    print(f"torch {_torch_version()}, {os.cpu_count()} CPUs")
    print()
    print("| op | plain gloo (--no-checks) | checked | checked / plain |")
    print("| --- | ---: | ---: | ---: |")
    for name in names:
        unit = "ms" if name == "ddp step" else "µs"
        plain = statistics.median(r[name] for r in runs[False])
        checked = statistics.median(r[name] for r in runs[True])
        print(f"| {name} | {plain:.1f} {unit} | {checked:.1f} {unit} | {checked / plain:.2f}x |")


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


if __name__ == "__main__":
    main()
