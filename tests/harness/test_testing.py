"""aiocoll.testing: torch's threaded test harness (MultiThreadedTestCase, spawn_threads_and_init_comms) on aiocoll.

The harness's test classes below are not collected by pytest (``__test__ = False``):
each pytest test runs some of them with unittest and asserts on the outcome, so that
the failing ones can be checked too.
"""

# PyTorch-style test cases: torch's TestCase.assertEqual is the one that compares tensors
# ruff: noqa: PT009

from __future__ import annotations

import asyncio
import gc
import threading
import time
import unittest
import weakref
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from _unittest_runs import problems, run_case
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.testing._internal.common_distributed import MultiThreadedTestCase, spawn_threads_and_init_comms
from torch.testing._internal.distributed._tensor.common_dtensor import DTensorOpTestBase
from torch.testing._internal.distributed.multi_threaded_pg import ProcessLocalGroup, ThreadLocalWorld

import aiocoll
from aiocoll import _collector
from aiocoll._c10d._backend import AiocollProcessGroup
from aiocoll._lifecycle import _worldthread
from aiocoll.testing import ThreadedPGReplacement, replace_threaded_pg

# torch 2.13 renamed a few collectives used below (the old names still work)
pytestmark = pytest.mark.filterwarnings(r"ignore:`torch\.distributed\..*` is deprecated:FutureWarning")

R = dist.ReduceOp


class _Case(MultiThreadedTestCase):
    """The usual shape of a MultiThreadedTestCase: 4 ranks, threads spawned in setUp."""

    __test__ = False

    @property
    def world_size(self) -> int:
        return 4

    def setUp(self) -> None:
        super().setUp()
        self._spawn_threads()


