"""The world driver: one run of a rank function on every rank of a world, start to outcome.

``spawn``, ``spawn_async``, the pytest plugin and the process harness all run their worlds
through ``WorldRun``; what differs between them is the ``WorldConfig`` they pass.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import random
import threading
import warnings
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, TypeVar, cast

import torch
import torch.distributed as dist

from .. import _patches, _torch, _watchdog
from .._c10d import _backend as _c10d
from .._c10d import _belongings
from .._comm import Comm
from .._diagnostics import _frdump
from .._diagnostics._output import prefixed_output
from .._engine._engine_comm import EngineComm
from .._engine._faults import FaultPlan
from .._engine._rank import RankState, rank_var
from .._engine._record import Recorder
from .._engine._turns import SameCpu, StallWatch, Turns
from .._engine._world import World, install_task_tracking
from .._errors import InvalidArgumentError, RankExitedError
from .._process._locals import RankLocals
from ._config import WorldConfig
from ._outcome import Outcome, warn_unmatched

if TYPE_CHECKING:
    from .._bridge._hybrid import HybridWorld

__all__ = ["HostedRun", "RankThread", "WorldRun", "is_async"]

T = TypeVar("T")


class RankThread(threading.Thread):
    """A sync rank's thread, knowing its rank and the world loop's thread that started it.

    Worlds may nest (a rank of ``aiocoll run`` calling ``torch.multiprocessing.spawn``):
    ``loop`` tells one world's rank threads from another's.
    """

    def __init__(self, rank: int, target: Callable[[], None]) -> None:
        # daemon: a rank stuck in user code must not keep the interpreter alive after ^C
        super().__init__(target=target, name=f"aiocoll rank {rank}", daemon=True)
        self.rank = rank
        self.loop = threading.current_thread()

    def run(self) -> None:
        # under a frame named after the rank: faulthandler's dump of a crash names threads by id only
        _watchdog.named_call(self.name, super().run)


class WorldRun:
    """One run of ``fn`` on the ranks of a world made from ``config``, on the running loop.

    ``run`` builds the world, enters every resource it needs on one exit stack (torch.distributed
    sessions, turns, task tracking, output prefixes, the hybrid bridge), makes every rank
    live before any runs, waits for them all (cancelled from outside: takes them all down
    first), releases what the ranks made, then returns their results in rank order or
    raises the first root cause, as ``Outcome`` reports it.

    >>> import asyncio
    >>> async def worker(comm):
    ...     return comm.rank * 10
    >>> asyncio.run(WorldRun(worker, WorldConfig(3, c10d="off")).run())
    [0, 10, 20]
    """

    def __init__(self, fn: Callable[[Comm], object], config: WorldConfig) -> None:
        if not callable(fn):
            raise InvalidArgumentError(f"spawn: argument 'fn' must be callable, got {type(fn).__name__}")
        self.fn = fn
        self.config = config
        self.is_async = is_async(fn)
        self.runners: list[asyncio.Future[object]] = []  # one per local rank, in rank order
        self._threads: list[threading.Thread] = []
        self._outcome: Outcome | None = None
        # made by _build
        self._sessions: list[_c10d.RankSession | None] = [None] * config.size
        self._locals: RankLocals | None = None  # sync ranks taking turns: their per-rank state
        self._cpus: SameCpu | None = None
        self._hybrid: HybridWorld | None = None

    def __repr__(self) -> str:
        kind = "async" if self.is_async else "sync"
        return f"<WorldRun of {getattr(self.fn, '__qualname__', self.fn)!r} ({kind} ranks), {self.config!r}>"

    async def run(self) -> list[object]:
        """Run every rank to its end; their results in rank order, or the report of the first failure."""
        if self._outcome is not None:
            raise RuntimeError(f"{self!r} has run already: a WorldRun runs once")
        with contextlib.ExitStack() as stack:
            # first: the world's objects are all younger than it, and its end (release,
            # entered by _build, so left before this) collects only those; its engine,
            # watched, tells later worlds' starts when to collect more (_belongings)
            watch = stack.enter_context(_belongings.world_scope(asyncio.get_running_loop()))
            w, local, order = self._build(stack)
            watch(w)
            await self._run_ranks(stack, w, local, order)
        return self._conclude(w)

    # -- building the world and entering its resources ---------------------------------

    def _build(self, stack: contextlib.ExitStack) -> tuple[World, list[RankState], list[RankState]]:
        """The world, its local ranks and the order they start in; every resource entered on ``stack``."""
        cfg = self.config
        loop = asyncio.get_running_loop()
        plan = FaultPlan(cfg.faults, cfg.size) if cfg.faults else None  # checked before anything starts
        c10d = cfg.c10d
        hybrid = None
        if cfg.process_group is not None:
            from .._bridge._hybrid import HybridWorld  # only hybrid worlds need the process-group machinery

            hybrid = self._hybrid = HybridWorld(cfg.process_group, cfg.size, cfg.timeout)
            stack.callback(hybrid.close)
            # torch.distributed inside the ranks would shadow the process's real groups,
            # which the hybrid world itself talks through
            c10d = "off"
        recorder = None
        if cfg.record or cfg.trace is not None:
            recorder = Recorder(cfg.size, None if cfg.trace is not None else cfg.record)
            if cfg.trace is not None:
                stack.callback(recorder.write_trace, cfg.trace)  # even when the run fails
        rng = None if cfg.schedule_seed is None else random.Random(cfg.schedule_seed)
        w = World(cfg.size, loop, cfg.timeout, hybrid, recorder=recorder, faults=plan, rng=rng)
        w.rank_seeds = cfg.rank_seeds
        self._outcome = Outcome(w)
        local = [st for st in w.ranks if hybrid is None or st.rank in hybrid.local]
        order = list(local)
        if rng is not None:
            rng.shuffle(order)  # which rank starts first, too
        # the groups, stores and meshes the ranks made die at the end, in this thread
        # (_belongings), but for those the ranks' results keep alive
        stack.callback(_c10d.release, w, self.runners)
        if cfg.sync_ranks == "turns" and hybrid is None and not self.is_async:
            # (a hybrid world's bridge runs on the loop: its sync ranks run in parallel)
            self._locals = stack.enter_context(contextlib.closing(RankLocals(cfg.size, cfg.rank_seeds)))
            self._cpus = SameCpu.detect(cfg.size)
            w.take_turns(Turns(cfg.size, w.rng, self._locals.switch, self._cpus))
        if c10d != "off":
            store = dist.HashStore()  # type: ignore[attr-defined]
            self._sessions = [_c10d.RankSession(st, store, init=c10d == "init") for st in w.ranks]
            _torch.prepare_for_rank_threads()  # before install(): a failure here leaves nothing to undo
            _patches.acquire(_c10d.PER_RANK_C10D)
            stack.callback(self._end_sessions)
        stack.callback(install_task_tracking(loop))
        stack.enter_context(_watchdog.fatal_errors_reported())  # a crash in C code prints each rank's stack
        if cfg.prefix_output:
            stack.enter_context(prefixed_output())
        return w, local, order

    def _end_sessions(self) -> None:
        for session in self._sessions:
            assert session is not None
            session.finish()
        _patches.release(_c10d.PER_RANK_C10D)

    # -- running the ranks ----------------------------------------------------------------

    async def _run_ranks(
        self, stack: contextlib.ExitStack, w: World, local: list[RankState], order: list[RankState]
    ) -> None:
        # Every rank is live before the first one runs, not from its first step: a rank
        # whose task or thread has not started yet is not absent, and a rank blocked early
        # would look deadlocked (a task factory may run a task's first step at once,
        # asyncio.eager_task_factory; a rank thread taking turns runs at once too).
        for st in local:
            st.enter()
        self.runners.extend(self._start(stack, w, local, order))
        for st, r in zip(local, self.runners, strict=True):
            st.tasks.task = r if isinstance(r, asyncio.Task) else None
            if w.turns is None:  # (a rank thread taking turns leaves in its own thread)
                r.add_done_callback(st.task_done)
        try:
            await asyncio.wait(self.runners)
            # tasks a rank created and left running would outlive the world
            leftover = w.tasks.cancel("aiocoll: the world this task belongs to has ended")
            if leftover:
                await asyncio.wait(leftover)
        except asyncio.CancelledError:
            await self._take_down(w)
            raise
        for t in self._threads:
            t.join()  # each has posted its result as its last act: this is immediate
        if self._hybrid is not None:
            await self._hybrid.say_goodbye(min(self.config.timeout or 5.0, 5.0))

    async def _take_down(self, w: World) -> None:
        """Cancelled from outside (KeyboardInterrupt, a cancel scope): take every rank down
        and wait for them, so nothing outlives the run.

        Threads cannot be cancelled: the abort fails their next collective, and we wait
        for them to return.
        """
        w.locked(w.abort, None, asyncio.CancelledError("spawn was cancelled"))
        pending = [*self.runners, *w.tasks.cancel("spawn was cancelled")]
        while pending:
            # An anyio cancel scope cancels us again on every loop turn: keep waiting,
            # or we would return while ranks still run. (A second ^C still lands:
            # KeyboardInterrupt is not a CancelledError.)
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait(pending)
            pending = [r for r in pending if not r.done()] + w.tasks.cancel("spawn was cancelled")
        self._retrieve()

    def _start(
        self, stack: contextlib.ExitStack, w: World, local: list[RankState], order: list[RankState]
    ) -> list[asyncio.Future[object]]:
        """Start the local ranks (every one live already); a future per rank, done when it ends."""
        if self.is_async:
            return self._start_tasks(w, local, order)
        if w.turns is not None:
            watch = StallWatch(w.turns, w.loop)
            watch.start()
            stack.callback(watch.stop)
        return self._start_threads(w, local, order)

    def _start_tasks(self, w: World, local: list[RankState], order: list[RankState]) -> list[asyncio.Future[object]]:
        fn = cast(Callable[[Comm], Coroutine[object, object, object]], self.fn)
        coros = {st.rank: self._task_main(w, st, fn) for st in order}
        w.tasks.rank_coros = set(coros.values())
        by_rank = {st.rank: w.loop.create_task(coros[st.rank], name=f"aiocoll rank {st.rank}") for st in order}
        return [by_rank[st.rank] for st in local]

    async def _task_main(self, w: World, st: RankState, fn: Callable[[Comm], Coroutine[object, object, T]]) -> T:
        rank_var().set(st)  # this task's context only; tasks it creates inherit it
        session = self._sessions[st.rank]
        try:
            if session is not None:
                session.start()
            comm = EngineComm(w, w.group, st.rank)
            # (the frame's name says whose stack a crash's dump shows: the loop's thread runs them all)
            result = await _watchdog.named_async_call(f"aiocoll rank {st.rank}", lambda: fn(comm))
        except BaseException as e:
            ok, value = _exited(st.rank, e)
            if ok:
                st.returned()
                return cast(T, value)
            assert isinstance(value, BaseException)
            self._failed(st, value)
            if value is e:
                raise
            raise value from e  # (a RankExitedError)
        st.returned()
        return result

    def _start_threads(self, w: World, local: list[RankState], order: list[RankState]) -> list[asyncio.Future[object]]:
        try:
            with self._cpus.starting() if self._cpus is not None else contextlib.nullcontext():
                endings = None if w.turns is None else _Endings(w, len(local))
                return [self._start_thread(w, st, endings) for st in local]
        finally:
            if w.turns is not None:
                # The first rank runs once every thread is started: starting a thread
                # waits for it to take the GIL, which a running rank would hold.
                w.turns.start(st.rank for st in order)

    def _start_thread(self, w: World, st: RankState, endings: _Endings | None) -> asyncio.Future[object]:
        """Run a sync rank in its own thread; the returned future completes when it ends
        (ranks taking turns: when they all have)."""
        fut: asyncio.Future[object] = w.loop.create_future()
        turns, rank_locals, fn = w.turns, self._locals, self.fn
        session = self._sessions[st.rank]

        def settle(ok: bool, value: object) -> None:
            if ok:
                st.returned()
            else:
                assert isinstance(value, BaseException)
                self._failed(st, value)

        def done(ok: bool, value: object) -> None:
            if turns is None:
                settle(ok, value)
            if ok:
                fut.set_result(value)
            else:
                assert isinstance(value, BaseException)
                fut.set_exception(value)

        def main() -> None:
            rank_var().set(st)
            st.runs_here()
            ok, value = False, cast(object, None)
            # as torch's threaded process group does: autograd must not hand work to its
            # own device threads from a rank thread (a setting of this thread: not undone, it ends)
            torch.autograd.set_multithreading_enabled(False)
            try:
                if turns is not None:  # (a failure here is the rank's: it still ends its turn below)
                    assert rank_locals is not None
                    rank_locals.bind(st.rank)
                    turns.begin(st.rank)
                if session is not None:
                    session.start()
                try:
                    ok, value = True, fn(EngineComm(w, w.group, st.rank, threaded=True))
                    if inspect.iscoroutine(value):
                        # e.g. spawn(lambda comm: worker(comm, x)): a plain function that made a
                        # coroutine, which nobody would await (and whose result would be lost)
                        value.close()
                        raise InvalidArgumentError(
                            f"spawn: {getattr(fn, '__qualname__', fn)!r} is a plain function but returned a "
                            f"coroutine on rank {st.rank}; "
                            "pass an async def (or functools.partial of one) to run async ranks"
                        )
                finally:
                    if session is not None:
                        session.finish()
                    # now, in its turn, not as the thread exits (where two exiting rank threads can deadlock in torch)
                    _torch.drop_thread_caches()
            except BaseException as e:
                ok, value = _exited(st.rank, e)
            if turns is not None:
                # settled now, in turn order: a failure aborts the world before another rank runs
                assert w.lock is not None
                try:
                    with w.lock:
                        settle(ok, value)
                        st.leave()
                finally:  # whatever happens, the others must not wait for this rank's turn
                    if rank_locals is not None:
                        rank_locals.unbind(st.rank)
                    turns.end(st.rank)
            # the thread's last act
            if endings is not None:
                endings.ended(done, ok, value)
            else:
                w.call_soon_threadsafe(done, ok, value)

        thread = RankThread(st.rank, main)
        self._threads.append(thread)
        thread.start()
        return fut

    def _failed(self, st: RankState, e: BaseException) -> None:
        assert self._outcome is not None
        self._outcome.failed(st, e)

    # -- the outcome ----------------------------------------------------------------------

    def _retrieve(self) -> None:
        """Mark the ranks' exceptions retrieved: the run reports them, once, its own way."""
        for r in self.runners:
            if r.done() and not r.cancelled():
                r.exception()

    def _conclude(self, w: World) -> list[object]:
        """The ranks' results, or the report of the first failure (warnings as the caller's)."""
        assert self._outcome is not None
        self._retrieve()
        detached = [] if w.turns is None else w.turns.detached
        if self._outcome.failures:
            exc = self._outcome.report()
            for line in detached:
                exc.add_note(f"aiocoll: {line}")
            if w.tasks.untracked is not None:
                exc.add_note(
                    f"aiocoll: the loop's task factory was replaced while the ranks ran (by {w.tasks.untracked}),"
                    " and Python 3.11 cannot read a task's context to tell whose tasks it made: deadlocks"
                    " were left to the timeout. Set the factory before spawn_async, or use Python 3.12+"
                )
            dumped = _frdump.on_failure(lambda prefix: _frdump.dump_world(w, prefix))
            if dumped is not None:
                exc.add_note(dumped)
            raise exc
        if detached:
            warnings.warn(
                "aiocoll: sync ranks take turns, and a rank waited for another outside torch.distributed:\n"
                + "\n".join(f"  {line}" for line in detached)
                + "\nUse spawn(..., sync_ranks='parallel') for code whose ranks wait for each other this way.",
                RuntimeWarning,
                stacklevel=3,
            )
        warn_unmatched(w.pending_works(), "the world", stacklevel=3)
        return [r.result() for r in self.runners]


