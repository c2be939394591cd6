"""Run torch's own threaded test harness on aiocoll.

torch tests distributed code in one process with ``MultiThreadedTestCase`` and
``@spawn_threads_and_init_comms`` (``torch.testing._internal.common_distributed``):
each rank is a thread, with torch.distributed initialised with backend ``"threaded"``.
``replace_threaded_pg()`` makes that backend create aiocoll process groups, so the
same tests run their collectives on the aiocoll engine and gain its reports:

- a rank that raises releases every rank waiting in a collective at once, with a
  ``WorldAbortedError`` naming it, and the test fails with that rank's error (torch's
  own process group leaves the others waiting until they time out);
- ranks that call different collectives fail with ``CollectiveMismatchError``, listing
  what each rank called and where;
- when every live rank waits for something that can no longer happen (a rank
  returned early, both ranks ``send`` first) they fail with ``DeadlockError`` at once.

The harness itself is left as it is (its threads, per-thread c10d state, exception
queue and report), so ``setUp``/``perThreadSetUp`` and subclasses such as
``DTensorOpTestBase`` work unchanged; only torch's process group is swapped out.
``dist.get_backend()`` still says ``"threaded"`` (DeviceMesh relies on it), while each
group is an ``AiocollProcessGroup``. The report keeps the root cause, annotated as
``aiocoll.spawn`` annotates it, and leaves out the ranks that only echo it.

Switch a whole test suite with one line in ``conftest.py``::

    import aiocoll.testing

    aiocoll.testing.replace_threaded_pg()

or for a block only, restoring torch's own process group afterwards::

    with aiocoll.testing.replace_threaded_pg():
        unittest.main(module="test_my_dtensor", exit=False)

A test case, as usual::

    import torch
    import torch.distributed as dist
    from torch.testing._internal.common_distributed import MultiThreadedTestCase

    class TestSum(MultiThreadedTestCase):
        @property
        def world_size(self):
            return 4

        def setUp(self):
            super().setUp()
            self._spawn_threads()

        def test_all_reduce(self):
            t = torch.ones(2) * self.rank
            dist.all_reduce(t)
            self.assertEqual(t, torch.full((2,), 6.0))

Limits: ranks are threads, so a rank busy outside a collective (computing, sleeping)
cannot be interrupted; it gets the error at its next collective. A rank thread that
dies without the harness seeing it (an exception in ``perThreadSetUp``, which torch
does not catch) is not noticed: the others wait until ``timeout``. One harness run
at a time per process, as with torch's own process group.
"""

from __future__ import annotations

import queue
import sys
import threading
from types import TracebackType
from typing import Any

import torch

from . import _torch
from ._c10d import AiocollProcessGroup, _C10dComm, _create_process_group
from ._engine import EngineWork, Phase, RankState, World, current_rank_state, rank_var
from ._errors import InvalidArgumentError
from ._spawn import DEFAULT_TIMEOUT, _failed, _loop_factory, _report, echoes_abort, warn_unmatched

__all__ = ["ThreadedPGReplacement", "replace_threaded_pg"]

_THREADED = _torch.threaded_harness.PLUGIN_KEY
_HARNESS_MODULE = _torch.threaded_harness.MODULE


class ThreadedPGReplacement:
    """What ``replace_threaded_pg()`` returns: in force until ``restore()`` or the end of a ``with``."""

    def __init__(self, timeout: float | None) -> None:
        self.timeout = timeout
        """Seconds a rank may wait in one collective (None: no bound)."""

    def restore(self) -> None:
        """Undo this replacement; torch's own process group is back once none is in force."""
        with _lock:
            if self in _active:
                _active.remove(self)
                if not _active:
                    _unpatch()

    def __enter__(self) -> ThreadedPGReplacement:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.restore()


