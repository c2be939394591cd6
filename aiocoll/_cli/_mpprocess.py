"""``multiprocessing.Process`` inside ``aiocoll run``: the processes a script starts for its ranks become aiocoll ranks.

The "Writing Distributed Applications" tutorial starts its ranks itself::

    def init_process(rank, size, fn, backend="gloo"):
        os.environ["MASTER_ADDR"] = "127.0.0.1"; os.environ["MASTER_PORT"] = "29500"
        dist.init_process_group(backend, rank=rank, world_size=size)
        fn(rank, size)

    if __name__ == "__main__":
        processes = [mp.Process(target=init_process, args=(rank, 2, run)) for rank in range(2)]
        for p in processes:
            p.start()
        for p in processes:
            p.join()

Under ``aiocoll run script.py`` a ``Process`` whose code calls ``init_process_group`` or
``init_device_mesh`` (``reaches_init``: its target, or its class's ``run``, and the
script's own functions and classes they name) is a rank. The ranks a rank of the run
starts one after another form a world of sync ranks in this process, in the order they
were started (``ProcessBatch``), with the checks, reports and seeds of ``mp.spawn``'s ranks
there. The world starts when the parent first waits for one of them (``join``), when it
starts nothing more for ``QUIET`` seconds (a parent waiting on a queue, or polling
``is_alive()``), or when its script ends. Each rank's generators start from seeds of
their own, as a spawned process's (a forked one would copy its parent's torch and NumPy
states). Each ``Process`` behaves as for a process: ``pid`` is the rank's own
``os.getpid()`` (``_procstate.rank_pid``), ``exitcode`` is 0, ``sys.exit``'s code or 1
after an exception (whose traceback it prints as multiprocessing's child does),
``sentinel`` is a descriptor that becomes ready when the rank ends, and
``multiprocessing.current_process()`` in the rank is the ``Process``.
Threads cannot be stopped one by one: ``terminate()`` and ``kill()`` of a rank still
running stop its whole world (its exit code is then ``-SIGTERM`` or ``-SIGKILL``).

A rank whose ``init_process_group`` names another rank or world size than its place
(started in another order, say), or that does what only a process can, stops the run,
which starts again in processes (``NeedsProcess``), as for ``mp.spawn``.

Every other process the script starts stays a real one: DataLoader workers and a
library's own processes as they are; a process of the script's own code that is not seen
to initialise torch.distributed (it may, through a library) gets the checks of the
processes mode in it (``aiocoll._cli._checked``), and says so once if it does.
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import multiprocessing.context as mp_context
import multiprocessing.process as mp_process
import os
import signal
import sys
import threading
import traceback
import types
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch.multiprocessing

from .. import _current, _patches, _torch
from .._lifecycle import _outcome, _procworld
from .._process import _procstate
from . import _checked, _rankmain, _runlogs
from ._mpspawn import Starter

__all__ = [
    "CHECKED_CHILDREN",
    "PROCESS_STARTS",
    "QUIET",
    "ProcessBatch",
    "checked_children",
    "process_ranks",
    "reaches_init",
]

# seconds without a new start after which a parent's rank processes start (it waits otherwise)
QUIET = 0.25
# what makes a process a rank of torch.distributed
_INIT_NAMES = frozenset({"init_process_group", "init_device_mesh"})
# the process a rank's code stands for (multiprocessing.current_process() in it)
_PROCESS: _current.Facet[mp_process.BaseProcess | None] = _current.Facet("multiprocessing process", None, carried=True)
# set by a start that forks a checked child (read in the child, after the fork)
_CHECK_CHILD: _current.Facet[tuple[float | None, str | None] | None] = _current.Facet(
    "starting a checked child", None, carried=False
)


# -- which processes are ranks -----------------------------------------------------------------


def reaches_init(process: mp_process.BaseProcess, target: object) -> bool:
    """Whether ``process`` (``target``: its target) is seen to initialise torch.distributed.

    Read from the code: its target's (or its class's ``run`` and other methods, where the
    class is the script's), and that of the script's own functions and classes those name,
    through the globals of the module each is defined in. Code of the standard library
    and of installed packages is not read: a process that initialises torch.distributed
    only there is not seen to (``tests/cli/test_run_process_ranks.py`` has examples). A name
    bound to torch's function itself (``from torch.distributed import init_process_group as
    init``) counts as a call of it.
    """
    todo: list[object] = [target]
    if type(process).run is not mp_process.BaseProcess.run:
        todo.append(type(process))
    seen: set[int] = set()
    while todo:
        item = todo.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, functools.partial):
            todo += [item.func, *item.args, *item.keywords.values()]
        elif isinstance(item, (types.MethodType, staticmethod, classmethod)):
            todo.append(item.__func__)
        elif isinstance(item, type):  # (its methods: those of the script's own code are read)
            todo += [v for c in item.__mro__ for v in vars(c).values()]
        elif isinstance(item, types.FunctionType) and _procstate.own_code(item.__code__.co_filename):
            names = _names(item.__code__)
            if names & _INIT_NAMES:
                return True
            scope = item.__globals__
            for name in names:
                found = scope.get(name)
                if getattr(found, "__name__", None) in _INIT_NAMES and callable(found):
                    return True  # (torch's function under a name of the script's)
                if isinstance(found, types.ModuleType):
                    if _own_module(found):  # (a module of the script's: what this code names in it)
                        todo += [getattr(found, n, None) for n in names]
                elif found is not None:
                    todo.append(found)
    return False


def _names(code: types.CodeType) -> set[str]:
    """The global and attribute names ``code`` and the code nested in it (inner functions, lambdas) use."""
    out = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            out |= _names(const)
    return out


def _own_module(module: types.ModuleType) -> bool:
    return _procstate.own_code(getattr(module, "__file__", None) or "<")


def _own(process: mp_process.BaseProcess, target: object) -> bool:
    """Whether ``process`` runs the script's own code (its target's, or its class's ``run``), not a library's."""
    if type(process).run is not mp_process.BaseProcess.run:
        target = type(process).run
    while isinstance(target, functools.partial):
        target = target.func
    code = getattr(getattr(target, "__func__", target), "__code__", None)
    return code is not None and _procstate.own_code(code.co_filename)


# -- a rank that stands for a process ------------------------------------------------------------


class _RankPopen:
    """What ``Process._popen`` is for a rank: the interface multiprocessing's ``Popen`` gives a process."""

    method = "aiocoll"

    def __init__(self, process: mp_process.BaseProcess, call: Callable[[], object], batch: ProcessBatch) -> None:
        self.process = process
        self.call = call
        self.batch = batch
        self.pid = _procstate.reserve_pid()
        self.returncode: int | None = None
        self.ended = threading.Event()
        self.environ = _procstate.snapshot_environ()  # (a child inherits its parent's, as it is now)
        self.writes_as = _runlogs.OUTPUT_RANK.get()  # and its streams
        self.parents_main = _rankmain.carried()  # and its __main__ is its parent's script
        self.sentinel, self._ready = os.pipe()  # readable (at its end) once the rank ended
        self._close = weakref.finalize(self, _close_quietly, self.sentinel)  # (as multiprocessing's Popen's)
        self.killed_by: int | None = None

    def poll(self, flag: int = os.WNOHANG) -> int | None:
        # (a look, not a wait: is_alive(), exitcode and repr() between two starts leave the batch open)
        return self.wait() if flag == 0 else self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        self.batch.start()  # (the parent waits for one: they all start now, if not yet)
        if not self.ended.wait(timeout):
            return None
        self.batch.reap()
        if self.batch.needs is not None:  # (the parent's rank stops too: the run starts again in processes)
            raise self.batch.needs
        return self.returncode

    def terminate(self) -> None:
        self._stop(signal.SIGTERM)

    def kill(self) -> None:
        self._stop(signal.SIGKILL)

    def _stop(self, sig: int) -> None:
        if not self.ended.is_set():
            self.killed_by = sig
            self.batch.stop()

    def close(self) -> None:
        self._close()  # (once: a finalizer runs at most once)

    def end(self, code: int) -> None:
        """The rank ended with exit code ``code`` (a stop's signal wins, as the process died by it)."""
        if self.ended.is_set():
            return
        self.returncode = -self.killed_by if self.killed_by is not None else code
        _close_quietly(self._ready)
        self.ended.set()

    def run_rank(self) -> None:
        """In the rank's thread: the process's code, as multiprocessing's child bootstrap runs it."""
        _runlogs.OUTPUT_RANK.set(self.writes_as)
        _procstate.take_pid(self.pid)
        _procstate.set_environ(self.environ)  # (its own view: as its parent's was at its start)
        code = 1
        try:
            with self.parents_main(), _PROCESS.bound(self.process):
                self.call()
            code = 0
        except SystemExit as e:
            code = _outcome.exit_status(e)  # (as its parent reads a process's, from waitpid)
            if code != 0:
                raise
        except _procstate.NeedsProcess as e:
            self.batch.needs = self.batch.needs or e
            self.batch.starter.needs_processes(e)  # (the parent may wait elsewhere than in join: the run stops)
            raise
        except BaseException as e:
            self._print_failure(e)
            raise
        finally:
            self.end(code)

    def _print_failure(self, e: BaseException) -> None:
        """As multiprocessing's child prints it: ``Process <name>:`` and the traceback."""
        with contextlib.suppress(Exception):
            print(f"Process {self.process.name}:", file=sys.stderr)
            if _outcome.echoes_abort(e):  # (another rank's failure, printed there: not this one's)
                print("".join(traceback.format_exception_only(type(e), e)).rstrip(), file=sys.stderr)
                return
            tb = _procworld.from_rank_code(e.__traceback__) or e.__traceback__
            traceback.print_exception(type(e), e, tb, file=sys.stderr)

    def __repr__(self) -> str:
        state = "running" if self.returncode is None else f"exit code {self.returncode}"
        return f"<_RankPopen {self.process.name} pid={self.pid} {state}>"


