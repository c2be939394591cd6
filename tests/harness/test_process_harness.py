"""aiocoll.testing.replace_process_harness: torch's multi-process test harness, in one process.

The harness's test classes below are not collected by pytest (``__test__ = False``):
each pytest test runs some of them with unittest and asserts on the outcome, so that
the failing ones can be checked too.
"""

# PyTorch-style test cases: torch's TestCase.assertEqual is the one that compares tensors
# ruff: noqa: PT009

from __future__ import annotations

import atexit
import importlib
import importlib.util
import logging
import multiprocessing
import os
import random
import signal
import socket
import sys
import time
import unittest
import warnings
import weakref
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.distributed.rpc as rpc
from _unittest_runs import problems, run_case
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.testing._internal import common_distributed
from torch.testing._internal.common_distributed import (
    TEST_SKIPS,
    MultiProcContinuousTest,
    MultiProcessTestCase,
    skip_if_lt_x_gpu,
)
from torch.testing._internal.distributed._tensor.common_dtensor import (
    DTensorContinuousTestBase,
    DTensorTestBase,
    with_comms,
)

import aiocoll
import aiocoll._engine._grouptimeouts
import aiocoll._harness._harness
import aiocoll._torch
from aiocoll._c10d._backend import AiocollProcessGroup
from aiocoll._harness._harness import Settings
from aiocoll._process import _libstate
from aiocoll._process._procstate import PID_FLOOR, OnePerProcess
from aiocoll.testing import ProcessHarnessReplacement, replace_process_harness

# ranks record here what the pytest tests then check (one process: they can)
seen: dict[str, Any] = {}


class _Case(MultiProcessTestCase):
    """The usual shape of a MultiProcessTestCase: processes spawned in setUp."""

    __test__ = False
    world = 4

    @property
    def world_size(self) -> int:
        return self.world

    def setUp(self) -> None:
        super().setUp()
        self._spawn_processes()

    def init(self, backend: str = "gloo") -> None:
        dist.init_process_group(
            backend, init_method=f"file://{self.file_name}", rank=self.rank, world_size=self.world_size
        )


class Basics(_Case):
    marker: ClassVar[str] = "class"

    def test_runs_in_this_process(self) -> None:
        self.init()
        self.assertTrue(seen.get("test process"))  # the pytest process's own dict: not a process of its own
        self.assertEqual(dist.get_backend(), "gloo")  # as asked, while the group is aiocoll's
        self.assertIsInstance(dist.group.WORLD, AiocollProcessGroup)
        self.assertEqual((dist.get_rank(), dist.get_world_size()), (self.rank, 4))
        t = torch.tensor([self.rank + 1.0])
        dist.all_reduce(t, op=dist.ReduceOp.PRODUCT)
        self.assertEqual(t.item(), 24.0)
        # a test object and a class of its own, as in a process
        type(self).marker = f"rank {self.rank}"
        seen.setdefault("objects", {})[self.rank] = (id(self), self.file_name)
        dist.barrier()
        self.assertEqual(type(self).marker, f"rank {self.rank}")

    def test_init_methods(self) -> None:
        # env:// with the rank and size given; the store is aiocoll's either way
        dist.init_process_group("gloo", init_method="env://", rank=self.rank, world_size=4)
        dist.barrier()
        dist.destroy_process_group()
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:1", rank=self.rank, world_size=4)
        dist.barrier()
        dist.destroy_process_group()
        store = dist.FileStore(self.file_name, 4)
        dist.init_process_group("cpu:gloo,cuda:nccl", store=store, rank=self.rank, world_size=4)
        self.assertEqual(dist.get_backend(), "cpu:gloo,cuda:nccl")
        objs: list[Any] = [None] * 4
        dist.all_gather_object(objs, self.rank)
        self.assertEqual(objs, [0, 1, 2, 3])

    def test_subgroups_and_mesh(self) -> None:
        self.init()
        evens = dist.new_group([0, 2], backend="gloo")
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        t = torch.tensor([float(self.rank)])
        dist.all_reduce(t, group=mesh["tp"].get_group())
        self.assertEqual(t.item(), 1.0 if self.rank < 2 else 5.0)
        if self.rank % 2 == 0:
            dist.all_reduce(t, group=evens)
            self.assertEqual(t.item(), 6.0)

    def test_leaves_its_group(self) -> None:
        self.init()  # not destroyed: the harness destroys it, and the next test makes its own
        dist.barrier()


class GlooSemantics(_Case):
    """What gloo does that ordinary code relies on, in-process (from test_c10d_gloo.py's init_process_group tests)."""

    def test_coalesced_list_holding_a_tensor_twice(self) -> None:
        self.init()
        t = torch.tensor([self.rank + 1.0])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # ("will be deprecated")
            dist.all_reduce_coalesced([t, t, torch.ones(2)])  # gloo reduces a flat copy: t once
        self.assertEqual(t, torch.tensor([10.0]))

    def test_uneven_reduce_scatter(self) -> None:
        self.init()
        out = torch.empty(self.rank)  # rank i gets i elements
        dist.reduce_scatter(out, [torch.arange(float(i)) + self.rank for i in range(4)])
        self.assertEqual(out, torch.arange(float(self.rank)) * 4 + 6)

    def test_backend_names_and_helpers(self) -> None:
        self.init()
        pg = dist.group.WORLD
        self.assertEqual(pg.name(), "gloo")  # as in processes: the backend asked for
        pg._get_backend(torch.device("cpu")).create_device(interface="lo")  # gloo's, asked of the backend
        dist.monitored_barrier()  # (torch 2.15 asks the group for a CPU backend of its own first)
        dist.monitored_barrier(dist.new_group([0, 1, 2, 3]), wait_all_ranks=True)
        with pytest.raises(ValueError, match="Tensors must be contiguous"):
            dist.all_to_all_single(torch.empty(2, 2), torch.ones(2, 2).t())


