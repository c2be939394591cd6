"""Failure behaviour: a failed rank aborts the world, mismatch and deadlock reports, timeouts.

Every test waits on state (events, counters), never on sleeps to let things settle; the
only sleeps are the "busy rank" being tested. Speed assertions use a spawn timeout of 60 s,
so "at once" means well under it.
"""

from __future__ import annotations

import asyncio
import logging
import re
import sys
import time
import traceback
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import torch
import torch.distributed as dist

import aiocoll
from aiocoll import CollectiveMismatchError, CollectiveTimeoutError, Comm, DeadlockError, WorldAbortedError

RankFn = Callable[[Comm], Coroutine[Any, Any, Any]]

FAST = 5.0
"""Seconds within which an error reported "at once" must come, with a spawn timeout of 60 s."""

THIS_FILE = "test_failures.py"


class Boom(Exception):
    """The user's own failure inside a rank."""


def _explode(rank: int) -> None:
    raise Boom(f"rank {rank} exploded")


def _next_line() -> int:
    """The number of the line after the caller's: call it right above the call to locate."""
    return sys._getframe(1).f_lineno + 1


def _site(line: int) -> str:
    return f"{THIS_FILE}:{line}"


def _outcome(fn: RankFn, world: int, loop: str, timeout: float | None = 60.0) -> tuple[object, float]:
    """What ``spawn`` returned or raised (any BaseException), and how long it took."""
    t0 = time.monotonic()
    try:
        out: object = aiocoll.spawn(fn, world=world, loop=loop, timeout=timeout)
    except BaseException as e:
        out = e
    return out, time.monotonic() - t0


def _failure(fn: RankFn, world: int, loop: str, timeout: float | None = 60.0) -> tuple[BaseException, float]:
    out, elapsed = _outcome(fn, world, loop, timeout)
    assert isinstance(out, BaseException), f"spawn returned {out!r} instead of raising"
    return out, elapsed


def _notes(e: BaseException) -> str:
    return "\n".join(getattr(e, "__notes__", []))


def _rank_line(message: str, rank: int) -> str:
    """The line of a report's table that describes ``rank``."""
    found = [ln for ln in message.splitlines() if re.match(rf"\s+rank {rank}\b", ln)]
    assert len(found) == 1, f"no single line for rank {rank} in:\n{message}"
    return found[0]


# -- a failed rank aborts the world --------------------------------------------------


def test_failed_rank_releases_waiters_cancels_busy_and_spawn_reraises_root(loop: str) -> None:
    got: dict[int, BaseException] = {}
    raised: list[BaseException] = []
    issued: list[int] = []
    ready = asyncio.Event()

    async def fn(comm: Comm) -> None:
        try:
            if comm.rank == 1:
                await ready.wait()  # until ranks 0 and 2 wait in the all_reduce
                try:
                    _explode(1)
                except Boom as e:
                    raised.append(e)
                    raise
            if comm.rank == 3:
                await asyncio.sleep(100)  # busy elsewhere: must be cancelled
            w = comm.all_reduce(torch.ones(2))
            issued.append(comm.rank)
            if len(issued) == 2:
                ready.set()
            await w
        except BaseException as e:
            got[comm.rank] = e
            raise

    err, elapsed = _failure(fn, 4, loop)
    assert elapsed < FAST
    # the root cause itself, not a secondary abort or a wrapper
    assert err is raised[0]
    assert type(err) is Boom
    frames = [f.name for f in traceback.extract_tb(err.__traceback__)]
    assert "_explode" in frames
    assert "fn" in frames
    notes = _notes(err)
    assert re.search(r"\brank 1\b", notes)
    assert "[0, 2, 3]" in notes  # the others, reported as aborted because of it
    for r in (0, 2):
        e = got[r]
        assert isinstance(e, WorldAbortedError), repr(e)
        assert e.rank == 1
        assert e.__cause__ is err
        assert "rank 1" in str(e)
        assert "Boom" in str(e)
    assert isinstance(got[3], asyncio.CancelledError)


