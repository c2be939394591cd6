"""A deliberately broken training loop, and the report aiocoll gives for it.

Run: python examples/broken_training.py

The bug is a classic: a rank skips a collective on a data-dependent condition (here, rank 2
skips the gradient all_reduce when its batch is empty), so from then on it is one call
behind the others. With real process groups this hangs until a timeout, or silently
reduces the wrong tensors together. aiocoll stops at the first divergent call and reports
what every rank called there, where, and (from the flight recorder) the calls before it,
aligned by sequence number, so the diverging rank stands out.
"""

from __future__ import annotations

import traceback

import torch

import aiocoll


async def train(comm: aiocoll.Comm) -> None:
    weights = torch.zeros(4)
    for step in range(6):
        batch = torch.full((3 if not (comm.rank == 2 and step == 3) else 0, 4), float(step))
        grad = batch.sum(0)
        if batch.numel():  # the bug: an empty batch skips the all_reduce on that rank only
            await comm.all_reduce(grad, op=torch.distributed.ReduceOp.AVG)
        weights -= 0.1 * grad
        if step % 2 == 1:
            await comm.barrier()  # end of an "epoch"


def main() -> str:
    try:
        aiocoll.spawn(train, world=4)
    except aiocoll.CollectiveMismatchError as e:
        report = "".join(traceback.format_exception_only(e))
        print(report)
        return report
    raise AssertionError("the bug went unnoticed")


if __name__ == "__main__":
    main()