def _close_quietly(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


class ProcessBatch:
    """The rank processes one parent started, one after another: a world of sync ranks once it starts."""

    def __init__(self, starter: Starter, parent: object) -> None:
        self.starter = starter
        self.parent = parent  # (the key of the open batch it was)
        self.number = len(starter.contexts)  # (its ranks' seeds: as a replay starts them, whatever runs before)
        self.members: list[_RankPopen] = []
        self.world: _procworld.InProcessWorld | None = None
        self.needs: _procstate.NeedsProcess | None = None
        self.daemon = True  # all its processes are daemons: the parent's exit stops them
        self._lock = threading.RLock()
        self._timer: threading.Timer | None = None
        self._reaped = False

    @property
    def joined(self) -> bool:  # (as ``SpawnedContext``'s, for the run's finish and reports)
        return self._reaped

    @property
    def name(self) -> str:
        return f"multiprocessing.Process ranks {[m.process.name for m in self.members]}"

    def add(self, member: _RankPopen) -> None:
        with self._lock:
            self.members.append(member)
            self.daemon = self.daemon and bool(member.process.daemon)
            if self._timer is not None:
                self._timer.cancel()
            self._timer = threading.Timer(QUIET, self.start)
            self._timer.daemon = True
            self._timer.start()

    def start(self) -> None:
        with self._lock:
            if self.world is not None:
                return
            if self._timer is not None:
                self._timer.cancel()
            _open.pop(self.parent, None)
            self.world = _procworld.InProcessWorld(
                len(self.members),
                self.starter.timeout,
                self.starter.deadline,
                self.name,
                seeds=self.starter.seeds.then(f"multiprocessing.Process {self.number}"),
            )
            self.world.start(lambda rank: self.members[rank].run_rank())

    def wait(self) -> None:
        """Start the ranks (if not yet), wait for every one to end, and end their world."""
        self.start()
        for m in self.members:
            m.ended.wait()
        self.reap()

    def reap(self) -> None:
        """Once every rank ended: end the world (a rank that needs a process told the run as it met that)."""
        with self._lock:
            if self._reaped or self.world is None or not all(m.ended.is_set() for m in self.members):
                return
            self._reaped = True
            self.world.wait(None)
            self.world.end()

    def stop(self) -> None:
        """``terminate()`` of a rank still running: its world ends (threads cannot be stopped one by one)."""
        self.abandon()

    def abandon(self, grace: float | None = None) -> None:
        """The world ends without waiting for ranks still running (as ``SpawnedContext``'s, at the run's end)."""
        self.start()
        assert self.world is not None
        with self._lock:
            if not self._reaped:
                self._reaped = True
                self.world.end(grace=grace)
                self._reap_left()

    def _reap_left(self) -> None:
        for m in self.members:  # ranks left behind: as if killed
            if not m.ended.is_set():
                m.killed_by = m.killed_by or signal.SIGKILL
                m.end(1)

    def __repr__(self) -> str:
        state = "open" if self.world is None else "ended" if self._reaped else "running"
        return f"<ProcessBatch {self.name} {state}>"


_open: dict[object, ProcessBatch] = {}  # the batch each parent is starting, by its key (``_parent``)
_runs: list[Starter] = []  # the runs under way (aiocoll run's), innermost last


def _parent() -> object:
    """The key of the calling rank's "process" (its pid), or of this thread outside ranks."""
    pid = _procstate.rank_pid()
    return pid if pid is not None else ("thread", threading.get_ident())


def _rank_call(process: mp_process.BaseProcess) -> tuple[Callable[[], object], object]:
    """What the child would run (captured before ``start`` lets go of the target), and the target."""
    target = getattr(process, "_target", None)
    if type(process).run is mp_process.BaseProcess.run:
        args, kwargs = getattr(process, "_args", ()), getattr(process, "_kwargs", {})
        return (lambda: target(*args, **kwargs) if target is not None else None), target
    return process.run, target


def _start(real: Callable[[mp_process.BaseProcess], None]) -> Callable[[mp_process.BaseProcess], None]:
    @functools.wraps(real)
    def start(self: mp_process.BaseProcess) -> None:
        if not _runs or _procstate.bound_rank() is None:  # (not in a rank of a run: the real thing)
            real(self)
            return
        starter = _runs[-1]
        call, target = _rank_call(self)
        try:
            rank = reaches_init(self, target)
        except Exception:  # (code that cannot be read, a module's __getattr__ that raises: no rank)
            rank = False
        if not rank:
            _start_checked(real, self, target, starter.timeout)
            return
        parent = _parent()
        batch = _open.get(parent)
        if batch is None or batch.world is not None:
            batch = _open[parent] = ProcessBatch(starter, parent)
            starter.contexts.append(batch)
        popen = _RankPopen(self, call, batch)
        self._Popen = lambda process: popen  # type: ignore[attr-defined]  # (shadows the class's, this once)
        try:
            real(self)
        finally:
            del self._Popen  # type: ignore[attr-defined]
        batch.add(popen)

    return start


def _start_checked(
    real: Callable[[mp_process.BaseProcess], None],
    process: mp_process.BaseProcess,
    target: object,
    timeout: float | None,
) -> None:
    """A real process; where its code is the script's, with the checks of the processes mode in it."""
    if not _own(process, target):
        real(process)
        return
    said = (
        f"aiocoll run: {process.name} (pid {{pid}}) initialised torch.distributed, which its code was not seen to do "
        "before it started (only the script's own code is read), so it runs as a process of its own; its groups "
        "are checked ones, as with --processes"
    )
    process._aiocoll_checks = _ChildChecks(timeout, said)  # type: ignore[attr-defined]  # (spawn: on unpickling)
    with _CHECK_CHILD.bound((timeout, said)):  # (fork: after the fork)
        real(process)


class _ChildChecks:
    """Rides along in a spawned child's pickled ``Process``: unpickling it there installs the checks."""

    def __init__(self, timeout: float | None, said: str | None) -> None:
        self.timeout = timeout
        self.said = said

    def __reduce__(self) -> tuple[Callable[..., _ChildChecks], tuple[float | None, str | None]]:
        return _install_in_child, (self.timeout, self.said)

    def __repr__(self) -> str:
        return f"<_ChildChecks timeout={self.timeout}>"


def _install_in_child(timeout: float | None, said: str | None) -> _ChildChecks:
    _checked.install(timeout, said=said)
    return _ChildChecks(timeout, said)


def _after_fork() -> None:
    wanted = _CHECK_CHILD.get()
    if wanted is not None:
        _CHECK_CHILD.set(None)
        timeout, said = wanted
        _checked.install(timeout, said=said)


os.register_at_fork(after_in_child=_after_fork)


def _current_process(real: Callable[[], mp_process.BaseProcess]) -> Callable[[], mp_process.BaseProcess]:
    @functools.wraps(real)
    def current_process() -> mp_process.BaseProcess:
        return _PROCESS.get() or real()

    return current_process


def _process_starts(key: object) -> list[_patches.Change]:
    real = mp_process.current_process
    current = _current_process(real)
    # (multiprocessing and torch.multiprocessing took the function itself at import, as did its contexts' class)
    owners = [m for m in (mp_process, multiprocessing, torch.multiprocessing) if m.current_process is real]
    return [
        _patches.Attr(mp_process.BaseProcess, "start", _start(mp_process.BaseProcess.start)),
        *[_patches.Attr(m, "current_process", current) for m in owners],
        _patches.Attr(mp_context.BaseContext, "current_process", staticmethod(current)),
    ]


PROCESS_STARTS = _patches.PatchSet(
    "multiprocessing.Process ranks",
    "in a rank of aiocoll run, a multiprocessing.Process whose code initialises torch.distributed is a rank "
    "in this process (current_process() in it is that Process); one of the script's own code that is not seen "
    "to is a real process with checked groups",
    _process_starts,
    [
        "multiprocessing.process.BaseProcess.start",
        "multiprocessing.process.current_process",
        "multiprocessing.current_process",
        "torch.multiprocessing.current_process",
        "multiprocessing.context.BaseContext.current_process",
    ],
)


@contextlib.contextmanager
def process_ranks(starter: Starter) -> Iterator[None]:
    """While the block runs, the ``multiprocessing.Process`` ranks the run's ranks start are ranks of ``starter``'s."""
    _runs.append(starter)
    try:
        with _patches.lease(PROCESS_STARTS):
            yield
    finally:
        _runs.remove(starter)


def checked_children(timeout: float | None) -> None:
    """In a rank's process (the processes mode): the processes of the script's own code it starts are checked too.

    (A forked child has the checks already, as this process's copy; a spawned one gets them
    when it unpickles its ``Process``.)
    """
    _patches.acquire(CHECKED_CHILDREN, timeout)


def _checked_children(timeout: Any) -> list[_patches.Change]:
    real = mp_process.BaseProcess.start

    @functools.wraps(real)
    def start(self: mp_process.BaseProcess) -> None:
        # (torch.multiprocessing.spawn's children run its _wrap, which runs the script's function)
        target = _torch.spawned_function(getattr(self, "_target", None), getattr(self, "_args", ()))
        if _own(self, target):  # (a forked child has this process's checks: the attribute is not read)
            self._aiocoll_checks = _ChildChecks(timeout, None)  # type: ignore[attr-defined]
        real(self)

    return [_patches.Attr(mp_process.BaseProcess, "start", start)]


CHECKED_CHILDREN = _patches.PatchSet(
    "checked child processes",
    "in a rank's process of aiocoll run (processes mode), the processes of the script's own code it starts "
    "with spawn or forkserver make checked groups too",
    _checked_children,
    ["multiprocessing.process.BaseProcess.start"],
)
