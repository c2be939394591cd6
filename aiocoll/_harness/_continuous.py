"""torch's ``MultiProcContinuousTest`` in one process: a class's tests on one world of sync ranks.

torch keeps W worker processes alive for such a class and hands them test ids through
queues; ``ContinuousRanks`` runs torch's own worker loop on sync ranks of one world
instead (``_procworld.InProcessWorld``), and stands in for the processes and queues the
main process reads.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import tempfile
import threading
import time
import traceback
import unittest
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from .. import _patches, _torch, _watchdog
from .._engine._rank import RankState, current_rank_state
from .._lifecycle._outcome import echoes_abort
from .._lifecycle._procworld import GRACE, InProcessWorld, pause
from .._process import _procstate
from .._watchdog import under_deadline
from ._harness import FakeProcess, Settings, exit_code, rank_class

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess
    from multiprocessing.queues import Queue

    from .._torch import MultiProcContinuousTest

__all__ = ["ContinuousRanks"]

_log = logging.getLogger("aiocoll.testing")  # (the logger of the public module: where users look)


class _Tasks:
    """A worker's task queue in its rank thread: the test ids the main process puts, None at the class's end.

    A rank waiting for its next test lets the others run (``pause``), and learns there
    that its world was aborted, as a process would be stopped. Meanwhile it counts as
    gone for deadlock detection: ranks that wait for it in a collective are deadlocked,
    as the main process hands out the next test only once every rank ended this one.
    """

    POLL = 0.002  # seconds between two looks, the other ranks running meanwhile

    def __init__(self) -> None:
        self._items: deque[str | None] = deque()  # (appended by the main thread, taken by the rank's)
        self._idle: RankState | None = None  # the rank's state while it waits for a test

    def put(self, item: str | None) -> None:
        self._items.append(item)
        st = self._idle
        if st is not None:
            st.resume()  # live again from now, before its thread even wakes up

    def get(self, *args: object, **kwargs: object) -> str | None:
        if not self._items:
            st = current_rank_state()
            if st is not None:
                self._idle = st
                st.idle("waiting for its next test")
                if self._items:  # put() came between the two looks
                    st.resume()
            try:
                while not self._items:
                    pause(self.POLL)
            finally:
                if st is not None:
                    self._idle = None
                    st.resume()
        return self._items.popleft()

    def empty(self) -> bool:
        return not self._items

    def __repr__(self) -> str:
        return f"<_Tasks {list(self._items)!r}>"


class _Results:
    """A worker's completion queue, as its rank thread fills it: a failure also fails the rank."""

    def __init__(self, owner: ContinuousRanks, rank: int) -> None:
        self._owner = owner
        self._rank = rank

    def put(self, result: object) -> None:
        self._owner.post(self._rank, result)
        if isinstance(result, BaseException) and not isinstance(result, unittest.SkipTest):
            # the worker loop would go on to its next test; the world must learn now
            raise result.__cause__ or result