class Seeds(_Case):
    def test_seeds_per_rank(self) -> None:
        self.init()
        # run_test seeded every rank alike, as in processes
        first = torch.randn(3)
        torch.manual_seed(self.rank)
        random.seed(self.rank)
        np.random.seed(self.rank)
        dist.barrier()  # the other ranks run meanwhile, and draw
        drawn = (torch.randn(3), random.random(), np.random.rand())
        seen.setdefault("draws", {})[self.rank] = (first, *drawn)

    def test_pid_as_identity(self) -> None:
        # each process's own file, in processes: each rank's own in one, named by a pid of its own
        self.init()
        pid = os.getpid()
        with open(f"{self.file_name}.{pid}", "w") as f:
            f.write(str(self.rank))
        dist.barrier()
        self.assertEqual(os.getpid(), pid)  # stable for the rank's life
        seen.setdefault("pids", {})[self.rank] = (pid, logging.LogRecord("x", 0, "", 0, "", (), None).process)

    def test_environ_per_rank(self) -> None:
        self.init()
        os.environ["LOCAL_RANK"] = str(self.rank)
        os.environ["AIOCOLL_SHARED"] = "same"
        dist.barrier()
        self.assertEqual(os.environ["LOCAL_RANK"], str(self.rank))
        self.assertEqual(os.getenv("AIOCOLL_SHARED"), "same")
        self.assertNotIn("AIOCOLL_TEST_UNSET_ME", os.environ)
        if self.rank == 1:
            del os.environ["AIOCOLL_TEST_PRESET"]
        dist.barrier()
        self.assertEqual("AIOCOLL_TEST_PRESET" in os.environ, self.rank != 1)


class Waits(_Case):
    world = 2

    def test_store_and_polling(self) -> None:
        # ranks that wait for each other through a store or a file, as separate processes can
        store = dist.FileStore(self.file_name, 2)
        flag = self.file_name + ".flag"
        if self.rank == 0:
            self.assertEqual(store.get("from 1"), b"hello")  # rank 1 has not run yet: rank 0 lets it
            store.set("from 0", "hi")
            while not os.path.exists(flag):
                time.sleep(0.01)
            os.remove(flag)
        else:
            store.set("from 1", "hello")
            store.wait(["from 0"])
            open(flag, "w").close()
        seen.setdefault("waited", set()).add(self.rank)

    def test_stores_waiting_in_c_code(self) -> None:
        # a TCPStore's server waits for its client in its constructor, a blocking
        # queue_pop (and a store's barrier) for the other rank: in C code, where aiocoll
        # cannot look, so a rank keeping its turn there would wait out the store's timeout
        files = dist.FileStore(self.file_name, 2)
        timeout = timedelta(seconds=20)
        if self.rank == 0:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            files.set("port", str(port))
            store = dist.TCPStore("127.0.0.1", port, 2, True, timeout=timeout)
            self.assertEqual(store.queue_pop("q"), b"from 1")
        else:
            store = dist.TCPStore("127.0.0.1", int(files.get("port")), 2, False, timeout=timeout)
            store.queue_push("q", "from 1")
        if hasattr(store, "barrier"):  # (torch 2.13 on)
            store.barrier("all here", 2)
        seen.setdefault("stores", set()).add(self.rank)


class Skips(_Case):
    @skip_if_lt_x_gpu(2)
    def test_needs_gpus(self) -> None:
        seen["ran on cpu"] = True

    def test_skip_test(self) -> None:
        self.skipTest("not today")

    def test_exit_code(self) -> None:
        sys.exit(TEST_SKIPS["odd_worldsize"].exit_code)


class Failures(_Case):
    def test_rank_fails(self) -> None:
        self.init()
        if self.rank == 1:
            time.sleep(0.3)  # the others wait in the barrier by now
            raise ValueError("rank 1 is broken")
        dist.barrier()

    def test_mismatch(self) -> None:
        self.init()
        t = torch.ones(2)
        if self.rank == 2:
            dist.broadcast(t, src=0)
        else:
            dist.all_reduce(t)

    def test_returns_early(self) -> None:
        self.init()
        if self.rank != 3:
            dist.barrier()

    def test_slow_rank(self) -> None:
        self.init()
        dist.barrier()
        if self.rank == 0:
            time.sleep(1.5)  # holding its turn: the others wait in the next barrier
        dist.barrier()

    def test_past_the_timeout(self) -> None:
        self.init()
        if self.rank == 2:
            time.sleep(2.5)
        dist.barrier()


class NeedsProcesses(_Case):
    world = 2

    def test_os_exit(self) -> None:
        if self.rank == 1:
            os._exit(0)  # in processes: rank 1 exits, rank 0 passes

    def test_signal_handler(self) -> None:
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)

    def test_gloo_directly(self) -> None:
        dist.ProcessGroupGloo(dist.FileStore(self.file_name, 2), self.rank, 2)

    @unittest.skipUnless(rpc.is_available(), "torch.distributed.rpc is not available")
    def test_rpc_agent(self) -> None:
        options = rpc.TensorPipeRpcBackendOptions(init_method=f"file://{self.file_name}")
        rpc.init_rpc(f"worker{self.rank}", rank=self.rank, world_size=2, rpc_backend_options=options)
        got = rpc.rpc_sync(f"worker{1 - self.rank}", torch.add, args=(torch.ones(2), self.rank))
        rpc.shutdown()
        self.assertEqual(got, torch.full((2,), 1.0 + self.rank))

    def test_ddp_logging_data(self) -> None:
        self.init()
        ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
        self.assertEqual(ddp._get_ddp_logging_data()["backend_name"], "gloo")  # gloo's own, in processes

    def test_profiler(self) -> None:
        self.init()
        with torch.autograd.profiler.profile() as prof:
            dist.all_reduce(torch.ones(1))
        # in a process, the backend's own event ("gloo:all_reduce", as torch's suite checks)
        self.assertTrue(any(e.name.startswith("gloo:all_reduce") for e in prof.function_events))

    def test_backend_by_name(self) -> None:  # (as a test that lists the registered backends does)
        dist.init_process_group("aiocoll", init_method=f"file://{self.file_name}", rank=self.rank, world_size=2)

    def test_separate_worlds(self) -> None:
        dist.init_process_group("gloo", init_method=f"file://{self.file_name}.{self.rank}", rank=0, world_size=1)

    def test_sparse_all_reduce(self) -> None:  # gloo reduces sparse tensors; aiocoll does not
        self.init()
        dist.all_reduce(torch.sparse_coo_tensor([[self.rank]], [1.0], size=(2,)))

    def setUp(self) -> None:
        super().setUp()
        if self._testMethodName == "test_exit_codes_checked":
            self.skip_return_code_checks = [self.test_exit_codes_checked.__wrapped__]  # type: ignore[attr-defined]

    def test_exit_codes_checked(self) -> None:
        pass


