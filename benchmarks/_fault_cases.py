"""The rank code of the fault campaign (``fault_campaign.py``): torch's C++ consumers, each with a fault.

Every rank runs ``run()`` with torch.distributed initialised (by ``aiocoll.spawn``, ``aiocoll
run``, the pytest plugin, the process-harness drop-in, or torchrun for reference). The
environment says what runs and what goes wrong:

- ``FC_CONSUMER``: one of ``CONSUMERS`` (DDP three ways, FSDP2, tensor parallelism,
  functional collectives, DTensor redistribution, pipelining, a DCP save in the background);
- ``FC_FAULT``: what rank 1 does: ``raise`` an error, ``exit`` (``sys.exit(3)``), or
  ``mismatch`` (a broadcast where the others call something else, so that they are left
  behind by it);
- ``FC_STEP``: when: ``first`` (step 0, before any collective of the step), ``later``
  (step 2: DDP has rebuilt its buckets, DCP has a save under way), ``backward`` (inside
  step 1's backward pass, between two layers: some gradients' collectives already issued),
  ``optimizer`` (in step 1's optimizer step);
- ``FC_DIR``: a directory the ranks share (DCP's checkpoints).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

FAILING_RANK = 1
STEPS = 4


def _config() -> tuple[str, str, str]:
    return os.environ["FC_CONSUMER"], os.environ["FC_FAULT"], os.environ["FC_STEP"]


def fault(point: str, step: int, group: Any = None) -> None:
    """Rank 1's fault, if ``point`` is the campaign's (a mismatch: on ``group``, the consumer's)."""
    _, what, when = _config()
    if dist.get_rank() != FAILING_RANK or point != when:
        return
    if what == "raise":
        raise RuntimeError(f"rank {FAILING_RANK} fails on purpose ({when}, step {step})")
    if what == "exit":
        sys.exit(3)
    if what == "mismatch":
        # the others call their step's collective: they are left behind by this one
        dist.broadcast(torch.zeros(3), src=0, group=group)
        return
    raise ValueError(f"FC_FAULT={what!r}")


def at(step: int, group: Any = None) -> None:
    """The faults between steps."""
    if step == 0:
        fault("first", step, group)
    elif step == 2:
        fault("later", step, group)


class _FaultFn(torch.autograd.Function):
    """Identity; its backward is where the ``backward`` fault strikes, mid-way through the pass."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, step: int) -> torch.Tensor:
        ctx.step = step
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        if ctx.step == 1:
            fault("backward", ctx.step)
        return grad, None


class FaultLayer(nn.Module):
    """A layer that does nothing but carry the ``backward`` fault."""

    def __init__(self) -> None:
        super().__init__()
        self.step = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = _FaultFn.apply(x, self.step)
        return out


def mlp(width: int = 24) -> nn.Sequential:
    torch.manual_seed(0)  # the same model on every rank
    return nn.Sequential(nn.Linear(16, width), FaultLayer(), nn.ReLU(), nn.Linear(width, 4))


class Training:
    """A rank's steps: the faults between them and in the backward pass, and an optimizer whose step 1 carries one."""

    def __init__(self, params: Any, fault_layer: FaultLayer) -> None:
        self.step = 0
        self.fault_layer = fault_layer
        self.opt = torch.optim.SGD(params, lr=0.01)
        self.opt.register_step_pre_hook(self._pre_step)

    def _pre_step(self, *_: object) -> None:
        if self.step == 1:
            fault("optimizer", self.step)

    def steps(self) -> Iterator[int]:
        for step in range(STEPS):
            self.step = self.fault_layer.step = step
            at(step)
            yield step
            self.opt.step()
            self.opt.zero_grad()


def train(model: nn.Module, fault_layer: FaultLayer, params: Any, replicated: bool = False) -> None:
    """``STEPS`` steps of SGD, with the faults between steps, in the backward pass and in the optimizer step."""
    for step in Training(params, fault_layer).steps():
        gen = torch.Generator().manual_seed(step if replicated else step * 100 + dist.get_rank())
        model(torch.randn(8, 16, generator=gen)).sum().backward()


def ddp(**kwargs: Any) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = mlp()
    wrapped = DDP(model, **kwargs)
    train(wrapped, model[1], wrapped.parameters())


def ddp_fp16_hook() -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = mlp()
    wrapped = DDP(model)
    wrapped.register_comm_hook(None, default_hooks.fp16_compress_hook)
    train(wrapped, model[1], wrapped.parameters())


def fsdp2() -> None:
    from torch.distributed.fsdp import fully_shard

    model = mlp()
    fully_shard(model[0])
    fully_shard(model[3])
    fully_shard(model)
    train(model, model[1], model.parameters())


def _mesh() -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),))


