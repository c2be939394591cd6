"""A world of sync ranks that stands for processes: the one ``aiocoll run``, ``mp.spawn`` and the harness share.

``InProcessWorld`` runs ``rank_main(rank)`` on each rank of a world of sync ranks
(threads taking turns, each with its own random generators, c10d state and
``os.environ``), on a loop of its own on a helper thread (``_worldthread``), so that the
caller's thread can give up on ranks that never end. A rank's "process" ends when its
``rank_main`` does: its exit handlers run then (``_procstate``).

Inside a rank, ``init_process_group`` with a real backend's name and any init method
makes an aiocoll group on the world's own store (``group_backend`` and ``rendezvous``,
which ``STEERED_INIT`` steers to); a rank that needs a process of
its own (``os._exit``, a default group of other ranks) raises ``NeedsProcess``, and the
world's end (``WorldEnd``) says so. ``pause`` and ``from_rank_code`` are what a rank's
waits and its tracebacks look like, as a process's would.

Its users: ``aiocoll run`` (``_run``), ``torch.multiprocessing.spawn`` inside it
(``_mpspawn``), and torch's ``MultiProcessTestCase`` and ``MultiProcContinuousTest`` in
one process (``_harness``, ``_continuous``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import sys
import threading
import time
import traceback
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch.distributed as dist

from .. import _current, _patches, _torch, _watchdog
from .._c10d import _backend as _c10d
from .._c10d import _belongings
from .._c10d._backend import BACKEND
from .._comm import Comm
from .._engine._rank import current_rank_state
from .._engine._world import World
from .._errors import WorldAbortedError
from .._paths import PACKAGE_DIR
from .._process import _procstate
from .._process._locals import Seeds
from .._stats import RankStatistics
from .._watchdog import under_deadline
from ._config import WorldConfig, WorldOptions
from ._driver import WorldRun
from ._outcome import echoes_abort
from ._worldthread import WorldThread

if TYPE_CHECKING:
    from .._torch import Store

__all__ = [
    "GRACE",
    "InProcessWorld",
    "RankPlace",
    "WorldEnd",
    "from_rank_code",
    "group_backend",
    "pause",
    "rendezvous",
]

# ranks still running this long after the world was cancelled are given up on
GRACE = 5.0
_THREADING = threading.__file__
# where the frames that start a rank come from: aiocoll's, asyncio's, the thread's, uvloop's
_STARTERS = (PACKAGE_DIR, os.path.dirname(asyncio.__file__) + os.sep, _THREADING, "uvloop")
# a pausing rank looks this often whether its world was aborted
PAUSE_SLICE = 0.05
# backends whose groups become aiocoll groups in a rank of the world (any device's, in "cpu:gloo,cuda:nccl")
MAPPED_BACKENDS = frozenset({"gloo", "nccl", "ncclx", "xccl", "hccl", "mpi", "ucc", "undefined"})


# -- the world ----------------------------------------------------------------------------------


# the world whose rank the calling thread runs, and that rank (not carried: a thread the rank
# starts is not the rank's own, and counts no barriers of its own)
_HERE: _current.Facet[tuple[InProcessWorld, int] | None] = _current.Facet("harness world", None, carried=False)
# a process forked from a rank's thread is in no world (see _procstate._in_forked_child)
os.register_at_fork(after_in_child=lambda: _HERE.set(None))


def _suite_barrier(real: Callable[[int | None, float], None], wait_for: int | None, timeout: float) -> None:
    """torch's suite's ``Barrier.sync`` in a rank of the world: each rank counts its own barriers, as a process would.

    A rank's count goes up by one at each barrier; it waits (letting the others run)
    until exactly ``wait_for`` ranks (all, by default) have counted as far, or raises
    torch's ``RuntimeError("barrier timeout")`` after ``timeout`` seconds, as torch's does.
    """
    here = _HERE.get()
    if here is None:
        real(wait_for, timeout)
        return
    world, rank = here
    counts = world.barriers
    counts[rank] = mine = counts.get(rank, 0) + 1
    wanted = dist.get_world_size() if wait_for is None else wait_for
    start = time.monotonic()
    while sum(n >= mine for n in counts.values()) != wanted:
        if time.monotonic() - start > timeout:
            raise RuntimeError("barrier timeout")
        pause(0.005)


# what every world changes in the process while it runs (leased by its start, released at its end):
# what a rank has of a process (RANK_PROCESSES, which this set needs), and the suite's Barrier with
# it, as the world counts the barriers (a suite that is not loaded is left alone)
SUITE_BARRIER = _patches.PatchSet(
    "torch's suite barrier",
    "each harness rank counts the barriers of torch's own multi-process suite (distributed_test.py) as its "
    "process would (nothing where that suite is not loaded)",
    lambda key: [_patches.Attr(o, n, v) for o, n, v in _torch.process_harness.suite_barrier(_suite_barrier)],
    ["*Barrier.sync"],  # (torch.testing._internal.distributed.distributed_test.Barrier)
    needs=(_procstate.RANK_PROCESSES,),
)


@dataclass(frozen=True)
class RankPlace:
    """Where a running rank is: its stack from its own code in (innermost last), and what it does."""

    rank: int
    stack: traceback.StackSummary | list[traceback.FrameSummary]
    state: str  # "running", "waiting in all_reduce", ...

    def in_code(self, files: Callable[[str], bool]) -> traceback.FrameSummary | None:
        """The innermost frame in a file ``files`` accepts (the user's script), if any."""
        return next((f for f in reversed(self.stack) if files(f.filename)), None)


@dataclass
class WorldEnd:
    """How a world ended (a test's, a run's, an ``mp.spawn`` call's)."""

    error: BaseException | None  # what spawn raised: the first root cause, with aiocoll's notes
    needs_process: _procstate.NeedsProcess | None  # a rank did what only a process can
    elapsed: float
    timed_out: bool = False  # the test ran past its deadline and was cancelled
    busy: dict[int, str] = field(default_factory=dict)  # at the deadline: ranks busy outside aiocoll, where
    left_running: list[int] = field(default_factory=list)  # ranks still running after GRACE: left behind
    deadline: float = 0.0  # the seconds it was given

    def timeout_error(self, test_id: str, deadline: float, message: str) -> RuntimeError:
        """``message`` (torch's words for a timeout), with where the ranks were."""
        err = RuntimeError(message)
        err.add_note(f"aiocoll: {test_id} ran past its timeout of {deadline:g} s and was cancelled")
        for rank, stack in sorted(self.busy.items()):
            err.add_note(f"aiocoll: rank {rank} was running, at:\n{stack.rstrip()}")
        if self.left_running:
            err.add_note(
                f"aiocoll: ranks {self.left_running} were still running {GRACE:g} s later; threads cannot be "
                "stopped, so they were left running"
            )
        return err


class InProcessWorld:
    """Runs ``rank_main(rank)`` on ``size`` sync ranks, on a helper thread that the caller's thread can give up on.

    ``run(rank_main)`` runs a world to its end, bounded by ``deadline`` seconds; a world
    that outlives one test (continuous tests) is driven by ``start``, ``wait`` and ``end``.
    ``options``: more of the world's configuration (``aiocoll run``'s ``--trace``, ...);
    ``grace``: seconds ranks get to wind down once cancelled, before they are left behind
    (None: ``GRACE``, as it is when the world is made). ``seeds``: where each rank's
    generators start, as a fresh process's are seeded anew (None: from the system's
    entropy; ``aiocoll run --seed`` gives its own).
    """

    def __init__(
        self,
        size: int,
        collective_timeout: float | None,
        deadline: float,
        name: str = "a test",
        *,
        options: WorldOptions | None = None,
        grace: float | None = None,
        seeds: Seeds | None = None,
    ) -> None:
        self.size = size
        self.seeds = Seeds.fresh() if seeds is None else seeds
        self.collective_timeout = collective_timeout
        self.deadline = deadline
        self.name = name  # the test's id, in the watchdog's report
        self.store: Store = dist.HashStore()  # type: ignore[attr-defined]  # rendezvous of init_method=...
        self._needs: _procstate.NeedsProcess | None = None
        self._engine: World | None = None  # the aiocoll World, once a rank runs
        self._wt: WorldThread[None] | None = None
        self._environ: dict[str, str] = {}
        self._started = 0.0
        self._entered = False  # the process-wide patches are in force for this world
        self._raised: list[BaseException] = []  # what the ranks raised, kept by the reports
        self.initialised: set[int] = set()  # the ranks that initialised torch.distributed (through ``rendezvous``)
        self.barriers: dict[int, int] = {}  # each rank's count of torch's suite's barriers (``_suite_barrier``)
        self._options: WorldOptions = {} if options is None else options.copy()
        self._grace = GRACE if grace is None else grace
        self.interrupted_at: dict[int, RankPlace] = {}  # where each rank was when the wait was interrupted

    def run(self, rank_main: Callable[[int], None], until: threading.Event | None = None) -> WorldEnd:
        """Run the world to its end; past ``deadline`` it is cancelled, and what does not end is left behind.

        ``until``: once it is set, the world is cancelled too (a nested world's rank needs a
        process: the run starts again in processes). A rank stuck holding the GIL stops
        this thread too: then the watchdog ends the process, with every thread's stack
        (``_watchdog``).
        """
        limit = self.deadline + GRACE + _watchdog.MARGIN
        # the world's engine dies by the scope's collection, a few ms, once it is let go
        with _belongings.world_scope(collect=True):
            try:
                return under_deadline(limit, self.name, lambda: self._run(rank_main, until))
            finally:
                if self.ended:
                    self._engine = None  # (its statistics were read by then: a report's)

    def _run(self, rank_main: Callable[[int], None], until: threading.Event | None) -> WorldEnd:
        self.start(rank_main)
        try:
            finished = self.wait(self.deadline, until)
        except BaseException:  # ^C: take the ranks down, as far as threads can be
            with contextlib.suppress(Exception):  # (a report's detail: never in the way of ending)
                self.interrupted_at = self.places()
            self.end()
            raise
        return self.end(timed_out=not finished)

    def start(self, rank_main: Callable[[int], None]) -> None:
        self._environ = _procstate.snapshot_environ()
        self._started = time.monotonic()
        self._wt = WorldThread(lambda: self._world(rank_main, self._environ), "auto")
        _patches.acquire(SUITE_BARRIER)
        self._entered = True
        self._wt.start()

    def wait(self, seconds: float | None, until: threading.Event | None = None) -> bool:
        """Wait up to ``seconds`` for the world's end (or for ``until``); whether either came."""
        assert self._wt is not None
        if until is None:
            return self._wt.wait(seconds)
        deadline = None if seconds is None else time.monotonic() + seconds
        while not until.is_set():
            if self._wt.wait(0.005):
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False
        return True

    @property
    def ended(self) -> bool:
        return self._wt is not None and self._wt.wait(0)

    def end(self, timed_out: bool = False, *, grace: float | None = None) -> WorldEnd:
        """How the world ended; one still running is cancelled first (``timed_out``: its deadline passed).

        ``grace``: seconds its ranks then get to wind down, for this end only (None: the
        world's own); an interrupted run gives them less.
        """
        wt = self._wt
        assert wt is not None
        elapsed = time.monotonic() - self._started
        busy: dict[int, str] = {}
        left: list[int] = []
        try:
            if not wt.wait(0):
                if timed_out:
                    busy = self._busy(wt)  # before cancelling: where they were when time ran out
                wt.cancel()
                if not wt.wait(self._grace if grace is None else grace):
                    left = sorted(wt.rank_frames())
        finally:
            if self._entered:  # (end() may be called again: after a ^C, say)
                self._entered = False
                _patches.release(SUITE_BARRIER)
                _procstate.restore_environ(self._environ)
        if wt.wait(0):
            self._release(wt.error)
        return WorldEnd(wt.error, self._needs, elapsed, timed_out, busy, left, self.deadline)

    def _release(self, error: BaseException | None) -> None:
        """Free what the ranks made, now, before the next test or a fallback to processes runs.

        The exceptions the ranks raised are kept for the reports, and their tracebacks
        keep the ranks' frames, with every store, group and mesh in their locals: the
        frames' locals are dropped (a process sends its parent the traceback's text
        only), then the world's belongings are released (``_belongings``). Otherwise a
        ``FileStore`` of this test would be destroyed by whichever thread next collects
        garbage, and blocks for ever, holding the GIL, if its file has changed since.
        """
        raised, self._raised = self._raised, []
        for e in [error, self._needs, *raised]:
            if e is not None:
                _forget_locals(e)
        if self._engine is not None:
            _c10d.release(self._engine)

    async def _world(self, rank_main: Callable[[int], None], environ: dict[str, str]) -> None:
        def rank_fn(comm: Comm) -> None:
            self._engine = getattr(comm, "_world", None)
            _HERE.set((self, comm.rank))
            _procstate.bind(comm.rank, _procstate.RankEnviron(environ), pause, _stepped_out)
            try:
                rank_main(comm.rank)
            except BaseException as e:
                if isinstance(e, _procstate.NeedsProcess):
                    self._needs = self._needs or e
                elif self.initialised and comm.rank not in self.initialised and _own_failure(e):
                    e.add_note(_shared_init(comm.rank, sorted(self.initialised)))
                self._raised.append(e)  # (the world keeps each rank's error: RankState.error)
                raise
            finally:
                try:
                    if self._needs is None:  # (a test that goes to processes runs its handlers there)
                        _procstate.run_exit_handlers()  # the rank's "process" ends
                finally:
                    _procstate.unbind()
                    _HERE.set(None)

        config = WorldConfig.of(self.size, {**self._options, "timeout": self.collective_timeout}, caller=self.name)
        seeded = dataclasses.replace(config, c10d="state", rank_seeds=self.seeds.of(self.size))
        await WorldRun(rank_fn, seeded).run()

    def places(self) -> dict[int, RankPlace]:
        """Where each rank still running is now: its stack from its own code in, and its state."""
        assert self._wt is not None
        stacks = {r: _outside_aiocoll(traceback.extract_stack(f)) for r, f in self._wt.rank_frames().items()}
        stats = self._rank_statistics()
        out = {}
        for r, stack in sorted(stacks.items()):
            st = stats.get(r)
            state: str = "running" if st is None else st.state
            if st is not None and st.state == "blocked" and st.waiting:
                state = f"waiting in {', '.join(st.waiting)}"
            out[r] = RankPlace(r, stack, state)
        return out

    def _rank_statistics(self) -> dict[int, RankStatistics]:
        """Each rank's state now, by rank; none before a rank ran."""
        if self._engine is None:
            return {}
        try:
            return {r.rank: r for r in self._engine.statistics().ranks}
        except Exception:  # (a snapshot taken from outside the world, while it runs: best effort)
            return {}

    def _busy(self, wt: WorldThread[None]) -> dict[int, str]:
        """Where each rank that is not waiting in a collective (nor ended) is, as a formatted stack."""
        stacks = {r: traceback.extract_stack(f) for r, f in wt.rank_frames().items()}
        states = {r: st.state for r, st in self._rank_statistics().items()}
        busy = {r: st for r, st in stacks.items() if states.get(r, "running") == "running"}
        return {r: "".join(traceback.format_list(_outside_aiocoll(st))) for r, st in (busy or stacks).items()}

    def __repr__(self) -> str:
        state = "not started" if self._wt is None else "ended" if self.ended else "running"
        return f"<InProcessWorld size={self.size} deadline={self.deadline}s {state}>"


_sleep = time.sleep  # the real one: time.sleep is cooperative in the world's ranks


def pause(seconds: float) -> None:
    """In a rank of the world: wait ``seconds``, the other ranks taking their turns meanwhile.

    Once the world is aborted (a rank failed, the test ran out of time), the rank
    learns of it here too, as a process would be stopped: ``WorldAbortedError``.
    """
    st = current_rank_state()
    if st is None:
        _sleep(seconds)
        return
    end = time.monotonic() + max(seconds, 0.0)
    while True:
        _raise_if_aborted(st.world)
        left = end - time.monotonic()
        step = min(max(left, 0.0), PAUSE_SLICE)
        turns = st.world.turns
        if turns is None or turns.free:
            _sleep(step)
        else:
            turns.event(st.rank).wait(step)
        if left <= PAUSE_SLICE:
            return


@contextlib.contextmanager
def _stepped_out() -> Iterator[None]:
    """In a rank of the world: the others take turns while the block makes a call that may wait for them in C code."""
    st = current_rank_state()
    turns = None if st is None else st.world.turns
    if st is None or turns is None:
        yield
        return
    with turns.stepped_out(st.rank):
        yield


def _forget_locals(error: BaseException) -> None:
    """Drop the locals of every finished frame in ``error``'s tracebacks (its causes and group members too)."""
    seen: set[int] = set()
    todo = [error]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)  # (skips frames still running)
        todo += [x for x in (e.__cause__, e.__context__) if x is not None]
        if isinstance(e, BaseExceptionGroup):
            todo += e.exceptions


