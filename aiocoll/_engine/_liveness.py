"""Liveness and deadlock detection: how many ranks are live and blocked, and who waits for whom.

The engine's invariant (see ``_world``): a Work only completes when some rank makes a
call, or when an op already under way ends. So once every live rank is blocked and no
op is in flight, nothing can ever complete: that is a deadlock, reported at once with
a table of what each rank waits for. (Unless a rank waits in a torch.distributed group
with a timeout of its own: the timeout will release it, as gloo's would.)

Each rank keeps its own counts (tasks live, tasks parked: ``RankState``); it tells the
``Liveness`` of its world when it becomes live or blocked, which keeps the world's
totals. The check is two integer compares on the common path: the full test runs only
when the last live rank blocks.

It names the engine's ranks, works and world only for type checking: the world
(``_engine._world``) imports this module, not the other way round.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from .._errors import DeadlockError
from .._ops import Recv, Send

if TYPE_CHECKING:
    from ._rank import EngineWork, RankState
    from ._world import World

__all__ = ["Liveness"]

_log = logging.getLogger("aiocoll")


class Liveness:
    """The world's count of live and blocked ranks; reports a deadlock when they are equal and nothing moves.

    Ranks report to it as they become live or blocked (``RankState``), the op runner as
    ops start and stop being in flight (``OpRunner``).
    """

    __slots__ = ("_told", "_world", "blocked", "in_flight", "live")

    def __init__(self, world: World) -> None:
        self._world = world
        self.live = 0  # ranks with some task or thread acting for them
        self.blocked = 0  # of those, ranks whose every task or thread waits for a Work
        # ops under way that will complete with no rank's call (off the loop, queued behind
        # one, in other processes, a release on its way): not a deadlock meanwhile
        self.in_flight = 0
        self._told: frozenset[int] = frozenset()  # the waits a warning named (see check)

    def check(self) -> None:
        """Fail every waiting work with a ``DeadlockError`` and abort, if nothing can complete any more.

        Called when a rank becomes blocked or stops being live, and when an op in flight ends.
        """
        if self.blocked < self.live or self.live == 0:
            return  # the common case: some rank can still make a call
        # (more blocked than live: tasks made out of the engine's sight parked; see below)
        world = self._world
        if self.in_flight or world.aborted is not None or world.explain_stall():
            return
        timed = [w for st in world.ranks for w in st.waiting if w._group.own_timeout is not None]
        if timed:
            # a torch.distributed group's own timeout will release its waiters, which may
            # then go on (as in gloo, where a program may catch the timeout): not a
            # deadlock yet, and the check runs again once they block again. Say so now.
            told = frozenset(map(id, timed))
            if told != self._told:
                self._told = told
                _log.warning(
                    "every live rank waits; a group's own timeout will end the wait of %s, which may go on "
                    "after it (until then this looks like a deadlock):\n%s",
                    ", ".join(sorted({f"rank {w._rank.rank}" for w in timed})),
                    self.table(),
                )
            return
        # Tasks made out of the engine's sight may be running: count them (which may
        # report the deadlock from within), or leave it to the timeout if they cannot be.
        if not world.tasks.count_all() or self.blocked != self.live or world.aborted is not None:
            return
        message = "deadlock: every live rank waits for a peer that will never arrive\n" + self.table()
        first: DeadlockError | None = None
        for st in world.ranks:
            for w in list(st.waiting):
                e = DeadlockError(message)
                first = first or e
                w._resolve(exc=e)
        assert first is not None
        world.abort(None, first)

    # -- reports ---------------------------------------------------------------------

    def table(self) -> str:
        """One line per rank: what it is doing or waiting for."""
        lines = []
        for st in self._world.ranks:
            line = f"  rank {st.rank}: {st.status()}"
            extra = self.waiting_for(st)
            if extra:
                line += f" -- {extra}"
            lines.append(line)
        return "\n".join(lines)

    @staticmethod
    def peers(w: EngineWork) -> tuple[str, list[int]]:
        """What a waiting work waits for: its kind, and the global ranks it needs (none: any)."""
        g, call = w._group, w._call
        if w._rdv is not None:
            return "collective", [g.ranks[r] for r in w._rdv.missing()]
        if isinstance(call, Recv):
            return "recv", [] if call.src is None else [g.ranks[call.src]]
        if isinstance(call, Send):
            return "send", [g.ranks[call.dst]]
        return "other", []

    def waits_for(self, st: RankState) -> list[int]:
        """The global ranks whose calls the works ``st`` waits on still need."""
        return sorted({r for w in st.waiting for r in self.peers(w)[1]})

    def waiting_for(self, st: RankState) -> str:
        """Whom a blocked rank waits for, in words (empty if it is not blocked)."""
        if not st.blocked:
            return ""
        parts = []
        for w in st.waiting:
            kind, ranks = self.peers(w)
            if kind == "collective":
                parts.append(f"waits for ranks {ranks}")
            elif kind == "recv":
                parts.append(f"waits for a send from {f'rank {ranks[0]}' if ranks else 'any rank'}")
            elif kind == "send":
                parts.append(f"waits for rank {ranks[0]} to recv")
        return "; ".join(parts)

    def __repr__(self) -> str:
        return f"<Liveness live={self.live} blocked={self.blocked} in_flight={self.in_flight}>"
