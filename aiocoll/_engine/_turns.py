"""Sync ranks take turns: one rank thread runs at a time and hands over when it waits.

Rank threads that run at once share torch's random generators, contend for the GIL and
interleave differently on every run. Taking turns gives each rank its generators (the
rank whose turn it is has its states loaded, see ``_locals``), makes the interleaving a
function of the program (and of ``schedule_seed``), and lets the engine run in the
calling thread: the rank that completes a rendezvous resolves it at once, without a
round trip through the event loop.

A rank keeps its turn until it waits for a work that is not done (``TurnEvent.wait``)
or ends; the turn then goes to the rank that became ready first (or, under a seeded
schedule, to a ready rank the seed picks). A rank whose work completes becomes ready;
if no rank holds the turn then, it takes it at once.

Code that makes one rank wait for another outside aiocoll (a ``threading.Barrier``
shared by the ranks, a queue) would wait forever holding the turn. ``StallWatch`` sees a
rank that waits in ``threading`` or ``queue`` with other ranks ready, and lets the others
go on without it: the ranks then run at once until it next waits for a collective, and
``spawn`` warns that generators were shared meanwhile. A rank that waits in C code (a
store's ``get``) is not seen: run such code with ``spawn(..., sync_ranks="parallel")``.

A hand-over wakes the next rank on the CPU of the rank that hands over (``SameCpu``):
only one of them runs at a time, and waking a thread on another CPU costs far more than
the switch itself (measured here: 43 against 8 µs per hand-over between two threads).
"""

from __future__ import annotations

import _thread
import asyncio
import contextlib
import ctypes
import os
import queue
import random
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from types import FrameType
from typing import Any

__all__ = ["SameCpu", "StallWatch", "TurnEvent", "Turns"]


