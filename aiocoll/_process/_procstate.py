"""What a rank of torch's multi-process test harness had as a process, in a thread of one.

torch's ``MultiProcessTestCase`` runs each rank in a process of its own; run in-process
(``aiocoll.testing.replace_process_harness``), each rank is a thread. Its random
generators are its own already (sync ranks take turns, ``_locals``). This module adds:

- ``RankEnviron``: each rank's ``os.environ`` as Python code sees it. A rank starts from
  the environment the test started with (as a spawned process inherits it) and sees
  its own changes only: ranks that set ``LOCAL_RANK`` to their rank each read back
  their own. Changes also reach the process's real environment, for C code that reads
  it, where the last writer wins; it is put back as it was once the test ends.
- ``ProcessOnly``: calls that only a process of its own can make (``os._exit``, a
  signal to itself, ``signal.signal``, a gloo group made directly, whose ranks would
  wait for each other inside gloo, an RPC agent, torch's profiler, DDP's logging data,
  ``logging``'s configuration, a library
  known to keep state once per process: ``OnePerProcess``) raise ``NeedsProcess``
  in a rank thread instead of ending, disturbing or hanging the whole test process (or
  configuring it for every rank and the rest of the run); the harness then runs that
  test in processes after all.
- ``rank_pid``: the process id a rank's own code reads (``os.getpid()``): one of its own,
  stable for its life, distinct between ranks, and above any real process id (Linux's
  ``pid_max`` is 4,194,304 at most), so that using it on the system (a signal, ``/proc``,
  ``psutil``, a wait) fails loudly rather than acting on another process; a signal to it
  is a signal to the rank's own process (``NeedsProcess``). Libraries (``logging``'s
  ``%(process)d``) get the real one.
- ``RankLogging`` (``_logstate``): each rank's ``logging`` configuration, handlers,
  levels and all; what it added is flushed and closed when the rank ends.
- ``_libstate``: libraries' state kept once per process (accelerate's ``PartialState``,
  ``AcceleratorState``, ``GradientState``; Lightning's ``rank_zero_only.rank``) is each
  rank's own, as in a fresh process.
- ``RankExit``: what a rank's test code registers with ``atexit`` runs when the rank
  ends, as its process's exit would run it, not when the test run ends.
- ``Cooperative``: a rank that sleeps (``time.sleep``) or waits for a store's key
  (``Store.get``, ``wait``, ``multi_get`` called from Python) gives its turn to the
  other ranks meanwhile, as a process would leave them the CPU; ranks that poll a file
  or a store for each other then meet instead of waiting for ever. So does a rank in a
  store's ``barrier`` or blocking ``queue_pop``, or making a store (a ``TCPStore``
  server waits for its clients): it steps out of the turns for the call (``stepped_out``).

All are installed while at least one harness world runs (``RANK_PROCESSES``) and
act only in threads bound to a rank (``bind``); every other thread sees the real thing.

>>> env = RankEnviron({"A": "1"})
>>> env.set("B", "2"); env.delete("A")
>>> env.get("B"), "A" in env.keys()
('2', False)
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import functools
import importlib.abc
import itertools
import os
import signal
import sys
import sysconfig
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from datetime import timedelta
from importlib.machinery import ModuleSpec
from types import FrameType, ModuleType
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import torch.distributed as dist
import torch.distributed.rpc as _rpc  # (torch.distributed imports it already)

from .. import _current, _patches, _torch
from .._paths import PACKAGE_DIR
from . import _libstate
from ._logstate import RankLogging, descriptors

if TYPE_CHECKING:
    from .._torch import Store

__all__ = [
    "PID_FLOOR",
    "RANK_PROCESSES",
    "Cooperative",
    "NeedsProcess",
    "ProcessOnly",
    "RankEnviron",
    "RankExit",
    "RankThreads",
    "bind",
    "bound_rank",
    "own_code",
    "rank_pid",
    "reserve_pid",
    "run_exit_handlers",
    "set_environ",
    "take_pid",
    "unbind",
]


class NeedsProcess(BaseException):
    """A harness rank did what only a process of its own can do; the test must run in processes.

    A ``BaseException``, like ``SystemExit``: the test's own ``except Exception`` must not
    take it for a failure of its own. The harness never lets it reach the user.
    """

    def __init__(self, rank: int, what: str) -> None:
        super().__init__(f"rank {rank} {what}")
        self.rank = rank
        self.what = what


_MISSING = object()


class RankEnviron:
    """One rank's view of ``os.environ``: a base (the environment when its test started) and its own changes."""

    __slots__ = ("_base", "_own")

    def __init__(self, base: dict[str, str]) -> None:
        self._base = base  # shared by the test's ranks, never written
        self._own: dict[str, str | None] = {}  # None: deleted by this rank

    def get(self, key: str) -> str:
        """The value, or KeyError."""
        value = self._own.get(key, _MISSING)
        if value is _MISSING:
            return self._base[key]
        if value is None:
            raise KeyError(key)
        assert isinstance(value, str)
        return value

    def set(self, key: str, value: str) -> None:
        self._own[key] = value

    def delete(self, key: str) -> None:
        """Delete ``key``, or KeyError where this rank does not see it."""
        self.get(key)
        self._own[key] = None

    def keys(self) -> list[str]:
        out = [k for k in self._base if self._own.get(k, "") is not None]
        out += [k for k, v in self._own.items() if v is not None and k not in self._base]
        return out

    def as_dict(self) -> dict[str, str]:
        """The rank's whole environment, as a process of its own would have it."""
        return {key: self.get(key) for key in self.keys()}

    def __repr__(self) -> str:
        return f"<RankEnviron {len(self._own)} change(s) over {len(self._base)} variables>"


