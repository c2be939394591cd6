"""The engine driven directly, without ``spawn``: a World, its groups, ranks and works on a test's event loop.

Each rank is live (as ``spawn`` makes it) but runs no task: the test issues its works
(``World.post``) and says when a rank waits on one (``World.park``), so every step of
the engine and its collaborators (p2p matching, the op runner, liveness and deadlock
detection, the deadlines, fault injection, abort) is seen as it happens.
"""

from __future__ import annotations

import ast
import asyncio
import random
import threading
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

import aiocoll
from aiocoll import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    DeadlockError,
    Fault,
    InjectedFault,
    WorldAbortedError,
)
from aiocoll._engine._faults import FaultPlan
from aiocoll._engine._groups import Group
from aiocoll._engine._inject import FaultProbe
from aiocoll._engine._rank import EngineWork
from aiocoll._engine._record import Recorder
from aiocoll._engine._world import World
from aiocoll._ops import AllReduce, Barrier, Recv, Reduction, Send

SUM = Reduction.of("sum")
WAIT = 30.0  # seconds: a bound on waits that should end at once, so a bug fails instead of hanging


def make_world(size: int, timeout: float | None = None, faults: Sequence[Fault] = ()) -> World:
    """A world on the running loop whose ranks are all live, as spawn makes them."""
    world = World(size, asyncio.get_running_loop(), timeout, faults=FaultPlan(faults, size) if faults else None)
    for st in world.ranks:
        st.enter()
    return world


def issue(world: World, rank: int, call: Any, group: Group | None = None) -> EngineWork:
    """Rank ``rank`` (global) issues ``call`` on ``group`` (default: the world's), from "line" ``rank``."""
    g = world.group if group is None else group
    return world.post(EngineWork(g, g.index[rank], call, ("unit.py", rank)))


