"""``Comm`` over a real torch.distributed process group (gloo, NCCL): ``from_process_group``.

Every op is issued with torch's own process group (the ``ProcessGroup`` methods that
``dist.all_reduce(..., async_op=True)`` and friends call) and completes on the event loop
through a bridged future; nothing here moves data by itself, and nothing blocks the loop.

Its parts, each a module of its own:

- ``_pgbridge``: torch completions into the loop (``bridge_work``, ``bridge_future``,
  ``when_done``);
- ``_pgbytes``: async exchange of byte strings (the object collectives' transport);
- ``_pgissue``: ``Issuer``, one per group, which turns aiocoll op calls into the group's
  own method calls, in call order, and completes their futures;
- here: ``PGWork``, ``ProcessGroupComm`` and ``from_process_group``, what users hold.
"""

from __future__ import annotations

import asyncio

import torch.distributed as dist

from .. import _ops as ops
from .. import _torch
from .._comm import Comm
from .._errors import AiocollError, BlockingCallError, CollectiveTimeoutError, InvalidArgumentError
from .._stats import RankStatistics, Statistics
from .._work import Site, Work
from ._pgissue import Issuer

__all__ = ["PGWork", "ProcessGroupComm", "create_group", "from_process_group"]

# -- Work and Comm ------------------------------------------------------------------------------


class PGWork(Work):
    """A ``Work`` of a process-group ``Comm``: await it, or ask ``done()``, ``result()``...

    Behaves as in-process works do; ``wait()`` blocks a thread other than the loop's::

        w = comm.all_reduce(t)         # issued on the group now
        await w                        # t holds the sum
    """

    __slots__ = ("_grank", "_group_name")

    def __init__(self, fut: asyncio.Future[object], call: ops.Call, rank: int, group: str, site: Site | None) -> None:
        super().__init__(fut, call, site)
        self._grank = rank
        self._group_name = group

    @property
    def _where(self) -> str:
        return f"on group {self._group_name!r}"

    @property
    def _owner(self) -> int:
        return self._grank

    def wait(self, timeout: float | None = None) -> object:
        """Block the calling thread (not the loop's) until done; return the result or raise."""
        fut = self._fut
        loop = fut.get_loop()
        if not fut.done():
            try:
                on_loop = asyncio.get_running_loop() is loop
            except RuntimeError:
                on_loop = False
            if on_loop:
                raise BlockingCallError(f"blocking wait for {self._call.describe()} on the event loop thread: await it")

            async def waiter() -> object:
                return await asyncio.shield(fut)

            try:
                return asyncio.run_coroutine_threadsafe(waiter(), loop).result(timeout)
            except TimeoutError:
                raise CollectiveTimeoutError(
                    f"rank {self._grank} waited {timeout}s in {self.describe()}; it is still pending"
                ) from None
        return fut.result()


class ProcessGroupComm(Comm):
    """A ``Comm`` whose collectives run on a real torch.distributed process group.

    Made by ``aiocoll.from_process_group``; same methods, arguments, checks and results
    as a ``Comm`` of ``aiocoll.spawn``::

        comm = aiocoll.from_process_group()      # the default group
        await comm.all_reduce(t)
    """

    __slots__ = ("_iss",)

    def __init__(self, pg: dist.ProcessGroup, *, timeout: float | None = None, check: bool | None = None) -> None:
        iss = Issuer.of(pg, timeout, check)
        super().__init__(iss.rank, iss.size)
        self._iss = iss

    @property
    def process_group(self) -> dist.ProcessGroup:
        """The torch.distributed group this Comm runs on (to mix in ``dist.*`` calls).

        ``dist.all_reduce(t, group=comm.process_group)`` is the blocking twin of
        ``await comm.all_reduce(t)``.
        """
        return self._iss.pg

    @property
    def backend(self) -> str:
        """The group's torch.distributed backend, such as ``"gloo"`` or ``"nccl"``."""
        return self._iss.backend

    @property
    def global_rank(self) -> int:
        """This process's rank in torch.distributed's default group."""
        return self._iss.global_ranks[self.rank]

    @property
    def group_ranks(self) -> tuple[int, ...]:
        """The global ranks of this group's members, in group-rank order.

        ``comm.group_ranks[comm.rank] == comm.global_rank``.
        """
        return self._iss.global_ranks

    @property
    def group_name(self) -> str:
        """The process group's name in torch.distributed (``"0"`` for the default group)."""
        return self._iss.name

    def __repr__(self) -> str:
        return f"<Comm rank={self.rank}/{self.world_size} group={self.group_name!r} backend={self.backend}>"

    def statistics(self) -> Statistics:
        """This process's view of the group, frozen: its ops pending and completed.

        Peers live in other processes, so their state is not known: they are ``"remote"``
        in ``ranks``, and this rank is the one that is not::

            s = comm.statistics()
            me = s.ranks[comm.rank]          # state "running", completed = ops done here
            print(s.backend, s.pending_collectives, s.pending_p2p, me.completed)
        """
        iss = self._iss
        p2p = sum(isinstance(c, (ops.Send, ops.Recv)) for c in iss.pending.values())
        return Statistics(
            size=self.world_size,
            aborted=False,
            live_ranks=1,
            blocked_ranks=0,
            pending_collectives=len(iss.pending) - p2p,
            pending_p2p=p2p,
            ranks=tuple(
                RankStatistics(g, "running", completed=iss.completed) if r == self.rank else RankStatistics(g, "remote")
                for r, g in enumerate(iss.global_ranks)
            ),
            backend=iss.backend,
        )

    def _join(self, call: ops.Call) -> PGWork:
        site = self._site()
        return PGWork(self._iss.issue(call, site=site), call, self.rank, self._iss.name, site)

    def _group_seq(self) -> int:
        # the issuer counts the groups made on its group as it issues their calls
        return self._iss.groups_made

    async def _subgroup(self, part: ops.Partition, seq: int, call: ops.NewGroup | ops.Split) -> ProcessGroupComm | None:
        iss = self._iss
        members = part.groups[self.rank]
        if members is None:
            return None
        ranks = [iss.global_ranks[m] for m in members]
        name = f"{iss.name}/aiocoll{seq}.{ranks[0]}"
        try:
            pg = await asyncio.to_thread(create_group, iss.pg, ranks, name)
        except RuntimeError as e:
            raise iss.error(call.describe(), e) from e
        comm = ProcessGroupComm(pg, check=iss.checker is not None)
        comm._iss.timeout, comm._iss._opts = iss.timeout, {}
        return comm


