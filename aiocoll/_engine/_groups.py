"""A world's groups: each a set of ranks meeting in rendezvous, one per sequence number.

A ``Group`` holds what its ranks wait for (its pending ``Rendezvous``, its unmatched p2p
works) and when that times out; ``Groups`` is the world's registry of them: the world
group, the groups torch.distributed makes by name, their sub-groups and side channels.
The engine (``_world.World``) joins calls to rendezvous and runs them; nothing here
acts on a group.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Protocol

from .._work import fmt_site

if TYPE_CHECKING:
    import asyncio

    from .._ops import Call
    from ._deadlines import Deadlines
    from ._rank import EngineWork
    from ._record import Stamp
    from ._world import World

__all__ = ["Bridge", "Elsewhere", "Group", "Groups", "Rendezvous"]


# Where the engine meets real process groups (``aiocoll._bridge``, a layer above it): the
# engine names only what it asks of them, and that layer's classes fill these in.


class Elsewhere(Protocol):
    """Other processes run some of the world's ranks (``_bridge._hybrid.HybridWorld``)."""

    @property
    def local(self) -> range:
        """The global ranks this process runs."""
        ...

    def attach(self, group: Group) -> None:
        """``group`` was made: give it a bridge if its ranks span processes."""
        ...

    def aborted(self, message: str, cause: BaseException) -> None:
        """The world aborted here: tell the other processes."""
        ...


class Bridge(Protocol):
    """Completes one group's collectives with the other processes (``_bridge._hybrid.PGBridge``)."""

    def run(self, rdv: Rendezvous) -> asyncio.Future[list[object]]:
        """Every local member of ``rdv`` arrived: fetch the other processes' calls and run the op."""
        ...

    def p2p(self, work: EngineWork) -> asyncio.Future[object] | None:
        """A send or recv whose peer is in another process, or None if the peer is here."""
        ...

    def close(self) -> None:
        """No op of the group goes to other processes any more."""
        ...


