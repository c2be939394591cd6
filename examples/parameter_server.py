"""A parameter server over point-to-point send/recv, applying updates as they arrive.

Rank 0 holds the weights of a linear regression; ranks 1-3 are workers, each with its
own shard of data and its own speed. A worker repeatedly receives the current weights,
computes the gradient on its shard and sends it back. The server takes the gradients
with ``recv(t)`` and no ``src``, which matches whichever worker sent first and returns
its rank, applies each one at once (asynchronous SGD: a gradient may be a step or two
stale) and sends that worker fresh weights. At the end the server broadcasts the final
weights, and every rank checks that they recovered the true ones.

Run: python examples/parameter_server.py
"""

from __future__ import annotations

import asyncio
import functools
from collections import Counter

import torch

import aiocoll

WORLD = 4  # rank 0 is the server, the others are workers
ROUNDS = 25  # gradients each worker sends
DIM = 5
LR = 0.3
TRUE_W = torch.linspace(-1.0, 1.0, DIM)


def shard(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A worker's data: 64 noisy samples of y = x @ TRUE_W, drawn from its own stream."""
    gen = aiocoll.rank_generator(seed=7)
    x = torch.randn(64, DIM, generator=gen)
    return x, x @ TRUE_W + 0.01 * torch.randn(64, generator=gen)


async def server(comm: aiocoll.Comm, order: list[int]) -> torch.Tensor:
    w = torch.zeros(DIM)
    sends = [comm.send(w.clone(), dst) for dst in range(1, comm.world_size)]  # everyone starts from w
    left = dict.fromkeys(range(1, comm.world_size), ROUNDS)
    grad = torch.empty(DIM)
    while any(left.values()):
        src = await comm.recv(grad)  # from whichever worker is first
        order.append(src)
        w -= LR * grad
        left[src] -= 1
        if left[src]:
            # a copy: w keeps changing before the worker gets around to receiving it
            sends.append(comm.send(w.clone(), src))
    for s in sends:
        await s
    return w


async def worker(comm: aiocoll.Comm) -> None:
    x, y = shard(comm.rank)
    w = torch.empty(DIM)
    for _ in range(ROUNDS):
        await comm.recv(w, src=0)
        await asyncio.sleep(0.001 * comm.rank)  # workers differ in speed
        grad = 2 / len(x) * x.T @ (x @ w - y)  # of the mean squared error
        await comm.send(grad, dst=0)


async def rank_main(comm: aiocoll.Comm, order: list[int]) -> list[float]:
    w = await server(comm, order) if comm.rank == 0 else torch.empty(DIM)
    if comm.rank != 0:
        await worker(comm)
    await comm.broadcast(w, src=0)  # the final weights, to every rank
    return w.tolist()


def main() -> None:
    order: list[int] = []
    results = aiocoll.spawn(functools.partial(rank_main, order=order), world=WORLD)

    assert all(r == results[0] for r in results)  # every rank has the server's weights
    w = torch.tensor(results[0])
    err = (w - TRUE_W).abs().max().item()
    assert err < 0.02, f"did not converge: {w} vs {TRUE_W}"
    counts = Counter(order)
    assert counts == dict.fromkeys(range(1, WORLD), ROUNDS), counts
    assert order != sorted(order)  # updates were applied as they came, interleaved
    print(f"server applied {len(order)} updates from workers {dict(sorted(counts.items()))}")
    print("first arrivals: " + " ".join(map(str, order[:15])) + " ...")
    print(f"max |w - w_true| = {err:.4f}")


if __name__ == "__main__":
    main()