class SameCpu:
    """Wakes a rank thread on the CPU the waking thread runs on, after that thread sleeps, then lets it run as before.

    The thread handing its turn over is about to sleep, so the next one can run on its
    CPU at once: ``pin`` restricts the sleeping thread to that CPU just before it is
    woken, and ``unpin``, in the woken thread, gives it back the CPUs it had (so torch's
    intra-op threads, which inherit them, are not confined).

    Woken on the same CPU, a thread preempts the one that woke it at once (the scheduler
    favours a thread that slept), finds the GIL still held, and sleeps again until the
    waking thread lets go of it: three context switches per hand-over instead of one
    (2.6 against 1.3 us a hand-over between two threads here). So ``pin`` also gives the
    sleeping thread the SCHED_BATCH policy, whose threads do not preempt on waking, and
    ``unpin`` gives it back SCHED_OTHER; only where the thread that started the ranks
    runs under SCHED_OTHER (the rank threads inherit its policy).

    Off where the OS has no per-thread affinity, where only one CPU is allowed, or once
    a call fails (a thread's affinity changed by the program, a cpuset that changed):
    hand-overs then simply wake the thread wherever the OS likes. The policy is left
    alone once setting it fails.

    >>> cpus = SameCpu.detect()
    >>> cpus is None or isinstance(cpus, SameCpu)
    True
    """

    __slots__ = (
        "_batch",
        "_batched",
        "_getcpu",
        "_masks",
        "_pinned",
        "_pinned_to",
        "_start_cpu",
        "_started_from",
        "_tids",
        "on",
    )

    def __init__(self, size: int, getcpu: Callable[[], int], batch: bool = False) -> None:
        self._getcpu = getcpu
        self._tids = [0] * size  # each rank's native thread id, once it runs
        self._masks: list[set[int]] = [set()] * size  # the CPUs each rank's thread may run on
        self._pinned = [False] * size
        self._pinned_to = [-1] * size  # the CPU each pinned rank's thread is pinned to
        self._batched = [False] * size  # under SCHED_BATCH until its thread is woken
        self._started_from: set[int] | None = None  # the CPUs of the thread that started the ranks pinned
        self._start_cpu = -1  # the CPU they started on
        self._batch = batch  # whether pin gives SCHED_BATCH
        self.on = True

    @classmethod
    def detect(cls, size: int = 0) -> SameCpu | None:
        """One for ``size`` ranks, or None where threads cannot be pinned or it would not help."""
        setaffinity = getattr(os, "sched_setaffinity", None)
        if setaffinity is None or len(os.sched_getaffinity(0)) < 2:
            return None
        getcpu = _sched_getcpu()
        if getcpu is None:
            return None
        try:
            batch = hasattr(os, "SCHED_BATCH") and os.sched_getscheduler(0) == os.SCHED_OTHER
        except OSError:
            batch = False
        return cls(size, getcpu, batch)

    @contextlib.contextmanager
    def starting(self) -> Iterator[None]:
        """Around starting the rank threads: they start on the CPU of the thread that starts them.

        ``Thread.start`` waits for the new thread to run; with the new thread on another
        CPU, each start costs cross-CPU wake-ups (73 against 29 us a thread here). The
        threads inherit the pinned CPU (and SCHED_BATCH, as for a hand-over), and each
        gets the CPUs (and policy) of the starting thread back at its first turn
        (``unpin``); the starting thread gets them back at once.
        """
        mask: set[int] | None = None
        batch = False
        if self.on:
            try:
                mask = os.sched_getaffinity(0)
                cpu = self._getcpu()
                if cpu < 0:
                    raise OSError(ctypes.get_errno(), "sched_getcpu failed")
                os.sched_setaffinity(0, (cpu,))
            except OSError:
                self.on = False
                mask = None
            else:
                self._start_cpu = cpu
                batch = self._set_batch(0)
        self._started_from = mask  # (kept: a rank thread may register after this returns)
        try:
            yield
        finally:
            if batch:
                self._set_other(0)
            if mask is not None:
                try:
                    os.sched_setaffinity(0, mask)
                except OSError:
                    self.on = False

    def register(self, rank: int) -> None:
        """In rank ``rank``'s thread, before its first turn."""
        started_from = self._started_from
        if started_from is not None:  # started pinned (see starting): unpinned at its first turn
            self._masks[rank] = started_from
            self._pinned[rank] = True
            self._pinned_to[rank] = self._start_cpu
            self._batched[rank] = self._batch
        else:
            self._masks[rank] = os.sched_getaffinity(0)
        self._tids[rank] = threading.get_native_id()

    def pin(self, rank: int) -> None:
        """Before waking ``rank``: it wakes on this thread's CPU, once this thread sleeps."""
        tid = self._tids[rank]
        if not (self.on and tid):
            return
        try:
            cpu = self._getcpu()
            if cpu < 0:
                raise OSError(ctypes.get_errno(), "sched_getcpu failed")
            if self._pinned[rank] and self._pinned_to[rank] == cpu and self._batched[rank] == self._batch:
                return  # as it is still from its start (it has not run since)
            os.sched_setaffinity(tid, (cpu,))
        except OSError:
            self.on = False
            return
        self._pinned[rank] = True
        self._pinned_to[rank] = cpu
        if self._batch and self._set_batch(tid):
            self._batched[rank] = True

    def unpin(self, rank: int) -> None:
        """In rank ``rank``'s thread, once woken: its CPUs and policy are its own again."""
        if self._pinned[rank]:
            self._pinned[rank] = False
            if self._batched[rank]:
                self._batched[rank] = False
                self._set_other(0)
            try:
                os.sched_setaffinity(0, self._masks[rank])
            except OSError:
                self.on = False

    def _set_batch(self, tid: int) -> bool:
        if not self._batch:
            return False
        try:
            os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0))
        except OSError:
            self._batch = False
            return False
        return True

    def _set_other(self, tid: int) -> None:
        try:
            os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
        except OSError:
            self._batch = False

    def __repr__(self) -> str:
        return f"<SameCpu {'on' if self.on else 'off'} ranks={len(self._tids)}>"


_getcpu_fn: Callable[[], int] | None = None


def _sched_getcpu() -> Callable[[], int] | None:
    """libc's ``sched_getcpu``, looked up once (None where there is none)."""
    global _getcpu_fn
    if _getcpu_fn is None:
        try:
            fn = ctypes.CDLL(None).sched_getcpu
        except (OSError, AttributeError):
            return None
        fn.restype = ctypes.c_int
        fn.argtypes = []
        _getcpu_fn = fn
    return _getcpu_fn