def replace_threaded_pg(*, timeout: float | None = DEFAULT_TIMEOUT) -> ThreadedPGReplacement:
    """Run torch's threaded test harness on aiocoll from now on; also a context manager.

    Replacements nest: torch's own process group (and everything patched for this) is
    restored exactly when the last one in force is restored. ``timeout`` bounds how
    long a rank may wait in one collective (None: no bound).

    For a whole test suite, in ``conftest.py``::

        import aiocoll.testing

        aiocoll.testing.replace_threaded_pg()

    For a block only, restoring torch's own process group afterwards::

        with aiocoll.testing.replace_threaded_pg(timeout=60):
            unittest.main(module="test_my_dtensor", exit=False)
    """
    if timeout is not None and (not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0):
        raise InvalidArgumentError(
            f"replace_threaded_pg: argument 'timeout' must be a positive number of seconds or None, got {timeout!r}"
        )
    r = ThreadedPGReplacement(timeout)
    with _lock:
        if not _active:
            _patch()
        _active.append(r)
    return r


# -- what is patched, and how it is undone --------------------------------------------

_lock = threading.Lock()
_active: list[ThreadedPGReplacement] = []
_saved: dict[str, Any] = {}


def _patch() -> None:
    # importing it registers backend "threaded" and defines the class the harness calls
    ProcessLocalGroup = _torch.threaded_harness.process_local_group()
    plugins = _torch.threaded_harness.plugins()
    _torch.prepare_for_rank_threads()  # before the harness starts its rank threads
    _saved["mended"] = _torch.threaded_harness.mend_thread_local_world()
    _saved["plugin"] = plugins[_THREADED]
    # The harness reports a rank's failure through this hook and calls reset() once its
    # threads are joined, before it reads their exceptions: aiocoll's abort and report.
    _saved["hooks"] = {name: ProcessLocalGroup.__dict__[name] for name in ("exception_handle", "reset")}
    # same key, so the plugin keeps its place in the table (c10d looks at the first one)
    plugins[_THREADED] = _torch.threaded_harness.plugin(_create_group)
    ProcessLocalGroup.exception_handle = classmethod(_exception_handle)
    ProcessLocalGroup.reset = classmethod(_reset)


def _unpatch() -> None:
    global _current
    ProcessLocalGroup = _torch.threaded_harness.process_local_group()
    _current = None  # a run cut short by this: its threads keep their world, the next run starts afresh
    _torch.threaded_harness.plugins()[_THREADED] = _saved.pop("plugin")
    _torch.threaded_harness.unmend_thread_local_world(_saved.pop("mended"))
    for name, hook in _saved.pop("hooks").items():
        setattr(ProcessLocalGroup, name, hook)


# -- one run of the harness (one test): an aiocoll world its threads join -------------


class _HarnessRun:
    """The world of one harness run, on a loop in a background thread.

    The harness starts the rank threads itself; each becomes its rank of this world in
    its ``init_process_group`` and leaves it when it destroys that group or fails.
    """

    def __init__(self, size: int, timeout: float | None) -> None:
        self.failures: list[tuple[int, BaseException]] = []
        self._ended: set[int] = set()
        made: list[World] = []
        ready = threading.Event()

        def main() -> None:
            loop = _loop_factory("auto")()
            try:
                try:
                    world = World(size, loop, timeout)  # on the loop's thread, as World requires
                    # Every rank counts as live from now on, as in spawn: a rank whose thread
                    # has not initialised yet is not absent.
                    for st in world.ranks:
                        st.enter()
                    made.append(world)
                finally:
                    ready.set()
                loop.run_forever()
            finally:
                loop.close()

        self.thread = threading.Thread(target=main, name="aiocoll harness loop", daemon=True)
        self.thread.start()
        ready.wait()
        if not made:
            raise RuntimeError("aiocoll: the harness's event loop failed to start")
        self.world = made[0]

    def rank_ended(self, st: RankState, exc: BaseException | None) -> None:
        """From any thread: rank ``st`` is done, or failed with ``exc``."""
        self.world.call_soon_threadsafe(self._end, st, exc)

    def _end(self, st: RankState, exc: BaseException | None) -> None:
        if st.rank in self._ended:  # a failed rank then destroys its group too
            return
        self._ended.add(st.rank)
        if exc is None:
            st.phase = Phase.RETURNED
        else:
            _failed(self.world, st, exc, self.failures)  # a root cause aborts the world
        st.leave()

    def close(self) -> list[EngineWork]:
        """After the harness joined its threads: release any straggler, stop the loop.

        Returns the operations still unmatched though every rank ended normally.
        """

        def finish() -> None:
            left = [st.rank for st in self.world.ranks if st.rank not in self._ended]
            if left:
                # threads the harness gave up on: fail their waits rather than leave them hanging
                self.world.abort(None, TimeoutError(f"ranks {left} were still running when the test ended"))
            self.world.loop.stop()

        self.world.call_soon_threadsafe(finish)
        self.thread.join()
        return [] if self.world.aborted is not None else self.world.pending_works()