def _raise_if_aborted(world: World) -> None:
    aborted = world.aborted
    if aborted is not None:
        err = WorldAbortedError(str(aborted), rank=aborted.rank)
        err.__cause__ = aborted.__cause__
        raise err


def from_rank_code(tb: types.TracebackType | None) -> types.TracebackType | None:
    """``tb`` from the rank's own code in, as its process's traceback would start (None: no such frame)."""
    while tb is not None and tb.tb_frame.f_code.co_filename.startswith(_STARTERS):
        tb = tb.tb_next
    return tb


def _outside_aiocoll(stack: list[traceback.FrameSummary]) -> list[traceback.FrameSummary]:
    """``stack`` from the rank's own code in: without the thread's and aiocoll's frames around it.

    The outermost frames start the rank; the innermost, where a rank that sleeps waits
    for its turn.
    """
    start, end = 0, len(stack)
    while start < end - 1 and stack[start].filename.startswith((PACKAGE_DIR, _THREADING)):
        start += 1
    while end > start + 1 and stack[end - 1].filename.startswith(PACKAGE_DIR):
        end -= 1
    return stack[start:end]


# -- torch.distributed inside a rank of the world ----------------------------------------------


def _maps(backend: object) -> bool:
    """Whether ``backend`` ("gloo", "cpu:gloo,cuda:nccl", ...) is one a rank of the world runs on aiocoll."""
    names = [part.split(":")[-1].strip().lower() for part in str(backend).split(",")]
    return bool(names) and all(n in MAPPED_BACKENDS for n in names)