class Collectives(_Case):
    def test_runs_on_aiocoll(self) -> None:
        self.assertIsInstance(dist.group.WORLD, AiocollProcessGroup)
        self.assertEqual(dist.get_backend(), "threaded")  # what the harness asked for
        self.assertEqual((dist.get_rank(), dist.get_world_size()), (self.rank, 4))

    def test_collectives(self) -> None:
        r = self.rank
        t = torch.tensor([r + 1.0])
        dist.all_reduce(t, op=R.PRODUCT)
        self.assertEqual(t.item(), 24.0)
        b = torch.tensor([float(r)])
        dist.broadcast(b, src=2)
        self.assertEqual(b.item(), 2.0)
        ag = [torch.zeros(2) for _ in range(4)]
        dist.all_gather(ag, torch.full((2,), float(r)))
        self.assertEqual([x[0].item() for x in ag], [0.0, 1.0, 2.0, 3.0])
        rs = torch.zeros(1)
        dist.reduce_scatter_tensor(rs, torch.arange(4.0) + r)
        self.assertEqual(rs.item(), 4 * r + 6.0)
        out = torch.zeros(4)
        dist.all_to_all_single(out, torch.arange(4.0) + 10 * r)
        self.assertEqual(out.tolist(), [10.0 * i + r for i in range(4)])
        objs: list[Any] = [None] * 4
        dist.all_gather_object(objs, {"rank": r})
        self.assertEqual(objs, [{"rank": i} for i in range(4)])
        dist.barrier()

    def test_send_recv(self) -> None:
        t = torch.tensor([float(self.rank)])
        if self.rank % 2 == 0:
            dist.send(t, self.rank + 1)
        else:
            dist.recv(t, self.rank - 1)
        self.assertEqual(t.item(), float(self.rank - self.rank % 2))

    def test_new_group(self) -> None:
        evens, odds = dist.new_group([0, 2]), dist.new_group([1, 3])
        mine = evens if self.rank % 2 == 0 else odds
        t = torch.tensor([float(self.rank)])
        dist.all_reduce(t, group=mine)
        self.assertEqual(t.item(), 2.0 if self.rank % 2 == 0 else 4.0)
        self.assertEqual(dist.get_rank(mine), self.rank // 2)
        if self.rank % 2:
            dist.broadcast(t, src=3, group=odds)
            self.assertEqual(t.item(), 4.0)
        else:
            dist.barrier(group=evens)

    def test_device_mesh_2d(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        self.assertEqual(mesh.get_coordinate(), [self.rank // 2, self.rank % 2])
        tp, dp = mesh["tp"].get_group(), mesh["dp"].get_group()
        self.assertIsInstance(tp, AiocollProcessGroup)
        t = torch.tensor([float(self.rank)])
        dist.all_reduce(t, group=tp)  # ranks {0, 1} and {2, 3}
        self.assertEqual(t.item(), 1.0 if self.rank < 2 else 5.0)
        dist.all_reduce(t, group=dp)  # ranks {0, 2} and {1, 3}
        self.assertEqual(t.item(), 6.0)

    def test_functional_collectives(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        x = torch.arange(4.0) + self.rank
        y = funcol.all_reduce(x, "sum", dist.group.WORLD)
        self.assertEqual(y.tolist(), [6.0 + 4 * i for i in range(4)])
        g = funcol.all_gather_tensor(torch.tensor([float(self.rank)]), 0, (mesh, 1))
        self.assertEqual(g.tolist(), [2.0 * (self.rank // 2), 2.0 * (self.rank // 2) + 1])
        s = funcol.reduce_scatter_tensor(torch.ones(4), "sum", 0, (mesh, 0))
        self.assertEqual(s.tolist(), [2.0, 2.0])


class DTensors(DTensorOpTestBase):
    """torch's own DTensor test base, as DTensor's tests use it."""

    __test__ = False

    @property
    def world_size(self) -> int:
        return 4

    def test_distribute_and_full_tensor(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2))
        full = torch.arange(32.0).reshape(4, 8)
        d = distribute_tensor(full, mesh, [Shard(0), Shard(1)])
        row, col = divmod(self.rank, 2)
        self.assertEqual(d.to_local(), full[2 * row : 2 * row + 2, 4 * col : 4 * col + 4])
        self.assertEqual(d.full_tensor(), full)
        self.assertEqual((d * 2).sum().full_tensor(), full.sum() * 2)
        r = d.redistribute(mesh, [Replicate(), Shard(0)])
        self.assertEqual(r.full_tensor(), full)


class Failures(_Case):
    released: ClassVar[dict[int, BaseException]] = {}

    def test_rank_fails(self) -> None:
        if self.rank == 1:
            time.sleep(0.5)  # the others are waiting in the all_reduce by now
            raise ValueError("rank 1 is broken")
        try:
            dist.all_reduce(torch.ones(2))
        except aiocoll.WorldAbortedError as e:
            Failures.released[self.rank] = e
            raise

    def test_mismatch(self) -> None:
        t = torch.ones(2)
        if self.rank == 2:
            dist.broadcast(t, src=0)
        else:
            dist.all_reduce(t)

    def test_returns_early(self) -> None:
        if self.rank != 3:
            dist.barrier()

    def test_unmatched_send(self) -> None:
        if self.rank == 0:
            dist.isend(torch.ones(1), 1)  # rank 1 never receives it

    def test_skip_on_one_rank(self) -> None:
        if self.rank == 0:
            self.skipTest("rank 0 has no use for this")
        dist.barrier()


class Decorated(unittest.TestCase):
    """Tests written with torch's ``@spawn_threads_and_init_comms``."""

    __test__ = False

    @spawn_threads_and_init_comms(world_size=4)
    def test_collectives(self) -> None:
        self.assertIsInstance(dist.group.WORLD, AiocollProcessGroup)
        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t)
        self.assertEqual(t.item(), 6.0)
        mesh = init_device_mesh("cpu", (2, 2))
        d = distribute_tensor(torch.arange(16.0).reshape(4, 4), mesh, [Shard(0), Replicate()])
        self.assertEqual(d.full_tensor().sum().item(), 120.0)

    @spawn_threads_and_init_comms(world_size=3)
    def test_rank_fails(self) -> None:
        if dist.get_rank() == 0:
            time.sleep(0.5)
            raise KeyError("rank 0 gave up")
        dist.broadcast(torch.ones(1), src=0)


class TorchOwn(MultiThreadedTestCase):
    """Checks that torch's own threaded process group is the one in use."""

    __test__ = False

    @property
    def world_size(self) -> int:
        return 2

    def setUp(self) -> None:
        super().setUp()
        self._spawn_threads()

    def test_torch_pg(self) -> None:
        self.assertIsInstance(dist.group.WORLD, ProcessLocalGroup)
        t = torch.tensor([float(self.rank)])
        dist.all_reduce(t)
        self.assertEqual(t.item(), 1.0)


# -- running them -----------------------------------------------------------------------


def _error_of(result: unittest.TestResult) -> str:
    assert not result.failures, problems(result)
    assert len(result.errors) == 1, problems(result)
    return result.errors[0][1]


@pytest.fixture
def aiocoll_pg() -> Iterator[ThreadedPGReplacement]:
    with replace_threaded_pg(timeout=60) as r:
        yield r


# torch 2.11's own harness fails in destroy_process_group: its ThreadLocalWorld lacks the
# new _World.comms. aiocoll's replacement mends that while in force; torch's own cannot pass.
TORCH_OWN_HARNESS_BROKEN = hasattr(dist.distributed_c10d._World, "comms") and not hasattr(ThreadLocalWorld, "comms")


def _check_torch_own_harness() -> None:
    if TORCH_OWN_HARNESS_BROKEN:
        pytest.skip(f"torch {torch.__version__}'s own threaded harness is broken ('ThreadLocalWorld' has no 'comms')")
    result = run_case(TorchOwn)
    assert result.testsRun == 1
    assert result.wasSuccessful(), problems(result)


def _torch_state() -> tuple[Any, ...]:
    """What replace_threaded_pg changes, by identity."""
    return (
        dist.Backend._plugins["THREADED"],
        ProcessLocalGroup.__dict__["exception_handle"],
        ProcessLocalGroup.__dict__["reset"],
    )


@pytest.mark.usefixtures("aiocoll_pg")
def test_collectives_subgroups_mesh_funcol() -> None:
    result = run_case(Collectives)
    assert result.testsRun == 6
    assert result.wasSuccessful(), problems(result)


_worlds_seen: list[weakref.ref[Any]] = []


class KeepsAWorld(_Case):
    def test_one_collective(self) -> None:
        run = aiocoll.testing._current
        assert run is not None
        _worlds_seen.append(weakref.ref(run.world))
        dist.all_reduce(torch.ones(1))


@pytest.mark.usefixtures("aiocoll_pg")
def test_a_runs_world_dies_by_its_own_scope_not_a_later_collection() -> None:
    # nothing of the run may be held through the collection its scope ends with (the
    # registry once held the run as a lease's key): its world would die by a later
    # collection, and piled-up worlds set off full collections at later tests' starts
    _worlds_seen.clear()
    run_case(Collectives, "test_runs_on_aiocoll")  # (first-use set-ups)
    gc.collect()
    gc.disable()  # only the run's own scope collects now
    try:
        result = run_case(KeepsAWorld)
    finally:
        gc.enable()
    assert result.wasSuccessful(), problems(result)
    assert len(_worlds_seen) == 4
    assert all(ref() is None for ref in _worlds_seen)


@pytest.mark.usefixtures("aiocoll_pg")
def test_dtensor() -> None:
    result = run_case(DTensors)
    assert result.testsRun == 1
    assert result.wasSuccessful(), problems(result)


@pytest.mark.usefixtures("aiocoll_pg")
def test_spawn_threads_and_init_comms() -> None:
    result = run_case(Decorated, "test_collectives")
    assert result.wasSuccessful(), problems(result)


@pytest.mark.usefixtures("aiocoll_pg")
def test_failing_rank_releases_the_others_at_once() -> None:
    Failures.released.clear()
    t0 = time.monotonic()
    result = run_case(Failures, "test_rank_fails")
    took = time.monotonic() - t0
    # rank 1 fails after 0.5 s; torch's own process group would keep the others waiting
    assert took < 10, took
    error = _error_of(result)
    assert "Thread 1 exited with exception" in error
    assert "ValueError: rank 1 is broken" in error
    assert "aiocoll: raised on rank 1 of a world of 4" in error
    assert "aiocoll: ranks [0, 2, 3] were aborted because of it" in error
    # the others' errors only echo it, so the report leaves them out
    assert "Thread 0" not in error
    assert "WorldAbortedError" not in error
    assert sorted(Failures.released) == [0, 2, 3]
    for e in Failures.released.values():
        assert isinstance(e, aiocoll.WorldAbortedError)
        assert e.rank == 1
        assert "rank 1 failed with ValueError: rank 1 is broken" in str(e)


@pytest.mark.usefixtures("aiocoll_pg")
def test_failing_rank_with_spawn_threads_and_init_comms() -> None:
    t0 = time.monotonic()
    result = run_case(Decorated, "test_rank_fails")
    assert time.monotonic() - t0 < 10
    error = _error_of(result)
    assert "KeyError: 'rank 0 gave up'" in error
    assert "aiocoll: raised on rank 0 of a world of 3" in error
    assert "aiocoll: ranks [1, 2] were aborted because of it" in error


@pytest.mark.usefixtures("aiocoll_pg")
def test_a_world_that_cannot_start_fails_the_test(monkeypatch: pytest.MonkeyPatch) -> None:
    # the world's loop cannot be made, so its thread ends before the world is built: the
    # ranks' init_process_group used to wait for the world for good
    def no_loop(choice: object) -> Callable[[], asyncio.AbstractEventLoop]:
        def make() -> asyncio.AbstractEventLoop:
            raise OSError("no loop here")

        return make

    monkeypatch.setattr(_worldthread, "loop_factory", no_loop)
    # torch's harness calls init_process_group outside its try: its error ends the rank's
    # thread through threading.excepthook (pytest fails the test on those)
    raised: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: raised.append(args.exc_value))
    runner = threading.Thread(target=run_case, args=(Decorated, "test_collectives"), daemon=True)
    runner.start()
    runner.join(30)
    assert not runner.is_alive(), "the test hung"
    assert len(raised) == 4
    for e in raised:
        assert isinstance(e, RuntimeError)
        assert str(e) == "aiocoll: the harness's world could not start"
        assert isinstance(e.__cause__, OSError)
        assert str(e.__cause__) == "no loop here"
    # and the objects its start set aside (_belongings.world_scope) are back, not set aside for good
    assert gc.get_freeze_count() in (0, _collector.STARTUP_FROZEN)


@pytest.mark.usefixtures("aiocoll_pg")
def test_mismatch_is_reported() -> None:
    error = _error_of(run_case(Failures, "test_mismatch"))
    assert "CollectiveMismatchError: ranks called different collectives" in error
    assert f"rank 2: broadcast(float32[2], src=0) at {__file__}:" in error
    assert f"rank 0: all_reduce(float32[2], op=ReduceOp.SUM) at {__file__}:" in error
    assert error.count("CollectiveMismatchError: ranks called") == 1  # once, not once per rank


@pytest.mark.usefixtures("aiocoll_pg")
def test_deadlock_is_reported() -> None:
    error = _error_of(run_case(Failures, "test_returns_early"))
    assert "DeadlockError: deadlock: every live rank waits" in error
    assert "rank 3: returned" in error
    assert error.count("DeadlockError: deadlock") == 1


@pytest.mark.usefixtures("aiocoll_pg")
def test_skip_on_one_rank_skips_the_test() -> None:
    result = run_case(Failures, "test_skip_on_one_rank")
    assert result.wasSuccessful(), problems(result)
    assert len(result.skipped) == 1


@pytest.mark.usefixtures("aiocoll_pg")
def test_unmatched_send_is_reported() -> None:
    # every rank ended normally, so the test passes, but the send would hang or be lost for real
    with pytest.warns(RuntimeWarning, match=r"1 operation\(s\) no peer ever matched:\n  rank 0: send"):
        result = run_case(Failures, "test_unmatched_send")
    assert result.wasSuccessful(), problems(result)


def test_context_manager_restores_torch_exactly() -> None:
    before, thread_local_world = _torch_state(), set(vars(ThreadLocalWorld))
    with replace_threaded_pg() as outer:
        assert _torch_state()[0] is not before[0]
        with replace_threaded_pg():  # nested: the outer one stays in force
            pass
        assert run_case(Collectives, "test_runs_on_aiocoll").wasSuccessful()
    outer.restore()  # again: a no-op
    assert _torch_state() == before
    assert all(a is b for a, b in zip(_torch_state(), before, strict=True))
    assert set(vars(ThreadLocalWorld)) == thread_local_world  # what was mended (torch 2.11) is gone
    _check_torch_own_harness()


def test_plain_call_until_restore() -> None:
    before, thread_local_world = _torch_state(), set(vars(ThreadLocalWorld))
    r = replace_threaded_pg()
    try:
        assert run_case(Collectives, "test_runs_on_aiocoll").wasSuccessful()
    finally:
        r.restore()
    assert _torch_state() == before
    assert set(vars(ThreadLocalWorld)) == thread_local_world
    _check_torch_own_harness()


def test_bad_timeout() -> None:
    with pytest.raises(aiocoll.InvalidArgumentError, match="timeout"):
        replace_threaded_pg(timeout=0)
