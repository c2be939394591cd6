"""On a real GPU: W ranks on one device, every op on real streams, results equal to the CPU's.

Each rank's inputs are produced by slow kernels on its current stream (a chain of large
matrix products whose result is folded into the input as ``+ 0``), so an op that read its
inputs before their producers finished would see the wrong values. The same programs run
with CPU tensors give the reference; inputs are small integers, so every reduction is
exact in any order and results are compared exactly.

Also: DDP, DTensor on a ``cuda`` DeviceMesh and FSDP2 on sync ranks against their CPU run,
per-rank CUDA generators across turns, the loop ticking while a 256 MB all_reduce is in
flight, and ``dist.all_reduce`` returning before its producer kernel has finished.

Every test here needs a CUDA device and is skipped without one; the orchestration itself is
tested on any machine through fakes in ``test_cuda.py``.
"""

from __future__ import annotations

import asyncio
import functools
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import aiocoll

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

W = 4
R = dist.ReduceOp
# GPU cycles torch.cuda._sleep spins: about 50 ms at 2 GHz, long against an op's launch
SPIN = 100_000_000


def _slow_zero(device: torch.device, n: int = 2048, k: int = 6) -> torch.Tensor:
    """A scalar 0 that the current stream computes slowly: ``k`` products of n x n matrices."""
    if device.type == "cpu":
        return torch.zeros((), device=device)
    a = torch.ones(n, n, device=device) / n
    for _ in range(k):
        a = torch.tanh(a @ a)  # bounded: the sum stays finite, so times 0 is 0
    return a.sum() * 0


def _inputs(device: torch.device) -> Any:
    def make(values: torch.Tensor) -> torch.Tensor:
        return values.to(device) + _slow_zero(device).to(values.dtype)

    return make


