"""gloo's ``monitored_barrier``, on a group's side channel: rank 0 names the ranks that did not come.

gloo's algorithm (``ProcessGroupGloo::monitoredBarrier``), kept step for step so that
its reports read the same: every other rank sends rank 0 a word and waits for one
back; rank 0 takes the words one rank after the other, each within what is left of
the timeout (or the whole timeout each, with ``wait_all_ranks``), then answers them
all. Rank 0 alone enforces the timeout; when it passes, it raises
"Rank 1 failed to pass monitoredBarrier in 2000 ms" and the group breaks, which
releases the ranks that did come with "Rank 2 successfully reached monitoredBarrier,
but received errors ...".

The words travel on the group's side channel (``World.side_channel``): no sequence
number of the group is taken, so ranks that skip the barrier stay in step with the
others, as in gloo, where the barrier is point-to-point traffic.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from ._comm import Comm
from ._errors import CollectiveTimeoutError, GroupTimeoutError
from ._work import Work

__all__ = ["monitored_barrier"]

_log = logging.getLogger("aiocoll")

_ARRIVE, _RELEASE = 1, 2  # the two tags: a rank's word to rank 0, rank 0's answer
_NONE_PROCESSED = "No ranks successfully processed in monitoredBarrier."
_POLL = 0.05  # seconds between rank 0's looks at whether the rank it waits for has left


def monitored_barrier(
    side: Comm,
    asked: float | None,
    kept: float | None,
    wait_all_ranks: bool,
    *,
    broke: Callable[[str], None],
    gone: Callable[[int], str | None],
) -> None:
    """Run the barrier as group-rank ``side.rank`` (a rank thread: it blocks).

    ``asked``: the timeout in seconds the caller gave (for the reports), ``kept``: how
    long rank 0 waits (None: no bound); ``broke(why)`` breaks the group; ``gone(r)``
    says how group-rank ``r`` left (``"returned"``, ``"failed"``), if it did: rank 0
    does not wait out the timeout for a rank that can never come.

    >>> import aiocoll, torch.distributed as dist
    >>> from datetime import timedelta
    >>> def worker(comm):
    ...     if comm.rank == 0:
    ...         try:
    ...             dist.monitored_barrier(timeout=timedelta(seconds=5))
    ...         except RuntimeError as e:
    ...             return str(e).splitlines()
    >>> aiocoll.spawn(worker, world=2)[0]
    ['[Rank 0]: Rank 1 failed to pass monitoredBarrier in 5000 ms', '(rank 1 returned: it will never come)']
    """
    if side.world_size == 1:
        return
    if side.rank != 0:
        _join(side)
    else:
        _Monitor(side, asked, kept, wait_all_ranks, broke, gone).run()


def _join(side: Comm) -> None:
    me = side.rank
    word = torch.tensor([me])
    works = [side.send(word, 0, _ARRIVE), side.recv(torch.zeros(1, dtype=word.dtype), 0, _RELEASE)]
    try:
        for w in works:
            w.wait()
    except GroupTimeoutError as e:  # rank 0 gave up and broke the group (a world's abort goes on up)
        raise GroupTimeoutError(
            f"Rank {me} successfully reached monitoredBarrier, but received errors while waiting for "
            f"send/recv from rank 0. Please check rank 0 logs for faulty rank.\n Original exception: \n{e}"
        ) from e


class _Monitor:
    """Rank 0's side: take every other rank's word, then answer them all."""

    def __init__(
        self,
        side: Comm,
        asked: float | None,
        kept: float | None,
        wait_all_ranks: bool,
        broke: Callable[[str], None],
        gone: Callable[[int], str | None],
    ) -> None:
        self.side, self.kept, self.wait_all_ranks, self.broke, self.gone = side, kept, wait_all_ranks, broke, gone
        self.asked = asked
        self.ms = "unbounded" if asked is None else f"{asked * 1000:.0f} ms"
        self.start = time.monotonic()

    def run(self) -> None:
        side = self.side
        peers = range(1, side.world_size)
        word = torch.tensor([0])
        self.wait_for({peer: side.recv(torch.zeros(1, dtype=word.dtype), peer, _ARRIVE) for peer in peers})
        # everyone came: let them go, so that all ranks leave the barrier, or none
        self.wait_for({peer: side.send(word, peer, _RELEASE) for peer in peers})

    def fail(self, message: str, notes: list[str]) -> GroupTimeoutError:
        self.broke(message)
        if self.kept is not None and self.asked is not None and self.kept != self.asked and not notes:
            notes = [f"aiocoll waited {self.kept * 1000:.0f} ms: the ranks share this process's cores"]
        return GroupTimeoutError("\n".join([message, *(f"({n})" for n in notes)]))

    def wait_for(self, works: dict[int, Work]) -> None:
        processed: list[int] = []
        failed: list[int] = []
        notes: list[str] = []
        for peer, work in works.items():
            left = self.kept
            if left is not None and not self.wait_all_ranks:
                # one timeout for all of them; with wait_all_ranks each has the whole of it,
                # or the first late rank would leave none for the others
                left -= time.monotonic() - self.start
                if left <= 0:
                    done = ", ".join(map(str, processed))
                    how = f"Successfully processed ranks: {done}" if done else _NONE_PROCESSED
                    raise self.fail(f"Rank 0 timed out in monitoredBarrier after {self.ms}.\n{how}", [])
            late = self.late(work, peer, left)
            if late is None:
                processed.append(peer)
                continue
            if late:
                notes.append(f"rank {peer} {late}: it will never come")
            if not self.wait_all_ranks:
                raise self.fail(f"[Rank 0]: Rank {peer} failed to pass monitoredBarrier in {self.ms}", notes)
            _log.error("[Rank 0]: Rank %s failed to pass monitoredBarrier in %s", peer, self.ms)
            failed.append(peer)
        if failed:
            ranks = ", ".join(map(str, failed))
            raise self.fail(f"[Rank 0]: Ranks {ranks} failed to pass monitoredBarrier in {self.ms}", notes)

    def late(self, work: Work, peer: int, left: float | None) -> str | None:
        """None once ``work`` is done in time; else ``""`` (the time ran out) or how ``peer`` left."""
        end = None if left is None else time.monotonic() + left
        while True:
            wait = _POLL if end is None else min(_POLL, end - time.monotonic())
            if wait <= 0:
                return None if work.done() else ""
            try:
                work.wait(wait)
                return None
            except CollectiveTimeoutError:
                if work.done():
                    raise  # the work's own error (the group broke, the world's timeout)
            left_as = self.gone(peer)
            if left_as is not None and not work.done():
                return left_as
