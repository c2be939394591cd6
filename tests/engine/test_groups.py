"""Sub-groups: new_group and split, nesting, group-local ranks."""

from __future__ import annotations

import pytest
import torch

import aiocoll
from aiocoll import Comm


def test_new_group_members_and_outsiders(loop: str) -> None:
    async def fn(comm: Comm) -> tuple[int, int, tuple[int, ...], float] | None:
        g = await comm.new_group([3, 1])  # order does not matter: ranks are sorted, as in torch
        if g is None:
            return None
        t = torch.tensor([float(comm.rank)])
        await g.all_reduce(t)
        return g.rank, g.world_size, g.group_ranks, t.item()

    res = aiocoll.spawn(fn, world=4, loop=loop)
    assert res == [None, (0, 2, (1, 3), 4.0), None, (1, 2, (1, 3), 4.0)]


def test_split_orders_by_key_then_rank(loop: str) -> None:
    async def fn(comm: Comm) -> tuple[int, int] | None:
        # colors: evens and odds; key reverses the order inside each color
        g = await comm.split(color=comm.rank % 2, key=-comm.rank)
        assert g is not None
        ranks = await g.all_gather_object(comm.rank)
        assert ranks == list(g.group_ranks)
        return g.rank, g.group_ranks[0]

    res = aiocoll.spawn(fn, world=6, loop=loop)
    # evens: 4, 2, 0 ; odds: 5, 3, 1
    assert res == [(2, 4), (2, 5), (1, 4), (1, 5), (0, 4), (0, 5)]


def test_split_color_none_joins_nothing(loop: str) -> None:
    async def fn(comm: Comm) -> int | None:
        g = await comm.split(None if comm.rank == 0 else "rest")
        return None if g is None else g.world_size

    assert aiocoll.spawn(fn, world=3, loop=loop) == [None, 2, 2]


def test_groups_nest_with_local_ranks(loop: str) -> None:
    async def fn(comm: Comm) -> tuple[int, int, float] | None:
        half = await comm.split(comm.rank // 4)  # two halves of 4
        assert half is not None
        quarter = await half.new_group([2, 3])  # half-local ranks 2 and 3
        if quarter is None:
            return None
        t = torch.tensor([float(comm.rank)])
        await quarter.all_reduce(t)
        await quarter.broadcast(t, src=1)  # quarter-local rank 1
        return quarter.rank, quarter.global_rank, t.item()

    res = aiocoll.spawn(fn, world=8, loop=loop)
    assert res == [None, None, (0, 2, 5.0), (1, 3, 5.0), None, None, (0, 6, 13.0), (1, 7, 13.0)]


def test_groups_have_independent_sequences(loop: str) -> None:
    """Collectives on a sub-group and on the parent interleave freely."""

    async def fn(comm: Comm) -> float:
        g = await comm.split(comm.rank % 2)
        assert g is not None
        a, b = torch.tensor([1.0]), torch.tensor([float(comm.rank)])
        # issue on the sub-group first on odd ranks, on the world first on even ranks
        if comm.rank % 2:
            w1, w2 = g.all_reduce(b), comm.all_reduce(a)
        else:
            w2, w1 = comm.all_reduce(a), g.all_reduce(b)
        await w1
        await w2
        return a.item() * 100 + b.item()

    assert aiocoll.spawn(fn, world=4, loop=loop) == [402.0, 404.0, 402.0, 404.0]


def test_same_group_twice_gives_distinct_groups(loop: str) -> None:
    async def fn(comm: Comm) -> tuple[str, str]:
        a = await comm.new_group([0, 1])
        b = await comm.new_group([0, 1])
        assert a is not None
        assert b is not None
        return a.group_name, b.group_name

    (a, b), _ = aiocoll.spawn(fn, world=2, loop=loop)
    assert a != b


def test_p2p_inside_subgroup_uses_local_ranks(loop: str) -> None:
    async def fn(comm: Comm) -> int | None:
        g = await comm.new_group([1, 2])
        if g is None:
            return None
        t = torch.tensor([comm.rank])
        if g.rank == 0:
            await g.send(t, dst=1)
            return None
        src = await g.recv(t, src=0)
        assert src == 0
        return int(t.item())

    assert aiocoll.spawn(fn, world=3, loop=loop) == [None, None, 1]


def test_new_group_disagreement_is_a_mismatch(loop: str) -> None:
    async def fn(comm: Comm) -> None:
        await comm.new_group([0, 1] if comm.rank == 0 else [0, 2])

    with pytest.raises(aiocoll.CollectiveMismatchError, match=r"new_group\(ranks=\[0, 1\]\)"):
        aiocoll.spawn(fn, world=3, loop=loop)


def test_new_group_bad_ranks() -> None:
    async def fn(comm: Comm) -> str:
        for bad in ([], [0, 0], [0, 5], "01"):
            with pytest.raises(aiocoll.InvalidArgumentError, match="new_group on rank"):
                await comm.new_group(bad)  # type: ignore[arg-type]
        with pytest.raises(aiocoll.InvalidArgumentError, match="hashable"):
            await comm.split([1])
        return "ok"

    assert aiocoll.spawn(fn, world=2) == ["ok", "ok"]