class HostedRun(WorldRun):
    """A world whose sync ranks run in threads someone else starts (torch's threaded harness).

    ``run()`` (on the world's loop) builds the world, makes every rank live and waits;
    from any thread, ``world()`` waits until it is built, a rank's thread joins by binding
    itself to ``world().ranks[r]``, and ``ended(r, exc)`` says that rank is done. Failures
    are the host's to report (``outcome``); ``run()`` returns the ranks' results (None
    each) and leaves what is still unmatched to ``world().pending_works()``.

    >>> import asyncio
    >>> run = HostedRun(WorldConfig(2, c10d="off", sync_ranks="parallel"))
    >>> async def host():
    ...     main = asyncio.ensure_future(run.run())
    ...     await asyncio.to_thread(run.world)  # built: the ranks' threads may join now
    ...     run.ended(0, None)
    ...     run.ended(1, ValueError("rank 1 failed"))
    ...     return await main
    >>> asyncio.run(host())
    [None, None]
    >>> run.outcome.failures
    [(1, ValueError('rank 1 failed'))]
    """

    def __init__(self, config: WorldConfig) -> None:
        if config.sync_ranks != "parallel" or config.c10d != "off":
            raise InvalidArgumentError("a hosted world runs its ranks in parallel and leaves torch.distributed alone")
        super().__init__(_started_elsewhere, config)
        self._ready = threading.Event()
        self._world: World | None = None
        self._not_built: BaseException | None = None  # why the world could not be built

    @property
    def outcome(self) -> Outcome:
        """The ranks' failures so far, and the report of the first (once the world is built)."""
        assert self._outcome is not None, "the world is not built yet"
        return self._outcome

    def world(self, timeout: float | None = None) -> World:
        """The world, from any thread, once built with every rank live; raises if building it
        failed, ``TimeoutError`` if it is not built within ``timeout`` seconds."""
        if not self._ready.wait(timeout):
            raise TimeoutError(f"aiocoll: the hosted world was not built within {timeout} s")
        if self._world is None:
            raise RuntimeError("aiocoll: the hosted world failed to start") from self._not_built
        return self._world

    def ended(self, rank: int, exc: BaseException | None) -> None:
        """From any thread: ``rank`` is done (``exc`` None) or failed with ``exc``; later calls for it are ignored."""
        w = self.world()
        w.call_soon_threadsafe(self._end, w.ranks[rank], exc)

    def _end(self, st: RankState, exc: BaseException | None) -> None:
        fut = self.runners[st.rank]  # (every rank of a hosted world is local)
        if fut.done():  # a failed rank then destroys its group too
            return
        if exc is None:
            st.returned()
            fut.set_result(None)
        else:
            self._failed(st, exc)  # a root cause aborts the world
            fut.set_exception(exc)

    def give_up(self, error: Callable[[list[int]], BaseException]) -> None:
        """From any thread, once the host is done with its threads: the ranks that have not
        ended are given up on, and ``run()`` returns. ``error(ranks)`` aborts the world (failing
        their waits), if there are any."""
        w = self.world()

        def give_up() -> None:
            left = [rank for rank, fut in enumerate(self.runners) if not fut.done()]
            if left:
                exc = error(left)
                w.abort(None, exc)
                for rank in left:
                    self.runners[rank].set_exception(exc)

        w.call_soon_threadsafe(give_up)

    async def run(self) -> list[object]:
        try:
            return await super().run()
        except BaseException as e:
            if self._world is None:
                self._not_built = e
            raise
        finally:
            self._ready.set()  # (a world that failed to build: world() raises)

    def _start(
        self, stack: contextlib.ExitStack, w: World, local: list[RankState], order: list[RankState]
    ) -> list[asyncio.Future[object]]:
        self._world = w
        self._ready.set()  # (ended() schedules onto the loop: its futures exist before it runs)
        return [w.loop.create_future() for _ in local]

    def _conclude(self, w: World) -> list[object]:
        self._retrieve()  # the host reports failures
        return [None] * len(self.runners)