def test_abort_releases_every_kind_of_wait(loop: str) -> None:
    """Ranks parked in recv, send and a sub-group collective all get WorldAbortedError."""
    got: dict[int, WorldAbortedError] = {}
    issued: list[int] = []
    ready = asyncio.Event()

    async def fn(comm: Comm) -> None:
        sub = await comm.new_group([0, 2])
        if comm.rank == 3:
            await ready.wait()
            _explode(3)
        if comm.rank == 0:
            w = comm.recv(torch.empty(1), src=3)
        elif comm.rank == 1:
            w = comm.send(torch.ones(1), dst=3)
        else:
            assert sub is not None
            w = sub.barrier()
        issued.append(comm.rank)
        if len(issued) == 3:
            ready.set()
        try:
            await w
        except WorldAbortedError as e:
            got[comm.rank] = e
            raise

    err, elapsed = _failure(fn, 4, loop)
    assert type(err) is Boom
    assert elapsed < FAST
    assert sorted(got) == [0, 1, 2]
    assert all(e.rank == 3 and e.__cause__ is err for e in got.values())


def test_rank_that_catches_abort_may_return(loop: str) -> None:
    caught: dict[int, WorldAbortedError] = {}
    late_done: dict[int, bool] = {}

    async def fn(comm: Comm) -> str:
        if comm.rank == 1:
            _explode(1)
        try:
            await comm.barrier()
        except WorldAbortedError as e:
            caught[comm.rank] = e
        # later calls on an aborted world fail at once instead of hanging
        late = comm.all_reduce(torch.ones(1))
        late_done[comm.rank] = late.done()
        with pytest.raises(WorldAbortedError):
            await late
        return "recovered"

    err, _ = _failure(fn, 3, loop)
    assert type(err) is Boom
    assert sorted(caught) == [0, 2]
    assert all(e.rank == 1 for e in caught.values())
    assert late_done == {0: True, 2: True}
    # the ranks that recovered are not reported as failed or aborted
    assert "were aborted because of it" not in _notes(err)


def test_two_root_causes_one_raised_other_noted(loop: str) -> None:
    async def fn(comm: Comm) -> None:
        if comm.rank == 0:
            raise Boom("first")
        if comm.rank == 1:
            raise KeyError("second")
        await comm.barrier()

    err, _ = _failure(fn, 3, loop)
    assert isinstance(err, Boom | KeyError)
    notes = _notes(err)
    other = ("rank 1", "KeyError") if isinstance(err, Boom) else ("rank 0", "Boom")
    assert all(s in notes for s in other), notes
    assert not isinstance(err, WorldAbortedError)


def test_same_failure_on_every_rank_is_reported_once(loop: str) -> None:
    async def fn(comm: Comm) -> None:
        raise Boom("everyone")

    err, _ = _failure(fn, 3, loop)
    assert type(err) is Boom
    notes = _notes(err)
    assert "rank 0" in notes
    assert "[1, 2]" in notes


def test_rank_failing_with_its_own_timeout_is_the_root_cause(loop: str) -> None:
    got: dict[int, BaseException] = {}

    async def fn(comm: Comm) -> None:
        if comm.rank == 0:
            async with asyncio.timeout(0.01):
                await asyncio.sleep(10)
        try:
            await comm.barrier()
        except BaseException as e:
            got[comm.rank] = e
            raise

    err, _ = _failure(fn, 2, loop)
    assert type(err) is TimeoutError, f"spawn raised {type(err).__name__}: {err}"
    assert "rank 0" in _notes(err)
    assert isinstance(got[1], WorldAbortedError)
    assert got[1].rank == 0


def test_rank_waiting_through_gather_gets_world_aborted(loop: str) -> None:
    got: dict[int, BaseException] = {}

    async def fn(comm: Comm) -> None:
        if comm.rank == 1:
            _explode(1)
        try:
            await asyncio.gather(comm.all_reduce(torch.ones(1)), comm.all_reduce(torch.ones(2)))
        except BaseException as e:
            got[comm.rank] = e
            raise

    err, _ = _failure(fn, 2, loop)
    assert type(err) is Boom
    assert isinstance(got[0], WorldAbortedError), f"rank 0 got {type(got[0]).__name__}"


# -- mismatch detection --------------------------------------------------------------


async def _op_differs(comm: Comm, lines: dict[int, int]) -> None:
    t = torch.ones(2)
    if comm.rank == 0:
        lines[0] = _next_line()
        await comm.all_reduce(t)
    else:
        lines[1] = _next_line()
        await comm.broadcast(t, src=1)


