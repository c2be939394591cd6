"""Quickstart: four async ranks on one event loop, each awaiting collectives.

Run: python examples/quickstart.py
"""

from __future__ import annotations

import torch

import aiocoll


async def worker(comm: aiocoll.Comm) -> list[float]:
    t = torch.ones(3) * comm.rank
    await comm.all_reduce(t)  # in place, like torch.distributed: 0 + 1 + 2 + 3

    # collectives are issued when called: overlap them with other work
    grads = [torch.full((2,), float(comm.rank)) for _ in range(3)]
    pending = [comm.all_reduce(g, op=torch.distributed.ReduceOp.AVG) for g in grads]
    for w in pending:
        await w

    # sub-groups are group-local, as in torch
    pair = await comm.new_group([0, 1])
    if pair is not None:
        await pair.broadcast(t, src=1)
    return t.tolist() + grads[0].tolist()


def main() -> list[list[float]]:
    results = aiocoll.spawn(worker, world=4)  # a list indexed by rank
    for rank, r in enumerate(results):
        print(f"rank {rank}: {r}")
    return results


if __name__ == "__main__":
    main()
