"""``spawn`` and ``spawn_async``: run a rank function on every rank of a new world."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import random
import sys
import threading
import warnings
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, cast, overload

import torch
import torch.distributed as dist

from . import _c10d, _frdump, _torch
from ._comm import Comm
from ._engine import EngineWork, Phase, RankState, World, install_task_tracking, rank_var
from ._engine_comm import EngineComm
from ._errors import InvalidArgumentError, WorldAbortedError
from ._faults import Fault, FaultPlan
from ._locals import RankLocals
from ._output import prefixed_output
from ._record import DEFAULT_RECORD, Recorder
from ._turns import SameCpu, StallWatch, Turns

__all__ = ["DEFAULT_RECORD", "DEFAULT_TIMEOUT", "run_world", "spawn", "spawn_async"]

T = TypeVar("T")

DEFAULT_TIMEOUT = 300.0
"""Seconds a rank may wait in one collective before ``CollectiveTimeoutError``."""

LoopChoice = Literal["auto", "asyncio", "uvloop"] | Callable[[], asyncio.AbstractEventLoop]
SyncRanks = Literal["turns", "parallel"]
C10dSetup = Literal["init", "state", "off"]


@overload
def spawn(
    fn: Callable[[Comm], Coroutine[Any, Any, T]],
    world: int,
    *,
    timeout: float | None = ...,
    loop: LoopChoice = ...,
    torch_distributed: bool = ...,
    record: int = ...,
    trace: str | os.PathLike[str] | None = ...,
    faults: Iterable[Fault] = ...,
    schedule_seed: int | None = ...,
    prefix_output: bool = ...,
    process_group: dist.ProcessGroup | None = ...,
    sync_ranks: SyncRanks = ...,
) -> list[T]: ...


@overload
def spawn(
    fn: Callable[[Comm], T],
    world: int,
    *,
    timeout: float | None = ...,
    loop: LoopChoice = ...,
    torch_distributed: bool = ...,
    record: int = ...,
    trace: str | os.PathLike[str] | None = ...,
    faults: Iterable[Fault] = ...,
    schedule_seed: int | None = ...,
    prefix_output: bool = ...,
    process_group: dist.ProcessGroup | None = ...,
    sync_ranks: SyncRanks = ...,
) -> list[T]: ...


def spawn(
    fn: Callable[[Comm], Any],
    world: int,
    *,
    timeout: float | None = DEFAULT_TIMEOUT,
    loop: LoopChoice = "auto",
    torch_distributed: bool = True,
    record: int = DEFAULT_RECORD,
    trace: str | os.PathLike[str] | None = None,
    faults: Iterable[Fault] = (),
    schedule_seed: int | None = None,
    prefix_output: bool = False,
    process_group: dist.ProcessGroup | None = None,
    sync_ranks: SyncRanks = "turns",
) -> list[Any]:
    """Run ``fn(comm)`` on ``world`` ranks of a new event loop; return their results in rank order.

    ``async def fn``: each rank is an asyncio task on the loop. Plain ``def fn``: each
    rank runs in its own thread, and its collectives (``comm``'s, or torch.distributed's)
    complete on the loop. With ``torch_distributed`` (the default), each rank has
    torch.distributed initialised with backend "aiocoll" (default group = the world),
    torn down afterwards.

    If a rank raises, every other rank is released at once (``WorldAbortedError`` in a
    collective; async ranks busy elsewhere are cancelled) and ``spawn`` re-raises the
    first failure, noting its rank.

    ``timeout`` bounds how long a rank may wait in one collective (None: no bound).
    ``loop`` is ``"auto"`` (uvloop when installed), ``"asyncio"``, ``"uvloop"`` or a
    loop factory.

    Diagnostics: the flight recorder keeps each rank's last ``record`` operations (0:
    off) and a failure's report shows them side by side; ``trace="run.json"`` records
    everything and writes a Chrome/Perfetto trace, even when the run fails. ``faults``
    (``Fault.fail/hang/delay``) make chosen ranks fail, hang or straggle at chosen
    operations. ``schedule_seed`` perturbs, reproducibly, the order in which ready ranks
    run and any-source receives match, to shake out order-dependent bugs.
    ``prefix_output`` prefixes what each rank prints or logs with ``[rank N]``.

    ``sync_ranks`` (plain ``def fn`` only): ``"turns"`` (the default) runs one rank
    thread at a time, handing over whenever a rank waits for a collective, so that each
    rank has its own random generators (torch's, ``random``'s and NumPy's, as in its own
    process), runs in an order that repeats (and that ``schedule_seed`` varies) and
    deadlocks are reported at once. ``"parallel"`` lets the threads run at once, sharing
    the generators: for code that makes ranks wait for each other outside
    torch.distributed (a ``threading.Barrier``, a queue, a store's ``get``).

    ``process_group`` makes a *hybrid world* over a real torch.distributed group of M
    processes (each calls ``spawn`` alike): process p runs ranks ``p*world//M`` up to
    ``(p+1)*world//M - 1`` and gets their results; collectives among ranks of several
    processes exchange every rank's call over the group and compute exactly what a flat
    world of ``world`` ranks would. For tests and simulations of large worlds::

        dist.init_process_group("gloo")                      # under torchrun, 2 processes
        results = aiocoll.spawn(fn, world=1024, process_group=dist.group.WORLD)  # 512 here

    >>> import torch, aiocoll
    >>> async def worker(comm):
    ...     t = torch.ones(2) * comm.rank
    ...     await comm.all_reduce(t)
    ...     return t.tolist()
    >>> aiocoll.spawn(worker, world=4)
    [[6.0, 6.0], [6.0, 6.0], [6.0, 6.0], [6.0, 6.0]]
    """
    _check(fn, world, timeout, record, schedule_seed, sync_ranks)
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        raise RuntimeError(
            "aiocoll.spawn() was called from a running event loop; use 'await aiocoll.spawn_async(...)' there instead"
        )
    if _in_trio():
        raise RuntimeError(
            "aiocoll.spawn() would block trio's event loop until the world ends; "
            "run it in a worker thread: await trio.to_thread.run_sync(aiocoll.spawn, fn, world)"
        )
    with asyncio.Runner(loop_factory=_loop_factory(loop)) as runner:
        return runner.run(
            spawn_async(
                fn,
                world,
                timeout=timeout,
                torch_distributed=torch_distributed,
                record=record,
                trace=trace,
                faults=faults,
                schedule_seed=schedule_seed,
                prefix_output=prefix_output,
                process_group=process_group,
                sync_ranks=sync_ranks,
            )
        )


@overload
async def spawn_async(
    fn: Callable[[Comm], Coroutine[Any, Any, T]],
    world: int,
    *,
    timeout: float | None = ...,
    torch_distributed: bool = ...,
    record: int = ...,
    trace: str | os.PathLike[str] | None = ...,
    faults: Iterable[Fault] = ...,
    schedule_seed: int | None = ...,
    prefix_output: bool = ...,
    process_group: dist.ProcessGroup | None = ...,
    sync_ranks: SyncRanks = ...,
) -> list[T]: ...


@overload
async def spawn_async(
    fn: Callable[[Comm], T],
    world: int,
    *,
    timeout: float | None = ...,
    torch_distributed: bool = ...,
    record: int = ...,
    trace: str | os.PathLike[str] | None = ...,
    faults: Iterable[Fault] = ...,
    schedule_seed: int | None = ...,
    prefix_output: bool = ...,
    process_group: dist.ProcessGroup | None = ...,
    sync_ranks: SyncRanks = ...,
) -> list[T]: ...


async def spawn_async(
    fn: Callable[[Comm], Any],
    world: int,
    *,
    timeout: float | None = DEFAULT_TIMEOUT,
    torch_distributed: bool = True,
    record: int = DEFAULT_RECORD,
    trace: str | os.PathLike[str] | None = None,
    faults: Iterable[Fault] = (),
    schedule_seed: int | None = None,
    prefix_output: bool = False,
    process_group: dist.ProcessGroup | None = None,
    sync_ranks: SyncRanks = "turns",
) -> list[Any]:
    """The awaitable twin of ``spawn``: runs the ranks on the running loop.

    For callers already inside a loop, e.g. a pytest-asyncio test::

        async def test_sum():
            results = await aiocoll.spawn_async(worker, world=4)

    >>> import asyncio, aiocoll
    >>> async def worker(comm):
    ...     return await comm.all_gather_object(comm.rank * 10)
    >>> async def main():
    ...     return await aiocoll.spawn_async(worker, world=3)
    >>> asyncio.run(main())
    [[0, 10, 20], [0, 10, 20], [0, 10, 20]]
    """
    _check(fn, world, timeout, record, schedule_seed, sync_ranks)
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        raise RuntimeError(
            "aiocoll.spawn_async() needs a running asyncio event loop (aiocoll runs on asyncio or "
            "uvloop, including anyio's asyncio backend). From trio, run a world in a worker thread: "
            "await trio.to_thread.run_sync(aiocoll.spawn, fn, world)"
        ) from None
    return await run_world(
        fn,
        world,
        timeout=timeout,
        c10d="init" if torch_distributed else "off",
        record=record,
        trace=trace,
        faults=faults,
        schedule_seed=schedule_seed,
        prefix_output=prefix_output,
        process_group=process_group,
        sync_ranks=sync_ranks,
    )


async def run_world(
    fn: Callable[[Comm], Any],
    world: int,
    *,
    timeout: float | None,
    c10d: C10dSetup,
    record: int = DEFAULT_RECORD,
    trace: str | os.PathLike[str] | None = None,
    faults: Iterable[Fault] = (),
    schedule_seed: int | None = None,
    prefix_output: bool = False,
    process_group: dist.ProcessGroup | None = None,
    sync_ranks: SyncRanks = "turns",
) -> list[Any]:
    """``spawn_async`` with checked arguments, on the running loop.

    ``c10d``: "init" initialises torch.distributed in each rank (backend "aiocoll");
    "state" only gives each rank its own c10d state, for code that initialises
    torch.distributed itself (``aiocoll.testing``'s process harness); "off" leaves
    torch.distributed alone.
    """
    loop = asyncio.get_running_loop()
    hybrid = None
    if process_group is not None:
        if not isinstance(process_group, dist.ProcessGroup):
            raise InvalidArgumentError(
                "spawn: argument 'process_group' must be a torch.distributed ProcessGroup "
                f"(e.g. dist.group.WORLD) or None, got {type(process_group).__name__}"
            )
        from ._hybrid import HybridWorld  # only hybrid worlds need the process-group machinery

        hybrid = HybridWorld(process_group, world, timeout)
        # torch.distributed inside the ranks would shadow the process's real groups,
        # which the hybrid world itself talks through
        c10d = "off"
    w = World(world, loop, timeout, hybrid)
    local = [st for st in w.ranks if hybrid is None or st.rank in hybrid.local]
    if hybrid is not None:
        for st in w.ranks:
            if st.rank not in hybrid.local:
                st.phase = Phase.REMOTE
    if record or trace is not None:
        w.recorder = Recorder(world, None if trace is not None else record)
        for st, ring in zip(w.ranks, w.recorder.ranks, strict=True):
            st.record = ring  # the engine appends straight to it
    faults = list(faults)
    if faults:
        w.faults = FaultPlan(faults, world)
    order = list(local)
    if schedule_seed is not None:
        w.rng = random.Random(schedule_seed)
        w.rng.shuffle(order)  # which rank starts first, too
    rank_locals: RankLocals | None = None
    cpus: SameCpu | None = None
    if sync_ranks == "turns" and hybrid is None and not _is_async(fn):
        # (a hybrid world's bridge runs on the loop: its sync ranks run in parallel)
        rank_locals = RankLocals(world)
        cpus = SameCpu.detect(world)
        w.take_turns(Turns(world, w.rng, rank_locals.switch, cpus))
    sessions: list[_c10d.RankSession | None] = [None] * world
    if c10d != "off":
        store = dist.HashStore()  # type: ignore[attr-defined]
        sessions = [_c10d.RankSession(st, store, init=c10d == "init") for st in w.ranks]
        _torch.prepare_for_rank_threads()  # before install(): a failure here leaves nothing to undo
        _c10d.install()
    undo = install_task_tracking(loop)
    output = prefixed_output() if prefix_output else contextlib.nullcontext()
    output.__enter__()
    failures: list[tuple[int, BaseException]] = []
    threads: list[threading.Thread] = []
    watch: StallWatch | None = None
    runners: list[asyncio.Future[Any]] = []
    try:
        # Every rank is live before the first one runs, not from its first step: a rank
        # whose task or thread has not started yet is not absent, and a rank blocked early
        # would look deadlocked (a task factory may run a task's first step at once,
        # asyncio.eager_task_factory; a rank thread taking turns runs at once too).
        for st in local:
            st.enter()
        if _is_async(fn):
            afn = cast(Callable[[Comm], Coroutine[Any, Any, Any]], fn)
            coros = {st.rank: _run_rank(w, st, afn, sessions[st.rank], failures) for st in order}
            w.rank_coros = set(coros.values())
            by_rank = {st.rank: loop.create_task(coros[st.rank], name=f"aiocoll rank {st.rank}") for st in order}
            runners = [by_rank[st.rank] for st in local]
        else:
            if w.turns is not None:
                watch = StallWatch(w.turns, loop)
                watch.start()
            try:
                with cpus.starting() if cpus is not None else contextlib.nullcontext():
                    endings = None if w.turns is None else _Endings(w, len(local))
                    runners = [
                        _start_thread(w, st, fn, sessions[st.rank], failures, threads, rank_locals, endings)
                        for st in local
                    ]
            finally:
                if w.turns is not None:
                    # The first rank runs once every thread is started: starting a thread
                    # waits for it to take the GIL, which a running rank would hold.
                    w.turns.start(st.rank for st in order)
        for st, r in zip(local, runners, strict=True):
            st.tasks.task = r if isinstance(r, asyncio.Task) else None
            if w.turns is None:  # (a rank thread taking turns leaves in its own thread)
                r.add_done_callback(st._task_done)
        try:
            await asyncio.wait(runners)
            # tasks a rank created and left running would outlive the world
            leftover = w.cancel_tasks("aiocoll: the world this task belongs to has ended")
            if leftover:
                await asyncio.wait(leftover)
        except asyncio.CancelledError:
            # Cancelled from outside (KeyboardInterrupt, a cancel scope): take every
            # rank down with us and wait for them, so nothing outlives the call.
            # Threads cannot be cancelled: the abort fails their next collective, and
            # we wait for them to return.
            w.locked(w.abort, None, asyncio.CancelledError("spawn was cancelled"))
            pending = [*runners, *w.cancel_tasks("spawn was cancelled")]
            while pending:
                # An anyio cancel scope cancels us again on every loop turn: keep waiting,
                # or we would return while ranks still run. (A second ^C still lands:
                # KeyboardInterrupt is not a CancelledError.)
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait(pending)
                pending = [r for r in pending if not r.done()] + w.cancel_tasks("spawn was cancelled")
            _retrieve(runners)
            raise
        for t in threads:
            t.join()  # each has posted its result as its last act: this is immediate
        if hybrid is not None:
            await hybrid.say_goodbye(min(timeout or 5.0, 5.0))
    finally:
        if watch is not None:
            watch.stop()
        undo()
        output.__exit__(None, None, None)
        if c10d != "off":
            for session in sessions:
                assert session is not None
                session.finish()
            _c10d.uninstall()
        if rank_locals is not None:
            rank_locals.close()
        # the groups, stores and meshes the ranks made die now, in this thread (_belongings),
        # but for those the ranks' results keep alive
        _c10d.release(w, runners)
        if trace is not None and w.recorder is not None:
            w.recorder.write_trace(trace)
        if hybrid is not None:
            hybrid.close()
    _retrieve(runners)
    detached = [] if w.turns is None else w.turns.detached
    if failures:
        exc = _report(w, failures)
        for line in detached:
            exc.add_note(f"aiocoll: {line}")
        if w.untracked is not None:
            exc.add_note(
                f"aiocoll: the loop's task factory was replaced while the ranks ran (by {w.untracked}),"
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
            stacklevel=2,
        )
    warn_unmatched(w.pending_works(), "the world", stacklevel=2)
    return [r.result() for r in runners]


def warn_unmatched(works: list[EngineWork], what: str, stacklevel: int) -> None:
    """Warn about ``works`` still pending though every rank has ended (``stacklevel`` as seen by the caller).

    They were issued and never matched: in a real job they would hang or be dropped.
    Say so rather than pass silently.
    """
    if works:
        lines = "\n".join(f"  rank {x._rank.rank}: {x.describe()}" for x in works)
        warnings.warn(
            f"aiocoll: {what} ended with {len(works)} operation(s) no peer ever matched:\n{lines}",
            RuntimeWarning,
            stacklevel=stacklevel + 1,
        )


async def _run_rank(
    w: World,
    st: RankState,
    fn: Callable[[Comm], Coroutine[Any, Any, T]],
    session: _c10d.RankSession | None,
    failures: list[tuple[int, BaseException]],
) -> T:
    rank_var().set(st)  # this task's context only; tasks it creates inherit it
    try:
        if session is not None:
            session.start()
        result = await fn(EngineComm(w, w.group, st.rank))
    except BaseException as e:
        _failed(w, st, e, failures)
        raise
    st.phase = Phase.RETURNED
    return result


def _in_trio() -> bool:
    """Whether the caller runs in a trio task (without importing trio when it is not in use)."""
    trio = sys.modules.get("trio")
    if trio is None:
        return False
    try:
        trio.lowlevel.current_task()
    except RuntimeError:
        return False
    return True


def _retrieve(runners: list[asyncio.Future[Any]]) -> None:
    """Mark the ranks' exceptions retrieved: spawn reports them, once, its own way."""
    for r in runners:
        if r.done() and not r.cancelled():
            r.exception()


def _failed(w: World, st: RankState, e: BaseException, failures: list[tuple[int, BaseException]]) -> None:
    """On the loop: rank ``st`` ended with ``e``; a root cause aborts the world."""
    st.phase = Phase.FAILED
    st.error = e
    failures.append((st.rank, e))
    if not _secondary(w, e):
        w.abort(st.rank, e)


def _start_thread(
    w: World,
    st: RankState,
    fn: Callable[[Comm], T],
    session: _c10d.RankSession | None,
    failures: list[tuple[int, BaseException]],
    threads: list[threading.Thread],
    rank_locals: RankLocals | None,
    endings: _Endings | None,
) -> asyncio.Future[T]:
    """Run a sync rank in its own thread; the returned future completes when it ends
    (ranks taking turns: when they all have)."""
    fut: asyncio.Future[T] = w.loop.create_future()
    turns = w.turns

    def settle(ok: bool, value: Any) -> None:
        if ok:
            st.phase = Phase.RETURNED
        else:
            _failed(w, st, value, failures)

    def done(ok: bool, value: Any) -> None:
        if turns is None:
            settle(ok, value)
        if ok:
            fut.set_result(value)
        else:
            fut.set_exception(value)

    def main() -> None:
        rank_var().set(st)
        ok, value = False, cast(Any, None)
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
                        f"spawn: {getattr(fn, '__qualname__', fn)!r} is a plain function but returned a coroutine "
                        f"on rank {st.rank}; "
                        "pass an async def (or functools.partial of one) to run async ranks"
                    )
            finally:
                if session is not None:
                    session.finish()
                # now, in its turn, not as the thread exits (where two exiting rank threads can deadlock in torch)
                _torch.drop_thread_caches()
        except BaseException as e:
            ok, value = False, e
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

    # daemon: a rank stuck in user code must not keep the interpreter alive after ^C
    thread = threading.Thread(target=main, name=f"aiocoll rank {st.rank}", daemon=True)
    threads.append(thread)
    thread.start()
    return fut


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
        self._outcomes: list[tuple[Callable[[bool, Any], None], bool, Any]] = []

    def ended(self, done: Callable[[bool, Any], None], ok: bool, value: Any) -> None:
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


def _secondary(w: World, e: BaseException) -> bool:
    """Whether ``e`` only reports another failure: an abort, or the cancellation it caused.

    A rank's own error raised while handling a cancellation (e.g. TimeoutError from
    ``asyncio.timeout``) is its own: only the top-level exception counts as a cancel.
    """
    if isinstance(e, asyncio.CancelledError):
        return w.aborted is not None
    return echoes_abort(e)


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


def _report(w: World, failures: list[tuple[int, BaseException]]) -> BaseException:
    """The exception ``spawn`` raises: the first root cause, annotated with its rank.

    The notes say which rank raised it, which others failed on their own, which were
    only aborted, and (with the flight recorder on) what every rank called last.
    """
    roots = [(r, e) for r, e in failures if not _secondary(w, e)]
    aborted = sorted(r for r, e in failures if _secondary(w, e))
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
            return failures[0][1]
        exc = cause
    if aborted:
        notes.append(f"aiocoll: ranks {aborted} were aborted because of it")
    if w.recorder is not None:
        notes.append(w.recorder.report())
    for n in notes:
        exc.add_note(n)
    return exc


def _check(
    fn: object, world: object, timeout: object, record: object = 0, seed: object = None, sync_ranks: object = "turns"
) -> None:
    if sync_ranks not in ("turns", "parallel"):
        raise InvalidArgumentError(f"spawn: argument 'sync_ranks' must be 'turns' or 'parallel', got {sync_ranks!r}")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise InvalidArgumentError(f"spawn: argument 'schedule_seed' must be an int or None, got {seed!r}")
    if not isinstance(record, int) or isinstance(record, bool) or record < 0:
        raise InvalidArgumentError(f"spawn: argument 'record' must be an int >= 0 (0: off), got {record!r}")
    if not callable(fn):
        raise InvalidArgumentError(f"spawn: argument 'fn' must be callable, got {type(fn).__name__}")
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise InvalidArgumentError(f"spawn: argument 'world' must be a positive int, got {world!r}")
    if timeout is not None and (not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout > 0):
        raise InvalidArgumentError(
            f"spawn: argument 'timeout' must be a positive number of seconds or None, got {timeout!r}"
        )


def _is_async(fn: object) -> bool:
    # also async callable objects, whose __call__ is the coroutine function
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


def _loop_factory(choice: LoopChoice) -> Callable[[], asyncio.AbstractEventLoop]:
    if callable(choice):
        return choice
    if choice == "asyncio":
        return asyncio.new_event_loop
    if choice in ("auto", "uvloop"):
        try:
            import uvloop
        except ImportError:
            if choice == "uvloop":
                raise InvalidArgumentError(
                    "spawn: loop='uvloop' but uvloop is not installed (pip install 'aiocoll[uvloop]')"
                ) from None
            return asyncio.new_event_loop
        return uvloop.new_event_loop
    raise InvalidArgumentError(
        f"spawn: argument 'loop' must be 'auto', 'asyncio', 'uvloop' or a loop factory, got {choice!r}"
    )


@dataclass(frozen=True)
class SeedFailure:
    """The first seed under which ``find_failing_seed`` saw the function fail, and how.

    Replay it with the same seed::

        found = aiocoll.find_failing_seed(worker, world=4)
        if found is not None:
            print(found.seed, found.error)
            aiocoll.spawn(worker, world=4, schedule_seed=found.seed)  # fails the same way
    """

    seed: int
    error: BaseException


def find_failing_seed(
    fn: Callable[[Comm], Any], world: int, seeds: Iterable[int] = range(100), **spawn_kwargs: Any
) -> SeedFailure | None:
    """Run ``spawn(fn, world, schedule_seed=s)`` for each seed; the first that fails, or None.

    An order-dependent bug (an any-source ``recv`` assumed to come from one rank, a race
    on shared Python state) shows under some schedules only; the seed replays it::

        found = aiocoll.find_failing_seed(worker, world=4, seeds=range(200))
        if found:
            aiocoll.spawn(worker, world=4, schedule_seed=found.seed)   # the same failure

    >>> import torch, aiocoll
    >>> async def racy(comm):                 # assumes rank 1's message comes first
    ...     if comm.rank == 0:
    ...         t = torch.zeros(1)
    ...         assert await comm.recv(t) == 1, "rank 2 came first"
    ...         await comm.recv(t)
    ...     else:
    ...         await comm.send(torch.ones(1), dst=0)
    >>> found = aiocoll.find_failing_seed(racy, world=3, seeds=range(50))
    >>> found is not None and isinstance(found.error, AssertionError)
    True
    """
    for seed in seeds:
        try:
            spawn(fn, world, schedule_seed=seed, **spawn_kwargs)
        except Exception as e:
            return SeedFailure(seed, e)
    return None