async def _reduce_op_differs(comm: Comm, lines: dict[int, int]) -> None:
    op = dist.ReduceOp.SUM if comm.rank == 0 else dist.ReduceOp.MAX
    lines[comm.rank] = _next_line()
    await comm.all_reduce(torch.ones(2), op=op)


async def _broadcast_src_differs(comm: Comm, lines: dict[int, int]) -> None:
    lines[comm.rank] = _next_line()
    await comm.broadcast(torch.ones(2), src=comm.rank)


async def _reduce_dst_differs(comm: Comm, lines: dict[int, int]) -> None:
    lines[comm.rank] = _next_line()
    await comm.reduce(torch.ones(2), dst=1 - comm.rank)


async def _dtype_differs(comm: Comm, lines: dict[int, int]) -> None:
    t = torch.ones(2, dtype=torch.float32 if comm.rank == 0 else torch.float64)
    lines[comm.rank] = _next_line()
    await comm.all_reduce(t)


async def _shape_differs(comm: Comm, lines: dict[int, int]) -> None:
    t = torch.ones(2 + comm.rank)
    lines[comm.rank] = _next_line()
    await comm.all_reduce(t)


async def _splits_differ(comm: Comm, lines: dict[int, int]) -> None:
    # rank 0 sends 2 rows to rank 1, but rank 1 expects 1 from rank 0
    out, x = torch.zeros(3), torch.arange(3.0)
    if comm.rank == 0:
        lines[0] = _next_line()
        await comm.all_to_all_single(out, x, output_split_sizes=[1, 2], input_split_sizes=[1, 2])
    else:
        lines[1] = _next_line()
        await comm.all_to_all_single(out, x, output_split_sizes=[1, 2], input_split_sizes=[2, 1])


async def _gather_list_shape_differs(comm: Comm, lines: dict[int, int]) -> None:
    # rank 1 contributes 3 elements, rank 0 made room for 2
    x = torch.ones(2 + comm.rank)
    outs = [torch.empty(2), torch.empty(2 if comm.rank == 0 else 3)]
    lines[comm.rank] = _next_line()
    await comm.all_gather(outs, x)


async def _object_src_differs(comm: Comm, lines: dict[int, int]) -> None:
    lines[comm.rank] = _next_line()
    await comm.broadcast_object("x", src=comm.rank)


async def _p2p_shape_differs(comm: Comm, lines: dict[int, int]) -> None:
    if comm.rank == 0:
        lines[0] = _next_line()
        await comm.send(torch.ones(2), dst=1)
    else:
        lines[1] = _next_line()
        await comm.recv(torch.empty(3), src=0)


MISMATCHES = [
    pytest.param(_op_differs, ("all_reduce(float32[2]", "broadcast(float32[2], src=1)"), id="op"),
    pytest.param(_reduce_op_differs, ("op=ReduceOp.SUM", "op=ReduceOp.MAX"), id="reduce-op"),
    pytest.param(_broadcast_src_differs, ("src=0", "src=1"), id="broadcast-src"),
    pytest.param(_reduce_dst_differs, ("dst=1", "dst=0"), id="reduce-dst"),
    pytest.param(_dtype_differs, ("float32[2]", "float64[2]"), id="dtype"),
    pytest.param(_shape_differs, ("float32[2]", "float32[3]"), id="shape"),
    pytest.param(
        _splits_differ,
        ("input_split_sizes=[1, 2]", "input_split_sizes=[2, 1]"),
        id="all_to_all_single-splits",
    ),
    pytest.param(_gather_list_shape_differs, ("all_gather(", "all_gather("), id="all_gather-list-shape"),
    pytest.param(_object_src_differs, ("broadcast_object(src=0)", "broadcast_object(src=1)"), id="object-src"),
    pytest.param(_p2p_shape_differs, ("send(float32[2], dst=1", "recv(float32[3], src=0"), id="send-recv-shape"),
]


