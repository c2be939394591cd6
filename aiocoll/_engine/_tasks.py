"""Which asyncio tasks act for a rank, and when all of them wait: the engine's task tracking.

A rank is *blocked* when every task acting for it waits for a collective; ``RankState``
keeps the counts (``live``, ``parked``). Two kinds of task need more than the rank's own:

- **Tasks the rank creates** (``asyncio.create_task``, ``gather`` of coroutines, anyio
  task groups...) act for it too. The engine's task factory (``install``) counts each task
  made while a rank is current as live for it, from before it is made (an eager factory
  runs its first step at once) until it ends (``RankTasks.helper_done``).
- **Tasks that wait for the rank's own tasks** (``await asyncio.gather(comm.all_reduce(a),
  comm.recv(b))``, ``await task``) can do nothing before those end, which are counted
  themselves: ``RankTasks`` counts such a task as parked while all it waits for are tasks
  of the rank (``_park_gatherers``), so a deadlock there is reported at once.

The factory's states (``_Factory``, one per loop): installed by the first world on a loop
and removed by the last (the engine leases it per loop: ``_world.TASK_TRACKING``); it
calls the factory it found (``prev``: None is ``asyncio.Task``); a factory a rank set and
left on the loop as its world ended may wrap
this one (``left``), and a later world then calls it, which calls this one back
(``guard``, with ``depth`` calls under way, each made as the loop did before: ``base``).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import threading
import weakref
from collections.abc import Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any, cast

from .. import _current as current
from .._stats import Phase

if TYPE_CHECKING:
    from ._rank import RankState
    from ._world import World

__all__ = ["CONTEXTS", "RANK", "RankTasks", "WorldTasks", "install", "task_factory"]

# RANK (``_current``'s): the rank a task or thread acts for, set by its rank's own task or
# thread, inherited by the tasks it creates. ``_current`` types it by what the layers below
# read of a rank (``_current.Rank``); the engine alone sets it, always to its RankState, so
# the engine reads it as such (a cast once, at import: nothing per read)
RANK = cast("contextvars.ContextVar[RankState | None]", current.RANK)


class RankTasks:
    """The tasks acting for one rank: its own, those it made (``helpers``), those counted parked in a gather."""

    __slots__ = ("counts", "gathering", "helpers", "holding", "loop", "recheck", "starting", "task")

    def __init__(self, counts: RankState, loop: asyncio.AbstractEventLoop) -> None:
        self.counts = counts
        self.loop = loop
        self.task: asyncio.Task[object] | None = None  # the rank's own task (async ranks)
        self.helpers: set[asyncio.Future[object]] = set()  # tasks the rank created, still running
        # its tasks counted parked in a gather (below), each with how many tasks it waits for
        self.gathering: dict[asyncio.Future[object], int] = {}
        self.holding: dict[asyncio.Future[object], asyncio.Future[object]] = {}  # a task -> the gathering task it holds
        self.starting = 0  # task factory calls under way (an eager one runs the task's first step)
        self.recheck = False  # a look for gathers is due on the loop's next turn (see RankState.parked_one)

    def __repr__(self) -> str:
        return f"<RankTasks helpers={len(self.helpers)} gathering={len(self.gathering)}>"

    def look_for_gatherers(self) -> None:
        """Run ``_park_gatherers`` if few of its tasks are left unparked (see ``_GATHER_SCAN``)."""
        if self.helpers and self.task is not None and 0 < self.counts.live - self.counts.parked <= _GATHER_SCAN:
            self._park_gatherers()

    def recheck_soon(self) -> None:
        """Look for gathers on the loop's next turn, once the tasks running now have yielded."""
        if not self.recheck:
            self.recheck = True
            self.loop.call_soon(self._recheck)

    def _recheck(self) -> None:
        self.recheck = False
        self.look_for_gatherers()

    def _park_gatherers(self) -> None:
        """Count as parked its tasks that await one of its own tasks, or a gather of them only.

        Such a task cannot act before those tasks end, and they are counted themselves:
        so a rank in ``await asyncio.gather(comm.all_reduce(a), comm.recv(b, src=1))``
        (or in ``await task`` of a task in ``recv``) is blocked exactly when the ops
        wait, and a deadlock there is reported at once. Runs when few of its tasks are
        left unparked, as one of them parks or ends: a gather's tasks first run once the
        gathering task awaits it, so one that waits in an op is seen; tasks started
        eagerly are looked at on the loop's next turn (see ``RankState.parked_one``). (Tasks that
        all waited long before they were awaited, with no task of the rank ending since,
        are not: their deadlock is reported at the timeout.)
        """
        main = self.task
        if len(self.helpers) == 1 and main is not None and main not in self.gathering:
            # the common shape, made short: its own task awaits its only task
            waiter = _gathering(main)
            if waiter is not None and waiter in self.helpers and not waiter.done():
                self.gathering[main] = 1
                self.holding[waiter] = main
                self.counts._change(0, 1)
                return
        found = []
        claimed: set[asyncio.Future[object]] = set()
        gatherers: list[asyncio.Future[object]] = []
        if len(self.helpers) <= _GATHER_HELPERS:  # (a look at each: not on every op of a rank of thousands)
            gatherers = [t for t in self.helpers if _awaits_own(t, self.helpers)]
        for task in (self.task, *gatherers):
            if task is None or task in self.gathering:
                continue
            leaves = self._leaves_of(_gathering(task))
            # a task gathered twice (by two tasks) is left to the first: the second counts as running
            if leaves and not any(leaf in self.holding or leaf in claimed for leaf in leaves):
                found.append((task, leaves))
                claimed |= leaves
        for task, leaves in found:
            self.gathering[task] = len(leaves)
            for leaf in leaves:
                self.holding[leaf] = task  # (no list per leaf: thousands of them would cost the GC)
            waiter = _gathering(task)
            assert waiter is not None
            if waiter not in self.helpers:  # (a task of the rank says so as it ends: helper_done)
                waiter.add_done_callback(functools.partial(self._gather_done, task))
        if found:
            self.counts._change(0, len(found))

    def _leaves_of(self, gather: asyncio.Future[object] | None) -> set[asyncio.Future[object]] | None:
        """The tasks of this rank that ``gather`` (a gather, or anything else) waits for, if it waits for no other.

        Nested gathers are looked into. None if it waits for something outside the rank
        (a timer, I/O...), for nothing, or may end any moment: a child failed or was
        cancelled (the children done so far must have succeeded).
        """
        if gather in self.helpers:  # (awaited directly)
            assert gather is not None
            return None if gather.done() else {gather}
        children = _children(gather)
        if children is None:
            return None
        leaves: set[asyncio.Future[object]] = set()
        for c in children:
            if c.done():
                if c.cancelled() or c.exception() is not None:
                    return None
            elif c in self.helpers:
                leaves.add(c)
            else:
                inner = self._leaves_of(c)
                if inner is None:
                    return None
                leaves |= inner
        return leaves or None

    def _gather_done(self, task: asyncio.Future[object], _gather: asyncio.Future[object]) -> None:
        self.resumed(task)

    def resumed(self, task: asyncio.Future[object] | None) -> None:
        """``task`` runs again, or is about to: it no longer counts as parked in a gather.

        A gather's end wakes its task before the engine hears of it (the task's callback
        came first). So the last task a gather waits for says so as it ends (see
        ``helper_done``), and a task of ``gathering`` that parks on a Work says so too.
        """
        if task is not None and self.gathering.pop(task, None) is not None:
            self.counts._change(0, -1)

    def helper_done(self, task: asyncio.Future[object]) -> None:
        self.helpers.discard(task)
        # A gather whose last task this was (or which failed) is about to wake its own
        # task; the engine would hear of it only later: count that task as running now.
        t = self.holding.pop(task, None)
        if t is not None and (left := self.gathering.get(t)) is not None:
            if left == 1 or task.cancelled() or task.exception() is not None:
                self.resumed(t)
            else:
                self.gathering[t] = left - 1
        self.counts._change(-1, 0)
        self.look_for_gatherers()  # a task that gathers the ones left may await it now


