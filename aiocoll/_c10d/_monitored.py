"""gloo's ``monitored_barrier``, on a group's side channel: rank 0 names the ranks that did not come.

gloo's algorithm (``ProcessGroupGloo::monitoredBarrier``), kept step for step so that
its reports read the same: every other rank sends rank 0 a word and waits for one
back; rank 0 takes the words one rank after the other, each within what is left of
the timeout (or the whole timeout each, with ``wait_all_ranks``), then answers them
all. Rank 0 alone enforces the timeout; when it passes, it raises
"Rank 1 failed to pass monitoredBarrier in 2000 ms" and the group breaks, which
releases the ranks that did come with "Rank 2 successfully reached monitoredBarrier,
but received errors ...".

The words travel on the group's side channel (``Groups.side_channel``): no sequence
number of the group is taken, so ranks that skip the barrier stay in step with the
others, as in gloo, where the barrier is point-to-point traffic.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .._comm import Comm
from .._errors import CollectiveTimeoutError, GroupTimeoutError
from .._work import Work

__all__ = ["MonitoredBarrier"]

_log = logging.getLogger("aiocoll")

_ARRIVE, _RELEASE = 1, 2  # the two tags: a rank's word to rank 0, rank 0's answer
_NONE_PROCESSED = "No ranks successfully processed in monitoredBarrier."
_POLL = 0.05  # seconds between rank 0's looks at whether the rank it waits for has left


@dataclass
class MonitoredBarrier:
    """One call of the barrier, as group-rank ``side.rank``; ``run()`` it in the rank's thread (it blocks).

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

    side: Comm
    asked: float | None
    kept: float | None
    wait_all_ranks: bool
    broke: Callable[[str], None]
    gone: Callable[[int], str | None]
    start: float = field(default_factory=time.monotonic)

    def run(self) -> None:
        if self.side.world_size == 1:
            return
        if self.side.rank != 0:
            self._join()
            return
        side = self.side
        peers = range(1, side.world_size)
        word = torch.tensor([0])
        self._wait_for({peer: side.recv(torch.zeros(1, dtype=word.dtype), peer, _ARRIVE) for peer in peers})
        # everyone came: let them go, so that all ranks leave the barrier, or none
        self._wait_for({peer: side.send(word, peer, _RELEASE) for peer in peers})

    @property
    def _ms(self) -> str:
        return "unbounded" if self.asked is None else f"{self.asked * 1000:.0f} ms"

    def _join(self) -> None:
        """A rank other than 0: its word to rank 0, and rank 0's answer."""
        side, me = self.side, self.side.rank
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

    def _fail(self, message: str, notes: list[str]) -> GroupTimeoutError:
        self.broke(message)
        if self.kept is not None and self.asked is not None and self.kept != self.asked and not notes:
            notes = [f"aiocoll waited {self.kept * 1000:.0f} ms: the ranks share this process's cores"]
        return GroupTimeoutError("\n".join([message, *(f"({n})" for n in notes)]))

    def _wait_for(self, works: dict[int, Work]) -> None:
        """Rank 0: each peer's work in turn, within the time left (gloo's order and reports)."""
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
                    raise self._fail(f"Rank 0 timed out in monitoredBarrier after {self._ms}.\n{how}", [])
            late = self._late(work, peer, left)
            if late is None:
                processed.append(peer)
                continue
            if late:
                notes.append(f"rank {peer} {late}: it will never come")
            if not self.wait_all_ranks:
                raise self._fail(f"[Rank 0]: Rank {peer} failed to pass monitoredBarrier in {self._ms}", notes)
            _log.error("[Rank 0]: Rank %s failed to pass monitoredBarrier in %s", peer, self._ms)
            failed.append(peer)
        if failed:
            ranks = ", ".join(map(str, failed))
            raise self._fail(f"[Rank 0]: Ranks {ranks} failed to pass monitoredBarrier in {self._ms}", notes)

    def _late(self, work: Work, peer: int, left: float | None) -> str | None:
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
            how = self.gone(peer)
            if how is not None and not work.done():
                return how