class Turns:
    """Who runs now among a world's rank threads, and who is ready to run next.

    ``_mu`` guards the scheduling state; it is only ever taken last (the engine's lock
    may be held around ``ready``). Each rank thread sleeps on its own lock, released by
    whoever hands it the turn.
    """

    __slots__ = (
        "_cpus",
        "_mu",
        "_ready",
        "_rng",
        "_threads",
        "_waiting",
        "_wake",
        "detached",
        "free",
        "handovers",
        "holder",
        "on_turn",
    )

    def __init__(
        self,
        size: int,
        rng: random.Random | None,
        on_turn: Callable[[int], None],
        cpus: SameCpu | None = None,
    ) -> None:
        self._mu = _thread.allocate_lock()
        self._wake = [_thread.allocate_lock() for _ in range(size)]
        for lock in self._wake:
            lock.acquire()  # released by whoever hands the rank its turn
        self._ready: list[int] = []  # ranks waiting for their turn, in the order they became ready
        self._waiting: list[TurnEvent | None] = [None] * size  # what each sleeping rank waits for
        self._rng = rng  # a seeded schedule: which ready rank runs next
        self.on_turn = on_turn  # called in a rank's thread as it takes its turn
        self.holder: int | None = None
        self.handovers = 0
        self._threads = [0] * size  # each rank's thread id
        self.detached: list[str] = []  # what StallWatch saw, one line each time it let the others go on
        self.free = False  # the world was aborted: every rank runs at once, to its end
        self._cpus = cpus  # where a hand-over wakes the next rank (None: where the OS likes)

    def start(self, order: Iterable[int]) -> None:
        """Every rank thread is started: the first of ``order`` runs, the others are ready."""
        with self._mu:
            self._ready.extend(order)
            self._pass_on()

    def begin(self, rank: int) -> None:
        """In rank ``rank``'s thread, first thing: wait for its first turn."""
        self._threads[rank] = threading.get_ident()
        if self._cpus is not None:
            self._cpus.register(rank)
        self._wake[rank].acquire()
        self._took_turn(rank)

    def end(self, rank: int) -> None:
        """In rank ``rank``'s thread, last thing: give up the turn for good."""
        with self._mu:
            if self.holder == rank and not self.free:
                self._pass_on(sleeping=True)

    def free_all(self) -> None:
        """The world was aborted: stop taking turns, so that no rank waits for one that is busy.

        Every rank learns of the abort at its next collective, at once; one that holds
        the turn in a long computation no longer keeps the others from ending.
        """
        with self._mu:
            if self.free:
                return
            self.free = True
            self.holder = None
            for rank in self._ready:
                self._wake[rank].release()
            self._ready.clear()

    def event(self, rank: int) -> TurnEvent:
        """A one-shot event rank ``rank`` may wait on, giving up its turn meanwhile."""
        return TurnEvent(self, rank)

    def _pass_on(self, sleeping: bool = False) -> None:
        """With ``_mu`` held: hand the turn to the next ready rank, if any.

        ``sleeping``: the calling rank thread sleeps (or ends) right after, so the next
        rank is woken on its CPU.
        """
        ready = self._ready
        if not ready:
            self.holder = None
            return
        nxt = ready.pop(0 if self._rng is None else self._rng.randrange(len(ready)))
        self.holder = nxt
        self.handovers += 1
        if sleeping and self._cpus is not None:
            self._cpus.pin(nxt)
        self._wake[nxt].release()

    def _wait(self, ev: TurnEvent, timeout: float | None) -> bool:
        """Rank ``ev.rank`` (holding the turn) waits for ``ev``; false if ``timeout`` passed first.

        Returns holding the turn again either way.
        """
        rank = ev.rank
        with self._mu:
            if ev._flag:
                return True
            self._waiting[rank] = ev
            if self.holder == rank and not self.free:
                self._pass_on(sleeping=True)
        wake = self._wake[rank]
        if timeout is None:
            wake.acquire()
        elif not wake.acquire(True, max(timeout, 0.0)):
            with self._mu:
                if self._waiting[rank] is ev:  # not woken: wait for a turn, as a ready rank
                    self._waiting[rank] = None
                    self._make_ready(rank)
            wake.acquire()  # either way, the turn is handed over through this lock
            self._took_turn(rank)
            return ev._flag
        self._took_turn(rank)
        return True

    @contextlib.contextmanager
    def stepped_out(self, rank: int) -> Iterator[None]:
        """Rank ``rank`` (holding the turn) makes a call that may wait in C code for another
        rank: the ready ranks take turns meanwhile, and it takes a turn again after.

        A wait that aiocoll cannot see (a store's constructor waiting for its clients) would
        otherwise hold the turn until the call timed out.
        """
        with self._mu:
            if self.holder == rank and not self.free:
                self._pass_on()
        try:
            yield
        finally:
            with self._mu:
                back = not self.free  # (an aborted world runs every rank at once)
                if back:
                    self._make_ready(rank)
            if back:
                self._wake[rank].acquire()  # handed over through this lock, as after a wait
                self._took_turn(rank)

    def _took_turn(self, rank: int) -> None:
        if self._cpus is not None:
            self._cpus.unpin(rank)
        if not self.free:  # (ranks that run at once after an abort share the generators)
            self.on_turn(rank)

    def stalled(self) -> int | None:
        """The rank holding the turn, if it waits in ``threading`` or ``queue`` while others are ready."""
        with self._mu:
            holder = self.holder
            if holder is None or not self._ready:
                return None
            tid = self._threads[holder]
        frame = sys._current_frames().get(tid)
        if frame is None or not _blocking(frame):
            return None
        return holder

    def detach(self, rank: int, why: str) -> None:
        """Let the ready ranks go on while ``rank``, holding the turn, waits outside aiocoll."""
        with self._mu:
            if self.holder != rank or self.free:
                return
            self.detached.append(why)
            self._pass_on()

    def _make_ready(self, rank: int) -> None:
        """With ``_mu`` held: ``rank`` may run again."""
        if self.free:
            self._wake[rank].release()
        elif self.holder is None:
            self.holder = rank
            self.handovers += 1
            self._wake[rank].release()
        else:
            self._ready.append(rank)

    def _set(self, ev: TurnEvent) -> None:
        with self._mu:
            if self._waiting[ev.rank] is ev:
                self._waiting[ev.rank] = None
                self._make_ready(ev.rank)

    def snapshot(self) -> dict[str, Any]:
        """Who holds the turn, who is ready, who sleeps (for reports)."""
        with self._mu:
            return {
                "holder": self.holder,
                "ready": list(self._ready),
                "waiting": [r for r, ev in enumerate(self._waiting) if ev is not None],
                "handovers": self.handovers,
            }

    def __repr__(self) -> str:
        s = self.snapshot()
        return f"<Turns holder={s['holder']} ready={s['ready']} waiting={s['waiting']} handovers={s['handovers']}>"