@pytest.mark.parametrize(("case", "calls"), MISMATCHES)
def test_mismatch_names_every_call_and_site(
    loop: str, case: Callable[[Comm, dict[int, int]], Coroutine[Any, Any, None]], calls: tuple[str, str]
) -> None:
    lines: dict[int, int] = {}
    got: dict[int, BaseException] = {}

    async def fn(comm: Comm) -> None:
        try:
            await case(comm, lines)
        except BaseException as e:
            got[comm.rank] = e
            raise

    err, elapsed = _failure(fn, 2, loop)
    assert elapsed < FAST
    assert isinstance(err, CollectiveMismatchError), repr(err)
    assert isinstance(err, ValueError)
    msg = str(err)
    for r in (0, 1):
        line = _rank_line(msg, r)
        assert calls[r] in line, f"{calls[r]!r} not in {line!r}"
        assert _site(lines[r]) in line, f"{_site(lines[r])!r} not in {line!r}"
    assert "rank" in _notes(err)
    # both ranks learn of the mismatch, neither hangs
    assert all(isinstance(got[r], CollectiveMismatchError) for r in (0, 1)), got


def test_valid_uneven_all_to_all_single_is_not_a_mismatch(loop: str) -> None:
    """input_split_sizes[j] of rank r == output_split_sizes[r] of rank j: fine, even if uneven."""

    async def fn(comm: Comm) -> list[float]:
        if comm.rank == 0:
            x, out = torch.tensor([1.0, 2.0, 3.0]), torch.zeros(4)
            await comm.all_to_all_single(out, x, output_split_sizes=[1, 3], input_split_sizes=[1, 2])
        else:
            x, out = torch.tensor([10.0, 20.0, 30.0, 40.0]), torch.zeros(3)
            await comm.all_to_all_single(out, x, output_split_sizes=[2, 1], input_split_sizes=[3, 1])
        return out.tolist()

    assert aiocoll.spawn(fn, world=2, loop=loop) == [[1.0, 10.0, 20.0, 30.0], [2.0, 3.0, 40.0]]


def test_mismatch_reported_at_once_when_missing_rank_is_parked_elsewhere(loop: str) -> None:
    got: dict[int, BaseException] = {}
    lines: dict[int, int] = {}

    async def fn(comm: Comm) -> None:
        t = torch.ones(2)
        try:
            if comm.rank == 0:
                await comm.all_reduce(t)
            elif comm.rank == 1:
                await comm.broadcast(t, src=0)
            else:
                lines[2] = _next_line()
                await comm.recv(torch.empty(1), src=0)
        except BaseException as e:
            got[comm.rank] = e
            raise

    err, elapsed = _failure(fn, 3, loop)
    assert elapsed < FAST
    assert isinstance(err, CollectiveMismatchError)
    row = _rank_line(str(err), 2)
    assert "not arrived" in row
    assert "recv(" in row
    assert _site(lines[2]) in row
    assert isinstance(got[0], CollectiveMismatchError)
    assert isinstance(got[1], CollectiveMismatchError)
    assert isinstance(got[2], WorldAbortedError)


# -- deadlock detection --------------------------------------------------------------


def _deadlock(fn: RankFn, world: int, loop: str) -> str:
    err, elapsed = _failure(fn, world, loop, timeout=60.0)
    assert isinstance(err, DeadlockError), f"expected DeadlockError, got {type(err).__name__}: {err}"
    assert elapsed < FAST, f"deadlock took {elapsed:.1f}s to report"
    return str(err)


def test_deadlock_rank_returned_while_others_wait(loop: str) -> None:
    lines: dict[int, int] = {}
    got: dict[int, BaseException] = {}

    async def fn(comm: Comm) -> None:
        if comm.rank == 0:
            return
        try:
            lines[comm.rank] = _next_line()
            await comm.all_reduce(torch.ones(2))
        except BaseException as e:
            got[comm.rank] = e
            raise

    msg = _deadlock(fn, 3, loop)
    assert "returned" in _rank_line(msg, 0)
    for r in (1, 2):
        row = _rank_line(msg, r)
        assert "all_reduce(float32[2]" in row
        assert _site(lines[r]) in row
        assert "[0]" in row  # who it waits for
        assert isinstance(got[r], DeadlockError)


