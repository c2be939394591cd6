"""``Issuer`` on a fake process group whose works complete on command: ordering, check gating, abort.

The fake is a ``dist.ProcessGroup`` registered as a backend of its own and made by
``init_process_group``, as a real one is; each call it receives is recorded with its
``dist.Work``, which completes (or fails) only when the test says so. Nothing crosses a
process: what is tested here is the issuer's own logic, which the gloo tests
(``test_process_group.py``) exercise end to end.
"""

from __future__ import annotations

import asyncio
import pickle
from collections.abc import Callable, Coroutine, Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from aiocoll import (
    AiocollError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    InvalidArgumentError,
    WorldAbortedError,
)
from aiocoll import _ops as ops
from aiocoll._bridge._pgissue import Issuer

BACKEND = "aiocoll_fake_issuer"


class FakeWork(dist.Work):
    """A work that completes when ``complete()`` is called."""

    def __init__(self, name: str, tensors: list[torch.Tensor]) -> None:
        super().__init__()
        self.name = name
        self.tensors = tensors
        self.fut: torch.futures.Future[Any] = torch.futures.Future()

    def get_future(self) -> torch.futures.Future[Any]:
        return self.fut

    def is_completed(self) -> bool:
        return self.fut.done()

    def wait(self, timeout: timedelta | None = None) -> bool:
        self.fut.wait()
        return True

    def complete(self, exc: BaseException | None = None) -> None:
        if exc is None:
            self.fut.set_result(None)
        else:
            self.fut.set_exception(exc)


class FakeGroup(dist.ProcessGroup):
    """A process group that records its calls (``works``) and moves no data."""

    def __init__(self, rank: int, size: int) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg,arg-type]
        self.works: list[FakeWork] = []
        self.refuse: RuntimeError | None = None  # raise this at the next call (a broken group)

    @property
    def group_name(self) -> str:  # type: ignore[override]
        return "fake"

    def getBackendName(self) -> str:
        return BACKEND

    def _get_backend(self, device: Any = None) -> FakeGroup:  # type: ignore[override]
        return self  # its own CPU backend: byte exchanges stay on the CPU

    def _call(self, name: str, tensors: list[torch.Tensor]) -> FakeWork:
        if self.refuse is not None:
            raise self.refuse
        work = FakeWork(name, tensors)
        self.works.append(work)
        return work

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> FakeWork:  # type: ignore[override]
        return self._call("allreduce", tensors)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> FakeWork:  # type: ignore[override]
        return self._call("broadcast", tensors)

    def barrier(self, opts: Any = None) -> FakeWork:  # type: ignore[override]
        return self._call("barrier", [])

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> FakeWork:  # type: ignore[override]
        return self._call("send", tensors)

    def names(self) -> list[str]:
        return [w.name for w in self.works]


@pytest.fixture
def group() -> Iterator[FakeGroup]:
    if BACKEND.upper() not in dist.Backend._plugins:  # (registered once per process)
        dist.Backend.register_backend(
            BACKEND, lambda store, rank, size, timeout: FakeGroup(rank, size), devices=["cpu"]
        )
    assert not dist.is_initialized()
    dist.init_process_group(BACKEND, store=dist.HashStore(), rank=0, world_size=2)  # type: ignore[attr-defined]
    try:
        pg = dist.group.WORLD
        assert isinstance(pg, FakeGroup)
        yield pg
    finally:
        dist.destroy_process_group()


class FakeChecker:
    """Stands for the cross-process checks: each collective's gate opens when the test says."""

    def __init__(self) -> None:
        self.gates: list[asyncio.Future[None]] = []

    def gate(self, call: Any, stamp: Any, loop: asyncio.AbstractEventLoop) -> asyncio.Future[None]:
        fut: asyncio.Future[None] = loop.create_future()
        self.gates.append(fut)
        return fut

    async def gone_error(self, what: str, stamp: Any, exc: BaseException) -> BaseException | None:
        return None  # nobody is known to have left


def checked(group: FakeGroup) -> tuple[Issuer, FakeChecker]:
    """An issuer of ``group`` whose collectives wait for checks the test opens (or fails)."""
    iss = Issuer(group)
    chk = FakeChecker()
    iss.checker = chk  # type: ignore[assignment]
    return iss, chk


