"""One distributed program, run world after world through each way into aiocoll.

``bench_leftovers.py`` measures what each world leaves in the process;
``tests/c10d/test_belongings.py`` runs the same drivers, fewer times, and asserts the bound.

``program`` uses what a test suite of distributed PyTorch code uses: a 2-D
``DeviceMesh``, DTensors in several placements with redistributes between them (shards,
replicas, a partial sum), tensor parallelism, FSDP2 over it with a training step, and a
distributed checkpoint saved and loaded. Four ranks.

Each driver ``run(entry, worlds, after)`` runs ``worlds`` worlds of it, calling
``after(i)`` in the driving thread once world ``i`` has ended:

- ``spawn``: ``aiocoll.spawn(fn, world=4)``;
- ``plugin``: a ``@pytest.mark.world(4)`` test, parametrized ``worlds`` times, run by
  ``pytest.main`` in this process;
- ``process harness``: a ``DTensorTestBase`` test (torch's multi-process harness) under
  ``aiocoll.testing.replace_process_harness()``;
- ``threaded harness``: a ``MultiThreadedTestCase`` test under ``replace_threaded_pg()``;
- ``torch threaded PG``: the same test on torch's own threaded process group, for
  comparison (torch's answer to running ranks in one process).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import textwrap
import unittest
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

WORLD = 4
ENTRY_POINTS = ("spawn", "plugin", "process harness", "threaded harness", "torch threaded PG")


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # a copy: RowwiseParallel's local output is a view, which FSDP2 warns about (2.13+)
        return self.fc2(torch.relu(self.fc1(x))).clone()


def program(rank: int, world_size: int, checkpoint_dir: str) -> float:
    """DTensor, TP, FSDP2 and DCP on a 2 x (world_size / 2) mesh; a number every rank agrees on."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("dp", "tp"))
    x = distribute_tensor(torch.randn(8, 8), mesh, [Shard(0), Shard(1)])
    y = x.redistribute(mesh, [Replicate(), Shard(0)])
    z = (y @ y.T).redistribute(mesh, [Replicate(), Replicate()])
    partial = x.sum(0).redistribute(mesh, [Replicate(), Replicate()])  # a partial sum over dp, then replicated
    model = _MLP()
    parallelize_module(model, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    dcp.save({"model": model.state_dict()}, checkpoint_id=checkpoint_dir)
    dcp.load({"model": model.state_dict()}, checkpoint_id=checkpoint_dir)
    return float(z.to_local().sum() + partial.to_local().sum())


def checkpoint_dir(tmp: str, world: int) -> str:
    """Where world ``world`` saves its checkpoint (DCP warns when it overwrites one)."""
    return os.path.join(tmp, f"checkpoint-{world}")


def run(entry: str, worlds: int, after: Callable[[int], None]) -> None:
    """Run ``worlds`` worlds of ``program`` through ``entry``; ``after(i)`` once world ``i`` has ended."""
    with tempfile.TemporaryDirectory() as tmp:

        def ended(i: int) -> None:
            shutil.rmtree(checkpoint_dir(tmp, i), ignore_errors=True)
            after(i)

        {
            "spawn": _spawn,
            "plugin": _plugin,
            "process harness": _process_harness,
            "threaded harness": _threaded_harness,
            "torch threaded PG": _threaded_harness,
        }[entry](entry, worlds, ended, tmp)


def _spawn(entry: str, worlds: int, after: Callable[[int], None], tmp: str) -> None:
    import aiocoll

    for i in range(worlds):

        def fn(comm: Any, i: int = i) -> float:
            return program(comm.rank, comm.world_size, checkpoint_dir(tmp, i))

        aiocoll.spawn(fn, world=WORLD)
        after(i)


# -- the pytest plugin --------------------------------------------------------------------------

_TEST_FILE = """
import pytest
from _worlds import checkpoint_dir, program

@pytest.mark.world({world})
@pytest.mark.parametrize("i", range({worlds}))
def test_program(comm, i):
    program(comm.rank, comm.world_size, checkpoint_dir({tmp!r}, i))
"""


class _After:
    """A pytest plugin: ``after(i)`` once the i-th test has been torn down."""

    def __init__(self, after: Callable[[int], None]) -> None:
        self.after = after
        self.count = 0
        self.failed: list[str] = []

    def pytest_collection_finish(self, session: Any) -> None:
        """Make pytest's per-test containers, which every test starts filling as it runs, tracked from the start.

        pytest collects every test before the first runs, and each test's item keeps its
        state until the session ends. Its instance dict (created lazily since Python
        3.12) and its stash's dict (tracked by the collector only once it holds a
        tracked object) would otherwise join the objects the collector tracks one test
        at a time, about 2 a test: pytest's, the same for any test, not a world's.
        """
        import _pytest.stash

        marker = _pytest.stash.StashKey[list[int]]()
        for item in session.items:
            vars(item)  # (materializes it)
            item.stash[marker] = []  # (a tracked value: its dict is tracked from now on)

    def pytest_runtest_logreport(self, report: Any) -> None:
        if report.failed:
            self.failed.append(f"{report.nodeid}: {report.longreprtext}")
        if report.when == "teardown":
            self.after(self.count)
            self.count += 1


def _plugin(entry: str, worlds: int, after: Callable[[int], None], tmp: str) -> None:
    import pytest

    test_file = Path(tmp) / "test_program.py"
    test_file.write_text(textwrap.dedent(_TEST_FILE.format(world=WORLD, worlds=worlds, tmp=tmp)))
    probe = _After(after)
    # no terminal reporter: it keeps every test's report; no logging plugin: it keeps the text of
    # every test's captured log records in the test's item until the session ends (torch's DCP
    # logger logs at DEBUG: about 25 KB a test here; 92 KB of RSS a world with it, 16 KB without).
    # That memory is pytest's, the same for any test of that code, not a world's.
    # This file's directory is where the test file imports the program from.
    args = [str(test_file), "-p", "no:terminal", "-p", "no:logging", "-p", "no:cacheprovider", "-W", "ignore"]
    args += ["--rootdir", tmp, "-c", str(Path(tmp) / "pytest.ini"), "--import-mode=append"]
    (Path(tmp) / "pytest.ini").write_text(f"[pytest]\npythonpath = {Path(__file__).parent}\n")
    code = pytest.main(args, plugins=[probe])
    if code != 0 or probe.failed:
        raise RuntimeError(f"the plugin's run failed (exit code {code}):\n" + "\n".join(probe.failed))


# -- torch's harnesses ----------------------------------------------------------------------------


def _run_tests(case: type[unittest.TestCase], worlds: int, after: Callable[[int], None], tmp: str) -> None:
    for i in range(worlds):
        result = unittest.TestResult()
        # on the class: each rank runs a test object of its own (of a subclass, in-process)
        case.checkpoint = checkpoint_dir(tmp, i)  # type: ignore[attr-defined]
        case("test_program").run(result)
        if not result.wasSuccessful():
            problems = "\n".join(tb for _, tb in result.errors + result.failures)
            raise RuntimeError(f"world {i} failed:\n{problems}")
        after(i)


def _process_harness(entry: str, worlds: int, after: Callable[[int], None], tmp: str) -> None:
    from torch.testing._internal.distributed._tensor.common_dtensor import DTensorTestBase, with_comms

    import aiocoll.testing

    class Program(DTensorTestBase):
        @property
        def world_size(self) -> int:
            return WORLD

        @with_comms  # type: ignore[untyped-decorator,misc]
        def test_program(self) -> None:
            program(self.rank, self.world_size, self.checkpoint)

    with aiocoll.testing.replace_process_harness(fallback="skip"):
        _run_tests(Program, worlds, after, tmp)


def _threaded_harness(entry: str, worlds: int, after: Callable[[int], None], tmp: str) -> None:
    from torch.testing._internal.common_distributed import MultiThreadedTestCase

    import aiocoll.testing

    class Program(MultiThreadedTestCase):
        @property
        def world_size(self) -> int:
            return WORLD

        def setUp(self) -> None:
            super().setUp()
            self._spawn_threads()

        def test_program(self) -> None:
            program(self.rank, self.world_size, self.checkpoint)

    if entry == "torch threaded PG":
        _run_tests(Program, worlds, after, tmp)
    else:
        with aiocoll.testing.replace_threaded_pg():
            _run_tests(Program, worlds, after, tmp)
