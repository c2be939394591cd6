"""Which rank is running, and what the calling thread has of that rank's process: the two slots.

Everything aiocoll keeps per rank is reached from here, through exactly two slots:

- ``RANK``, a context variable: the engine's state of the rank the calling code acts for
  (``RankState``), with the rank's torch.distributed state on it. A context variable,
  because async ranks share one thread: each rank's task has a context of its own. The
  tasks and threads a rank starts get a copy of its context, so they act for it too.
- ``_record``, a thread-local: what the calling thread has of a process that a rank
  stands for (a sync rank of the harness drop-ins, ``aiocoll run``, ``mp.spawn`` in it),
  declared by the modules that keep it as ``Facet``\\ s: its environment view, ``atexit``
  list and logging (``_procstate``), its generators (``_locals``), its ``__main__``
  (``_rankmain``), where its output goes (``_runlogs``), its harness world
  (``_procworld``), its CUDA device choice (``_torch._cuda``). A thread-local, because
  these are a thread's: torch's own harness starts rank threads without a copied
  context, and C++ starts threads with none.

A facet is ``carried`` when the threads the rank starts share it, as a process's threads
share its environment (``carried()`` binds those in the new thread), and not when it is
the rank's own thread's alone (its turn among the ranks; its CUDA device).
No module makes thread-locals or context variables of its own for a rank's state.

>>> COLOUR = Facet("doctest colour", "none", carried=True)
>>> with COLOUR.bound("red"):
...     inside, carried_over = COLOUR.get(), _in_thread(carried(), COLOUR.get)
>>> inside, carried_over, COLOUR.get()
('red', 'red', 'none')
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any, ClassVar, Concatenate, Generic, ParamSpec, Protocol, TypeVar

__all__ = ["RANK", "Facet", "PerRank", "Rank", "StandIn", "carried", "forget_all"]

T = TypeVar("T")
V = TypeVar("V")
R = TypeVar("R")
P = ParamSpec("P")


class Rank(Protocol):
    """What the code below the engine reads of the rank that runs: the engine's ``RankState``
    fills it in (this module sits below the engine, and names none of its classes)."""

    @property
    def c10d(self) -> object:
        """The rank's torch.distributed state, which ``_torch``'s proxy reads; None before it has one."""
        ...


RANK: contextvars.ContextVar[Rank | None] = contextvars.ContextVar("aiocoll_rank", default=None)
"""The rank the calling code acts for (None: none): see the module."""


class _Record(threading.local):
    """The calling thread's facets: an attribute per facet set (absent: its default)."""


_record = _Record()


class Facet(Generic[T]):
    """One part of what a thread has of a rank's process, declared by the module that keeps it."""

    __slots__ = ("carried", "default", "name")
    declared: ClassVar[list[Facet[Any]]] = []

    def __init__(self, name: str, default: T, *, carried: bool) -> None:
        self.name = name  # (the record's attribute: one per facet)
        self.default = default
        self.carried = carried  # whether the threads a rank starts share it
        Facet.declared.append(self)

    def get(self) -> T:
        """The calling thread's value (the default where none is set)."""
        value: T = getattr(_record, self.name, self.default)
        return value

    def set(self, value: T) -> None:
        """Set the calling thread's value (``default``: unset)."""
        if value is self.default:
            _record.__dict__.pop(self.name, None)
        else:
            setattr(_record, self.name, value)

    @contextlib.contextmanager
    def bound(self, value: T) -> Iterator[None]:
        """The calling thread's value is ``value`` in the block, what it was before after it."""
        before = self.get()
        self.set(value)
        try:
            yield
        finally:
            self.set(before)

    def __repr__(self) -> str:
        return f"<Facet {self.name!r}{' carried' if self.carried else ''}: {self.get()!r} here>"


def carried() -> Callable[[], AbstractContextManager[None]]:
    """For a thread (or a pool's task) the calling rank starts: binds there the facets it carries.

    Read now, in the rank's thread; the factory's block binds them in the new thread and
    restores what that thread had after (a pool's thread runs one rank's task, then another's).
    """
    values = [(f, v) for f in Facet.declared if f.carried and (v := f.get()) is not f.default]
    if not values:
        return contextlib.nullcontext

    @contextlib.contextmanager
    def bound() -> Iterator[None]:
        before = [(f, f.get()) for f, _ in values]
        for f, v in values:
            f.set(v)
        try:
            yield
        finally:
            for f, v in before:
                f.set(v)

    return bound


class PerRank(Generic[V]):
    """What a process has once, made per rank: the calling rank's own ``V`` where it has one, else the process's.

    The one way aiocoll writes it, in two forms:

    - ``call(rank, process)``: a function to put in place of a method of an object whose
      identity must stay (``os.environ``'s, ``logging.Logger``'s attributes): it runs
      ``rank(own, ...)`` where ``own()`` gives the calling rank's value, ``process(...)``
      elsewhere;
    - ``StandIn``: an object to put in place of another (``sys.modules["__main__"]``,
      c10d's ``_world``), every attribute of which is the calling rank's own object's,
      else the process's.

    >>> own: dict[str, str | None] = {"name": None}
    >>> shout = PerRank(lambda: own["name"]).call(lambda mine, s: f"{mine}: {s}", lambda s: s)
    >>> shout("hi"), own.update(name="rank 0"), shout("hi")
    ('hi', None, 'rank 0: hi')
    """

    __slots__ = ("own",)

    def __init__(self, own: Callable[[], V | None]) -> None:
        self.own = own  # the calling rank's value (None: the thread is no rank's, or has none)

    def call(self, rank: Callable[Concatenate[V, P], R], process: Callable[P, R]) -> Callable[P, R]:
        """``rank(own, ...)`` in a rank that has its own value, ``process(...)`` elsewhere."""
        own = self.own

        def per_rank(*args: P.args, **kwargs: P.kwargs) -> R:
            mine = own()
            return process(*args, **kwargs) if mine is None else rank(mine, *args, **kwargs)

        return per_rank

    def __repr__(self) -> str:
        return f"<PerRank of {self.own!r}>"


class StandIn:
    """An object standing in for one of which each rank has its own (``PerRank``'s second form).

    A subclass says whose it is (``_aiocoll_own``: the calling rank's object, or None);
    an instance keeps the process's (``_aiocoll_process``). Every attribute read, written
    or deleted is then the rank's object's, else the process's; the subclass's own
    methods are reached through ``object.__getattribute__`` only, so that the object's
    own names never clash with them.
    """

    __slots__ = ()
    _aiocoll_own: ClassVar[PerRank[Any]]

    def __getattribute__(self, name: str) -> Any:
        return getattr(_stood_for(self), name)

    def __setattr__(self, name: str, value: object) -> None:
        setattr(_stood_for(self), name, value)

    def __delattr__(self, name: str) -> None:
        delattr(_stood_for(self), name)

    def __dir__(self) -> list[str]:
        return dir(_stood_for(self))


def _stood_for(obj: StandIn) -> Any:
    """The object ``obj`` stands for in the calling thread."""
    mine = type(obj)._aiocoll_own.own()
    return mine if mine is not None else object.__getattribute__(obj, "_aiocoll_process")


def forget_all() -> None:
    """The calling thread has no facet any more (a process forked from a rank's thread is no rank)."""
    _record.__dict__.clear()


def _in_thread(enter: Callable[[], AbstractContextManager[None]], fn: Callable[[], T]) -> T:
    """``fn()`` in a new thread, inside ``enter()`` (for the examples)."""
    out: list[T] = []

    def run() -> None:
        with enter():
            out.append(fn())

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return out[0]