class _Completion:
    """A worker's completion queue, as the main process reads it: the test runs on the first read."""

    def __init__(self, owner: ContinuousRanks, rank: int) -> None:
        self._owner = owner
        self._rank = rank

    def get(self, block: bool = True, timeout: float | None = None) -> object:
        return self._owner.result(self._rank)

    def empty(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"<_Completion rank {self._rank} of {self._owner!r}>"


class _Dispatch:
    """A worker's task queue, as the main process fills it: the test id to run next, None at the class's end."""

    def __init__(self, owner: ContinuousRanks, rank: int) -> None:
        self._owner = owner
        self._rank = rank

    def put(self, test_id: object) -> None:
        if test_id is None:  # the class is done (its tearDownClass)
            self._owner.stop(self._rank)
        else:
            self._owner.next_test = str(test_id)


class _Worker(FakeProcess):
    """A continuous worker as the main process sees it: joining it joins the real one, if the class started any."""

    def __init__(self, owner: ContinuousRanks, rank: int) -> None:
        super().__init__(rank, 0)
        self._owner = owner
        self._rank = rank

    def join(self, timeout: float | None = None) -> None:
        self._owner.join(self._rank, timeout)


_CLASS_ATTRS = ("processes", "task_queues", "completion_queues", "rdvz_file")

CLASS_LISTS_KEPT = _patches.PatchSet(
    "continuous test's lists kept",
    "torch's _spawn_processes sets a MultiProcContinuousTest class's workers and queues; where its real "
    "workers start after all, the in-process ones stay on the class",
    lambda cls: [_patches.Attr.kept(cls, name) for name in _CLASS_ATTRS],
    [f"*.{name}" for name in _CLASS_ATTRS],
    per="run",
)


class _RealWorkers:
    """torch's own continuous workers for one class: real processes, each with its group made once.

    Started the first time a test of the class needs processes of its own (and
    ``fallback="processes"``); that test, and any later one of the class that needs
    processes, runs on them, as it would under torch's harness.
    """

    def __init__(self, cls: type, size: int, spawn: Callable[[type, int], None]) -> None:
        # torch's _spawn_processes sets its lists on the class; the main process keeps
        # talking to the in-process ones there, so they are put back
        with _patches.lease(CLASS_LISTS_KEPT, cls):
            spawn(cls, size)
            self.processes: list[BaseProcess] = list(cls.processes)  # type: ignore[attr-defined]
            self.tasks: list[Queue[str | None]] = list(cls.task_queues)  # type: ignore[attr-defined]
            self.completions: list[Queue[object]] = list(cls.completion_queues)  # type: ignore[attr-defined]
            self.rdvz_file: str = cls.rdvz_file  # type: ignore[attr-defined]
        self._joined: set[int] = set()

    def run(self, test_id: str, timeout: float) -> list[object]:
        """Each worker's result of ``test_id``: the id when it passed, else what it put (or why it put nothing)."""
        for q in self.tasks:
            q.put(test_id)
        start = time.monotonic()
        return [self._result(p, q, start, timeout) for p, q in zip(self.processes, self.completions, strict=True)]

    @staticmethod
    def _result(process: BaseProcess, completions: Queue[object], start: float, timeout: float) -> object:
        # as torch's newer harness reads a worker (torch 2.10 waits forever): its result, or
        # why there is none, a dead worker or the test's timeout
        while True:
            left = start + timeout - time.monotonic()
            try:
                return completions.get(timeout=min(1.0, max(0.01, left)))
            except queue.Empty:
                if not process.is_alive() and completions.empty():
                    return RuntimeError(f"Exited with {process.exitcode}")
                if left <= 0:
                    return RuntimeError(f"Process timed out after {time.monotonic() - start:.0f}s")

    def stop(self, rank: int) -> None:
        self.tasks[rank].put(None)

    def join(self, rank: int, timeout: float | None) -> None:
        p = self.processes[rank]
        p.join(GRACE if timeout is None else timeout)
        if p.is_alive():  # still in a test that timed out: torch's harness would wait forever
            p.kill()
            p.join(GRACE)
        self._joined.add(rank)
        if len(self._joined) == len(self.processes):
            with contextlib.suppress(OSError):
                os.remove(self.rdvz_file)

    def __repr__(self) -> str:
        return f"<_RealWorkers pids={[p.pid for p in self.processes]}>"


class ContinuousRanks:
    """``MultiProcContinuousTest``'s workers, in-process: one world of sync ranks for a class's tests.

    As torch keeps W processes alive for a class, each with its process group made once
    (``_init_pg``) and its class attributes, a class's tests run one after the other on
    one world, whose ranks run torch's worker loop, each on a class of its own
    (``rank_class``). The main process hands them test ids and reads their results as
    under torch's harness. A failure ends the world (torch then skips the class's
    other tests); a test that needs processes of its own ends it too, and runs on
    torch's own workers for the class, started then (``spawn``: torch's
    ``_spawn_processes``), or is skipped, as ``settings.fallback`` says; the class's
    next test gets a fresh world.
    """

    def __init__(
        self,
        cls: type[MultiProcContinuousTest],
        size: int,
        settings: Settings,
        fallbacks: list[tuple[str, str]],
        spawn: Callable[[type, int], None],
    ) -> None:
        self.cls = cls
        self.size = size
        self.settings = settings
        self.fallbacks = fallbacks  # where to record a test that needs processes
        self._spawn = spawn
        with tempfile.NamedTemporaryFile(delete=False) as f:
            self.rdvz_file = f.name
        self.processes = [_Worker(self, r) for r in range(size)]
        self.task_queues = [_Dispatch(self, r) for r in range(size)]
        self.completion_queues = [_Completion(self, r) for r in range(size)]
        self.next_test: str | None = None
        self._test: str | None = None
        self._results: list[object] = []
        self._world: InProcessWorld | None = None  # the class's ranks, while they live
        self._tasks: list[_Tasks] = []
        self._posted = threading.Event()  # every rank has posted its result of the current test
        self._lock = threading.Lock()
        self._current: list[object] = []
        self._workers: _RealWorkers | None = None  # torch's own, once a test needed them

    def result(self, rank: int) -> object:
        """Rank ``rank``'s result of the current test (running it on the first request)."""
        if self.next_test is not None and self.next_test != self._test:
            self._test = self.next_test
            self._results = self._run(self.next_test)
        return self._results[rank]

    def post(self, rank: int, result: object) -> None:
        """Rank ``rank``'s result of the current test (from its thread)."""
        with self._lock:
            if self._current[rank] is None:
                self._current[rank] = result
            if all(r is not None for r in self._current):
                self._posted.set()

    def stop(self, rank: int) -> None:
        """The class is done: rank ``rank``'s worker may end."""
        if self._world is not None:
            self._tasks[rank].put(None)
        if self._workers is not None:
            self._workers.stop(rank)

    def join(self, rank: int, timeout: float | None) -> None:
        world = self._world
        if world is not None and rank == self.size - 1:  # (torch joins them in order: the last one ends it)
            world.wait(GRACE if timeout is None else timeout)
            world.end()
            self._world = None
        if self._workers is not None:
            self._workers.join(rank, timeout)

    def _in_processes(self, test_id: str, reason: str, test_timeout: float) -> list[object]:
        self.fallbacks.append((test_id, reason))
        if self.settings.fallback == "skip":
            return [unittest.SkipTest(f"aiocoll: {reason}: the test needs processes of its own")] * self.size
        _log.warning("aiocoll: %s: %s; running it in processes", test_id, reason)
        if self._workers is None:
            self._workers = _RealWorkers(self.cls, self.size, self._spawn)
        return self._workers.run(test_id, test_timeout)

    def _start_world(self, test_timeout: float) -> InProcessWorld:
        skips = _torch.process_harness.skips()
        cls, size, rdvz_file = self.cls, self.size, self.rdvz_file
        tasks = self._tasks = [_Tasks() for _ in range(size)]

        def rank_main(rank: int) -> None:
            try:
                # (torch leaves _worker_loop unannotated)
                rank_class(cls)._worker_loop(rank, size, rdvz_file, tasks[rank], _Results(self, rank))  # type: ignore[no-untyped-call]
            except SystemExit as e:  # out of _init_pg (torch 2.10 lets it through)
                code = exit_code(e)
                if code in skips:
                    self.post(rank, unittest.SkipTest(skips[code]))
                    return
                self.post(rank, _worker_error(e))
                raise
            except _procstate.NeedsProcess:
                raise
            except BaseException as e:
                self.post(rank, _worker_error(e))
                raise

        world = InProcessWorld(
            size,
            self.settings.collective_timeout(test_timeout),
            self.settings.deadline(test_timeout, size),
            cls.__qualname__,
        )
        world.start(rank_main)
        return world

    def _run(self, test_id: str) -> list[object]:
        test_timeout = _torch.process_harness.test_timeout(test_id)
        # a rank stuck holding the GIL would stop this thread too: the watchdog ends the process then
        limit = self.settings.deadline(test_timeout, self.size) + 2 * GRACE + _watchdog.MARGIN
        return under_deadline(limit, test_id, lambda: self._run_test(test_id, test_timeout))

    def _run_test(self, test_id: str, test_timeout: float) -> list[object]:
        with self._lock:
            self._current = [None] * self.size
            self._posted.clear()
        world = self._world
        if world is not None and world.ended:  # (its ranks ended between two tests: start afresh)
            world.end()
            world = None
        if world is None:
            world = self._world = self._start_world(test_timeout)
        began = time.monotonic()
        for q in self._tasks:
            q.put(test_id)
        try:
            done = world.wait(world.deadline, until=self._posted)
            failed = any(_is_failure(r) for r in self._current)
            if done and self._posted.is_set() and not failed and not world.ended:
                return list(self._current)  # the world lives on, for the class's next test
            if failed:  # the world is ending: its report comes with it
                world.wait(GRACE)
        except BaseException:  # ^C
            world.end()
            self._world = None
            raise
        end = world.end(timed_out=not done)
        self._world = None
        results = list(self._current)
        if end.needs_process is not None:
            return self._in_processes(test_id, str(end.needs_process), test_timeout)
        if end.timed_out:
            err = end.timeout_error(test_id, end.deadline, f"Process timed out after {time.monotonic() - began}s")
            return [err] * self.size
        root: BaseException | None = None
        for r in results:
            if isinstance(r, BaseException) and not isinstance(r, unittest.SkipTest):
                cause = r.__cause__ or r
                if not echoes_abort(cause) and (end.error is None or cause is end.error):
                    root = r
                    break
        if end.error is not None and root is None:
            # not a rank's failure: aiocoll's own (a torch it cannot work with, a warning made an error)
            return [end.error] * self.size
        if root is not None and root is not end.error:
            # aiocoll's notes end the report (the cause's traceback was taken before they were added)
            notes = getattr(end.error, "__notes__", [])
            for n in notes:
                root.add_note(n)
            if end.error is not None and end.error is root.__cause__ and notes:
                del end.error.__notes__
            # ranks that were only released by the failure report it, not their release
            results = [root if isinstance(r, BaseException) and echoes_abort(r.__cause__ or r) else r for r in results]
        return [root if r is None else r for r in results]

    def __repr__(self) -> str:
        return f"<ContinuousRanks {self.cls.__name__} size={self.size} test={self._test}>"


def _is_failure(result: object) -> bool:
    return isinstance(result, BaseException) and not isinstance(result, unittest.SkipTest)


def _worker_error(e: BaseException) -> RuntimeError:
    """What torch's worker loop puts in its completion queue for a failure."""
    err = RuntimeError("Exception in worker process:\n" + "".join(traceback.format_exception(e)))
    err.__cause__ = e
    return err
