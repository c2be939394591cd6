"""The public surface: names, reprs, Work, loop choice, object collectives, scale."""

from __future__ import annotations

import asyncio
import dataclasses
import doctest
import importlib

import pytest
import torch

import aiocoll
from aiocoll import Comm, RankStatistics, Statistics
from aiocoll._bridge._pg import PGWork, ProcessGroupComm
from aiocoll._engine._engine_comm import EngineComm
from aiocoll._engine._rank import EngineWork
from aiocoll._ops import Barrier


def test_public_names() -> None:
    assert set(aiocoll.__all__) == {
        "DEFAULT_RECORD",
        "DEFAULT_TIMEOUT",
        "AiocollError",
        "BlockingCallError",
        "CollectiveMismatchError",
        "CollectiveTimeoutError",
        "Comm",
        "DeadlockError",
        "Fault",
        "GroupTimeoutError",
        "InjectedFault",
        "InvalidArgumentError",
        "TorchCompatError",
        "OpInfo",
        "RankExitedError",
        "RankStatistics",
        "SeedFailure",
        "Statistics",
        "Work",
        "WorldAbortedError",
        "dump_flight_recorder",
        "__version__",
        "find_failing_seed",
        "from_process_group",
        "rank_generator",
        "settle",
        "spawn",
        "spawn_async",
    }
    for name in aiocoll.__all__:
        assert getattr(aiocoll, name) is not None
    assert aiocoll.__version__.count(".") >= 2


def test_exception_hierarchy() -> None:
    assert issubclass(aiocoll.CollectiveTimeoutError, TimeoutError)
    assert issubclass(aiocoll.CollectiveMismatchError, ValueError)
    assert issubclass(aiocoll.InvalidArgumentError, ValueError)
    for name in ("CollectiveTimeoutError", "CollectiveMismatchError", "InvalidArgumentError", "DeadlockError"):
        assert issubclass(getattr(aiocoll, name), aiocoll.AiocollError)
    assert issubclass(aiocoll.WorldAbortedError, aiocoll.AiocollError)
    # gloo's timeouts are RuntimeErrors, and torch code catches them so
    assert issubclass(aiocoll.GroupTimeoutError, aiocoll.CollectiveTimeoutError)
    assert issubclass(aiocoll.GroupTimeoutError, RuntimeError)


@pytest.mark.parametrize(
    "module", ["aiocoll._ops", "aiocoll._spawn", "aiocoll._bridge._presence", "aiocoll._collector"]
)
def test_doctests(module: str) -> None:
    failures, tried = doctest.testmod(importlib.import_module(module))
    assert tried > 0
    assert failures == 0


def test_loop_choice_is_honoured() -> None:
    pytest.importorskip("uvloop")
    import uvloop

    async def fn(comm: Comm) -> str:
        return type(asyncio.get_running_loop()).__module__

    assert aiocoll.spawn(fn, world=2, loop="uvloop") == ["uvloop", "uvloop"]
    assert aiocoll.spawn(fn, world=1, loop="auto") == ["uvloop"]
    assert aiocoll.spawn(fn, world=1, loop="asyncio")[0].startswith("asyncio")
    assert aiocoll.spawn(fn, world=1, loop=uvloop.new_event_loop) == ["uvloop"]


def test_reprs_and_work(loop: str) -> None:
    async def fn(comm: Comm) -> tuple[str, str, str, bool, object]:
        t = torch.ones(2)
        w = comm.all_reduce(t)
        pending = repr(w)
        before = w.done()
        await w
        return repr(comm), pending, repr(w), before, w.result()

    res = aiocoll.spawn(fn, world=2, loop=loop)
    c, pending, done, before, result = res[0]
    assert c == "<Comm rank=0/2 group='world'>"
    assert pending == "<Work rank=0 all_reduce(float32[2], op=ReduceOp.SUM) #0 on group 'world' pending>"
    assert done.endswith("done>")
    assert before is False  # rank 1 had not arrived yet when rank 0 issued
    assert result is None
    assert res[1][3] is True  # rank 1 was the last arrival: its work completed on the spot