def ones(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


async def until(cond: Callable[[], bool]) -> None:
    """Wait (on the loop) until ``cond()`` holds; fail after ``WAIT`` seconds."""
    async with asyncio.timeout(WAIT):
        while not cond():
            await asyncio.sleep(0.001)


def error(work: EngineWork) -> BaseException:
    assert work.done(), work
    exc = work.exception()
    assert exc is not None, work
    return exc


# -- collectives -----------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_collective_completes_when_the_last_rank_arrives() -> None:
    world = make_world(3)
    ts = [ones(1), ones(2), ones(3)]
    w0 = issue(world, 0, AllReduce(ts[0], SUM))
    w1 = issue(world, 1, AllReduce(ts[1], SUM))
    rdv = world.group.pending[0]
    assert rdv.missing() == [2]
    assert not w0.done()
    assert not w1.done()
    assert ts[0].item() == 1.0  # nothing ran yet
    w2 = issue(world, 2, AllReduce(ts[2], SUM))
    assert w0.done()
    assert w1.done()
    assert w2.done()
    assert [t.item() for t in ts] == [6.0, 6.0, 6.0]
    assert world.group.pending == {}
    assert [w._seq for w in (w0, w1, w2)] == [0, 0, 0]
    assert w0._rdv is None  # released: the work <-> rendezvous cycle is broken
    # the next call of each rank is the group's next sequence number
    nxt = issue(world, 1, Barrier())
    assert nxt._seq == 1
    assert list(world.group.pending) == [1]


@pytest.mark.asyncio
async def test_a_collective_in_a_subgroup_numbers_its_own_calls() -> None:
    world = make_world(3)
    sub = world.group.child("k", "sub", [1, 2])
    assert sub.ranks == (1, 2)
    issue(world, 0, Barrier())  # the world's #0, pending
    a, b = ones(1), ones(5)
    wa = issue(world, 1, AllReduce(a, SUM), sub)
    wb = issue(world, 2, AllReduce(b, SUM), sub)
    assert wa.done()
    assert wb.done()
    assert a.item() == b.item() == 6.0
    assert wa._seq == 0
    assert sub.pending == {}
    assert list(world.group.pending) == [0]


@pytest.mark.asyncio
async def test_different_collectives_are_a_mismatch_naming_every_call() -> None:
    world = make_world(2)
    w0 = issue(world, 0, AllReduce(ones(1), SUM))
    assert not w0.done()
    w1 = issue(world, 1, Barrier())
    for w in (w0, w1):
        assert isinstance(error(w), CollectiveMismatchError)
    msg = str(error(w0))
    assert msg.startswith("ranks called different collectives as call #0 of group 'world':")
    assert "rank 0: all_reduce(float32[1], op=ReduceOp.SUM) at unit.py:0" in msg
    assert "rank 1: barrier() at unit.py:1" in msg
    assert error(w0) is not error(w1)  # each rank raises its own
    assert world.aborted is not None
    assert world.group.pending == {}


@pytest.mark.asyncio
async def test_arguments_that_disagree_are_a_mismatch() -> None:
    world = make_world(2)
    w0 = issue(world, 0, AllReduce(ones(1), SUM))
    issue(world, 1, AllReduce(ones(1, 2), SUM))
    assert str(error(w0)).startswith("ranks called all_reduce with arguments that disagree as call #0")


@pytest.mark.asyncio
async def test_a_mismatch_is_reported_rather_than_the_deadlock_it_causes() -> None:
    world = make_world(3)
    w0 = issue(world, 0, AllReduce(ones(1), SUM))
    w1 = issue(world, 1, Barrier())
    r2 = issue(world, 2, Recv(ones(0), 0, 0))  # rank 2 never arrives: it waits for rank 0
    world.park(w0)
    world.park(w1)
    assert not w0.done()  # rank 2 may yet call something: not reported
    world.park(r2)  # now nothing can move: the mismatch explains why
    assert isinstance(error(w0), CollectiveMismatchError)
    assert isinstance(error(w1), CollectiveMismatchError)
    assert "rank 2: not arrived (blocked in recv(float32[1], src=0, tag=0)" in str(error(w0))
    assert isinstance(error(r2), WorldAbortedError)
    assert not isinstance(error(r2), DeadlockError)


# -- p2p matching ----------------------------------------------------------------------


@pytest.mark.asyncio
async def test_p2p_matches_in_issue_order() -> None:
    world = make_world(2)
    s1 = issue(world, 0, Send(ones(1), 1, 0))
    s2 = issue(world, 0, Send(ones(2), 1, 0))
    assert not s1.done()
    assert repr(world.p2p) == "<P2PMatcher unmatched sends=2 recvs=0>"
    x, y = ones(0), ones(0)
    rx = issue(world, 1, Recv(x, 0, 0))
    ry = issue(world, 1, Recv(y, 0, 0))
    assert (x.item(), y.item()) == (1.0, 2.0)
    assert s1.done()
    assert s2.done()
    assert rx.result() == 0
    assert ry.result() == 0
    assert repr(world.p2p) == "<P2PMatcher unmatched sends=0 recvs=0>"


@pytest.mark.asyncio
async def test_p2p_matches_by_tag() -> None:
    world = make_world(2)
    issue(world, 0, Send(ones(7), 1, 7))
    issue(world, 0, Send(ones(8), 1, 8))
    x, y = ones(0), ones(0)
    issue(world, 1, Recv(x, 0, 8))
    issue(world, 1, Recv(y, 0, 7))
    assert (x.item(), y.item()) == (8.0, 7.0)


@pytest.mark.asyncio
async def test_a_recv_waits_for_its_send() -> None:
    world = make_world(2)
    x = ones(0)
    r = issue(world, 1, Recv(x, 0, 3))
    assert not r.done()
    assert world.group.recvs[(1, 3)] == [r]
    issue(world, 0, Send(ones(4), 1, 2))  # another tag: no match
    assert not r.done()
    s = issue(world, 0, Send(ones(5), 1, 3))
    assert s.done()
    assert r.result() == 0
    assert x.item() == 5.0


@pytest.mark.asyncio
async def test_any_source_takes_the_earliest_send_of_any_rank() -> None:
    world = make_world(3)
    issue(world, 2, Send(ones(2), 0, 0))
    issue(world, 1, Send(ones(1), 0, 0))
    a, b = ones(0), ones(0)
    ra = issue(world, 0, Recv(a, None, 0))
    rb = issue(world, 0, Recv(b, None, 0))
    assert (ra.result(), a.item()) == (2, 2.0)
    assert (rb.result(), b.item()) == (1, 1.0)


@pytest.mark.asyncio
async def test_a_send_skips_recvs_for_other_sources() -> None:
    world = make_world(3)
    from1, anyone = ones(0), ones(0)
    r1 = issue(world, 0, Recv(from1, 1, 0))
    r_any = issue(world, 0, Recv(anyone, None, 0))
    issue(world, 2, Send(ones(2), 0, 0))
    assert not r1.done()
    assert r_any.result() == 2
    assert anyone.item() == 2.0


@pytest.mark.asyncio
async def test_a_seeded_schedule_lets_any_queued_sender_win_an_any_source_recv() -> None:
    winners = set()
    for seed in range(20):
        world = make_world(3)
        world.rng = random.Random(seed)
        issue(world, 1, Send(ones(1), 0, 0))
        issue(world, 2, Send(ones(2), 0, 0))
        winners.add(issue(world, 0, Recv(ones(0), None, 0)).result())
    assert winners == {1, 2}
    world = make_world(3)  # unseeded: always the earliest
    issue(world, 1, Send(ones(1), 0, 0))
    issue(world, 2, Send(ones(2), 0, 0))
    assert issue(world, 0, Recv(ones(0), None, 0)).result() == 1


@pytest.mark.asyncio
async def test_a_send_and_recv_that_cannot_transfer_are_a_mismatch() -> None:
    world = make_world(2)
    s = issue(world, 0, Send(ones(1, 2), 1, 0))
    r = issue(world, 1, Recv(ones(1, 2, 3), 0, 0))
    for w in (s, r):
        assert isinstance(error(w), CollectiveMismatchError)
    assert str(error(s)).startswith("send of float32[2] matched a recv into float32[3] on group 'world'")
    assert world.aborted is not None


@pytest.mark.asyncio
async def test_p2p_in_a_subgroup_reports_group_ranks() -> None:
    world = make_world(3)
    sub = world.group.child("k", "sub", [2, 0])  # group-rank 0 is global 2
    x = ones(0)
    issue(world, 2, Send(ones(9), 1, 0), sub)  # to group-rank 1: global 0
    r = issue(world, 0, Recv(x, 0, 0), sub)
    assert r.result() == 0
    assert x.item() == 9.0
    assert world.group.sends == {}
    assert world.group.recvs == {}


# -- liveness and deadlock detection ---------------------------------------------------


@pytest.mark.asyncio
async def test_ranks_count_as_blocked_only_when_every_task_waits() -> None:
    world = make_world(2)
    st = world.ranks[0]
    st.enter()  # a helper task of rank 0
    assert (world.liveness.live, world.liveness.blocked) == (2, 0)
    r = issue(world, 0, Recv(ones(0), 1, 0))
    world.park(r)
    assert st.parked == 1
    assert not st.blocked
    assert world.liveness.blocked == 0
    st.leave()  # the helper ends: rank 0's only task waits
    assert st.blocked
    assert world.liveness.blocked == 1
    issue(world, 1, Send(ones(1), 0, 0))
    assert r.done()
    assert not st.blocked
    assert world.liveness.blocked == 0
    assert repr(world.liveness) == "<Liveness live=2 blocked=0 in_flight=0>"


@pytest.mark.asyncio
async def test_a_deadlock_is_reported_when_every_live_rank_waits() -> None:
    world = make_world(2)
    r0 = issue(world, 0, Recv(ones(0), 1, 0))
    r1 = issue(world, 1, Recv(ones(0), 0, 0))
    world.park(r0)
    assert not r0.done()
    assert world.liveness.blocked == 1
    world.park(r1)
    for w in (r0, r1):
        assert isinstance(error(w), DeadlockError)
    msg = str(error(r0))
    assert msg.startswith("deadlock: every live rank waits for a peer that will never arrive\n")
    assert "rank 0: blocked in recv(float32[1], src=1, tag=0) on group 'world' at unit.py:0" in msg
    assert "-- waits for a send from rank 1" in msg
    assert world.aborted is not None
    assert world.liveness.blocked == 0  # released ranks are no longer parked


@pytest.mark.asyncio
async def test_a_rank_that_ends_while_the_others_wait_is_a_deadlock() -> None:
    world = make_world(3)
    w0 = issue(world, 0, Barrier())
    w1 = issue(world, 1, Barrier())
    world.park(w0)
    world.park(w1)
    assert not w0.done()  # rank 2 is live: it may yet arrive
    world.ranks[2].phase = aiocoll._engine._world.Phase.RETURNED
    world.ranks[2].leave()
    assert isinstance(error(w0), DeadlockError)
    assert "rank 2: returned" in str(error(w0))
    assert "rank 0: blocked in barrier() #0 on group 'world' at unit.py:0 -- waits for ranks [2]" in str(error(w0))


@pytest.mark.asyncio
async def test_an_idle_rank_counts_as_gone_until_it_resumes() -> None:
    world = make_world(3)
    idle = world.ranks[2]
    idle.idle("waiting for its next test")
    idle.resume()  # work came: live again
    idle.idle("waiting for its next test")  # twice is once
    idle.idle("waiting for its next test")
    w0 = issue(world, 0, Barrier())
    world.park(w0)
    assert not w0.done()  # rank 1 is live: it may yet arrive
    w1 = issue(world, 1, Barrier())
    world.park(w1)
    assert isinstance(error(w0), DeadlockError)
    assert "rank 2: waiting for its next test" in str(error(w0))
    assert "waits for ranks [2]" in str(error(w0))


@pytest.mark.asyncio
async def test_no_deadlock_while_an_op_is_in_flight() -> None:
    world = make_world(2)
    world.liveness.in_flight += 1  # say, an op running off the loop will complete
    r0 = issue(world, 0, Recv(ones(0), 1, 0))
    r1 = issue(world, 1, Recv(ones(0), 0, 0))
    world.park(r0)
    world.park(r1)
    assert not r0.done()
    assert not r1.done()
    world.liveness.in_flight -= 1
    world.liveness.check()  # as the runner does when an op in flight ends
    assert isinstance(error(r0), DeadlockError)


@pytest.mark.asyncio
async def test_snapshot_says_whom_a_rank_waits_for() -> None:
    world = make_world(3)
    w = issue(world, 0, Barrier())
    world.park(w)
    snap = world.ranks[0].snapshot()
    assert snap.state == "blocked"
    assert snap.waits_for == (1, 2)
    assert world.ranks[1].snapshot().state == "running"
    assert world.statistics().pending_collectives == 1


# -- the op runner ---------------------------------------------------------------------


@dataclass(slots=True)
class Gated:
    """A collective that sums, on the worker thread, once the test opens its gate."""

    name: ClassVar[str] = "gated"
    tensor: torch.Tensor
    gate: threading.Event

    def signature(self) -> Hashable:
        return self.name

    def describe(self) -> str:
        return "gated()"

    @property
    def nbytes(self) -> int:
        return self.tensor.nbytes

    @staticmethod
    def check(calls: Sequence[Any]) -> str | None:
        return None

    @staticmethod
    def run(calls: Sequence[Gated]) -> list[None]:
        assert calls[0].gate.wait(WAIT)
        total = sum(c.tensor for c in calls)
        for c in calls:
            c.tensor.copy_(total)
        return [None] * len(calls)


@pytest.mark.asyncio
async def test_ops_complete_in_order_behind_an_op_running_off_the_loop() -> None:
    world = make_world(2)
    world.runner.inline_bytes = 0  # every op with data runs on the worker thread
    gate = threading.Event()
    t0, t1 = ones(1), ones(2)
    g0 = issue(world, 0, Gated(t0, gate))
    g1 = issue(world, 1, Gated(t1, gate))
    assert world.runner.busy is not None
    assert world.liveness.in_flight == 1
    # a transfer matched meanwhile reads t0: it must run after the op that writes t0
    x = ones(0)
    s = issue(world, 0, Send(t0, 1, 0))
    r = issue(world, 1, Recv(x, 0, 0))
    assert not s.done()
    assert world.liveness.in_flight == 2
    assert repr(world.runner) == "<OpRunner busy queued=1 remote=0>"
    # while the op is in flight, ranks waiting on it are not deadlocked
    for w in (g0, g1):
        world.park(w)
    assert not g0.done()
    gate.set()
    await asyncio.wait_for(asyncio.gather(g0, r), WAIT)
    assert t0.item() == t1.item() == 3.0
    assert x.item() == 3.0  # the transfer ran after the op
    assert world.runner.busy is None
    assert world.liveness.in_flight == 0
    assert repr(world.runner) == "<OpRunner idle queued=0 remote=0>"


@pytest.mark.asyncio
async def test_an_abort_releases_the_ranks_of_an_op_running_off_the_loop() -> None:
    world = make_world(2)
    world.runner.inline_bytes = 0
    gate = threading.Event()
    g = [issue(world, r, Gated(ones(r), gate)) for r in range(2)]
    x = ones(0)
    s = issue(world, 0, Send(ones(5), 1, 0))
    r = issue(world, 1, Recv(x, 0, 0))
    world.abort(None, RuntimeError("stop"))
    for w in (*g, s, r):
        assert isinstance(error(w), WorldAbortedError)
    assert world.liveness.in_flight == 1  # the op still runs; the queued transfer never will
    gate.set()
    await until(lambda: world.runner.busy is None)
    assert world.liveness.in_flight == 0
    assert x.item() == 0.0


@pytest.mark.asyncio
async def test_a_failing_op_fails_every_rank_with_its_error_and_aborts() -> None:
    world = make_world(2)
    gate = threading.Event()
    gate.set()
    w0 = issue(world, 0, Gated(ones(1), gate))
    w1 = issue(world, 1, Gated(ones(1, 2), gate))  # a sum of 2 elements into rank 0's 1: run raises
    assert isinstance(error(w0), RuntimeError)
    assert error(w0) is error(w1)
    assert world.aborted is not None
    assert world.aborted.__cause__ is error(w0)


@pytest.mark.asyncio
async def test_a_seeded_schedule_releases_ranks_in_a_random_order() -> None:
    async def release_order(seed: int | None) -> tuple[int, ...]:
        world = make_world(4)
        world.rng = None if seed is None else random.Random(seed)
        order: list[int] = []
        works = [EngineWork(world.group, r, Barrier(), None) for r in range(4)]
        for r, w in enumerate(works):
            w._fut.add_done_callback(lambda _, r=r: order.append(r))
        for w in works:
            world.post(w)
        # some are released a few loop turns late: in flight meanwhile, so not deadlocked
        assert world.liveness.in_flight == sum(not w.done() for w in works)
        await asyncio.wait_for(asyncio.gather(*works), WAIT)
        assert world.liveness.in_flight == 0
        return tuple(order)

    assert await release_order(None) == (0, 1, 2, 3)
    orders = [await release_order(seed) for seed in range(10)]
    assert orders == [await release_order(seed) for seed in range(10)]  # reproducible per seed
    assert len(set(orders)) > 1


# -- timeouts --------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_collective_times_out_naming_who_did_not_arrive() -> None:
    world = make_world(2, timeout=0.05)
    w0 = issue(world, 0, AllReduce(ones(1), SUM))
    with pytest.raises(CollectiveTimeoutError) as info:
        await asyncio.wait_for(w0, WAIT)
    assert str(info.value).startswith(
        "all_reduce #0 on group 'world' timed out after 0.05s: ranks [0] arrived, ranks [1] did not:"
    )
    assert world.aborted is not None
    assert world.group.pending == {}


@pytest.mark.asyncio
async def test_an_unmatched_recv_times_out_and_leaves_its_queue() -> None:
    world = make_world(2, timeout=0.05)
    r = issue(world, 0, Recv(ones(0), 1, 4))
    assert world.p2p.waiting == {r}
    with pytest.raises(
        CollectiveTimeoutError,
        match=r"rank 0 waited 0.05s in recv\(.*tag=4\) on group 'world' at unit.py:0; rank 1 did not match it",
    ):
        await asyncio.wait_for(r, WAIT)
    assert world.p2p.waiting == set()
    assert world.pending_works() == []


@pytest.mark.asyncio
async def test_matched_p2p_leaves_the_deadlines_behind() -> None:
    world = make_world(2, timeout=60)
    s = issue(world, 0, Send(ones(1), 1, 0))
    assert world._still_pending(s)
    issue(world, 1, Recv(ones(0), 0, 0))
    assert not world._still_pending(s)
    assert world.p2p.waiting == set()


# -- fault injection -------------------------------------------------------------------


def inject(world: World, rank: int, call: Any) -> EngineWork:
    """Issue ``call`` for ``rank`` as Comm does: a fault its probe picks takes it."""
    assert world.probe is not None
    work = EngineWork(world.group, rank, call, ("unit.py", rank))
    hit = world.probe.issuing(rank, call.name, world.group.name)
    return world.post(work) if hit is None else world.inject(*hit, work)


@pytest.mark.asyncio
async def test_faults_are_the_world_s_probe_and_tell_its_recorder_the_rest() -> None:
    loop = asyncio.get_running_loop()
    assert World(2, loop, None).probe is None
    recorder = Recorder(2, 8)
    assert World(2, loop, None, recorder=recorder).probe is recorder
    world = World(2, loop, None, recorder=recorder, faults=FaultPlan([Fault.delay(rank=0, at=1, seconds=0.01)], 2))
    for st in world.ranks:
        st.enter()
    probe = world.probe
    assert isinstance(probe, FaultProbe)
    assert probe.recorder is recorder
    for call in (Barrier(), Barrier()):
        works = [inject(world, r, call) for r in (0, 1)]
        await asyncio.wait_for(asyncio.gather(*works), WAIT)
    assert list(world.injector.held) == []
    # the recorder heard both barriers, the delayed one too
    assert [(st.group, st.seq, st.outcome) for st in recorder.ranks[0]] == [("world", 0, "ok"), ("world", 1, "ok")]
    assert [(st.group, st.seq) for st in recorder.ranks[1]] == [("world", 0), ("world", 1)]
    # faults alone: stamps are made for the engine, kept nowhere
    alone = World(1, loop, None, faults=FaultPlan([Fault.hang(rank=0, at=5)], 1))
    assert isinstance(alone.probe, FaultProbe)
    assert alone.probe.recorder is None


@pytest.mark.asyncio
async def test_a_delayed_call_is_held_then_joins() -> None:
    world = make_world(2, faults=[Fault.delay(rank=0, at=0, seconds=0.05)])
    t0, t1 = ones(1), ones(2)
    w0 = inject(world, 0, AllReduce(t0, SUM))
    assert w0 in world.injector.held
    assert world.group.pending == {}
    world.park(w0)
    assert world.ranks[0].parked == 0  # late, not waiting for a peer
    w1 = inject(world, 1, AllReduce(t1, SUM))
    assert world.group.pending[0].missing() == [0]
    assert repr(world.injector) == "<FaultInjector held=1 timeout=None>"
    await asyncio.wait_for(w1, WAIT)
    assert w0.done()
    assert t0.item() == t1.item() == 3.0
    assert world.injector.held == {}


@pytest.mark.asyncio
async def test_a_hung_call_makes_its_peers_time_out_naming_it() -> None:
    world = make_world(2, timeout=0.05, faults=[Fault.hang(rank=0, at=0)])
    w0 = inject(world, 0, Barrier())
    w1 = inject(world, 1, Barrier())
    with pytest.raises(CollectiveTimeoutError) as info:
        await asyncio.wait_for(w1, WAIT)
    assert "rank 0: not arrived (hung by an injected fault in barrier (its operation #0))" in str(info.value)
    assert isinstance(error(w0), WorldAbortedError)  # released by the abort
    assert world.injector.held == {}


@pytest.mark.asyncio
async def test_a_hung_call_alone_times_out_after_twice_the_timeout() -> None:
    world = make_world(1, timeout=0.02, faults=[Fault.hang(rank=0)])
    w = inject(world, 0, Barrier())
    with pytest.raises(CollectiveTimeoutError, match=r"rank 0 waited 0.04s in barrier\(\): hung by an injected fault"):
        await asyncio.wait_for(w, WAIT)
    assert world.aborted is not None


@pytest.mark.asyncio
async def test_a_failing_fault_raises_at_the_call() -> None:
    world = make_world(2, faults=[Fault.fail(rank=1, at=1)])
    inject(world, 1, Barrier())  # its operation #0: no fault
    with pytest.raises(InjectedFault, match=r"injected failure on rank 1 at its operation #1 \(barrier\)"):
        inject(world, 1, Barrier())
    assert world.aborted is None


@pytest.mark.asyncio
async def test_a_held_call_from_a_rank_thread_is_held_on_the_loop() -> None:
    world = make_world(2, faults=[Fault.hang(rank=1)])
    works: list[EngineWork] = []
    thread = threading.Thread(target=lambda: works.append(inject(world, 1, Barrier())))
    thread.start()
    thread.join(WAIT)
    await until(lambda: bool(world.injector.held))  # the thread asked the loop to hold it
    assert list(world.injector.held) == works


# -- abort -----------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_abort_fails_every_pending_work_and_every_later_one() -> None:
    world = make_world(3, timeout=60, faults=[Fault.delay(rank=2, at=0, seconds=60)])
    coll = inject(world, 0, Barrier())
    send = inject(world, 1, Send(ones(1), 2, 5))
    held = inject(world, 2, Recv(ones(0), 0, 9))
    recv = inject(world, 2, Recv(ones(0), 0, 9))
    assert held in world.injector.held
    assert len(world.pending_works()) == 3
    cause = RuntimeError("boom")
    world.abort(1, cause)
    for w in (coll, send, held, recv):
        e = error(w)
        assert isinstance(e, WorldAbortedError)
        assert str(e) == "rank 1 failed with RuntimeError: boom"
        assert e.rank == 1
        assert e.__cause__ is cause
    assert world.pending_works() == []
    assert world.injector.held == {}
    assert world.p2p.waiting == set()
    assert world.group.pending == {}
    assert world.group.sends == {}
    assert world.group.recvs == {}
    later = issue(world, 0, Barrier())
    assert isinstance(error(later), WorldAbortedError)
    world.abort(None, ValueError("again"))  # the first abort stands
    assert str(world.aborted) == "rank 1 failed with RuntimeError: boom"


@pytest.mark.asyncio
async def test_cancelling_a_waiting_rank_aborts_the_world() -> None:
    world = make_world(2)
    w0 = issue(world, 0, Barrier())
    waiter = asyncio.ensure_future(asyncio.wait_for(w0, WAIT))
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert world.aborted is not None
    assert str(world.aborted).startswith("rank 0 failed with WorldAbortedError: rank 0 was cancelled while waiting")


# -- the collaborators' shape ------------------------------------------------------------

COLLABORATORS = ("_liveness", "_p2p", "_runner", "_inject")


def _imports(module: str, *, runtime: bool = False) -> set[str]:
    """The engine modules that ``module`` (in ``_engine``) imports (under TYPE_CHECKING too, unless ``runtime``)."""
    tree = ast.parse((Path(aiocoll.__file__).parent / "_engine" / f"{module}.py").read_text(encoding="utf-8"))
    skipped: set[int] = set()
    if runtime:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
                skipped.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module is None:
                out.update(a.name for a in node.names)
            else:
                out.add(node.module.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("aiocoll._engine."):
            out.add((node.module or "").split(".")[2])
    return out


def _imported_by(module: str) -> set[str]:
    """Every engine module that importing ``module`` brings in at run time, itself aside."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        for m in _imports(todo.pop(), runtime=True) - seen - {module}:
            seen.add(m)
            todo.append(m)
    return seen


@pytest.mark.parametrize("module", COLLABORATORS)
def test_collaborators_do_not_import_the_engine(module: str) -> None:
    # they name the world's classes for type checking only: the world imports them
    imports = _imports(module, runtime=True)
    assert "_world" not in imports
    assert "_world" not in _imported_by(module)  # not even through the modules it imports
    # among themselves: only the runner knows the liveness, to tell it of ops in flight
    assert imports & set(COLLABORATORS) == ({"_liveness"} if module == "_runner" else set())


@pytest.mark.asyncio
async def test_the_world_owns_one_of_each_collaborator() -> None:
    world = make_world(2)
    assert repr(world.liveness) == "<Liveness live=2 blocked=0 in_flight=0>"
    assert repr(world.p2p) == "<P2PMatcher unmatched sends=0 recvs=0>"
    assert repr(world.runner) == "<OpRunner idle queued=0 remote=0>"
    assert repr(world.injector) == "<FaultInjector held=0 timeout=None>"
    # the per-op path calls their methods bound once
    assert world._run == world.runner.run
    assert world._send == world.p2p.send
    assert world._recv == world.p2p.recv
    assert world._held is world.injector.held
