"""``Comm``: a rank's handle on a group. Validates arguments and builds the op; a subclass issues it.

The base class holds everything both kinds of ``Comm`` share: the argument checks, the
collectives, p2p, object collectives and the making of sub-groups. A subclass says how a
checked call is issued (``_join``) and where the group's facts come from:

- ``_engine_comm.EngineComm``: a rank of ``spawn``, on the in-process engine;
- ``_pg.ProcessGroupComm``: a process on a real torch.distributed group (``from_process_group``).
"""

from __future__ import annotations

import abc
from collections.abc import Hashable, Sequence
from typing import NoReturn

import torch
import torch.distributed as dist

from . import _ops as ops
from ._errors import InvalidArgumentError
from ._stats import Statistics
from ._work import Site, Work, call_site

__all__ = ["Comm"]

_SUM = dist.ReduceOp.SUM


class Comm(abc.ABC):
    """One rank's view of a group: its ``rank`` and ``world_size`` and the collectives.

    Every collective is issued when called and returns an awaitable ``Work``; ranks are
    group-local, as in torch.distributed:

    >>> import torch, aiocoll
    >>> async def worker(comm):
    ...     t = torch.ones(2) * comm.rank
    ...     await comm.all_reduce(t)                  # t == sum of all ranks' tensors
    ...     evens = await comm.new_group([0, 2])      # a Comm on ranks 0 and 2, None on 1
    ...     return t.tolist(), evens and (evens.rank, evens.world_size)
    >>> aiocoll.spawn(worker, world=3)
    [([3.0, 3.0], (0, 2)), ([3.0, 3.0], None), ([3.0, 3.0], (1, 2))]

    Bad arguments raise ``InvalidArgumentError`` on the calling rank before it joins,
    leaving its tensors untouched. ``spawn`` gives each rank a ``Comm`` on the in-process
    engine; ``from_process_group`` gives one on a real process group, with the same
    methods, checks and results.
    """

    __slots__ = ("rank", "world_size")

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        """This rank's index in the group."""
        self.world_size = world_size
        """How many ranks the group has."""

    @property
    @abc.abstractmethod
    def global_rank(self) -> int:
        """This rank's index in the whole world (of ``spawn``, or of torch.distributed's default group)."""

    @property
    @abc.abstractmethod
    def group_ranks(self) -> tuple[int, ...]:
        """The global ranks of this group's members, in group-rank order.

        >>> import aiocoll
        >>> async def worker(comm):
        ...     odds = await comm.new_group([1, 3])
        ...     return odds and (odds.rank, odds.global_rank, odds.group_ranks, odds.group_name)
        >>> aiocoll.spawn(worker, world=4)
        [None, (0, 1, (1, 3), 'world/0'), None, (1, 3, (1, 3), 'world/0')]
        """

    @property
    @abc.abstractmethod
    def group_name(self) -> str:
        """The group's name: ``"world"``, then ``"world/0"`` and so on for sub-groups (a process group: torch's)."""

    def __repr__(self) -> str:
        return f"<Comm rank={self.rank}/{self.world_size} group={self.group_name!r}>"

    @abc.abstractmethod
    def statistics(self) -> Statistics:
        """A frozen snapshot of the world: each rank's state and what it waits for.

        ``result.ranks[r]`` is a ``RankStatistics``: ``state`` ("running", "blocked",
        "returned" or "failed"), ``waiting`` (the ops it waits in), ``waits_for`` (the
        global ranks those ops still need) and ``completed`` (its ops done so far)::

            for r in comm.statistics().ranks:
                print(r.rank, r.state, r.waiting, r.waits_for)

        On a process group it knows only this process (the others are ``"remote"``).
        """

    # -- what a subclass provides ------------------------------------------------------

    @abc.abstractmethod
    def _join(self, call: ops.Call) -> Work:
        """Issue the checked ``call`` for this rank and return its work.

        Called straight from the public methods: ``_site`` finds the user's frame by depth.
        """

    @abc.abstractmethod
    def _group_seq(self) -> int:
        """The number that names the next group this rank makes (read before its call is issued)."""

    @abc.abstractmethod
    async def _subgroup(self, part: ops.Partition, seq: int, call: ops.NewGroup | ops.Split) -> Comm | None:
        """This rank's ``Comm`` on the group ``part`` gives it, made at ``seq``; None if it has none."""

    def _any_source_ok(self) -> bool:
        """Whether ``recv`` may take a send from any rank."""
        return True

    def _site(self) -> Site:
        # frames: call_site <- _site <- _join <- the Comm method <- the user
        return call_site(3)

    # -- validation helpers ------------------------------------------------------------

    def _bad(self, op: str, message: str) -> NoReturn:
        raise InvalidArgumentError(f"{op} on rank {self.rank}: {message}")

    def _tensor(self, op: str, arg: str, x: object) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            self._bad(op, f"argument {arg!r}: expected a torch.Tensor, got {type(x).__name__}")
        if x.is_sparse:
            self._bad(op, f"argument {arg!r}: sparse tensors are not supported")
        return x

    def _tensors(self, op: str, arg: str, xs: object, n: int | None = None) -> list[torch.Tensor]:
        if not isinstance(xs, (list, tuple)):
            self._bad(op, f"argument {arg!r}: expected a list of tensors, got {type(xs).__name__}")
        if n is not None and len(xs) != n:
            self._bad(op, f"argument {arg!r}: expected {n} tensors (the group size), got {len(xs)}")
        return [self._tensor(op, f"{arg}[{i}]", x) for i, x in enumerate(xs)]

    def _root(self, op: str, arg: str, r: object) -> int:
        if not isinstance(r, int) or isinstance(r, bool):
            self._bad(op, f"argument {arg!r}: expected an int rank, got {type(r).__name__}")
        if not 0 <= r < self.world_size:
            self._bad(op, f"argument {arg!r}: rank {r} is out of range for a group of {self.world_size}")
        return r

    def _same(self, op: str, arg: str, t: torch.Tensor, ref_arg: str, ref: torch.Tensor, shape: bool = True) -> None:
        if t.dtype != ref.dtype:
            self._bad(op, f"argument {arg!r} has dtype {t.dtype} but {ref_arg!r} has {ref.dtype}")
        if t.device != ref.device:
            self._bad(op, f"argument {arg!r} is on {t.device} but {ref_arg!r} is on {ref.device}")
        if shape and t.shape != ref.shape:
            self._bad(op, f"argument {arg!r} has shape {list(t.shape)} but {ref_arg!r} has {list(ref.shape)}")

    def _dumps(self, op: str, arg: str, obj: object) -> bytes:
        try:
            return ops.dumps(obj, arg)
        except InvalidArgumentError as e:
            self._bad(op, str(e))

    def _reduction(self, op: str, red: object, dtype: torch.dtype) -> ops.Reduction:
        try:
            r = ops.checked_reduction(red, dtype)
        except InvalidArgumentError as e:
            self._bad(op, str(e))
        return r

    # -- collectives -------------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor, op: object = _SUM) -> Work:
        """Reduce ``tensor`` across the group, in place on every rank.

        ``op`` is a ``torch.distributed.ReduceOp`` (default SUM); reductions run in rank
        order, so results are bitwise repeatable.

        >>> import torch, aiocoll
        >>> async def worker(comm):
        ...     t = torch.tensor([comm.rank + 1.0])
        ...     await comm.all_reduce(t)
        ...     return t.item()
        >>> aiocoll.spawn(worker, world=3)
        [6.0, 6.0, 6.0]
        """
        t = self._tensor("all_reduce", "tensor", tensor)
        return self._join(ops.AllReduce(t, self._reduction("all_reduce", op, t.dtype)))

    def reduce(self, tensor: torch.Tensor, dst: int, op: object = _SUM) -> Work:
        """Reduce ``tensor`` across the group into rank ``dst``'s tensor; others are unchanged.

        >>> import torch, torch.distributed as dist, aiocoll
        >>> async def worker(comm):
        ...     t = torch.tensor([comm.rank + 1.0])
        ...     await comm.reduce(t, dst=0, op=dist.ReduceOp.MAX)
        ...     return t.item()
        >>> aiocoll.spawn(worker, world=3)
        [3.0, 2.0, 3.0]
        """
        t = self._tensor("reduce", "tensor", tensor)
        dst = self._root("reduce", "dst", dst)
        return self._join(ops.Reduce(t, dst, self._reduction("reduce", op, t.dtype)))

    def broadcast(self, tensor: torch.Tensor, src: int) -> Work:
        """Copy rank ``src``'s ``tensor`` into every rank's ``tensor``.

        >>> import torch, aiocoll
        >>> async def worker(comm):
        ...     t = torch.tensor([comm.rank * 10.0])
        ...     await comm.broadcast(t, src=2)
        ...     return t.item()
        >>> aiocoll.spawn(worker, world=3)
        [20.0, 20.0, 20.0]
        """
        t = self._tensor("broadcast", "tensor", tensor)
        return self._join(ops.Broadcast(t, self._root("broadcast", "src", src)))

    def all_gather(self, tensor_list: list[torch.Tensor], tensor: torch.Tensor) -> Work:
        """Every rank's ``tensor`` into ``tensor_list[rank]`` on every rank.

        >>> import torch, aiocoll
        >>> async def worker(comm):
        ...     out = [torch.zeros(1) for _ in range(comm.world_size)]
        ...     await comm.all_gather(out, torch.tensor([comm.rank * 1.0]))
        ...     return torch.cat(out).tolist()
        >>> aiocoll.spawn(worker, world=3)
        [[0.0, 1.0, 2.0], [0.0, 1.0, 2.0], [0.0, 1.0, 2.0]]
        """
        x = self._tensor("all_gather", "tensor", tensor)
        outs = self._tensors("all_gather", "tensor_list", tensor_list, self.world_size)
        for i, o in enumerate(outs):
            self._same("all_gather", f"tensor_list[{i}]", o, "tensor", x, shape=False)
        if outs[self.rank].shape != x.shape:
            self._bad(
                "all_gather",
                f"argument 'tensor_list[{self.rank}]' has shape {list(outs[self.rank].shape)} "
                f"but this rank's 'tensor' has {list(x.shape)}",
            )
        return self._join(ops.AllGather(outs, x))

    def all_gather_into_tensor(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor) -> Work:
        """Gather every rank's input into ``output_tensor``, concatenated along dim 0 (or stacked).

        >>> import torch, aiocoll
        >>> async def worker(comm):
        ...     out = torch.zeros(comm.world_size, 2)
        ...     await comm.all_gather_into_tensor(out, torch.full((2,), comm.rank * 1.0))
        ...     return out.tolist()
        >>> aiocoll.spawn(worker, world=2)
        [[[0.0, 0.0], [1.0, 1.0]], [[0.0, 0.0], [1.0, 1.0]]]
        """
        op = "all_gather_into_tensor"
        out = self._tensor(op, "output_tensor", output_tensor)
        x = self._tensor(op, "input_tensor", input_tensor)
        self._same(op, "output_tensor", out, "input_tensor", x, shape=False)
        if out.numel() != x.numel() * self.world_size:
            self._bad(
                op,
                f"argument 'output_tensor' must hold world_size ({self.world_size}) x input "
                f"({x.numel()} elements), has {out.numel()}",
            )
        return self._join(ops.AllGatherIntoTensor(out, x))

    def gather(self, tensor: torch.Tensor, gather_list: list[torch.Tensor] | None = None, dst: int = 0) -> Work:
        """Collect every rank's ``tensor`` into ``gather_list`` on rank ``dst``.

        ``gather_list`` is required on ``dst`` and None (or empty) elsewhere.

        >>> import torch, aiocoll
        >>> async def worker(comm):
        ...     out = [torch.zeros(1) for _ in range(comm.world_size)] if comm.rank == 0 else None
        ...     await comm.gather(torch.tensor([comm.rank * 1.0]), out, dst=0)
        ...     return out and torch.cat(out).tolist()
        >>> aiocoll.spawn(worker, world=3)
        [[0.0, 1.0, 2.0], None, None]
        """
        x = self._tensor("gather", "tensor", tensor)
        dst = self._root("gather", "dst", dst)
        outs = None
        if self.rank == dst:
            if gather_list is None:
                self._bad("gather", "argument 'gather_list' is required on the destination rank")
            outs = self._tensors("gather", "gather_list", gather_list, self.world_size)
            for i, o in enumerate(outs):
                self._same("gather", f"gather_list[{i}]", o, "tensor", x)
        elif not _empty(gather_list):
            self._bad("gather", f"argument 'gather_list' must be None or empty on non-destination rank {self.rank}")
        return self._join(ops.Gather(x, outs, dst))

    def scatter(self, tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None = None, src: int = 0) -> Work:
        """Send ``scatter_list[i]`` of rank ``src`` to rank i's ``tensor``.

        ``scatter_list`` is required on ``src`` and None (or empty) elsewhere.

        >>> import torch, aiocoll
        >>> async def worker(comm):
        ...     t = torch.zeros(1)
        ...     chunks = [torch.tensor([10.0 * i]) for i in range(comm.world_size)] if comm.rank == 0 else None
        ...     await comm.scatter(t, chunks, src=0)
        ...     return t.item()
        >>> aiocoll.spawn(worker, world=3)
        [0.0, 10.0, 20.0]
        """
        out = self._tensor("scatter", "tensor", tensor)
        src = self._root("scatter", "src", src)
        ins = None
        if self.rank == src:
            if scatter_list is None:
                self._bad("scatter", "argument 'scatter_list' is required on the source rank")
            ins = self._tensors("scatter", "scatter_list", scatter_list, self.world_size)
            for i, x in enumerate(ins):
                self._same("scatter", f"scatter_list[{i}]", x, "tensor", out)
        elif not _empty(scatter_list):
            self._bad("scatter", f"argument 'scatter_list' must be None or empty on non-source rank {self.rank}")
        return self._join(ops.Scatter(out, ins, src))

    def reduce_scatter(self, output: torch.Tensor, input_list: list[torch.Tensor], op: object = _SUM) -> Work:
        """Reduce ``input_list[i]`` across ranks into rank i's ``output``.

        >>> import torch, aiocoll
        >>> async def worker(comm):
        ...     out = torch.zeros(1)
        ...     await comm.reduce_scatter(out, [torch.tensor([i * 1.0]) for i in range(comm.world_size)])
        ...     return out.item()
        >>> aiocoll.spawn(worker, world=3)
        [0.0, 3.0, 6.0]
        """
        out = self._tensor("reduce_scatter", "output", output)
        ins = self._tensors("reduce_scatter", "input_list", input_list, self.world_size)
        # input_list[i] goes to rank i, whose output may differ in shape from this rank's (gloo's uneven
        # reduce_scatter): this rank's own must match its output; all must match across ranks (the signature)
        for i, x in enumerate(ins):
            self._same("reduce_scatter", f"input_list[{i}]", x, "output", out, shape=i == self.rank)
        return self._join(ops.ReduceScatter(out, ins, self._reduction("reduce_scatter", op, out.dtype)))

    def reduce_scatter_tensor(self, output: torch.Tensor, input: torch.Tensor, op: object = _SUM) -> Work:
        """Reduce ``input`` across ranks; rank i gets chunk i (along dim 0) in ``output``.

        >>> import torch, aiocoll
        >>> async def worker(comm):
        ...     out = torch.zeros(2)
        ...     await comm.reduce_scatter_tensor(out, torch.arange(4.0))
        ...     return out.tolist()
        >>> aiocoll.spawn(worker, world=2)
        [[0.0, 2.0], [4.0, 6.0]]
        """
        name = "reduce_scatter_tensor"
        out = self._tensor(name, "output", output)
        x = self._tensor(name, "input", input)
        self._same(name, "input", x, "output", out, shape=False)
        if x.numel() != out.numel() * self.world_size:
            self._bad(
                name,
                f"argument 'input' must hold world_size ({self.world_size}) x output "
                f"({out.numel()} elements), has {x.numel()}",
            )
        return self._join(ops.ReduceScatterTensor(out, x, self._reduction(name, op, out.dtype)))

    def all_to_all(self, output_tensor_list: list[torch.Tensor], input_tensor_list: list[torch.Tensor]) -> Work:
        """Send ``input_tensor_list[j]`` to rank j; receive rank j's into ``output_tensor_list[j]``.

        >>> import torch, aiocoll
        >>> async def worker(comm):
        ...     ins = [torch.tensor([10.0 * comm.rank + j]) for j in range(comm.world_size)]
        ...     outs = [torch.zeros(1) for _ in range(comm.world_size)]
        ...     await comm.all_to_all(outs, ins)
        ...     return torch.cat(outs).tolist()
        >>> aiocoll.spawn(worker, world=2)
        [[0.0, 10.0], [1.0, 11.0]]
        """
        outs = self._tensors("all_to_all", "output_tensor_list", output_tensor_list, self.world_size)
        ins = self._tensors("all_to_all", "input_tensor_list", input_tensor_list, self.world_size)
        for i, t in enumerate(outs + ins):
            arg = f"output_tensor_list[{i}]" if i < len(outs) else f"input_tensor_list[{i - len(outs)}]"
            self._same("all_to_all", arg, t, "input_tensor_list[0]", ins[0], shape=False)
        if outs[self.rank].shape != ins[self.rank].shape:
            self._bad(
                "all_to_all",
                f"argument 'output_tensor_list[{self.rank}]' has shape {list(outs[self.rank].shape)} "
                f"but 'input_tensor_list[{self.rank}]' has {list(ins[self.rank].shape)}",
            )
        return self._join(ops.AllToAll(outs, ins))

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Sequence[int] | torch.Tensor | None = None,
        input_split_sizes: Sequence[int] | torch.Tensor | None = None,
    ) -> Work:
        """Split ``input`` along dim 0, send chunk j to rank j, concatenate what arrives in ``output``.

        Without split sizes the chunks are even; ``input_split_sizes[j]`` rows go to rank
        j, and ``output_split_sizes[j]`` rows arrive from it. Here rank 0 sends 1 row to
        itself and 2 to rank 1:

        >>> import torch, aiocoll
        >>> async def worker(comm):
        ...     if comm.rank == 0:
        ...         x, in_splits, out_splits = torch.tensor([0.0, 1.0, 2.0]), [1, 2], [1, 1]
        ...     else:
        ...         x, in_splits, out_splits = torch.tensor([10.0, 11.0]), [1, 1], [2, 1]
        ...     out = torch.zeros(sum(out_splits))
        ...     await comm.all_to_all_single(out, x, out_splits, in_splits)
        ...     return out.tolist()
        >>> aiocoll.spawn(worker, world=2)
        [[0.0, 10.0], [1.0, 2.0, 11.0]]
        """
        name = "all_to_all_single"
        out = self._tensor(name, "output", output)
        x = self._tensor(name, "input", input)
        self._same(name, "output", out, "input", x, shape=False)
        if out.dim() == 0 or x.dim() == 0:
            self._bad(name, "tensors must have at least one dimension")
        if out.shape[1:] != x.shape[1:]:
            self._bad(name, f"'output' and 'input' must agree past dim 0, got {list(out.shape)} and {list(x.shape)}")
        out_splits = self._splits(name, "output_split_sizes", output_split_sizes, out.shape[0])
        in_splits = self._splits(name, "input_split_sizes", input_split_sizes, x.shape[0])
        return self._join(ops.AllToAllSingle(out, x, out_splits, in_splits))

    def _splits(self, op: str, arg: str, splits: Sequence[int] | torch.Tensor | None, rows: int) -> list[int]:
        """The split sizes as ints; what torch takes: a list, tuple or Size of ints, or a 1-D integer tensor."""
        w = self.world_size
        expected = f"expected a list of {w} ints or a 1-D integer tensor"
        if isinstance(splits, torch.Tensor):
            if (
                splits.dim() != 1
                or splits.dtype.is_floating_point
                or splits.dtype.is_complex
                or splits.dtype == torch.bool
            ):
                self._bad(
                    op, f"argument {arg!r}: {expected}, got a {splits.dtype} tensor of shape {list(splits.shape)}"
                )
            splits = [int(s) for s in splits.tolist()]
        elif splits is not None and not isinstance(splits, (list, tuple, torch.Size)):
            self._bad(op, f"argument {arg!r}: {expected}, got {type(splits).__name__}")
        if splits is None or len(splits) == 0:
            if rows % w:
                self._bad(op, f"dim 0 ({rows}) is not divisible by the group size ({w}); pass {arg}")
            return [rows // w] * w
        out = list(splits)
        if len(out) != w:
            self._bad(op, f"argument {arg!r}: expected {w} sizes (the group size), got {len(out)}")
        if any(not isinstance(s, int) or isinstance(s, bool) or s < 0 for s in out):
            self._bad(op, f"argument {arg!r}: sizes must be non-negative ints, got {out}")
        if sum(out) != rows:
            self._bad(op, f"argument {arg!r}: sizes {out} sum to {sum(out)}, but dim 0 has {rows} rows")
        return out

    def barrier(self) -> Work:
        """Wait until every rank of the group has called ``barrier``.

        >>> import aiocoll
        >>> log = []
        >>> async def worker(comm):
        ...     log.append(f"before {comm.rank}")
        ...     await comm.barrier()
        ...     log.append(f"after {comm.rank}")
        >>> _ = aiocoll.spawn(worker, world=2)
        >>> sorted(log[:2]), sorted(log[2:])
        (['before 0', 'before 1'], ['after 0', 'after 1'])
        """
        return self._join(ops.Barrier())

    # -- point to point --------------------------------------------------------------

    def _tag(self, op: str, tag: object) -> int:
        if not isinstance(tag, int) or isinstance(tag, bool):
            self._bad(op, f"argument 'tag': expected an int, got {type(tag).__name__}")
        return tag

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Work:
        """Send ``tensor`` to rank ``dst``; completes when a matching ``recv`` has taken it.

        Sends and receives pair up in call order per (sender, receiver, tag).

        >>> import torch, aiocoll
        >>> async def worker(comm):
        ...     t = torch.zeros(2)
        ...     if comm.rank == 0:
        ...         await comm.send(torch.tensor([1.0, 2.0]), dst=1)
        ...     else:
        ...         await comm.recv(t, src=0)
        ...     return t.tolist()
        >>> aiocoll.spawn(worker, world=2)
        [[0.0, 0.0], [1.0, 2.0]]
        """
        t = self._tensor("send", "tensor", tensor)
        dst = self._root("send", "dst", dst)
        if dst == self.rank:
            self._bad("send", f"argument 'dst': rank {dst} cannot send to itself")
        return self._join(ops.Send(t, dst, self._tag("send", tag)))

    def recv(self, tensor: torch.Tensor, src: int | None = None, tag: int = 0) -> Work:
        """Receive into ``tensor`` from rank ``src`` (any rank if None); awaits to the sender's rank.

        With no ``src``, the earliest matching send from any rank is taken:

        >>> import torch, aiocoll
        >>> async def worker(comm):
        ...     if comm.rank > 0:
        ...         await comm.send(torch.tensor([comm.rank * 1.0]), dst=0)
        ...         return None
        ...     got = []
        ...     for _ in range(comm.world_size - 1):
        ...         t = torch.zeros(1)
        ...         src = await comm.recv(t)
        ...         got.append((src, t.item()))
        ...     return sorted(got)
        >>> aiocoll.spawn(worker, world=3)
        [[(1, 1.0), (2, 2.0)], None, None]
        """
        t = self._tensor("recv", "tensor", tensor)
        if src is not None:
            src = self._root("recv", "src", src)
            if src == self.rank:
                self._bad("recv", f"argument 'src': rank {src} cannot receive from itself")
        elif not self._any_source_ok():
            self._bad("recv", "a recv from any source is not supported in a group that spans processes; pass 'src'")
        return self._join(ops.Recv(t, src, self._tag("recv", tag)))

    # -- objects -------------------------------------------------------------------------

    def broadcast_object(self, obj: object, src: int) -> Work:
        """Rank ``src``'s ``obj`` on every rank (each gets its own unpickled copy).

        >>> import aiocoll
        >>> async def worker(comm):
        ...     return await comm.broadcast_object({"lr": 0.1} if comm.rank == 0 else None, src=0)
        >>> aiocoll.spawn(worker, world=2)
        [{'lr': 0.1}, {'lr': 0.1}]
        """
        src = self._root("broadcast_object", "src", src)
        payload = self._dumps("broadcast_object", "obj", obj) if self.rank == src else None
        return self._join(ops.BroadcastObject(payload, src))

    def all_gather_object(self, obj: object) -> Work:
        """Every rank's ``obj``, as a list indexed by rank, on every rank.

        >>> import aiocoll
        >>> async def worker(comm):
        ...     return await comm.all_gather_object(f"rank{comm.rank}")
        >>> aiocoll.spawn(worker, world=2)
        [['rank0', 'rank1'], ['rank0', 'rank1']]
        """
        return self._join(ops.AllGatherObject(self._dumps("all_gather_object", "obj", obj)))

    def gather_object(self, obj: object, dst: int = 0) -> Work:
        """Every rank's ``obj`` as a list on rank ``dst``; None elsewhere.

        >>> import aiocoll
        >>> async def worker(comm):
        ...     return await comm.gather_object(comm.rank**2, dst=0)
        >>> aiocoll.spawn(worker, world=3)
        [[0, 1, 4], None, None]
        """
        dst = self._root("gather_object", "dst", dst)
        return self._join(ops.GatherObject(self._dumps("gather_object", "obj", obj), dst))

    def scatter_object(self, objs: Sequence[object] | None, src: int = 0) -> Work:
        """``objs[i]`` of rank ``src`` to rank i; ``objs`` is ignored on the other ranks.

        >>> import aiocoll
        >>> async def worker(comm):
        ...     return await comm.scatter_object(["a", "b", "c"] if comm.rank == 0 else None, src=0)
        >>> aiocoll.spawn(worker, world=3)
        ['a', 'b', 'c']
        """
        src = self._root("scatter_object", "src", src)
        payloads = None
        if self.rank == src:
            if not isinstance(objs, (list, tuple)) or len(objs) != self.world_size:
                n = len(objs) if isinstance(objs, (list, tuple)) else type(objs).__name__
                self._bad(
                    "scatter_object",
                    f"argument 'objs': expected a list of {self.world_size} objects on the source rank, got {n}",
                )
            payloads = [self._dumps("scatter_object", f"objs[{i}]", o) for i, o in enumerate(objs)]
        return self._join(ops.ScatterObject(payloads, src))

    # -- sub-groups ----------------------------------------------------------------------

    async def new_group(self, ranks: Sequence[int]) -> Comm | None:
        """Make a sub-group of ``ranks`` (group-local); every rank of this group must call it.

        Returns the member's ``Comm`` (ranks renumbered in sorted order) or None. On a
        process group, the new group is a torch.distributed group too (``comm.process_group``).

        >>> import torch, aiocoll
        >>> async def worker(comm):
        ...     evens = await comm.new_group([0, 2])
        ...     if evens is None:
        ...         return None
        ...     t = torch.tensor([comm.rank * 1.0])
        ...     await evens.all_reduce(t)
        ...     return evens.rank, evens.world_size, t.item()
        >>> aiocoll.spawn(worker, world=3)
        [(0, 2, 2.0), None, (1, 2, 2.0)]
        """
        if not isinstance(ranks, (list, tuple, range)) or not ranks:
            self._bad("new_group", "argument 'ranks': expected a non-empty list of ranks")
        rs = sorted(self._root("new_group", f"ranks[{i}]", r) for i, r in enumerate(ranks))
        if len(set(rs)) != len(rs):
            self._bad("new_group", f"argument 'ranks': duplicate ranks in {list(ranks)}")
        call = ops.NewGroup(tuple(rs))
        seq = self._group_seq()
        part = await self._join(call)
        return await self._subgroup(part, seq, call)

    async def split(self, color: Hashable | None, key: object = 0) -> Comm | None:
        """MPI-style split: ranks with the same ``color`` form a group, ordered by (key, rank).

        ``color=None`` joins no group and returns None (on a process group, colors and
        keys travel pickled). Here even and odd ranks split, each group in reverse rank
        order:

        >>> import aiocoll
        >>> async def worker(comm):
        ...     sub = await comm.split(color=comm.rank % 2, key=-comm.rank)
        ...     return sub.rank, sub.group_ranks
        >>> aiocoll.spawn(worker, world=4)
        [(1, (2, 0)), (1, (3, 1)), (0, (2, 0)), (0, (3, 1))]
        """
        try:
            hash(color)
        except TypeError:
            self._bad("split", f"argument 'color' must be hashable, got {type(color).__name__}")
        call = ops.Split(color, key)
        seq = self._group_seq()
        part = await self._join(call)
        return await self._subgroup(part, seq, call)


def _empty(xs: object) -> bool:
    """None or an empty list: what a non-root rank may pass for the root's list."""
    return xs is None or (isinstance(xs, (list, tuple)) and not xs)
