"""What ``Comm.statistics()`` returns: frozen snapshots of what the ranks are doing.

One type for both kinds of ``Comm``, so monitoring code works on either: over the
in-process engine a snapshot sees every rank; over a real process group
(``from_process_group``) it sees this process only, and says so (other ranks are
``"remote"``, counts that cannot be known are 0).
"""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass
from typing import Literal

__all__ = ["Phase", "RankStatistics", "StateName", "Statistics"]

StateName = Literal["running", "blocked", "returned", "failed", "remote"]
"""What a rank is doing: see ``RankStatistics.state``."""


class Phase(enum.Enum):
    """Where a rank is in its life, as the engine keeps it (``state`` names it in statistics)."""

    RUNNING = "running"
    RETURNED = "returned"
    FAILED = "failed"
    REMOTE = "in another process"  # a rank of a hybrid world that another process runs

    @property
    def state(self) -> StateName:
        """Its name in ``RankStatistics.state`` (a running rank may show as ``"blocked"`` there)."""
        return _STATES[self]


_STATES: dict[Phase, StateName] = {
    Phase.RUNNING: "running",
    Phase.RETURNED: "returned",
    Phase.FAILED: "failed",
    Phase.REMOTE: "remote",
}


@dataclass(frozen=True, slots=True)
class RankStatistics:
    """One rank in a ``Statistics`` snapshot: its state, what it waits in, what it waits for.

    >>> import aiocoll
    >>> async def worker(comm):
    ...     await comm.barrier()
    ...     return comm.statistics().ranks[comm.rank]
    >>> aiocoll.spawn(worker, world=2)[1]
    <RankStatistics rank=1 running, completed=1>
    """

    rank: int
    """The global rank (the world's; on a process group, torch.distributed's)."""
    state: StateName
    """``"running"``; ``"blocked"`` when all of its tasks wait in ops; ``"returned"``;
    ``"failed"``; ``"remote"`` for a rank in another process, whose state is not known here."""
    waiting: tuple[str, ...] = ()
    """The ops it waits in, as reports name them: ``"barrier() #3 on group 'world'"``.
    Empty on a process group (its pending ops are counted in ``Statistics``)."""
    waits_for: tuple[int, ...] = ()
    """The global ranks those ops still need."""
    completed: int = 0
    """Its ops that have completed (or failed) so far; 0 for a remote rank."""

    def __repr__(self) -> str:
        out = f"<RankStatistics rank={self.rank} {self.state}"
        if self.waiting:
            out += f" in {'; '.join(self.waiting)}"
        if self.waits_for:
            out += f" for ranks {list(self.waits_for)}"
        return f"{out}, completed={self.completed}>"


@dataclass(frozen=True, slots=True)
class Statistics:
    """A snapshot of a world: counts, and each rank's ``RankStatistics``.

    It never changes once taken; take another to see what changed. Here rank 0 watches
    rank 1 block in an ``all_reduce`` that rank 0 has not joined yet:

    >>> import asyncio, torch, aiocoll
    >>> async def worker(comm):
    ...     if comm.rank == 1:
    ...         await comm.all_reduce(torch.ones(1))
    ...         return None
    ...     while comm.statistics().blocked_ranks == 0:
    ...         await asyncio.sleep(0)
    ...     s = comm.statistics()
    ...     await comm.all_reduce(torch.ones(1))
    ...     return s
    >>> s = aiocoll.spawn(worker, world=2)[0]
    >>> s
    <Statistics size=2 live=2 blocked=1 pending_collectives=1 pending_p2p=0: 1 running, 1 blocked>
    >>> s.ranks[1].waiting, s.ranks[1].waits_for
    (("all_reduce(float32[1], op=ReduceOp.SUM) #0 on group 'world'",), (0,))
    """

    size: int
    """Ranks in the world (on a process group: in the group)."""
    aborted: bool
    """Whether the world was aborted. Always False on a process group, whose failures
    surface as errors of its ops."""
    live_ranks: int
    """Ranks of this process still running. On a process group: 1, this one."""
    blocked_ranks: int
    """Of those, how many wait in ops (nothing else of theirs runs). On a process group:
    0, as its tasks are not tracked."""
    pending_collectives: int
    """Collectives still waiting for ranks. On a process group: this process's
    collectives not yet complete."""
    pending_p2p: int
    """Sends and receives not yet matched. On a process group: this process's not yet complete."""
    ranks: tuple[RankStatistics, ...]
    """One per rank: the world's, by global rank; on a process group, the group's
    members in group-rank order (this process's own entry is the one not ``"remote"``)."""
    backend: str | None = None
    """The torch.distributed backend of a process group (``"gloo"``, ``"nccl"``); None in-process."""

    def __repr__(self) -> str:
        states = Counter(r.state for r in self.ranks)
        head = f"<Statistics size={self.size}"
        if self.backend is not None:
            head += f" backend={self.backend}"
        if self.aborted:
            head += " aborted"
        return (
            f"{head} live={self.live_ranks} blocked={self.blocked_ranks} "
            f"pending_collectives={self.pending_collectives} pending_p2p={self.pending_p2p}: "
            + ", ".join(f"{n} {state}" for state, n in states.items())
            + ">"
        )
