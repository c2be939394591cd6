"""Point-to-point matching: each send meets the recv it is for, in the order they were issued.

Per group, unmatched sends wait by (dst, tag) then by source, each source's in issue
order; unmatched recvs wait by (dst, tag) in issue order. A send takes the first recv
waiting for it (one from its source, or from any source); a recv takes its source's
earliest send, or, from any source, the earliest send of all (a seeded schedule picks
any of the queued senders). The queues are the group's (``Group.sends``, ``Group.recvs``),
so that a snapshot of the world shows them; the matcher is the only code that changes them
while the world runs.

A matched pair moves its data at once, or, while an op runs off the loop, after it (the
world's ops complete in order). An unmatched send or recv times out after its group's
deadline: the world's timeout, which aborts the world, or a torch.distributed group's own,
which breaks that group (``_grouptimeouts``; the world decides which, and calls ``give_up``).

It names the engine's works, groups, op runner and world only for type checking: the
world (``_engine._world``) imports this module, not the other way round.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, cast

from .._errors import CollectiveMismatchError, CollectiveTimeoutError
from .._ops import Recv, Send, check_transfer, transfer
from .._work import fmt_site

if TYPE_CHECKING:
    from ._groups import Group
    from ._rank import EngineWork
    from ._runner import OpRunner
    from ._world import World

__all__ = ["P2PMatcher"]

_now = time.perf_counter


class P2PMatcher:
    """Matches a world's sends and recvs, and times out those left unmatched.

    ``send`` and ``recv`` enter a work (engine code: on the loop, or under the world's
    lock); a matched pair completes both works.
    """

    __slots__ = ("_counter", "_engine", "_groups", "_runner", "waiting")

    def __init__(self, engine: World, runner: OpRunner, groups: Callable[[], Sequence[Group]]) -> None:
        self._engine = engine
        self._runner = runner
        self._groups = groups  # every group of the world, for a work that must leave its queue
        self._counter = itertools.count()  # issue numbers of sends: an any-source recv takes the earliest
        # unmatched sends and recvs that will time out (with deadlines only); the world's
        # deadlines drop those no longer in it
        self.waiting: set[EngineWork] = set()

    def send(self, work: EngineWork) -> None:
        """Enter a send: it completes with the first recv waiting for it, or waits for one."""
        group, src = work._group, work._grank
        call = cast(Send, work._call)  # (the world sends only sends here)
        key = (call.dst, call.tag)
        recvs = group.recvs.get(key)
        if recvs:
            for i, rw in enumerate(recvs):
                want = cast(Recv, rw._call).src
                if want is None or want == src:
                    del recvs[i]
                    self._match(group, src, work, rw)
                    return
        q = group.sends.setdefault(key, {}).setdefault(src, deque())
        q.append((next(self._counter), work))
        deadlines = group.deadlines
        if deadlines is not None:
            self.waiting.add(work)
            deadlines.add(work)

    def recv(self, work: EngineWork) -> None:
        """Enter a recv: it completes with its source's earliest send, or waits for one."""
        group, dst = work._group, work._grank
        call = cast(Recv, work._call)  # (and only recvs here)
        by_src = group.sends.get((dst, call.tag))
        if by_src:
            src: int | None
            if call.src is not None:
                q = by_src.get(call.src)
                src = call.src if q else None
            else:
                # any source: the earliest unmatched send, whoever sent it
                heads = [(q[0][0], s) for s, q in by_src.items() if q]
                rng = self._engine.rng
                if not heads:
                    src = None
                elif rng is not None:  # a seeded schedule: any queued sender may win
                    src = rng.choice(heads)[1]
                else:
                    src = min(heads)[1]
            if src is not None:
                _, sw = by_src[src].popleft()
                self._match(group, src, sw, work)
                return
        group.recvs.setdefault((dst, call.tag), []).append(work)
        deadlines = group.deadlines
        if deadlines is not None:
            self.waiting.add(work)
            deadlines.add(work)

    def _match(self, group: Group, src: int, sw: EngineWork, rw: EngineWork) -> None:
        for w in (sw, rw):
            self.waiting.discard(w)
            if w._stamp is not None:
                w._stamp.all_here()  # both sides are here
        send, recv = cast(Send, sw._call), cast(Recv, rw._call)
        problem = check_transfer(send, recv)
        if problem is not None:
            msg = (
                f"{problem} on group {group.name!r}:\n"
                f"  rank {src}: {send.describe()} at {fmt_site(sw._site)}\n"
                f"  rank {send.dst}: {recv.describe()} at {fmt_site(rw._site)}"
            )
            errs = [CollectiveMismatchError(msg), CollectiveMismatchError(msg)]
            sw._resolve(exc=errs[0])
            rw._resolve(exc=errs[1])
            self._engine.abort(None, errs[0])
            return
        runner = self._runner
        if runner.busy is None:
            self._transfer(src, sw, rw)
        else:
            runner.serial((sw, rw), functools.partial(self._transfer, src, sw, rw))

    def _transfer(self, src: int, sw: EngineWork, rw: EngineWork) -> None:
        try:
            transfer(cast(Send, sw._call), cast(Recv, rw._call))
        except Exception as e:
            self._runner.failed((sw, rw), e)
            return
        sw._resolve(None)
        rw._resolve(src)
        for w in (sw, rw):
            if w._stamp is not None:
                w._stamp.ok()

    # -- timeouts and abort ------------------------------------------------------------

    def timed_out(self, work: EngineWork) -> None:
        """``work`` waited the world's timeout unmatched: fail it and abort the world."""
        if work.done():
            self.waiting.discard(work)
            return
        deadlines = work._group.deadlines
        assert deadlines is not None
        err = CollectiveTimeoutError(f"rank {work._rank.rank} waited {deadlines.timeout}s in {self.unmatched(work)}")
        self.give_up(work, err)
        self._engine.abort(None, err)

    def unmatched(self, work: EngineWork) -> str:
        """What ``work`` is, and who did not match it (for a timeout's report)."""
        call, g = work._call, work._group
        peer = call.dst if isinstance(call, Send) else cast(Recv, call).src
        if peer is None:
            who = "no rank sent to it"
        else:
            who = f"rank {g.ranks[peer]} did not match it ({self._engine.ranks[g.ranks[peer]].status()})"
        return f"{work.describe()}; {who}"

    def give_up(self, work: EngineWork, err: BaseException) -> None:
        """``work`` will never be matched: it leaves its queue and fails with ``err``."""
        self.waiting.discard(work)
        self._remove(work)
        work._resolve(exc=err)

    def _remove(self, work: EngineWork) -> None:
        for g in self._groups():
            for lst in g.recvs.values():
                if work in lst:
                    lst.remove(work)
            for by_src in g.sends.values():
                for q in by_src.values():
                    for item in q:
                        if item[1] is work:
                            q.remove(item)
                            break

    def drop(self, group: Group, error: Callable[[], BaseException]) -> None:
        """The world was aborted: fail the unmatched recvs and sends of ``group``, each with its own ``error()``."""
        waiting = self.waiting
        for lst in group.recvs.values():
            for w in lst:
                waiting.discard(w)
                w._resolve(exc=error())
        group.recvs.clear()
        for by_src in group.sends.values():
            for q in by_src.values():
                for _, w in q:
                    waiting.discard(w)
                    w._resolve(exc=error())
        group.sends.clear()

    def __repr__(self) -> str:
        groups = self._groups()
        sends = sum(len(q) for g in groups for by in g.sends.values() for q in by.values())
        recvs = sum(len(lst) for g in groups for lst in g.recvs.values())
        return f"<P2PMatcher unmatched sends={sends} recvs={recvs}>"
