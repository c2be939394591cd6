"""``Work``: what every collective returns, whoever carries it out.

The base class holds what every kind of work shares: the ``asyncio.Future`` it completes,
the op's call and the line that issued it, and on top of them awaiting, ``done()``,
``result()``, ``exception()``, ``describe()`` and the repr. Each kind says how a thread
blocks on it (``wait``) and where it stands in its group (``_where``):

- ``_engine._world.EngineWork``: a rank's share of a rendezvous on the in-process engine;
- ``_pg.PGWork``: an op issued on a real torch.distributed process group.

It also holds how a work's outcome reaches torch's C++ (``TorchFutures``): torch's own
``Future.set_exception`` is Python-only (the future *succeeds*, with the exception as its
value, and DDP's reducer, reading tensors out of it, crashed the process). A future made
by ``then`` fails in C++ when its callback raises, as gloo's futures do.
"""

from __future__ import annotations

import abc
import asyncio
import sys
import threading
from collections.abc import Generator
from types import CodeType
from typing import TYPE_CHECKING, Any

import torch

from ._errors import WorldAbortedError

if TYPE_CHECKING:
    from ._ops import Call

__all__ = ["SentToTorch", "Site", "TorchFutures", "Work", "call_site", "fmt_site"]

Site = tuple[str, int]
"""File and line: where a rank issued an op."""


def call_site(depth: int) -> Site:
    """File and line of the user's frame ``depth`` levels above the caller."""
    f = sys._getframe(depth + 1)
    code: CodeType = f.f_code
    return (code.co_filename, f.f_lineno)


def fmt_site(site: Site | None) -> str:
    return "?" if site is None else f"{site[0]}:{site[1]}"


class Work(abc.ABC):
    """One rank's handle on one collective or p2p op; await it for the result.

    Collectives are issued when called, so work can overlap compute::

        w = comm.all_reduce(grad)      # issued now
        loss = compute_more()          # ... while the others arrive
        await w                        # done: grad holds the sum

    >>> import torch, aiocoll
    >>> async def worker(comm):
    ...     grads = [torch.ones(2), torch.ones(3)]
    ...     works = [comm.all_reduce(g) for g in grads]    # both issued now
    ...     for w in works:
    ...         await w
    ...     return [g.sum().item() for g in grads]
    >>> aiocoll.spawn(worker, world=2)
    [[4.0, 6.0], [4.0, 6.0]]
    """

    __slots__ = ("_call", "_fut", "_site")

    def __init__(self, fut: asyncio.Future[object], call: Call, site: Site | None) -> None:
        self._fut = fut  # completed with the op's result or error, on the loop of the ranks
        self._call = call  # an op's call (_ops); the engine reads the fields of the p2p calls it matches
        self._site = site

    @property
    @abc.abstractmethod
    def _where(self) -> str:
        """Where the op stands, for reports: ``"#3 on group 'world'"``."""

    @property
    @abc.abstractmethod
    def _owner(self) -> int:
        """The rank that issued it, for reports."""

    # (the result stays Any, here and in wait() and result(): its type is the op's, which Work does not know)
    def __await__(self) -> Generator[object, None, Any]:
        return (yield from self._fut)

    @abc.abstractmethod
    def wait(self, timeout: float | None = None) -> Any:
        """Block the calling thread until done; return the result or raise the op's error.

        For code that runs in a thread of its own. On the event loop thread, ``await``
        the work instead: blocking there would stop the very loop that completes it
        (``BlockingCallError``). With ``timeout`` (seconds), raises
        ``CollectiveTimeoutError`` if the op is still pending by then::

            comm.all_reduce(t).wait()      # in a rank thread, as dist.all_reduce blocks
        """

    def torch_future(self, value: object) -> torch.futures.Future[object]:
        """A torch Future completed with ``value`` when this work completes, failed (in C++ too) when it fails.

        What the torch.distributed adapter hands out as ``get_future()``::

            fut = work.torch_future([t])
        """
        futs = TorchFutures()
        tf = futs.add(value)

        def done(f: asyncio.Future[object]) -> None:
            futs.settle(cancelled_error(self.describe()) if f.cancelled() else f.exception())

        self._fut.add_done_callback(done)
        return tf

    def done(self) -> bool:
        """Whether the op has completed (or failed)."""
        return self._fut.done()

    def is_completed(self) -> bool:
        """Alias of ``done()``, as on torch.distributed's Work."""
        return self._fut.done()

    def result(self) -> Any:
        """The op's result; raises its error; InvalidStateError if not done yet.

        The result is what ``await`` returns: None for tensor collectives (they write in
        place), the objects for object collectives, the sender's rank for ``recv``.

        >>> import aiocoll
        >>> async def worker(comm):
        ...     w = comm.all_gather_object(comm.rank)
        ...     await w
        ...     return w.done(), w.exception(), w.result()
        >>> aiocoll.spawn(worker, world=2)
        [(True, None, [0, 1]), (True, None, [0, 1])]
        """
        return self._fut.result()

    def exception(self) -> BaseException | None:
        """The op's error, or None if it succeeded; InvalidStateError if not done yet."""
        return self._fut.exception()

    def describe(self) -> str:
        """The op, its place in its group and the line that issued it, as aiocoll's reports show it.

        >>> import torch, aiocoll
        >>> async def worker(comm):
        ...     w = comm.all_reduce(torch.ones(2))
        ...     await w
        ...     return w.describe()
        >>> print(aiocoll.spawn(worker, world=2)[0])  # doctest: +ELLIPSIS
        all_reduce(float32[2], op=ReduceOp.SUM) #0 on group 'world' at <doctest ...>:2
        """
        return f"{self._call.describe()} {self._where} at {fmt_site(self._site)}"

    def __repr__(self) -> str:
        state = "done" if self._fut.done() else "pending"
        return f"<Work rank={self._owner} {self._call.describe()} {self._where} {state}>"


