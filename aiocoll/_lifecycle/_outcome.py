"""What became of a world's ranks, and the one exception that reports it.

Every world driver (``spawn``, the harnesses) records its ranks' ends here and raises
what ``Outcome.report`` builds, so a failure reads the same whichever way it ran.
"""

from __future__ import annotations

import asyncio
import sys
import warnings
from typing import TYPE_CHECKING

from .._errors import WorldAbortedError

if TYPE_CHECKING:
    from .._engine._rank import EngineWork, RankState
    from .._engine._world import World

__all__ = ["Outcome", "echoes_abort", "exit_status", "sees_through", "warn_unmatched"]


class Outcome:
    """The failures of one world's ranks, in the order they happened.

    The first rank to fail on its own (not because of an abort) is the root cause: its
    failure aborts the world, and ``report`` raises it annotated with its rank.
    """

    __slots__ = ("failures", "world")

    def __init__(self, world: World) -> None:
        self.world = world
        self.failures: list[tuple[int, BaseException]] = []

    def __repr__(self) -> str:
        return f"<Outcome of a world of {self.world.size}: {len(self.failures)} rank(s) failed>"

    def failed(self, st: RankState, e: BaseException) -> None:
        """On the loop: rank ``st`` ended with ``e``; a root cause aborts the world.

        An error torch's C++ raised for one of aiocoll's (DDP's ``backward()``, which
        reads a failed future: a ``RuntimeError`` holding its text) gets that error as
        its ``__cause__``: the report then tells an abort's echo from a root cause.
        """
        sees_through(self.world, e)
        st.failed(e)
        self.failures.append((st.rank, e))
        if not self.is_echo(e):
            self.world.abort(st.rank, e)

    def is_echo(self, e: BaseException) -> bool:
        """Whether ``e`` only reports another failure: an abort, or the cancellation it caused.

        A rank's own error raised while handling a cancellation (e.g. TimeoutError from
        ``asyncio.timeout``) is its own: only the top-level exception counts as a cancel.
        """
        if isinstance(e, asyncio.CancelledError):
            return self.world.aborted is not None
        return echoes_abort(e)

    def report(self) -> BaseException:
        """The exception to raise: the first root cause, annotated with its rank.

        The notes say which rank raised it, which others failed on their own, which were
        only aborted, and (with the flight recorder on) what every rank called last.
        """
        w = self.world
        roots = [(r, e) for r, e in self.failures if not self.is_echo(e)]
        aborted = sorted(r for r, e in self.failures if self.is_echo(e))
        notes = []
        if roots:
            rank, exc = roots[0]
            notes.append(f"aiocoll: raised on rank {rank} of a world of {w.size}")
            same = sorted(r for r, e in roots[1:] if type(e) is type(exc) and str(e) == str(exc))
            if same:
                notes.append(f"aiocoll: ranks {same} raised the same {type(exc).__name__}")
            for r, e in roots[1:]:
                if r not in same:
                    notes.append(f"aiocoll: rank {r} also failed: {type(e).__name__}: {e}")
        else:
            # No rank raised a cause of its own (e.g. ranks waiting through gather were
            # cancelled): the incident that aborted the world is the cause.
            cause = w.aborted.__cause__ if w.aborted is not None else None
            if not isinstance(cause, Exception):
                return self.failures[0][1]
            exc = cause
        if aborted:
            notes.append(f"aiocoll: ranks {aborted} were aborted because of it")
        if w.recorder is not None:
            notes.append(w.recorder.report())
        for n in notes:
            exc.add_note(n)
        return exc


def sees_through(world: World, e: BaseException) -> None:
    """If torch raised ``e`` (or what it came from) for an error of ``world``'s works: that error as its cause."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if cur.__cause__ is None and (sent := world.sent_to_torch.find(cur)) is not None and sent is not cur:
            cur.__cause__ = sent
            return
        cur = cur.__cause__ or cur.__context__


def exit_status(e: SystemExit) -> int:
    """What ``sys.exit(e.code)`` makes a process's exit code, as the interpreter reads it
    (a string is printed on stderr, and means 1)."""
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code & 0xFF
    print(e.code, file=sys.stderr)
    return 1


def echoes_abort(e: BaseException) -> bool:
    """Whether ``e`` is a ``WorldAbortedError``, was raised while handling one, or is a group
    (what a task group raises) of nothing but such errors and cancellations."""
    if isinstance(e, BaseExceptionGroup):
        leaves = e.exceptions
        return any(echoes_abort(x) for x in leaves) and all(
            echoes_abort(x) or isinstance(x, asyncio.CancelledError) for x in leaves
        )
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, WorldAbortedError):
            return True
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return False


def warn_unmatched(works: list[EngineWork], what: str, stacklevel: int) -> None:
    """Warn about ``works`` still pending though every rank has ended (``stacklevel`` as seen by the caller).

    They were issued and never matched: in a real job they would hang or be dropped.
    Say so rather than pass silently.
    """
    if works:
        lines = "\n".join(f"  rank {x.owner}: {x.describe()}" for x in works)
        warnings.warn(
            f"aiocoll: {what} ended with {len(works)} operation(s) no peer ever matched:\n{lines}",
            RuntimeWarning,
            stacklevel=stacklevel + 1,
        )
