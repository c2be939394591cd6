"""The same ``async def`` on real processes: gloo, launched with torchrun, on 127.0.0.1.

    torchrun --nproc-per-node 2 --master-addr 127.0.0.1 --master-port 29512 examples/torchrun_allreduce.py

Each process runs its own event loop; ``aiocoll.from_process_group()`` turns the default
process group into a ``Comm``, and ``work(comm)`` runs unchanged. Run without torchrun
(``python examples/torchrun_allreduce.py``), the very same ``work`` runs on 2 in-process
ranks of ``aiocoll.spawn``, and prints the same lines.

Under torchrun it then runs ``work`` once more, on a *hybrid world*: each process runs 2
in-process ranks and the 2 processes together make one world of 4, as an in-process
``aiocoll.spawn(work, world=4)`` would.
"""

from __future__ import annotations

import asyncio
import os
import sys

import torch
import torch.distributed as dist

import aiocoll


async def work(comm: aiocoll.Comm) -> str:
    t = torch.ones(3) * comm.rank
    await comm.all_reduce(t)  # while this waits, the loop serves other tasks
    names = await comm.all_gather_object(f"rank{comm.rank}")
    return f"rank {comm.rank} of {comm.world_size}: all_reduce {t.tolist()}, objects {names}"


def say(line: str) -> None:
    # one write per line: torchrun's processes share one stdout, and a line written in
    # pieces could interleave with another process's
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


async def main() -> None:
    # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT for init_process_group
    dist.init_process_group("gloo")
    try:
        say(await work(aiocoll.from_process_group()))
        # the same function on 2 processes x 2 in-process ranks: this process's 2 results
        world = dist.group.WORLD
        assert world is not None
        for line in await aiocoll.spawn_async(work, world=2 * dist.get_world_size(), process_group=world):
            say(f"hybrid {line}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    if "RANK" in os.environ:
        asyncio.run(main())
    else:
        for line in aiocoll.spawn(work, world=2):
            print(line)
