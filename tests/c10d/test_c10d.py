"""The torch.distributed adapter: backend "aiocoll", sync ranks in threads, async ranks on the loop."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.distributed_c10d as c10d
import torch.distributed.nn.functional  # import before spawn: it captures group.WORLD as a default
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.nn.parallel import DistributedDataParallel

import aiocoll
from aiocoll import Comm

pytestmark = pytest.mark.filterwarnings("ignore:.*is deprecated.*:FutureWarning")

R = dist.ReduceOp


def test_backend_is_registered() -> None:
    assert "aiocoll" in dist.Backend.backend_list


def test_sync_ranks_collectives() -> None:
    def fn(comm: Comm) -> dict[str, Any]:
        r, w = dist.get_rank(), dist.get_world_size()
        assert (r, w) == (comm.rank, comm.world_size)
        assert dist.get_backend() == "aiocoll"
        out: dict[str, Any] = {}
        t = torch.tensor([r + 1.0])
        dist.all_reduce(t, op=R.PRODUCT)
        out["all_reduce"] = t.item()
        b = torch.tensor([float(r)])
        dist.broadcast(b, src=2)
        out["broadcast"] = b.item()
        red = torch.tensor([r])
        dist.reduce(red, dst=1, op=R.MAX)
        out["reduce"] = red.item()
        ag = [torch.zeros(2) for _ in range(w)]
        dist.all_gather(ag, torch.full((2,), float(r)))
        out["all_gather"] = [x[0].item() for x in ag]
        agt = torch.zeros(w, 2)
        dist.all_gather_into_tensor(agt, torch.full((2,), float(r)))
        out["all_gather_into_tensor"] = agt[:, 0].tolist()
        g = [torch.zeros(1) for _ in range(w)] if r == 0 else None
        dist.gather(torch.tensor([r * 10.0]), g, dst=0)
        out["gather"] = None if g is None else [x.item() for x in g]
        sc = torch.zeros(1)
        dist.scatter(sc, [torch.tensor([i * 3.0]) for i in range(w)] if r == 3 else None, src=3)
        out["scatter"] = sc.item()
        rs = torch.zeros(1)
        dist.reduce_scatter(rs, [torch.tensor([float(r * 100 + i)]) for i in range(w)])
        out["reduce_scatter"] = rs.item()
        rst = torch.zeros(1)
        dist.reduce_scatter_tensor(rst, torch.arange(w, dtype=torch.float32) + r, op=R.MIN)
        out["reduce_scatter_tensor"] = rst.item()
        a2a = [torch.zeros(1) for _ in range(w)]
        dist.all_to_all(a2a, [torch.tensor([float(r * 10 + j)]) for j in range(w)])
        out["all_to_all"] = [x.item() for x in a2a]
        # uneven: rank r sends j+1 rows to rank j
        src = torch.full((sum(j + 1 for j in range(w)),), float(r))
        dst = torch.zeros((r + 1) * w)
        dist.all_to_all_single(dst, src, [r + 1] * w, [j + 1 for j in range(w)])
        out["all_to_all_single"] = dst.tolist()
        # the split sizes as tensors, as torch's own process groups take them
        dst_t = torch.zeros((r + 1) * w)
        dist.all_to_all_single(dst_t, src, torch.tensor([r + 1] * w), torch.tensor([j + 1 for j in range(w)]))
        out["all_to_all_single/tensor_splits"] = dst_t.tolist()
        dist.barrier()
        objs: list[Any] = [None] * w
        dist.all_gather_object(objs, {"rank": r})
        out["all_gather_object"] = objs
        bl: list[Any] = [f"from {r}"]
        dist.broadcast_object_list(bl, src=1)
        out["broadcast_object_list"] = bl[0]
        return out

    res = aiocoll.spawn(fn, world=4)
    for r, out in enumerate(res):
        assert out["all_reduce"] == 24.0
        assert out["broadcast"] == 2.0
        assert out["reduce"] == (3 if r == 1 else r)
        assert out["all_gather"] == [0.0, 1.0, 2.0, 3.0]
        assert out["all_gather_into_tensor"] == [0.0, 1.0, 2.0, 3.0]
        assert out["gather"] == ([0.0, 10.0, 20.0, 30.0] if r == 0 else None)
        assert out["scatter"] == r * 3.0
        assert out["reduce_scatter"] == sum(s * 100 + r for s in range(4))
        assert out["reduce_scatter_tensor"] == float(r)  # min over s of (r + s)
        assert out["all_to_all"] == [float(s * 10 + r) for s in range(4)]
        assert out["all_to_all_single"] == [float(s) for s in range(4) for _ in range(r + 1)]
        assert out["all_to_all_single/tensor_splits"] == out["all_to_all_single"]
        assert out["all_gather_object"] == [{"rank": s} for s in range(4)]
        assert out["broadcast_object_list"] == "from 1"


def test_ranks_share_one_world_rank_map() -> None:
    # one {global: group} map for all ranks instead of one each (W^2 entries, 60 MB at W=1024)
    def fn(comm: Comm) -> tuple[int, list[int], int]:
        m = c10d._world.pg_group_ranks[c10d.GroupMember.WORLD]
        assert m == {r: r for r in range(comm.world_size)}
        return id(m), dist.get_process_group_ranks(dist.group.WORLD), dist.get_global_rank(dist.group.WORLD, comm.rank)

    for out in (aiocoll.spawn(fn, world=4), aiocoll.spawn(lambda comm: fn(comm), world=4)):
        assert len({i for i, _, _ in out}) == 1
        assert [ranks for _, ranks, _ in out] == [[0, 1, 2, 3]] * 4
        assert [g for _, _, g in out] == [0, 1, 2, 3]


def test_p2p_through_torch() -> None:
    def fn(comm: Comm) -> tuple[float, int, float]:
        r, w = dist.get_rank(), dist.get_world_size()
        got = torch.zeros(1)
        ops = [dist.P2POp(dist.isend, torch.tensor([float(r)]), (r + 1) % w), dist.P2POp(dist.irecv, got, (r - 1) % w)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        src = -1
        any_got = torch.zeros(1)
        if r == 0:
            src = dist.recv(any_got)  # from whichever rank sends
        elif r == 2:
            dist.send(torch.tensor([42.0]), dst=0)
        return got.item(), src, any_got.item()

    res = aiocoll.spawn(fn, world=3)
    assert [x[0] for x in res] == [2.0, 0.0, 1.0]
    assert res[0][1:] == (2, 42.0)


def test_subgroups() -> None:
    def fn(comm: Comm) -> tuple[float, float, str]:
        r = dist.get_rank()
        odd = dist.new_group([1, 3])
        t = torch.ones(1)
        if r in (1, 3):
            dist.all_reduce(t, group=odd)
            assert dist.get_rank(odd) == r // 2
        mine, _ = dist.new_subgroups(2)  # [0, 1] and [2, 3]
        u = torch.tensor([float(r)])
        dist.all_reduce(u, group=mine)
        return t.item(), u.item(), dist.get_backend(mine)

    res = aiocoll.spawn(fn, world=4)
    assert [x[0] for x in res] == [1.0, 2.0, 1.0, 2.0]
    assert [x[1] for x in res] == [1.0, 1.0, 5.0, 5.0]
    assert {x[2] for x in res} == {"aiocoll"}


def test_async_op_work_api() -> None:
    def fn(comm: Comm) -> tuple[bool, bool, list[float], bool, Any]:
        t = torch.tensor([float(dist.get_rank())])
        if dist.get_rank() == 1:
            time.sleep(0.2)  # a slow peer: rank 0's work is still pending when it looks
        w = dist.all_reduce(t, async_op=True)
        assert w is not None
        before = w.is_completed()
        fut = w.get_future()
        ok = w.wait(timeout=timedelta(seconds=30))
        value = fut.wait()
        return before, ok, [x.item() for x in value], w.is_completed(), w.result()[0].item()

    res = aiocoll.spawn(fn, world=2)
    assert res[0][0] is False  # rank 1 had not arrived
    for _, ok, value, done, result in res:
        assert ok is True
        assert value == [1.0]
        assert done is True
        assert result == 1.0


def test_wait_timeout_raises() -> None:
    def fn(comm: Comm) -> str:
        if dist.get_rank() == 0:
            w = dist.all_reduce(torch.ones(1), async_op=True)
            assert w is not None
            with pytest.raises(aiocoll.CollectiveTimeoutError, match="still pending"):
                w.wait(timeout=timedelta(milliseconds=50))
            comm.barrier().wait()  # let rank 1 arrive only now
            w.wait()
        else:
            comm.barrier().wait()
            dist.all_reduce(torch.ones(1))
        return "ok"

    assert aiocoll.spawn(fn, world=2) == ["ok", "ok"]


def test_errors_keep_type_and_never_return_unreduced_data() -> None:
    seen: dict[int, BaseException] = {}
    outputs: dict[int, list[float]] = {}

    def fn(comm: Comm) -> None:
        t = torch.ones(2)
        try:
            if dist.get_rank() == 1:
                dist.all_reduce(t[:1])  # shape differs from rank 0's
            else:
                dist.all_reduce(t)
        except aiocoll.CollectiveMismatchError as e:
            seen[dist.get_rank()] = e
            outputs[dist.get_rank()] = t.tolist()
            raise

    with pytest.raises(aiocoll.CollectiveMismatchError, match=r"float32\[1\]"):
        aiocoll.spawn(fn, world=2)
    assert set(seen) == {0, 1}
    assert outputs == {0: [1.0, 1.0], 1: [1.0, 1.0]}  # untouched


def test_error_through_functional_collectives() -> None:
    def fn(comm: Comm) -> None:
        if dist.get_rank() == 1:
            dist.broadcast(torch.ones(2), 0)
        else:
            funcol.all_reduce(torch.ones(2), "sum", dist.group.WORLD).wait()

    with pytest.raises(aiocoll.CollectiveMismatchError, match="broadcast"):
        aiocoll.spawn(fn, world=2)


def test_failing_sync_rank_releases_others_at_once() -> None:
    errors: dict[int, BaseException] = {}
    entered = threading.Barrier(3)

    def fn(comm: Comm) -> None:
        r = dist.get_rank()
        if r == 1:
            entered.wait()
            time.sleep(0.05)  # the others are (most likely) blocked in all_reduce by now
            raise ValueError("rank 1 broke")
        entered.wait()
        try:
            dist.all_reduce(torch.ones(1))
        except aiocoll.WorldAbortedError as e:
            errors[r] = e
            raise

    start = time.perf_counter()
    with pytest.raises(ValueError, match="rank 1 broke") as info:
        aiocoll.spawn(fn, world=3, timeout=60)
    assert time.perf_counter() - start < 10
    assert "aiocoll: raised on rank 1 of a world of 3" in info.value.__notes__
    assert set(errors) == {0, 2}
    for e in errors.values():
        assert isinstance(e, aiocoll.WorldAbortedError)
        assert e.rank == 1
        assert "rank 1 failed with ValueError: rank 1 broke" in str(e)


def test_sync_rank_deadlock_is_reported() -> None:
    def fn(comm: Comm) -> None:
        if dist.get_rank() == 0:
            return
        dist.barrier()

    start = time.perf_counter()
    with pytest.raises(aiocoll.DeadlockError) as info:
        aiocoll.spawn(fn, world=3, timeout=60)
    assert time.perf_counter() - start < 10
    msg = str(info.value)
    assert "rank 0: returned" in msg
    assert "rank 1: blocked in barrier()" in msg
    assert "test_c10d.py" in msg  # the user's call site, above torch.distributed


def test_busy_sync_rank_times_out() -> None:
    def fn(comm: Comm) -> None:
        if dist.get_rank() == 0:
            time.sleep(1.0)  # busy in user code: not parked, so only the timeout can tell
            return
        dist.barrier()

    # ranks that run at once: rank 1 waits in barrier while rank 0 sleeps
    with pytest.raises(aiocoll.CollectiveTimeoutError, match=r"ranks \[1\] arrived, ranks \[0\] did not"):
        aiocoll.spawn(fn, world=2, timeout=0.2, sync_ranks="parallel")


def test_busy_sync_rank_taking_turns_is_seen_to_leave() -> None:
    def fn(comm: Comm) -> None:
        if dist.get_rank() == 0:
            time.sleep(0.3)  # holds the turn: rank 1 reaches barrier only once rank 0 has returned
            return
        dist.barrier()

    start = time.perf_counter()
    with pytest.raises(aiocoll.DeadlockError, match=r"rank 0: returned") as info:
        aiocoll.spawn(fn, world=2, timeout=60)
    assert time.perf_counter() - start < 10  # at once, not at the timeout
    assert "rank 1: blocked in barrier()" in str(info.value)


def test_group_of_another_rank_is_refused() -> None:
    groups: dict[int, Any] = {}
    ready = threading.Barrier(2)

    def fn(comm: Comm) -> str:
        groups[dist.get_rank()] = dist.group.WORLD
        ready.wait()
        if dist.get_rank() == 1:
            with pytest.raises(aiocoll.AiocollError, match="the process group of rank 0 was used by rank 1"):
                groups[0].allreduce([torch.ones(1)])
        return "ok"

    # (the ranks wait for each other on a threading.Barrier: they must run at once)
    assert aiocoll.spawn(fn, world=2, sync_ranks="parallel") == ["ok", "ok"]


# -- async ranks ---------------------------------------------------------------------


def test_async_ranks_use_torch_distributed(loop: str) -> None:
    async def fn(comm: Comm) -> tuple[int, float, str | None, int]:
        assert dist.get_rank() == comm.rank
        t = torch.tensor([float(dist.get_rank())])
        work = dist.all_reduce(t, async_op=True)
        assert work is not None
        await work
        g = dist.new_group([0, 1])
        u = torch.ones(1)
        if comm.rank < 2:
            await dist.all_reduce(u, group=g, async_op=True)  # type: ignore[misc]
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
        name = g.group_name if comm.rank < 2 else None  # non-members get a placeholder, as in torch
        return dist.get_rank(), t.item(), name, mesh["b"].get_local_rank()

    res = aiocoll.spawn(fn, world=4, loop=loop)
    assert [x[0] for x in res] == [0, 1, 2, 3]
    assert {x[1] for x in res} == {6.0}
    assert len({x[2] for x in res[:2]}) == 2  # rank-unique names in the loop thread's registry
    assert [x[3] for x in res] == [0, 1, 0, 1]


def test_blocking_torch_call_on_loop_thread_raises(loop: str) -> None:
    async def fn(comm: Comm) -> str:
        with pytest.raises(aiocoll.BlockingCallError, match="async_op=True"):
            dist.all_reduce(torch.ones(1))
        with pytest.raises(aiocoll.BlockingCallError, match="await"):
            dist.recv(torch.ones(1), src=1 - comm.rank)  # p2p has no opts: caught in wait()
        return "ok"

    # the recvs above were issued before wait() refused: nobody matched them
    with pytest.warns(RuntimeWarning, match=r"2 operation\(s\) no peer ever matched:\n  rank 0: recv"):
        assert aiocoll.spawn(fn, world=2, loop=loop) == ["ok", "ok"]


def test_functional_collectives_on_async_ranks(loop: str) -> None:
    async def fn(comm: Comm) -> list[float]:
        mesh = init_device_mesh("cpu", (comm.world_size,))
        y = funcol.all_reduce(torch.full((2,), float(comm.rank)), "sum", mesh)
        z = funcol.all_gather_tensor(torch.tensor([float(comm.rank)]), 0, dist.group.WORLD)
        await aiocoll.settle()  # every rank's collectives have completed: reading them won't block
        return y.tolist() + z.tolist()

    assert aiocoll.spawn(fn, world=3, loop=loop) == [[3.0, 3.0, 0.0, 1.0, 2.0]] * 3


# -- DeviceMesh, DTensor, functional collectives, DDP --------------------------------


def test_device_mesh_and_dtensor() -> None:
    def fn(comm: Comm) -> dict[str, Any]:
        mesh1 = init_device_mesh("cpu", (4,))
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        big = torch.arange(16.0).reshape(4, 4)
        d = distribute_tensor(big, mesh, [Shard(0), Replicate()])
        e = d.redistribute(mesh, [Replicate(), Shard(1)])
        s = distribute_tensor(big, mesh1, [Shard(1)])
        total = (s * 2).sum().full_tensor()
        return {
            "local": d.to_local().tolist(),
            "full": (d @ d).full_tensor(),
            "redistributed": e.to_local().shape,
            "dp_ranks": mesh["dp"].mesh.tolist(),
            "total": total.item(),
            "mesh_id": mesh._thread_id,
        }

    res = aiocoll.spawn(fn, world=4)
    big = torch.arange(16.0).reshape(4, 4)
    for r, out in enumerate(res):
        assert out["local"] == big[(r // 2) * 2 : (r // 2) * 2 + 2].tolist()
        assert torch.equal(out["full"], big @ big)
        assert out["redistributed"] == (4, 2)
        assert out["dp_ranks"] == [r % 2, r % 2 + 2]
        assert out["total"] == big.sum().item() * 2
    assert len({out["mesh_id"] for out in res}) == 4  # each rank's meshes are its own


def test_results_are_written_unseen_by_autograd() -> None:
    # gloo and NCCL write from C++, leaving autograd's version counters alone; DTensor's
    # distribute_tensor broadcasts into a tensor that views of a grad-requiring tensor share
    def fn(comm: Comm) -> tuple[int, float]:
        x = torch.full((4,), float(comm.rank), requires_grad=True)
        views = x.chunk(2)
        dist.broadcast(x.detach(), src=0)
        out = [torch.zeros(2) for _ in range(4)]
        dist.all_gather(out, views[0])  # autograd would refuse the views had the broadcast counted
        return x._version, out[3].sum().item()

    assert aiocoll.spawn(fn, world=4) == [(0, 0.0)] * 4


# torch 2.10 warns when autograd passes through wait_tensor (it had no autograd kernel
# yet); the gradients are still right, which the test checks
@pytest.mark.filterwarnings("ignore:_c10d_functional..wait_tensor. an autograd kernel was not registered:UserWarning")
def test_functional_collectives_and_autograd() -> None:
    def fn(comm: Comm) -> tuple[list[float], list[float], list[float]]:
        r = dist.get_rank()
        x = funcol.all_reduce(torch.full((2,), float(r)), "sum", dist.group.WORLD)
        a = torch.full((2,), float(r + 1), requires_grad=True)
        y = funcol.all_gather_tensor_autograd(a * 2, 0, dist.group.WORLD)
        y = funcol.wait_tensor(y)
        (y * torch.arange(y.numel(), dtype=torch.float32)).sum().backward()
        assert a.grad is not None
        return x.tolist(), y.tolist(), a.grad.tolist()

    res = aiocoll.spawn(fn, world=2)
    for r, (x, y, grad) in enumerate(res):
        assert x == [1.0, 1.0]
        assert y == [2.0, 2.0, 4.0, 4.0]
        # the backward of all_gather is a reduce_scatter (sum) of the upstream grads
        coeff = torch.arange(4, dtype=torch.float32)[r * 2 : r * 2 + 2] * 2 * 2
        assert grad == coeff.tolist()


def _model() -> torch.nn.Module:
    # Initialised from a generator of its own: the global RNG is shared by rank threads,
    # so torch.manual_seed in each rank would race.
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return model


def _ddp_grads(comm: Comm, hook: Any = None) -> list[torch.Tensor]:
    model = _model()
    ddp = DistributedDataParallel(model)
    if hook is not None:
        ddp.register_comm_hook(state=None, hook=hook)
    g = aiocoll.rank_generator(seed=1)
    x = torch.randn(8, 4, generator=g)
    ddp(x).square().sum().backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _reference_grads(world: int) -> list[torch.Tensor]:
    model = _model()
    xs = []
    for r in range(world):
        g = torch.Generator().manual_seed(1 * 1_048_576 + r)  # what rank_generator(seed=1) gives rank r
        xs.append(torch.randn(8, 4, generator=g))
    (model(torch.cat(xs)).square().sum() / world).backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _future_hook(state, bucket):  # type: ignore[no-untyped-def]
    # no annotations: DDP compares them with dist.GradBucket, and this module's are strings
    t = bucket.buffer().div_(dist.get_world_size())
    work = dist.all_reduce(t, async_op=True)
    assert work is not None
    return work.get_future().then(lambda fut: fut.value()[0])


@pytest.mark.parametrize("hook", [None, _future_hook], ids=["builtin", "future-hook"])
def test_ddp_gradients_match_single_process(hook: Any) -> None:
    res = aiocoll.spawn(lambda comm: _ddp_grads(comm, hook), world=4)
    ref = _reference_grads(4)
    for grads in res:
        assert len(grads) == len(ref)
        for g, rg in zip(grads, ref, strict=True):
            torch.testing.assert_close(g, rg)


# -- isolation and teardown -------------------------------------------------------------


def test_per_rank_isolation_in_threads() -> None:
    def fn(comm: Comm) -> tuple[bool, bool, str, int]:
        r = dist.get_rank()
        if r == 0:
            torch.set_grad_enabled(False)  # thread-local: the other rank keeps grad mode
        comm.barrier().wait()
        grad = torch.is_grad_enabled()
        torch.set_grad_enabled(True)
        return grad, torch.autograd.is_multithreading_enabled(), dist.group.WORLD.group_name, id(c10d._world.pg_map)

    res = aiocoll.spawn(fn, world=2)
    assert [x[0] for x in res] == [False, True]
    assert [x[1] for x in res] == [False, False]
    assert res[0][3] != res[1][3]  # each rank has its own c10d state


def test_teardown_restores_torch() -> None:
    before_world = c10d._world
    before_init = DeviceMesh.__init__

    def fn(comm: Comm) -> bool:
        return dist.is_initialized()

    assert aiocoll.spawn(fn, world=2) == [True, True]
    assert c10d._world is before_world
    assert DeviceMesh.__init__ is before_init
    assert not dist.is_initialized()
    with pytest.raises(aiocoll.AiocollError, match="outside any aiocoll rank"):
        dist.init_process_group("aiocoll", rank=0, world_size=1, store=dist.HashStore())  # type: ignore[attr-defined]


def test_rank_generator_differs_per_rank_and_repeats() -> None:
    async def fn(comm: Comm) -> list[float]:
        return torch.rand(3, generator=aiocoll.rank_generator(seed=7)).tolist()

    a = aiocoll.spawn(fn, world=3)
    b = aiocoll.spawn(fn, world=3)
    assert a == b
    assert len({tuple(x) for x in a}) == 3