T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., object])

# what a class or module gets while harness worlds run: (owner, attribute name, replacement)
Patch = tuple[object, str, object]


# what a harness rank's thread has of its process (see ``_current``); all but its turn
# (``pause``, ``stepped_out``) are shared with the threads it starts
_RANK: _current.Facet[int | None] = _current.Facet("harness rank", None, carried=True)
_ENVIRON: _current.Facet[RankEnviron | None] = _current.Facet("os.environ", None, carried=True)
_PAUSE: _current.Facet[Callable[[float], None] | None] = _current.Facet("pause", None, carried=False)
_STEPPED_OUT: _current.Facet[Callable[[], AbstractContextManager[None]] | None] = _current.Facet(
    "stepped out", None, carried=False
)
_EXITS: _current.Facet[list[tuple[Callable[..., object], tuple[object, ...], dict[str, object]]] | None] = (
    _current.Facet("atexit", None, carried=True)
)
_LOGGING: _current.Facet[RankLogging | None] = _current.Facet("logging", None, carried=True)
# the rank's process id, as its own code reads it (carried: a process's threads share its pid)
_PID: _current.Facet[int | None] = _current.Facet("pid", None, carried=True)

# above Linux's largest pid_max (2**22): no real process has one of these ids
PID_FLOOR = 4_194_305
_pids = itertools.count(PID_FLOOR)
_Store: type[Store] = dist.Store  # type: ignore[attr-defined]  # (its stubs do not export it)


def bind(
    rank: int,
    environ: RankEnviron,
    pause: Callable[[float], None],
    stepped_out: Callable[[], AbstractContextManager[None]],
) -> None:
    """In a harness rank's thread, before its code runs.

    ``pause(s)`` waits ``s`` seconds, letting others run; a call made inside
    ``stepped_out()`` may wait in C code for another rank, the others running meanwhile.
    """
    _RANK.set(rank)
    _ENVIRON.set(environ)
    _PAUSE.set(pause)
    _STEPPED_OUT.set(stepped_out)
    _EXITS.set([])
    _LOGGING.set(RankLogging())
    _PID.set(next(_pids))
    _libstate.bind()


def unbind() -> None:
    for facet in (_RANK, _ENVIRON, _PAUSE, _STEPPED_OUT, _EXITS, _LOGGING, _PID):
        facet.set(None)
    _libstate.unbind()


def reserve_pid() -> int:
    """A process id for a rank not bound yet (a ``multiprocessing.Process``'s ``pid``, known at its start)."""
    return next(_pids)