class DTensors(DTensorTestBase):
    """torch's own DTensor test base, as DTensor's tests use it."""

    __test__ = False

    @property
    def world_size(self) -> int:
        return 4

    @with_comms
    def test_distribute_and_backward(self) -> None:
        mesh = self.build_device_mesh()
        self.assertEqual(dist.get_backend(), self.backend)
        full = torch.randn(8, 4)  # the same on every rank: run_test seeded them alike
        d = distribute_tensor(full, mesh, [Shard(0)]).requires_grad_()
        self.assertEqual(d.full_tensor(), full)
        r = d.redistribute(mesh, [Replicate()])
        r.to_local().sum().backward()
        self.assertEqual(d.grad.placements, (Shard(0),))
        self.assertEqual(d.grad.to_local(), torch.ones(2, 4))
        p = DTensor.from_local(torch.ones(2), mesh, [Partial()])
        self.assertEqual(p.full_tensor(), torch.full((2,), 4.0))
        local = torch.randn(2, requires_grad=True)  # views of it are broadcast into: autograd must not mind
        views = local.chunk(2)
        distribute_tensor(local, mesh, [Replicate()])
        self.assertEqual(views[0].sum() + views[1].sum(), local.sum())

    @with_comms
    def test_fails(self) -> None:
        if self.rank == 3:
            raise AssertionError("rank 3 disagrees")
        dist.barrier()


class _OnTheCpu(DTensorContinuousTestBase):
    """torch's continuous DTensor base, on the CPU wherever it runs.

    torch's own ``_init_pg`` binds each rank to a GPU when the machine has any, and skips
    the class when it has fewer GPUs than ranks (found on a one-GPU machine, where every
    continuous test here was skipped): these tests are about the harness, on gloo.
    """

    __test__ = False

    @classmethod
    def backend_str(cls) -> str:
        # (torch's answers nccl where CUDA is there: a test that falls back to torch's own
        # workers then fails on a one-GPU machine, "Duplicate GPU detected")
        return "gloo"

    @classmethod
    def _init_pg(cls, rank: int, world_size: int, rdvz_file: str) -> None:
        MultiProcContinuousTest._init_pg.__func__(cls, rank, world_size, rdvz_file)  # type: ignore[attr-defined]


