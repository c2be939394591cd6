"""Who is still there: each process's heartbeat in the job's store, and its state on this host.

Across processes a peer that exits or dies is noticed by the transport only sometimes
(gloo sees a closed socket; a stopped process keeps its sockets open) and then only with
the transport's message, which does not say who. ``Presence`` keeps, per process, in the
default group's store: who it is (host, pid, start time), a counter bumped from a daemon
thread, and a "left" key set at exit. A survivor names the processes gone:

* a peer on this host is looked up in ``/proc``: its state is the truth. A live peer is
  never named, however long its heartbeat stalls (a C call that holds its GIL, a long
  garbage collection); one that is gone is named at once, one stopped by a signal after
  ``STOPPED`` seconds;
* a peer on another host can only be judged by its heartbeat: it is named after its
  counter stood still for ``STALE`` seconds, which is therefore long.

Used by the cross-process checks of ``from_process_group`` (``_xcheck``) and by hybrid
worlds (``_hybrid``).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import dataclasses
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist

from .. import _torch
from .._errors import AiocollError

__all__ = ["Presence", "StoreUnreachable", "parse_stat"]


class StoreUnreachable(AiocollError, RuntimeError):
    """The store the heartbeats live in cannot be reached (the process that hosts it is gone)."""

    @classmethod
    def of(cls, e: Exception) -> StoreUnreachable:
        """The error for the store's exception ``e`` (its first line)."""
        return cls(f"the store is unreachable ({str(e).splitlines()[0] if str(e) else e!r})")


# Flags of the kernel's task: it has begun to exit, or is writing a core dump (a fatal
# signal; its state stays R or S and its sockets open for as long as the dump takes).
_PF_DYING = 0x4 | 0x200  # PF_EXITING | PF_DUMPCORE


