"""Run torch's own distributed test harnesses on aiocoll.

torch tests distributed code with two harnesses (``torch.testing._internal.common_distributed``):

- ``MultiProcessTestCase`` (and what derives from it: ``DTensorTestBase``, ``FSDPTest``,
  ``MultiProcContinuousTest`` and its ``DTensorContinuousTestBase``) starts a process
  per rank, talking gloo over loopback. ``replace_process_harness()`` runs each test's
  ranks in the test's own process instead, as aiocoll sync ranks: far faster, and
  with aiocoll's reports when something goes wrong.
- ``MultiThreadedTestCase`` and ``@spawn_threads_and_init_comms`` run each rank in a
  thread, with backend ``"threaded"``. ``replace_threaded_pg()`` makes that backend's
  groups aiocoll's.

Switch a whole test suite with one line in ``conftest.py``::

    import aiocoll.testing

    aiocoll.testing.replace_process_harness()
    aiocoll.testing.replace_threaded_pg()

or for a block only, restoring torch's own harness afterwards::

    with aiocoll.testing.replace_process_harness():
        unittest.main(module="test_my_dtensor", exit=False)

**The threaded harness.** With ``replace_threaded_pg()`` in force:

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

**The multi-process harness**: see ``replace_process_harness``.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import sys
import threading
import unittest
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypedDict

import torch

from . import _patches, _torch
from ._c10d import _backend as _c10d
from ._c10d import _belongings
from ._c10d._backend import AiocollProcessGroup, _C10dComm, _create_process_group
from ._engine._rank import EngineWork, RankState, current_rank_state, rank_var
from ._engine._world import World
from ._errors import InvalidArgumentError
from ._harness import _continuous, _harness
from ._lifecycle import _procworld
from ._lifecycle._config import DEFAULT_TIMEOUT, WorldConfig
from ._lifecycle._driver import HostedRun
from ._lifecycle._outcome import echoes_abort, warn_unmatched
from ._lifecycle._worldthread import WorldThread

if TYPE_CHECKING:
    from collections.abc import Callable

    from ._torch import DistributedBackendOptions, MultiProcessTestCase

__all__ = ["ProcessHarnessReplacement", "ThreadedPGReplacement", "replace_process_harness", "replace_threaded_pg"]

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


def _threaded_harness_changes(key: object) -> list[_patches.Change]:
    # importing it registers backend "threaded" and defines the class the harness calls
    ProcessLocalGroup = _torch.threaded_harness.process_local_group()
    _torch.prepare_for_rank_threads()  # before the harness starts its rank threads (once; nothing to undo)
    changes: list[_patches.Change] = list(_torch.threaded_harness.mend_thread_local_world())
    # same key, so the plugin keeps its place in the table (c10d looks at the first one)
    changes.append(
        _patches.Item(
            _torch.threaded_harness.plugins(),
            _THREADED,
            _torch.threaded_harness.plugin(_create_group),
            _torch.threaded_harness.PLUGINS,
        )
    )
    # The harness reports a rank's failure through this hook and calls reset() once its
    # threads are joined, before it reads their exceptions: aiocoll's abort and report.
    changes += [
        _patches.Attr(ProcessLocalGroup, name, classmethod(hook))
        for name, hook in (("exception_handle", _exception_handle), ("reset", _reset))
    ]
    # meshes belong to the run whose rank built them, released when it ends (the
    # harness's threaded backend keeps them apart by thread itself)
    changes.append(_torch.watch_meshes(_harness_mesh_made))
    return changes


THREADED_HARNESS = _patches.PatchSet(
    "threaded harness",
    "torch's threaded test harness (MultiThreadedTestCase) runs its ranks on aiocoll (replace_threaded_pg)",
    _threaded_harness_changes,
    [
        "*.ThreadLocalWorld.*",
        f"{_torch.threaded_harness.PLUGINS}[{_THREADED!r}]",
        "*.ProcessLocalGroup.exception_handle",
        "*.ProcessLocalGroup.reset",
        "torch.distributed.*DeviceMesh.__init__",
    ],
)


def _patch() -> None:
    _patches.acquire(THREADED_HARNESS)


def _unpatch() -> None:
    global _current
    if _current is not None:
        _current.scope.close()  # (its world's own scope ends with the world)
    _current = None  # a run cut short by this: its threads keep their world, the next run starts afresh
    _patches.release(THREADED_HARNESS)


# -- one run of the harness (one test): an aiocoll world its threads join -------------


_BUILD_SLICE = 0.05  # seconds between looks at the world thread while waiting for the world


class _HarnessRun:
    """The world of one harness run (one test), run by a ``HostedRun`` on a loop of its own.

    The harness starts the rank threads itself; each becomes its rank of this world in
    its ``init_process_group`` and leaves it when it destroys that group or fails.
    """

    def __init__(self, size: int, timeout: float | None) -> None:
        config = WorldConfig(size, timeout=timeout, c10d="off", record=0, sync_ranks="parallel")
        # entered here, left by _reset once it let the run go: the world's engine dies then (_belongings)
        self.scope = contextlib.ExitStack()
        self.scope.enter_context(_belongings.world_scope(collect=True))
        # (keyed by a token, not by this run: the registry holds its key until the lease ends, and
        # the run, holding the world, must be let go before the scope's collection; the hook is
        # put back first, as the lease ends before the scope)
        self.scope.enter_context(_patches.lease(HOOK_KEPT, object()))
        # (torch 2.10-2.12 would keep every DTensorSpec and mesh the test's ops hash: the
        # harness's worlds have no c10d of aiocoll's, which leases this for spawn's)
        self.scope.enter_context(_patches.lease(_c10d.OPSCHEMA_LEAK))
        try:
            self._run = HostedRun(config)
            self._thread = WorldThread(self._run.run, "auto")
            self._thread.start()
            self.world = self._built()
        except BaseException:
            self.scope.close()  # (no _reset comes for a run that never was)
            raise
        self.outcome = self._run.outcome

    def _built(self) -> World:
        """The world once built; raises if its thread ended first (its loop could not be made,
        so ``run()`` never ran to say so), where waiting for the world alone would never end."""
        while True:
            # looked at first: a world built before the thread ended is ready by then
            ended = self._thread.wait(0)
            try:
                return self._run.world(0 if ended else _BUILD_SLICE)
            except TimeoutError:
                if ended:
                    raise RuntimeError("aiocoll: the harness's world could not start") from self._thread.error

    def rank_ended(self, st: RankState, exc: BaseException | None) -> None:
        """From any thread: rank ``st`` is done, or failed with ``exc``."""
        self._run.ended(st.rank, exc)

    def close(self) -> list[EngineWork]:
        """After the harness joined its threads: release any straggler, end the world.

        Returns the operations still unmatched though every rank ended normally.
        """
        # threads the harness gave up on: fail their waits rather than leave them hanging
        self._run.give_up(lambda left: TimeoutError(f"ranks {left} were still running when the test ended"))
        self._thread.wait()
        return [] if self.world.aborted is not None else self.world.pending_works()


_current: _HarnessRun | None = None

HOOK_KEPT = _patches.PatchSet(
    "harness run's excepthook",
    "each rank's init_process_group wraps sys.excepthook and nothing unwraps it: it comes back when the "
    "harness run (a test) ends, as a process's hook goes with the process",
    lambda run: [_patches.Attr.kept(sys, "excepthook")],
    ["sys.excepthook"],
    per="run",
)


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
        # in the rank's thread: torch's threads exit together, which can deadlock freeing this cache
        _torch.drop_thread_caches()
        self._run.rank_ended(self._st, None)


def _create_group(opts: DistributedBackendOptions, backend_options: object = None) -> AiocollProcessGroup:
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
    st.runs_here()
    # as torch's threaded process group does: backward must run on this thread
    torch.autograd.set_multithreading_enabled(False)
    return _DefaultGroup(run, st, str(opts.group_id))


def _harness_mesh_made(mesh: object) -> None:
    st = _rank_of(_current)
    if st is not None:
        _c10d.belong(st.world, "mesh", mesh)


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
    scope = run.scope
    try:
        leftovers = run.close()  # (what the ranks made is released as its world ends, not in a later test)
        harness = sys.modules.get(_HARNESS_MODULE)
        if harness is not None:
            _keep_root_causes(run, harness.MultiThreadedTestCase.exception_queue)
    finally:
        run = None
        scope.close()
    warn_unmatched(leftovers, "the test", stacklevel=3)


# what a rank of torch's threaded harness puts in its exception queue, with its rank: sys.exc_info()
_ExcInfo = tuple[type[BaseException], BaseException, TracebackType | None]


def _keep_root_causes(run: _HarnessRun, q: queue.Queue[tuple[int, _ExcInfo]]) -> None:
    """Leave in the harness's queue only what went wrong first, as ``spawn`` reports it.

    The ranks an abort released only echo the root cause, and ranks failing with the
    same error (one mismatch or deadlock seen by all) would repeat it: keep one of each.
    """
    entries: list[tuple[int, _ExcInfo]] = []
    while True:
        try:
            entries.append(q.get_nowait())
        except queue.Empty:
            break
    roots = [(rank, info) for rank, info in entries if not echoes_abort(info[1])]
    if not roots:
        roots = entries
    elif run.outcome.failures:
        first = run.outcome.report()  # notes: its rank, who was aborted by it
        roots.sort(key=lambda e: e[1][1] is not first)
    seen: set[tuple[type, str]] = set()
    for rank, info in roots:
        key = (type(info[1]), str(info[1]))
        if key not in seen:
            seen.add(key)
            q.put((rank, info))


# -- torch's multi-process harness, in-process ----------------------------------------

_log = logging.getLogger("aiocoll.testing")
_FALLBACKS = ("processes", "skip")


class ProcessHarnessReplacement:
    """What ``replace_process_harness()`` returns: in force until ``restore()`` or the end of a ``with``."""

    def __init__(self, timeout: float | None, fallback: _harness.Fallback) -> None:
        self.settings = _harness.Settings(timeout, fallback)
        self.fallbacks: list[tuple[str, str]] = []
        """``(test id, reason)`` of each test that ran in processes (or was skipped) because it needs them."""

    @property
    def timeout(self) -> float | None:
        """Seconds a rank may wait in one collective (None: half the test's own timeout)."""
        return self.settings.timeout

    @property
    def fallback(self) -> _harness.Fallback:
        """What becomes of a test that needs processes of its own: ``"processes"`` or ``"skip"``."""
        return self.settings.fallback

    def restore(self) -> None:
        """Undo this replacement; torch's own harness is back once none is in force."""
        with _process_lock:
            if self in _process_active:
                _process_active.remove(self)
                if not _process_active:
                    _patches.release(PROCESS_HARNESS)

    def __enter__(self) -> ProcessHarnessReplacement:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.restore()

    def __repr__(self) -> str:
        state = "in force" if self in _process_active else "restored"
        return (
            f"<ProcessHarnessReplacement {state} timeout={self.timeout} fallback={self.fallback!r} "
            f"fell back={len(self.fallbacks)}>"
        )


def replace_process_harness(
    *, timeout: float | None = None, fallback: _harness.Fallback = "processes"
) -> ProcessHarnessReplacement:
    """Run the ranks of torch's multi-process tests in the test's process from now on; also a context manager.

    Tests derived from ``MultiProcessTestCase`` (``DTensorTestBase``, ``FSDPTest``...)
    and from ``MultiProcContinuousTest`` (``DTensorContinuousTestBase``) run unchanged:
    each rank is an aiocoll sync rank (a thread; ranks take turns), and the groups they
    make with ``init_process_group`` (``file://``, ``env://``, ``tcp://`` or a store;
    backend ``gloo``, ``nccl``, ``cpu:gloo,cuda:nccl``...) run on aiocoll, while
    ``dist.get_backend()`` still names the backend asked for. Each rank has what it had
    as a process: its own test object and class attributes, random generators (torch's,
    ``random``'s, NumPy's) and ``os.environ``. torch's own code then judges the outcome,
    from each rank's exit code and what it reported, so skips (``skip_if_lt_x_gpu``,
    ``sys.exit(TEST_SKIPS[...].exit_code)``, ``self.skipTest``) and failures read as
    under torch's harness: which process failed, its traceback, then aiocoll's report
    (the rank that raised first, the ranks aborted because of it, each rank's last
    operations). A mismatch or a deadlock is reported at once; a test that runs past
    torch's timeout for it is reported with where each rank was, never left hanging.

    A test that does what only a process of its own can do (``os._exit``, a signal to
    itself, ``signal.signal``, checking its processes' exit codes, forming worlds that
    are not the test's ranks), or what aiocoll lacks (a sparse ``all_reduce``), is run
    in processes by torch's own harness after all (``fallback="processes"``), or
    skipped with the reason (``fallback="skip"``); ``fallbacks`` lists them. ``timeout``
    bounds one wait in one collective (None: half of torch's timeout for the test).
    Replacements nest; torch's harness is restored exactly when the last one in force
    is restored.

    For a whole test suite, in ``conftest.py``::

        import aiocoll.testing

        aiocoll.testing.replace_process_harness()

    For a block only::

        with aiocoll.testing.replace_process_harness() as harness:
            unittest.main(module="test_my_dtensor", exit=False)
        print(harness.fallbacks)
    """
    if timeout is not None and (not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0):
        raise InvalidArgumentError(
            f"replace_process_harness: argument 'timeout' must be a positive number of seconds or None, got {timeout!r}"
        )
    if fallback not in _FALLBACKS:
        raise InvalidArgumentError(
            f"replace_process_harness: argument 'fallback' must be 'processes' or 'skip', got {fallback!r}"
        )
    r = ProcessHarnessReplacement(timeout, fallback)
    with _process_lock:
        if not _process_active:
            _patches.acquire(PROCESS_HARNESS)
        _process_active.append(r)
    return r


_process_lock = threading.Lock()
_process_active: list[ProcessHarnessReplacement] = []


class _Saved(TypedDict, total=False):
    case: dict[str, Callable[..., None]]  # MultiProcessTestCase's _start_processes, _join_processes
    continuous: Callable[[type, int], None]  # MultiProcContinuousTest._spawn_processes's function


_process_saved: _Saved = {}
_SPAWN_CONTINUOUS = "_spawn_processes"  # MultiProcContinuousTest's classmethod, replaced while patched
_DEFERRED = "_aiocoll_deferred_start"  # on a test object: the Process factory its start was deferred with


def _process_harness_changes(key: object) -> list[_patches.Change]:
    case = _torch.process_harness.test_case()
    continuous = _torch.process_harness.continuous_test_case()
    _torch.prepare_for_rank_threads()  # (once; nothing to undo)
    changes: list[_patches.Change] = []
    # torch's own, which the hooks call where a test runs in processes after all
    _process_saved["case"] = {name: case.__dict__[name] for name in ("_start_processes", "_join_processes")}
    changes += [
        _patches.Attr(case, "_start_processes", _start_processes),
        _patches.Attr(case, "_join_processes", _join_processes),
    ]
    if continuous is not None:
        _process_saved["continuous"] = continuous.__dict__[_SPAWN_CONTINUOUS].__func__
        changes.append(_patches.Attr(continuous, _SPAWN_CONTINUOUS, classmethod(_spawn_continuous)))
    return changes


PROCESS_HARNESS = _patches.PatchSet(
    "process harness",
    "torch's multi-process test harness (MultiProcessTestCase, MultiProcContinuousTest) runs a test's ranks "
    "in this process, and c10d makes aiocoll groups for the backends asked for (replace_process_harness)",
    _process_harness_changes,
    [
        "*.MultiProcessTestCase._start_processes",
        "*.MultiProcessTestCase._join_processes",
        f"*.MultiProcContinuousTest.{_SPAWN_CONTINUOUS}",
    ],
    needs=(_procworld.STEERED_INIT,),
)


def _settings() -> ProcessHarnessReplacement | None:
    with _process_lock:
        return _process_active[-1] if _process_active else None


def _start_processes(self: MultiProcessTestCase, proc: object) -> None:
    """MultiProcessTestCase._start_processes while replaced: nothing starts yet (see _join_processes)."""
    if _settings() is None or getattr(self, _DEFERRED, None) is False:
        _process_saved["case"]["_start_processes"](self, proc)
        return
    self.processes = []
    setattr(self, _DEFERRED, proc)


def _join_processes(self: MultiProcessTestCase, fn: object) -> None:
    """MultiProcessTestCase._join_processes while replaced: the ranks run here, or in processes if they must."""
    proc = getattr(self, _DEFERRED, None)
    replacement = _settings()
    if not proc or replacement is None:
        _process_saved["case"]["_join_processes"](self, fn)
        return
    if int(self.world_size) <= 0:
        # e.g. min(4, torch.cuda.device_count()) on a machine without GPUs: torch starts no
        # process, notes it and the test passes (its body never runs); so here
        _process_saved["case"]["_join_processes"](self, fn)
        return
    reason = _needs_processes(self, fn)
    if reason is None:
        end, ends = _harness.run_process_ranks(self, replacement.settings)
        if end.needs_process is None:
            _harness.report_process_ranks(self, fn, end, ends)
            return
        reason = str(end.needs_process)
    replacement.fallbacks.append((self.id(), reason))
    if replacement.fallback == "skip":
        raise unittest.SkipTest(f"aiocoll: {reason}: the test needs processes of its own")
    _log.warning("aiocoll: %s: %s; running it in processes", self.id(), reason)
    with contextlib.suppress(OSError):  # a rendezvous file the in-process ranks may have written to
        open(self.file_name, "wb").close()
    setattr(self, _DEFERRED, False)
    self._start_processes(proc)  # through any override, now for real
    _process_saved["case"]["_join_processes"](self, fn)


def _needs_processes(case: MultiProcessTestCase, fn: object) -> str | None:
    """Why a test cannot run in-process, seen before it runs, or None."""
    if fn in getattr(case, "skip_return_code_checks", ()):
        return "takes any exit code of its processes (skip_return_code_checks)"
    code = getattr(case, "special_return_code_checks", {}).get(fn)
    if isinstance(code, int) and code < 0:
        return f"expects its processes to be killed by signal {-code} (special_return_code_checks)"
    return None


def _spawn_continuous(cls: Any, world_size: int) -> None:  # (Any: it sets attributes torch's class leaves out)
    """MultiProcContinuousTest._spawn_processes while replaced: workers of this process."""
    replacement = _settings()
    if replacement is None:
        _process_saved["continuous"](cls, world_size)
        return
    ranks = _continuous.ContinuousRanks(
        cls, int(world_size), replacement.settings, replacement.fallbacks, _process_saved["continuous"]
    )
    cls.rdvz_file = ranks.rdvz_file
    cls.processes, cls.task_queues, cls.completion_queues = ranks.processes, ranks.task_queues, ranks.completion_queues
