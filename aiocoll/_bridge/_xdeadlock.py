"""Deadlocks across processes: every process blocked in ops that none of the others can meet.

In one process the engine sees every rank wait (``_liveness``). Across processes nobody
does, and the backends wait for the group's timeout: rank 0 in ``all_reduce`` while
rank 1 waits in ``recv`` from rank 0 hangs for 30 minutes on gloo. Here each process
says what its threads wait in, once they have waited ``WATCH_AFTER`` seconds: a
``Wait`` per blocked thread, under ``<presence prefix>waits/<global rank>`` in the job's
store (``Presence``'s), with a count that changes whenever the set does. A blocked
thread looks at every process's entry each ``WATCH_AFTER`` seconds; it reports a
deadlock when two looks in a row saw every process blocked, nothing changed between
them, no process is gone (those are named by ``Presence`` instead), and no wait can be
met by another's: a collective needs every member waiting in the same one, a ``recv``
a peer waiting in the matching ``send``, and the other way round.

A store that cannot be reached (its host, rank 0's process, has ended) ends the looking:
the op then fails as the transport and ``Presence`` say. Only waits in ``Work.wait()``
count: a process whose thread computes, sleeps, or waits in anything else is not
blocked, so no deadlock is ever reported while one might go on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal

from .._errors import DeadlockError
from ._presence import Presence, StoreUnreachable

__all__ = ["WATCH_AFTER", "Wait", "Watch", "watching"]

WATCH_AFTER = 0.5  # seconds a thread waits before it says so, and between two looks at the others

Kind = Literal["collective", "send", "recv"]


@dataclasses.dataclass(frozen=True)
class Wait:
    """One blocked op, as the other processes read it.

    ``peer``: a send's or recv's peer (global rank; None: any source). ``seq``: a
    collective's number in its group.

    >>> ar = Wait("0", (0, 1), "collective", 3, None, "all_reduce(...) at a.py:4")
    >>> ar.met_by(0, {0: [ar], 1: [ar]}), ar.met_by(0, {0: [ar], 1: []})
    (True, False)
    """

    group: str
    ranks: tuple[int, ...]  # the group's members (global ranks)
    kind: Kind
    seq: int | None
    peer: int | None
    what: str  # the op and where it was called, as the reports say it

    def met_by(self, me: int, waits: Mapping[int, Sequence[Wait]]) -> bool:
        """Whether the others' ``waits`` (by global rank) can complete this one, waited by ``me``."""

        def has(rank: int | None, kind: Kind, **fields: Any) -> bool:
            if rank is None:
                return False
            return any(
                w.group == self.group and w.kind == kind and all(getattr(w, k) in v for k, v in fields.items())
                for w in waits.get(rank, ())
            )

        if self.kind == "collective":
            return all(has(m, "collective", seq={self.seq}) for m in self.ranks)
        if self.kind == "recv":
            senders = self.ranks if self.peer is None else (self.peer,)
            return any(has(p, "send", peer={me}) for p in senders)
        return has(self.peer, "recv", peer={me, None})

    def waits_for(self, me: int, waits: Mapping[int, Sequence[Wait]]) -> str:
        """Whom it waits for, in words (as ``_liveness`` says it in one process)."""
        if self.kind == "collective":
            missing = [
                m for m in self.ranks if not any(w.group == self.group and w.seq == self.seq for w in waits.get(m, ()))
            ]
            return f"waits for ranks {missing}"
        if self.kind == "recv":
            return f"waits for a send from {'any rank' if self.peer is None else f'rank {self.peer}'}"
        return f"waits for rank {self.peer} to recv"


