"""The test files ``bench_test_files.py`` runs, built from what torch's wheel ships.

torch's own test files are not in its wheels (and are not copied here), so these are
test files of the same kinds, on torch's own harnesses (``torch.testing._internal``):

- ``c10d``: c10d collectives on ``MultiThreadedTestCase`` and ``spawn_threads_and_init_comms``
  (the shape of torch's ``test_multi_threaded_pg.py``);
- ``funcol``: functional collectives on ``MultiThreadedTestCase`` (``test_functional_api.py``);
- ``dtensor``: DTensor placements, redistributes, views, matmuls and tensor parallelism on
  ``DTensorOpTestBase`` (``test_pointwise_ops.py``, ``test_redistribute.py``);
- ``opinfo``: one test per operator of the wheel's ``op_db`` on ``DTensorOpTestBase``, each
  running the operator's first sample inputs on DTensors of every placement the
  converter offers (the shape of ``test_dtensor_ops.py``);
- ``process``: DTensor and c10d tests on ``DTensorTestBase``, torch's multi-process harness
  (a process per rank, gloo);
- ``plugin``: DTensor, tensor-parallel and FSDP2 test bodies, as a pytest file of
  ``@pytest.mark.world(4)`` tests for aiocoll's plugin and as a ``MultiThreadedTestCase``
  for torch's threaded process group, both run by pytest.

Every file's ranks are 4. ``load(name)`` gives a file's test classes.
"""

# PyTorch-style test cases: torch's TestCase.assertEqual is the one that compares tensors
# ruff: noqa: PT009

from __future__ import annotations

import contextlib
import itertools
import textwrap
import threading
import unittest
from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.testing._internal.common_distributed import MultiThreadedTestCase, spawn_threads_and_init_comms
from torch.testing._internal.common_utils import TestCase
from torch.testing._internal.distributed._tensor.common_dtensor import (
    DTensorConverter,
    DTensorOpTestBase,
    DTensorTestBase,
    with_comms,
)
from torch.utils._pytree import tree_flatten, tree_map

WORLD = 4
FILES = ("c10d", "funcol", "dtensor", "opinfo", "process", "plugin")
THREADED = ("c10d", "funcol", "dtensor", "opinfo")  # on torch's threaded process group


def _rank_tensor(rank: int, *shape: int) -> torch.Tensor:
    return torch.arange(float(torch.Size(shape).numel())).reshape(shape) + 100 * rank


class _ThreadedTest(MultiThreadedTestCase):
    """A MultiThreadedTestCase of WORLD ranks, its threads started in setUp (no tests of its own)."""

    @property
    def world_size(self) -> int:
        return WORLD

    def setUp(self) -> None:
        super().setUp()
        self._spawn_threads()


# -- c10d: collectives through torch.distributed --------------------------------------------------