def test_deadlock_both_send_first(loop: str) -> None:
    lines: dict[int, int] = {}

    async def fn(comm: Comm) -> None:
        peer = 1 - comm.rank
        lines[comm.rank] = _next_line()
        await comm.send(torch.ones(1), dst=peer)
        await comm.recv(torch.empty(1), src=peer)

    msg = _deadlock(fn, 2, loop)
    for r in (0, 1):
        row = _rank_line(msg, r)
        assert f"send(float32[1], dst={1 - r}" in row
        assert _site(lines[r]) in row


def test_deadlock_recv_from_rank_that_never_sends(loop: str) -> None:
    async def fn(comm: Comm) -> str:
        if comm.rank == 0:
            await comm.recv(torch.empty(1), src=1)
        return "done"

    msg = _deadlock(fn, 2, loop)
    assert "recv(float32[1], src=1" in _rank_line(msg, 0)
    assert "returned" in _rank_line(msg, 1)


def test_deadlock_send_and_recv_with_different_tags(loop: str) -> None:
    async def fn(comm: Comm) -> None:
        if comm.rank == 0:
            await comm.send(torch.ones(1), dst=1, tag=1)
        else:
            await comm.recv(torch.empty(1), src=0, tag=2)

    msg = _deadlock(fn, 2, loop)
    assert "tag=1" in _rank_line(msg, 0)
    assert "tag=2" in _rank_line(msg, 1)


def test_deadlock_collective_against_p2p(loop: str) -> None:
    async def fn(comm: Comm) -> None:
        if comm.rank == 0:
            await comm.recv(torch.empty(1), src=1)
        await comm.barrier()

    msg = _deadlock(fn, 2, loop)
    assert "recv(" in _rank_line(msg, 0)
    assert "barrier()" in _rank_line(msg, 1)


def test_deadlock_cycle_across_sub_groups(loop: str) -> None:
    async def fn(comm: Comm) -> None:
        g01 = await comm.new_group([0, 1])
        g12 = await comm.new_group([1, 2])
        g02 = await comm.new_group([0, 2])
        mine = {0: g01, 1: g12, 2: g02}[comm.rank]
        assert mine is not None
        await mine.all_reduce(torch.ones(1))

    msg = _deadlock(fn, 3, loop)
    for r, peer in ((0, 1), (1, 2), (2, 0)):
        row = _rank_line(msg, r)
        assert "all_reduce(" in row
        assert f"[{peer}]" in row


def test_deadlock_inside_gather_is_detected(loop: str) -> None:
    # gather runs each Work in a task of the rank; the rank is blocked once they all wait
    async def fn(comm: Comm) -> None:
        t = torch.ones(1)
        if comm.rank == 0:
            await asyncio.gather(comm.all_reduce(t), comm.recv(torch.empty(1), src=1))
        else:
            await comm.all_reduce(t)

    msg = _deadlock(fn, 2, loop)
    assert "blocked in recv(float32[1], src=1, tag=0)" in _rank_line(msg, 0)
    assert "returned" in _rank_line(msg, 1)


def test_deadlock_inside_a_gather_of_many_ops_is_detected(loop: str) -> None:
    # more tasks than the rank's helpers are looked through: its own task's gather still is
    async def fn(comm: Comm) -> None:
        if comm.rank == 0:
            ops = [comm.all_reduce(torch.ones(1)) for _ in range(39)]
            await asyncio.gather(*ops, comm.recv(torch.empty(1), src=1))
        else:
            for _ in range(39):
                await comm.all_reduce(torch.ones(1))

    msg = _deadlock(fn, 2, loop)
    assert "blocked in recv(float32[1], src=1, tag=0)" in _rank_line(msg, 0)
    assert "returned" in _rank_line(msg, 1)


def test_deadlock_inside_nested_gathers_is_detected(loop: str) -> None:
    async def fn(comm: Comm) -> None:
        t = torch.ones(1)
        if comm.rank == 0:
            inner = asyncio.gather(comm.all_reduce(t), comm.recv(torch.empty(1), src=1))
            await asyncio.gather(inner, comm.barrier())
        else:
            await comm.all_reduce(t)
            await comm.barrier()
            await comm.barrier()  # rank 0 went on to no second barrier: it waits in the recv

    msg = _deadlock(fn, 2, loop)
    assert "recv(float32[1], src=1, tag=0)" in _rank_line(msg, 0)
    assert "barrier()" in _rank_line(msg, 1)