async def async_table(comm: aiocoll.Comm, device: torch.device) -> dict[str, Any]:
    """Every collective and p2p of a ``Comm``, on ``device``; what each rank got, on the host."""
    r, w = comm.rank, comm.world_size
    make = _inputs(device)
    out: dict[str, Any] = {}

    def zeros(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.zeros(*shape, dtype=dtype, device=device)

    for name, op in (("sum", R.SUM), ("max", R.MAX), ("product", R.PRODUCT), ("avg", R.AVG)):
        t = make(torch.arange(6.0) + r)
        await comm.all_reduce(t, op)
        out[f"all_reduce/{name}"] = t
    t = make(torch.arange(5, dtype=torch.int64) * (r + 1))
    await comm.all_reduce(t)
    out["all_reduce/int64"] = t
    t = make(torch.full((3,), r + 1.0))
    await comm.reduce(t, dst=1 % w)
    out["reduce"] = t
    t = make(torch.full((4,), 10.0 * r))
    await comm.broadcast(t, src=2 % w)
    out["broadcast"] = t
    outs = [zeros(j + 1) for j in range(w)]
    await comm.all_gather(outs, make(torch.full((r + 1,), r + 0.5)))
    out["all_gather"] = outs
    g = zeros(w, 3)
    await comm.all_gather_into_tensor(g, make(torch.arange(3.0) + 10 * r))
    out["all_gather_into_tensor"] = g
    gl = [zeros(2) for _ in range(w)] if r == 3 % w else None
    await comm.gather(make(torch.full((2,), float(r))), gl, dst=3 % w)
    out["gather"] = gl
    o = zeros(3)
    await comm.scatter(o, [make(torch.full((3,), float(i * 7))) for i in range(w)] if r == 0 else None, src=0)
    out["scatter"] = o
    o = zeros(2)
    await comm.reduce_scatter(o, [make(torch.full((2,), float(r * w + i))) for i in range(w)])
    out["reduce_scatter"] = o
    o = zeros(2)
    await comm.reduce_scatter_tensor(o, make(torch.arange(2.0 * w) * (r + 1)))
    out["reduce_scatter_tensor"] = o
    ol = [zeros(2) for _ in range(w)]
    await comm.all_to_all(ol, [make(torch.full((2,), float(10 * r + i))) for i in range(w)])
    out["all_to_all"] = ol
    # uneven splits: rank r sends i + 1 elements to rank i, receives r + 1 from each
    o = zeros(w * (r + 1))
    x = make(torch.cat([torch.full((i + 1,), float(100 * r + i)) for i in range(w)]))
    await comm.all_to_all_single(o, x, output_split_sizes=[r + 1] * w, input_split_sizes=[i + 1 for i in range(w)])
    out["all_to_all_single"] = o
    if w > 1:  # a ring: each rank sends to the next, receives from the one before
        got = zeros(4)
        send = comm.send(make(torch.full((4,), float(r * r + 1))), dst=(r + 1) % w)
        recv = comm.recv(got, src=(r - 1) % w)
        await asyncio.gather(send, recv)
        out["ring"] = got
    await comm.barrier()
    return _to_host(out)


def sync_table(comm: aiocoll.Comm, device: torch.device) -> dict[str, Any]:
    """The same calls through ``torch.distributed`` on sync ranks; odd ranks on a stream of their own."""
    stream = torch.cuda.Stream(device) if device.type == "cuda" and comm.rank % 2 else None
    if stream is None:
        return _sync_table(device)
    with torch.cuda.stream(stream):
        out = _sync_table(device)
    return out


def _sync_table(device: torch.device) -> dict[str, Any]:
    r, w = dist.get_rank(), dist.get_world_size()
    make = _inputs(device)
    out: dict[str, Any] = {}

    def zeros(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.zeros(*shape, dtype=dtype, device=device)

    for name, op in (("sum", R.SUM), ("max", R.MAX), ("product", R.PRODUCT), ("avg", R.AVG)):
        t = make(torch.arange(6.0) + r)
        dist.all_reduce(t, op)
        out[f"all_reduce/{name}"] = t
    t = make(torch.arange(5, dtype=torch.int64) * (r + 1))
    dist.all_reduce(t)
    out["all_reduce/int64"] = t
    t = make(torch.full((3,), r + 1.0))
    dist.reduce(t, dst=1)
    out["reduce"] = t
    t = make(torch.full((4,), 10.0 * r))
    dist.broadcast(t, src=2)
    out["broadcast"] = t
    outs = [zeros(j + 1) for j in range(w)]
    dist.all_gather(outs, make(torch.full((r + 1,), r + 0.5)))
    out["all_gather"] = outs
    g = zeros(w, 3)
    _all_gather_single(g, make(torch.arange(3.0) + 10 * r))
    out["all_gather_into_tensor"] = g
    gl = [zeros(2) for _ in range(w)] if r == 3 else None
    dist.gather(make(torch.full((2,), float(r))), gl, dst=3)
    out["gather"] = gl
    o = zeros(3)
    dist.scatter(o, [make(torch.full((3,), float(i * 7))) for i in range(w)] if r == 0 else None, src=0)
    out["scatter"] = o
    o = zeros(2)
    dist.reduce_scatter(o, [make(torch.full((2,), float(r * w + i))) for i in range(w)])
    out["reduce_scatter"] = o
    o = zeros(2)
    _reduce_scatter_single(o, make(torch.arange(2.0 * w) * (r + 1)))
    out["reduce_scatter_tensor"] = o
    ol = [zeros(2) for _ in range(w)]
    dist.all_to_all(ol, [make(torch.full((2,), float(10 * r + i))) for i in range(w)])
    out["all_to_all"] = ol
    o = zeros(w * (r + 1))
    x = make(torch.cat([torch.full((i + 1,), float(100 * r + i)) for i in range(w)]))
    dist.all_to_all_single(o, x, output_split_sizes=[r + 1] * w, input_split_sizes=[i + 1 for i in range(w)])
    out["all_to_all_single"] = o
    got = zeros(4)
    works = dist.batch_isend_irecv(
        [
            dist.P2POp(dist.isend, make(torch.full((4,), float(r * r + 1))), (r + 1) % w),
            dist.P2POp(dist.irecv, got, (r - 1) % w),
        ]
    )
    for work in works:
        work.wait()
    out["ring"] = got
    dist.barrier()
    return _to_host(out)


def _to_host(out: dict[str, Any]) -> dict[str, Any]:
    # .cpu() runs on the caller's current stream: right only if the op ordered it (or completed)
    def host(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return v.cpu()
        if isinstance(v, list):
            return [host(x) for x in v]
        return v

    return {k: host(v) for k, v in out.items()}


def _assert_same(got: dict[str, Any], want: dict[str, Any], who: str) -> None:
    assert got.keys() == want.keys()
    for k in want:
        g, e = got[k], want[k]
        if isinstance(e, list):
            assert isinstance(g, list), f"{who} {k}"
            assert len(g) == len(e), f"{who} {k}"
            pairs = list(zip(g, e, strict=True))
        elif e is None:
            assert g is None, f"{who} {k}"
            continue
        else:
            pairs = [(g, e)]
        for a, b in pairs:
            assert a.dtype == b.dtype, f"{who} {k}"
            assert torch.equal(a, b), f"{who} {k}: {a} != {b} (CPU)"


CPU = torch.device("cpu")
CUDA = torch.device("cuda", 0)
# torch 2.13 renamed the *_tensor collectives (the old names warn)
_all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


async def _async_table_on(comm: aiocoll.Comm, device: torch.device) -> dict[str, Any]:
    return await async_table(comm, device)


@pytest.fixture(scope="module")
def reference() -> list[dict[str, Any]]:
    return aiocoll.spawn(functools.partial(_async_table_on, device=CPU), world=W, torch_distributed=False)


def test_every_op_of_async_ranks_on_slow_producers(reference: list[dict[str, Any]], loop: str) -> None:
    got = aiocoll.spawn(functools.partial(_async_table_on, device=CUDA), world=W, loop=loop)
    for r in range(W):
        _assert_same(got[r], reference[r], f"rank {r}")


def test_every_op_of_sync_ranks_on_slow_producers(reference: list[dict[str, Any]]) -> None:
    cpu = aiocoll.spawn(lambda comm: sync_table(comm, CPU), world=W)
    got = aiocoll.spawn(lambda comm: sync_table(comm, CUDA), world=W)
    for r in range(W):
        _assert_same(cpu[r], reference[r], f"rank {r} (torch.distributed on the CPU)")
        _assert_same(got[r], reference[r], f"rank {r}")


def test_sync_ranks_in_parallel_on_slow_producers(reference: list[dict[str, Any]]) -> None:
    got = aiocoll.spawn(lambda comm: sync_table(comm, CUDA), world=W, sync_ranks="parallel")
    for r in range(W):
        _assert_same(got[r], reference[r], f"rank {r}")


# -- DDP, DTensor, FSDP2 ------------------------------------------------------------------------


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x))).clone()