def not_the_rank_s_thread(rank: int, what: str) -> str:
    """Why a wait is refused on a thread the rank started, for a work made on its own (``BlockingCallError``)."""
    return (
        f"rank {rank}: a wait for {what} on thread {threading.current_thread().name!r}, which the rank made on "
        "its own thread: while ranks take turns, only that thread may wait for it (waiting hands the rank's "
        "turn over); wait for it there, make the call on this thread, or run the ranks at once "
        "(spawn(..., sync_ranks='parallel'), aiocoll run --sync-ranks parallel)"
    )


class TurnEvent:
    """What a rank thread waits on for one work: set by the engine, waited on by the rank.

    The same interface as the event of ranks that run in parallel (``set``, ``is_set``,
    ``wait``); waiting gives the rank's turn away until it is set.
    """

    __slots__ = ("_flag", "_turns", "rank")

    def __init__(self, turns: Turns, rank: int) -> None:
        self._turns = turns
        self.rank = rank
        self._flag = False

    def set(self) -> None:
        if not self._flag:
            self._flag = True
            self._turns._set(self)

    def is_set(self) -> bool:
        return self._flag

    def wait(self, timeout: float | None = None) -> bool:
        """Whether it is set, after waiting up to ``timeout`` seconds (None: until it is)."""
        if self._flag:
            return True
        return self._turns._wait(self, timeout)

    def __repr__(self) -> str:
        return f"<TurnEvent rank={self.rank} {'set' if self._flag else 'clear'}>"


_BLOCKING_FILES = {threading.__file__, queue.__file__}


def _blocking(frame: FrameType) -> bool:
    return frame.f_code.co_filename in _BLOCKING_FILES


def _where(frame: FrameType) -> str:
    """``threading.Barrier.wait at file:line``: the primitive, and the line outside the stdlib that waits in it."""
    what = frame.f_code.co_qualname if hasattr(frame.f_code, "co_qualname") else frame.f_code.co_name
    f: FrameType | None = frame
    while f is not None and _blocking(f):
        what = f"{os.path.splitext(os.path.basename(f.f_code.co_filename))[0]}.{f.f_code.co_qualname}"
        f = f.f_back
    site = "?" if f is None else f"{f.f_code.co_filename}:{f.f_lineno}"
    return f"{what} at {site}"


class StallWatch:
    """Checks, from the loop, that the rank holding the turn is not waiting for another rank.

    A rank seen waiting in ``threading`` or ``queue`` for ``after`` seconds while other
    ranks are ready is detached (``Turns.detach``): the others run without waiting for it.
    """

    __slots__ = ("_after", "_every", "_handle", "_loop", "_since", "_turns")

    def __init__(self, turns: Turns, loop: asyncio.AbstractEventLoop, every: float = 0.05, after: float = 0.2) -> None:
        self._turns = turns
        self._loop = loop
        self._every = every
        self._after = after
        self._since: tuple[int, int, float] | None = None  # (rank, handovers, first seen)
        self._handle: asyncio.TimerHandle | None = None

    def start(self) -> None:
        self._handle = self._loop.call_later(self._every, self._tick)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _tick(self) -> None:
        turns = self._turns
        rank = turns.stalled()
        now = time.monotonic()
        if rank is None:
            self._since = None
        elif self._since is None or self._since[:2] != (rank, turns.handovers):
            self._since = (rank, turns.handovers, now)
        elif now - self._since[2] >= self._after:
            frame = sys._current_frames().get(turns._threads[rank])
            where = "?" if frame is None else _where(frame)
            turns.detach(
                rank,
                f"rank {rank} waited in {where} while holding its turn; the other ranks went on "
                "without it, and the ranks ran at once (sharing random generators) until it next "
                "waited for a collective",
            )
            self._since = None
        self._handle = self._loop.call_later(self._every, self._tick)

    def __repr__(self) -> str:
        return f"<StallWatch every={self._every}s after={self._after}s>"
