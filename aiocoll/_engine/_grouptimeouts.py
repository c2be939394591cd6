"""A torch.distributed group's own timeout, kept as gloo keeps it.

``init_process_group(timeout=...)`` and ``new_group(timeout=...)`` give a group a timeout
of its own. gloo fails an op still pending after it ("Timed out waiting 1000ms for recv
operation to complete"), and the group breaks: the pending and later ops of every
member fail at once ("Connection closed by peer"), while the other groups go on
(measured on torch 2.13, three gloo processes). ``GroupTimeouts`` does the same for the
engine's groups:

- a group given its own timeout gets a ``Deadlines`` of that length (one per length,
  shared by the groups that have it), unless the world's own timeout is no longer:
  then that one fires first, as it does for every group;
- when the world finds one of the group's ops past it (``expired``), the op fails with
  ``GroupTimeoutError`` and the group breaks (``break_group``), with its side channel
  (``Group.side``, where ``monitored_barrier`` talks);
- the engine refuses ops on a broken group (``Group.broken`` says why).

A world's ranks share this process's cores, where torch's processes each had some, so
the timeout kept is the one asked for, stretched as a test's deadline is (``slowdown``).

Nothing here imports the engine at run time: groups and rendezvous are ``_groups``' data,
and the p2p matcher and its works are named for type checking only.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from .._errors import GroupTimeoutError
from ._deadlines import Deadlines

if TYPE_CHECKING:
    from ._groups import Group, Rendezvous
    from ._p2p import P2PMatcher
    from ._rank import EngineWork

__all__ = ["GroupTimeouts", "slowdown", "usable_cpus"]


def slowdown(ranks: int) -> int:
    """How many times longer ``ranks`` ranks sharing this process may take than in processes of their own.

    torch's processes share the machine's usable cores; ranks in one process share one
    (those taking turns) or the GIL. Rank for rank, that is ``min(ranks, cores)`` times
    less CPU time.

    >>> slowdown(1)
    1
    """
    return max(1, min(ranks, usable_cpus()))


def usable_cpus() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # (not on every platform)
        return os.cpu_count() or 1


class GroupTimeouts:
    """The own timeouts of a world's groups: their deadlines, and what happens when one passes.

    ``world_timeout``: the world's own (None: none), which a group's timeout must undercut
    to matter; ``stretch``: how much longer than asked a group's timeout is kept;
    ``deadlines(seconds)`` makes the ``Deadlines`` of one length (on the world's loop);
    ``fail_pending(group, error)`` fails what waits in a group (the world's, as on abort).
    """

    __slots__ = ("_by_length", "_fail_pending", "_make", "_p2p", "stretch", "world_timeout")

    def __init__(
        self,
        world_timeout: float | None,
        stretch: int,
        deadlines: Callable[[float], Deadlines],
        p2p: P2PMatcher,
        fail_pending: Callable[[Group, Callable[[], BaseException]], None],
    ) -> None:
        self.world_timeout = world_timeout
        self.stretch = stretch
        self._make = deadlines
        self._p2p = p2p
        self._fail_pending = fail_pending
        self._by_length: dict[float, Deadlines] = {}

    def own(self, group: Group, seconds: float) -> None:
        """``group`` (a torch.distributed group) was made with a timeout of ``seconds``."""
        kept = seconds * self.stretch
        if self.world_timeout is not None and kept >= self.world_timeout:
            return  # the world's own timeout comes first
        deadlines = self._by_length.get(kept)
        if deadlines is None:
            deadlines = self._by_length[kept] = self._make(kept)
        group.own_timeout = (seconds, kept)
        group.deadlines = deadlines

    def describe(self, group: Group) -> str:
        """``"1000 ms"``, or with the stretch: ``"1000 ms (kept: 2000 ms, as 2 ranks share the cores)"``."""
        assert group.own_timeout is not None
        asked, kept = group.own_timeout
        if kept == asked:
            return f"{_ms(asked)} ms"
        return f"{_ms(asked)} ms (kept: {_ms(kept)} ms, as {self.stretch} ranks share the cores)"

    def rendezvous_expired(self, rdv: Rendezvous) -> None:
        """A collective of a group with its own timeout is still pending past it."""
        group = rdv.group
        arrived = [r for r, w in enumerate(rdv.works) if w is not None]
        what = f"{rdv.op().name} {rdv.where}"
        message = (
            f"{what}: Timed out waiting {self.describe(group)}: ranks {arrived} arrived, "
            f"ranks {rdv.missing()} did not; the group is broken for every member from now on, "
            f"as gloo's is after a timeout:\n{rdv.table()}"
        )
        group.pending.pop(rdv.seq, None)
        for w in rdv.works:
            if w is not None:
                w._resolve(exc=GroupTimeoutError(message))
        self.break_group(group, f"{what} timed out on ranks {arrived}")

    def p2p_expired(self, work: EngineWork) -> None:
        """A send or recv of a group with its own timeout is still unmatched past it."""
        group = work._group
        unmatched = self._p2p.unmatched(work)
        self._p2p.give_up(
            work,
            GroupTimeoutError(
                f"rank {work._rank.rank}: Timed out waiting {self.describe(group)} in {unmatched}; "
                f"group {group.name!r} is broken for every member from now on, as gloo's is after a timeout"
            ),
        )
        self.break_group(group, f"{work.describe()} timed out on rank {work._rank.rank}")

    def break_group(self, group: Group, why: str) -> None:
        """``group`` (and its side channel) can no longer be used: fail what waits in it, and what comes."""
        main = group.main
        for g in (main, main.side):
            if g is None or g.broken is not None:
                continue
            g.broken = why

            def error(g: Group = g) -> GroupTimeoutError:
                return GroupTimeoutError(refusal(g))

            self._fail_pending(g, error)

    def clear(self) -> None:
        """The world was aborted: nothing is pending any more."""
        for d in self._by_length.values():
            d.clear()

    def __repr__(self) -> str:
        return f"<GroupTimeouts lengths={sorted(self._by_length)} stretch={self.stretch}>"


def refusal(group: Group) -> str:
    """Why an op of the broken ``group`` fails."""
    return f"group {group.name!r} is broken: {group.broken} (as gloo's, a group is unusable after a timeout)"


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f}"
