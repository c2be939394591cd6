"""Fault injection as the engine applies it: works that a fault hangs or delays are held back.

``_faults`` decides which operation a fault hits (``FaultPlan.check``), asked through the
world's probe (``FaultProbe``, which tells its recorder everything else); the world then
raises for a ``fail`` and hands a ``hang`` or a ``delay`` to its ``FaultInjector``, which
keeps the work out of the engine: a delayed work is entered (``World.post``) when its
timer fires, a hung one never is. A rank waiting on a held work is not counted as
blocked (it is stuck or late, not waiting for a peer), so the world checks ``held`` on
every park.

A hung work times out after twice the world's timeout (its peers, waiting for it, time
out first and say more); an abort fails every held work and cancels the timers.

It names the engine's works and world only for type checking: the world
(``_engine._world``) imports this module, not the other way round.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING

from .._errors import CollectiveTimeoutError
from .._ops import P2PRecord
from .._work import Site
from ._faults import Fault, FaultPlan, OpInfo
from ._record import Probe, Stamp

if TYPE_CHECKING:
    from ._rank import EngineWork
    from ._world import World

__all__ = ["FaultInjector", "FaultProbe"]


class FaultProbe(Probe):
    """Fault injection as the engine's probe: ``plan`` picks the ops that faults hit; the
    recorder, if the world has one, hears everything else.

    >>> from aiocoll import Fault
    >>> from aiocoll._engine._record import Recorder
    >>> probe = FaultProbe(FaultPlan([Fault.fail(rank=1, at=1)], size=2), Recorder(2, 8))
    >>> probe.issuing(1, "all_reduce", "world"), probe.issuing(1, "barrier", "world")[1]
    (None, OpInfo(rank=1, index=1, op='barrier', group='world'))
    """

    __slots__ = ("plan", "recorder")

    def __init__(self, plan: FaultPlan, recorder: Probe | None) -> None:
        self.plan = plan
        self.recorder = recorder

    def __repr__(self) -> str:
        return f"<FaultProbe faults={len(self.plan.faults)} recorder={self.recorder!r}>"

    def issuing(self, rank: int, op: str, group: str) -> tuple[Fault, OpInfo] | None:
        return self.plan.check(rank, op, group)

    def collective(self, group: str, index: dict[int, int], seq: int, sig: Hashable, size: int) -> Stamp:
        inner = self.recorder
        if inner is None:
            return super().collective(group, index, seq, sig, size)
        return inner.collective(group, index, seq, sig, size)

    def p2p(self, group: str, rank: int, rec: P2PRecord) -> Stamp:
        inner = self.recorder
        if inner is None:
            return super().p2p(group, rank, rec)
        return inner.p2p(group, rank, rec)

    def arrived(self, stamp: Stamp, grank: int, rank: int, site: Site | None, at: float | None = None) -> None:
        if self.recorder is not None:  # (else the stamp is kept nowhere)
            self.recorder.arrived(stamp, grank, rank, site, at)


class FaultInjector:
    """Holds back the works that faults hang or delay, and enters a delayed one when its time comes."""

    __slots__ = ("_engine", "_loop", "_timeout", "held", "hung")

    def __init__(self, engine: World, loop: asyncio.AbstractEventLoop, timeout: float | None) -> None:
        self._engine = engine
        self._loop = loop
        self._timeout = timeout
        # held works: hung, or delayed, with the timer that ends the hold (None until it is
        # armed on the loop)
        self.held: dict[EngineWork, asyncio.TimerHandle | None] = {}
        self.hung: dict[int, str] = {}  # what a fault did to each rank it hung, for reports

    def hang(self, work: EngineWork, why: str) -> None:
        """Keep ``work`` out of the engine for good (any thread); ``why`` is its rank's state in reports."""
        self.hung[work._rank.rank] = why
        self.hold(work, None)

    def hold(self, work: EngineWork, delay: float | None) -> None:
        """Keep ``work`` out of the engine: enter it ``delay`` seconds from now, or never (None: hung).

        Any thread: the rank's own, as it issues the work.
        """
        engine = self._engine
        if engine.on_loop_thread():
            self._hold(work, delay)
        elif engine.lock is not None:
            # a rank taking turns: held before it can wait on it (a wait on a held work
            # is not counted as blocked)
            with engine.lock:
                self._hold(work, delay)
        else:
            engine.call_soon_threadsafe(self._hold, work, delay)

    def _hold(self, work: EngineWork, delay: float | None) -> None:
        engine = self._engine
        if engine.aborted is not None:
            work._resolve(exc=engine._aborted_error())
            return
        self.held[work] = None  # its timer, if any, is armed on the loop
        if delay is not None or self._timeout is not None:
            if engine.on_loop_thread():
                self._arm(work, delay)
            else:
                engine.call_soon_threadsafe(self._arm, work, delay)

    def _arm(self, work: EngineWork, delay: float | None) -> None:
        if work not in self.held:
            return  # released by an abort meanwhile
        locked = self._engine.locked
        if delay is not None:
            self.held[work] = self._loop.call_later(delay, locked, self._release, work)
        else:
            assert self._timeout is not None
            # The hung rank waits in its call too, and the timeout bounds that as any wait
            # (alone in its world, nothing else would end it). Twice the timeout: the
            # peers waiting for it time out first, and their report says more.
            self.held[work] = self._loop.call_later(2 * self._timeout, locked, self._hang_timed_out, work)

    def _hang_timed_out(self, work: EngineWork) -> None:
        assert self._timeout is not None
        del self.held[work]
        err = CollectiveTimeoutError(
            f"rank {work._rank.rank} waited {2 * self._timeout}s in {work._call.describe()}: "
            f"{self.hung.get(work._rank.rank)}"
        )
        work._resolve(exc=err)
        self._engine.abort(None, err)

    def _release(self, work: EngineWork) -> None:
        del self.held[work]
        self._engine.post(work)

    def abort(self, error: Callable[[], BaseException]) -> None:
        """The world was aborted: fail every held work (each with its own ``error()``), stop the timers."""
        for w, timer in self.held.items():
            if timer is not None:
                timer.cancel()
            w._resolve(exc=error())
        self.held.clear()

    def __repr__(self) -> str:
        return f"<FaultInjector held={len(self.held)} timeout={self._timeout}>"
