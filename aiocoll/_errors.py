"""The exception hierarchy: one root, leaves that also subclass the fitting builtin."""

from __future__ import annotations

__all__ = [
    "AiocollError",
    "BlockingCallError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "DeadlockError",
    "GroupTimeoutError",
    "InvalidArgumentError",
    "RankExitedError",
    "TorchCompatError",
    "WorldAbortedError",
]


class AiocollError(Exception):
    """Root of every error aiocoll raises on purpose.

    Each error also derives from the fitting builtin, so ``except ValueError`` and the
    like keep working; ``except aiocoll.AiocollError`` catches every report of aiocoll:

    >>> import aiocoll
    >>> issubclass(aiocoll.DeadlockError, aiocoll.AiocollError), issubclass(aiocoll.DeadlockError, RuntimeError)
    (True, True)
    """


class InvalidArgumentError(AiocollError, ValueError):
    """A collective was called with bad arguments on one rank.

    Raised on the calling rank before it joins the collective, so no data has moved
    and the caller's tensors are untouched. It is raised by the call itself, not by
    the ``await``:

    >>> import torch, aiocoll
    >>> async def worker(comm):
    ...     t = torch.ones(2)
    ...     try:
    ...         comm.broadcast(t, src=5)
    ...     except aiocoll.InvalidArgumentError as e:
    ...         return str(e), t.tolist()
    >>> aiocoll.spawn(worker, world=2)[0]
    ("broadcast on rank 0: argument 'src': rank 5 is out of range for a group of 2", [1.0, 1.0])
    """


class CollectiveMismatchError(AiocollError, ValueError):
    """Ranks met at the same collective of a group with calls that do not agree.

    Example: rank 0 calls ``all_reduce`` while rank 1 calls ``broadcast``, or the
    tensors differ in shape or dtype. The message lists what every rank called, and
    where:

    >>> import torch, aiocoll
    >>> async def worker(comm):
    ...     t = torch.ones(2)
    ...     if comm.rank == 1:
    ...         await comm.broadcast(t, src=0)
    ...     else:
    ...         await comm.all_reduce(t)
    >>> try:  # doctest: +ELLIPSIS
    ...     aiocoll.spawn(worker, world=3)
    ... except aiocoll.CollectiveMismatchError as e:
    ...     print(e)
    ranks called different collectives as call #0 of group 'world':
      rank 0: all_reduce(float32[2], op=ReduceOp.SUM) at ...
      rank 1: broadcast(float32[2], src=0) at ...
      rank 2: all_reduce(float32[2], op=ReduceOp.SUM) at ...
    """


class CollectiveTimeoutError(AiocollError, TimeoutError):
    """A rank waited in one collective longer than the world's ``timeout``.

    The fallback for waits aiocoll cannot prove hopeless, such as a peer that is busy
    (here, sleeping) rather than waiting:

    >>> import asyncio, aiocoll
    >>> async def worker(comm):
    ...     if comm.rank == 1:
    ...         await asyncio.sleep(10)
    ...     await comm.barrier()
    >>> try:  # doctest: +ELLIPSIS
    ...     aiocoll.spawn(worker, world=2, timeout=0.05)
    ... except aiocoll.CollectiveTimeoutError as e:
    ...     print(e)
    barrier #0 on group 'world' timed out after 0.05s: ranks [0] arrived, ranks [1] did not:
      rank 0: barrier() at ...
      rank 1: not arrived (running)
    """


class GroupTimeoutError(CollectiveTimeoutError, RuntimeError):
    """An op of a torch.distributed group outlived the group's own timeout, and the group broke.

    The ``timeout`` given to ``init_process_group`` or ``new_group`` is kept as gloo keeps
    it: an op still pending after it fails, and the group is unusable from then on for
    every member (each later op on it raises this error at once), while other groups go
    on. A ``RuntimeError``, as gloo's errors are, and a ``CollectiveTimeoutError``.
    The timeout is stretched by the cores the ranks share: see the sync ranks guide.

    >>> import aiocoll, torch, torch.distributed as dist
    >>> from datetime import timedelta
    >>> def worker(comm):
    ...     g = dist.new_group(timeout=timedelta(seconds=0.05))
    ...     if comm.rank == 0:
    ...         try:
    ...             dist.barrier(group=g)  # rank 1 waits in another group
    ...         except RuntimeError as e:
    ...             print(type(e).__name__, " Timed out " in str(e))
    ...     dist.barrier()  # the world's group goes on
    ...     try:
    ...         dist.barrier(group=g)
    ...     except aiocoll.GroupTimeoutError as e:
    ...         return str(e).split(":")[0]
    >>> aiocoll.spawn(worker, world=2)
    GroupTimeoutError True
    ["group '1' is broken", "group '1' is broken"]
    """