def test_comm_and_work_are_abstract_interfaces() -> None:
    # what users annotate with and isinstance-check against; each kind implements all of it
    with pytest.raises(TypeError, match="abstract"):
        aiocoll.Comm(0, 1)  # type: ignore[abstract]
    with pytest.raises(TypeError, match="abstract"):
        aiocoll.Work(None, None, None)  # type: ignore[abstract,arg-type]
    for cls in (EngineComm, ProcessGroupComm, EngineWork, PGWork):
        assert not getattr(cls, "__abstractmethods__", None), f"{cls.__name__} leaves methods abstract"
    assert issubclass(EngineComm, aiocoll.Comm)
    assert issubclass(ProcessGroupComm, aiocoll.Comm)
    assert issubclass(EngineWork, aiocoll.Work)
    assert issubclass(PGWork, aiocoll.Work)


def test_engine_work_sets_every_field_of_work() -> None:
    # EngineWork sets Work's fields itself (no call to Work.__init__ on the hot path):
    # a field added to Work must be set there too
    async def fn(comm: Comm) -> list[str]:
        assert isinstance(comm, EngineComm)
        w = comm.all_reduce(torch.ones(1))
        assert isinstance(w, aiocoll.Work)
        await w
        return [name for name in aiocoll.Work.__slots__ if not hasattr(w, name)]

    assert aiocoll.spawn(fn, world=2) == [[], []]


def test_process_group_work_shares_the_interface() -> None:
    # the base's behaviour on a work that does not come from the engine
    loop = asyncio.new_event_loop()
    try:
        fut: asyncio.Future[object] = loop.create_future()
        w = PGWork(fut, Barrier(), 1, "0", ("train.py", 7))
        assert [name for name in aiocoll.Work.__slots__ if not hasattr(w, name)] == []
        assert isinstance(w, aiocoll.Work)
        assert repr(w) == "<Work rank=1 barrier() on group '0' pending>"
        assert w.describe() == "barrier() on group '0' at train.py:7"
        assert (w.done(), w.is_completed()) == (False, False)
        tf = w.torch_future("value")
        fut.set_result(None)
        assert loop.run_until_complete(w) is None  # awaitable, on its loop
        assert (w.done(), w.is_completed(), w.result(), w.exception()) == (True, True, None, None)
        assert w.wait() is None  # done: no blocking, from any thread
        assert tf.wait() == "value"
        assert repr(w).endswith(" done>")
    finally:
        loop.close()


def test_object_collectives(loop: str) -> None:
    async def fn(comm: Comm) -> tuple[object, ...]:
        r = comm.rank
        b = await comm.broadcast_object({"from": r, "list": [r]}, src=1)
        g = await comm.all_gather_object(("rank", r))
        ga = await comm.gather_object(r * r, dst=2)
        s = await comm.scatter_object([f"to {i}" for i in range(comm.world_size)] if r == 0 else None, src=0)
        return b, g, ga, s

    res = aiocoll.spawn(fn, world=3, loop=loop)
    for r, (b, g, ga, s) in enumerate(res):
        assert b == {"from": 1, "list": [1]}
        assert g == [("rank", 0), ("rank", 1), ("rank", 2)]
        assert ga == ([0, 1, 4] if r == 2 else None)
        assert s == f"to {r}"
    # every rank got its own copy
    assert res[0][0] is not res[2][0]


def test_world_1024(loop: str) -> None:
    async def fn(comm: Comm) -> list[float]:
        t = torch.tensor([float(comm.rank)])
        for _ in range(3):
            await comm.all_reduce(t)
        out = torch.empty(comm.world_size)
        await comm.all_gather_into_tensor(out, torch.tensor([float(comm.rank)]))
        return [t.item(), out[-1].item()]

    res = aiocoll.spawn(fn, world=1024, loop=loop)
    s = sum(range(1024))
    assert res[0] == [float(s * 1024 * 1024), 1023.0]
    assert all(r == res[0] for r in res)