def take_pid(pid: int) -> None:
    """In a bound rank: its process id is ``pid`` (from ``reserve_pid``), not the one ``bind`` gave it."""
    _PID.set(pid)


def rank_pid() -> int | None:
    """The process id the calling rank's own code reads (None: not in a rank that stands for a process)."""
    return _PID.get()


def _stand_in(wrapper: F, real: Callable[..., object], name: str) -> F:
    """``wrapper``, named and documented as ``real`` (which it wraps, ``__wrapped__``), whose place it takes."""
    wrapper.__name__ = wrapper.__qualname__ = name
    wrapper.__doc__ = real.__doc__
    wrapper.__wrapped__ = real  # type: ignore[attr-defined]
    return wrapper


def stepped_out() -> AbstractContextManager[None]:
    """Around a call that may wait in C code for another rank: in a harness rank, the others take turns meanwhile."""
    step = _STEPPED_OUT.get()
    return contextlib.nullcontext() if step is None else step()


_rank_logging = _LOGGING.get


def run_exit_handlers() -> None:
    """Run what the calling rank registered with ``atexit`` (last first), as its process's exit would.

    An error is printed and the next handler runs, as at an interpreter's exit. Then the
    rank's logging handlers are flushed and closed, as ``logging``'s own exit handler does.
    """
    exits = _EXITS.get()
    while exits:
        fn, args, kwargs = exits.pop()
        try:
            fn(*args, **kwargs)
        except BaseException:
            print(f"aiocoll: rank {_RANK.get()}: exception ignored in atexit callback {fn!r}:", file=sys.stderr)
            traceback.print_exc()
    logs = _LOGGING.get()
    if logs is not None:
        logs.shutdown()


def _in_forked_child() -> None:
    """A process forked from a rank's thread (a DataLoader worker, say) is a process of its own.

    It runs on with a copy of that thread, still bound to the rank: it keeps the rank's
    environment, now as its real one (a child inherits its parent's), and is a rank no
    more, so that its ``os._exit``, ``time.sleep``, ``atexit`` and torch.distributed are
    the real ones.
    """
    view, logs, rank = _ENVIRON.get(), _LOGGING.get(), _RANK.get()
    _libstate.in_forked_child()  # (before unbind: the rank's libraries' state becomes the process's)
    unbind()
    if view is not None:
        restore_environ(view.as_dict())
    if logs is not None:
        logs.make_the_process_s()
    if rank is not None:
        # nor does it act for the rank any more: its torch.distributed is the process's own
        # (the groups it makes are its own, as a forked process's are), where a rank's
        # init_process_group in it would take it for the rank itself (_procworld forgets
        # the world; where its output goes stays the rank's, as a child inherits its fds)
        _current.RANK.set(None)


os.register_at_fork(after_in_child=_in_forked_child)


def bound_rank() -> int | None:
    """The harness rank the calling thread runs, if any."""
    return _RANK.get()


# -- os.environ, per rank ------------------------------------------------------------------

_Environ = type(os.environ)


def _environ_methods() -> dict[str, Callable[..., object]]:
    """Replacements for ``os._Environ``'s methods: a bound rank thread reads and writes its own view.

    (``os.environb`` shares the class: only ``os.environ`` has views.)
    """
    real_get, real_set, real_del = _Environ.__getitem__, _Environ.__setitem__, _Environ.__delitem__
    real_iter, real_len = _Environ.__iter__, _Environ.__len__
    view = _current.PerRank(_ENVIRON.get)

    def setitem(v: RankEnviron, env: os._Environ[str], key: str, value: str) -> None:
        real_set(env, key, value)  # checks the types as always, and C code sees it
        if env is os.environ:
            v.set(key, value)

    def delitem(v: RankEnviron, env: os._Environ[str], key: str) -> None:
        if env is not os.environ:
            real_del(env, key)
            return
        v.delete(key)
        with contextlib.suppress(KeyError):  # (set by this rank in its own view only)
            real_del(env, key)

    def getitem(v: RankEnviron, env: os._Environ[str], key: str) -> str:
        return v.get(key) if env is os.environ else real_get(env, key)

    def iterate(v: RankEnviron, env: os._Environ[str]) -> Iterator[str]:
        return iter(v.keys()) if env is os.environ else real_iter(env)

    def length(v: RankEnviron, env: os._Environ[str]) -> int:
        return len(v.keys()) if env is os.environ else real_len(env)

    return {
        "__getitem__": view.call(getitem, real_get),
        "__setitem__": view.call(setitem, real_set),
        "__delitem__": view.call(delitem, real_del),
        "__iter__": view.call(iterate, real_iter),
        "__len__": view.call(length, real_len),
    }


