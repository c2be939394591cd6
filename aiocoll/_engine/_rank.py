"""One rank's share of the engine: its state (``RankState``) and its works (``EngineWork``).

A ``RankState`` keeps one global rank's liveness: its phase, the tasks or thread acting
for it, the works they wait for, and its progress; it tells its world's ``Liveness`` when
it becomes live or blocked. An ``EngineWork`` is one rank's share of a rendezvous, or a
send or recv: the world (``_world.World``) enters it and resolves it when its op
completes or fails, and the work parks its rank while a task or thread awaits it.

Both reach their world through its attributes (its loop, lock, liveness, ``park``); the
world imports this module, and this one names ``World`` for type checking only.
"""

from __future__ import annotations

import _thread
import asyncio
import contextlib
import contextvars
import threading
from collections.abc import Generator
from typing import TYPE_CHECKING, Any

import torch

from .._errors import BlockingCallError, CollectiveTimeoutError
from .._ops import Call, _cuda
from .._stats import Phase, RankStatistics, StateName
from .._work import Site, TorchFutures, Work, cancelled_error
from ._record import Stamp
from ._tasks import RANK, RankTasks
from ._turns import TurnEvent, not_the_rank_s_thread

if TYPE_CHECKING:
    from ._groups import Group, Rendezvous
    from ._world import World

__all__ = ["EngineWork", "RankState", "current_rank_state", "first_line", "rank_var"]


# seconds a rank thread waits before it reports itself blocked (for deadlock detection)
_PARK_AFTER = 0.002


class _Latch:
    """A one-shot ``threading.Event`` for a work a rank thread waits on, set from the loop thread.

    One raw lock instead of an Event's Condition: a tenth of the cost to make, set and
    wait on (0.3 against 2.6 us), and a waiter wakes with one lock hand-off instead of
    re-taking the Condition's lock. Only the loop thread sets it.
    """

    __slots__ = ("_lock", "_set")

    def __init__(self) -> None:
        self._lock = _thread.allocate_lock()
        self._lock.acquire()  # held until set(): waiters block on it
        self._set = False

    def set(self) -> None:
        if not self._set:
            self._set = True
            self._lock.release()

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float | None = None) -> bool:
        """Whether it is set, after waiting up to ``timeout`` seconds (None: until it is)."""
        if self._set:
            return True
        # (a negative timeout is an immediate check, as for threading.Event; lock.acquire rejects it)
        if not self._lock.acquire(True, -1 if timeout is None else max(timeout, 0.0)):
            return False
        self._lock.release()  # let any other waiter through: once set, it stays set
        return True


_rank_var = RANK  # (see aiocoll._engine._tasks)


def current_rank_state() -> RankState | None:
    """The rank whose task (or helper task) is running now, if any."""
    return _rank_var.get()


