"""torch's multi-process test harness, in one process: each test's ranks as aiocoll sync ranks.

``aiocoll.testing.replace_process_harness()`` routes ``MultiProcessTestCase`` here, and
``MultiProcContinuousTest`` to ``_continuous``, which builds on this. A test's ranks run
as a world of sync ranks (threads taking turns, each with its own random generators,
c10d state and ``os.environ``), on a loop of their own on a helper thread, so that the
test's thread can give up on ranks that never end. Each rank runs torch's own
per-process code (``cls._run`` or ``cls._worker_loop``) on an object of a class of its
own (``rank_class``), as a process would: what one rank sets on its class, the others
do not see.

What a rank would have been as a process is handed back in torch's terms (exit codes,
the tracebacks sent down the pipes, the results in the completion queues), so that
torch's own code decides what passed, failed or was skipped, and aiocoll's report
(which rank raised first, who was aborted because of it, the flight recorder) is
added to the failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import multiprocessing
import os
import signal
import threading
import time
import traceback
import types
import unittest
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch.distributed as dist

from . import _belongings, _c10d, _patches, _procstate, _torch, _watchdog
from ._c10d import BACKEND
from ._comm import Comm
from ._config import WorldConfig, WorldOptions
from ._driver import WorldRun
from ._engine import World, current_rank_state
from ._errors import RankExitedError, WorldAbortedError
from ._grouptimeouts import slowdown
from ._outcome import echoes_abort
from ._paths import PACKAGE_DIR
from ._stats import RankStatistics
from ._watchdog import under_deadline
from ._worldthread import WorldThread

__all__ = [
    "FakeProcess",
    "Fallback",
    "InProcessWorld",
    "Mailbox",
    "RankEnd",
    "Settings",
    "WorldEnd",
    "exit_code",
    "group_backend",
    "pause",
    "rank_class",
    "rendezvous",
    "report_process_ranks",
    "run_process_ranks",
]

# a rank terminated by torch's harness once another failed (-SIGTERM, as multiprocessing reports it)
TERMINATED = -int(signal.SIGTERM)
# ranks still running this long after the world was cancelled are given up on
GRACE = 5.0
_THREADING = threading.__file__
# where the frames that start a rank come from: aiocoll's, asyncio's, the thread's, uvloop's
_STARTERS = (PACKAGE_DIR, os.path.dirname(asyncio.__file__) + os.sep, _THREADING, "uvloop")
# a pausing rank looks this often whether its world was aborted
PAUSE_SLICE = 0.05
# backends whose groups become aiocoll groups in a harness rank (any device's, in "cpu:gloo,cuda:nccl")
MAPPED_BACKENDS = frozenset({"gloo", "nccl", "ncclx", "xccl", "hccl", "mpi", "ucc", "undefined"})
_log = logging.getLogger("aiocoll.testing")  # (the logger of the public module: where users look)


Fallback = Literal["processes", "skip"]


@dataclass(frozen=True)
class Settings:
    """How in-process tests run: set by ``replace_process_harness``."""

    timeout: float | None  # one wait in one collective; None: half the test's own timeout
    fallback: Fallback  # what becomes of tests that need processes of their own

    def collective_timeout(self, test_timeout: float) -> float:
        return self.timeout if self.timeout is not None else test_timeout / 2

    @staticmethod
    def deadline(test_timeout: float, size: int) -> float:
        """How long a test's ranks may run in-process: torch's timeout, in the CPU time its processes had.

        torch gives a test's W processes ``test_timeout`` seconds on the machine's cores;
        ranks taking turns use one core. A hang is no longer what this bound is for (a
        deadlock is reported at once, each wait in a collective has its own timeout):
        only a rank that never stops computing runs into it.
        """
        return test_timeout * slowdown(size)


def rank_class(cls: type) -> Any:
    """A subclass of ``cls`` for one rank, which passes for ``cls`` (same name, module, test ids).

    In processes, a rank that sets a class attribute (``MultiProcContinuousTest`` sets
    ``cls.rank`` and ``cls.pg``) sets its own copy; here each rank sets its subclass's.
    """
    return types.new_class(
        cls.__name__,
        (cls,),
        exec_body=lambda ns: ns.update(__module__=cls.__module__, __qualname__=cls.__qualname__, __doc__=cls.__doc__),
    )


# -- what torch's harness sees of a rank: a process, its pipe ------------------------------


class FakeProcess:
    """A rank as torch's harness sees its process: a name, a pid, an exit code (None: still running)."""

    def __init__(self, rank: int, exitcode: int | None) -> None:
        self.name = f"process {rank}"
        self.pid = f"aiocoll rank {rank}"  # a key of pid_to_pipe, and shown in torch's messages
        self.exitcode = exitcode

    def is_alive(self) -> bool:
        return self.exitcode is None

    def terminate(self) -> None:
        """Nothing to stop: the rank's thread has ended (or cannot be stopped)."""

    def kill(self) -> None:
        """As ``terminate``."""

    def join(self, timeout: float | None = None) -> None:
        """The rank has ended already."""

    def __repr__(self) -> str:
        return f"<FakeProcess {self.name} exitcode={self.exitcode}>"