# -- calls only a process of its own can make ------------------------------------------------


class ProcessOnly:
    """Wrappers raising ``NeedsProcess`` in a bound rank thread, for calls that act on the whole process."""

    @staticmethod
    def wrappers() -> list[Patch]:
        """``(module, name, replacement)`` for each call that is refused in a rank."""
        out: list[Patch] = []

        def refuse(module: object, name: str, what: Callable[..., str | None]) -> None:
            real = getattr(module, name, None)
            if real is None:  # (not on this platform)
                return

            def wrapper(*args: object, **kwargs: object) -> object:
                rank = _RANK.get()
                if rank is not None:
                    why = what(*args, **kwargs)
                    if why is not None:
                        raise NeedsProcess(rank, why)
                return real(*args, **kwargs)

            out.append((module, name, _stand_in(wrapper, real, name)))

        def to_self(pid: int, sig: int) -> str | None:
            own = pid in (0, real_getpid()) or (pid >= PID_FLOOR and pid == _PID.get())
            return f"sent signal {sig} to its own process" if own else None

        real_getpid = os.getpid

        def gloo(pg: object, store: object, rank: int, size: int, *args: object, **kwargs: object) -> str | None:
            return (
                "made a ProcessGroupGloo directly (its ranks would wait for each other inside gloo)"
                if size > 1
                else None
            )

        def rpc_agent(*args: object, **kwargs: object) -> str | None:
            size = kwargs.get("world_size", args[3] if len(args) > 3 else None)
            return None if size == 1 else "called torch.distributed.rpc.init_rpc (a process has one RPC agent)"

        if dist.is_gloo_available():
            refuse(dist.ProcessGroupGloo, "__init__", gloo)
        if _rpc.is_available():  # (its agent, names and autograd contexts are the process's)
            refuse(_rpc, "init_rpc", rpc_agent)
        # (one profiling session per process: ranks starting theirs at once crash kineto, and a
        # process's profile would show its backend's events, gloo's, where these ranks have aiocoll's)
        refuse(*_torch.profiler_start(), lambda *args, **kwargs: "started torch's profiler (one per process)")
        refuse(
            *_torch.ddp_logging_data(),
            lambda ddp: (
                "read DDP's logging data, which describes its group's backend (aiocoll's, not the one asked for)"
            ),
        )
        out.append((os, "getpid", ProcessOnly._getpid(os.getpid)))
        refuse(os, "_exit", lambda code=0: f"called os._exit({code})")
        refuse(os, "abort", lambda: "called os.abort()")
        refuse(os, "kill", to_self)
        refuse(signal, "raise_signal", lambda sig: f"raised signal {sig}")
        refuse(signal, "signal", lambda sig, handler: f"installed a handler for signal {sig}")
        refuse(signal, "alarm", lambda seconds: f"set an alarm ({seconds} s)")
        refuse(signal, "setitimer", lambda which, seconds, interval=0.0: "set an interval timer")
        return out

    # torch's own tests live among the installed packages, and are a rank's own code
    TORCH_TESTS = os.path.join(os.path.dirname(os.path.dirname(dist.__file__)), "testing", "_internal", "")

    @staticmethod
    def _getpid(real: Callable[[], int]) -> Callable[[], int]:
        """``os.getpid``: the rank's own (``rank_pid``) to its own code, which may take it as the
        rank's identity (a file named by it); libraries (the standard library's ``logging``,
        installed packages, aiocoll) get the real one."""

        def getpid() -> int:
            pid = _PID.get()
            if pid is not None and own_code(sys._getframe(1).f_code.co_filename):
                return pid
            return real()

        return _stand_in(getpid, real, "getpid")