class RankState:
    """One global rank's liveness: its phase, what acts for it (tasks, its thread), what
    they wait for, and its progress; and the works torch.distributed issued for it, which
    must die with it. What a fault did to it is the injector's to say."""

    __slots__ = (
        "__weakref__",
        "activity",
        "c10d",
        "completed",
        "error",
        "issued",
        "live",
        "liveness",
        "parked",
        "phase",
        "rank",
        "tasks",
        "thread",
        "waiting",
        "world",
    )

    def __init__(self, world: World, rank: int) -> None:
        self.rank = rank
        self.world = world
        self.liveness = world.liveness  # told when this rank becomes live or blocked
        self.phase = Phase.RUNNING
        self.live = 0  # tasks (or threads) acting for this rank
        self.parked = 0  # of those, how many await an unfinished Work
        self.waiting: list[EngineWork] = []
        self.tasks = RankTasks(self, world.loop)  # the tasks acting for it (see aiocoll._engine._tasks)
        self.error: BaseException | None = None  # why the rank failed
        self.completed = 0  # works of this rank that have completed (or failed)
        self.activity: str | None = None  # for reports: what it does while not live (see idle())
        # works torch.distributed issued for this rank on the loop (see aiocoll.settle): here,
        # so that they die with the rank (a table keyed by rank elsewhere would keep it alive)
        self.issued: list[Work] = []
        # the rank's own thread (sync ranks; 0: none yet): a thread it starts takes no turns,
        # and its waits do not make the rank blocked
        self.thread = 0
        self.c10d: Any = None  # its torch.distributed state, once it has one (``use_c10d``)

    def use_c10d(self, state: Any) -> None:
        """torch.distributed's state for this rank (``_c10d._backend.RankSession``; ``_torch``'s proxy reads it)."""
        self.c10d = state

    def on_own_thread(self) -> bool:
        """Whether the calling thread is this rank's own (not one the rank started)."""
        return self.thread == _thread.get_ident()

    def runs_here(self) -> None:
        """The calling thread is this sync rank's own from now on."""
        self.thread = _thread.get_ident()

    def returned(self) -> None:
        """Its function returned."""
        self.phase = Phase.RETURNED

    def failed(self, e: BaseException) -> None:
        """It ended with ``e`` (whether that was the root cause is the outcome's to say)."""
        self.phase = Phase.FAILED
        self.error = e

    def take_issued(self) -> list[Work]:
        """The works torch.distributed issued for it since the last call (see ``aiocoll.settle``)."""
        works, self.issued = self.issued, []
        return works

    @property
    def blocked(self) -> bool:
        return self.live > 0 and self.parked == self.live

    def _change(self, dlive: int, dparked: int) -> None:
        was_blocked, was_live = self.blocked, self.live > 0
        self.live += dlive
        self.parked += dparked
        now_blocked = self.blocked
        lv = self.liveness
        lv.blocked += now_blocked - was_blocked
        lv.live += (self.live > 0) - was_live
        if (now_blocked and not was_blocked) or (was_live and self.live == 0):
            lv.check()

    # park/unpark, the two calls of every op, specialised from _change: a task that parks
    # or unparks is live, so parked < live before a park and live > 0 throughout

    def parked_one(self) -> None:
        """One of its tasks (or its thread) now waits for a Work."""
        self.parked += 1
        if self.parked == self.live:
            lv = self.liveness
            lv.blocked += 1
            lv.check()
        elif self.tasks.starting:
            # A task started eagerly (asyncio.eager_task_factory) parks before the task
            # that created it awaits it: look for gathers once that task has yielded.
            self.tasks.recheck_soon()
        else:
            self.tasks.look_for_gatherers()

    def unparked(self) -> None:
        if self.parked == self.live:
            self.liveness.blocked -= 1
        self.parked -= 1

    def enter(self) -> None:
        """A task or thread starts acting for this rank."""
        self._change(1, 0)

    def leave(self) -> None:
        self._change(-1, 0)

    def idle(self, activity: str) -> None:
        """From now on (until ``resume``) the rank counts as gone for deadlock detection.

        For a rank thread waiting for work the world cannot give it (a continuous test's
        worker waiting for its next test): ranks blocked on it meanwhile are deadlocked.
        Reports show ``activity`` as its state. Any thread may call it, and ``resume``.
        """
        with self._engine_lock():
            if self.activity is None:
                self.activity = activity
                self._change(-1, 0)

    def resume(self) -> None:
        """The rank is live again (a no-op unless it is idle)."""
        with self._engine_lock():
            if self.activity is not None:
                self.activity = None
                self._change(1, 0)

    def _engine_lock(self) -> contextlib.AbstractContextManager[object]:
        lock = self.world.lock
        if lock is None:
            # ranks not taking turns leave the engine to the loop's thread
            assert self.world.on_loop_thread(), "idle() and resume() need ranks that take turns"
            return contextlib.nullcontext()
        return lock

    def task_done(self, _task: object) -> None:
        """Its own task ended (a done callback: the world's driver adds it)."""
        self._change(-1, 0)

    def status(self) -> str:
        if self.phase is Phase.FAILED and self.error is not None:
            return f"failed with {type(self.error).__name__}: {first_line(self.error)}"
        if self.phase is not Phase.RUNNING:
            return str(self.phase.value)
        if self.blocked:
            return "blocked in " + "; ".join(w.describe() for w in self.waiting)
        if self.live == 0 and self.activity is not None:
            return self.activity
        return self.world.injector.hung.get(self.rank, "running")

    def snapshot(self) -> RankStatistics:
        """What this rank is doing now, frozen (for monitors and reports)."""
        state: StateName = "blocked" if self.phase is Phase.RUNNING and self.blocked else self.phase.state
        return RankStatistics(
            self.rank,
            state,
            tuple(f"{w._call.describe()} {w._where}" for w in self.waiting),
            tuple(self.liveness.waits_for(self)),
            self.completed,
        )

    def __repr__(self) -> str:
        return f"<RankState rank={self.rank} {self.status()}>"


# -- Work ----------------------------------------------------------------------------


