"""``EngineComm``: the ``Comm`` of a rank of ``spawn``, whose calls join the in-process engine."""

from __future__ import annotations

import torch

from .. import _ops as ops
from .._comm import Comm
from .._errors import AiocollError
from .._ops import _cuda
from .._stats import Statistics
from ._groups import Group
from ._rank import EngineWork, current_rank_state
from ._world import World

__all__ = ["EngineComm", "rank_generator"]


class EngineComm(Comm):
    """A ``Comm`` on the in-process engine: what ``spawn`` gives each rank.

    Its collectives join the engine's rendezvous of its group; ``statistics()`` sees the
    whole world::

        async def worker(comm):          # comm: an EngineComm
            await comm.all_reduce(t)
    """

    __slots__ = ("_group", "_threaded", "_world")

    def __init__(self, world: World, group: Group, rank: int, *, threaded: bool = False) -> None:
        super().__init__(rank, group.size)
        self._world = world
        self._group = group
        # a rank running in its own thread posts its works to the loop, and waits on
        # them with Work.wait()
        self._threaded = threaded

    # Read-only names for what torch.distributed's adapter and the diagnostics read

    @property
    def world(self) -> World:
        """The engine's world this rank belongs to."""
        return self._world

    @property
    def group(self) -> Group:
        """The engine's group its collectives run in."""
        return self._group

    @property
    def threaded(self) -> bool:
        """Whether its rank runs in a thread of its own (it posts to the loop and waits with ``Work.wait``)."""
        return self._threaded

    @property
    def global_rank(self) -> int:
        """This rank's index in the whole world of ``spawn``."""
        return self._group.ranks[self.rank]

    @property
    def group_ranks(self) -> tuple[int, ...]:
        """The global ranks of this group's members, in group-rank order."""
        return self._group.ranks

    @property
    def group_name(self) -> str:
        """The group's name in aiocoll's reports: ``"world"``, then ``"world/0"`` and so on for sub-groups."""
        return self._group.name

    def statistics(self) -> Statistics:
        """A frozen snapshot of the whole world: each rank's state and what it waits for."""
        return self._world.statistics()

    def _any_source_ok(self) -> bool:
        # a group of a hybrid world that spans processes matches p2p per pair of ranks
        return self._group.bridge is None

    def _join(self, call: ops.Call) -> EngineWork:
        work = EngineWork(self._group, self.rank, call, self._site(), self._threaded)
        # CUDA inputs are ready where the caller's current stream is now: mark it here, in
        # the caller's thread (current streams are per thread)
        work._cuda = _cuda.issue(call)
        probe = self._world.probe
        if probe is not None and (hit := probe.issuing(work._rank.rank, call.name, self._group.name)) is not None:
            return self._world.inject(*hit, work)
        if self._threaded:
            world = self._world
            lock = world.lock
            if lock is not None:  # ranks take turns: this thread runs the engine
                with lock:
                    return world.post(work)
            world.call_soon_threadsafe(world.post, work)
            return work
        return self._world.post(work)

    def _group_seq(self) -> int:
        # a sub-group is named by the sequence number its making takes in this group
        return self._group.next_seq[self.rank]

    async def _subgroup(self, part: ops.Partition, seq: int, call: ops.NewGroup | ops.Split) -> EngineComm | None:
        members = part.groups[self.rank]
        if members is None:
            return None
        name = (
            f"{self._group.name}/{seq}" if isinstance(call, ops.NewGroup) else f"{self._group.name}/{seq}:{call.color}"
        )
        group = self._group.child((seq, part.colors[self.rank]), name, members)
        return EngineComm(self._world, group, members.index(self.rank), threaded=self._threaded)


def rank_generator(seed: int = 0, device: str | torch.device = "cpu") -> torch.Generator:
    """A random generator of the calling rank's own, seeded from ``seed`` and the rank.

    Async ranks share torch's global generators (they are tasks of one thread), so
    ``torch.manual_seed`` in one rank moves the others' random streams. Draw from a
    generator per rank instead (sync ranks have their own global generators already)::

        g = aiocoll.rank_generator(seed=0)       # differs per rank, same every run
        x = torch.randn(3, generator=g)

    >>> import torch, aiocoll
    >>> async def worker(comm):
    ...     return torch.randint(0, 10**6, (2,), generator=aiocoll.rank_generator(seed=0)).tolist()
    >>> first = aiocoll.spawn(worker, world=2)
    >>> first == aiocoll.spawn(worker, world=2), first[0] != first[1]
    (True, True)
    """
    st = current_rank_state()
    if st is None:
        raise AiocollError("rank_generator() must be called inside an aiocoll rank")
    g = torch.Generator(device)
    g.manual_seed((seed * 1_048_576 + st.rank) % 2**63)
    return g