def own_code(filename: str) -> bool:
    """Whether code of ``filename`` is a rank's own (the script's, its modules', torch's tests),
    not a library's (the standard library, installed packages, aiocoll)."""
    libraries = (*RankExit.LIBRARIES, PACKAGE_DIR, "<")  # ("<frozen ...>", "<string>": no file of the rank's)
    return not filename.startswith(libraries) or filename.startswith(ProcessOnly.TORCH_TESTS)


class OnePerProcess(importlib.abc.MetaPathFinder):
    """The import of a library that keeps state once per process: made per rank, or refused in a rank.

    Such state would serve every rank of the process (``sys.modules`` is one), so a run
    would differ from torchrun's without a word (Lightning's ``rank_zero_only.rank`` would
    be the last rank's for all, so rank 0's rank-zero-only logging would never run). A
    module ``_libstate`` watches gets its stand-ins once imported, in any thread; a
    library listed in ``LIBRARIES`` (none today) is refused in a rank. Only libraries
    measured here are either; one refused but imported before the ranks start (by a test
    file, say) is not seen.
    """

    LIBRARIES: ClassVar[dict[str, str]] = {}  # (none today: accelerate's and Lightning's are per rank, _libstate)

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if _libstate.watched(fullname):  # (imported in any thread: the ranks' state is their own)
            spec = self._real_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _ThenPerRank(spec.loader, fullname)
            return spec
        rank = _RANK.get()
        top = fullname.partition(".")[0]
        why = self.LIBRARIES.get(top)
        if rank is None or why is None:
            return None  # (the next finder finds it)
        # the library's real spec, so that code asking whether it is installed
        # (importlib.util.find_spec) is told the truth; importing it is what is refused
        spec = self._real_spec(fullname, path, target)
        if spec is not None:
            spec.loader = _Refused(
                NeedsProcess(rank, f"imported {top}, {why}: the ranks of one process would share it")
            )
        return spec

    def _real_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None) -> ModuleSpec | None:
        """What the finders after this one find."""
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec: ModuleSpec | None = None if finder is self or find is None else find(fullname, path, target)
            if spec is not None:
                return spec
        return None

    def __repr__(self) -> str:
        return f"<OnePerProcess {sorted(self.LIBRARIES)}>"


class _ThenPerRank(importlib.abc.Loader):
    """The module's own loader, then its classes' shared state made per rank (``_libstate``)."""

    def __init__(self, loader: importlib.abc.Loader, module: str) -> None:
        self.loader = loader
        self.module = module

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        _libstate.after_import(self.module)

    def __getattr__(self, name: str) -> object:  # (get_source, get_resource_reader, ...: the real loader's)
        return getattr(self.loader, name)

    def __repr__(self) -> str:
        return f"<_ThenPerRank {self.module} by {self.loader!r}>"


class _Refused(importlib.abc.Loader):
    """Loads nothing: raises ``refusal`` where the module would run."""

    def __init__(self, refusal: NeedsProcess) -> None:
        self.refusal = refusal

    def create_module(self, spec: ModuleSpec) -> None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        raise self.refusal


class RankExit:
    """``atexit`` per rank: what a rank's test code registers runs when the rank ends, as at its process's exit.

    Registrations made by an import (a module's top-level code), by the standard library or
    by an installed package stay the process's: those serve every rank, and their clean-up
    must not run while others still use them (``weakref.finalize`` registers its exit hook
    the first time one is made, wherever that is, and running it would end every
    finalizer of the process).
    """

    LIBRARIES = tuple(
        sorted({os.path.join(sysconfig.get_paths()[k], "") for k in ("stdlib", "platstdlib", "purelib", "platlib")})
    )

    @staticmethod
    def _the_process_s(caller: FrameType) -> bool:
        code = caller.f_code
        return bool(code.co_name == "<module>" or code.co_filename.startswith(RankExit.LIBRARIES))

    @staticmethod
    def wrappers() -> list[Patch]:
        real_register, real_unregister = atexit.register, atexit.unregister

        def register(func: Callable[..., object], *args: object, **kwargs: object) -> Callable[..., object]:
            exits = _EXITS.get()
            if exits is None or RankExit._the_process_s(sys._getframe(1)):
                return real_register(func, *args, **kwargs)
            exits.append((func, args, kwargs))
            return func

        def unregister(func: Callable[..., object]) -> None:
            exits = _EXITS.get()
            if exits is not None:
                exits[:] = [e for e in exits if e[0] != func]
            real_unregister(func)

        register.__doc__, unregister.__doc__ = real_register.__doc__, real_unregister.__doc__
        return [(atexit, "register", register), (atexit, "unregister", unregister)]