class C10dCollectives(_ThreadedTest):
    def test_all_reduce_sum(self) -> None:
        for shape in ((1,), (3, 3), (64, 64)):
            t = _rank_tensor(self.rank, *shape)
            dist.all_reduce(t)
            self.assertEqual(t, sum(_rank_tensor(r, *shape) for r in range(WORLD)))

    def test_all_reduce_ops(self) -> None:
        for op, expect in ((dist.ReduceOp.MAX, 3.0), (dist.ReduceOp.MIN, 0.0), (dist.ReduceOp.PRODUCT, 0.0)):
            t = torch.full((4,), float(self.rank))
            dist.all_reduce(t, op=op)
            self.assertEqual(t, torch.full((4,), expect))

    def test_all_reduce_async(self) -> None:
        works = []
        tensors = [torch.full((8,), float(self.rank + i)) for i in range(4)]
        for t in tensors:
            work = dist.all_reduce(t, async_op=True)
            assert work is not None
            works.append(work)
        for work in works:
            work.wait()
        for i, t in enumerate(tensors):
            self.assertEqual(t, torch.full((8,), float(6 + 4 * i)))

    def test_all_reduce_many(self) -> None:
        t = torch.ones(16)
        for _ in range(20):
            dist.all_reduce(t)
            t /= WORLD
        self.assertEqual(t, torch.ones(16))

    def test_all_gather(self) -> None:
        out = [torch.empty(3, 3) for _ in range(WORLD)]
        dist.all_gather(out, _rank_tensor(self.rank, 3, 3))
        for r, t in enumerate(out):
            self.assertEqual(t, _rank_tensor(r, 3, 3))

    def test_all_gather_into_tensor(self) -> None:
        out = torch.empty(WORLD * 4, 2)
        dist.all_gather_into_tensor(out, _rank_tensor(self.rank, 4, 2))
        self.assertEqual(out, torch.cat([_rank_tensor(r, 4, 2) for r in range(WORLD)]))

    def test_reduce_scatter(self) -> None:
        out = torch.empty(5)
        dist.reduce_scatter(out, [torch.full((5,), float(self.rank * r)) for r in range(WORLD)])
        self.assertEqual(out, torch.full((5,), float(6 * self.rank)))

    def test_reduce_scatter_tensor(self) -> None:
        out = torch.empty(2, 3)
        dist.reduce_scatter_tensor(out, torch.ones(WORLD * 2, 3) * self.rank)
        self.assertEqual(out, torch.full((2, 3), 6.0))

    def test_broadcast_from_each_rank(self) -> None:
        for src in range(WORLD):
            t = _rank_tensor(self.rank, 3, 3)
            dist.broadcast(t, src=src)
            self.assertEqual(t, _rank_tensor(src, 3, 3))

    def test_scatter(self) -> None:
        out = torch.empty(3, 3)
        chunks = [_rank_tensor(r, 3, 3) for r in range(WORLD)] if self.rank == 0 else None
        dist.scatter(out, chunks, src=0)
        self.assertEqual(out, _rank_tensor(self.rank, 3, 3))

    def test_gather(self) -> None:
        out = [torch.empty(2) for _ in range(WORLD)] if self.rank == 1 else None
        dist.gather(_rank_tensor(self.rank, 2), out, dst=1)
        if out is not None:
            for r, t in enumerate(out):
                self.assertEqual(t, _rank_tensor(r, 2))

    def test_all_to_all(self) -> None:
        out = [torch.empty(2) for _ in range(WORLD)]
        dist.all_to_all(out, [torch.full((2,), float(10 * self.rank + r)) for r in range(WORLD)])
        self.assertEqual(out, [torch.full((2,), float(10 * r + self.rank)) for r in range(WORLD)])

    def test_all_to_all_single(self) -> None:
        out = torch.empty(WORLD * 2)
        dist.all_to_all_single(out, torch.arange(WORLD * 2.0) + 100 * self.rank)
        expect = torch.cat([torch.arange(2.0) + 2 * self.rank + 100 * r for r in range(WORLD)])
        self.assertEqual(out, expect)

    def test_barrier(self) -> None:
        for _ in range(5):
            dist.barrier()

    def test_broadcast_object_list(self) -> None:
        objects: list[Any] = [{"rank": self.rank, "data": list(range(5))}, None]
        dist.broadcast_object_list(objects, src=2)
        self.assertEqual(objects[0], {"rank": 2, "data": list(range(5))})

    def test_all_gather_object(self) -> None:
        out: list[Any] = [None] * WORLD
        dist.all_gather_object(out, ("rank", self.rank))
        self.assertEqual(out, [("rank", r) for r in range(WORLD)])

    def test_scatter_object_list(self) -> None:
        out: list[Any] = [None]
        dist.scatter_object_list(out, [f"to {r}" for r in range(WORLD)] if self.rank == 0 else None, src=0)
        self.assertEqual(out[0], f"to {self.rank}")

    def test_subgroups(self) -> None:
        evens, odds = dist.new_group([0, 2]), dist.new_group([1, 3])
        mine = evens if self.rank % 2 == 0 else odds
        t = torch.full((4,), float(self.rank))
        dist.all_reduce(t, group=mine)
        self.assertEqual(t, torch.full((4,), 2.0 if self.rank % 2 == 0 else 4.0))

    def test_new_subgroups_all_gather(self) -> None:
        pair, _ = dist.new_subgroups(group_size=2)
        out = [torch.empty(1) for _ in range(2)]
        dist.all_gather(out, torch.full((1,), float(self.rank)), group=pair)
        first = self.rank - self.rank % 2
        self.assertEqual(out, [torch.full((1,), float(first)), torch.full((1,), float(first + 1))])

    def test_rank_and_size(self) -> None:
        self.assertEqual(dist.get_rank(), self.rank)
        self.assertEqual(dist.get_world_size(), WORLD)
        self.assertTrue(dist.is_initialized())

    def test_bucketed_gradients(self) -> None:
        # what DDP's reducer does, by hand: flat buckets all-reduced asynchronously, then averaged
        grads = [torch.randn(32, 32) * 0 + self.rank for _ in range(6)]
        flat = torch.cat([g.flatten() for g in grads])
        buckets = flat.split(2048)
        works = [dist.all_reduce(b, async_op=True) for b in buckets]
        for w in works:
            assert w is not None
            w.wait()
        self.assertEqual(torch.cat(buckets) / WORLD, torch.full_like(flat, 1.5))