def group_backend(backend: object, group_rank: int, ranks: list[int]) -> str | None:
    """For ``STEERED_INIT``: aiocoll for the real backends, in the world's ranks."""
    world, here = _HERE.get() or (None, -1)
    if world is not None and str(backend).lower() == BACKEND:
        # only code that lists the registered backends asks for aiocoll's by name here;
        # in a process of its own (torch's harness), aiocoll's backend is not among them
        raise _procstate.NeedsProcess(here, f"asked for aiocoll's own backend {BACKEND!r} by name")
    if world is None or not _maps(backend):
        return None
    if not ranks and group_rank != here:  # the default group
        raise _procstate.NeedsProcess(
            here, f"initialised torch.distributed as rank {group_rank}: its ranks form worlds of their own"
        )
    return BACKEND


def rendezvous(url: str, rank: int, world_size: int) -> tuple[Store, int, int] | None:
    """For ``STEERED_INIT``: the world's own store, in its ranks."""
    world, here = _HERE.get() or (None, -1)
    if world is None:
        return None
    query = dict(p.split("=", 1) for p in url.partition("?")[2].split("&") if "=" in p)
    if rank == -1:
        rank = int(query.get("rank", _environ_int("RANK", url)))
    if world_size == -1:
        world_size = int(query.get("world_size", _environ_int("WORLD_SIZE", url)))
    if rank != here or not 0 < world_size <= world.size:
        raise _procstate.NeedsProcess(
            here,
            f"initialised torch.distributed as rank {rank} of {world_size}: its ranks form worlds of their own",
        )
    world.initialised.add(rank)
    return world.store, rank, world_size


