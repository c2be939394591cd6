"""The engine: rendezvous per (group, sequence number), p2p matching, abort, timeouts
and deadlock detection. It knows nothing of what an op does: it only compares call
signatures and hands the calls of all ranks to the op's ``check`` and ``run``.

``World`` owns the groups, the ranks, the loop, the lock and the deadlines; it enters
works (``post``), joins collectives to their rendezvous, and aborts. A group and its
rendezvous are data (``_groups``: ``Group``, ``Rendezvous``, and ``Groups``, the
registry that finds a torch.distributed group by name); a rank's state and its works
are ``_rank``'s (``RankState``, ``EngineWork``). The rest is done by
collaborators it owns, one job each, in their own modules (which import this one for
type checking only):

- ``_runner.OpRunner``: runs ready ops in order, inline or off the loop, and releases
  their ranks;
- ``_p2p.P2PMatcher``: matches sends with recvs, and times out the unmatched;
- ``_liveness.Liveness``: counts live and blocked ranks, and reports a deadlock;
- ``_inject.FaultInjector``: holds back the works that faults hang or delay;
- ``_tasks.RankTasks`` (one per rank) and the task factory: which asyncio tasks act for
  a rank, and which of them wait only for others of the rank (gathers).

Everything here runs on the world's event loop thread, or, for sync ranks that take
turns (``_turns``), in the thread of the rank that holds the turn, under the world's
``lock`` (which the loop then takes too, for timers and ops it runs).

Deadlock detection rests on one invariant: a Work can only complete when some rank
makes a call. So if every live rank is *blocked* (each of its tasks is awaiting an
unfinished Work of this world) and no op is executing, nothing can ever complete.
Tasks a rank creates count as that rank's (a task factory tracks them through a
context variable, ``_tasks``), so a rank with a busy helper task is never taken for blocked.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import threading
import time
from collections.abc import Callable, Sequence

from .. import _patches
from .._errors import (
    AiocollError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    GroupTimeoutError,
    WorldAbortedError,
)
from .._ops import Call, Recv, Send
from .._stats import Phase, Statistics
from .._work import SentToTorch
from . import _tasks
from ._deadlines import Deadlines
from ._faults import Fault, FaultPlan, OpInfo
from ._groups import Elsewhere, Group, Groups, Rendezvous
from ._grouptimeouts import GroupTimeouts, refusal, slowdown
from ._inject import FaultInjector, FaultProbe
from ._liveness import Liveness
from ._p2p import P2PMatcher
from ._rank import EngineWork, RankState, first_line
from ._record import Probe, Recorder
from ._runner import OpRunner
from ._tasks import RANK, RankTasks, WorldTasks
from ._turns import Turns

__all__ = ["TASK_TRACKING", "World", "install_task_tracking", "mismatch_message"]


# loop turns between releasing waiting ranks on abort and cancelling those still running
_CANCEL_AFTER_TURNS = 4

_world_ids = itertools.count()
_now = time.perf_counter


_P2P = (Send, Recv)  # for isinstance: a tuple, as ``Send | Recv`` builds a union object per call


class World:
    """The shared state of all ranks of one ``spawn``."""

    def __init__(
        self,
        size: int,
        loop: asyncio.AbstractEventLoop,
        timeout: float | None,
        hybrid: Elsewhere | None = None,
        *,
        recorder: Recorder | None = None,
        faults: FaultPlan | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.size = size
        self.loop = loop
        self.loop_thread = threading.get_ident()  # worlds are made on their loop's thread
        self.id = next(_world_ids)
        self.timeout = timeout
        # live and blocked ranks, deadlock detection; before the ranks, which report to it
        self.liveness: Liveness = Liveness(self)
        # when pending ops time out (before the first group, which takes it)
        self.deadlines: Deadlines | None = None if timeout is None else self._new_deadlines(timeout)
        self.ranks: list[RankState] = [RankState(self, r) for r in range(size)]
        self.hybrid: Elsewhere | None = hybrid  # other processes run some ranks (see aiocoll._bridge._hybrid)
        if hybrid is not None:
            for st in self.ranks:
                if st.rank not in hybrid.local:
                    st.phase = Phase.REMOTE
        # its groups, the world group first (torch.distributed's by name: ranks in threads make them)
        self.groups = Groups(self, size)
        self.group = self.groups.world
        self.aborted: WorldAbortedError | None = None
        # sync ranks taking turns run the engine in their threads, under this lock
        self.turns: Turns | None = None
        self.lock: threading.RLock | None = None
        # the flight recorder (or a trace), when on, for reports and dumps
        self.recorder = recorder
        self.sent_to_torch = SentToTorch()  # errors torch got through futures, for the report
        self.faults = faults  # faults to inject, when any
        # what the engine tells of each op, and asks whether a fault hits it: the recorder,
        # or the faults telling the recorder
        self.probe: Probe | None = recorder if faults is None else FaultProbe(faults, recorder)
        self.rng = rng  # a seeded schedule's choices, when one is set
        # each rank's seed for its generators, where the world stands for fresh processes
        self.rank_seeds: tuple[int, ...] | None = None
        # its ranks' asyncio tasks, found, counted and cancelled (see aiocoll._engine._tasks)
        self.tasks = WorldTasks(self)
        # rendezvous whose calls disagree: reported once every rank has shown its call, or
        # once the ranks missing are stuck elsewhere (explain_stall)
        self._mismatched: list[Rendezvous] = []
        # The world's collaborators, one job each (and self.liveness, above). The per-op
        # path reaches theirs through bound methods and a dict kept at hand here.
        # runs ready ops in order, inline or off the loop, and releases their ranks
        self.runner: OpRunner = OpRunner(self, loop, self.liveness)
        # matches sends with recvs, and times out the unmatched
        self.p2p: P2PMatcher = P2PMatcher(self, self.runner, self.groups.all)
        # the own timeouts of torch.distributed groups, which break a group when they pass
        local = size if hybrid is None else len(hybrid.local)
        self.timeouts = GroupTimeouts(timeout, slowdown(local), self._new_deadlines, self.p2p, self.fail_pending)
        # holds back the works that faults hang or delay
        self.injector: FaultInjector = FaultInjector(self, loop, timeout)
        self._run = self.runner.run
        self._send = self.p2p.send
        self._recv = self.p2p.recv
        self._held = self.injector.held  # park skips held works

    # -- collectives -----------------------------------------------------------------

    @property
    def inline_bytes(self) -> int:
        """Ops moving more bytes run off the loop (the runner's setting; a hybrid bridge reads it too)."""
        return self.runner.inline_bytes

    def on_loop_thread(self) -> bool:
        return threading.get_ident() == self.loop_thread

    def call_soon_threadsafe(self, fn: Callable[..., object], *args: object) -> None:
        """Schedule ``fn`` on the loop from any thread (a no-op once the loop is closed)."""
        # a closed loop means the world is gone and nothing waits any more
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.locked, fn, *args)

    def detach_hybrid(self) -> None:
        """The hybrid world closed: its groups' bridges close, and no op goes to other processes any more."""
        for g in self.groups.all():
            if g.bridge is not None:
                g.bridge.close()
            g.bridge = None
        self.hybrid = None

    def take_turns(self, turns: Turns) -> None:
        """Sync ranks take turns (see ``_turns``): they run the engine in their own threads."""
        self.turns = turns
        self.lock = threading.RLock()

    def locked(self, fn: Callable[..., object], *args: object) -> None:
        """Run ``fn(*args)`` as engine code: under the lock when rank threads run the engine too."""
        lock = self.lock
        if lock is None:
            fn(*args)
        else:
            with lock:
                fn(*args)

    def post(self, work: EngineWork) -> EngineWork:
        """Enter ``work`` into the engine: a collective, a send or a recv. Loop thread only."""
        call = work._call
        if not isinstance(call, _P2P):
            self._join(work)
            return work
        probe = self.probe
        if probe is not None:  # p2p: no sequence number; a stamp of its own
            rank = work._rank.rank
            stamp = work._stamp = probe.p2p(work._group.name, rank, call.record_info())
            probe.arrived(stamp, 0, rank, work._site)
        bridge = work._group.bridge
        if self.aborted is not None:
            work._resolve(exc=self._aborted_error())
        elif work._group.broken is not None:
            work._resolve(exc=GroupTimeoutError(refusal(work._group)))
        elif bridge is not None and (fut := bridge.p2p(work)) is not None:
            self.runner.remote(work, fut)  # the peer is in another process
        elif isinstance(call, Send):
            self._send(work)
        else:
            self._recv(work)
        return work

    def park(self, work: EngineWork, st: RankState | None = None) -> None:
        """A task or thread of ``st`` (default: the work's rank) now waits for ``work``."""
        st = st or work._rank
        if work._fut.done() or work._parked_on is not None:
            return
        if self._held and work in self._held:
            return  # held back by a fault: the rank is stuck or late, not waiting for peers
        work._parked_on = st
        st.waiting.append(work)
        st.parked_one()

    # -- fault injection ---------------------------------------------------------------

    def inject(self, fault: Fault, info: OpInfo, work: EngineWork) -> EngineWork:
        """Apply ``fault`` to ``work`` instead of posting it (any thread)."""
        assert self.faults is not None
        if fault.kind == "fail":
            raise self.faults.exception(fault, info)
        if fault.kind == "hang":
            self.injector.hang(work, f"hung by an injected fault in {info.op} (its operation #{info.index})")
        else:
            self.injector.hold(work, fault.seconds)
        return work

    def _join(self, work: EngineWork) -> None:
        """Deposit the work's call for its group-rank at its next sequence number."""
        group, grank, call = work._group, work._grank, work._call
        seq = work._seq = group.next_seq[grank]
        group.next_seq[grank] = seq + 1
        if self.aborted is not None:
            work._resolve(exc=self._aborted_error())
            return
        rdv = group.pending.get(seq)
        if rdv is None:
            if group.broken is not None:  # (breaking it failed its pending rendezvous: only first arrivals look)
                work._resolve(exc=GroupTimeoutError(refusal(group)))
                return
            rdv = group.pending[seq] = Rendezvous(group, seq)
            sig = rdv.sig = call.signature()
            deadlines = group.deadlines
            if deadlines is not None:
                deadlines.add(rdv)
            if self.probe is not None:
                rdv.stamp = self.probe.collective(group.name, group.index, seq, sig, group.size)
        else:
            sig = call.signature()
            if sig != rdv.sig:
                if not rdv.mismatched:
                    # Report once every rank has shown what it called, or as soon as the
                    # missing ones are blocked elsewhere (see explain_stall).
                    rdv.mismatched = True
                    self._mismatched.append(rdv)
                if rdv.stamp is not None:
                    rdv.stamp.differs(grank, sig)
        stamp = rdv.stamp
        if stamp is not None:  # the world has a probe
            work._stamp = stamp
            self.probe.arrived(stamp, grank, work._rank.rank, work._site)  # type: ignore[union-attr]
        work._rdv = rdv
        rdv.calls[grank] = call
        rdv.works[grank] = work
        rdv.arrived += 1
        if rdv.arrived == group.expected:
            # a group that spans processes reports a mismatch after the exchange, so that
            # every process learns of it (and shows every rank's call)
            if rdv.mismatched and group.bridge is None:
                self._report_mismatch(rdv)
            else:
                self._complete(rdv)

    def _report_mismatch(self, rdv: Rendezvous) -> None:
        self._mismatched.remove(rdv)
        self._fail_rendezvous(
            rdv, CollectiveMismatchError, mismatch_message(rdv.calls, rdv.seq, rdv.group.name, rdv.table())
        )

    def _complete(self, rdv: Rendezvous) -> None:
        del rdv.group.pending[rdv.seq]
        if rdv.stamp is not None:
            rdv.stamp.all_here()
        bridge = rdv.group.bridge
        if bridge is not None:
            if rdv.mismatched:
                self._mismatched.remove(rdv)
            # every local member arrived: the bridge fetches the other processes' calls and runs the op
            self.runner.exchange(rdv, bridge.run(rdv))
            return
        op = rdv.op()
        problem = op.check(rdv.calls)
        if problem is not None:
            self._fail_rendezvous(rdv, CollectiveMismatchError, f"{problem} ({op.name} {rdv.where}):\n{rdv.table()}")
            return
        self._run(rdv, op)

    def fail(self, work: EngineWork, error: BaseException) -> None:
        """End a rank's wait in ``work`` with ``error``: for a layer above that learns first why
        it cannot complete (a hybrid world whose peer process is gone)."""
        work._resolve(exc=error)

    def _fail_rendezvous(self, rdv: Rendezvous, cls: type[AiocollError], message: str) -> None:
        rdv.group.pending.pop(rdv.seq, None)
        self.runner.fail_each(rdv.works, cls, message)

    def _timed_out(self, rdv: Rendezvous) -> None:
        if rdv.mismatched:
            self._report_mismatch(rdv)
            return
        arrived = [r for r, w in enumerate(rdv.works) if w is not None]
        self._fail_rendezvous(
            rdv,
            CollectiveTimeoutError,
            f"{rdv.op().name} {rdv.where} timed out after {self.timeout}s: "
            f"ranks {arrived} arrived, ranks {rdv.missing()} did not:\n{rdv.table()}",
        )

    # -- deadlines, groups ----------------------------------------------------------

    def _new_deadlines(self, seconds: float) -> Deadlines:
        return Deadlines(self.loop, seconds, self._still_pending, self._expired, self.locked, self.loop_thread)

    def _still_pending(self, item: Rendezvous | EngineWork) -> bool:
        """Whether a rendezvous or p2p work the deadlines hold still waits for peers."""
        if isinstance(item, Rendezvous):
            return item.pending
        return item in self.p2p.waiting

    def _expired(self, item: Rendezvous | EngineWork) -> None:
        if isinstance(item, Rendezvous):
            if item.group.own_timeout is None or item.mismatched:
                self._timed_out(item)
            else:
                self.timeouts.rendezvous_expired(item)
        elif item._group.own_timeout is None:
            self.p2p.timed_out(item)
        else:
            self.timeouts.p2p_expired(item)

    def break_group(self, group: Group, why: str) -> None:
        """``group`` timed out in ``monitored_barrier`` (outside the engine): break it, as a timeout does."""
        if self.lock is None and not self.on_loop_thread():
            self.call_soon_threadsafe(self.timeouts.break_group, group, why)
        else:
            self.locked(self.timeouts.break_group, group, why)

    def fail_pending(self, group: Group, error: Callable[[], BaseException]) -> None:
        """Fail what waits in ``group`` (rendezvous, unmatched sends and recvs), each work with its own ``error()``."""
        for rdv in list(group.pending.values()):
            for w in rdv.works:
                if w is not None:
                    w._resolve(exc=error())
        group.pending.clear()
        self.p2p.drop(group, error)

    # -- failure -------------------------------------------------------------------

    def _aborted_error(self) -> WorldAbortedError:
        assert self.aborted is not None
        e = WorldAbortedError(str(self.aborted), rank=self.aborted.rank)
        e.__cause__ = self.aborted.__cause__
        return e

    def abort(self, rank: int | None, cause: BaseException, message: str | None = None) -> None:
        """Release every waiting rank with an error and cancel the ranks still running.

        ``rank`` is the rank whose failure aborts the world, if a rank's failure does;
        ``message`` the ranks' error message, if not the default one built from them.
        """
        if self.aborted is not None:
            return
        if message is not None:
            msg = message
        elif rank is not None:
            msg = f"rank {rank} failed with {type(cause).__name__}: {cause}"
        else:
            msg = f"the world was aborted by {type(cause).__name__}: {first_line(cause)}"
        self.aborted = WorldAbortedError(msg, rank=rank)
        self.aborted.__cause__ = cause
        if self.hybrid is not None:
            self.hybrid.aborted(msg, cause)  # tell the other processes, which wait for ours
        for g in self.groups.all():
            self.fail_pending(g, self._aborted_error)
        self.runner.abort(self._aborted_error)  # ops under way release their ranks; queued ones never start
        if self.deadlines is not None:
            self.deadlines.clear()
        self.timeouts.clear()
        self.injector.abort(self._aborted_error)
        # Ranks busy elsewhere (sleeping, awaiting a queue) would otherwise keep the
        # world alive: cancel them, as a task group cancels its other tasks. Deferred by
        # one loop turn so the ranks just released above first see their error (a
        # cancel now would replace it) and may finish on their own.
        if self.turns is not None:
            self.turns.free_all()  # no released rank waits for the turn of one that is busy
        if self.on_loop_thread():
            self.loop.call_soon(self._cancel_running, msg, _CANCEL_AFTER_TURNS)
        else:  # a rank thread taking turns (whose world has no tasks to cancel; for uniformity)
            self.call_soon_threadsafe(self._cancel_running, msg, _CANCEL_AFTER_TURNS)

    def _cancel_running(self, msg: str, turns: int = 0) -> None:
        if turns:
            # An error set on a helper's work reaches the rank's own task only a few
            # callbacks later (helper task -> gather's callback -> the awaiting task).
            self.loop.call_soon(self._cancel_running, msg, turns - 1)
            return
        self.tasks.cancel(msg)

    def _cancelled(self, work: EngineWork) -> None:
        """A rank stopped waiting for ``work`` (cancelled): its collective cannot complete."""
        if self.aborted is not None:
            return
        err = WorldAbortedError(
            f"rank {work._rank.rank} was cancelled while waiting in {work.describe()}",
            rank=work._rank.rank,
        )
        err.__cause__ = asyncio.CancelledError()
        self.abort(work._rank.rank, err)

    def explain_stall(self) -> bool:
        """Every live rank waits: report the mismatched collective behind it, if any (true if so).

        A rank that called the wrong collective then waits in its next one; the mismatch
        says more than a deadlock would.
        """
        # (a broken group's rendezvous failed without leaving this list)
        self._mismatched = [rdv for rdv in self._mismatched if rdv.pending]
        if not self._mismatched:
            return False
        self._report_mismatch(self._mismatched[0])
        return True

    # -- reporting -----------------------------------------------------------------

    # (the liveness keeps the counts; statistics() reads them here)
    @property
    def _n_live(self) -> int:
        return self.liveness.live

    @property
    def _n_blocked(self) -> int:
        return self.liveness.blocked

    def pending_works(self) -> list[EngineWork]:
        """Every work still waiting for a peer, collectives first."""
        out: list[EngineWork] = []
        for g in self.groups.all():
            out += [w for rdv in g.pending.values() for w in rdv.works if w is not None]
            out += [w for lst in g.recvs.values() for w in lst]
            out += [w for by in g.sends.values() for q in by.values() for _, w in q]
        return out

    def statistics(self) -> Statistics:
        """A snapshot: rank states, pending collectives and p2p ops."""
        groups = self.groups.all()
        return Statistics(
            size=self.size,
            aborted=self.aborted is not None,
            live_ranks=self._n_live,
            blocked_ranks=self._n_blocked,
            pending_collectives=sum(len(g.pending) for g in groups),
            pending_p2p=sum(len(v) for g in groups for v in g.recvs.values())
            + sum(len(q) for g in groups for by in g.sends.values() for q in by.values()),
            ranks=tuple(st.snapshot() for st in self.ranks),
        )

    def __repr__(self) -> str:
        s = self.statistics()
        state = "aborted" if s.aborted else "live"
        return (
            f"<World size={s.size} {state} live={s.live_ranks} blocked={s.blocked_ranks} "
            f"pending={s.pending_collectives}>"
        )