class Rendezvous:
    """The meeting of a group's ranks at one sequence number."""

    __slots__ = ("arrived", "calls", "group", "mismatched", "seq", "sig", "stamp", "works")

    def __init__(self, group: Group, seq: int) -> None:
        self.group = group
        self.seq = seq
        n = group.size
        self.calls: list[Call | None] = [None] * n
        self.works: list[EngineWork | None] = [None] * n
        self.arrived = 0
        self.sig: Hashable = None
        self.mismatched = False
        self.stamp: Stamp | None = None

    @property
    def where(self) -> str:
        return f"#{self.seq} on group {self.group.name!r}"

    @property
    def pending(self) -> bool:
        """Whether it still waits for ranks (it leaves its group's table when it completes or fails)."""
        return self.group.pending.get(self.seq) is self

    def op(self) -> type[Call]:
        """The collective the ranks called (the lowest arrived rank's, if they disagree)."""
        return type(next(c for c in self.calls if c is not None))

    def missing(self) -> list[int]:
        return [r for r, w in enumerate(self.works) if w is None]

    def table(self) -> str:
        lines = []
        for r, w in enumerate(self.works):
            g = self.group.ranks[r]
            who = f"rank {r}" if g == r else f"rank {r} (global {g})"
            if w is None:
                lines.append(f"  {who}: not arrived ({self.group.world.ranks[g].status()})")
            else:
                lines.append(f"  {who}: {w._call.describe()} at {fmt_site(w._site)}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<Rendezvous {self.where} arrived={self.arrived}/{self.group.size}>"


class Group:
    """A set of global ranks that run collectives together, in group-rank order."""

    __slots__ = (
        "_children",
        "bridge",
        "broken",
        "deadlines",
        "expected",
        "index",
        "main",
        "name",
        "next_seq",
        "own_timeout",
        "pending",
        "ranks",
        "recvs",
        "sends",
        "side",
        "size",
        "world",
    )

    def __init__(self, world: World, name: str, ranks: Sequence[int]) -> None:
        self.world = world
        self.name = name
        self.ranks = tuple(ranks)
        self.index = {g: i for i, g in enumerate(self.ranks)}  # global rank -> group-rank
        self.size = len(self.ranks)
        # arrivals that complete a rendezvous here: every member, unless other processes
        # run some of them (a hybrid world), whose calls the bridge then fetches
        self.expected = self.size
        self.bridge: Bridge | None = None
        if world.hybrid is not None:
            world.hybrid.attach(self)
        self.next_seq = [0] * self.size
        self.pending: dict[int, Rendezvous] = {}
        # p2p: unmatched sends by (dst, tag) then src, unmatched recvs by (dst, tag); only
        # the world's P2PMatcher changes them
        self.sends: dict[tuple[int, int], dict[int, deque[tuple[int, EngineWork]]]] = {}
        self.recvs: dict[tuple[int, int], list[EngineWork]] = {}
        self._children: dict[Hashable, Group] = {}
        # when its pending ops time out: the world's timeout, or a torch.distributed
        # group's own (then given as (asked, kept) seconds; see _grouptimeouts)
        self.deadlines: Deadlines | None = world.deadlines
        self.own_timeout: tuple[float, float] | None = None
        self.broken: str | None = None  # why, once its own timeout has broken it
        # monitored_barrier's channel beside it (``Groups.side_channel``), and, for that
        # channel, the group it serves (``self`` for any other group)
        self.side: Group | None = None
        self.main: Group = self

    @property
    def is_world(self) -> bool:
        return self is self.world.group

    def child(self, key: Hashable, name: str, ranks: Sequence[int]) -> Group:
        """The sub-group made at ``key``; every member asks, the first creates it."""
        g = self._children.get(key)
        if g is None:
            g = self._children[key] = Group(self.world, name, [self.ranks[r] for r in ranks])
        return g

    def __repr__(self) -> str:
        return f"<Group {self.name!r} ranks={list(self.ranks)} pending={len(self.pending)}>"


class Groups:
    """The groups of one world: the world group and every group made from it.

    A group made through torch.distributed is found by name and ranks; the first member
    to ask makes it. A rank that makes a group of the same name and ranks again (torch
    names groups anew after ``destroy_process_group``) gets a new one, as its peers do:
    the n-th making of each member meets the n-th of the others. Ranks in threads make
    groups concurrently, hence the lock.

    >>> from types import SimpleNamespace
    >>> world = SimpleNamespace(hybrid=None, deadlines=None)
    >>> gs = Groups(world, 4)
    >>> a = gs.named("1", [0, 1], rank=0)
    >>> a is gs.named("1", [0, 1], rank=1), a is gs.named("1", [0, 1], rank=0)
    (True, False)
    >>> len(gs.all())
    3
    """

    def __init__(self, world: World, size: int) -> None:
        self._world = world
        self.world = Group(world, "world", range(size))
        self._named: dict[tuple[str, tuple[int, ...], int], Group] = {}
        self._made: dict[tuple[str, tuple[int, ...], int], int] = {}  # by (name, ranks, rank): how often made
        self._lock = threading.Lock()

    def named(self, name: str, ranks: Sequence[int], rank: int) -> Group:
        """The group that global ``rank`` makes as ``name`` over ``ranks`` (global), made by the first member."""
        members = tuple(ranks)
        with self._lock:
            made = self._made.get((name, members, rank), 0)
            self._made[(name, members, rank)] = made + 1
            key = (name, members, made)
            g = self._named.get(key)
            if g is None:
                g = self._named[key] = Group(self._world, name, members)
        return g

    def side_channel(self, group: Group) -> Group:
        """``group``'s channel for ``monitored_barrier``: its ranks and timeout, sequences and queues of its own."""
        with self._lock:
            side = group.side
            if side is None:
                side = group.side = Group(self._world, f"{group.name}:monitored_barrier", group.ranks)
                side.main = group
                side.deadlines, side.own_timeout, side.broken = group.deadlines, group.own_timeout, group.broken
        return side

    def all(self) -> list[Group]:
        """Every group, sub-groups and side channels included."""
        out, stack = [], [self.world, *list(self._named.values())]
        while stack:
            g = stack.pop()
            out.append(g)
            stack.extend(g._children.values())
            if g.side is not None:
                stack.append(g.side)
        return out

    def __repr__(self) -> str:
        return f"<Groups of {len(self.all())}>"
