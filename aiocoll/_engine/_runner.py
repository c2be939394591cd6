"""The op runner: where a ready op runs, in what order ops complete, and how their ranks are released.

A collective whose rendezvous completed, or a matched send and recv, is ready to run.
Small CPU ops run inline, at once. Large CPU ops run on a worker thread and CUDA ops on
a side stream (``_device``): one at a time, and every op ready meanwhile waits behind
it, so ops complete in the order they became ready, as they would inline (a rank may
issue two collectives on one tensor without awaiting the first). Ops of a group that
spans processes run through its bridge (``_hybrid``), as do sends and recvs whose peer
is in another process.

Every op under way that will complete with no rank's call (off the loop, queued, in
another process, a seeded release on its way) is counted in flight, so that the
world's ``Liveness`` does not take its waiting ranks for deadlocked. With a seeded
schedule, a collective releases its ranks in a random order, some a few loop turns late.

It names the engine's works, rendezvous and world only for type checking: the world
(``_engine._world``) imports this module, not the other way round.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

from .._errors import AiocollError, CollectiveMismatchError, WorldAbortedError
from .._ops import _cuda, _device
from ._liveness import Liveness

if TYPE_CHECKING:
    from .._ops import Call
    from ._groups import Rendezvous
    from ._rank import EngineWork
    from ._world import World

__all__ = ["OpRunner"]

_now = time.perf_counter


class OpRunner:
    """Runs a world's ready ops, in order, inline or off the loop, and releases their ranks."""

    __slots__ = ("_engine", "_liveness", "_loop", "_queue", "_remote", "busy", "inline_bytes")

    def __init__(self, engine: World, loop: asyncio.AbstractEventLoop, liveness: Liveness) -> None:
        self._engine = engine
        self._loop = loop
        self._liveness = liveness  # told of ops in flight, and checked when one ends
        self.inline_bytes = _device.INLINE_BYTES  # ops moving more run on the worker thread
        # the works of the op running off the loop (None: none is), and the ops that became
        # ready behind it, with what runs each
        self.busy: Sequence[EngineWork | None] | None = None
        self._queue: deque[tuple[Sequence[EngineWork | None], Callable[[], None]]] = deque()
        # works waiting on other processes (hybrid worlds): collectives in an exchange, p2p
        self._remote: set[EngineWork] = set()

    # -- running ops, in order ---------------------------------------------------------

    def serial(self, works: Sequence[EngineWork | None], fn: Callable[[], None]) -> None:
        """Run ``fn`` now, or after the op running off the loop and those queued behind it.

        Ops complete in the order they became ready, as they would inline: a rank may
        issue two collectives on one tensor without awaiting the first.
        """
        if self.busy is None and not self._queue:
            fn()
        else:
            self._liveness.in_flight += 1  # queued: it will complete, so no deadlock meanwhile
            self._queue.append((works, fn))

    def run(self, rdv: Rendezvous, op: Any) -> None:
        """Run ``op`` over a completed rendezvous (its checks passed) and release its ranks."""
        if self.busy is not None:  # behind an op running off the loop
            self.serial(rdv.works, functools.partial(self.run, rdv, op))
            return
        engine = self._engine
        # (a rendezvous runs here once every member arrived: it has no None left)
        where = _device.placement(cast("list[Call]", rdv.calls), self.inline_bytes)
        if where is _device.Placement.INLINE or (
            # a rank thread taking turns runs CPU ops itself: no rank runs meanwhile, and
            # the loop it would spare is not in its way
            where is _device.Placement.THREAD and engine.lock is not None and not engine.on_loop_thread()
        ):
            try:
                results = op.run(rdv.calls)
            except Exception as e:
                self.failed(rdv.works, e)
                return
            self._finish(rdv, results)
            return
        self.busy = rdv.works
        self._liveness.in_flight += 1
        if not engine.on_loop_thread():  # a rank thread taking turns: streams are polled from the loop
            engine.call_soon_threadsafe(self._start_off_loop, rdv, op, where)
        else:
            self._start_off_loop(rdv, op, where)

    def _start_off_loop(self, rdv: Rendezvous, op: Any, where: _device.Placement) -> None:
        if self._engine.aborted is not None:
            self.busy = None
            self._liveness.in_flight -= 1
            return
        if where is _device.Placement.CUDA:
            # (a rendezvous runs here once every member arrived: it has no None left)
            calls = cast("list[Call]", rdv.calls)
            fut = _cuda.run_cuda(self._loop, op.run, calls, [w._cuda if w else None for w in rdv.works])
            for w in rdv.works:
                if w is not None:
                    w._enqueued()
        else:
            fut = _device.run_in_worker(self._loop, op.run, rdv.calls)
        fut.add_done_callback(functools.partial(self._engine.locked, self._ran, rdv))

    def _ran(self, rdv: Rendezvous, fut: asyncio.Future[list[Any]]) -> None:
        """An op that ran off the loop is done: resolve its ranks, then run what queued behind it."""
        self.busy = None
        lv = self._liveness
        lv.in_flight -= 1
        # (cancelled: the CUDA poller was stopped, or the executor shut down with the loop)
        exc = WorldAbortedError(f"{rdv.where}: the op was cancelled") if fut.cancelled() else fut.exception()
        if self._engine.aborted is not None:
            pass  # its ranks were released by the abort
        elif exc is not None:
            self.failed(rdv.works, exc)
        else:
            self._finish(rdv, fut.result())
        while self._queue and self.busy is None:
            _, fn = self._queue.popleft()
            lv.in_flight -= 1
            fn()
        lv.check()

    # -- releasing ranks ---------------------------------------------------------------

    def _finish(self, rdv: Rendezvous, results: list[Any]) -> None:
        engine = self._engine
        if engine.rng is not None and engine.turns is None:  # (ranks that take turns are shuffled by turns)
            self._resolve_shuffled(rdv.works, results)
        else:
            for w, res in zip(rdv.works, results, strict=True):
                if w is not None:  # None: a member in another process (hybrid worlds)
                    w._resolve(res)
                    w._rdv = None  # break the work <-> rendezvous cycle: free it by refcount, not by gc
        if rdv.stamp is not None:
            rdv.stamp.ok()

    def _resolve_shuffled(self, works: list[EngineWork | None], results: list[Any]) -> None:
        """A seeded schedule: release the ranks in a random order, some a few loop turns late.

        The order in which ranks are released is the order in which they run next, so
        this reorders what the ranks do after each collective, reproducibly per seed.
        """
        rng = self._engine.rng
        assert rng is not None
        pairs = [(w, res) for w, res in zip(works, results, strict=True) if w is not None]
        rng.shuffle(pairs)
        for w, res in pairs:
            w._rdv = None
            turns = rng.randrange(3)
            if turns:
                self._liveness.in_flight += 1  # a release on its way: not a deadlock meanwhile
                self._loop.call_soon(self._release_later, w, res, turns - 1)
            else:
                w._resolve(res)

    def _release_later(self, w: EngineWork, res: Any, turns: int) -> None:
        if turns:
            self._loop.call_soon(self._release_later, w, res, turns - 1)
            return
        self._liveness.in_flight -= 1
        w._resolve(res)

    def failed(self, works: Sequence[EngineWork | None], e: BaseException) -> None:
        """An op over ``works`` raised ``e``: every rank gets it, and the world is aborted."""
        # Arguments were validated before the call joined, so this is unexpected: keep the
        # original error type for every rank, and abort the world.
        for w in works:
            if w is not None:
                w._resolve(exc=e)
        self._engine.abort(None, e)

    def fail_each(self, works: Sequence[EngineWork | None], cls: type[AiocollError], message: str) -> None:
        """Fail ``works`` with an error ``cls(message)`` each (one per rank), and abort the world with the first."""
        first: AiocollError | None = None
        for w in works:
            if w is not None:
                e = cls(message)
                first = first or e
                w._resolve(exc=e)
        self._engine.abort(None, first or cls(message))

    # -- ops in other processes (hybrid worlds) ------------------------------------------

    def exchange(self, rdv: Rendezvous, fut: asyncio.Future[list[Any]]) -> None:
        """The bridge runs ``rdv``'s op with the other processes: release its ranks when ``fut`` ends."""
        self._liveness.in_flight += 1  # the exchange will end (or fail): no deadlock meanwhile
        self._remote.update(w for w in rdv.works if w is not None)
        fut.add_done_callback(functools.partial(self._exchanged, rdv))

    def _exchanged(self, rdv: Rendezvous, fut: asyncio.Future[list[Any]]) -> None:
        self._liveness.in_flight -= 1
        self._remote.difference_update(rdv.works)
        exc = None if fut.cancelled() else fut.exception()
        if self._engine.aborted is not None:
            pass  # its ranks were released by the abort
        elif fut.cancelled():
            self.failed(rdv.works, WorldAbortedError(f"{rdv.where}: the exchange with other processes was cancelled"))
        elif isinstance(exc, CollectiveMismatchError):
            self.fail_each(rdv.works, CollectiveMismatchError, str(exc))
        elif exc is not None:
            self.failed(rdv.works, exc)
        else:
            self._finish(rdv, fut.result())
        self._liveness.check()

    def remote(self, work: EngineWork, fut: asyncio.Future[Any]) -> None:
        """A send or recv whose peer is in another process: complete ``work`` when ``fut`` does."""
        self._liveness.in_flight += 1  # the other process will answer, or the group's timeout will
        self._remote.add(work)
        fut.add_done_callback(functools.partial(self._remote_done, work))

    def _remote_done(self, work: EngineWork, fut: asyncio.Future[Any]) -> None:
        self._liveness.in_flight -= 1
        self._remote.discard(work)
        exc = WorldAbortedError("cancelled") if fut.cancelled() else fut.exception()
        if exc is not None:
            self.failed((work,), exc)
        else:
            work._resolve(fut.result())
            if work._stamp is not None:
                work._stamp.all_here()
                work._stamp.ok()
        self._liveness.check()

    # -- abort -------------------------------------------------------------------------

    def abort(self, error: Callable[[], BaseException]) -> None:
        """The world was aborted: fail the works of the ops under way (each with its own ``error()``).

        An op running off the loop (or an exchange with other processes) cannot be
        stopped; its ranks are released now, and what it writes when it ends goes
        nowhere. Queued ops never start.
        """
        for works in [self.busy or (), *(ws for ws, _ in self._queue), list(self._remote)]:
            for w in works:
                if w is not None:
                    w._resolve(exc=error())
        self._liveness.in_flight -= len(self._queue)
        self._queue.clear()

    def __repr__(self) -> str:
        busy = "idle" if self.busy is None else "busy"
        return f"<OpRunner {busy} queued={len(self._queue)} remote={len(self._remote)}>"