STEERED_INIT = _patches.PatchSet(
    "steered c10d init",
    "in a rank that stands for a process (the process harness, aiocoll run, mp.spawn in it), the groups "
    "c10d makes for gloo, nccl... are aiocoll's, and init_method's rendezvous is the world's own store",
    lambda key: _torch.process_harness.init_changes(group_backend, rendezvous),
    _torch.process_harness.INIT_TARGETS,
)


def _own_failure(e: BaseException) -> bool:
    """Whether ``e`` is a rank's own error (not an exit, a skip, or its release by another rank's failure)."""
    return isinstance(e, Exception) and not _skip(e) and not echoes_abort(e)


def _skip(e: BaseException) -> bool:
    """Whether ``e`` is a test's skip (``unittest.SkipTest``).

    Looked up, not imported: this world is not only the test harness's, and no SkipTest
    can have been raised where ``unittest`` was never imported.
    """
    unittest = sys.modules.get("unittest")
    return unittest is not None and isinstance(e, unittest.SkipTest)


def _shared_init(rank: int, initialised: list[int]) -> str:
    """What a rank that failed without initialising torch.distributed, while others did, may have met."""
    return (
        f"aiocoll: rank {rank} never initialised torch.distributed, while ranks {initialised} did. If its code "
        "calls init_process_group before it failed, state that a library keeps once per process (a singleton, "
        "or a module's global) served every rank: the ranks share one "
        "process, and one rank's init_process_group stood for theirs. Run such code in processes of its own "
        "(torchrun)"
    )


def _environ_int(name: str, url: str) -> int:
    if url.startswith("env://") and name in os.environ:
        return int(os.environ[name])
    raise ValueError(f"Error initializing torch.distributed using {url}: {name} is not given")
