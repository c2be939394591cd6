"""A torchrun script: DDP training with a DataLoader (2 worker processes per rank) and a checkpoint.

    aiocoll run --nproc-per-node 4 examples/ddp_train.py     # every rank in this process
    torchrun --nproc-per-node 4 examples/ddp_train.py        # the same, one process per rank

Nothing in it knows about aiocoll. Run plainly (``python examples/ddp_train.py``) it starts
itself under ``aiocoll run`` with 4 ranks.
"""

import os
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def main(checkpoint_dir: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same data and initial weights on every rank
    x = torch.randn(256, 8)
    y = x @ torch.arange(1.0, 9.0) + 0.5
    data = TensorDataset(x, y)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=16, sampler=sampler, num_workers=2)
    model = DDP(nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(xb).squeeze(1), yb)
            loss.backward()
            opt.step()
    path = os.path.join(checkpoint_dir, "model.pt")
    if rank == 0:
        os.makedirs(checkpoint_dir, exist_ok=True)
        torch.save(model.module.state_dict(), path)
    dist.barrier()  # the checkpoint is written before anyone reads it
    restored = nn.Linear(8, 1)
    restored.load_state_dict(torch.load(path))
    same = all(torch.equal(a, b) for a, b in zip(restored.parameters(), model.module.parameters(), strict=True))
    total = torch.tensor([loss.item()])
    dist.all_reduce(total)
    if rank == 0:
        print(f"world {world}: mean last loss {total.item() / world:.4f}, checkpoint restored: {same}")
    dist.destroy_process_group()


if __name__ == "__main__":
    if "RANK" not in os.environ:  # run plainly: start it the way it is meant to run
        cmd = [sys.executable, "-m", "aiocoll", "run", "--nproc-per-node", "4", __file__, *sys.argv[1:]]
        sys.exit(subprocess.call(cmd))
    main(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("CHECKPOINT_DIR", tempfile.gettempdir()))