class Continuous(_OnTheCpu):
    """torch's test base that keeps its processes across a class's tests."""

    __test__ = False
    world_size = 4

    def test_mesh(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        full = torch.arange(16.0).reshape(4, 4)
        self.assertEqual(distribute_tensor(full, mesh, [Shard(0)]).full_tensor(), full)
        self.assertEqual(self.rank, dist.get_rank())
        self.assertIs(type(self).pg, dist.group.WORLD)  # the class attribute _init_pg set, per rank
        seen.setdefault("continuous", set()).add(self.rank)

    @skip_if_lt_x_gpu(2)
    def test_skip(self) -> None:
        seen["ran on cpu"] = True

    def test_signal_handler(self) -> None:
        # needs a process of its own: runs on torch's workers for the class, started now
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        self.assertNotEqual(os.getpid(), int(os.environ["AIOCOLL_TEST_PID"]))
        dist.barrier()

    def test_zz_fails(self) -> None:  # last: a failure skips the class's later tests, as in torch
        if self.rank == 2:
            raise KeyError("rank 2 lost it")
        dist.barrier()


class ContinuousSignal(_OnTheCpu):
    """A class of one continuous test that needs processes of its own (its class is not poisoned by another's)."""

    __test__ = False
    world_size = 2
    test_signal_handler = Continuous.test_signal_handler


class ContinuousKeeps(_OnTheCpu):
    """A class whose second test finds what the first left, as in the processes torch keeps for a class."""

    __test__ = False
    world_size = 2

    @classmethod
    def _init_pg(cls, rank: int, world_size: int, rdvz_file: str) -> None:
        seen.setdefault("init_pg", []).append(rank)
        super()._init_pg(rank, world_size, rdvz_file)  # type: ignore[misc]

    def test_1_remember(self) -> None:
        type(self).remembered = (self.rank, id(type(self).pg), torch.randn(2))  # type: ignore[attr-defined]
        dist.barrier()

    def test_2_recall(self) -> None:
        rank, pg, drawn = type(self).remembered  # type: ignore[attr-defined]
        self.assertEqual((rank, pg), (self.rank, id(type(self).pg)))
        t = drawn.clone()
        dist.all_reduce(t)
        seen.setdefault("recalled", {})[self.rank] = t


class ContinuousEarly(_OnTheCpu):
    """A continuous test whose rank 1 ends it early while rank 0 waits for it in a collective."""

    __test__ = False
    world_size = 2

    def test_returns_early(self) -> None:
        if self.rank == 0:
            dist.barrier()


class ContinuousDies(_OnTheCpu):
    """A continuous test that needs processes and whose worker then dies there."""

    __test__ = False
    world_size = 2

    def test_worker_exits(self) -> None:
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        if self.rank == 1:
            os._exit(3)


class AtExit(_Case):
    """A rank's atexit handlers run when the rank ends, as at its process's exit: in order, last first."""

    world = 2

    def test_handlers(self) -> None:
        self.init()
        ran = seen.setdefault("atexit", [])
        atexit.register(ran.append, (self.rank, "first"))
        atexit.register(ran.append, (self.rank, "second"))
        atexit.register(ran.append, (self.rank, "dropped"))
        atexit.unregister(ran.append)  # (all three: unregister goes by function)
        atexit.register(lambda: ran.append((self.rank, "last registered")))
        atexit.register(lambda: ran.append((self.rank, "runs first")))
        dist.barrier()
        assert [w for r, w in ran if r == self.rank] == []  # not yet: this rank has not ended


class Logging(_Case):
    """Each rank configures logging as its process's own, and a rank's assertLogs sees its own records."""

    world = 2

    def test_basic_config(self) -> None:
        self.init()
        out = seen.setdefault("logging", {})[self.rank] = []

        class ToList(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                out.append(self.format(record))

        logging.basicConfig(level=logging.INFO, format=f"rank {self.rank}: %(message)s", handlers=[ToList()])
        dist.barrier()  # (both ranks' configurations in place before either logs)
        logging.getLogger("aiocoll.test.harness").info("from %d", self.rank)
        assert [type(h) for h in logging.getLogger().handlers] == [ToList]
        dist.barrier()
        with self.assertLogs("aiocoll.test.harness", level="INFO") as caught:
            logging.getLogger("aiocoll.test.harness").info("caught on %d", self.rank)
            dist.barrier()  # (the other rank runs inside its own assertLogs meanwhile)
        assert caught.output == [f"INFO:aiocoll.test.harness:caught on {self.rank}"]


class NoRanks(DTensorTestBase):
    """torch's test_state_dict.py asks for min(4, torch.cuda.device_count()) ranks: none on a CPU."""

    @property
    def world_size(self) -> int:
        return 0

    @with_comms
    def test_body_never_runs(self) -> None:
        raise AssertionError("a rank ran")  # pragma: no cover - there are no ranks


class TorchOwn(_Case):
    """Checks that torch's own harness (processes) is the one in use."""

    world = 2

    def test_in_processes(self) -> None:
        if seen.get("test process"):  # (a process of its own imported this module afresh)
            raise AssertionError("ran in the test process")


# -- running them -----------------------------------------------------------------------


def _failure_of(result: unittest.TestResult) -> str:
    found = result.errors + result.failures
    assert len(found) == 1, problems(result)
    return found[0][1]


@pytest.fixture(autouse=True)
def _seen() -> Iterator[None]:
    seen.clear()
    seen["test process"] = True
    yield
    seen.clear()


@pytest.fixture
def harness() -> Iterator[ProcessHarnessReplacement]:
    with replace_process_harness(timeout=60) as r:
        yield r


def _torch_state() -> tuple[Any, ...]:
    """What replace_process_harness changes, by identity."""
    return (
        MultiProcessTestCase.__dict__["_start_processes"],
        MultiProcessTestCase.__dict__["_join_processes"],
        MultiProcContinuousTest.__dict__["_spawn_processes"],
        c10d._new_process_group_helper,
        c10d.rendezvous,
    )


# 1. the tests run unmodified, in this process


def test_ranks_run_in_process_with_objects_of_their_own(harness: ProcessHarnessReplacement) -> None:
    result = run_case(Basics)
    assert result.testsRun == 4
    assert result.wasSuccessful(), problems(result)
    objects = seen["objects"]
    assert sorted(objects) == [0, 1, 2, 3]
    assert len({obj for obj, _ in objects.values()}) == 4
    assert len({name for _, name in objects.values()}) == 1  # the test's file_name, shared
    assert Basics.marker == "class"  # the ranks set their own classes'
    assert harness.fallbacks == []
    assert not dist.is_initialized()  # this thread's c10d state was never touched


def test_dtensor_test_base(harness: ProcessHarnessReplacement) -> None:
    result = run_case(DTensors, "test_distribute_and_backward")
    assert result.wasSuccessful(), problems(result)


def test_continuous_test_base(harness: ProcessHarnessReplacement, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIOCOLL_TEST_PID", str(os.getpid()))
    result = run_case(Continuous)
    assert result.testsRun == 4
    assert seen["continuous"] == {0, 1, 2, 3}
    # a test that needs processes of its own ran on torch's own workers, and passed there
    assert [t for t, _ in harness.fallbacks] == [f"{__name__}.Continuous.test_signal_handler"]
    assert "installed a handler for signal" in harness.fallbacks[0][1]
    assert [t.id().rsplit(".", 1)[1] for t, _ in result.skipped] == ["test_skip"], problems(result)
    assert "ran on cpu" not in seen
    failure = _failure_of(result)
    assert "RuntimeError: Exception in worker process" in failure
    assert "KeyError: 'rank 2 lost it" in failure
    assert "aiocoll: raised on rank 2 of a world of 4" in failure
    assert "aiocoll: ranks [0, 1, 3] were aborted because of it" in failure
    assert failure.count("aiocoll: raised on rank") == 1


def test_continuous_test_needing_processes_is_skipped_with_the_reason() -> None:
    with replace_process_harness(fallback="skip") as harness:
        result = run_case(ContinuousSignal)
    assert result.testsRun == 1
    assert result.wasSuccessful(), problems(result)
    [(test, reason)] = result.skipped
    assert test.id().endswith("test_signal_handler")
    assert reason.startswith("aiocoll: ")
    assert reason.endswith(": the test needs processes of its own")
    assert "installed a handler for signal" in reason
    assert len(harness.fallbacks) == 1


@pytest.mark.parametrize("gpus", [0, 1])
def test_continuous_ranks_live_for_their_class(
    harness: ProcessHarnessReplacement, monkeypatch: pytest.MonkeyPatch, gpus: int
) -> None:
    seen.pop("init_pg", None)
    if gpus:  # as on a one-GPU machine, where torch's base would skip the class (see _OnTheCpu)
        monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
        monkeypatch.setattr(torch.accelerator, "device_count", lambda: gpus)
    result = run_case(ContinuousKeeps)
    assert result.testsRun == 2
    assert result.wasSuccessful(), problems(result)
    assert sorted(seen["init_pg"]) == [0, 1]  # the group is made once for the class, per rank
    assert torch.equal(seen["recalled"][0], seen["recalled"][1])
    assert harness.fallbacks == []


def test_continuous_rank_that_ends_a_test_early_is_a_deadlock_at_once(harness: ProcessHarnessReplacement) -> None:
    start = time.monotonic()
    result = run_case(ContinuousEarly)
    assert time.monotonic() - start < 10  # not the collective timeout (60 s here)
    failure = _failure_of(result)
    assert "DeadlockError" in failure
    assert "rank 1: waiting for its next test" in failure


def test_continuous_worker_that_dies_in_processes_fails_the_test(harness: ProcessHarnessReplacement) -> None:
    result = run_case(ContinuousDies)
    assert result.testsRun == 1
    assert [t for t, _ in harness.fallbacks] == [f"{__name__}.ContinuousDies.test_worker_exits"]
    assert "Exited with 3" in _failure_of(result)


def test_gloo_semantics_in_process(harness: ProcessHarnessReplacement) -> None:
    result = run_case(GlooSemantics)
    assert result.testsRun == 3
    assert result.wasSuccessful(), problems(result)
    assert harness.fallbacks == []


# 2. each rank has its process state


def test_seeds_and_generators_per_rank(harness: ProcessHarnessReplacement) -> None:
    # torch's TestCase.setUp seeds this thread too (as it does the parent process under torch's
    # harness): what this thread holds after it is what the ranks must leave alone
    from torch.testing._internal.common_utils import SEED

    torch.manual_seed(SEED)
    state = torch.random.get_rng_state()
    result = run_case(Seeds, "test_seeds_per_rank")
    assert result.wasSuccessful(), problems(result)
    draws = seen["draws"]
    for r in range(1, 4):
        assert torch.equal(draws[r][0], draws[0][0])  # seeded alike by torch's run_test
    for r in range(4):
        g = torch.Generator().manual_seed(r)
        assert torch.equal(draws[r][1], torch.randn(3, generator=g))
        assert draws[r][2] == random.Random(r).random()
        assert draws[r][3] == np.random.RandomState(r).rand()
    assert torch.equal(torch.random.get_rng_state(), state)  # this thread's generator is its own


def test_each_rank_has_a_pid_of_its_own_that_no_process_has(harness: ProcessHarnessReplacement) -> None:
    result = run_case(Seeds, "test_pid_as_identity")
    assert result.wasSuccessful(), problems(result)
    pids = seen["pids"]
    assert sorted(pids) == [0, 1, 2, 3]
    own = [pid for pid, _ in pids.values()]
    assert len(set(own)) == 4  # distinct between ranks
    assert all(pid >= PID_FLOOR for pid in own)  # above any real process's: a use on the system fails loudly
    with pytest.raises(ProcessLookupError):
        os.kill(own[0], 0)
    assert {logged for _, logged in pids.values()} == {os.getpid()}  # libraries (logging) get the real one


def test_environment_per_rank(harness: ProcessHarnessReplacement, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIOCOLL_TEST_PRESET", "1")
    monkeypatch.delenv("AIOCOLL_TEST_UNSET_ME", raising=False)
    before = dict(os.environ)
    result = run_case(Seeds, "test_environ_per_rank")
    assert result.wasSuccessful(), problems(result)
    assert dict(os.environ) == before  # as a parent's environment after its children ran


def test_ranks_waiting_for_each_other_outside_collectives(harness: ProcessHarnessReplacement) -> None:
    t0 = time.monotonic()
    result = run_case(Waits)
    assert result.wasSuccessful(), problems(result)
    assert seen["waited"] == seen["stores"] == {0, 1}
    assert time.monotonic() - t0 < 10


# 3. skips and failures read as torch's harness reports them, with aiocoll's report


def test_skips(harness: ProcessHarnessReplacement) -> None:
    result = run_case(Skips)
    assert result.testsRun == 3
    assert result.wasSuccessful(), problems(result)
    reasons = sorted(reason for _, reason in result.skipped)
    assert reasons == sorted(
        [
            TEST_SKIPS["multi-gpu-2" if "multi-gpu-2" in TEST_SKIPS else "multi-device-2"].message,  # renamed in 2.15
            TEST_SKIPS["generic"].message,
            TEST_SKIPS["odd_worldsize"].message,
        ]
    )
    assert "ran on cpu" not in seen


def test_failing_rank_is_named_and_releases_the_others(harness: ProcessHarnessReplacement) -> None:
    t0 = time.monotonic()
    failure = _failure_of(run_case(Failures, "test_rank_fails"))
    assert time.monotonic() - t0 < 20
    assert "Process 1 exited with error code 10 and exception" in failure
    assert "ValueError: rank 1 is broken" in failure
    assert f'{__file__}", line' in failure  # the rank's own traceback
    assert "aiocoll: raised on rank 1 of a world of 4" in failure
    assert "aiocoll: ranks [0, 2, 3] were aborted because of it" in failure
    assert "Process 0 exited" not in failure  # only released by it: left out
    assert "WorldAbortedError" not in failure


def test_dtensor_failure(harness: ProcessHarnessReplacement) -> None:
    failure = _failure_of(run_case(DTensors, "test_fails"))
    assert "Process 3 exited with error code 10" in failure
    assert "AssertionError: rank 3 disagrees" in failure
    assert "aiocoll: raised on rank 3 of a world of 4" in failure


def test_mismatch_is_reported(harness: ProcessHarnessReplacement) -> None:
    failure = _failure_of(run_case(Failures, "test_mismatch"))
    assert "CollectiveMismatchError: ranks called different collectives" in failure
    assert f"rank 2: broadcast(float32[2], src=0) at {__file__}:" in failure
    assert f"rank 0: all_reduce(float32[2], op=ReduceOp.SUM) at {__file__}:" in failure
    assert failure.count("CollectiveMismatchError: ranks called") == 1  # once, not once per rank
    assert "(the same CollectiveMismatchError as process 0)" in failure


def test_deadlock_is_reported(harness: ProcessHarnessReplacement) -> None:
    failure = _failure_of(run_case(Failures, "test_returns_early"))
    assert "DeadlockError: deadlock: every live rank waits" in failure
    assert "rank 3: returned" in failure
    assert failure.count("DeadlockError: deadlock") == 1


def test_collective_timeout() -> None:
    with replace_process_harness(timeout=0.5):
        failure = _failure_of(run_case(Failures, "test_slow_rank"))
    assert "CollectiveTimeoutError" in failure
    assert "rank 0" in failure


def test_hang_becomes_a_report(harness: ProcessHarnessReplacement, monkeypatch: pytest.MonkeyPatch) -> None:
    # torch's own knob for a test's timeout
    monkeypatch.setitem(common_distributed.TIMEOUT_OVERRIDE, "test_past_the_timeout", 1)
    # the deadline scales with the cores (up to the 4 ranks): pinned, so that the 2.5 s
    # sleep outlasts it on any machine (with 16 cores it did not: the test passed)
    monkeypatch.setattr(aiocoll._engine._grouptimeouts, "usable_cpus", lambda: 2)
    t0 = time.monotonic()
    failure = _failure_of(run_case(Failures, "test_past_the_timeout"))
    assert time.monotonic() - t0 < 10
    assert "Process 2 terminated or timed out after" in failure
    # torch's 1 s, in the CPU time of its 4 processes: ranks taking turns use one core
    assert f"ran past its timeout of {Settings.deadline(1, 4):g} s" in failure
    assert "aiocoll: rank 2 was running, at:" in failure
    assert "time.sleep(2.5)" in failure


def test_a_world_of_no_ranks_passes_as_on_torchs_harness(harness: ProcessHarnessReplacement) -> None:
    # torch starts no process and the test passes (with a note); it used to crash here
    result = run_case(NoRanks)
    assert result.testsRun == 1
    assert result.wasSuccessful(), problems(result)
    assert result.skipped == []
    assert harness.fallbacks == []


def test_a_ranks_atexit_handlers_run_when_it_ends(harness: ProcessHarnessReplacement) -> None:
    seen.pop("atexit", None)
    result = run_case(AtExit)
    assert result.wasSuccessful(), problems(result)
    ran = seen["atexit"]
    assert sorted(ran) == sorted((r, w) for r in (0, 1) for w in ("runs first", "last registered"))
    for r in (0, 1):  # each rank's in reverse order of registration
        assert [w for q, w in ran if q == r] == ["runs first", "last registered"]
    assert harness.fallbacks == []
    assert not hasattr(atexit.register, "__wrapped__")  # the test process's own atexit, outside ranks


def test_logging_is_configured_per_rank(harness: ProcessHarnessReplacement) -> None:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    result = run_case(Logging)
    assert result.wasSuccessful(), problems(result)
    assert seen["logging"] == {0: ["rank 0: from 0"], 1: ["rank 1: from 1"]}
    assert harness.fallbacks == []
    assert (root.handlers, root.level) == (handlers, level)  # the test process's own logging, untouched
    assert "handlers" not in vars(logging.Logger)


def test_a_world_of_no_ranks_passes_on_torchs_harness() -> None:
    result = run_case(NoRanks)  # torch's own harness: what the drop-in mirrors
    assert result.wasSuccessful(), problems(result)
    assert result.skipped == []


# 4. what needs processes of its own runs in processes, or is skipped with the reason


def test_what_needs_processes_is_skipped_with_the_reason() -> None:
    with replace_process_harness(fallback="skip") as harness:
        result = run_case(
            NeedsProcesses,
            "test_os_exit",
            "test_signal_handler",
            "test_gloo_directly",
            "test_rpc_agent",
            "test_separate_worlds",
            "test_exit_codes_checked",
            "test_sparse_all_reduce",
            "test_backend_by_name",
            "test_profiler",
            "test_ddp_logging_data",
        )
    assert result.wasSuccessful(), problems(result)
    reasons = dict((t.id().rsplit(".", 1)[1], reason) for t, reason in result.skipped)
    assert reasons["test_os_exit"] == "aiocoll: rank 1 called os._exit(0): the test needs processes of its own"
    assert "installed a handler for signal" in reasons["test_signal_handler"]
    assert "rank 1 initialised torch.distributed as rank 0 of 1" in reasons["test_separate_worlds"]
    assert "skip_return_code_checks" in reasons["test_exit_codes_checked"]
    assert "rank 0 made a ProcessGroupGloo directly" in reasons["test_gloo_directly"]
    assert "rank 0 called torch.distributed.rpc.init_rpc (a process has one RPC agent)" in reasons["test_rpc_agent"]
    assert "reduced a sparse tensor (aiocoll has no sparse collectives)" in reasons["test_sparse_all_reduce"]
    assert "asked for aiocoll's own backend 'aiocoll' by name" in reasons["test_backend_by_name"]
    assert "started torch's profiler (one per process)" in reasons["test_profiler"]
    assert "read DDP's logging data, which describes its group's backend" in reasons["test_ddp_logging_data"]
    assert len(harness.fallbacks) == 10
    assert not hasattr(os._exit, "__wrapped__")  # restored
    assert not hasattr(signal.signal, "__wrapped__")


class _SuiteBarrier:
    """Stands for the barrier of torch's own suite (distributed_test.py): torch's runs only outside ranks here."""

    calls = 0

    @classmethod
    def sync(cls, wait_for: int | None = None, timeout: float = 10) -> None:
        cls.calls += 1


class SuiteBarrier(_Case):
    world = 3

    def test_meets(self) -> None:
        self.init()
        log = seen.setdefault("barrier", [])
        log.append(("before", self.rank))
        if self.rank == 1:
            time.sleep(0.05)  # the others wait meanwhile, their turns given up
        _SuiteBarrier.sync()
        log.append(("after", self.rank))
        _SuiteBarrier.sync()
        if self.rank == 2:
            with pytest.raises(RuntimeError, match=r"^barrier timeout$"):  # as torch's says it
                _SuiteBarrier.sync(timeout=0.1)


def test_torchs_suite_barrier_counts_per_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    suite = type(sys)("distributed_test")
    suite.Barrier = _SuiteBarrier  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, aiocoll._torch.process_harness.SUITE, suite)
    real = _SuiteBarrier.__dict__["sync"]
    with replace_process_harness(fallback="skip") as harness:
        result = run_case(SuiteBarrier)
    assert result.wasSuccessful(), problems(result)
    assert harness.fallbacks == []
    log = seen["barrier"]
    assert sorted(log[:3]) == [("before", 0), ("before", 1), ("before", 2)]
    assert sorted(log[3:]) == [("after", 0), ("after", 1), ("after", 2)]
    assert _SuiteBarrier.calls == 0  # torch's own never ran in a rank
    assert _SuiteBarrier.__dict__["sync"] is real  # put back
    _SuiteBarrier.sync()  # outside ranks, torch's
    assert _SuiteBarrier.calls == 1


class PerProcessLibrary(_Case):
    world = 2

    def test_imports_it(self) -> None:
        # asking whether it is installed is no import: told the truth either way
        seen["installed"] = [importlib.util.find_spec(f"aiocoll_test_per_process{s}") is not None for s in ("", "_x")]
        importlib.import_module("aiocoll_test_per_process")


def test_a_library_known_to_keep_state_per_process_needs_processes(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (tmp_path / "aiocoll_test_per_process.py").write_text("raise AssertionError('it ran')\n", encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("aiocoll_test_per_process", "aiocoll_test_per_process_x"):  # (the latter not installed)
        monkeypatch.setitem(OnePerProcess.LIBRARIES, name, "which is made up")
    with replace_process_harness(fallback="skip"):
        result = run_case(PerProcessLibrary)
    assert result.wasSuccessful(), problems(result)
    assert seen["installed"] == [True, False]
    [(_, reason)] = result.skipped
    assert reason == (
        "aiocoll: rank 0 imported aiocoll_test_per_process, which is made up: the ranks of one process would "
        "share it: the test needs processes of its own"
    )
    assert not any(isinstance(f, OnePerProcess) for f in sys.meta_path)  # removed with the world
    # (accelerate's and Lightning's state is each rank's own: _libstate)
    assert not {"accelerate", "lightning", "lightning_fabric", "pytorch_lightning"} & set(OnePerProcess.LIBRARIES)


BORG = """
class Borg:  # accelerate's pattern: every instance shares one class-level dict
    _shared_state = {}

    def __init__(self, **kw):
        self.__dict__ = self._shared_state
        self.__dict__.update(kw)
"""


class BorgState(_Case):
    world = 3

    def test_each_rank_has_its_own(self) -> None:
        from aiocoll_test_borg import Borg
        from aiocoll_test_borg_before import Borg as Before

        for cls in (Borg, Before):
            fresh = dict(cls._shared_state)  # (read before this rank makes one)
            cls(rank=self.rank)
            time.sleep(0.05)  # (the other ranks make theirs meanwhile)
            seen.setdefault("borg", []).append((cls.__module__, self.rank, fresh, cls().rank, cls._shared_state))


def test_a_library_s_class_level_shared_state_is_each_rank_s_own(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for name in ("aiocoll_test_borg", "aiocoll_test_borg_before"):
        (tmp_path / f"{name}.py").write_text(BORG, encoding="utf-8")
        monkeypatch.setitem(_libstate.SHARED_STATES, name, ("_shared_state", ("Borg",)))
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    from aiocoll_test_borg_before import Borg as Before  # (imported before the world, by a test file say)

    Before(made="before")
    with replace_process_harness():
        result = run_case(BorgState)
    assert result.wasSuccessful(), problems(result)
    from aiocoll_test_borg import Borg

    # each rank started from an empty state, as a fresh process does, and kept its own
    assert sorted(seen["borg"], key=str) == sorted(
        [(m, r, {}, r, {"rank": r}) for m in ("aiocoll_test_borg", "aiocoll_test_borg_before") for r in range(3)],
        key=str,
    )
    # the process's own state: untouched by the ranks, and a plain dict again after the world
    assert type(vars(Borg)["_shared_state"]) is dict
    assert Borg._shared_state == {}
    assert vars(Before)["_shared_state"] == {"made": "before"}
    assert _libstate.installed() == []


RANKED = """
def rank_zero_only(fn):  # Lightning's rank_zero_only: the process's rank, an attribute of the function
    def wrapped(*args):
        if not hasattr(rank_zero_only, "rank"):
            raise RuntimeError("rank_zero_only.rank is not set")
        return fn(*args) if rank_zero_only.rank == 0 else None
    return wrapped

@rank_zero_only
def hello(rank):
    return f"hello from {rank}"
"""


class RankedState(_Case):
    world = 3

    def test_each_rank_has_its_own(self) -> None:
        import aiocoll_test_ranked as m

        os.environ["RANK"] = str(self.rank)  # (as torchrun sets it: what a rank that set none reads)
        before = getattr(m.rank_zero_only, "rank", "unset")
        m.rank_zero_only.rank = self.rank
        time.sleep(0.05)  # (the other ranks set theirs meanwhile)
        seen.setdefault("ranked", []).append((self.rank, before, m.rank_zero_only.rank, m.hello(self.rank)))


def test_a_library_s_rank_kept_on_a_function_is_each_rank_s_own(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (tmp_path / "aiocoll_test_ranked.py").write_text(RANKED, encoding="utf-8")
    monkeypatch.setitem(_libstate.RANK_ATTRIBUTES, "aiocoll_test_ranked", ("rank_zero_only", ("rank",)))
    monkeypatch.delitem(sys.modules, "aiocoll_test_ranked", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    with replace_process_harness():
        result = run_case(RankedState)
    assert result.wasSuccessful(), problems(result)
    # the first rank found none set, as a fresh process does; the others, once one had set it,
    # what Lightning's import sets in each process (the rank from the environment)
    assert sorted(seen["ranked"]) == [(0, "unset", 0, "hello from 0"), (1, 1, 1, None), (2, 2, 2, None)]
    import aiocoll_test_ranked as m

    assert type(m.rank_zero_only).__name__ == "function"  # (the process's own again)
    assert not hasattr(m.rank_zero_only, "rank")  # (the ranks' values were theirs)
    assert _libstate.installed() == []


@pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="accelerate is a pinned test dependency")
def test_accelerate_s_states_are_each_rank_s_own() -> None:
    class Accelerate(_Case):
        world = 2

        def test_accelerator(self) -> None:
            from accelerate import Accelerator
            from accelerate.state import AcceleratorState, GradientState, PartialState

            # what torchrun gives each process (OMP_NUM_THREADS: else accelerate sets the
            # process's torch threads)
            os.environ.update(RANK=str(self.rank), LOCAL_RANK=str(self.rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
            os.environ.update(MASTER_ADDR="localhost", MASTER_PORT="29400", OMP_NUM_THREADS="1")
            acc = Accelerator(cpu=True)
            got = acc.gather(torch.tensor([float(self.rank)]))
            states = (PartialState().process_index, AcceleratorState().local_process_index, GradientState().num_steps)
            seen.setdefault("accelerate", []).append((acc.process_index, acc.num_processes, got.tolist(), states))

    with replace_process_harness():
        result = run_case(Accelerate)
    assert result.wasSuccessful(), problems(result)
    assert sorted(seen["accelerate"]) == [(r, 2, [0.0, 1.0], (r, r, 1)) for r in range(2)]


def test_what_needs_processes_runs_in_processes() -> None:
    with replace_process_harness() as harness:
        result = run_case(NeedsProcesses, "test_os_exit", "test_rpc_agent")
    assert result.wasSuccessful(), problems(result)
    assert result.skipped == []
    assert harness.fallbacks == [
        (f"{__name__}.NeedsProcesses.test_os_exit", "rank 1 called os._exit(0)"),
        (
            f"{__name__}.NeedsProcesses.test_rpc_agent",
            "rank 0 called torch.distributed.rpc.init_rpc (a process has one RPC agent)",
        ),
    ]


# the replacement itself


def test_context_manager_restores_torch_exactly() -> None:
    before = _torch_state()
    with replace_process_harness() as outer:
        assert _torch_state()[0] is not before[0]
        with replace_process_harness():  # nested: the outer one stays in force
            pass
        assert run_case(Basics, "test_leaves_its_group").wasSuccessful()
        assert "in force" in repr(outer)
    outer.restore()  # again: a no-op
    assert all(a is b for a, b in zip(_torch_state(), before, strict=True))
    assert "restored" in repr(outer)


def test_plain_call_until_restore() -> None:
    before = _torch_state()
    r = replace_process_harness()
    try:
        assert run_case(Basics, "test_leaves_its_group").wasSuccessful()
    finally:
        r.restore()
    assert all(a is b for a, b in zip(_torch_state(), before, strict=True))
    result = run_case(TorchOwn)
    assert result.wasSuccessful(), problems(result)


def test_bad_arguments() -> None:
    with pytest.raises(aiocoll.InvalidArgumentError, match="timeout"):
        replace_process_harness(timeout=0)
    with pytest.raises(aiocoll.InvalidArgumentError, match="fallback"):
        replace_process_harness(fallback="maybe")


def test_atexit_registrations_of_libraries_and_imports_stay_the_processs() -> None:
    # weakref.finalize registers its exit hook inside a function, the first time one is
    # made: run at a rank's end, it would end every finalizer of the process
    from types import SimpleNamespace

    from aiocoll._process._procstate import RankExit

    def frame(name: str, filename: str) -> Any:
        return SimpleNamespace(f_code=SimpleNamespace(co_name=name, co_filename=filename))

    assert RankExit._the_process_s(frame("__init__", weakref.__file__))
    assert RankExit._the_process_s(frame("f", os.path.join(os.path.dirname(torch.__file__), "x.py")))
    assert RankExit._the_process_s(frame("<module>", __file__))  # an import of the test's own
    assert not RankExit._the_process_s(frame("test_handlers", __file__))


def _forked_child(seen: Any) -> None:
    seen.put(os.environ.get("AIOCOLL_TEST_FORKED"))
    seen.close()
    seen.join_thread()
    os._exit(3)  # a process's own exit: refused in a rank, as it would end every rank


def test_a_process_forked_by_a_rank_is_a_process_of_its_own() -> None:
    """A DataLoader worker, say: it inherits its rank's environment, and its exit is its own (it hung before)."""
    from aiocoll._lifecycle._procworld import InProcessWorld

    fork = multiprocessing.get_context("fork")
    got: dict[int, tuple[int | None, str]] = {}

    def rank_main(rank: int) -> None:
        os.environ["AIOCOLL_TEST_FORKED"] = f"rank {rank}"
        seen = fork.Queue()
        child = fork.Process(target=_forked_child, args=(seen,))
        child.start()
        got[rank] = (None, seen.get(timeout=30))
        child.join(30)
        got[rank] = (child.exitcode, got[rank][1])

    end = InProcessWorld(2, 30.0, 60.0, "a test that forks").run(rank_main)
    assert end.error is None, end.error
    assert end.needs_process is None
    assert got == {0: (3, "rank 0"), 1: (3, "rank 1")}
    assert "AIOCOLL_TEST_FORKED" not in os.environ