def mismatch_message(calls: Sequence[Call | None], seq: int, group: str, table: str) -> str:
    """The report of ranks whose calls at ``seq`` disagree (the pytest plugin parses its first line)."""
    names = {type(c).name for c in calls if c is not None}
    what = "different collectives" if len(names) > 1 else f"{names.pop()} with arguments that disagree"
    return f"ranks called {what} as call #{seq} of group {group!r}:\n{table}"


TASK_TRACKING = _patches.PatchSet(
    "task tracking",
    "a world's loop makes its tasks through the engine's task factory, which counts the tasks each async "
    "rank starts (and calls the factory it found)",
    lambda loop: [_patches.Step("loop.set_task_factory", lambda: _tasks.install(loop, _current_tasks))],  # type: ignore[arg-type]
    ["loop.set_task_factory"],
    per="loop",
)


def install_task_tracking(loop: asyncio.AbstractEventLoop) -> Callable[[], None]:
    """Track tasks created by ranks on ``loop`` (leased per loop); returns the undo."""
    _patches.acquire(TASK_TRACKING, loop)
    return lambda: _patches.release(TASK_TRACKING, loop)


def _current_tasks() -> RankTasks | None:
    """The tasks of the running rank, if one runs now (what the task factory counts a new task for)."""
    st = RANK.get()
    return st.tasks if st is not None and st.phase is Phase.RUNNING else None
