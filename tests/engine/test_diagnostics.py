"""Fault injection, seeded interleavings and per-rank output."""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import aiocoll
from aiocoll import Comm, Fault, InjectedFault

STEPS = 4


async def _train(comm: Comm) -> float:
    """A small workload: collectives and p2p, the result depends on every rank."""
    t = torch.ones(2)
    for _ in range(STEPS):
        await comm.all_reduce(t)
    right, left = (comm.rank + 1) % comm.world_size, (comm.rank - 1) % comm.world_size
    got = torch.zeros(2)
    if comm.world_size > 1:
        s = comm.send(t, dst=right)
        await comm.recv(got, src=left)
        await s
    await comm.barrier()
    return float(t.sum() + got.sum())


def _expected(world: int) -> float:
    v = 2.0 * world**STEPS
    return v + (v if world > 1 else 0.0)


# -- fault injection -----------------------------------------------------------------


def test_fail_raises_at_the_chosen_operation(loop: str) -> None:
    with pytest.raises(InjectedFault, match=r"rank 2 at its operation #3 \(all_reduce\)") as info:
        aiocoll.spawn(_train, world=3, loop=loop, faults=[Fault.fail(rank=2, at=3)])
    assert "aiocoll: raised on rank 2 of a world of 3" in info.value.__notes__


def test_fail_with_a_given_exception_and_predicate(loop: str) -> None:
    fault = Fault.fail(rank=1, when=lambda op: op.op == "send", exc=ConnectionResetError("peer gone"))
    with pytest.raises(ConnectionResetError, match="peer gone"):
        aiocoll.spawn(_train, world=3, loop=loop, faults=[fault])
    fault = Fault.fail(rank=0, when=lambda op: op.op == "barrier", exc=ValueError)
    with pytest.raises(ValueError, match=r"rank 0 at its operation #6 \(barrier\)"):
        aiocoll.spawn(_train, world=3, loop=loop, faults=[fault])


def test_hang_makes_the_peers_time_out_naming_the_rank(loop: str) -> None:
    start = time.perf_counter()
    with pytest.raises(aiocoll.CollectiveTimeoutError) as info:
        aiocoll.spawn(_train, world=3, loop=loop, timeout=0.2, faults=[Fault.hang(rank=1, at=2)])
    assert time.perf_counter() - start < 5
    msg = str(info.value)
    assert "ranks [0, 2] arrived, ranks [1] did not" in msg
    assert "rank 1: not arrived (hung by an injected fault in all_reduce (its operation #2))" in msg


def test_delay_changes_nothing_but_time(loop: str) -> None:
    start = time.perf_counter()
    res = aiocoll.spawn(_train, world=3, loop=loop, faults=[Fault.delay(rank=0, at=1, seconds=0.2)])
    assert time.perf_counter() - start >= 0.2
    assert res == [_expected(3)] * 3


def test_faults_on_sync_ranks() -> None:
    def fn(comm: Comm) -> float:
        t = torch.ones(1)
        for _ in range(3):
            dist.all_reduce(t)
        return t.item()

    with pytest.raises(aiocoll.CollectiveTimeoutError, match=r"ranks \[1\] did not"):
        aiocoll.spawn(fn, world=2, timeout=0.2, faults=[Fault.hang(rank=1, at=1)])
    assert aiocoll.spawn(fn, world=2, faults=[Fault.delay(rank=1, at=0, seconds=0.05)]) == [8.0, 8.0]
    with pytest.raises(InjectedFault, match="rank 0 at its operation #2"):
        aiocoll.spawn(fn, world=2, faults=[Fault.fail(rank=0, at=2)])


def test_fault_arguments_are_checked() -> None:
    with pytest.raises(aiocoll.InvalidArgumentError, match="'at'"):
        Fault.fail(rank=0, at=-1)
    with pytest.raises(aiocoll.InvalidArgumentError, match="'seconds'"):
        Fault.delay(rank=0, seconds=-1)
    with pytest.raises(aiocoll.InvalidArgumentError, match="no such rank in a world of 2"):
        aiocoll.spawn(_train, world=2, faults=[Fault.fail(rank=5)])
    with pytest.raises(aiocoll.InvalidArgumentError, match="Fault objects"):
        aiocoll.spawn(_train, world=2, faults=["fail"])  # type: ignore[list-item]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    kind=st.sampled_from(["fail", "hang", "delay"]),
    world=st.integers(1, 4),
    data=st.data(),
)
def test_every_fault_at_random_points_fails_cleanly(kind: str, world: int, data: st.DataObject, loop: str) -> None:
    rank = data.draw(st.integers(0, world - 1), label="rank")
    at = data.draw(st.integers(0, STEPS + 3), label="at")  # past the rank's last op: never fires
    fault = {
        "fail": Fault.fail(rank=rank, at=at),
        "hang": Fault.hang(rank=rank, at=at),
        "delay": Fault.delay(rank=rank, at=at, seconds=0.01),
    }[kind]
    n_ops = STEPS + (3 if world > 1 else 1)  # the rank's operations in _train
    threads, world_state = set(threading.enumerate()), c10d._world

    async def main() -> tuple[list[float] | None, BaseException | None, float]:
        start = time.perf_counter()
        try:
            res = await aiocoll.spawn_async(_train, world=world, timeout=0.2, faults=[fault])
        except Exception as e:
            return None, e, time.perf_counter() - start
        finally:
            leftover = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            assert leftover == []
        return res, None, time.perf_counter() - start

    res, err, took = asyncio.run(main())
    fires = at < n_ops
    if not fires or kind == "delay":
        assert err is None, err
        assert res == [_expected(world)] * world
    elif kind == "fail":
        assert isinstance(err, InjectedFault)
        assert f"rank {rank} at its operation #{at}" in str(err)
    else:  # hang: the peers that wait for it time out; alone, the rank waits on its own
        assert isinstance(err, aiocoll.CollectiveTimeoutError | aiocoll.DeadlockError), err
        assert "hung by an injected fault" in str(err)
    assert took < 5
    assert set(threading.enumerate()) <= threads  # none of its threads is left (others may have ended)
    assert c10d._world is world_state