# -- torch futures ---------------------------------------------------------------------


class _Failed:
    """What the source of a handed-out torch future carries when its work failed."""

    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error


def _unwrap(source: torch.futures.Future[object]) -> object:
    """The callback between a source future and the one torch gets: raising here fails it in C++."""
    value = source.value()
    if type(value) is _Failed:
        err = value.error
        tb = err.__traceback__
        try:
            raise err
        finally:
            # the error, as its rank sees it when it awaits the work, keeps its own traceback
            err.__traceback__ = tb
    return value


def cancelled_error(what: str) -> Exception:
    """The error a cancelled work's torch futures fail with (a cancellation is no ``Exception``)."""
    err = WorldAbortedError(f"{what} was cancelled")
    err.__cause__ = asyncio.CancelledError()
    return err


class TorchFutures:
    """The torch Futures handed out for one work: completed with their values, or failed as C++ sees failures.

    ``add`` hands out a future from any thread; ``settle`` completes every one handed
    out so far, and the later ones at once. A failed future raises in C++ callers
    (DDP's reducer: ``backward()`` raises) and in ``fut.wait()``, as a ``RuntimeError``
    whose text carries the work's error (torch's wording: "Got the following error when
    running the callback: <type>: <message>"); ``SentToTorch`` finds the error again.

    >>> import torch
    >>> futs = TorchFutures()
    >>> fut = futs.add([torch.ones(1)])
    >>> futs.settle(ValueError("no"))
    >>> try:
    ...     fut.wait()
    ... except RuntimeError as e:
    ...     print(str(e).splitlines()[0])
    Got the following error when running the callback: ValueError: no
    """

    __slots__ = ("_lock", "_outcome", "_pending")

    def __init__(self) -> None:
        # futures are asked for in rank threads and settled on the loop's thread
        self._lock = threading.Lock()
        self._pending: list[tuple[torch.futures.Future[object], object]] = []
        self._outcome: tuple[Exception | None] | None = None  # once settled: (its error or None,)

    def add(self, value: object) -> torch.futures.Future[object]:
        """A future completed with ``value``, or failed with the work's error."""
        source: torch.futures.Future[object] = torch.futures.Future()
        handed: torch.futures.Future[object] = source.then(_unwrap)
        with self._lock:
            outcome = self._outcome
            if outcome is None:
                self._pending.append((source, value))
        if outcome is not None:
            _complete(source, value, outcome[0])
        return handed

    def settle(self, exc: BaseException | None) -> None:
        """The work is done (``exc`` None) or failed: complete the futures, now and to come. Once only."""
        err = None if exc is None else exc if isinstance(exc, Exception) else _as_exception(exc)
        with self._lock:
            if self._outcome is not None:
                return
            self._outcome = (err,)
            pending, self._pending = self._pending, []
        for source, value in pending:
            _complete(source, value, err)

    @property
    def settled(self) -> bool:
        return self._outcome is not None

    def __repr__(self) -> str:
        state = "pending" if self._outcome is None else "ok" if self._outcome[0] is None else "failed"
        return f"<TorchFutures {state}, {len(self._pending)} waiting>"


def _as_exception(exc: BaseException) -> Exception:
    """An ``Exception`` for a work that ended with a cancellation or an exit: only those can fail a future."""
    if isinstance(exc, asyncio.CancelledError):
        return cancelled_error("the work")
    err = WorldAbortedError(f"the work ended with {type(exc).__name__}: {exc}")
    err.__cause__ = exc
    return err


def _complete(source: torch.futures.Future[object], value: object, err: Exception | None) -> None:
    source.set_result(value if err is None else _Failed(err))


_CALLBACK_ERROR = "Got the following error when running the callback: "


class SentToTorch:
    """The errors a world's works failed torch futures with, to find them in what torch raises.

    Through DDP's reducer an error reaches the rank as a ``RuntimeError`` holding its text
    (``TorchFutures``); ``find`` gives back the error itself, so that a report can tell a
    rank released by another's failure from a root cause, and show the original.

    >>> sent = SentToTorch()
    >>> err = KeyError("lost")
    >>> sent.add(err)
    >>> sent.find(RuntimeError(f"{_CALLBACK_ERROR}KeyError: 'lost'")) is err
    True
    >>> sent.find(RuntimeError("KeyError: 'lost'")) is None   # not torch's wrapper
    True
    """

    __slots__ = ("_errors",)

    LIMIT = 256  # a world with so many distinct errors is long aborted: keep the first

    def __init__(self) -> None:
        self._errors: dict[str, BaseException] = {}

    def add(self, exc: BaseException) -> None:
        text = str(exc)
        if text and len(self._errors) < self.LIMIT:
            self._errors.setdefault(text, exc)

    def find(self, e: BaseException) -> BaseException | None:
        """The sent error that ``e`` (torch's wrapper of it) carries, if any: the longest whose text it holds."""
        text = str(e)
        if _CALLBACK_ERROR not in text:
            return None
        best = max((key for key in self._errors if key in text), key=len, default=None)
        return None if best is None else self._errors[best]

    def __repr__(self) -> str:
        return f"<SentToTorch {len(self._errors)} errors>"