def test_spawn_async_in_running_loop() -> None:
    async def fn(comm: Comm) -> int:
        await comm.barrier()
        return comm.rank

    async def main() -> list[int]:
        return await aiocoll.spawn_async(fn, world=3)

    assert asyncio.run(main()) == [0, 1, 2]


def test_reduce_leaves_non_destination_untouched(loop: str) -> None:
    async def fn(comm: Comm) -> float:
        t = torch.tensor([float(comm.rank + 1)])
        await comm.reduce(t, dst=1, op=torch.distributed.ReduceOp.PRODUCT)
        return t.item()

    assert aiocoll.spawn(fn, world=4, loop=loop) == [1.0, 24.0, 3.0, 4.0]


def test_statistics_snapshot(loop: str) -> None:
    async def fn(comm: Comm) -> dict[str, Statistics] | None:
        if comm.rank == 1:
            ready.set()
            await comm.all_reduce(torch.ones(1))  # blocks: rank 0 has not arrived
            return None
        await ready.wait()
        before = comm.statistics()
        await comm.all_reduce(torch.ones(1))
        return {"before": before, "after": comm.statistics()}

    ready = asyncio.Event()
    res = aiocoll.spawn(fn, world=2, loop=loop)[0]
    assert res is not None
    before, after = res["before"], res["after"]
    assert isinstance(before, Statistics)
    assert isinstance(after, Statistics)
    r0, r1 = before.ranks
    assert r0 == RankStatistics(rank=0, state="running", waiting=(), waits_for=(), completed=0)
    assert r1.state == "blocked"
    assert r1.waiting == ("all_reduce(float32[1], op=ReduceOp.SUM) #0 on group 'world'",)
    assert r1.waits_for == (0,)
    assert before.blocked_ranks == 1
    assert before.pending_collectives == 1
    assert [r.completed for r in after.ranks] == [1, 1]
    assert after.pending_collectives == 0


def test_statistics_are_frozen_snapshots() -> None:
    async def fn(comm: Comm) -> tuple[Statistics, Statistics, str] | None:
        if comm.rank == 1:
            await comm.all_reduce(torch.ones(1))  # blocks until rank 0 has looked
            return None
        while comm.statistics().blocked_ranks == 0:
            await asyncio.sleep(0)
        before = comm.statistics()
        shown = repr(before)
        await comm.all_reduce(torch.ones(1))  # the world moves on: rank 1 is released, ops complete
        return before, comm.statistics(), shown

    res = aiocoll.spawn(fn, world=2)[0]
    assert res is not None
    before, after, shown = res
    # the world changed, the snapshot taken before did not
    assert after.blocked_ranks == 0
    assert [r.completed for r in after.ranks] == [1, 1]
    assert before.blocked_ranks == 1
    assert before.pending_collectives == 1
    assert [r.state for r in before.ranks] == ["running", "blocked"]
    assert [r.completed for r in before.ranks] == [0, 0]
    assert repr(before) == shown
    assert shown == "<Statistics size=2 live=2 blocked=1 pending_collectives=1 pending_p2p=0: 1 running, 1 blocked>"
    assert repr(before.ranks[1]) == (
        "<RankStatistics rank=1 blocked in all_reduce(float32[1], op=ReduceOp.SUM) #0 on group 'world' "
        "for ranks [0], completed=0>"
    )
    # frozen all the way down: no field can be assigned, nor can the sequences be changed
    with pytest.raises(dataclasses.FrozenInstanceError):
        before.blocked_ranks = 0  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        before.ranks[1].state = "running"  # type: ignore[misc]
    assert not hasattr(before, "__dict__")  # slots: nothing can be added either
    assert isinstance(before.ranks, tuple)
    assert isinstance(before.ranks[1].waiting, tuple)
    assert isinstance(before.ranks[1].waits_for, tuple)
    assert before.backend is None