def test_deadlock_awaiting_a_task_of_the_rank_is_detected(loop: str) -> None:
    # rank 0's own task awaits a task of its, which waits in a recv; and a chain of two
    async def recv_from_1(comm: Comm) -> None:
        await comm.recv(torch.empty(1), src=1)

    async def via(comm: Comm) -> None:
        await asyncio.create_task(recv_from_1(comm))

    for body in (recv_from_1, via):

        async def fn(comm: Comm) -> None:
            if comm.rank == 0:
                await asyncio.create_task(body(comm))  # noqa: B023 (the loop waits for each spawn)

        msg = _deadlock(fn, 2, loop)
        assert "blocked in recv(float32[1], src=1, tag=0)" in _rank_line(msg, 0)
        assert "returned" in _rank_line(msg, 1)


def test_awaiting_a_task_whose_op_completes_later_is_no_deadlock(loop: str) -> None:
    # rank 0 awaits its task in recv while rank 1 still sleeps: blocked, not deadlocked
    async def fn(comm: Comm) -> float:
        got = torch.zeros(1)
        if comm.rank == 0:

            async def recv() -> None:
                await comm.recv(got, src=1)

            await asyncio.create_task(recv())
        else:
            await asyncio.sleep(0.05)
            await comm.send(torch.full((1,), 4.0), dst=0)
        return got.item()

    out, _ = _outcome(fn, 2, loop)
    assert out == [4.0, 0.0], out


def test_gathered_ops_that_complete_are_no_deadlock(loop: str) -> None:
    # each rank's ops wait in turn while the others' tasks still run: never all blocked
    async def fn(comm: Comm) -> list[float]:
        r, peer = comm.rank, 1 - comm.rank
        got = torch.zeros(1)

        async def later() -> None:
            await asyncio.sleep(0.05)  # a task of the rank that runs while the ops wait
            await comm.send(torch.full((1,), float(r)), dst=peer)

        t = torch.full((1,), float(r + 1))
        await asyncio.gather(comm.all_reduce(t), comm.recv(got, src=peer), later())
        return [t.item(), got.item()]

    out, _ = _outcome(fn, 2, loop)
    assert out == [[3.0, 1.0], [3.0, 0.0]], out


def test_a_rank_that_goes_on_after_a_gather_is_not_blocked(loop: str) -> None:
    # after the gather, rank 0 waits in a recv while a task of its own still runs (it
    # sends what rank 1 waits for): rank 0 is not blocked, whatever order the loop wakes
    # its task and the gather's end in
    async def fn(comm: Comm) -> float:
        t, got = torch.ones(1), torch.zeros(1)
        if comm.rank == 0:

            async def later() -> None:
                await asyncio.sleep(0.1)
                await comm.send(torch.full((1,), 5.0), dst=1)

            background = asyncio.create_task(later())
            await asyncio.gather(comm.all_reduce(t))
            await comm.recv(got, src=1)
            await background
        else:
            await asyncio.sleep(0.05)  # rank 0's gathered all_reduce waits for it
            await comm.all_reduce(t)
            await comm.recv(got, src=0)
            await comm.send(got + 1, dst=0)
        return got.item()

    out, _ = _outcome(fn, 2, loop)
    assert out == [6.0, 5.0], out


def test_a_rank_whose_gather_just_ended_is_not_blocked(loop: str, caplog: pytest.LogCaptureFixture) -> None:
    # rank 1 waits for what rank 0 sends after its gather: as the gathered op's task
    # ends, rank 0's own task is about to wake, not blocked
    async def fn(comm: Comm) -> float:
        t, got = torch.ones(1), torch.zeros(1)
        if comm.rank == 0:
            await asyncio.gather(comm.all_reduce(t))
            await comm.send(torch.full((1,), 5.0), dst=1)
        else:
            await asyncio.sleep(0.05)  # rank 0's gathered all_reduce waits for it
            await comm.all_reduce(t)
            await comm.recv(got, src=0)
        return got.item()

    caplog.set_level(logging.ERROR, logger="asyncio")
    out, _ = _outcome(fn, 2, loop)
    assert out == [0.0, 5.0], out
    # an engine callback that fails is only logged by the loop: fail on that too
    assert not [r.getMessage() for r in caplog.records if r.name == "asyncio"]