class C10dWrapped(TestCase):
    """Tests that start their ranks themselves (``spawn_threads_and_init_comms``)."""

    @spawn_threads_and_init_comms(world_size=WORLD)
    def test_broadcast_object_list(self) -> None:
        objects: list[Any] = [99 if dist.get_rank() == 0 else None] * WORLD
        dist.broadcast_object_list(objects)
        self.assertEqual(objects[0], 99)

    @spawn_threads_and_init_comms(world_size=WORLD)
    def test_all_reduce(self) -> None:
        t = torch.ones(3, 3) * dist.get_rank()
        dist.all_reduce(t)
        self.assertEqual(t, torch.full((3, 3), 6.0))

    @spawn_threads_and_init_comms(world_size=WORLD)
    def test_all_gather(self) -> None:
        out = [torch.empty(2) for _ in range(WORLD)]
        dist.all_gather(out, torch.full((2,), float(dist.get_rank())))
        self.assertEqual(out, [torch.full((2,), float(r)) for r in range(WORLD)])


# -- funcol: functional collectives ---------------------------------------------------------------


class FunctionalCollectives(_ThreadedTest):
    def test_all_reduce_group(self) -> None:
        y = funcol.all_reduce(torch.full((4,), float(self.rank)), "sum", dist.group.WORLD)
        self.assertEqual(y, torch.full((4,), 6.0))

    def test_all_reduce_ranks(self) -> None:
        y = funcol.all_reduce(torch.ones(4), "sum", list(range(WORLD)))
        self.assertEqual(y, torch.full((4,), float(WORLD)))

    def test_all_reduce_mesh(self) -> None:
        mesh = init_device_mesh("cpu", (WORLD,))
        y = funcol.all_reduce(torch.ones(2, 2), "max", mesh)
        self.assertEqual(y, torch.ones(2, 2))

    def test_all_reduce_2d_mesh_dims(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        t = torch.full((2,), float(self.rank))
        rows = funcol.all_reduce(t, "sum", (mesh, 0))
        cols = funcol.all_reduce(t, "sum", (mesh, 1))
        self.assertEqual(rows, torch.full((2,), float(2 * (self.rank % 2) + 2)))
        self.assertEqual(cols, torch.full((2,), float(4 * (self.rank // 2) + 1)))

    def test_all_gather_tensor(self) -> None:
        y = funcol.all_gather_tensor(_rank_tensor(self.rank, 2, 3), 0, dist.group.WORLD)
        self.assertEqual(y, torch.cat([_rank_tensor(r, 2, 3) for r in range(WORLD)]))

    def test_all_gather_tensor_dim1(self) -> None:
        y = funcol.all_gather_tensor(_rank_tensor(self.rank, 2, 3), 1, dist.group.WORLD)
        self.assertEqual(y, torch.cat([_rank_tensor(r, 2, 3) for r in range(WORLD)], dim=1))

    def test_reduce_scatter_tensor(self) -> None:
        y = funcol.reduce_scatter_tensor(torch.ones(WORLD * 2, 2), "sum", 0, dist.group.WORLD)
        self.assertEqual(y, torch.full((2, 2), float(WORLD)))

    def test_all_to_all_single(self) -> None:
        y = funcol.all_to_all_single(torch.arange(WORLD * 1.0) + 10 * self.rank, None, None, dist.group.WORLD)
        self.assertEqual(y, torch.tensor([10.0 * r + self.rank for r in range(WORLD)]))

    def test_broadcast(self) -> None:
        y = funcol.broadcast(torch.full((3,), float(self.rank)), 3, dist.group.WORLD)
        self.assertEqual(y, torch.full((3,), 3.0))

    def test_all_reduce_coalesced(self) -> None:
        ys = funcol.all_reduce_coalesced([torch.ones(2), torch.ones(3) * 2], "sum", dist.group.WORLD)
        self.assertEqual(ys, [torch.full((2,), 4.0), torch.full((3,), 8.0)])

    def test_chain(self) -> None:
        t = torch.full((8,), float(self.rank))
        for _ in range(10):
            t = funcol.all_reduce(t, "sum", dist.group.WORLD) / WORLD
        self.assertEqual(t, torch.full((8,), 1.5))

    def test_autograd_all_gather(self) -> None:
        x = torch.ones(2, 2, requires_grad=True)
        y = funcol.all_gather_tensor_autograd(x * (self.rank + 1), 0, dist.group.WORLD)
        y.sum().backward()
        assert x.grad is not None
        self.assertEqual(x.grad, torch.full((2, 2), float(WORLD * (self.rank + 1))))


# -- dtensor: placements, redistributes, tensor parallelism ---------------------------------------


class _MLP(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)
        # the same weights on every rank: rank threads share one random generator, so
        # "seed, then build" gives each rank other weights (in processes it does not)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.linspace(-1, 1, p.numel()).reshape(p.shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # a copy: RowwiseParallel's local output is a view, which FSDP2 warns about (2.13+)
        return self.fc2(torch.relu(self.fc1(x))).clone()


class DTensorApi(DTensorOpTestBase):
    @property
    def world_size(self) -> int:
        return WORLD

    def _full(self, *shape: int) -> torch.Tensor:
        return torch.arange(float(torch.Size(shape).numel())).reshape(shape)

    def test_distribute_each_placement(self) -> None:
        mesh = self.build_device_mesh()
        full = self._full(8, 12)
        for placement in (Shard(0), Shard(1), Replicate()):
            x = distribute_tensor(full, mesh, [placement])
            self.assertEqual(x.full_tensor(), full)

    def test_redistribute_shard_to_replicate(self) -> None:
        mesh = self.build_device_mesh()
        full = self._full(8, 8)
        x = distribute_tensor(full, mesh, [Shard(0)]).redistribute(mesh, [Replicate()])
        self.assertEqual(x.to_local(), full)

    def test_redistribute_replicate_to_shard(self) -> None:
        mesh = self.build_device_mesh()
        full = self._full(8, 8)
        x = distribute_tensor(full, mesh, [Replicate()]).redistribute(mesh, [Shard(1)])
        self.assertEqual(x.to_local(), full.chunk(WORLD, dim=1)[self.rank])

    def test_redistribute_shard_to_shard(self) -> None:
        mesh = self.build_device_mesh()
        full = self._full(8, 8)
        x = distribute_tensor(full, mesh, [Shard(0)]).redistribute(mesh, [Shard(1)])
        self.assertEqual(x.full_tensor(), full)

    def test_partial_to_replicate(self) -> None:
        mesh = self.build_device_mesh()
        x = DTensor.from_local(torch.ones(4, 4), mesh, [Partial()])
        self.assertEqual(x.redistribute(mesh, [Replicate()]).to_local(), torch.full((4, 4), float(WORLD)))

    def test_partial_to_shard(self) -> None:
        mesh = self.build_device_mesh()
        x = DTensor.from_local(torch.ones(8, 4), mesh, [Partial()])
        self.assertEqual(x.redistribute(mesh, [Shard(0)]).to_local(), torch.full((2, 4), float(WORLD)))

    def test_pointwise_ops(self) -> None:
        mesh = self.build_device_mesh()
        full = self._full(8, 4)
        x = distribute_tensor(full, mesh, [Shard(0)])
        for fn in (torch.neg, torch.sigmoid, torch.tanh, torch.exp, lambda t: t * 2 + 1, lambda t: t.clamp(0, 5)):
            self.assertEqual(fn(x).full_tensor(), fn(full))

    def test_binary_ops_mixed_placements(self) -> None:
        mesh = self.build_device_mesh()
        a, b = self._full(8, 8), self._full(8, 8).T.contiguous()
        x = distribute_tensor(a, mesh, [Shard(0)])
        y = distribute_tensor(b, mesh, [Replicate()])
        self.assertEqual((x + y).full_tensor(), a + b)
        self.assertEqual((x * y).full_tensor(), a * b)

    def test_reductions(self) -> None:
        mesh = self.build_device_mesh()
        full = self._full(8, 4)
        x = distribute_tensor(full, mesh, [Shard(0)])
        self.assertEqual(x.sum().full_tensor(), full.sum())
        self.assertEqual(x.sum(dim=1).full_tensor(), full.sum(dim=1))
        self.assertEqual(x.amax(dim=0).full_tensor(), full.amax(dim=0))
        self.assertEqual(x.mean().full_tensor(), full.mean())

    def test_matmul_sharded(self) -> None:
        mesh = self.build_device_mesh()
        a, b = self._full(8, 16) / 100, self._full(16, 8) / 100
        rowwise = distribute_tensor(a, mesh, [Shard(0)]) @ distribute_tensor(b, mesh, [Replicate()])
        inner = distribute_tensor(a, mesh, [Shard(1)]) @ distribute_tensor(b, mesh, [Shard(0)])
        self.assertEqual(rowwise.full_tensor(), a @ b)
        self.assertEqual(inner.full_tensor(), a @ b)

    def test_views(self) -> None:
        mesh = self.build_device_mesh()
        full = self._full(8, 6)
        x = distribute_tensor(full, mesh, [Shard(0)])
        self.assertEqual(x.view(8, 2, 3).full_tensor(), full.view(8, 2, 3))
        self.assertEqual(x.t().full_tensor(), full.t())
        self.assertEqual(x.reshape(48).full_tensor(), full.reshape(48))

    def test_softmax_and_backward(self) -> None:
        mesh = self.build_device_mesh()
        full = self._full(8, 4) / 10
        x = distribute_tensor(full.clone().requires_grad_(), mesh, [Shard(0)])
        y = torch.softmax(x, dim=1)
        y.sum().backward()
        self.assertEqual(y.full_tensor(), torch.softmax(full, dim=1))
        assert x.grad is not None
        self.assertEqual(x.grad.full_tensor().shape, full.shape)

    def test_2d_mesh(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        full = self._full(8, 8)
        x = distribute_tensor(full, mesh, [Shard(0), Shard(1)])
        self.assertEqual(x.redistribute(mesh, [Replicate(), Shard(0)]).full_tensor(), full)
        self.assertEqual((x @ x.T).full_tensor(), full @ full.T)

    def test_tensor_parallel_mlp(self) -> None:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = self.build_device_mesh()
        model, reference = _MLP(), _MLP()
        parallelize_module(model, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        x = torch.arange(64.0).reshape(4, 16) / 64
        out = model(x)
        self.assertEqual(out, reference(x))
        out.sum().backward()

    def test_tensor_parallel_training_steps(self) -> None:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = self.build_device_mesh()
        model = _MLP()
        parallelize_module(model, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x = torch.arange(64.0).reshape(4, 16) / 64
        for _ in range(3):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()

    def test_from_local_and_to_local(self) -> None:
        mesh = self.build_device_mesh()
        x = DTensor.from_local(torch.full((2, 3), float(self.rank)), mesh, [Shard(0)])
        self.assertEqual(x.shape, torch.Size([2 * WORLD, 3]))
        self.assertEqual(x.full_tensor()[::2, 0], torch.arange(float(WORLD)))


# -- opinfo: the operators of torch's op_db on DTensors --------------------------------------------

# operators whose results are random (or uninitialised memory): their DTensor results
# cannot be compared, and random ones draw from a generator every rank thread shares
_RANDOM = ("rand", "dropout", "bernoulli", "multinomial", "normal", "uniform", "poisson", "empty", "exponential")
_SAMPLES_PER_OP = 2
_PLACEMENTS_PER_SAMPLE = 3

# the samples of the test running now: made by the test's own thread before the ranks
# start, so that every rank runs the same inputs (the ranks share the CPU generator)
_samples: dict[str, list[tuple[tuple[Any, ...], dict[str, Any], Any]]] = {}
_samples_lock = threading.Lock()


def opinfo_ops(count: int) -> list[Any]:
    """The first ``count`` operators of ``op_db`` that run on float32 CPU tensors (all of them: 0)."""
    from torch.testing._internal.common_methods_invocations import op_db

    ops = [
        op
        for op in op_db
        if torch.float32 in op.supported_dtypes("cpu") and not any(word in op.name for word in _RANDOM)
    ]
    ops.sort(key=lambda op: (op.name, op.variant_test_name))
    return ops if count <= 0 else ops[:count]


def _op_test_name(op: Any) -> str:
    return "test_" + f"{op.name}_{op.variant_test_name}".strip("_").replace(".", "_")


def _samples_of(op: Any) -> list[tuple[tuple[Any, ...], dict[str, Any], Any]]:
    out = []
    for sample in itertools.islice(op.sample_inputs("cpu", torch.float32, requires_grad=False), _SAMPLES_PER_OP):
        args, kwargs = (sample.input, *sample.args), dict(sample.kwargs)
        try:
            expected = op(*args, **kwargs)
        except Exception:
            continue  # (the operator refuses this sample on plain tensors too)
        out.append((args, kwargs, expected))
    return out


def _clone(x: Any) -> Any:
    return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, x)


def _compare(got: Any, expected: Any) -> None:
    for g, e in zip(tree_flatten(got)[0], tree_flatten(expected)[0], strict=False):
        if isinstance(g, DTensor):
            g = g.full_tensor()
        if isinstance(g, torch.Tensor) and isinstance(e, torch.Tensor):
            torch.testing.assert_close(g, e, equal_nan=True, atol=1e-4, rtol=1e-4)


def _op_test(op: Any) -> Callable[[Any], None]:
    def test(self: Any) -> None:
        mesh = self.build_device_mesh()
        for args, kwargs, expected in _samples[self._testMethodName]:
            converter = DTensorConverter(mesh, _clone(args), _clone(kwargs))
            for dargs, dkwargs in itertools.islice(converter, _PLACEMENTS_PER_SAMPLE):
                if not converter.successful():
                    break
                # what DTensor does not support raises alike on every rank (same inputs, even
                # shards): counted as this operator's answer, as torch's test lists its xfails
                with contextlib.suppress(Exception):
                    _compare(op(*dargs, **dkwargs), expected)

    return test


class DTensorOpInfo(DTensorOpTestBase):
    """One test per operator (added by ``opinfo_class``)."""

    ops: ClassVar[dict[str, Any]] = {}

    @property
    def world_size(self) -> int:
        return WORLD

    def setUp(self) -> None:
        op = self.ops.get(self._testMethodName)
        if op is not None:
            with _samples_lock:
                _samples[self._testMethodName] = _samples_of(op)
        super().setUp()  # (starts the ranks)

    def tearDown(self) -> None:
        super().tearDown()
        _samples.pop(self._testMethodName, None)


def opinfo_class(count: int) -> type[DTensorOpInfo]:
    """``DTensorOpInfo`` with a test for each of the first ``count`` operators (all: 0)."""
    ops = {_op_test_name(op): op for op in opinfo_ops(count)}
    cls = type("DTensorOpInfo", (DTensorOpInfo,), {"ops": ops, "__module__": __name__})
    for name, op in ops.items():
        setattr(cls, name, _op_test(op))
    return cls


# -- process: torch's multi-process harness ------------------------------------------------------


class ProcessDTensor(DTensorTestBase):
    @property
    def world_size(self) -> int:
        return WORLD

    @with_comms  # type: ignore[untyped-decorator,misc]
    def test_collectives(self) -> None:
        t = torch.full((4,), float(self.rank))
        dist.all_reduce(t)
        out = [torch.empty(4) for _ in range(WORLD)]
        dist.all_gather(out, t)
        self.assertEqual(out, [torch.full((4,), 6.0)] * WORLD)

    @with_comms  # type: ignore[untyped-decorator,misc]
    def test_redistribute(self) -> None:
        mesh = self.build_device_mesh()
        full = torch.arange(64.0).reshape(8, 8)
        x = distribute_tensor(full, mesh, [Shard(0)])
        self.assertEqual(x.redistribute(mesh, [Shard(1)]).full_tensor(), full)

    @with_comms  # type: ignore[untyped-decorator,misc]
    def test_tensor_parallel(self) -> None:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        model = _MLP()
        parallelize_module(model, self.build_device_mesh(), {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        model(torch.ones(4, 16)).sum().backward()

    @with_comms  # type: ignore[untyped-decorator,misc]
    def test_2d_mesh(self) -> None:
        mesh = init_device_mesh(self.device_type, (2, 2))
        full = torch.arange(64.0).reshape(8, 8)
        self.assertEqual(distribute_tensor(full, mesh, [Shard(0), Shard(1)]).full_tensor(), full)


# -- plugin: the same bodies as a pytest file of the plugin and as a MultiThreadedTestCase ---------


def body_dtensor(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    full = torch.arange(64.0).reshape(8, 8)
    x = distribute_tensor(full, mesh, [Shard(0)])
    assert torch.equal((x @ x.T).full_tensor(), full @ full.T)
    assert torch.equal(x.redistribute(mesh, [Replicate()]).to_local(), full)


def body_tensor_parallel(rank: int, world_size: int) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world_size,))
    model = _MLP()
    parallelize_module(model, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(2):
        opt.zero_grad()
        model(torch.ones(4, 16)).sum().backward()
        opt.step()


def body_fsdp2(rank: int, world_size: int) -> None:
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    model = nn.Sequential(_MLP(), _MLP())
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(2):
        opt.zero_grad()
        model(torch.ones(4, 16)).sum().backward()
        opt.step()


def body_fsdp2_tp(rank: int, world_size: int) -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("dp", "tp"))
    model = _MLP()
    parallelize_module(model, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    model(torch.ones(4, 16)).sum().backward()


PLUGIN_BODIES: dict[str, Callable[[int, int], None]] = {
    "dtensor": body_dtensor,
    "tensor_parallel": body_tensor_parallel,
    "fsdp2": body_fsdp2,
    "fsdp2_tp": body_fsdp2_tp,
}
PLUGIN_REPEAT = 4  # each body this many times: 16 tests


def plugin_file(system: str) -> str:
    """The pytest file of the plugin's tests (``system`` "aiocoll") or of torch's threaded harness ("torch")."""
    if system == "aiocoll":
        return textwrap.dedent(f"""
            import pytest
            from _test_files import PLUGIN_BODIES

            @pytest.mark.world({WORLD})
            @pytest.mark.parametrize("i", range({PLUGIN_REPEAT}))
            @pytest.mark.parametrize("name", sorted(PLUGIN_BODIES))
            def test_body(comm, name, i):
                PLUGIN_BODIES[name](comm.rank, comm.world_size)
            """)
    return textwrap.dedent(f"""
        from torch.testing._internal.common_distributed import MultiThreadedTestCase
        from _test_files import PLUGIN_BODIES

        class TestBodies(MultiThreadedTestCase):
            @property
            def world_size(self):
                return {WORLD}

            def setUp(self):
                super().setUp()
                self._spawn_threads()

        for _name in sorted(PLUGIN_BODIES):
            for _i in range({PLUGIN_REPEAT}):
                setattr(TestBodies, f"test_body_{{_name}}_{{_i}}",
                        lambda self, _body=PLUGIN_BODIES[_name]: _body(self.rank, self.world_size))
        """)


def load(name: str, opinfo_count: int = 0) -> list[type[unittest.TestCase]]:
    """The test classes of file ``name`` (not ``plugin``: a pytest file, see ``plugin_file``)."""
    return {
        "c10d": lambda: [C10dCollectives, C10dWrapped],
        "funcol": lambda: [FunctionalCollectives],
        "dtensor": lambda: [DTensorApi],
        "opinfo": lambda: [opinfo_class(opinfo_count)],
        "process": lambda: [ProcessDTensor],
    }[name]()
