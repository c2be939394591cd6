"""Torch completions into an asyncio loop: a ``dist.Work`` or torch Future as an ``asyncio.Future``.

- ``bridge_work(work, loop)`` / ``bridge_future(fut, loop)``: completed with
  ``call_soon_threadsafe`` from whichever thread torch completes on. Works without a
  future (gloo's send, recv and reduce-scatters) are waited on in a helper thread; works
  on an accelerator (NCCL) are polled from the loop until the op is done.
- ``when_done(work, loop, fn)``: the same, as a callback (what ``Issuer`` and the
  checks use).
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable

import torch
import torch.distributed as dist

from .._ops import _cuda

__all__ = ["bridge_future", "bridge_work", "when_done"]

_Done = Callable[[BaseException | None], None]


# -- bridging torch completions into the loop ----------------------------------------------


# Completions arrive on torch's threads (gloo's workers) or ours. The callback we hand over
# is kept in a one-item box that only the loop empties: were the last reference to it
# (and through it to a Comm, its issuer and the process group) dropped on a gloo worker
# thread, after destroy_process_group, the group would be destroyed on its own worker
# thread, which aborts the process ("terminate called without an active exception").


def _call_on(loop: asyncio.AbstractEventLoop, box: list[_Done], exc: BaseException | None) -> None:
    with contextlib.suppress(RuntimeError):  # a closed loop: nobody is left to tell
        loop.call_soon_threadsafe(_take_and_call, box, exc)


def _take_and_call(box: list[_Done], exc: BaseException | None) -> None:
    box.pop()(exc)


class _Waiters:
    """Daemon threads that block in ``work.wait()`` for works that have no future.

    Grows on demand (a pending recv holds its thread until a send arrives or the group's
    timeout) and never joins at exit, so a forgotten recv cannot hold the process.
    """

    def __init__(self) -> None:
        self._q: queue.SimpleQueue[tuple[dist.Work, asyncio.AbstractEventLoop, list[_Done]]] = queue.SimpleQueue()
        self._idle = 0
        self._lock = threading.Lock()

    def submit(self, work: dist.Work, loop: asyncio.AbstractEventLoop, box: list[_Done]) -> None:
        with self._lock:
            if self._idle:
                self._idle -= 1
            else:
                threading.Thread(target=self._run, name="aiocoll-pg-wait", daemon=True).start()
        self._q.put((work, loop, box))

    def _run(self) -> None:
        while True:
            work, loop, box = self._q.get()
            exc: BaseException | None = None
            try:
                work.wait()
            except BaseException as e:
                exc = e
            _call_on(loop, box, exc)
            del work, loop, box, exc
            with self._lock:
                self._idle += 1


_waiters = _Waiters()


class _Completed:
    """``work.is_completed()`` as an event the loop can poll (``_cuda.watch``)."""

    __slots__ = ("work",)

    def __init__(self, work: dist.Work) -> None:
        self.work = work

    def query(self) -> bool:
        return bool(self.work.is_completed())


def when_done(
    work: dist.Work, loop: asyncio.AbstractEventLoop, fn: _Done, *, on_device: bool = False, wait: bool = True
) -> None:
    """Call ``fn(None)`` (or ``fn(error)``) on ``loop``'s thread once ``work`` completes.

    ``on_device``: the work runs on an accelerator's stream. NCCL completes such a work's
    future when the op is *enqueued*; the op is done once ``work.is_completed()`` (a
    non-blocking event query), which the loop then polls as it polls aiocoll's own CUDA
    ops. Then ``work.wait()`` (``wait=True``) raises the op's error, if any, and orders the
    loop thread's current stream after the op, without blocking: the op is done. Pass
    ``wait=False`` for a barrier, whose ``wait()`` synchronises the whole current stream.
    """
    if on_device:
        then = fn

        def finish() -> None:
            if wait:
                work.wait()

        def fn(exc: BaseException | None) -> None:  # on the loop
            if exc is not None:
                then(exc)
                return
            polled = _cuda.watch(loop, _Completed(work), finish)
            polled.add_done_callback(lambda f: then(f.exception()))

    box = [fn]
    try:
        tfut = work.get_future()
    except RuntimeError:  # "Work::getFuture not implemented" (gloo: send, recv, reduce-scatters)
        _waiters.submit(work, loop, box)
        return

    def done(f: torch.futures.Future[object]) -> None:
        exc: BaseException | None = None
        try:
            f.value()  # raises the op's error
        except BaseException as e:
            exc = e
        _call_on(loop, box, exc)

    tfut.add_done_callback(done)


def bridge_work(
    work: dist.Work, loop: asyncio.AbstractEventLoop | None = None, *, on_device: bool = False
) -> asyncio.Future[None]:
    """An asyncio future of ``loop`` (default: the running loop) completed when ``work`` is.

    Its result is None, or the torch error the work failed with; ``on_device`` as for
    :func:`when_done`. For use on a real group::

        w = dist.all_reduce(t, async_op=True)
        await aiocoll._bridge._pgbridge.bridge_work(w)          # the loop runs other tasks meanwhile
    """
    loop = loop or asyncio.get_running_loop()
    fut: asyncio.Future[None] = loop.create_future()

    def done(exc: BaseException | None) -> None:
        if not fut.done():
            if exc is None:
                fut.set_result(None)
            else:
                fut.set_exception(exc)

    when_done(work, loop, done, on_device=on_device)
    return fut


def bridge_future(
    tfut: torch.futures.Future[object], loop: asyncio.AbstractEventLoop | None = None
) -> asyncio.Future[object]:
    """An asyncio future of ``loop`` holding ``tfut``'s value (or error) once it has one.

    ``tfut``'s callback may run on any thread; the result reaches the loop through
    ``call_soon_threadsafe``::

        value = await aiocoll._bridge._pgbridge.bridge_future(work.get_future())
    """
    loop = loop or asyncio.get_running_loop()
    fut: asyncio.Future[object] = loop.create_future()

    box: list[asyncio.Future[object]] = [fut]  # emptied on the loop (see _call_on)

    def settle(f: torch.futures.Future[object]) -> None:
        out = box.pop()
        if out.done():
            return
        try:
            out.set_result(f.value())
        except BaseException as e:
            out.set_exception(e)

    def done(f: torch.futures.Future[object]) -> None:
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is left to tell
            loop.call_soon_threadsafe(settle, f)

    tfut.add_done_callback(done)
    return fut