# When a rank's gathers are looked for: once at most this many of its tasks are left
# unparked (so at most this many tasks, each awaiting a gather or a task of the rank, are
# found; nested gathers count as one), and among its helper tasks only while it has at
# most _GATHER_HELPERS of them (its main task is always looked at). Past that a deadlock
# is reported at the timeout.
_GATHER_SCAN = 8
_GATHER_HELPERS = 32


def _gathering(task: asyncio.Future[object]) -> asyncio.Future[object] | None:
    """What ``task`` awaits now (asyncio's ``_fut_waiter``, C and Python tasks alike), if anything."""
    return getattr(task, "_fut_waiter", None)


def _children(fut: asyncio.Future[object] | None) -> Sequence[asyncio.Future[object]] | None:
    """The futures of ``fut`` if it is a pending ``asyncio.gather``; else None.

    Reads asyncio's own names (Python 3.11-3.13): ``_GatheringFuture`` and its
    ``_children``. Should they change, this says None and gathers are not looked into.
    """
    if fut is None or not isinstance(fut, _GatheringFuture) or fut.done():
        return None
    children = getattr(fut, "_children", None)
    return children if isinstance(children, list) else None


_GatheringFuture: type = getattr(asyncio.tasks, "_GatheringFuture", type(None))

# Whether a task's context can be read (Task.get_context, Python 3.12+).
CONTEXTS = hasattr(asyncio.Task, "get_context")