def _started_elsewhere(comm: Comm) -> None:
    """A hosted world's ranks run code of their own: never called."""
    raise AssertionError("a hosted world's ranks are started by its host")


class _Endings:
    """The ends of a world's rank threads taking turns, told to the loop at once when the last one ends.

    Their outcomes are settled in their own threads, in turn order; the loop only needs
    them to return. A wake-up of the loop per rank would make the loop thread take the
    GIL while the next rank runs, W times (10-15 us each here).
    """

    __slots__ = ("_left", "_lock", "_outcomes", "_world")

    def __init__(self, w: World, count: int) -> None:
        self._world = w
        self._lock = threading.Lock()
        self._left = count
        self._outcomes: list[tuple[Callable[[bool, object], None], bool, object]] = []

    def ended(self, done: Callable[[bool, object], None], ok: bool, value: object) -> None:
        """In a rank thread, as its last act: ``done(ok, value)`` is to run on the loop."""
        with self._lock:
            self._outcomes.append((done, ok, value))
            self._left -= 1
            last = self._left == 0
        if last:
            self._world.call_soon_threadsafe(self._tell)

    def _tell(self) -> None:
        for done, ok, value in self._outcomes:
            done(ok, value)


def _exited(rank: int, e: BaseException) -> tuple[bool, object]:
    """How a rank that raised ``e`` ended, as ``(ok, value)``: an exit is a process's, not the program's.

    ``sys.exit(0)`` (or no code) is a rank that ended early, returning None, as its process
    would; another code fails the world (``RankExitedError``). Anything else is the rank's failure.
    """
    if not isinstance(e, SystemExit):
        return False, e
    if e.code in (0, None):
        return True, None
    return False, RankExitedError.of(rank, e)


def is_async(fn: object) -> bool:
    """Whether ``fn`` runs async ranks: a coroutine function, or an object whose ``__call__`` is one."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)
