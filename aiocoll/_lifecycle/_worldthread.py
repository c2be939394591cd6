"""``WorldThread``: a world run on a loop of its own, on a helper thread, that its caller can give up on.

Sync ranks are threads, and threads cannot be stopped: a rank stuck outside a collective
never returns. The pytest plugin and the process harness run their worlds here, so that
the test's own thread waits with a deadline (or until ^C), cancels the world (which
releases every rank waiting in a collective) and leaves behind what does not end,
instead of hanging with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
import time
from collections.abc import Callable, Coroutine
from types import FrameType
from typing import Any, Generic, NoReturn, TypeVar

from ._config import LoopChoice, loop_factory
from ._driver import RankThread

__all__ = ["WorldThread"]

T = TypeVar("T")

_SLICE = 0.2  # seconds: how soon a ^C is seen while the caller waits for the world


async def _ran() -> NoReturn:
    raise RuntimeError("this WorldThread has run already")


class WorldThread(Generic[T]):
    """Runs ``main()`` on a new loop (``loop``: as ``spawn``'s) on a helper thread.

    ``main`` makes the coroutine that runs the world (``spawn_async``, ``run_world``)::

        wt = WorldThread(lambda: spawn_async(fn, 4), "auto")
        wt.start()
        if not wt.wait(60):
            wt.cancel()          # ranks waiting in collectives are released
            wt.wait(2)           # those busy elsewhere may never end
        results = wt.result()
    """

    def __init__(self, main: Callable[[], Coroutine[Any, Any, T]], loop: LoopChoice) -> None:
        self._main = main
        self._loop = loop
        self._done = threading.Event()
        self._lock = threading.Lock()  # orders cancel() against the world's start
        self._cancelled = False
        self._task: asyncio.Task[T] | None = None
        self._value: T | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="aiocoll world loop", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Whether the world has ended, after waiting up to ``timeout`` seconds.

        Waits in slices: a ^C (SIGINT) may be delivered to a rank thread, and then only
        wakes the main thread at its next bytecode, which a long wait would postpone.
        """
        if timeout is not None and timeout <= _SLICE:
            return self._done.wait(timeout)
        end = None if timeout is None else time.monotonic() + timeout
        while not self._done.wait(_SLICE if end is None else max(0.0, min(_SLICE, end - time.monotonic()))):
            if end is not None and time.monotonic() >= end:
                return False
        return True

    @property
    def error(self) -> BaseException | None:
        """What the world raised (once ended): a rank's error, aiocoll's report, or CancelledError."""
        return self._error

    def result(self) -> T:
        """The world's result (once ended); raises what it raised."""
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]  # (set: the world ended without an error)

    def cancel(self) -> None:
        """Cancel the world (from any thread); a world not started yet will not start."""
        with self._lock:
            self._cancelled = True
            task = self._task
        if task is not None:
            # RuntimeError: the loop closed meanwhile, the world has ended anyway
            with contextlib.suppress(RuntimeError):
                task.get_loop().call_soon_threadsafe(task.cancel)

    def rank_frames(self) -> dict[int, FrameType]:
        """The frame each of the world's rank threads still alive is running now, by rank."""
        frames = sys._current_frames()
        out: dict[int, FrameType] = {}
        for t in threading.enumerate():
            # (not those of a world started inside one of these ranks: its loop is another thread)
            if isinstance(t, RankThread) and t.loop is self._thread and t.is_alive():
                frame = frames.get(t.ident or -1)
                if frame is not None:
                    out[t.rank] = frame
        return out

    def _run(self) -> None:
        async def main() -> T:
            with self._lock:
                if self._cancelled:
                    raise asyncio.CancelledError
                self._task = asyncio.current_task()
            return await self._main()

        try:
            with asyncio.Runner(loop_factory=loop_factory(self._loop)) as runner:
                self._value = runner.run(main())
        except BaseException as e:  # handed to the caller's thread
            self._error = e
        finally:
            with self._lock:
                # what only the run needed: the task keeps the closed loop (uvloop's: 256 KB)
                # and ``main`` is often a closure over this thread's owner, a reference cycle
                # that would keep both alive after the owner is let go, until a collection
                self._task = None
                self._main = _ran
            self._done.set()

    def __repr__(self) -> str:
        state = "ended" if self._done.is_set() else "cancelled" if self._cancelled else "running"
        return f"<WorldThread {state}>"
