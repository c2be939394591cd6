"""``Work``: what every collective returns, whoever carries it out.

The base class holds what every kind of work shares: the ``asyncio.Future`` it completes,
the op's call and the line that issued it, and on top of them awaiting, ``done()``,
``result()``, ``exception()``, ``describe()`` and the repr. Each kind says how a thread
blocks on it (``wait``) and where it stands in its group (``_where``):

- ``_engine.EngineWork``: a rank's share of a rendezvous on the in-process engine;
- ``_pg.PGWork``: an op issued on a real torch.distributed process group.
"""

from __future__ import annotations

import abc
import asyncio
import sys
from collections.abc import Generator
from types import CodeType
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ._ops import Call

__all__ = ["Site", "Work", "call_site", "fmt_site"]

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

    def __init__(self, fut: asyncio.Future[Any], call: Call, site: Site | None) -> None:
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

    def __await__(self) -> Generator[Any, None, Any]:
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

    def torch_future(self, value: Any) -> torch.futures.Future[Any]:
        """A torch Future completed with ``value`` (or the op's error) when this work completes.

        What the torch.distributed adapter hands out as ``get_future()``::

            fut = work.torch_future([t])
        """
        tf: torch.futures.Future[Any] = torch.futures.Future()

        def done(f: asyncio.Future[Any]) -> None:
            exc = f.exception() if not f.cancelled() else asyncio.CancelledError()
            if exc is None:
                tf.set_result(value)
            else:
                tf.set_exception(exc)

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
