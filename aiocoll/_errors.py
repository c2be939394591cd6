"""The exception hierarchy: one root, leaves that also subclass the fitting builtin."""

from __future__ import annotations

__all__ = [
    "AiocollError",
    "BlockingCallError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "DeadlockError",
    "InvalidArgumentError",
    "WorldAbortedError",
]


class AiocollError(Exception):
    """Root of every error aiocoll raises on purpose."""


class InvalidArgumentError(AiocollError, ValueError):
    """A collective was called with bad arguments on one rank.

    Raised on the calling rank before it joins the collective, so no data has moved
    and the caller's tensors are untouched.
    """


class CollectiveMismatchError(AiocollError, ValueError):
    """Ranks met at the same collective of a group with calls that do not agree.

    Example: rank 0 calls ``all_reduce`` while rank 1 calls ``broadcast``, or the
    tensors differ in shape or dtype. The message lists what every rank called.
    """


class CollectiveTimeoutError(AiocollError, TimeoutError):
    """A rank waited in one collective longer than the world's ``timeout``."""


class DeadlockError(AiocollError, RuntimeError):
    """Every live rank waits for something that can no longer happen.

    Raised at once, not after a timeout; the message holds a table of each rank's
    state and pending operation.
    """


class WorldAbortedError(AiocollError, RuntimeError):
    """The world was aborted (a rank failed) while this rank waited or called.

    ``rank`` is the rank whose failure aborted the world (None when the world was
    cancelled from outside); ``__cause__`` is its exception.
    """

    def __init__(self, message: str, *, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


class BlockingCallError(AiocollError, RuntimeError):
    """A blocking wait was made on the event loop thread, where it would deadlock.

    The loop it blocks is the one that completes the collective. On the loop, use
    ``await comm.all_reduce(t)`` or ``await dist.all_reduce(t, async_op=True)``.
    """
