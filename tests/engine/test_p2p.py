"""send/recv: matching per (sender, receiver, tag) in order, any-source receive."""

from __future__ import annotations

import pytest
import torch

import aiocoll
from aiocoll import Comm


def test_send_recv_in_order_per_pair(loop: str) -> None:
    async def fn(comm: Comm) -> list[int]:
        if comm.rank == 0:
            for i in range(5):
                await comm.send(torch.tensor([i]), dst=1)
            return []
        got = []
        for _ in range(5):
            t = torch.empty(1, dtype=torch.long)
            await comm.recv(t, src=0)
            got.append(int(t.item()))
        return got

    assert aiocoll.spawn(fn, world=2, loop=loop)[1] == [0, 1, 2, 3, 4]


def test_tags_match_independently(loop: str) -> None:
    """Receives posted in the opposite tag order still get the right messages."""

    async def fn(comm: Comm) -> list[int]:
        if comm.rank == 0:
            a = comm.send(torch.tensor([10]), dst=1, tag=1)
            b = comm.send(torch.tensor([20]), dst=1, tag=2)
            await a
            await b
            return []
        x, y = torch.empty(1, dtype=torch.long), torch.empty(1, dtype=torch.long)
        ry = comm.recv(y, src=0, tag=2)
        rx = comm.recv(x, src=0, tag=1)
        await ry
        await rx
        return [int(x.item()), int(y.item())]

    assert aiocoll.spawn(fn, world=2, loop=loop)[1] == [10, 20]


def test_recv_any_source_returns_sender(loop: str) -> None:
    async def fn(comm: Comm) -> list[tuple[int, int]]:
        if comm.rank != 0:
            await comm.send(torch.tensor([comm.rank * 10]), dst=0)
            return []
        got = []
        for _ in range(comm.world_size - 1):
            t = torch.empty(1, dtype=torch.long)
            src = await comm.recv(t)
            got.append((src, int(t.item())))
        return got

    got = aiocoll.spawn(fn, world=4, loop=loop)[0]
    assert sorted(got) == [(1, 10), (2, 20), (3, 30)]
    assert all(v == s * 10 for s, v in got)


def test_any_source_takes_earliest_send(loop: str) -> None:
    """Both sends are queued before rank 0 receives; the earlier one (rank 2's) comes first."""

    async def fn(comm: Comm) -> int | None:
        pair = await comm.new_group([1, 2])
        if comm.rank == 0:
            await comm.barrier()  # both sends are posted by now
            t = torch.empty(1, dtype=torch.long)
            first = await comm.recv(t)
            assert t.item() == first
            second = await comm.recv(t)
            return first * 10 + second
        assert pair is not None
        if comm.rank == 2:
            w = comm.send(torch.tensor([2]), dst=0)
            await pair.barrier()  # rank 1 sends only after this
        else:
            await pair.barrier()
            w = comm.send(torch.tensor([1]), dst=0)
        await comm.barrier()
        await w
        return None

    assert aiocoll.spawn(fn, world=3, loop=loop)[0] == 21


def test_send_waits_for_matching_recv(loop: str) -> None:
    """A send completes only once a recv took its data (NCCL/gloo-like rendezvous)."""

    async def fn(comm: Comm) -> bool:
        if comm.rank == 0:
            w = comm.send(torch.tensor([1.0]), dst=1)
            done_before = w.done()
            await comm.barrier()
            await w
            return done_before
        await comm.barrier()
        await comm.recv(torch.empty(1), src=0)
        return False

    assert aiocoll.spawn(fn, world=2, loop=loop)[0] is False


def test_send_recv_shape_mismatch(loop: str) -> None:
    async def fn(comm: Comm) -> None:
        if comm.rank == 0:
            await comm.send(torch.ones(3), dst=1)
        else:
            await comm.recv(torch.empty(2), src=0)

    with pytest.raises(aiocoll.CollectiveMismatchError, match=r"send of float32\[3\] matched a recv into float32\[2\]"):
        aiocoll.spawn(fn, world=2, loop=loop)


def test_send_recv_shapes_may_differ_when_the_elements_agree(loop: str) -> None:
    # as with gloo and NCCL, which move elements: torch 2.10's pipelining sends a 0-d
    # loss into a receive buffer of shape [1]
    async def fn(comm: Comm) -> list[list[float]] | None:
        if comm.rank == 0:
            await comm.send(torch.tensor(2.5), dst=1)
            await comm.send(torch.arange(6.0).reshape(2, 3), dst=1)
            return None
        one, flat = torch.zeros(1), torch.zeros(6)
        await comm.recv(one, src=0)
        await comm.recv(flat, src=0)
        return [one.tolist(), flat.tolist()]

    assert aiocoll.spawn(fn, world=2, loop=loop)[1] == [[2.5], [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]]


def test_p2p_noncontiguous_and_dtypes(loop: str) -> None:
    async def fn(comm: Comm) -> torch.Tensor | None:
        if comm.rank == 0:
            x = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4).t()  # non-contiguous
            await comm.send(x, dst=1)
            return None
        out = torch.zeros(3, 4, dtype=torch.bfloat16).t()
        await comm.recv(out, src=0)
        return out.contiguous()

    got = aiocoll.spawn(fn, world=2, loop=loop)[1]
    assert got is not None
    assert torch.equal(got, torch.arange(12, dtype=torch.bfloat16).reshape(3, 4).t())