class Mailbox:
    """The parent's end of a rank's pipe, as torch's harness reads it: what the rank sent."""

    def __init__(self, messages: Sequence[Any]) -> None:
        self._messages = list(messages)
        self.closed = False

    def recv(self) -> Any:
        if not self._messages:  # (a process's closed pipe would raise EOFError)
            return "(the rank sent nothing: its code exited with this code itself)\n"
        return self._messages.pop(0)

    def poll(self, timeout: float | None = 0.0) -> bool:
        return bool(self._messages)

    def send(self, obj: Any) -> None:
        """Requests to the rank (torch asks a hung process for its traceback): answered by aiocoll's report."""

    def close(self) -> None:
        self.closed = True

    def __repr__(self) -> str:
        return f"<Mailbox {len(self._messages)} message(s)>"


@dataclass
class RankEnd:
    """How one rank ended: its exit code as a process's, what it sent, the failure behind a non-zero code."""

    exitcode: int | None = None
    sent: list[Any] = field(default_factory=list)
    error: BaseException | None = None


# -- one test's world -------------------------------------------------------------------------


class _Here(threading.local):
    world: InProcessWorld | None = None
    rank: int = -1


def _suite_barrier(real: Callable[[int | None, float], None], wait_for: int | None, timeout: float) -> None:
    """torch's suite's ``Barrier.sync`` in a harness rank: each rank counts its own barriers, as a process would.

    A rank's count goes up by one at each barrier; it waits (letting the others run)
    until exactly ``wait_for`` ranks (all, by default) have counted as far, or raises
    torch's ``RuntimeError("barrier timeout")`` after ``timeout`` seconds, as torch's does.
    """
    world, rank = _here.world, _here.rank
    if world is None:
        real(wait_for, timeout)
        return
    counts = world.barriers
    counts[rank] = mine = counts.get(rank, 0) + 1
    wanted = dist.get_world_size() if wait_for is None else wait_for
    start = time.monotonic()
    while sum(n >= mine for n in counts.values()) != wanted:
        if time.monotonic() - start > timeout:
            raise RuntimeError("barrier timeout")
        pause(0.005)


_here = _Here()
SUITE_BARRIER = _patches.PatchSet(
    "torch's suite barrier",
    "each harness rank counts the barriers of torch's own multi-process suite (distributed_test.py) as its "
    "process would (nothing where that suite is not loaded)",
    lambda key: [_patches.Attr(o, n, v) for o, n, v in _torch.process_harness.suite_barrier(_suite_barrier)],
    ["*Barrier.sync"],  # (torch.testing._internal.distributed.distributed_test.Barrier)
)
_process_state = _procstate.ProcessState(SUITE_BARRIER)


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
    """How a test's world ended."""

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
    """Runs ``rank_main(rank)`` on ``size`` sync ranks, on a helper thread that the test's thread can give up on.

    ``run(rank_main)`` runs a world to its end, bounded by ``deadline`` seconds; a world
    that outlives one test (continuous tests) is driven by ``start``, ``wait`` and ``end``.
    """

    def __init__(self, size: int, collective_timeout: float | None, deadline: float, name: str = "a test") -> None:
        self.size = size
        self.collective_timeout = collective_timeout
        self.deadline = deadline
        self.name = name  # the test's id, in the watchdog's report
        self.store: Any = dist.HashStore()  # type: ignore[attr-defined]  # rendezvous of init_method=...
        self._needs: _procstate.NeedsProcess | None = None
        self._engine: World | None = None  # the aiocoll World, once a rank runs
        self._wt: WorldThread[Any] | None = None
        self._environ: dict[str, str] = {}
        self._started = 0.0
        self._entered = False  # the process-wide patches are in force for this world
        self._raised: list[BaseException] = []  # what the ranks raised, kept by the reports
        self.initialised: set[int] = set()  # the ranks that initialised torch.distributed (through ``rendezvous``)
        self.barriers: dict[int, int] = {}  # each rank's count of torch's suite's barriers (``_suite_barrier``)
        self.options: WorldOptions = {}  # more of the world's configuration (aiocoll run's --trace, ...)
        self.grace = GRACE  # seconds ranks get to wind down once cancelled, before they are left behind
        self.interrupted_at: dict[int, RankPlace] = {}  # where each rank was when the wait was interrupted

    def run(self, rank_main: Callable[[int], None]) -> WorldEnd:
        """Run the world to its end; past ``deadline`` it is cancelled, and what does not end is left behind.

        A rank stuck holding the GIL stops this thread too: then the watchdog ends the
        process, with every thread's stack (``_watchdog``).
        """
        limit = self.deadline + GRACE + _watchdog.MARGIN
        # the world's engine dies by the scope's collection, a few ms, once it is let go
        with _belongings.world_scope(collect=True):
            try:
                return under_deadline(limit, self.name, lambda: self._run(rank_main))
            finally:
                if self.ended:
                    self._engine = None  # (its statistics were read by then: a report's)

    def _run(self, rank_main: Callable[[int], None]) -> WorldEnd:
        self.start(rank_main)
        try:
            finished = self.wait(self.deadline)
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
        _process_state.enter()
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

    def end(self, timed_out: bool = False) -> WorldEnd:
        """How the world ended; one still running is cancelled first (``timed_out``: its deadline passed)."""
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
                if not wt.wait(self.grace):
                    left = sorted(wt.rank_frames())
        finally:
            if self._entered:  # (end() may be called again: after a ^C, say)
                self._entered = False
                _process_state.exit()
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
            _here.world, _here.rank = self, comm.rank
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
                    _here.world = None

        config = WorldConfig.of(self.size, {**self.options, "timeout": self.collective_timeout}, caller=self.name)
        await WorldRun(rank_fn, dataclasses.replace(config, c10d="state")).run()

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

    def _busy(self, wt: WorldThread[Any]) -> dict[int, str]:
        """Where each rank that is not waiting in a collective (nor ended) is, as a formatted stack."""
        stacks = {r: traceback.extract_stack(f) for r, f in wt.rank_frames().items()}
        states = {r: st.state for r, st in self._rank_statistics().items()}
        busy = {r: st for r, st in stacks.items() if states.get(r, "running") == "running"}
        return {r: "".join(traceback.format_list(_outside_aiocoll(st))) for r, st in (busy or stacks).items()}

    def __repr__(self) -> str:
        state = "not started" if self._wt is None else "ended" if self.ended else "running"
        return f"<InProcessWorld size={self.size} deadline={self.deadline}s {state}>"