def run(body: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(asyncio.wait_for(body(), 10))


async def turns(n: int = 5) -> None:
    """Let the loop run callbacks (completions arrive through call_soon_threadsafe)."""
    for _ in range(n):
        await asyncio.sleep(0)


def all_reduce() -> ops.AllReduce:
    return ops.AllReduce(torch.ones(2), ops.Reduction.of("sum"))


def test_ops_reach_the_group_in_call_order_and_complete_with_their_work(group: FakeGroup) -> None:
    async def body() -> None:
        iss = Issuer(group)
        futs = [iss.issue(all_reduce()), iss.issue(ops.Broadcast(torch.ones(3), 0)), iss.issue(ops.Barrier())]
        assert group.names() == ["allreduce", "broadcast", "barrier"]
        await turns()
        assert not any(f.done() for f in futs)  # issued is not done
        assert set(iss.pending) == set(futs)
        group.works[1].complete()
        await turns()
        assert [f.done() for f in futs] == [False, True, False]  # each completes with its own work
        for w in (group.works[0], group.works[2]):
            w.complete()
        assert await asyncio.gather(*futs) == [None, None, None]
        assert not iss.pending
        assert iss.completed == 3

    run(body)


def test_a_multi_step_op_holds_the_group_until_it_ends(group: FakeGroup) -> None:
    async def body() -> None:
        iss = Issuer(group)
        obj = iss.issue(ops.BroadcastObject(pickle.dumps({"a": 1}), 0))  # size, then payload: two broadcasts
        later = iss.issue(all_reduce())
        await turns()
        assert group.names() == ["broadcast"]  # the all_reduce waits behind the object's steps
        group.works[0].complete()
        await turns()
        assert group.names() == ["broadcast", "broadcast"]
        group.works[1].complete()
        assert await obj == {"a": 1}
        await turns()
        assert group.names() == ["broadcast", "broadcast", "allreduce"]  # now, not before
        group.works[2].complete()
        assert await later is None

    run(body)


def test_collectives_wait_for_their_checks_in_call_order(group: FakeGroup) -> None:
    async def body() -> None:
        iss, chk = checked(group)
        first, second = iss.issue(all_reduce()), iss.issue(ops.Barrier())
        assert group.names() == []
        chk.gates[1].set_result(None)  # the second passed its check first: it still waits for the first
        await turns()
        assert group.names() == []
        chk.gates[0].set_result(None)
        await turns()
        assert group.names() == ["allreduce", "barrier"]
        for w in group.works:
            w.complete()
        await asyncio.gather(first, second)

    run(body)


def test_a_failed_check_fails_its_op_and_sends_nothing(group: FakeGroup) -> None:
    async def body() -> None:
        iss, chk = checked(group)
        fut = iss.issue(all_reduce())
        chk.gates[0].set_exception(CollectiveMismatchError("rank 1 called broadcast"))
        with pytest.raises(CollectiveMismatchError, match="rank 1 called broadcast"):
            await fut
        assert group.names() == []

    run(body)


def test_p2p_on_the_cpu_is_not_held_behind_a_check(group: FakeGroup) -> None:
    # gloo matches p2p by tag alone: a send held behind a check that waits for the peer's
    # next collective would deadlock a program that works unchecked
    async def body() -> None:
        iss, chk = checked(group)
        coll = iss.issue(all_reduce())
        sent = iss.issue(ops.Send(torch.ones(2), 1, 0))
        assert group.names() == ["send"]
        group.works[0].complete()
        assert await sent is None
        chk.gates[0].set_result(None)
        await turns()
        group.works[1].complete()
        await coll
        assert group.names() == ["send", "allreduce"]

    run(body)


def test_abort_fails_the_ops_waiting_for_checks_and_every_later_one_at_once(group: FakeGroup) -> None:
    async def body() -> None:
        iss, chk = checked(group)
        waiting = iss.issue(all_reduce())
        reason = CollectiveMismatchError("rank 1 called barrier")
        iss.abort(reason)
        with pytest.raises(WorldAbortedError, match="aborted by an earlier CollectiveMismatchError") as info:
            await waiting
        assert info.value.__cause__ is reason
        later = iss.issue(ops.Barrier())
        assert later.done()  # at once, not sent
        with pytest.raises(WorldAbortedError):
            await later
        chk.gates[0].set_result(None)  # a check that passes after the abort sends nothing
        await turns()
        assert group.names() == []

    run(body)


@pytest.mark.parametrize(
    ("error", "expected"),
    [("Connection closed by peer", WorldAbortedError), ("Timed out waiting 1000ms for recv", CollectiveTimeoutError)],
)
def test_a_group_error_becomes_an_aiocoll_error_that_names_the_op(
    group: FakeGroup, error: str, expected: type[Exception]
) -> None:
    async def body() -> None:
        iss = Issuer(group)
        fut = iss.issue(all_reduce())
        cause = RuntimeError(error)
        group.works[0].complete(cause)
        with pytest.raises(expected, match=r"all_reduce\(float32\[2\].*on rank 0 of group 'fake' \(" + BACKEND) as info:
            await fut
        assert info.value.__cause__ is not None
        assert error in str(info.value.__cause__)
        stamp = iss.recent(1)[0]
        assert stamp.outcome == expected.__name__

    run(body)


def test_a_group_that_refuses_a_call_fails_that_op_only(group: FakeGroup) -> None:
    async def body() -> None:
        iss = Issuer(group)
        group.refuse = RuntimeError("the group is broken")
        with pytest.raises(WorldAbortedError, match="the group is broken"):
            await iss.issue(all_reduce())
        group.refuse = None
        fut = iss.issue(ops.Barrier())
        group.works[0].complete()
        assert await fut is None

    run(body)


def test_bad_arguments_raise_before_anything_is_sent(group: FakeGroup) -> None:
    async def body() -> None:
        iss = Issuer(group)
        bad = ops.AllReduce(torch.ones(2, dtype=torch.complex64), ops.Reduction.of("max"))
        with pytest.raises(InvalidArgumentError, match="complex"):
            iss.issue(bad)
        assert group.names() == []
        assert not iss.pending

    run(body)


def test_a_cancelled_check_fails_its_op_and_the_next_goes_on(group: FakeGroup) -> None:
    async def body() -> None:
        iss, chk = checked(group)
        first, second = iss.issue(all_reduce()), iss.issue(ops.Barrier())
        chk.gates[0].cancel()
        chk.gates[1].set_result(None)
        with pytest.raises(AiocollError, match="its cross-process check was cancelled"):
            await first
        await turns()
        assert group.names() == ["barrier"]  # the unchecked op was never sent; the next one was
        group.works[0].complete()
        assert await second is None

    run(body)