def _awaits_own(task: asyncio.Future[object], helpers: set[asyncio.Future[object]]) -> bool:
    """Whether ``task`` awaits a gather, or one of ``helpers`` itself."""
    waiter = _gathering(task)
    return isinstance(waiter, _GatheringFuture) or waiter in helpers


# a loop's task factory (``loop.set_task_factory``): (loop, coro, **kwargs) -> a task of
# the coroutine's result (typeshed's protocol for it is generic in that result, and private)
TaskFactory = Callable[..., asyncio.Future[Any]]


class _Factory:
    """What the engine's task factory calls on one loop."""

    __slots__ = ("base", "depth", "guard", "left", "prev")

    def __init__(self) -> None:
        self.prev: TaskFactory | None = None  # the factory it calls (None: asyncio.Task)
        # a factory a rank set and left on the loop as its world ended: it may call the
        # engine's back (a wrapper of the one it found), which then calls base
        self.left: TaskFactory | None = None
        self.base: TaskFactory | None = None
        self.guard = False  # whether prev is that factory
        self.depth = 0  # then: calls of prev under way (a call back comes in meanwhile)

    def __repr__(self) -> str:
        return f"<_Factory prev={self.prev!r} left={self.left!r}>"


# the rank whose tasks a task made now belongs to (set by the engine at install)
_current: Callable[[], RankTasks | None] | None = None
_installed: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Factory] = weakref.WeakKeyDictionary()


def task_factory(
    loop: asyncio.AbstractEventLoop, coro: Coroutine[object, object, object], **kwargs: Any
) -> asyncio.Future[object]:
    f = _installed.get(loop)
    prev = f.prev if f is not None else None
    guarded = False
    if f is not None and f.guard:  # (rare: prev may call this factory back)
        if f.depth:
            # called back (or a task made in a first step meanwhile): make it as the
            # loop did before, not through prev again
            prev = f.base
        else:
            guarded = True
            f.depth += 1
    try:
        tasks = _current() if _current is not None else None
        task: asyncio.Future[object]
        if tasks is None:
            task = prev(loop, coro, **kwargs) if prev is not None else asyncio.Task(coro, loop=loop, **kwargs)
            return task
        # Live before it is made: a factory may run the task's first step at once
        # (asyncio.eager_task_factory), and a rank whose task parks there is not blocked.
        tasks.counts._change(1, 0)
        tasks.starting += 1
        try:
            task = prev(loop, coro, **kwargs) if prev is not None else asyncio.Task(coro, loop=loop, **kwargs)
        except BaseException:
            tasks.counts._change(-1, 0)
            raise
        finally:
            tasks.starting -= 1
    finally:
        if guarded:
            f.depth -= 1  # type: ignore[union-attr]
    if task in tasks.helpers:
        # counted already: found by WorldTasks.count_all in its first step, or made by a call back
        tasks.counts._change(-1, 0)
    else:
        tasks.helpers.add(task)
        task.add_done_callback(tasks.helper_done)  # (called soon if its first step ended it)
    return task


def install(loop: asyncio.AbstractEventLoop, running: Callable[[], RankTasks | None]) -> Callable[[], None]:
    """Track the tasks made on ``loop`` for the rank ``running()`` names (None: none); returns the undo.

    Once per loop at a time: the engine leases it per loop (``_world.TASK_TRACKING``).
    """
    global _current
    _current = running
    current = loop.get_task_factory()
    f = _installed.get(loop)
    if f is None:
        f = _installed[loop] = _Factory()
    if current is not task_factory:
        f.prev = current
        f.guard = current is not None and current is f.left
        loop.set_task_factory(task_factory)  # type: ignore[arg-type]
    return lambda: _uninstall(loop)