class EngineWork(Work):
    """A ``Work`` on the in-process engine: one rank's share of a rendezvous, or a send or recv.

    Made by ``EngineComm._join``; the engine resolves it (``_resolve``) when its op
    completes or fails, and tracks who awaits it, for deadlock detection.
    """

    __slots__ = (
        "_cuda",
        "_event",
        "_grank",
        "_group",
        "_parked_on",
        "_rank",
        "_rdv",
        "_seq",
        "_stamp",
        "_tfuts",
    )

    def __init__(self, group: Group, grank: int, call: Call, site: Site | None, threaded: bool = False) -> None:
        world = group.world
        # Work.__init__'s three fields, set here: a call to it would cost 0.1 us per rank
        # per op, 3% of a 64-rank all_reduce (tests/package/test_api.py checks none is missed)
        self._fut = world.loop.create_future()
        self._call = call
        self._site = site
        self._rank = world.ranks[group.ranks[grank]]
        self._group = group
        self._grank = grank
        self._rdv: Rendezvous | None = None  # while pending: whom it waits for
        self._seq: int | None = None  # its place in the group's collectives
        self._parked_on: RankState | None = None
        # set for works issued from another thread, which blocks on it in wait()
        self._event: _Latch | TurnEvent | None = None
        if threaded:
            turns = world.turns
            if turns is not None and self._rank.on_own_thread():
                self._event = TurnEvent(turns, self._rank.rank)
            else:  # ranks that run at once, or a thread the rank started (it takes no turns)
                self._event = _Latch()
        self._tfuts: TorchFutures | None = None  # once torch asked for futures (get_future)
        self._stamp: Stamp | None = None  # its timing, when the world records
        # for a call on CUDA tensors: where its inputs are ready, and once enqueued its op's
        # done event (set by EngineComm._join in the caller's thread, whose streams it reads)
        self._cuda: _cuda.Issue | None = None

    @property
    def _where(self) -> str:
        if self._seq is not None:
            return f"#{self._seq} on group {self._group.name!r}"
        return f"on group {self._group.name!r}"

    @property
    def _owner(self) -> int:
        return self._rank.rank

    # Read-only names for what the layers above read of a work (the bridge, a world's
    # report); the engine's own modules use the fields, on the per-op path.

    @property
    def call(self) -> Call:
        """The op's call (an ``_ops`` class)."""
        return self._call

    @property
    def site(self) -> Site | None:
        """Where its rank issued it (file, line), if known."""
        return self._site

    @property
    def group(self) -> Group:
        """The group it runs in."""
        return self._group

    @property
    def grank(self) -> int:
        """Its rank's place in the group."""
        return self._grank

    @property
    def seq(self) -> int | None:
        """Its place in the group's collectives (None: a send or recv)."""
        return self._seq

    @property
    def where(self) -> str:
        """Where the op stands, for reports: ``"#3 on group 'world'"``."""
        return self._where

    @property
    def owner(self) -> int:
        """The global rank that issued it."""
        return self._owner

    def __await__(self) -> Generator[Any, None, Any]:
        fut = self._fut
        if not fut.done():
            st = _rank_var.get()
            if st is not None and st.world is self._rank.world:
                if st.tasks.gathering and (task := asyncio.current_task()) in st.tasks.gathering:
                    st.tasks.resumed(task)  # it awaited a gather until now (see RankTasks.resumed)
                st.world.park(self, st)
            try:
                yield from fut
            except asyncio.CancelledError:
                # The engine only ever sets results or errors: a cancelled future means
                # the awaiting task was cancelled while the op was still pending.
                if fut.cancelled():
                    world = self._rank.world
                    world._cancelled(self)
                    if self._tfuts is not None:  # (the abort fails them, unless the world was aborted already)
                        self._fail_tfuts(world._aborted_error())
                raise
            finally:
                self._unpark()
        return fut.result()

    def _enqueued(self) -> None:
        """Its CUDA op is on a stream: a thread blocked in wait() may go on (NCCL's semantics)."""
        iss = self._cuda
        if self._event is not None and iss is not None and iss.done is not None:
            self._unpark()
            self._event.set()

    def _unpark(self) -> None:
        st = self._parked_on
        if st is not None:
            self._parked_on = None
            st.waiting.remove(self)
            st.unparked()

    def _resolve(self, result: Any = None, exc: BaseException | None = None) -> None:
        if self._fut.done():
            if exc is not None and self._tfuts is not None and self._fut.cancelled():
                # its awaiting task was cancelled: torch's futures still fail, as the world aborts
                self._fail_tfuts(exc)
            return
        # Unpark first: a rank whose wait is satisfied is runnable from now on.
        self._unpark()
        if exc is None:
            self._fut.set_result(result)
        else:
            self._fut.set_exception(exc)
            # Mark it retrieved: a work nobody awaits (issued, then the rank failed) would
            # have asyncio log its error at exit; spawn reports failures its own way. An
            # awaiter still gets the error.
            self._fut.exception()
        self._rank.completed += 1
        stamp = self._stamp
        if stamp is not None and exc is not None:
            stamp.failed(exc)  # (successes are stamped once per collective, in _complete)
        if self._tfuts is not None:
            if exc is None:
                self._tfuts.settle(None)
            else:
                self._fail_tfuts(exc)
        if self._event is not None:
            self._event.set()

    # -- for threads and torch.distributed ---------------------------------------------

    def wait(self, timeout: float | None = None) -> Any:
        """Block the calling thread until done; return the result or raise the op's error.

        For ranks that run in threads. On the event loop thread, ``await`` the work
        instead: blocking there would stop the very loop that completes it
        (``BlockingCallError``). With ``timeout`` (seconds), raises
        ``CollectiveTimeoutError`` if the op is still pending by then.

        >>> import torch, aiocoll
        >>> def worker(comm):  # a plain def: each rank runs in its own thread
        ...     t = torch.ones(1)
        ...     comm.all_reduce(t).wait()
        ...     return t.item()
        >>> aiocoll.spawn(worker, world=2)
        [2.0, 2.0]
        """
        world = self._rank.world
        if not self._fut.done():
            if _thread.get_ident() == world.loop_thread:
                raise BlockingCallError(
                    f"blocking wait for {self._call.describe()} on the event loop thread would "
                    "deadlock: await it instead (e.g. 'await work' or "
                    "'await dist.all_reduce(t, async_op=True)')"
                )
            event = self._event
            if event is None:  # issued on the loop, waited from a thread
                raise RuntimeError("this work was issued on the event loop; await it there")
            own = self._rank.on_own_thread()
            if isinstance(event, TurnEvent) and not own:
                raise BlockingCallError(not_the_rank_s_thread(self._rank.rank, self._call.describe()))
            lock = world.lock
            if timeout is None and not own:
                # a thread the rank started (an async checkpoint's, say): it holds no turn to
                # hand over, and the rank is not blocked while its own thread runs on
                event.wait()
            elif timeout is None and lock is not None:
                # ranks take turns: report the wait now, then hand the turn over
                with lock:
                    world.park(self)
                event.wait()
            elif timeout is None:
                # Tell the loop this thread is blocked only if the wait is not short: most
                # complete within microseconds, and a message per wait costs a loop wake-up.
                if not event.wait(_PARK_AFTER):
                    world.call_soon_threadsafe(world.park, self)
                    event.wait()
            elif not event.wait(timeout):
                # A wait with a timeout is not counted as blocked: the thread will
                # wake up and may yet make the call its peers wait for.
                raise CollectiveTimeoutError(
                    f"rank {self._rank.rank} waited {timeout}s in {self.describe()}; it is still pending"
                )
        iss = self._cuda
        if iss is not None and iss.done is not None and not self._fut.done():
            # Enqueued on a CUDA stream, not finished: as with NCCL, order the caller's
            # current stream after the op instead of waiting for it. An error the device
            # reports later aborts the world, and the rank sees it at its next call.
            _cuda.stream_wait(iss)
            return None  # what tensor collectives return
        return self._fut.result()

    def torch_future(self, value: Any) -> torch.futures.Future[Any]:
        """A torch Future completed with ``value`` (or the op's error) when this work completes.

        What the torch.distributed adapter hands out as ``get_future()``.

        >>> import torch, aiocoll
        >>> async def worker(comm):
        ...     t = torch.ones(1)
        ...     w = comm.all_reduce(t)
        ...     fut = w.torch_future([t])
        ...     await w
        ...     return fut.done(), fut.value()[0].item()
        >>> aiocoll.spawn(worker, world=2)
        [(True, 2.0), (True, 2.0)]
        """
        # Not the base's done-callback: rank threads ask for torch futures (asyncio's
        # callbacks may only be added on the loop's thread), and C++ callers block on them
        # while ranks take turns, when no loop turn may come to run a callback. The engine
        # completes them itself, in _resolve.
        futs = self._tfuts
        if futs is None:
            with _tfuts_lock:  # (two threads of one rank may ask at once)
                futs = self._tfuts
                if futs is None:
                    futs = self._tfuts = TorchFutures()
        tf = futs.add(value)
        fut = self._fut
        if fut.done() and not futs.settled:  # done before torch asked: settle now
            if fut.cancelled():
                self._fail_tfuts(cancelled_error(self.describe()))
            elif (exc := fut.exception()) is not None:
                self._fail_tfuts(exc)
            else:
                futs.settle(None)
        return tf

    def _fail_tfuts(self, exc: BaseException) -> None:
        """Fail the torch futures handed out, noting the error for the world's report (``SentToTorch``)."""
        assert self._tfuts is not None
        if not self._tfuts.settled:
            self._rank.world.sent_to_torch.add(exc)
            self._tfuts.settle(exc)


# Guards the making of a work's torch futures, which rank threads ask for (rarely) while the
# loop may settle them.
_tfuts_lock = threading.Lock()


def rank_var() -> contextvars.ContextVar[RankState | None]:
    return _rank_var


def first_line(e: BaseException) -> str:
    """The first line of ``e``'s message, for one-line reports."""
    return (str(e).splitlines() or [""])[0]
