"""Argument errors: InvalidArgumentError on the calling rank, before any data moves.

The pattern of the collective tests: every rank but one issues a correct all_reduce and
waits in it; then the bad rank makes its bad call, which must raise InvalidArgumentError
naming the op, the rank and the argument, leave its tensors untouched and leave the
waiting ranks undisturbed (their collective still pending); then the bad rank joins the
all_reduce with a good tensor, which only completes correctly if the bad call did not use
up a sequence number or deposit anything.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

import aiocoll
from aiocoll import Comm, InvalidArgumentError, Work

R = dist.ReduceOp
WORLD = 3
BAD = 1  # the rank that makes the bad call

Watch = list[tuple[torch.Tensor, torch.Tensor]]
BadCall = Callable[[Comm, Watch], object]


def _t(watch: Watch, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A tensor with distinct values, remembered with a copy to check it stays untouched."""
    n = math.prod(shape)
    t = (torch.arange(n) + 7).reshape(shape).to(dtype)
    watch.append((t, t.clone()))
    return t


def _ts(watch: Watch, k: int, *shape: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    return [_t(watch, *shape, dtype=dtype) for _ in range(k)]


class Unpicklable:
    def __reduce__(self) -> str:
        raise TypeError("this object refuses to be pickled")


def _premul(factor: float) -> object:
    return dist._make_nccl_premul_sum(factor)  # type: ignore[attr-defined]


# (op, argument named in the message, the bad call on rank BAD of a world of 3)
CASES: list[Any] = [
    # non-tensor and unsupported tensors
    pytest.param("all_reduce", "'tensor'", lambda c, w: c.all_reduce([1.0, 2.0]), id="all_reduce-list"),
    pytest.param("all_reduce", "'tensor'", lambda c, w: c.all_reduce(3.0), id="all_reduce-float"),
    pytest.param(
        "all_reduce", "'tensor'", lambda c, w: c.all_reduce(torch.ones(2).to_sparse()), id="all_reduce-sparse"
    ),
    pytest.param("broadcast", "'tensor'", lambda c, w: c.broadcast(None, src=0), id="broadcast-none"),
    pytest.param("send", "'tensor'", lambda c, w: c.send([1], dst=0), id="send-list"),
    # reduce ops and their dtypes
    pytest.param("all_reduce", "'op'", lambda c, w: c.all_reduce(_t(w, 2), op=R.BAND), id="BAND-float"),
    pytest.param("all_reduce", "'op'", lambda c, w: c.all_reduce(_t(w, 2), op=R.BXOR), id="BXOR-float"),
    pytest.param("all_reduce", "'op'", lambda c, w: c.all_reduce(_t(w, 2, dtype=torch.int64), op=R.AVG), id="AVG-int"),
    pytest.param(
        "all_reduce",
        "'op'",
        lambda c, w: c.all_reduce(_t(w, 2, dtype=torch.complex64), op=R.MAX),
        id="MAX-complex",
    ),
    pytest.param(
        "all_reduce",
        "'op'",
        lambda c, w: c.all_reduce(_t(w, 2, dtype=torch.int32), op=_premul(2.0)),
        id="PREMUL_SUM-int",
    ),
    pytest.param("all_reduce", "'op'", lambda c, w: c.all_reduce(_t(w, 2), op=R.PREMUL_SUM), id="PREMUL-no-factor"),
    pytest.param("all_reduce", "'op'", lambda c, w: c.all_reduce(_t(w, 2), op="median"), id="op-unknown-name"),
    pytest.param("all_reduce", "'op'", lambda c, w: c.all_reduce(_t(w, 2), op=3), id="op-int"),
    pytest.param("reduce", "'op'", lambda c, w: c.reduce(_t(w, 2), dst=0, op=R.BOR), id="reduce-BOR-float"),
    pytest.param(
        "reduce_scatter",
        "'op'",
        lambda c, w: c.reduce_scatter(_t(w, 2, dtype=torch.int64), _ts(w, 3, 2, dtype=torch.int64), op=R.AVG),
        id="reduce_scatter-AVG-int",
    ),
    pytest.param(
        "reduce_scatter_tensor",
        "'op'",
        lambda c, w: c.reduce_scatter_tensor(_t(w, 2), _t(w, 6), op=R.BAND),
        id="reduce_scatter_tensor-BAND-float",
    ),
    # roots out of range or of the wrong type
    pytest.param("reduce", "'dst'", lambda c, w: c.reduce(_t(w, 2), dst=3), id="reduce-dst-3"),
    pytest.param("reduce", "'dst'", lambda c, w: c.reduce(_t(w, 2), dst=-1), id="reduce-dst-neg"),
    pytest.param("reduce", "'dst'", lambda c, w: c.reduce(_t(w, 2), dst="0"), id="reduce-dst-str"),
    pytest.param("broadcast", "'src'", lambda c, w: c.broadcast(_t(w, 2), src=WORLD), id="broadcast-src-3"),
    pytest.param("broadcast", "'src'", lambda c, w: c.broadcast(_t(w, 2), src=1.0), id="broadcast-src-float"),
    pytest.param("broadcast", "'src'", lambda c, w: c.broadcast(_t(w, 2), src=True), id="broadcast-src-bool"),
    pytest.param("broadcast", "'src'", lambda c, w: c.broadcast(_t(w, 2), src=None), id="broadcast-src-none"),
    pytest.param("gather", "'dst'", lambda c, w: c.gather(_t(w, 2), dst=5), id="gather-dst"),
    pytest.param("scatter", "'src'", lambda c, w: c.scatter(_t(w, 2), src=-1), id="scatter-src"),
    pytest.param("send", "'dst'", lambda c, w: c.send(_t(w, 2), dst=3), id="send-dst-range"),
    pytest.param("send", "'dst'", lambda c, w: c.send(_t(w, 2), dst=BAD), id="send-to-self"),
    pytest.param("recv", "'src'", lambda c, w: c.recv(_t(w, 2), src=7), id="recv-src-range"),
    pytest.param("recv", "'src'", lambda c, w: c.recv(_t(w, 2), src=BAD), id="recv-from-self"),
    pytest.param("send", "'tag'", lambda c, w: c.send(_t(w, 2), dst=0, tag="a"), id="send-tag"),
    pytest.param("recv", "'tag'", lambda c, w: c.recv(_t(w, 2), src=0, tag=1.5), id="recv-tag"),
    pytest.param("gather_object", "'dst'", lambda c, w: c.gather_object(1, dst=WORLD), id="gather_object-dst"),
    pytest.param("broadcast_object", "'src'", lambda c, w: c.broadcast_object(1, src="0"), id="broadcast_object-src"),
    # list lengths, and size/dtype/device mismatches within one call
    pytest.param("all_gather", "'tensor_list'", lambda c, w: c.all_gather(_ts(w, 2, 2), _t(w, 2)), id="all_gather-len"),
    pytest.param(
        "all_gather", "'tensor_list'", lambda c, w: c.all_gather(_t(w, 3, 2), _t(w, 2)), id="all_gather-not-list"
    ),
    pytest.param(
        "all_gather",
        "'tensor_list[2]'",
        lambda c, w: c.all_gather([*_ts(w, 2, 2), _t(w, 2, dtype=torch.float64)], _t(w, 2)),
        id="all_gather-dtype",
    ),
    pytest.param(
        "all_gather",
        "'tensor_list[0]'",
        lambda c, w: c.all_gather([torch.empty(2, device="meta"), *_ts(w, 2, 2)], _t(w, 2)),
        id="all_gather-device",
    ),
    pytest.param(
        "all_gather",
        f"'tensor_list[{BAD}]'",
        lambda c, w: c.all_gather([_t(w, 2), _t(w, 3), _t(w, 2)], _t(w, 2)),
        id="all_gather-own-shape",
    ),
    pytest.param(
        "all_gather_into_tensor",
        "'output_tensor'",
        lambda c, w: c.all_gather_into_tensor(_t(w, 5), _t(w, 2)),
        id="all_gather_into_tensor-size",
    ),
    pytest.param(
        "all_gather_into_tensor",
        "'output_tensor'",
        lambda c, w: c.all_gather_into_tensor(_t(w, 6, dtype=torch.float64), _t(w, 2)),
        id="all_gather_into_tensor-dtype",
    ),
    pytest.param("gather", "'gather_list'", lambda c, w: c.gather(_t(w, 2), None, dst=BAD), id="gather-dst-needs-list"),
    pytest.param(
        "gather", "'gather_list'", lambda c, w: c.gather(_t(w, 2), _ts(w, 2, 2), dst=BAD), id="gather-list-len"
    ),
    pytest.param(
        "gather",
        "'gather_list[1]'",
        lambda c, w: c.gather(_t(w, 2), [_t(w, 2), _t(w, 4), _t(w, 2)], dst=BAD),
        id="gather-list-shape",
    ),
    pytest.param(
        "gather", "'gather_list'", lambda c, w: c.gather(_t(w, 2), _ts(w, 3, 2), dst=0), id="gather-list-on-non-dst"
    ),
    pytest.param(
        "gather",
        "'gather_list'",
        lambda c, w: c.gather(_t(w, 2), _t(w, 3, 2), dst=0),
        id="gather-tensor-as-list-on-non-dst",
    ),
    pytest.param("scatter", "'scatter_list'", lambda c, w: c.scatter(_t(w, 2), None, src=BAD), id="scatter-src-none"),
    pytest.param(
        "scatter", "'scatter_list'", lambda c, w: c.scatter(_t(w, 2), _ts(w, 4, 2), src=BAD), id="scatter-list-len"
    ),
    pytest.param(
        "scatter",
        "'scatter_list[2]'",
        lambda c, w: c.scatter(_t(w, 2), [*_ts(w, 2, 2), _t(w, 2, dtype=torch.int64)], src=BAD),
        id="scatter-list-dtype",
    ),
    pytest.param(
        "scatter",
        "'scatter_list'",
        lambda c, w: c.scatter(_t(w, 2), _ts(w, 3, 2), src=0),
        id="scatter-list-on-non-src",
    ),
    pytest.param(
        "reduce_scatter",
        "'input_list'",
        lambda c, w: c.reduce_scatter(_t(w, 2), _ts(w, 2, 2)),
        id="reduce_scatter-len",
    ),
    pytest.param(
        "reduce_scatter",
        f"'input_list[{BAD}]'",  # (this rank's input; others' may differ from its output, as in gloo)
        lambda c, w: c.reduce_scatter(_t(w, 2), [*_ts(w, BAD, 2), _t(w, 3), *_ts(w, WORLD - BAD - 1, 2)]),
        id="reduce_scatter-shape",
    ),
    pytest.param(
        "reduce_scatter_tensor",
        "'input'",
        lambda c, w: c.reduce_scatter_tensor(_t(w, 2), _t(w, 5)),
        id="reduce_scatter_tensor-size",
    ),
    pytest.param(
        "all_to_all",
        "'output_tensor_list'",
        lambda c, w: c.all_to_all(_ts(w, 2, 2), _ts(w, 3, 2)),
        id="all_to_all-len",
    ),
    pytest.param(
        "all_to_all",
        "'input_tensor_list[1]'",
        lambda c, w: c.all_to_all(_ts(w, 3, 2), [_t(w, 2), _t(w, 2, dtype=torch.float16), _t(w, 2)]),
        id="all_to_all-dtype",
    ),
    pytest.param(
        "all_to_all",
        f"'output_tensor_list[{BAD}]'",
        lambda c, w: c.all_to_all([_t(w, 2), _t(w, 3), _t(w, 2)], _ts(w, 3, 2)),
        id="all_to_all-own-shape",
    ),
    # split sizes
    pytest.param(
        "all_to_all_single",
        "'input_split_sizes'",
        lambda c, w: c.all_to_all_single(_t(w, 3), _t(w, 3), [1, 1, 1], [1, 2]),
        id="splits-len",
    ),
    pytest.param(
        "all_to_all_single",
        "'input_split_sizes'",
        lambda c, w: c.all_to_all_single(_t(w, 3), _t(w, 3), [1, 1, 1], [2, 2, -1]),
        id="splits-negative",
    ),
    pytest.param(
        "all_to_all_single",
        "'output_split_sizes'",
        lambda c, w: c.all_to_all_single(_t(w, 3), _t(w, 3), [1, 1, 2], [1, 1, 1]),
        id="splits-sum",
    ),
    pytest.param(
        "all_to_all_single",
        "'output_split_sizes'",
        lambda c, w: c.all_to_all_single(_t(w, 3), _t(w, 3), [1.0, 1.0, 1.0], [1, 1, 1]),
        id="splits-float",
    ),
    pytest.param(
        "all_to_all_single",
        "output_split_sizes",
        lambda c, w: c.all_to_all_single(_t(w, 4), _t(w, 3)),
        id="splits-needed-for-uneven-rows",
    ),
    pytest.param(
        "all_to_all_single",
        "'output_split_sizes'",
        lambda c, w: c.all_to_all_single(_t(w, 3), _t(w, 3), 3, [1, 1, 1]),
        id="splits-not-a-list",
    ),
    pytest.param(
        "all_to_all_single",
        "'input_split_sizes'",
        lambda c, w: c.all_to_all_single(_t(w, 3), _t(w, 3), [1, 1, 1], torch.ones(3)),
        id="splits-float-tensor",
    ),
    pytest.param(
        "all_to_all_single",
        "'input_split_sizes'",
        lambda c, w: c.all_to_all_single(_t(w, 3), _t(w, 3), [1, 1, 1], torch.ones(1, 3, dtype=torch.int64)),
        id="splits-2d-tensor",
    ),
    pytest.param(
        "all_to_all_single",
        "'input_split_sizes'",
        lambda c, w: c.all_to_all_single(_t(w, 3), _t(w, 3), [1, 1, 1], torch.tensor([1, 2, 1])),
        id="splits-tensor-sum",
    ),
    pytest.param(
        "all_to_all_single",
        "'output'",
        lambda c, w: c.all_to_all_single(_t(w, 3, dtype=torch.int64), _t(w, 3)),
        id="all_to_all_single-dtype",
    ),
    # object collectives
    pytest.param(
        "scatter_object",
        "'objs'",
        lambda c, w: c.scatter_object([1, 2], src=BAD),
        id="scatter_object-len",
    ),
    pytest.param(
        "broadcast_object",
        "'obj'",
        lambda c, w: c.broadcast_object(Unpicklable(), src=BAD),
        id="broadcast_object-unpicklable",
    ),
    pytest.param(
        "all_gather_object", "'obj'", lambda c, w: c.all_gather_object(lambda: None), id="all_gather_object-lambda"
    ),
    pytest.param(
        "gather_object", "'obj'", lambda c, w: c.gather_object(Unpicklable(), dst=0), id="gather_object-unpicklable"
    ),
    pytest.param(
        "scatter_object",
        "'objs[2]'",
        lambda c, w: c.scatter_object([1, 2, Unpicklable()], src=BAD),
        id="scatter_object-unpicklable",
    ),
    # sub-groups (coroutines: the error comes when awaited, still before joining)
    pytest.param("new_group", "'ranks'", lambda c, w: c.new_group([]), id="new_group-empty"),
    pytest.param("new_group", "'ranks'", lambda c, w: c.new_group([0, 0]), id="new_group-duplicate"),
    pytest.param("new_group", "'ranks[1]'", lambda c, w: c.new_group([0, 5]), id="new_group-range"),
    pytest.param("new_group", "'ranks'", lambda c, w: c.new_group("01"), id="new_group-str"),
    pytest.param("split", "'color'", lambda c, w: c.split([1, 2]), id="split-unhashable"),
]


async def _make(bad_call: BadCall, comm: Comm, watch: Watch) -> None:
    """Make the bad call; await it only if it is a coroutine (new_group, split), never a Work."""
    res = bad_call(comm, watch)
    if inspect.isawaitable(res) and not isinstance(res, Work):
        await res


@pytest.mark.parametrize(("op", "arg", "bad_call"), CASES)
def test_bad_argument_raises_before_any_data_moves(loop: str, op: str, arg: str, bad_call: BadCall) -> None:
    pending: dict[int, Work] = {}
    ready = asyncio.Event()
    seen: list[InvalidArgumentError] = []

    async def fn(comm: Comm) -> list[float]:
        good = torch.full((4,), float(comm.rank + 1))
        if comm.rank != BAD:
            pending[comm.rank] = comm.all_reduce(good)
            if len(pending) == WORLD - 1:
                ready.set()
            await pending[comm.rank]
            return good.tolist()
        await ready.wait()  # every other rank now waits in the all_reduce
        watch: Watch = []
        with pytest.raises(InvalidArgumentError) as ei:
            await _make(bad_call, comm, watch)
        seen.append(ei.value)
        for t, before in watch:
            assert torch.equal(t, before), f"{op} touched a tensor of the failed call"
        # nobody moved: the others' collective is still pending, not completed or failed
        assert not any(w.done() for w in pending.values())
        # and the sequence numbers still line up: the good call meets the others' all_reduce
        await comm.all_reduce(good)
        return good.tolist()

    results = aiocoll.spawn(fn, world=WORLD, loop=loop, timeout=60)
    assert results == [[6.0] * 4] * WORLD
    (err,) = seen
    assert isinstance(err, ValueError)
    msg = str(err)
    assert re.search(rf"\b{op}\b", msg), f"op {op!r} not named in: {msg}"
    assert re.search(rf"\brank {BAD}\b", msg), f"rank {BAD} not named in: {msg}"
    assert arg in msg, f"argument {arg} not named in: {msg}"


def test_uncaught_argument_error_fails_spawn_naming_the_rank(loop: str) -> None:
    got: dict[int, BaseException] = {}

    async def fn(comm: Comm) -> None:
        try:
            await comm.broadcast(torch.ones(2), src=comm.world_size if comm.rank == 2 else 0)
        except BaseException as e:
            got[comm.rank] = e
            raise

    with pytest.raises(InvalidArgumentError, match=r"broadcast on rank 2: argument 'src'") as ei:
        aiocoll.spawn(fn, world=3, loop=loop, timeout=60)
    assert any("rank 2" in n for n in ei.value.__notes__)
    assert isinstance(got[0], aiocoll.WorldAbortedError)
    assert got[0].rank == 2
    assert got[0].__cause__ is ei.value


def test_argument_error_in_sub_group_names_the_group_rank(loop: str) -> None:
    async def fn(comm: Comm) -> str | None:
        sub = await comm.new_group([1, 2])
        if sub is None:
            return None
        with pytest.raises(InvalidArgumentError) as ei:
            sub.send(torch.ones(1), dst=sub.rank)
        await sub.barrier()  # still aligned after the failed call
        return str(ei.value)

    res = aiocoll.spawn(fn, world=3, loop=loop, timeout=60)
    assert res[0] is None
    assert "send on rank 0:" in str(res[1])  # global rank 1 is rank 0 of the sub-group
    assert "send on rank 1:" in str(res[2])


# -- spawn's own arguments -------------------------------------------------------------


async def _ok(comm: Comm) -> int:
    return comm.rank


SPAWN_CASES: list[Any] = [
    pytest.param({"world": 0}, "'world'", id="world-0"),
    pytest.param({"world": -2}, "'world'", id="world-negative"),
    pytest.param({"world": 2.0}, "'world'", id="world-float"),
    pytest.param({"world": "2"}, "'world'", id="world-str"),
    pytest.param({"world": True}, "'world'", id="world-bool"),
    pytest.param({"timeout": 0}, "'timeout'", id="timeout-0"),
    pytest.param({"timeout": -1.0}, "'timeout'", id="timeout-negative"),
    pytest.param({"timeout": float("nan")}, "'timeout'", id="timeout-nan"),
    pytest.param({"timeout": "5"}, "'timeout'", id="timeout-str"),
    pytest.param({"timeout": True}, "'timeout'", id="timeout-bool"),
    pytest.param({"fn": 42}, "'fn'", id="fn-not-callable"),
]


def _spawn_kwargs(bad: dict[str, object]) -> dict[str, Any]:
    return {"fn": _ok, "world": 2, "timeout": 10.0, **bad}


@pytest.mark.parametrize(("bad", "arg"), SPAWN_CASES)
def test_spawn_rejects_bad_arguments(bad: dict[str, object], arg: str) -> None:
    with pytest.raises(InvalidArgumentError) as ei:
        aiocoll.spawn(**_spawn_kwargs(bad))
    assert isinstance(ei.value, ValueError)
    assert "spawn" in str(ei.value)
    assert arg in str(ei.value)


@pytest.mark.parametrize(("bad", "arg"), SPAWN_CASES)
def test_spawn_async_rejects_bad_arguments(bad: dict[str, object], arg: str) -> None:
    async def main() -> None:
        before = asyncio.all_tasks()
        factory = asyncio.get_running_loop().get_task_factory()
        with pytest.raises(InvalidArgumentError) as ei:
            await aiocoll.spawn_async(**_spawn_kwargs(bad))
        assert arg in str(ei.value)
        assert asyncio.all_tasks() == before
        assert asyncio.get_running_loop().get_task_factory() is factory

    asyncio.run(main())


@pytest.mark.parametrize("choice", ["trio", "", 3, None])
def test_spawn_rejects_bad_loop(choice: object) -> None:
    ran: list[int] = []

    async def fn(comm: Comm) -> None:
        ran.append(comm.rank)

    with pytest.raises(InvalidArgumentError, match="'loop'") as ei:
        aiocoll.spawn(fn, world=2, loop=choice)
    assert "spawn" in str(ei.value)
    assert ran == []


def test_a_plain_function_that_returns_a_coroutine_is_refused() -> None:
    # spawn(lambda comm: worker(comm, x)) looks like a sync rank: say so, instead of
    # returning coroutine objects that nobody awaits
    async def worker(comm: aiocoll.Comm, x: int) -> int:
        return x  # pragma: no cover - never awaited

    with pytest.raises(aiocoll.InvalidArgumentError, match=r"returned a coroutine on rank 0; pass an async def"):
        aiocoll.spawn(lambda comm: worker(comm, 1), world=2)
