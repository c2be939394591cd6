"""Who is still there: each process's heartbeat in the job's store.

Across processes a peer that exits or dies is noticed by the transport only sometimes
(gloo sees a closed socket; a stopped process keeps its sockets open) and then only with
the transport's message, which does not say who. ``Presence`` keeps a counter per process
in the default group's store, bumped from a daemon thread, and a "left" key set at exit,
so that a survivor can name the processes gone. Used by the cross-process checks of
``from_process_group`` (``_xcheck``) and by hybrid worlds (``_hybrid``).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from . import _torch
from ._errors import AiocollError

__all__ = ["Presence", "StoreUnreachable"]


class StoreUnreachable(AiocollError, RuntimeError):
    """The store the heartbeats live in cannot be reached (the process that hosts it is gone)."""


class Presence:
    """This process's heartbeat in the default group's store, and a reader of the others'.

    Keys ``aiocoll/<restart>/beat/<global rank>`` (a counter bumped every ``INTERVAL``
    seconds by a daemon thread) and ``.../left/<global rank>`` (set at interpreter exit).
    ``store.add(key, 0)`` reads a counter without blocking, even before it exists; every
    store call runs off the event loop. One per default group, made by ``of()``: a
    process's checked Comms and hybrid worlds share it.
    """

    INTERVAL = 0.2
    STALE = 1.0  # a counter that stood still this long belongs to a process that is gone

    _current: Presence | None = None
    _lock = threading.Lock()

    def __init__(self, store: Any, rank: int, pg: dist.ProcessGroup) -> None:
        self.store = store
        self.rank = rank
        self._pg_id = id(pg)
        self.prefix = f"aiocoll/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
        self._stop = threading.Event()
        self.error: BaseException | None = None  # the store failed under the beating thread
        self.store.add(self._key("beat", rank), 1)  # alive from now on, before any peer looks
        self._thread = threading.Thread(target=self._beat, name="aiocoll-heartbeat", daemon=True)
        self._thread.start()
        atexit.register(self.leave)

    @classmethod
    def of(cls, pg: dist.ProcessGroup) -> Presence:
        """The presence of this process in the job of the default group (started at first use)."""
        default = _torch.default_group()
        with cls._lock:
            cur = cls._current
            if cur is None or cur._pg_id != id(default):
                if cur is not None:
                    cur.stop()
                cur = cls._current = cls(_torch.default_store(), dist.get_rank(), default)
            return cur

    def _key(self, kind: str, rank: int) -> str:
        return f"{self.prefix}{kind}/{rank}"

    def _beat(self) -> None:
        key = self._key("beat", self.rank)
        while not self._stop.wait(self.INTERVAL):
            try:
                self.store.add(key, 1)
            except Exception as e:  # the store's host is gone: nothing left to tell
                self.error = e
                return

    def stop(self) -> None:
        self._stop.set()
        atexit.unregister(self.leave)

    def leave(self) -> None:
        """Say that this process leaves (at exit): the others name it at once."""
        self._stop.set()
        self._thread.join(1.0)
        with contextlib.suppress(Exception):
            self.store.add(self._key("left", self.rank), 1)

    def _read(self, kind: str, rank: int) -> int:
        try:
            return int(self.store.add(self._key(kind, rank), 0))
        except Exception as e:
            raise StoreUnreachable(f"the store is unreachable ({str(e).splitlines()[0] if str(e) else e!r})") from e

    def gone(self, ranks: Sequence[int]) -> tuple[list[int], list[int]]:
        """(left, silent): of global ``ranks``, those that left, else those whose heartbeat stopped.

        Blocks up to ``STALE`` seconds (run it in a thread). Ranks that never beat (no
        checked Comm or hybrid world there) are never called silent.
        """
        left = [r for r in ranks if self._read("left", r)]
        if left:
            return left, []
        seen = {r: self._read("beat", r) for r in ranks}
        still = [r for r in ranks if seen[r] > 0]
        deadline = time.monotonic() + self.STALE
        while still and time.monotonic() < deadline:
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
            left = [r for r in still if self._read("left", r)]
            if left:
                return left, []
            still = [r for r in still if self._read("beat", r) == seen[r]]
        return [], still