class _Board:
    """This process's blocked waits, and what it last published of them."""

    def __init__(self, presence: Presence, rank: int, size: int) -> None:
        self.presence = presence
        self.rank = rank
        self.size = size
        self._lock = threading.Lock()
        self._waits: dict[int, Wait] = {}  # by the id of the Watch that waits
        self._generation = 0  # changes with the set
        self._published = -1  # the version the store has (-1: none)
        self.gone = False  # the store is unreachable: no look can tell a deadlock any more
        self._acked: str | None = None  # the deadlock this process said it read

    def key(self, rank: int) -> str:
        return f"{self.presence.prefix}waits/{rank}"

    def enter(self, watch: Watch) -> None:
        with self._lock:
            self._waits[id(watch)] = watch.wait
            self._generation += 1

    def leave(self, watch: Watch) -> None:
        with self._lock:
            del self._waits[id(watch)]
            self._generation += 1
            if self._published >= 0:
                self._publish()  # at once: a stale "blocked" must not outlive the wait

    def publish(self) -> None:
        with self._lock:
            if self._published != self._generation:
                self._publish()

    def _publish(self) -> None:
        entry = {"version": self._generation, "waits": [dataclasses.asdict(w) for w in self._waits.values()]}
        try:
            self.presence.store.set(self.key(self.rank), json.dumps(entry))
        except Exception:  # the store's host left (a peer that ended): nothing to tell any more
            self.gone = True
            return
        self._published = self._generation

    def told(self) -> str | None:
        """The deadlock another process found among this process's waits as published now, if any (acknowledged)."""
        store = self.presence.store
        key = self.key_of("deadlock")
        try:
            if not store.check([key]):
                return None
            found = json.loads(bytes(store.get(key)).decode())
            if found["versions"].get(str(self.rank)) != self._published:
                return None  # an earlier one (its waits are over)
            self._ack(found["message"])
        except Exception:
            self.gone = True
            return None
        return str(found["message"])

    def tell(self, message: str, seen: dict[int, tuple[int, list[Wait]]]) -> None:
        """Tell the other processes the deadlock found in ``seen``, and wait (a little) until they read it.

        So that every rank reports the deadlock, not one of them its peer's exit: the first
        to raise may end its process, and with rank 0's the store.
        """
        store = self.presence.store
        found = {"message": message, "versions": {str(r): v for r, (v, _) in seen.items()}}
        try:
            store.set(self.key_of("deadlock"), json.dumps(found))
            self._ack(message)
            deadline = time.monotonic() + 4 * WATCH_AFTER
            while int(store.add(self.key_of("deadlock-read"), 0)) < self.size and time.monotonic() < deadline:
                time.sleep(WATCH_AFTER / 10)
        except Exception:
            self.gone = True

    def _ack(self, message: str) -> None:
        if self._acked != message:
            self._acked = message
            self.presence.store.add(self.key_of("deadlock-read"), 1)

    def key_of(self, name: str) -> str:
        return f"{self.presence.prefix}waits/{name}"

    def read(self) -> dict[int, tuple[int, list[Wait]]] | None:
        """Every process's published waits (by global rank), or None if one is not blocked."""
        store = self.presence.store
        seen = {}
        for r in range(self.size):
            key = self.key(r)
            try:
                if not store.check([key]):
                    return None  # never blocked for long
                entry = json.loads(bytes(store.get(key)).decode())
            except Exception:  # the store's host left: the transport or Presence names who
                self.gone = True
                return None
            waits = [Wait(**{**w, "ranks": tuple(w["ranks"])}) for w in entry["waits"]]
            if not waits:
                return None
            seen[r] = (int(entry["version"]), waits)
        return seen


_board: _Board | None = None
_board_lock = threading.Lock()


class Watch:
    """One thread's blocked wait: says so to the other processes, and looks for a deadlock (``look``)."""

    def __init__(self, board: _Board, wait: Wait) -> None:
        self.board = board
        self.wait = wait
        self._last: dict[int, tuple[int, list[Wait]]] | None = None

    def look(self) -> DeadlockError | None:
        """Publish this process's waits; the deadlock if every process is in one (blocking: a few store calls)."""
        board = self.board
        board.publish()
        told = None if board.gone else board.told()
        if told is not None:
            return DeadlockError(told)
        seen = None if board.gone else board.read()
        last, self._last = self._last, seen
        if seen is None or last is None or any(seen[r][0] != last[r][0] for r in seen):
            return None  # someone is not blocked, or moved since the last look
        waits = {r: w for r, (_, w) in seen.items()}
        if any(w.met_by(r, waits) for r, ws in waits.items() for w in ws):
            return None
        try:
            if any(s.dead() is not None for s in board.presence.look(range(board.size)).values()):
                return None  # a process is gone: the checks name it
        except StoreUnreachable:
            return None
        lines = [
            f"  rank {r}: blocked in {w.what} -- {w.waits_for(r, waits)}" for r, ws in sorted(waits.items()) for w in ws
        ]
        message = "deadlock: every rank's process waits for a peer that will never arrive\n" + "\n".join(lines)
        board.tell(message, seen)
        return DeadlockError(message)


@contextlib.contextmanager
def watching(wait: Wait, presence: Presence, rank: int, size: int) -> Iterator[Watch]:
    """While the calling thread is blocked in ``wait``: a ``Watch`` on it (this process's rank and the job's size)."""
    global _board
    with _board_lock:
        if _board is None or _board.presence is not presence:
            _board = _Board(presence, rank, size)
        board = _board
    watch = Watch(board, wait)
    board.enter(watch)
    try:
        yield watch
    finally:
        board.leave(watch)