class DeadlockError(AiocollError, RuntimeError):
    """Every live rank waits for something that can no longer happen.

    Raised at once, not after a timeout; the message holds a table of each rank's
    state and pending operation. Here rank 1 returns without joining the all_reduce:

    >>> import torch, aiocoll
    >>> async def worker(comm):
    ...     if comm.rank == 0:
    ...         await comm.all_reduce(torch.ones(1))
    >>> try:  # doctest: +ELLIPSIS
    ...     aiocoll.spawn(worker, world=2)
    ... except aiocoll.DeadlockError as e:
    ...     print(e)
    deadlock: every live rank waits for a peer that will never arrive
      rank 0: blocked in all_reduce(float32[1], op=ReduceOp.SUM) #0 on group 'world' at ... -- waits for ranks [1]
      rank 1: returned
    """


class WorldAbortedError(AiocollError, RuntimeError):
    """The world was aborted (a rank failed) while this rank waited or called.

    ``rank`` is the rank whose failure aborted the world (None when the world was
    cancelled from outside); ``__cause__`` is its exception. ``spawn`` re-raises the
    original failure, not this echo of it:

    >>> import aiocoll
    >>> async def worker(comm):
    ...     if comm.rank == 1:
    ...         raise KeyError("boom")
    ...     try:
    ...         await comm.barrier()
    ...     except aiocoll.WorldAbortedError as e:
    ...         print(f"rank {comm.rank}: {e} (e.rank={e.rank})")
    ...         raise
    >>> try:
    ...     aiocoll.spawn(worker, world=2)
    ... except KeyError as e:
    ...     print("spawn raised", repr(e))
    rank 0: rank 1 failed with KeyError: 'boom' (e.rank=1)
    spawn raised KeyError('boom')
    """

    def __init__(self, message: str, *, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


class RankExitedError(AiocollError, RuntimeError):
    """A rank called ``sys.exit`` with a non-zero code (or a message) while its world ran.

    A process would have ended with that code; a rank of ``spawn`` is a thread or a task,
    and its exit must not end the calling program: it fails the world instead, as
    ``torch.multiprocessing.spawn`` raises ``ProcessExitedException``. ``rank`` and
    ``exit_code`` say who left and how; ``__cause__`` is the ``SystemExit``. (``sys.exit(0)``
    or ``sys.exit()`` is a rank that ends early, as its process would: it returns None.)

    >>> import sys, aiocoll
    >>> async def worker(comm):
    ...     if comm.rank == 1:
    ...         sys.exit(3)
    >>> try:
    ...     aiocoll.spawn(worker, world=2)
    ... except aiocoll.RankExitedError as e:
    ...     print(e, (e.rank, e.exit_code))
    rank 1 exited with code 3 (sys.exit(3)) (1, 3)
    """

    def __init__(self, message: str, *, rank: int, exit_code: int) -> None:
        super().__init__(message)
        self.rank = rank
        self.exit_code = exit_code

    @classmethod
    def of(cls, rank: int, e: SystemExit) -> RankExitedError:
        """The error for rank ``rank`` ending with ``e``, its exit code as a process's (a message: 1)."""
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        err = cls(f"rank {rank} exited with code {code} (sys.exit({e.code!r}))", rank=rank, exit_code=code)
        err.__cause__ = e
        return err


class BlockingCallError(AiocollError, RuntimeError):
    """A blocking wait was made on the event loop thread, where it would deadlock.

    (Or, while sync ranks take turns, on a thread a rank started, for a collective the
    rank made on its own thread: only that thread may wait for it.)

    The loop it blocks is the one that completes the collective. On the loop, use
    ``await comm.all_reduce(t)`` or ``await dist.all_reduce(t, async_op=True)``. The
    refused call has not joined the collective, so the rank may still make it:

    >>> import torch, torch.distributed as dist, aiocoll
    >>> async def worker(comm):
    ...     t = torch.ones(1)
    ...     try:
    ...         dist.all_reduce(t)
    ...     except aiocoll.BlockingCallError:
    ...         await dist.all_reduce(t, async_op=True)
    ...     return t.item()
    >>> aiocoll.spawn(worker, world=2)
    [2.0, 2.0]
    """


class TorchCompatError(AiocollError, RuntimeError):
    """The installed torch lacks something aiocoll relies on (outside the tested range).

    The message names the assumption and the torch releases aiocoll is tested on. It is
    raised before any data moves (mostly before any rank runs), instead of a crash or a
    wrong result:

    >>> import aiocoll
    >>> try:
    ...     _ = aiocoll.spawn(lambda comm: None, world=2)
    ... except aiocoll.TorchCompatError as e:  # on a torch outside the tested range
    ...     print(e)  # "aiocoll relies on ..., which torch X does not provide; ..."
    >>> issubclass(aiocoll.TorchCompatError, RuntimeError)
    True
    """