_current: _HarnessRun | None = None


def _rank_of(run: _HarnessRun | None) -> RankState | None:
    """The calling thread's rank in ``run``, if it is one of its ranks."""
    st = current_rank_state()
    return st if run is not None and st is not None and st.world is run.world else None


class _DefaultGroup(AiocollProcessGroup):
    """A harness rank's default group: destroying it, the harness's last act for the rank, ends the rank."""

    def __init__(self, run: _HarnessRun, st: RankState, name: str) -> None:
        super().__init__(_C10dComm(run.world, run.world.group, st.rank, threaded=True), name)
        self._run = run
        self._st = st

    def shutdown(self) -> None:
        super().shutdown()
        self._run.rank_ended(self._st, None)


def _create_group(opts: Any, backend_options: Any = None) -> AiocollProcessGroup:
    """Backend "threaded" while replaced: aiocoll groups; a thread's first one binds it to its rank."""
    global _current
    if _rank_of(_current) is not None:
        return _create_process_group(opts, backend_options)  # a sub-group
    rank, size = int(opts.group_rank), int(opts.group_size)
    with _lock:
        if _current is None:
            _current = _HarnessRun(size, _active[-1].timeout if _active else DEFAULT_TIMEOUT)
        run = _current
    if size != run.world.size or not 0 <= rank < size:
        err = InvalidArgumentError(
            f"init_process_group: rank {rank} of a world of {size}, but this test's world has {run.world.size} ranks"
        )
        run.world.call_soon_threadsafe(run.world.abort, None, err)
        raise err
    st = run.world.ranks[rank]
    rank_var().set(st)  # this thread's context: every later call here acts for this rank
    # as torch's threaded process group does: backward must run on this thread
    torch.autograd.set_multithreading_enabled(False)
    return _DefaultGroup(run, st, str(opts.group_id))


def _exception_handle(cls: type, exc: BaseException) -> None:
    """The harness's report of a failing rank (called on its thread): abort the world."""
    run = _current
    if run is None:
        return
    st = _rank_of(run)
    if st is not None:
        run.rank_ended(st, exc)
    else:  # not one of the world's threads: still, nothing can complete consistently now
        run.world.call_soon_threadsafe(run.world.abort, None, exc)


def _reset(cls: type) -> None:
    """Called by the harness once its threads are joined, before it reads their exceptions."""
    global _current
    with _lock:
        run, _current = _current, None
    if run is None:
        return
    leftovers = run.close()
    harness = sys.modules.get(_HARNESS_MODULE)
    if harness is not None:
        _keep_root_causes(run, harness.MultiThreadedTestCase.exception_queue)
    warn_unmatched(leftovers, "the test", stacklevel=3)


def _keep_root_causes(run: _HarnessRun, q: queue.Queue[Any]) -> None:
    """Leave in the harness's queue only what went wrong first, as ``spawn`` reports it.

    The ranks an abort released only echo the root cause, and ranks failing with the
    same error (one mismatch or deadlock seen by all) would repeat it: keep one of each.
    """
    entries: list[tuple[int, Any]] = []
    while True:
        try:
            entries.append(q.get_nowait())
        except queue.Empty:
            break
    roots = [(rank, info) for rank, info in entries if not echoes_abort(info[1])]
    if not roots:
        roots = entries
    elif run.failures:
        first = _report(run.world, run.failures)  # notes: its rank, who was aborted by it
        roots.sort(key=lambda e: e[1][1] is not first)
    seen: set[tuple[type, str]] = set()
    for rank, info in roots:
        key = (type(info[1]), str(info[1]))
        if key not in seen:
            seen.add(key)
            q.put((rank, info))