def tensor_parallel() -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = mlp(width=6 * dist.get_world_size())
    parallelize_module(model, _mesh(), {"0": ColwiseParallel(), "3": RowwiseParallel()})
    train(model, model[1], model.parameters(), replicated=True)  # TP's input is the same on every rank


def functional_collectives() -> None:
    import torch.distributed._functional_collectives as funcol

    for step in range(STEPS):
        at(step)
        t = torch.full((8,), float(dist.get_rank()))
        out = funcol.wait_tensor(funcol.all_reduce(t, "sum", dist.group.WORLD))
        gathered = funcol.all_gather_tensor(out, 0, dist.group.WORLD)
        assert float(gathered.sum()) == 8 * dist.get_world_size() * sum(range(dist.get_world_size()))


def dtensor_redistribute() -> None:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = _mesh()
    n = dist.get_world_size()
    for step in range(STEPS):
        at(step)
        dt = distribute_tensor(torch.arange(4.0 * n * n).reshape(2 * n, 2 * n) * (step + 1), mesh, [Shard(0)])
        full = dt.redistribute(mesh, [Replicate()]).to_local()
        cols = dt.redistribute(mesh, [Shard(1)]).full_tensor()
        assert torch.equal(full, cols)


def pipelining() -> None:
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    fault_layer = FaultLayer()
    stage_module = nn.Sequential(nn.Linear(16, 16), fault_layer)
    stage = PipelineStage(stage_module, rank, size, torch.device("cpu"))
    # (torch 2.10 wants a microbatch per stage at least)
    schedule = ScheduleGPipe(stage, n_microbatches=size, loss_fn=lambda out, target: (out - target).pow(2).sum())
    for step in Training(stage_module.parameters(), fault_layer).steps():
        if rank == 0:
            schedule.step(torch.randn(2 * size, 16, generator=torch.Generator().manual_seed(step)))
        elif rank == size - 1:
            schedule.step(target=torch.zeros(2 * size, 16), losses=[])
        else:
            schedule.step()


def dcp_async_save() -> None:
    """A checkpoint saved in the background while the rank goes on, as ``dcp.async_save`` does it.

    ``dcp.save`` on a pool thread, on a group of its own; the rank waits in
    ``Future.result()``. (``async_save`` itself refuses groups that register no C++ backend,
    aiocoll's and torch's threaded one: see the command-line guide.)
    """
    from concurrent.futures import ThreadPoolExecutor

    import torch.distributed.checkpoint as dcp

    model = mlp()
    group = dist.new_group()  # the default backend: the launcher's
    with ThreadPoolExecutor(1) as pool:
        for step in range(STEPS):
            where = os.path.join(os.environ["FC_DIR"], str(step))
            saving = pool.submit(dcp.save, {"model": model.state_dict()}, checkpoint_id=where, process_group=group)
            # while the save goes on in the background, its collectives to come (a mismatch
            # meets them: on the default group, the others would wait in result() for ever,
            # as processes would, and aiocoll would report it at the world's timeout only)
            at(step, group)
            saving.result()


CONSUMERS: dict[str, Callable[[], None]] = {
    "ddp": ddp,
    "ddp_fp16_hook": ddp_fp16_hook,
    "ddp_small_buckets": lambda: ddp(bucket_cap_mb=0.0005),  # a bucket per parameter or so
    "fsdp2": fsdp2,
    "tensor_parallel": tensor_parallel,
    "functional_collectives": functional_collectives,
    "dtensor_redistribute": dtensor_redistribute,
    "pipelining": pipelining,
    "dcp_async_save": dcp_async_save,
}

# where each consumer can fail: the steps it has
TRAINING = ("first", "later", "backward", "optimizer")
STEPS_OF: dict[str, tuple[str, ...]] = {
    "ddp": TRAINING,
    "ddp_fp16_hook": TRAINING,
    "ddp_small_buckets": TRAINING,
    "fsdp2": TRAINING,
    "tensor_parallel": TRAINING,
    "functional_collectives": ("first", "later"),
    "dtensor_redistribute": ("first", "later"),
    "pipelining": TRAINING,
    "dcp_async_save": ("first", "later"),
}


def run() -> None:
    """This rank's part of the case the environment names."""
    consumer, _, _ = _config()
    CONSUMERS[consumer]()