def test_after_many_gathers_a_deadlock_is_still_reported_exactly(loop: str) -> None:
    # gathers of every shape came and went (nested, a task gathered by two tasks, one
    # that failed): the counts they moved are back, and a later deadlock is exact
    async def fn(comm: Comm) -> None:
        t = torch.ones(1)
        for _ in range(3):
            await asyncio.gather(comm.all_reduce(t), asyncio.gather(comm.barrier(), comm.all_reduce(t)))
            shared = asyncio.ensure_future(comm.all_reduce(t))
            await asyncio.gather(asyncio.gather(shared), asyncio.gather(shared))
            shared = asyncio.ensure_future(comm.all_reduce(t))

            async def waits(one: asyncio.Future[Any]) -> None:
                await asyncio.gather(one)

            await asyncio.gather(waits(shared), waits(shared))  # two tasks gather one

            async def fails() -> None:
                await comm.barrier()
                raise KeyError("expected")

            got = await asyncio.gather(fails(), comm.all_reduce(t), return_exceptions=True)
            assert isinstance(got[0], KeyError)
        if comm.rank == 1:
            await comm.barrier()  # rank 0 has returned

    msg = _deadlock(fn, 2, loop)
    assert "returned" in _rank_line(msg, 0)
    assert "blocked in barrier()" in _rank_line(msg, 1)


def test_a_gather_that_waits_on_a_future_of_its_own_is_no_deadlock(loop: str) -> None:
    # a future nobody in the world resolves (a timer, I/O): the gathering rank is not blocked
    async def fn(comm: Comm) -> float:
        got = torch.zeros(1)
        if comm.rank == 0:
            loop_ = asyncio.get_running_loop()
            external: asyncio.Future[None] = loop_.create_future()
            sent: list[Any] = []

            def fire() -> None:
                sent.append(comm.send(torch.full((1,), 5.0), dst=1))
                external.set_result(None)

            loop_.call_later(0.2, fire)
            await asyncio.gather(external, comm.recv(got, src=1))
            await sent[0]
        else:
            await comm.recv(got, src=0)
            await comm.send(got + 1, dst=0)
        return got.item()

    out, elapsed = _outcome(fn, 2, loop)
    assert out == [6.0, 5.0], out
    assert elapsed >= 0.2


@pytest.mark.xfail(
    sys.version_info < (3, 12),
    strict=True,
    raises=AssertionError,
    reason="Known limitation on Python 3.11 (docs/limits.md): asyncio.wait_for wraps the Work in a task, so the "
    "waiting rank is not counted as parked and the deadlock is only reported at the timeout",
)
def test_deadlock_inside_wait_for_is_detected(loop: str) -> None:
    async def fn(comm: Comm) -> None:
        if comm.rank == 0:
            await asyncio.wait_for(comm.barrier(), 30)

    out, _ = _outcome(fn, 2, loop, timeout=0.5)
    assert isinstance(out, DeadlockError), f"spawn gave {type(out).__name__}: {out}"


# -- no false positives --------------------------------------------------------------


def test_no_deadlock_while_helper_task_will_issue_the_collective(loop: str) -> None:
    """Rank 0's main task is parked in recv; its helper task later joins the all_reduce."""

    async def fn(comm: Comm) -> float:
        x = torch.tensor([float(comm.rank + 1)])
        if comm.rank == 0:

            async def helper() -> None:
                await asyncio.sleep(0.02)
                await comm.all_reduce(x)

            task = asyncio.create_task(helper())
            got = torch.empty(1)
            await comm.recv(got, src=1)
            await task
            return got.item()
        await comm.all_reduce(x)
        await comm.send(x * 10, dst=0)
        return x.item()

    assert aiocoll.spawn(fn, world=2, loop=loop) == [30.0, 3.0]


def test_no_deadlock_while_a_rank_sleeps_before_arriving(loop: str) -> None:
    async def fn(comm: Comm) -> float:
        if comm.rank == 2:
            await asyncio.sleep(0.05)
        t = torch.ones(1)
        await comm.all_reduce(t)
        return t.item()

    assert aiocoll.spawn(fn, world=3, loop=loop) == [3.0, 3.0, 3.0]


