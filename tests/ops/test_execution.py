"""Where ops run: small ones inline on the loop, large ones on a worker thread, in issue order."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
import torch

import aiocoll
from aiocoll._ops import AllReduce, Reduction, _device

BIG = 1 << 20  # elements: 4 MiB of float32 per rank, well above the inline limit


def test_placement_by_size() -> None:
    small = [AllReduce(torch.ones(4), Reduction.of(torch.distributed.ReduceOp.SUM)) for _ in range(4)]
    big = [AllReduce(torch.ones(BIG), Reduction.of(torch.distributed.ReduceOp.SUM)) for _ in range(4)]
    assert _device.placement(small) is _device.Placement.INLINE
    assert _device.placement(big) is _device.Placement.THREAD
    # the limit counts every rank's bytes
    assert _device.placement(small, inline_bytes=4 * 4 * 4 - 1) is _device.Placement.THREAD


def test_tensors_of_flattens_lists() -> None:
    from aiocoll._ops import AllGather

    a, b, c = torch.zeros(1), torch.zeros(1), torch.ones(1)
    assert _device.tensors_of(AllGather([a, b], c)) == [a, b, c]


def test_large_op_runs_on_a_worker_thread_while_the_loop_ticks(loop: str) -> None:
    threads: set[str] = set()
    real_run = AllReduce.run

    def spying_run(calls: Any) -> list[None]:
        threads.add(threading.current_thread().name)
        return real_run(calls)

    async def worker(comm: aiocoll.Comm) -> tuple[float, int]:
        ticks = 0
        stop = False

        async def ticker() -> None:
            nonlocal ticks
            while not stop:
                ticks += 1
                await asyncio.sleep(0)

        t = torch.full((8 * BIG,), float(comm.rank + 1))
        tick_task = asyncio.ensure_future(ticker()) if comm.rank == 0 else None
        await asyncio.sleep(0)
        for _ in range(3):
            await comm.all_reduce(t)
        stop = True
        if tick_task is not None:
            await tick_task
        return t[0].item(), ticks

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(AllReduce, "run", staticmethod(spying_run))
        out = aiocoll.spawn(worker, world=2, loop=loop)
    assert [v for v, _ in out] == [3.0 * 2 * 2, 3.0 * 2 * 2]
    assert threads
    assert all(n.startswith("aiocoll-op") for n in threads)
    # the loop served the ticker while the 32 MiB sums ran elsewhere
    assert out[0][1] > 3


def test_ops_complete_in_issue_order_across_placements(loop: str) -> None:
    async def worker(comm: aiocoll.Comm) -> list[float]:
        big = torch.ones(BIG)
        small = big[:1]  # a view: the small op must see the big op's result
        w1 = comm.all_reduce(big)  # runs on the worker thread
        w2 = comm.all_reduce(small)  # inline, but after w1
        peer = 1 - comm.rank
        box = torch.zeros(1)
        w3 = comm.send(big[:1], peer) if comm.rank == 0 else comm.recv(box, peer)
        await w1
        await w2
        await w3
        return [big[0].item(), big[1].item(), box.item()]

    r0, r1 = aiocoll.spawn(worker, world=2, loop=loop)
    # big: 1+1=2 everywhere; then its first element summed again: 2+2=4; rank 1 got rank 0's 4
    assert r0[:2] == [4.0, 2.0]
    assert r1 == [4.0, 2.0, 4.0]


def test_sync_ranks_use_the_worker_thread_too() -> None:
    def worker(comm: aiocoll.Comm) -> float:
        t = torch.full((BIG,), 2.0)
        comm.all_reduce(t).wait()
        return t[-1].item()

    assert aiocoll.spawn(worker, world=3) == [6.0] * 3


def test_error_in_a_worker_thread_op_keeps_its_type(loop: str) -> None:
    def broken(calls: Any) -> list[None]:
        raise OSError("disk on fire")

    async def worker(comm: aiocoll.Comm) -> None:
        await comm.all_reduce(torch.ones(BIG))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(AllReduce, "run", staticmethod(broken))
        with pytest.raises(OSError, match="disk on fire"):
            aiocoll.spawn(worker, world=2, loop=loop)


def test_abort_releases_ranks_waiting_on_a_running_op(loop: str) -> None:
    release = threading.Event()
    real_run = AllReduce.run

    def slow_run(calls: Any) -> list[None]:
        release.wait(10)
        return real_run(calls)

    async def worker(comm: aiocoll.Comm) -> None:
        w = comm.all_reduce(torch.ones(BIG))
        if comm.rank == 1:
            await asyncio.sleep(0.05)
            raise KeyError("rank 1 gives up")
        await w

    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(AllReduce, "run", staticmethod(slow_run))
            with pytest.raises(KeyError, match="rank 1 gives up"):
                aiocoll.spawn(worker, world=2, loop=loop, timeout=30)
    finally:
        release.set()


def test_no_deadlock_reported_while_an_op_runs_off_the_loop(loop: str) -> None:
    # Every rank awaits the one op running on the worker thread: all are blocked, yet
    # the op will complete, so this is no deadlock.
    real_run = AllReduce.run

    def slow_run(calls: Any) -> list[None]:
        threading.Event().wait(0.2)
        return real_run(calls)

    async def worker(comm: aiocoll.Comm) -> float:
        t = torch.ones(BIG)
        await comm.all_reduce(t)
        return t[0].item()

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(AllReduce, "run", staticmethod(slow_run))
        assert aiocoll.spawn(worker, world=2, loop=loop) == [2.0, 2.0]


def test_deadlock_after_an_off_loop_op_is_still_reported(loop: str) -> None:
    async def worker(comm: aiocoll.Comm) -> None:
        await comm.all_reduce(torch.ones(BIG))
        if comm.rank == 0:
            await comm.barrier()

    with pytest.raises(aiocoll.DeadlockError):
        aiocoll.spawn(worker, world=2, loop=loop, timeout=30)


def test_latch_for_thread_waits() -> None:
    # the one-lock latch rank threads wait on: Event's semantics, every waiter released by one set()
    import threading

    from aiocoll._engine._rank import _Latch

    latch = _Latch()
    assert not latch.wait(0)
    assert not latch.wait(-1)
    assert not latch.is_set()
    woke: list[bool] = []
    waiters = [threading.Thread(target=lambda: woke.append(latch.wait(30))) for _ in range(3)]
    for t in waiters:
        t.start()
    latch.set()
    latch.set()  # idempotent
    for t in waiters:
        t.join(30)
    assert woke == [True, True, True]
    assert latch.is_set()
    assert latch.wait()
    assert latch.wait(-1)