def parallel_program(comm: aiocoll.Comm, device: str) -> dict[str, torch.Tensor]:
    """DDP, a DTensor on a 2 x 2 mesh, TP and FSDP2 on ``device``; what each produced, on the host."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.nn.parallel import DistributedDataParallel

    if device == "cuda":
        torch.cuda.set_device(0)  # before the mesh: every rank shares the one GPU
    r = comm.rank
    out: dict[str, torch.Tensor] = {}
    # parameters and data are made on the CPU (same values whatever the device), then moved
    torch.manual_seed(0)
    model = _MLP().to(device)
    ddp = DistributedDataParallel(model)
    x = (torch.randn(8, 16) + r).to(device)
    ddp(x).square().sum().backward()
    out["ddp/grad"] = torch.cat([p.grad.flatten() for p in model.parameters()]).cpu()  # type: ignore[union-attr]

    mesh = init_device_mesh(device, (2, 2), mesh_dim_names=("dp", "tp"))
    a = distribute_tensor(torch.arange(64.0).reshape(8, 8).to(device), mesh, [Shard(0), Shard(1)])
    b = a.redistribute(mesh, [Replicate(), Shard(0)])
    out["dtensor/matmul"] = (b @ b.T).full_tensor().cpu()
    out["dtensor/partial_sum"] = a.sum(0).full_tensor().cpu()

    torch.manual_seed(1)
    model = _MLP().to(device)
    parallelize_module(model, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        x = (torch.randn(4, 16) + step).to(device)
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        out[f"fsdp/loss{step}"] = loss.detach().cpu()
    out["fsdp/params"] = torch.cat([p.full_tensor().flatten() for p in model.parameters()]).cpu()
    return out


def test_ddp_dtensor_and_fsdp2_on_a_cuda_mesh() -> None:
    cpu = aiocoll.spawn(lambda comm: parallel_program(comm, "cpu"), world=W)
    got = aiocoll.spawn(lambda comm: parallel_program(comm, "cuda"), world=W)
    for r in range(W):
        assert got[r].keys() == cpu[r].keys()
        for k, want in cpu[r].items():
            # float sums on the GPU run in another order: equal up to rounding
            torch.testing.assert_close(
                got[r][k], want, rtol=1e-5, atol=1e-5, msg=lambda m, k=k, r=r: f"rank {r} {k}: {m}"
            )
    assert all(torch.equal(got[r]["fsdp/params"], got[0]["fsdp/params"]) for r in range(W))


# -- per-rank state, the loop, no host sync -----------------------------------------------------


def test_each_rank_has_its_own_cuda_generator() -> None:
    def worker(comm: aiocoll.Comm) -> list[torch.Tensor]:
        torch.manual_seed(comm.rank)
        draws = []
        for _ in range(3):
            draws.append(torch.randn(4, device="cuda").cpu())
            dist.barrier()  # the other ranks take their turns (and draw) in between
        return draws

    got = aiocoll.spawn(worker, world=W)
    for r in range(W):
        with torch.random.fork_rng(devices=[0]):
            torch.manual_seed(r)  # as a process of its own would draw
            want = [torch.randn(4, device="cuda").cpu() for _ in range(3)]
        for a, b in zip(got[r], want, strict=True):
            assert torch.equal(a, b), f"rank {r}"


def test_the_loop_ticks_while_a_256mb_all_reduce_is_in_flight(loop: str) -> None:
    n = 64 << 20  # float32: 256 MB a rank

    async def worker(comm: aiocoll.Comm) -> tuple[int, float, float, float]:
        t = torch.full((n,), float(comm.rank + 1), device=CUDA)
        torch.cuda._sleep(2 * SPIN)  # type: ignore[no-untyped-call]  # the op waits ~100 ms for it
        t.add_(0.0)
        ticks, gap, last = 0, 0.0, time.perf_counter()
        w = comm.all_reduce(t)

        async def ticker() -> None:
            nonlocal ticks, gap, last
            while not w.done():
                await asyncio.sleep(0.001)
                now = time.perf_counter()
                ticks, gap, last = ticks + 1, max(gap, now - last), now

        start = time.perf_counter()
        await asyncio.gather(w, ticker())
        took = time.perf_counter() - start
        head = t[:2].cpu()
        return ticks, gap, took, float(head.sum())

    for ticks, gap, took, head in aiocoll.spawn(worker, world=W, loop=loop):
        assert head == 2 * 10.0  # 1 + 2 + 3 + 4, twice
        assert took > 0.05  # the op really was in flight for a while (the spin)...
        assert ticks >= 10  # ... and the loop served the ticker meanwhile
        assert gap < 0.05, f"the loop stalled {gap * 1e3:.1f} ms"


def test_dist_all_reduce_returns_before_its_producer_has_finished() -> None:
    def worker(comm: aiocoll.Comm) -> tuple[bool, bool, list[float]]:
        t = torch.zeros(1 << 20, device=CUDA)
        torch.cuda._sleep(5 * SPIN)  # type: ignore[no-untyped-call]  # ~250 ms
        t.fill_(comm.rank + 1.0)
        dist.all_reduce(t)
        after = torch.cuda.Event()
        after.record()  # on the current stream, which must now wait for the op
        returned_early = not after.query()
        # every rank looks before any waits: ranks take turns, and a rank that synchronised
        # first would keep the others from looking until the GPU were done
        dist.barrier()
        torch.cuda.current_stream().synchronize()
        return returned_early, after.query(), t[[0, -1]].cpu().tolist()

    for early, done, values in aiocoll.spawn(worker, world=W):
        assert early  # no host sync: dist.all_reduce returned with the GPU still spinning
        assert done
        assert values == [10.0, 10.0]