def create_group(parent: dist.ProcessGroup, ranks: list[int], name: str) -> dist.ProcessGroup:
    """A process group of ``ranks`` (global), made by its members only (blocking: run it off the loop).

    ``dist.new_group`` wants every process of the job in the same order (or, with
    ``use_local_synchronization``, names groups by their ranks alone, so the same ranks
    twice collide); aiocoll's groups are made by the parent's ranks only, under a name
    unique to the parent and its count of groups made.
    """
    backend = dist.get_backend(parent)
    timeout = _torch.group_timeout(parent, backend)  # the parent's, where it says
    return _torch.new_group_helper(ranks, dist.get_rank(), backend, name, timeout)


def from_process_group(
    pg: dist.ProcessGroup | None = None, *, timeout: float | None = None, check: bool = True
) -> Comm:
    """A ``Comm`` on a real torch.distributed process group (default: the world group).

    Same API and results as the ranks of ``aiocoll.spawn``: every collective, p2p,
    object collectives, ``new_group``/``split``. Ops are issued with ``async_op=True``
    and awaited through futures bridged into the running loop, which keeps serving
    other tasks. A timeout (the group's own, or ``timeout`` seconds per op if given)
    raises ``CollectiveTimeoutError``, with torch's error as ``__cause__``.

    ``check=True`` (the default; every process must pass the same) brings in-process
    reports to processes. Each collective is issued once every rank's call is known to
    agree (a fingerprint all-gathered on a gloo side group): ranks that call different
    collectives, or disagree on shapes, dtypes, roots, reduce ops or split sizes, raise
    ``CollectiveMismatchError`` in every process within a round trip, naming each rank's
    call and file:line, with the flight recorder table as a note. The op is never issued
    (tensors stay untouched, no wrong result), so the group stays in step. A rank that
    exits or dies is named in the survivors' ``WorldAbortedError``, with what each was
    waiting in (a heartbeat in the job's store); the Comm is then aborted (its later ops
    raise ``WorldAbortedError`` at once). ``check=False`` saves the side round
    trip per collective (see ``benchmarks/bench_checks.py``). Launch with torchrun::

        # torchrun --nproc-per-node 2 train.py
        async def main():
            dist.init_process_group("gloo")
            comm = aiocoll.from_process_group()
            t = torch.ones(3) * comm.rank
            await comm.all_reduce(t)

        asyncio.run(main())
    """
    if pg is None:
        if not dist.is_initialized():
            raise AiocollError("from_process_group(): call torch.distributed.init_process_group() first")
        pg = _torch.default_group()
    if not isinstance(pg, dist.ProcessGroup):
        raise InvalidArgumentError(f"from_process_group(): expected a ProcessGroup, got {type(pg).__name__}")
    if pg.rank() < 0:
        raise InvalidArgumentError("from_process_group(): this process is not a member of the group")
    if not isinstance(check, bool):
        raise InvalidArgumentError(f"from_process_group(): argument 'check' must be a bool, got {check!r}")
    return ProcessGroupComm(pg, timeout=timeout, check=check)
