"""One gloo rank of ``bench_suite.py``: ``python _gloo_worker.py RANK WORLD INIT_METHOD OUT SPEC``.

It imports only torch (what a real gloo job pays for), joins the process group over a store on 127.0.0.1,
passes one barrier and writes, as JSON to ``OUT``: the wall-clock time (``time.time()``, comparable across
processes) at which it was past that barrier, and for every operation of ``SPEC`` (a JSON list of
``{"op": "all_reduce"|"all_gather_into_tensor", "numel": N, "warmup": N, "iters": N}``) the seconds per
operation of its own timed loop, after a checked first call and the warm-up.
"""

from __future__ import annotations

import json
import sys
import time
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

TIMEOUT = timedelta(seconds=300)


def run_op(rank: int, world: int, op: str, numel: int, warmup: int, iters: int) -> float:
    """Seconds per operation over ``iters`` timed calls, after a checked first call and ``warmup`` more."""
    if op == "all_reduce":
        t = torch.ones(numel)
        dist.all_reduce(t)
        if t[0].item() != world:
            raise AssertionError(f"rank {rank}: all_reduce gave {t[0].item()}, expected {world}")

        def call() -> None:
            dist.all_reduce(t)

    elif op == "all_gather_into_tensor":
        # torch 2.13 deprecates the name (for all_gather_single); the suite measures it under this one
        warnings.filterwarnings("ignore", message="`torch.distributed.all_gather_into_tensor`", category=FutureWarning)
        inp = torch.full((numel,), float(rank))
        out = torch.empty(numel * world)
        dist.all_gather_into_tensor(out, inp)
        if out[numel * (world - 1)].item() != world - 1:
            raise AssertionError(f"rank {rank}: all_gather_into_tensor gave wrong data")

        def call() -> None:
            dist.all_gather_into_tensor(out, inp)

    else:
        raise ValueError(f"unknown op {op!r}")
    for _ in range(warmup):
        call()
    start = time.perf_counter()
    for _ in range(iters):
        call()
    return (time.perf_counter() - start) / iters


def main(argv: list[str]) -> None:
    rank, world, init_method, out, spec = int(argv[0]), int(argv[1]), argv[2], argv[3], json.loads(argv[4])
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=init_method, timeout=TIMEOUT)
    try:
        dist.barrier()
        past_barrier = time.time()
        seconds = [run_op(rank, world, s["op"], s["numel"], s["warmup"], s["iters"]) for s in spec]
    finally:
        dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump({"past_barrier": past_barrier, "seconds_per_op": seconds}, f)


if __name__ == "__main__":
    main(sys.argv[1:])