class Cooperative:
    """Wrappers that wait by letting the other ranks run, in a bound rank thread."""

    POLL = 0.002  # seconds between two looks at a store while others run

    @staticmethod
    def wrappers() -> list[Patch]:
        real_sleep = time.sleep

        def sleep(seconds: float) -> None:
            pause = _PAUSE.get()
            if pause is None:
                real_sleep(seconds)
            else:
                pause(seconds)

        out: list[Patch] = [(time, "sleep", sleep)]
        for name in ("get", "wait", "multi_get"):
            real = getattr(_Store, name, None)
            if real is not None:
                out.append((_Store, name, Cooperative._store_wait(name, real)))
        for name in ("barrier", "queue_pop"):  # (waits a store cannot tell in advance: made stepped out)
            real = getattr(_Store, name, None)
            if real is not None:
                out.append((_Store, name, Cooperative._stepped_out(name, real)))
        return out

    @staticmethod
    def _stepped_out(name: str, real: Callable[..., object]) -> Callable[..., object]:
        def wrapper(store: Store, *args: object, **kwargs: object) -> object:
            with stepped_out():
                return real(store, *args, **kwargs)

        return _stand_in(wrapper, real, name)

    @staticmethod
    def _store_wait(name: str, real: Callable[..., object]) -> Callable[..., object]:
        # (args: a store method's, a key or keys and maybe a timeout)
        def wrapper(store: Store, *args: Any, **kwargs: object) -> object:
            pause = _PAUSE.get()
            if pause is not None and args:
                keys = [args[0]] if name == "get" else list(args[0])
                limit = args[1] if name == "wait" and len(args) > 1 else getattr(store, "timeout", None)
                seconds = limit.total_seconds() if isinstance(limit, timedelta) else 300.0
                deadline = time.monotonic() + seconds
                try:
                    # until the keys are there (or the store's timeout, which the real call then raises)
                    while not store.check(keys) and time.monotonic() < deadline:
                        pause(Cooperative.POLL)
                except (RuntimeError, NotImplementedError, AttributeError):  # a store that cannot check
                    pass
            return real(store, *args, **kwargs)

        return _stand_in(wrapper, real, name)


class RankThreads:
    """A thread a rank starts, and a task it hands a thread pool, belong to the rank, as in its process.

    They see its ``os.environ``, ``logging``, ``__main__``, ``random``, output streams and
    torch.distributed state (``contextvars``, as ``asyncio.to_thread`` carries them). A pool
    task runs as the rank that submitted it, whichever rank's task started the pool's thread:
    a pool made once for the process serves every rank, each as itself.
    """

    # aiocoll's own threads and pool tasks (a world's loop thread, its ranks', its workers)
    # are no rank's: a world started inside a rank sets up its own
    @staticmethod
    def carry(caller: FrameType) -> Callable[[Callable[[], T]], T] | None:
        """What runs a callable as the calling rank (None outside ranks, or for aiocoll's own ``caller``)."""
        if _RANK.get() is None or caller.f_code.co_filename.startswith(PACKAGE_DIR):
            return None
        context = contextvars.copy_context()
        as_rank_thread = _current.carried()  # (its environment, logging, __main__, random, output)

        def as_rank(fn: Callable[[], T]) -> T:
            with as_rank_thread():
                return fn()

        # (a fresh copy per call: a context is entered by one thread at a time)
        return lambda fn: context.copy().run(as_rank, fn)

    @staticmethod
    def wrappers() -> list[Patch]:
        real_start, real_submit = threading.Thread.start, ThreadPoolExecutor.submit

        def start(self: threading.Thread) -> None:
            carry = RankThreads.carry(sys._getframe(1))
            if carry is not None:
                run = self.run  # (as looked up now: a subclass's, or Thread's calling the target)
                self.run = lambda: carry(run)  # type: ignore[method-assign]
            real_start(self)

        def submit(self: ThreadPoolExecutor, fn: Callable[..., T], /, *args: object, **kwargs: object) -> Future[T]:
            carry = RankThreads.carry(sys._getframe(1))
            if carry is None:
                return real_submit(self, fn, *args, **kwargs)
            return real_submit(self, lambda: carry(functools.partial(fn, *args, **kwargs)))

        start.__doc__, submit.__doc__ = real_start.__doc__, real_submit.__doc__
        return [(threading.Thread, "start", start), (ThreadPoolExecutor, "submit", submit)]


