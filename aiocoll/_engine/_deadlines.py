"""When pending operations time out: one loop timer for every pending rendezvous and p2p work.

A world's timeout is the same for every operation, so deadlines come in the order the
operations were entered and a FIFO holds them sorted. One timer is armed for the
earliest; entries whose operation completed meanwhile are dropped lazily (on the next
``add`` or when the timer fires), so the common case (an operation that completes well
within the timeout) costs an append and a check, instead of a timer made and cancelled
per operation. ``add`` may be called from a rank thread that runs the engine (sync
ranks taking turns): the timer is then armed through the loop.

>>> import asyncio
>>> async def main():
...     fired = []
...     d = Deadlines(asyncio.get_running_loop(), 0.01, lambda x: x != "done", fired.append, lambda f, *a: f(*a))
...     d.add("done"); d.add("late")
...     await asyncio.sleep(0.05)
...     return fired
>>> asyncio.run(main())
['late']
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

__all__ = ["Deadlines"]

_COMPACT_MIN = 64  # entries before the first compaction


class Deadlines:
    """Calls ``expire(item)`` once ``timeout`` seconds after ``add(item)`` if ``pending(item)`` still holds.

    ``run(fn, *args)`` runs the timer's callback as the engine needs it (under its lock
    when rank threads run the engine too).
    """

    __slots__ = ("_armed", "_compact_at", "_entries", "_expire", "_loop", "_loop_thread", "_pending", "_run", "timeout")

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        timeout: float,
        pending: Callable[[Any], bool],
        expire: Callable[[Any], None],
        run: Callable[..., None],
        loop_thread: int | None = None,
    ) -> None:
        self._loop = loop
        # the loop's thread: the one making it, unless told (a rank thread may make one)
        self._loop_thread = threading.get_ident() if loop_thread is None else loop_thread
        self.timeout = timeout
        self._pending = pending
        self._expire = expire
        self._run = run
        self._entries: deque[tuple[float, Any]] = deque()
        self._armed = False
        self._compact_at = _COMPACT_MIN

    def add(self, item: Any) -> None:
        """``item`` times out ``timeout`` seconds from now unless it completes first."""
        entries = self._entries
        while entries and not self._pending(entries[0][1]):
            entries.popleft()  # completed: keep the queue as short as what is pending
        if len(entries) >= self._compact_at:
            # an operation long pending at the head keeps completed ones (and their
            # tensors) behind it: drop those, so the queue stays within twice what is pending
            self._entries = entries = deque(e for e in entries if self._pending(e[1]))
            self._compact_at = max(_COMPACT_MIN, 2 * len(entries))
        entries.append((time.monotonic() + self.timeout, item))
        if not self._armed:
            self._armed = True
            if threading.get_ident() == self._loop_thread:
                self._arm()
            else:
                with contextlib.suppress(RuntimeError):  # the loop is closed: the world is gone
                    self._loop.call_soon_threadsafe(self._run, self._arm)

    def clear(self) -> None:
        """Nothing is pending any more (the world was aborted)."""
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def _arm(self) -> None:
        if not self._entries:
            self._armed = False
            return
        delay = self._entries[0][0] - time.monotonic()
        self._loop.call_later(max(delay, 0.0), self._run, self._fire)

    def _fire(self) -> None:
        entries = self._entries
        now = time.monotonic()
        while entries:
            deadline, item = entries[0]
            if not self._pending(item):
                entries.popleft()
                continue
            if deadline > now:
                break
            entries.popleft()
            self._expire(item)
        self._arm()

    def __repr__(self) -> str:
        return f"<Deadlines {len(self._entries)} entries, timeout={self.timeout}s armed={self._armed}>"
