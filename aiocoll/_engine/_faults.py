"""Fault injection: make a chosen rank fail, hang or be late at a chosen operation.

To test your own error handling (and elastic logic) against what a real job does when
a rank dies, stalls or straggles::

    faults = [aiocoll.Fault.fail(rank=2, at=3)]           # rank 2's 4th operation raises
    aiocoll.spawn(train, world=4, faults=faults)          # -> InjectedFault from rank 2

A fault fires once, at the first operation that matches it: the rank (any if None), the
rank's operation index ``at`` (0-based, counting every collective and p2p call it makes in
the world), and a predicate ``when`` on an ``OpInfo``. Kinds:

- ``fail``: the call raises (``InjectedFault``, or the exception given), as a crash there;
- ``hang``: the call never joins and never completes, as a rank stuck in a kernel: its
  peers time out (``CollectiveTimeoutError`` names it), or see the abort;
- ``delay``: the call joins ``seconds`` later, as a straggler; results are unchanged.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

from .._errors import AiocollError, InvalidArgumentError

__all__ = ["Fault", "FaultPlan", "InjectedFault", "OpInfo"]


class InjectedFault(AiocollError, RuntimeError):
    """The failure a ``Fault.fail`` injects (unless it was given an exception of its own).

    Catch it to test your recovery path::

        try:
            aiocoll.spawn(train, world=4, faults=[aiocoll.Fault.fail(rank=3, at=10)])
        except aiocoll.InjectedFault:
            ...  # what your job does when a rank dies
    """


@dataclass(frozen=True)
class OpInfo:
    """What a fault's ``when`` predicate sees of an operation.

    For example, to delay rank 1's first barrier by a second::

        aiocoll.Fault.delay(rank=1, seconds=1.0, when=lambda op: op.op == "barrier")
    """

    rank: int
    """The calling rank (global)."""
    index: int
    """The rank's n-th operation in this world (0-based)."""
    op: str
    """The operation: "all_reduce", "send", "barrier", ..."""
    group: str
    """The group's name ("world" for the world's own)."""


@dataclass(frozen=True)
class Fault:
    """A fault to inject; build one with ``Fault.fail``, ``Fault.hang`` or ``Fault.delay``.

    >>> import torch, aiocoll
    >>> async def worker(comm):
    ...     for _ in range(3):
    ...         await comm.all_reduce(torch.ones(1))
    >>> try:
    ...     aiocoll.spawn(worker, world=2, faults=[aiocoll.Fault.fail(rank=1, at=2)])
    ... except aiocoll.InjectedFault as e:
    ...     print(e)
    injected failure on rank 1 at its operation #2 (all_reduce)
    """

    kind: Literal["fail", "hang", "delay"]
    rank: int | None = None
    at: int | None = None
    when: Callable[[OpInfo], bool] | None = None
    seconds: float = 0.0
    exc: BaseException | type[BaseException] | None = None

    @classmethod
    def fail(
        cls,
        rank: int | None = None,
        at: int | None = None,
        *,
        when: Callable[[OpInfo], bool] | None = None,
        exc: BaseException | type[BaseException] | None = None,
    ) -> Fault:
        """The matching call raises ``exc`` (default: ``InjectedFault``)."""
        return cls("fail", rank, at, when, exc=exc)

    @classmethod
    def hang(
        cls, rank: int | None = None, at: int | None = None, *, when: Callable[[OpInfo], bool] | None = None
    ) -> Fault:
        """The matching call never completes, and its rank is not counted as blocked."""
        return cls("hang", rank, at, when)

    @classmethod
    def delay(
        cls,
        rank: int | None = None,
        at: int | None = None,
        *,
        seconds: float,
        when: Callable[[OpInfo], bool] | None = None,
    ) -> Fault:
        """The matching call joins its collective ``seconds`` late."""
        return cls("delay", rank, at, when, seconds=seconds)

    def __post_init__(self) -> None:
        for name in ("rank", "at"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise InvalidArgumentError(f"Fault.{self.kind}: argument {name!r} must be an int >= 0, got {v!r}")
        if self.kind == "delay" and not (isinstance(self.seconds, (int, float)) and self.seconds >= 0):
            raise InvalidArgumentError(f"Fault.delay: argument 'seconds' must be >= 0, got {self.seconds!r}")

    def describe(self) -> str:
        rank = "any rank" if self.rank is None else f"rank {self.rank}"
        at = "" if self.at is None else f" at its operation #{self.at}"
        return f"{self.kind} on {rank}{at}"


class FaultPlan:
    """The faults of one world, and each rank's operation count."""

    def __init__(self, faults: Iterable[Fault], size: int) -> None:
        self.faults = list(faults)
        for f in self.faults:
            if not isinstance(f, Fault):
                raise InvalidArgumentError(f"spawn: argument 'faults' must hold Fault objects, got {type(f).__name__}")
            if f.rank is not None and f.rank >= size:
                raise InvalidArgumentError(f"spawn: {f.describe()}: no such rank in a world of {size}")
        self.fired = [False] * len(self.faults)
        self.counts = [0] * size  # each rank counts its own: only its task or thread touches it
        self._lock = threading.Lock()  # sync ranks check concurrently

    def check(self, rank: int, op: str, group: str) -> tuple[Fault, OpInfo] | None:
        """The fault that fires at global ``rank``'s call of ``op`` on ``group``, if any.

        Counts the call as the rank's next operation. It takes plain values, not the
        engine's work, so that this module does not depend on the engine that uses it.
        """
        index = self.counts[rank]
        self.counts[rank] = index + 1
        info: OpInfo | None = None
        for i, f in enumerate(self.faults):
            if self.fired[i] or (f.rank is not None and f.rank != rank) or (f.at is not None and f.at != index):
                continue
            info = info or OpInfo(rank, index, op, group)
            if f.when is not None and not f.when(info):
                continue
            with self._lock:
                if self.fired[i]:
                    continue
                self.fired[i] = True
            return f, info
        return None

    def exception(self, fault: Fault, info: OpInfo) -> BaseException:
        """What a firing ``fail`` fault raises."""
        message = f"injected failure on rank {info.rank} at its operation #{info.index} ({info.op})"
        if fault.exc is None:
            return InjectedFault(message)
        if isinstance(fault.exc, type):
            return fault.exc(message)
        return fault.exc