def _uninstall(loop: asyncio.AbstractEventLoop) -> None:
    """The undo of ``install`` on ``loop``."""
    f = _installed[loop]
    left = f.prev if f.guard else None  # a factory left before, which calls this one back
    if left is not None:
        f.prev, f.guard = f.base, False
    current = loop.get_task_factory()
    if current is not task_factory:
        # A rank left its factory on the loop: it may call this one, which goes on
        # calling what it called (the entry stays for that)
        f.left, f.base = current, f.prev
    elif left is not None:
        loop.set_task_factory(left)  # (it calls this one back, which calls base)
    else:
        loop.set_task_factory(f.prev)
        del _installed[loop]


class WorldTasks:
    """The asyncio tasks of one world's ranks, beyond those the factory counted: found, counted, cancelled.

    Async ranks only, on the loop's thread (sync ranks are threads, which make no tasks).
    """

    __slots__ = ("_world", "rank_coros", "untracked")

    def __init__(self, world: World) -> None:
        self._world = world
        # the coroutines of its ranks' own tasks (none: its ranks are threads, which make no
        # tasks); a rank's own task is no helper of it
        self.rank_coros: set[object] = set()
        # the task factory that replaced the engine's while the ranks ran, when the tasks
        # made since cannot be found (see count_all)
        self.untracked: str | None = None

    def __repr__(self) -> str:
        return f"<WorldTasks of world {self._world.id}: {len(self.rank_coros)} rank task(s)>"

    def cancel(self, msg: str) -> list[asyncio.Future[object]]:
        """Cancel every task of every rank still running; return them to be awaited."""
        out: list[asyncio.Future[object]] = []
        for st in self._world.ranks:
            for t in [st.tasks.task, *st.tasks.helpers]:
                if t is not None and not t.done():
                    t.cancel(msg)
                    out.append(t)
        if CONTEXTS and self.rank_coros and threading.get_ident() == self._world.loop_thread:
            for _, task in self._found():  # (made through a factory a rank set)
                task.cancel(msg)
                out.append(task)
        return out

    def count_all(self) -> bool:
        """Make sure every task of the ranks is counted; false if that cannot be known.

        The engine counts the tasks a rank makes through the loop's task factory (see
        ``aiocoll._engine._tasks``). A rank may set another one while it runs, as in
        ``loop.set_task_factory(asyncio.eager_task_factory)`` inside ``spawn``, and may
        put the old one back: the tasks made through it are found here by the rank in
        their context, and counted from now on. Python 3.11 cannot read a task's
        context: a world whose factory is another one here leaves its deadlocks to the
        timeout. Runs only when every rank looks blocked.
        """
        w = self._world
        if not self.rank_coros or threading.get_ident() != w.loop_thread:
            return True  # (sync ranks make no tasks; async ranks run on the loop's thread)
        found: list[tuple[RankState, asyncio.Task[object]]] = []
        if CONTEXTS:
            # (a rank that returned may have tasks left, which still act for it)
            found = [(st, t) for st, t in self._found() if st.phase in (Phase.RUNNING, Phase.RETURNED)]
        elif self.untracked is None and (factory := w.loop.get_task_factory()) is not task_factory:
            self.untracked = repr(factory)
        if self.untracked is not None:
            return False
        for st, task in found:
            st.live += 1
            st.tasks.helpers.add(task)
            task.add_done_callback(st.tasks.helper_done)
        # Tasks out of sight that parked leave the world's totals off: count them again.
        lv = w.liveness
        lv.live = sum(st.live > 0 for st in w.ranks)
        lv.blocked = sum(st.blocked for st in w.ranks)
        for st in {st for st, _ in found}:
            st.tasks.look_for_gatherers()  # a task that awaits the ones found may wait for nothing else
            st.tasks.recheck_soon()  # (or will, once the task that made them in its first step awaits them)
        return True

    def _found(self) -> list[tuple[RankState, asyncio.Task[object]]]:
        """The tasks made for this world's ranks out of the engine's sight, each with its rank (Python 3.12+).

        Found by the rank in their context: a task's context is a copy of its maker's.
        """
        out = []
        for task in asyncio.all_tasks(self._world.loop):
            get_context = getattr(task, "get_context", None)  # (a task class of some other library may lack it)
            st = get_context().get(RANK) if get_context is not None else None
            if (
                st is not None
                and st.world is self._world
                and task not in st.tasks.helpers
                and task is not st.tasks.task
                and task.get_coro() not in self.rank_coros
            ):
                out.append((st, task))
        return out
