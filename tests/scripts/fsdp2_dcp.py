"""A torchrun script: FSDP2 (fully_shard) training, saved and restored with distributed checkpoint."""

import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def model() -> nn.Module:
    torch.manual_seed(0)
    # (a CPU script: fully_shard's default mesh is on the accelerator where there is one)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    m = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    for layer in m:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(m, mesh=mesh)


def main(ckpt: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    m = model()
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    torch.manual_seed(1 + rank)
    for _ in range(5):
        opt.zero_grad()
        loss = m(torch.randn(8, 16)).pow(2).mean()
        loss.backward()
        opt.step()
    dcp.save(get_model_state_dict(m), checkpoint_id=ckpt)
    fresh = model()
    state = get_model_state_dict(fresh)
    dcp.load(state, checkpoint_id=ckpt)
    set_model_state_dict(fresh, state)
    pairs = zip(m.parameters(), fresh.parameters(), strict=True)
    same = all(torch.equal(a.full_tensor(), b.full_tensor()) for a, b in pairs)
    norm = sum(p.full_tensor().norm() ** 2 for p in m.parameters()) ** 0.5
    if rank == 0:
        print(f"world {dist.get_world_size()}: weight norm {norm.item():.5f}, restored from checkpoint: {same}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