_sleep = time.sleep  # the real one: time.sleep is cooperative in harness ranks


def pause(seconds: float) -> None:
    """In a harness rank: wait ``seconds``, the other ranks taking their turns meanwhile.

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
    """In a harness rank: the other ranks take turns while the block makes a call that may wait for them in C code."""
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


# -- torch.distributed inside a harness rank ----------------------------------------------------


def _maps(backend: Any) -> bool:
    """Whether ``backend`` ("gloo", "cpu:gloo,cuda:nccl", ...) is one a harness rank runs on aiocoll."""
    names = [part.split(":")[-1].strip().lower() for part in str(backend).split(",")]
    return bool(names) and all(n in MAPPED_BACKENDS for n in names)


def group_backend(backend: Any, group_rank: int, ranks: list[int]) -> str | None:
    """For ``_torch.process_harness.patched_init``: aiocoll for the real backends, in harness ranks."""
    world = _here.world
    if world is not None and str(backend).lower() == BACKEND:
        # only code that lists the registered backends asks for aiocoll's by name here;
        # in a process of its own (torch's harness), aiocoll's backend is not among them
        raise _procstate.NeedsProcess(_here.rank, f"asked for aiocoll's own backend {BACKEND!r} by name")
    if world is None or not _maps(backend):
        return None
    if not ranks and group_rank != _here.rank:  # the default group
        raise _procstate.NeedsProcess(
            _here.rank, f"initialised torch.distributed as rank {group_rank}: its ranks form worlds of their own"
        )
    return BACKEND


def rendezvous(url: str, rank: int, world_size: int) -> tuple[Any, int, int] | None:
    """For ``_torch.process_harness.patched_init``: the world's own store, in harness ranks."""
    world = _here.world
    if world is None:
        return None
    query = dict(p.split("=", 1) for p in url.partition("?")[2].split("&") if "=" in p)
    if rank == -1:
        rank = int(query.get("rank", _environ_int("RANK", url)))
    if world_size == -1:
        world_size = int(query.get("world_size", _environ_int("WORLD_SIZE", url)))
    if rank != _here.rank or not 0 < world_size <= world.size:
        raise _procstate.NeedsProcess(
            _here.rank,
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
    return isinstance(e, Exception) and not isinstance(e, unittest.SkipTest) and not echoes_abort(e)


def _shared_init(rank: int, initialised: list[int]) -> str:
    """What a rank that failed without initialising torch.distributed, while others did, may have met."""
    return (
        f"aiocoll: rank {rank} never initialised torch.distributed, while ranks {initialised} did. If its code "
        "calls init_process_group before it failed, state that a library keeps once per process (a singleton, "
        "such as accelerate's PartialState, or a module's global) served every rank: the ranks share one "
        "process, and one rank's init_process_group stood for theirs. Run such code in processes of its own "
        "(torchrun)"
    )


def _environ_int(name: str, url: str) -> int:
    if url.startswith("env://") and name in os.environ:
        return int(os.environ[name])
    raise ValueError(f"Error initializing torch.distributed using {url}: {name} is not given")


# -- MultiProcessTestCase ------------------------------------------------------------------------


def exit_code(e: SystemExit) -> int:
    """The exit code of a process ended by ``e`` (as multiprocessing reports it)."""
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    return 1


def run_process_ranks(case: Any, settings: Settings) -> tuple[WorldEnd, list[RankEnd]]:
    """Run the ranks of ``case`` (a MultiProcessTestCase in the main process) in-process."""
    error_code = int(case.TEST_ERROR_EXIT_CODE)
    test_name = case._current_test_name()
    cls, file_name, size = type(case), case.file_name, int(case.world_size)
    kwargs = {"fake_pg": getattr(case, "fake_pg", False)}
    ends = [RankEnd() for _ in range(size)]
    skips = _torch.process_harness.skips()

    def rank_main(rank: int) -> None:
        end = ends[rank]
        parent, child = multiprocessing.Pipe()
        failure: BaseException | None = None
        try:
            rank_class(cls)._run(rank, test_name, file_name, child, **kwargs)
            end.exitcode = 0
        except SystemExit as e:
            end.exitcode = exit_code(e)
            if end.exitcode == error_code and e.__context__ is not None:
                failure = end.error = e.__context__  # what run_test caught, reported and exited for
            elif end.exitcode not in (0, *skips):
                # a process that exits with an error closes its sockets: its peers' collectives
                # with it fail at once (gloo's "connection closed"), not at the test's timeout
                failure = end.error = RankExitedError.of(rank, e)
        except _procstate.NeedsProcess:
            raise
        except BaseException as e:  # out of _run itself: a process would print it and exit with 1
            end.exitcode, failure = 1, e
            end.error = e
        finally:
            with contextlib.suppress(OSError, EOFError):  # (EOF: run_test closed its end)
                while parent.poll():
                    end.sent.append(parent.recv())
            parent.close()
            child.close()
        if failure is not None:
            raise failure  # aiocoll's world learns of it now: the others are released at once

    test_timeout = _torch.process_harness.test_timeout(case.id())
    deadline = settings.deadline(test_timeout, size)
    world = InProcessWorld(size, settings.collective_timeout(test_timeout), deadline, case.id())
    return world.run(rank_main), ends


def report_process_ranks(case: Any, fn: Any, end: WorldEnd, ends: list[RankEnd]) -> None:
    """Hand the ranks' ends to torch's ``_check_return_codes``, adding aiocoll's report to a failure."""
    error_code = int(case.TEST_ERROR_EXIT_CODE)
    notes = list(getattr(end.error, "__notes__", []))
    if end.timed_out:
        first = min(end.busy, default=0)
        raise end.timeout_error(
            case.id(), end.deadline, f"Process {first} terminated or timed out after {end.elapsed} seconds"
        )
    processes, pipes = [], {}
    seen: dict[tuple[type, str], int] = {}
    for rank, e in enumerate(ends):
        code, sent = e.exitcode, list(e.sent)
        if e.error is not None and echoes_abort(e.error):
            code, sent = TERMINATED, []  # only released because another rank failed: torch stops those
        elif code == error_code and e.error is not None:
            key = (type(e.error), str(e.error))
            if key in seen:
                sent = [f"(the same {type(e.error).__name__} as process {seen[key]})\n"]
            else:
                seen[key] = rank
        elif code == 1 and e.error is not None:
            notes.append(
                f"aiocoll: process {rank} exited with code 1 on an exception out of {type(case).__name__}._run:\n"
                + "".join(traceback.format_exception(e.error))
            )
        p = FakeProcess(rank, code)
        processes.append(p)
        pipes[p.pid] = Mailbox(sent)
    if end.error is not None and not any(x.error is not None for x in ends):
        raise end.error  # not a rank's: aiocoll's own (a torch it cannot work with, a warning made an error)
    skips = _torch.process_harness.skips()
    for rank, e in enumerate(ends):
        if e.exitcode not in (0, None, error_code, 1):
            # a rank that left early (skipped, sys.exit) while others went on: why they then waited
            why = f" ({skips[e.exitcode]})" if e.exitcode in skips else ""
            notes.append(f"aiocoll: process {rank} exited with code {e.exitcode}{why}")
    case.processes, case.pid_to_pipe = processes, pipes
    try:
        case._check_return_codes(fn, end.elapsed)
    except unittest.SkipTest:
        raise
    except BaseException as failure:
        for n in notes:
            failure.add_note(n)
        raise