def test_no_deadlock_while_a_rank_is_in_to_thread(loop: str) -> None:
    def compute() -> float:
        time.sleep(0.05)  # a blocking call in a worker thread: the rank is busy, not parked
        return 5.0

    async def fn(comm: Comm) -> float:
        v = await asyncio.to_thread(compute) if comm.rank == 1 else 1.0
        t = torch.tensor([v])
        await comm.all_reduce(t)
        return t.item()

    assert aiocoll.spawn(fn, world=3, loop=loop) == [7.0, 7.0, 7.0]


def test_no_deadlock_with_gather_of_collectives(loop: str) -> None:
    async def fn(comm: Comm) -> list[float]:
        a = torch.tensor([float(comm.rank)])
        b = torch.tensor([10.0 * comm.rank])
        if comm.rank == 1:
            await asyncio.sleep(0.02)  # the others wait in their gathers meanwhile
        await asyncio.gather(comm.all_reduce(a), comm.all_reduce(b))
        return [a.item(), b.item()]

    assert aiocoll.spawn(fn, world=3, loop=loop) == [[3.0, 30.0]] * 3


def test_no_deadlock_with_wait_for_around_a_collective(loop: str) -> None:
    async def fn(comm: Comm) -> float:
        if comm.rank == 1:
            await asyncio.sleep(0.02)
        t = torch.ones(1)
        await asyncio.wait_for(comm.all_reduce(t), 30)
        return t.item()

    assert aiocoll.spawn(fn, world=2, loop=loop) == [2.0, 2.0]


# -- timeouts ------------------------------------------------------------------------


def test_collective_timeout_names_who_arrived(loop: str) -> None:
    got: dict[int, BaseException] = {}

    async def fn(comm: Comm) -> None:
        try:
            if comm.rank == 2:
                await asyncio.sleep(5)  # busy, not parked: a timeout, not a deadlock
            await comm.all_reduce(torch.ones(1))
        except BaseException as e:
            got[comm.rank] = e
            raise

    err, elapsed = _failure(fn, 3, loop, timeout=0.2)
    assert isinstance(err, CollectiveTimeoutError), repr(err)
    assert isinstance(err, TimeoutError)
    assert 0.2 <= elapsed < 2.0  # the sleeping rank was cancelled, not waited for
    msg = str(err)
    assert "all_reduce" in msg
    assert "0.2s" in msg
    assert "ranks [0, 1] arrived" in msg
    assert "ranks [2] did not" in msg
    assert "not arrived" in _rank_line(msg, 2)
    assert isinstance(got[0], CollectiveTimeoutError)
    assert isinstance(got[1], CollectiveTimeoutError)
    assert isinstance(got[2], asyncio.CancelledError)


@pytest.mark.parametrize("op", ["recv", "send"])
def test_p2p_timeout(loop: str, op: str) -> None:
    async def fn(comm: Comm) -> None:
        if comm.rank == 1:
            await asyncio.sleep(5)
        elif op == "recv":
            await comm.recv(torch.empty(1), src=1)
        else:
            await comm.send(torch.ones(1), dst=1)

    err, elapsed = _failure(fn, 2, loop, timeout=0.2)
    assert isinstance(err, CollectiveTimeoutError), repr(err)
    assert isinstance(err, TimeoutError)
    assert elapsed < 2.0
    msg = str(err)
    assert f"{op}(float32[1]" in msg
    assert "rank 0" in msg
    assert "0.2s" in msg


def test_no_timeout_when_timeout_is_none(loop: str) -> None:
    async def fn(comm: Comm) -> float:
        if comm.rank == 0:
            await asyncio.sleep(0.02)
        t = torch.ones(1)
        await comm.all_reduce(t)
        return t.item()

    assert aiocoll.spawn(fn, world=2, loop=loop, timeout=None) == [2.0, 2.0]


def test_timeout_inside_gather_is_reported_as_timeout(loop: str) -> None:
    async def fn(comm: Comm) -> None:
        if comm.rank == 1:
            await asyncio.sleep(5)
        await asyncio.gather(comm.all_reduce(torch.ones(1)), comm.all_reduce(torch.ones(1)))

    out, elapsed = _outcome(fn, 2, loop, timeout=0.2)
    assert elapsed < 2.0
    assert isinstance(out, CollectiveTimeoutError), f"spawn raised {type(out).__name__}: {out}"
