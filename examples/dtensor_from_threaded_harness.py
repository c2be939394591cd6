"""DTensor code written for torch's threaded test harness, run on aiocoll unchanged.

The rank function below is ordinary torch.distributed code: a plain ``def`` that uses
``dist.*``, builds a 2 x 2 ``DeviceMesh`` ("dp" x "tp"), shards two matrices over it with
``distribute_tensor``, multiplies them, ``redistribute``s the product and checks its
``full_tensor()`` against the same product computed locally. Under torch's threaded
harness it is started by a decorator; under aiocoll by ``spawn``. That line is all that
changes::

    # before: torch's threaded harness
    @spawn_threads_and_init_comms(world_size=4)
    def sharded_matmul(self) -> ...:
        ...

    # after: aiocoll (same body, line for line)
    def sharded_matmul(comm) -> ...:
        ...

    aiocoll.spawn(sharded_matmul, world=4)

As there, each rank runs in its own thread with torch.distributed initialised for it; on
aiocoll their collectives meet on one engine, which reports a mismatch or a deadlock at
once instead of hanging. ``spawn`` also returns what each rank returned.

Run: python examples/dtensor_from_threaded_harness.py
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import aiocoll


def sharded_matmul(comm: object) -> tuple[list[int], list[int]]:
    """One rank: returns its mesh coordinate and the shape of its block of x @ w."""
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    i, j = rank // 2, rank % 2
    coord = mesh.get_coordinate()  # this rank's place in the mesh
    assert coord is not None
    assert list(coord) == [i, j]

    gen = torch.Generator().manual_seed(0)  # the same full tensors on every rank
    x = torch.randn(8, 6, generator=gen)
    w = torch.randn(6, 4, generator=gen)

    # rows of x split over "dp", columns of w over "tp"
    dx = distribute_tensor(x, mesh, [Shard(0), Replicate()])
    dw = distribute_tensor(w, mesh, [Replicate(), Shard(1)])
    assert dx.to_local().shape == (4, 6)
    assert dw.to_local().shape == (6, 2)

    y = x @ w  # the reference, computed locally
    dy = dx @ dw  # local matmuls, no communication: each rank holds one 4 x 2 block
    assert isinstance(dy, DTensor)
    assert tuple(dy.placements) == (Shard(0), Shard(1))
    torch.testing.assert_close(dy.to_local(), y[4 * i : 4 * i + 4, 2 * j : 2 * j + 2])

    rows = dy.redistribute(mesh, [Shard(0), Replicate()])  # all-gather along "tp"
    torch.testing.assert_close(rows.to_local(), y[4 * i : 4 * i + 4])

    torch.testing.assert_close(dy.full_tensor(), y)  # all-gather along both
    return list(coord), list(dy.to_local().shape)


def main() -> None:
    results = aiocoll.spawn(sharded_matmul, world=4)
    assert results == [([0, 0], [4, 2]), ([0, 1], [4, 2]), ([1, 0], [4, 2]), ([1, 1], [4, 2])], results
    for rank, (coord, shape) in enumerate(results):
        print(f"rank {rank}: mesh coordinate {coord}, local block of x @ w {shape}; full_tensor() == x @ w")


if __name__ == "__main__":
    main()