# -- seeded interleavings ----------------------------------------------------------------


async def _arrivals(comm: Comm) -> list[int]:
    """Rank 0 records the order the others' messages come in (any-source receives)."""
    if comm.rank == 0:
        order = []
        for _ in range(comm.world_size - 1):
            order.append(await comm.recv(torch.zeros(1)))
        return order
    await comm.send(torch.ones(1), dst=0)
    return []


def test_a_seed_replays_the_same_schedule(loop: str) -> None:
    runs = {
        seed: [aiocoll.spawn(_arrivals, world=5, loop=loop, schedule_seed=seed)[0] for _ in range(3)]
        for seed in range(8)
    }
    for seed, orders in runs.items():
        assert orders[0] == orders[1] == orders[2], seed
        assert sorted(orders[0]) == [1, 2, 3, 4]
    assert len({tuple(orders[0]) for orders in runs.values()}) > 1  # seeds do change the order


def test_seeded_schedules_keep_results_right(loop: str) -> None:
    for seed in range(10):
        assert aiocoll.spawn(_train, world=4, loop=loop, schedule_seed=seed) == [_expected(4)] * 4


def test_seeds_shake_out_an_order_dependent_bug() -> None:
    async def racy(comm: Comm) -> None:
        # a bug: rank 0 assumes the first message it receives comes from rank 1
        if comm.rank == 0:
            assert await comm.recv(torch.zeros(1)) == 1, "rank 2's message came first"
            await comm.recv(torch.zeros(1))
        else:
            await comm.send(torch.ones(1), dst=0)

    assert aiocoll.spawn(racy, world=3) == [None] * 3  # the default schedule hides it
    found = aiocoll.find_failing_seed(racy, world=3, seeds=range(50))
    assert found is not None
    assert isinstance(found.error, AssertionError)
    with pytest.raises(AssertionError, match="rank 2's message came first"):
        aiocoll.spawn(racy, world=3, schedule_seed=found.seed)  # replays it
    assert aiocoll.find_failing_seed(_train, world=3, seeds=range(5)) is None


def test_schedule_seed_is_checked() -> None:
    with pytest.raises(aiocoll.InvalidArgumentError, match="'schedule_seed'"):
        aiocoll.spawn(_train, world=2, schedule_seed="x")  # type: ignore[call-overload]


# -- per-rank output ---------------------------------------------------------------------


def test_prefix_output(capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    async def fn(comm: Comm) -> None:
        print(f"hello from {comm.rank}")
        print("two", end="")
        print(" parts")
        sys.stderr.write("to stderr\n")
        logging.getLogger("aiocoll.test").warning("logged by %s", comm.rank)

    print("outside before")
    with caplog.at_level(logging.WARNING, logger="aiocoll.test"):
        aiocoll.spawn(fn, world=2, prefix_output=True)
    print("outside after")
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert lines[0] == "outside before"
    assert lines[-1] == "outside after"
    for r in range(2):
        assert f"[rank {r}] hello from {r}" in lines
        assert f"[rank {r}] two parts" in lines
        assert f"[rank {r}] to stderr" in err.splitlines()
    assert sorted(rec.getMessage() for rec in caplog.records) == ["[rank 0] logged by 0", "[rank 1] logged by 1"]
    assert all(hasattr(rec, "aiocoll_rank") for rec in caplog.records)


def test_prefix_output_is_off_by_default_and_restored(capsys: pytest.CaptureFixture[str]) -> None:
    out_before, factory_before = sys.stdout, logging.getLogRecordFactory()

    def fn(comm: Comm) -> Any:
        print(f"plain {dist.get_rank()}")

    aiocoll.spawn(fn, world=2)
    aiocoll.spawn(fn, world=2, prefix_output=True)
    assert sys.stdout is out_before
    assert logging.getLogRecordFactory() is factory_before
    lines = capsys.readouterr().out.splitlines()
    assert sorted(lines) == ["[rank 0] plain 0", "[rank 1] plain 1", "plain 0", "plain 1"]