def _rank_process_changes(key: object) -> list[_patches.Change]:
    patches: list[Patch] = [(_Environ, name, fn) for name, fn in _environ_methods().items()]
    patches += ProcessOnly.wrappers()
    patches += RankExit.wrappers()
    patches += Cooperative.wrappers()
    patches += descriptors(_rank_logging)
    patches += RankThreads.wrappers()
    changes: list[_patches.Change] = [_patches.Attr(owner, name, fn) for owner, name, fn in patches]
    changes.append(_patches.Step("sys.meta_path", _insert_finder))
    for module in [*_libstate.SHARED_STATES, *_libstate.RANK_ATTRIBUTES]:
        # (if imported now; OnePerProcess puts them in place when imported later)
        changes.append(_patches.Step(_libstate.target(module), functools.partial(_per_rank_library_state, module)))
    return changes


def _per_rank_library_state(module: str) -> Callable[[], str | None]:
    _libstate.install_imported(module)

    def undo() -> str | None:
        _libstate.restore(module)
        return None

    return undo


def _insert_finder() -> Callable[[], str | None]:
    finder = OnePerProcess()
    sys.meta_path.insert(0, finder)  # (in place: finders others add meanwhile stay)

    def undo() -> str | None:
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(finder)
        return None

    return undo


RANK_PROCESSES = _patches.PatchSet(
    "rank processes",
    "a harness rank's os.environ, atexit, logging configuration, threads, accelerate's states and Lightning's "
    "rank are its own; "
    "calls only a "
    "process can make, and importing a library kept once per process, raise NeedsProcess; time.sleep and "
    "a store's waits let the other ranks run",
    _rank_process_changes,
    [
        "os._Environ.*",
        "os.getpid",
        "os._exit",
        "os.abort",
        "os.kill",
        "signal.*",
        "atexit.*",
        "time.sleep",
        "*.ProcessGroupGloo.__init__",
        "*.Store.get",
        "*.Store.wait",
        "*.Store.multi_get",
        "*.Store.barrier",
        "*.Store.queue_pop",
        "torch.distributed.rpc.init_rpc",
        "torch.autograd.profiler.profile._prepare_trace",
        "torch.nn.parallel.distributed.DistributedDataParallel._get_ddp_logging_data",
        "logging.Logger.*",
        "logging.Manager.*",
        "threading.Thread.start",
        "concurrent.futures.thread.ThreadPoolExecutor.submit",
        "sys.meta_path",
        "*._shared_state",  # (_libstate.SHARED_STATES: accelerate's states)
        "*.rank_zero_only",  # (_libstate.RANK_ATTRIBUTES: Lightning's rank)
    ],
)


def snapshot_environ() -> dict[str, str]:
    """The process's environment now (what a rank started now would inherit)."""
    return dict(os.environ)


def set_environ(saved: dict[str, str]) -> None:
    """Make ``os.environ`` as the calling thread sees it (a rank's view, or the real one) ``saved``."""
    for key in [k for k in os.environ if k not in saved]:
        del os.environ[key]
    for key, value in saved.items():
        if os.environ.get(key) != value:
            os.environ[key] = value


def restore_environ(saved: dict[str, str]) -> None:
    """Put the process's environment back as ``saved``.

    The real one, whatever thread calls: the parent rank of a nested world (``mp.spawn`` in
    a rank) ends it, and its own view must not become the world's start.
    """
    with _ENVIRON.bound(None):
        set_environ(saved)