def parse_stat(text: str) -> tuple[str, int]:
    """(state letter, start time in clock ticks) from the text of ``/proc/<pid>/stat``.

    The state is ``"X"`` (dead) for a task that has begun to exit or dumps core: a
    killed process's state stays ``R`` or ``D`` while the kernel tears it down, and closes
    its sockets, before it becomes a zombie (``Z``). The command name (field 2) is in
    parentheses and may hold spaces and parentheses itself, so the fields are counted
    from the last ``)``.

    >>> parse_stat("42 (a) b) S 1 42 42 0 -1 4194560 0 0 0 0 0 0 0 0 20 0 1 0 123456 0 0")
    ('S', 123456)
    >>> parse_stat("42 (a) b) R 1 42 42 0 -1 4194564 0 0 0 0 0 0 0 0 20 0 1 0 123456 0 0")
    ('X', 123456)
    >>> parse_stat("42 (a) b) S 1 42 42 0 -1 4195072 0 0 0 0 0 0 0 0 20 0 1 0 123456 0 0")
    ('X', 123456)
    """
    rest = text[text.rindex(")") + 2 :].split()
    state, flags, start = rest[0], int(rest[6]), int(rest[19])  # fields 3, 9 and 22 of proc(5)
    return ("X" if flags & _PF_DYING else state), start


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, start time) of process ``pid`` on this host; None if there is no such process.

    Raises ``PermissionError`` if the process exists but cannot be read (``/proc``
    mounted with ``hidepid``, another user's process): then nobody here can tell.
    """
    try:
        return parse_stat(Path(f"/proc/{pid}/stat").read_text())
    except (FileNotFoundError, ProcessLookupError):
        pass
    try:
        os.kill(pid, 0)  # hidden rather than gone? PermissionError says it exists
    except ProcessLookupError:
        return None
    raise PermissionError(f"process {pid} exists but /proc does not show it")


def _this_host() -> str | None:
    """This kernel's boot id and pid namespace: processes that share them see each other's pids.

    None where there is no ``/proc`` to read (not Linux).
    """
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        ns = os.stat("/proc/self/ns/pid").st_ino
        if os.readlink("/proc/self") != str(os.getpid()):
            return None  # a /proc of another pid namespace (unshare -p without a remount)
        stat = _stat(os.getpid())
    except OSError:
        return None
    return f"{boot}/{ns}" if stat is not None else None


@dataclasses.dataclass(frozen=True)
class _Sighting:
    """One look at one peer: from the store, and from ``/proc`` if it runs on this host."""

    left: bool
    beat: int  # its heartbeat counter (0: it never beat)
    pid: int | None  # on this host; None elsewhere, or where /proc cannot tell
    state: str | None  # its /proc state letter ("X": exiting, see parse_stat); "" if its process is gone

    def dead(self) -> str | None:
        """How it went, if it did."""
        if self.left:
            return "exited"
        if self.pid is not None and self.state in ("", "Z", "X"):
            return f"died (pid {self.pid} on this host is gone)"
        return None


class Presence:
    """This process's heartbeat and identity in the default group's store, and a reader of the others'.

    Keys ``aiocoll/<restart>/who/<global rank>`` (``<host>|<pid>|<start time>``, set once),
    ``.../beat/<global rank>`` (a counter bumped every ``INTERVAL`` seconds by a daemon
    thread) and ``.../left/<global rank>`` (set at interpreter exit). ``store.add(key, 0)``
    reads a counter without blocking, even before it exists; every store call runs off
    the event loop. One per default group, made by ``of()``: a process's checked Comms
    and hybrid worlds share it.
    """

    INTERVAL = 0.2
    POLL = 0.1  # between two looks at the peers
    STOPPED = 0.5  # a peer on this host stopped by a signal this long is named
    # A peer elsewhere whose counter stood still this long is named. Long, since a live
    # process's heartbeat thread stalls while a C call holds its GIL.
    STALE = 5.0
    SETTLE = 1.0  # after the transport failed, how long peers that seem to run are looked at
    ON_THIS_HOST = True  # look peers on this host up in /proc (tests turn it off to play remote)

    _current: Presence | None = None
    _lock = threading.Lock()

    def __init__(self, store: Any, rank: int, pg: dist.ProcessGroup) -> None:
        self.store = store
        self.rank = rank
        self._pg_id = id(pg)
        self._own_pid = os.getpid()  # (a child made by fork inherits the atexit hook: not its exit)
        self.prefix = f"aiocoll/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
        self.host = _this_host() if self.ON_THIS_HOST else None
        self._pids: dict[int, int | None] = {}  # global rank -> its pid if on this host, None if elsewhere
        self._starts: dict[int, int] = {}
        self._stop = threading.Event()
        self.error: BaseException | None = None  # the store failed under the beating thread
        who = "elsewhere"
        if self.host is not None:
            me = _stat(os.getpid())
            assert me is not None  # _this_host read it
            who = f"{self.host}|{os.getpid()}|{me[1]}"
        self.store.set(self._key("who", rank), who)
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
        """Stop beating; the beating thread is gone when this returns (or after a second, if
        it is stuck in the store), so that it does not outlive the job it beats for."""
        self._stop.set()
        atexit.unregister(self.leave)
        if threading.current_thread() is not self._thread:
            self._thread.join(1.0)

    def leave(self) -> None:
        """Say that this process leaves (at exit): the others name it at once."""
        if os.getpid() != self._own_pid:
            return
        self._stop.set()
        self._thread.join(1.0)
        with contextlib.suppress(Exception):
            self.store.add(self._key("left", self.rank), 1)

    def _read(self, kind: str, rank: int) -> int:
        try:
            return int(self.store.add(self._key(kind, rank), 0))
        except Exception as e:
            raise StoreUnreachable.of(e) from e

    def _pid(self, rank: int) -> int | None:
        """The pid of global ``rank`` if it runs on this host (read once from the store)."""
        if rank in self._pids:
            return self._pids[rank]
        key = self._key("who", rank)
        try:
            if not self.store.check([key]):
                return None  # not started yet: ask again next time
            who = bytes(self.store.get(key)).decode()
        except Exception as e:
            raise StoreUnreachable.of(e) from e
        host, _, rest = who.partition("|")
        pid = None
        if self.host is not None and host == self.host:
            pid_s, _, start = rest.partition("|")
            pid = int(pid_s)
            self._starts[rank] = int(start)
        self._pids[rank] = pid
        return pid

    def look(self, ranks: Sequence[int]) -> dict[int, _Sighting]:
        """One look at each of global ``ranks`` (blocking: a few store reads and ``/proc`` files)."""
        seen = {}
        for r in ranks:
            left = bool(self._read("left", r))
            beat = self._read("beat", r)
            pid = self._pid(r)
            state = None
            if pid is not None:
                try:
                    stat = _stat(pid)
                except PermissionError:  # it exists but /proc will not say more: judge by heartbeat
                    pid = None
                else:
                    # a pid that came back with another start time was reused: that process is gone
                    state = "" if stat is None or stat[1] != self._starts[r] else stat[0]
            seen[r] = _Sighting(left, beat, pid, state)
        return seen

    async def gone(self, ranks: Sequence[int], settle: float = 0.0) -> list[tuple[int, str]]:
        """Of global ``ranks``, those gone and how (``"exited"``, ...); [] if none is.

        Looks every ``POLL`` seconds, off the loop, for as long as a verdict needs: a
        peer that left, or whose process on this host is gone, is named at once; one on
        this host stopped by a signal once it stayed so for ``STOPPED`` seconds; one
        elsewhere whose heartbeat stood still for ``STALE`` seconds. A peer running on
        this host is never named; nor is one that never beat (no checked Comm or hybrid
        world there). ``settle``: seconds to go on looking even so, when the transport
        has failed (should a kernel show a dying process as running a little longer).
        Raises ``StoreUnreachable`` if the store is gone.
        """
        loop = asyncio.get_running_loop()
        first = cur = await asyncio.to_thread(self.look, ranks)
        began = loop.time()
        stopped = {r for r, s in first.items() if s.state == "T"}  # "t", stopped by a debugger, is alive
        silent = {r for r, s in first.items() if s.pid is None and s.beat > 0}
        while True:
            dead = [(r, how) for r, s in cur.items() if (how := s.dead()) is not None]
            if dead:
                return dead
            waited = loop.time() - began
            stopped = {r for r in stopped if cur[r].state == "T"}
            silent = {r for r in silent if cur[r].pid is None and cur[r].beat == first[r].beat}
            named = [
                (r, f"is stopped (pid {cur[r].pid} on this host, by SIGSTOP or Ctrl-Z)")
                for r in sorted(stopped)
                if waited >= self.STOPPED
            ]
            named += [
                (r, f"stopped responding (no heartbeat for {self.STALE:g}s)")
                for r in sorted(silent)
                if waited >= self.STALE
            ]
            if named:
                return named
            if not stopped and not silent and waited >= settle:
                return []
            await asyncio.sleep(self.POLL)
            cur = await asyncio.to_thread(self.look, ranks)
