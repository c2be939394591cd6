"""Data-parallel training with async ranks, gradient all_reduce overlapping backward.

Four ranks train copies of one small MLP, each on its own synthetic batches. As soon as
backward has produced a parameter's gradient, a ``register_post_accumulate_grad_hook``
issues ``comm.all_reduce(p.grad, op=AVG)`` for it (the last layer's first), while backward
goes on with the earlier layers; the rank awaits all the works before the optimizer
step. The script checks that every rank ends with the same weights, bit for bit, and
that they match a single-process model trained on the full batch (the ranks' batches
concatenated).

Async ranks share one thread, so they share torch's grad mode and global RNG: each rank
draws its data from ``aiocoll.rank_generator(seed)``, and no rank holds ``torch.no_grad()``
across an ``await``.

Run: python examples/data_parallel.py
"""

from __future__ import annotations

import copy
import functools

import torch
from torch import nn
from torch.distributed import ReduceOp

import aiocoll

WORLD = 4
STEPS = 60
BATCH = 16  # per rank and step
LR = 0.1


def make_model() -> nn.Module:
    torch.manual_seed(0)  # before the ranks start: the one initial model they all copy
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))


def sgd_step(model: nn.Module) -> None:
    # plain SGD (torch.optim works too; it costs a second to import)
    with torch.no_grad():  # grad mode is shared by all ranks: no await inside
        for p in model.parameters():
            assert p.grad is not None
            p -= LR * p.grad


def target(x: torch.Tensor) -> torch.Tensor:
    return torch.sin(0.5 * x.sum(dim=1, keepdim=True) / 8**0.5)


async def train(template: nn.Module, comm: aiocoll.Comm) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    """One rank: returns its final weights, the batches it trained on, and how many
    gradient all_reduces were complete by the time its backward returned."""
    model = copy.deepcopy(template)
    gen = aiocoll.rank_generator(seed=1)  # this rank's own data stream

    pending: list[aiocoll.Work] = []

    def reduce_grad(p: torch.Tensor) -> None:
        # called by autograd the moment p.grad is final: issue its all_reduce now
        assert p.grad is not None
        pending.append(comm.all_reduce(p.grad, op=ReduceOp.AVG))

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(reduce_grad)

    batches: list[torch.Tensor] = []
    done_early = 0
    for _ in range(STEPS):
        x = torch.randn(BATCH, 8, generator=gen)
        batches.append(x)
        model.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), target(x))
        loss.backward()  # issues one all_reduce per parameter as it goes
        done_early += sum(w.done() for w in pending)
        for w in pending:
            await w
        pending.clear()
        sgd_step(model)
    return [p.detach() for p in model.parameters()], batches, done_early


def reference(template: nn.Module, batches: list[torch.Tensor]) -> tuple[list[torch.Tensor], float, float]:
    """The same training in one process, on the full batch of every step; also the mean
    loss of its first and last ten steps."""
    model = copy.deepcopy(template)
    losses = []
    for x in batches:
        model.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), target(x))
        loss.backward()
        sgd_step(model)
        losses.append(loss.item())
    return [p.detach() for p in model.parameters()], sum(losses[:10]) / 10, sum(losses[-10:]) / 10


def main() -> None:
    template = make_model()
    results = aiocoll.spawn(functools.partial(train, template), world=WORLD)

    weights = [w for w, _, _ in results]
    for rank in range(1, WORLD):
        assert all(torch.equal(a, b) for a, b in zip(weights[0], weights[rank], strict=True)), rank

    full_batches = [torch.cat([b[step] for _, b, _ in results]) for step in range(STEPS)]
    ref, first_loss, last_loss = reference(template, full_batches)
    for a, b in zip(weights[0], ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert last_loss < 0.5 * first_loss, (first_loss, last_loss)

    n_params = len(weights[0])
    early = sum(e for _, _, e in results)
    assert early > 0  # some reductions finished while a rank's backward was still running
    print(f"{WORLD} ranks x {STEPS} steps: weights identical on every rank and match the full-batch reference")
    print(f"full-batch loss {first_loss:.3f} -> {last_loss:.3f}")
    print(f"{early} of {WORLD * STEPS * n_params} gradient all_reduces were complete before their backward returned")


if __name__ == "__main__":
    main()
