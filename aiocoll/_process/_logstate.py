"""``logging``'s configuration per rank, as each rank's process of its own would have it.

A logger's handlers, filters, level, ``propagate`` and ``disabled`` (and ``logging.disable``'s
level) are the process's. Ranks that are threads of one process would share them: the
first rank's ``logging.basicConfig`` would configure every rank (the others' calls do
nothing, as root has a handler then), and a rank's ``assertLogs`` would catch the others'
records. While harness worlds run, those attributes are data descriptors on
``logging.Logger`` (and ``logging.Manager``), which take precedence over an instance's
``__dict__``: a thread bound to a rank reads and writes its own values (a copy of the
process's, made at its first look, as a process inherits them, less pytest's capturing
handlers, which a process spawned for a rank would not have), every other thread the
process's own, in the instance's ``__dict__`` as always. ``basicConfig``, ``dictConfig``,
``fileConfig``, ``assertLogs``, ``caplog`` and libraries' own ``setLevel`` calls then act on
the rank alone, whatever logger they touch, including loggers made later.

What a module's top-level code does while it is imported stays the process's, as each
process would have done it at its own import (a library's ``NullHandler``): the first
rank to import a module runs its code once for all.

>>> view = RankLogging()
>>> log = logging.getLogger("aiocoll.doctest")
>>> view.set(log, "level", logging.DEBUG)
>>> view.get(log, "level") == logging.DEBUG, log.__dict__["level"] == logging.NOTSET
(True, True)
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from types import FrameType

from .._current import PerRank

__all__ = ["RankLogging", "descriptors"]

# what one rank changed, per object, by attribute; lists are the rank's own copies
_Own = dict[str, object]

# Logger attributes a process has of its own; lists are copied at a rank's first look, as the
# rank changes them in place (``addHandler`` appends)
LOGGER_ATTRS = ("handlers", "filters", "level", "propagate", "disabled", "_cache")
MANAGER_ATTRS = ("_disable",)  # (behind the `disable` property)
_COPIED = frozenset({"handlers", "filters"})


class RankLogging:
    """One rank's logging state: what it changed over the process's, per logger."""

    __slots__ = ("_own",)

    def __init__(self) -> None:
        # keyed by id(): a Logger subclass may define __eq__; the object is kept alive beside it
        self._own: dict[int, tuple[object, _Own]] = {}

    def _slot(self, obj: object) -> _Own:
        entry = self._own.get(id(obj))
        if entry is None:
            entry = self._own[id(obj)] = (obj, {})
        return entry[1]

    def get(self, obj: object, name: str) -> object:
        """The rank's value, or the process's (a list: copied for the rank now)."""
        entry = self._own.get(id(obj))
        if entry is not None and name in entry[1]:
            return entry[1][name]
        if name == "_cache":  # isEnabledFor's cache, which setLevel clears on every logger: none per rank
            return {}
        value = _the_process_s(obj, name)
        if name in _COPIED and not importing():
            value = self._slot(obj)[name] = [x for x in value if not _the_runner_s(x)]  # type: ignore[attr-defined]
        return value

    def set(self, obj: object, name: str, value: object) -> None:
        if name == "_cache" or importing():
            vars(obj)[name] = value
        else:
            self._slot(obj)[name] = value

    def handlers(self) -> list[logging.Handler]:
        """The handlers this rank added, which no other thread's loggers have (its process's own)."""
        loggers = [logging.root, *logging.Logger.manager.loggerDict.values()]  # (placeholders have none)
        shared = {id(h) for obj in loggers for h in vars(obj).get("handlers", ())}
        out: dict[int, logging.Handler] = {}
        for _, own in self._own.values():
            for h in own.get("handlers", ()):  # type: ignore[attr-defined]
                if id(h) not in shared:
                    out[id(h)] = h
        return list(out.values())

    def shutdown(self) -> None:
        """Flush and close the rank's own handlers, as ``logging.shutdown`` does at a process's exit."""
        for h in reversed(self.handlers()):
            try:
                h.acquire()
                try:
                    h.flush()
                    h.close()
                finally:
                    h.release()
            except (OSError, ValueError):  # (as logging.shutdown: a stream already closed)
                pass

    def make_the_process_s(self) -> None:
        """Make the rank's values the process's: in a process forked from the rank, which inherits them."""
        for obj, own in self._own.values():
            vars(obj).update(own)
        self._own.clear()

    def __repr__(self) -> str:
        return f"<RankLogging {len(self._own)} logger(s) looked at>"


def _the_runner_s(handler: object) -> bool:
    """A handler of the test runner (pytest's log capture): a process spawned for the rank would not have it."""
    return type(handler).__module__.startswith("_pytest.")


def importing() -> bool:
    """Whether the calling thread is importing a module (importlib's frames are on its stack)."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def _the_process_s(obj: object, name: str) -> object:
    try:
        return vars(obj)[name]
    except KeyError:
        raise AttributeError(f"{type(obj).__name__!r} object has no attribute {name!r}") from None


class _PerRank:
    """A data descriptor: a rank's own value where ``current()`` gives a view, else the instance's."""

    def __init__(self, name: str, current: Callable[[], RankLogging | None]) -> None:
        self.name = name
        self.current = current
        per_rank = PerRank(current)
        self._get = per_rank.call(lambda view, obj: view.get(obj, name), lambda obj: _the_process_s(obj, name))
        self._set = per_rank.call(self._set_own, lambda obj, value: vars(obj).__setitem__(name, value))

    def _set_own(self, view: RankLogging, obj: object, value: object) -> None:
        attrs = vars(obj)
        if self.name not in attrs:  # a logger made in a rank: the process gets its first values too
            attrs[self.name] = list(value) if self.name in _COPIED else value  # type: ignore[call-overload]
        view.set(obj, self.name, value)

    def __get__(self, obj: object, owner: type | None = None) -> object:
        return self if obj is None else self._get(obj)

    def __set__(self, obj: object, value: object) -> None:
        self._set(obj, value)

    def __repr__(self) -> str:
        return f"<per-rank attribute {self.name!r}>"


def descriptors(current: Callable[[], RankLogging | None]) -> list[tuple[type, str, _PerRank]]:
    """``(class, name, descriptor)`` to set while harness worlds run; ``current()``: the calling thread's view."""
    out: list[tuple[type, str, _PerRank]] = [(logging.Logger, n, _PerRank(n, current)) for n in LOGGER_ATTRS]
    out += [(logging.Manager, name, _PerRank(name, current)) for name in MANAGER_ATTRS]
    return out
