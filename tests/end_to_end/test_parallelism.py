"""torch's parallelism libraries, unmodified, on sync ranks: each result checked against one process.

Tensor parallel, FSDP2 (``fully_shard``), 2-D FSDP x TP, ``torch.distributed.pipelining``
and distributed checkpoint run as written for torchrun; every rank's result must equal
what the same model computes in a single process.

The models are initialised from generators of their own, so each test checks one library
at a time (seeding torch's generator in every rank, then building the model, is checked in
``test_turns``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import aiocoll
from aiocoll import Comm

DIM = 8

# FSDP2's advice to code that modifies its outputs in place, which this code does not
pytestmark = pytest.mark.filterwarnings("ignore:FSDP2-wrapped module .* returned a view tensor:UserWarning")


def _model(seed: int = 0) -> nn.Sequential:
    model = nn.Sequential(nn.Linear(DIM, 16), nn.ReLU(), nn.Linear(16, DIM))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def _batch(n: int = 4) -> torch.Tensor:
    return torch.randn(n, DIM, generator=torch.Generator().manual_seed(1))


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _train(model: nn.Module, steps: int = 2) -> list[float]:
    """A few SGD steps on the same batch; the losses."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        loss = model(_batch()).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(_full(loss.detach())))
    return losses


def _reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _model()
    losses = _train(model)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: _full(v.detach()).clone() for k, v in model.state_dict().items()}


def _assert_matches_reference(res: list[tuple[list[float], dict[str, torch.Tensor]]]) -> None:
    losses, state = _reference()
    for rank, (got_losses, got_state) in enumerate(res):
        assert got_losses == torch.tensor(losses).tolist() or torch.allclose(
            torch.tensor(got_losses), torch.tensor(losses), rtol=1e-5, atol=1e-6
        ), (rank, got_losses, losses)
        assert got_state.keys() == state.keys()
        for k in state:
            assert torch.allclose(got_state[k], state[k], rtol=1e-5, atol=1e-6), (rank, k)
    assert losses[1] < losses[0]  # it did train


def _tp_plan() -> dict[str, Any]:
    return {"0": ColwiseParallel(), "2": RowwiseParallel()}


def test_tensor_parallel() -> None:
    def fn(comm: Comm) -> tuple[list[float], dict[str, torch.Tensor]]:
        mesh = init_device_mesh("cpu", (comm.world_size,))
        model = parallelize_module(_model(), mesh, _tp_plan())
        assert isinstance(model[0].weight, DTensor)
        return _train(model), _full_state(model)

    _assert_matches_reference(aiocoll.spawn(fn, world=2))


def test_fsdp2() -> None:
    def fn(comm: Comm) -> tuple[list[float], dict[str, torch.Tensor]]:
        mesh = init_device_mesh("cpu", (comm.world_size,))
        model = _model()
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        assert isinstance(model[0].weight, DTensor)
        return _train(model), _full_state(model)

    _assert_matches_reference(aiocoll.spawn(fn, world=4))


def test_fsdp2_with_tensor_parallel_2d() -> None:
    def fn(comm: Comm) -> tuple[list[float], dict[str, torch.Tensor]]:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        model = parallelize_module(_model(), mesh["tp"], _tp_plan())
        fully_shard(model, mesh=mesh["dp"])
        assert model[0].weight.device_mesh.ndim == 2
        return _train(model), _full_state(model)

    _assert_matches_reference(aiocoll.spawn(fn, world=4))


def test_pipelining_gpipe() -> None:
    x = _batch()

    def fn(comm: Comm) -> tuple[list[float], dict[str, torch.Tensor]]:
        rank = dist.get_rank()
        full = _model()
        part = full[:2] if rank == 0 else full[2:]  # stage 0: Linear+ReLU, stage 1: Linear
        stage = PipelineStage(part, rank, comm.world_size, torch.device("cpu"))
        losses: list[torch.Tensor] = []
        schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=lambda out, tgt: out.pow(2).mean())
        opt = torch.optim.SGD(part.parameters(), lr=0.1)
        got: list[float] = []
        for _ in range(2):
            if rank == 0:
                schedule.step(x)
            else:
                schedule.step(target=torch.zeros(4, DIM), losses=losses)
                got.append(float(torch.stack(losses).detach().mean()))
                losses.clear()
            opt.step()
            opt.zero_grad()
        return got, {k: v.detach().clone() for k, v in part.state_dict().items()}

    res = aiocoll.spawn(fn, world=2)
    # reference: the same two microbatches of 2 rows; the schedule scales the gradients
    # by 1 / n_microbatches, which is backpropagating their mean
    ref = _model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_losses = []
    for _ in range(2):
        losses = [ref(mb).pow(2).mean() for mb in x.chunk(2)]
        torch.stack(losses).mean().backward()
        opt.step()
        opt.zero_grad()
        ref_losses.append(float(torch.stack([loss.detach() for loss in losses]).mean()))
    assert torch.allclose(torch.tensor(res[1][0]), torch.tensor(ref_losses), rtol=1e-5)
    state = ref.state_dict()
    for k, v in res[0][1].items():
        assert torch.allclose(v, state[k], rtol=1e-5, atol=1e-6), k
    for k, v in res[1][1].items():
        idx, rest = k.split(".", 1)
        assert torch.allclose(v, state[f"{int(idx)}.{rest}"], rtol=1e-5, atol=1e-6), k


# torch 2.10's own checkpoint writer calls tensor.storage(), which warns
@pytest.mark.filterwarnings("ignore:TypedStorage is deprecated:UserWarning")
def test_distributed_checkpoint_round_trip(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")

    def save(comm: Comm) -> None:
        mesh = init_device_mesh("cpu", (comm.world_size,))
        model = _model(seed=3)
        fully_shard(model, mesh=mesh)
        dcp.save(get_model_state_dict(model), checkpoint_id=ckpt)

    def load(comm: Comm) -> dict[str, torch.Tensor]:
        mesh = init_device_mesh("cpu", (comm.world_size,))
        model = _model(seed=4)  # other weights: the load must replace them
        fully_shard(model, mesh=mesh)
        state = get_model_state_dict(model)
        dcp.load(state, checkpoint_id=ckpt)
        set_model_state_dict(model, state)
        return _full_state(model)

    aiocoll.spawn(save, world=4)
    assert list(Path(ckpt).iterdir())  # it wrote something
    expected = _model(seed=3).state_dict()
    for got in aiocoll.spawn(load, world=4):
        for k, v in expected.items():
            assert torch.equal(got[k], v), k
