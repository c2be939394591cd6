"""The last resort against a hang: a deadline kept by a thread that needs no GIL.

A world's deadline is kept by Python code (the test's thread waits, cancels the world,
gives up on ranks that do not end), and Python code needs the GIL. A rank stuck in C
code *holding* the GIL (a C++ destructor spinning in a garbage collection, a C call
that never returns) stops every thread of the process: neither aiocoll nor
pytest-timeout nor ^C's handler can run. Only a thread of C that never takes the GIL
can act then: ``faulthandler``'s. Armed with a world's deadline plus a margin, it
dumps every thread's Python stack to stderr and ends the process (exit code 1), so a
test run stops with a report instead of hanging for ever. (Under pytest-xdist the
worker's crash fails that test, and the run goes on with a new worker.)

The dump names what ran past its deadline: under faulthandler's ``Timeout`` line, the
waiting thread's stack runs through a frame named after it (``in <what>, under
aiocoll's deadline of N s``; pytest leaves that frame out of the tracebacks it shows).

faulthandler has one such timer per process: arming replaces pytest's own
(``faulthandler_timeout``) for the time the block runs. It writes to the process's
stderr as it was when this module was first imported: aiocoll's pytest plugin imports
it as pytest loads it, before pytest captures file descriptor 2 for each test (a dump
written into a test's capture would die with the process, unread).
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
import types
from collections.abc import Callable
from typing import TypeVar

__all__ = ["MARGIN", "under_deadline"]

T = TypeVar("T")

MARGIN = 30.0
"""Seconds past its own deadline (and grace) that a world gets before the process is ended."""

_lock = threading.Lock()
_armed: dict[int, float] = {}  # token -> the time.monotonic() it ends at (blocks may nest)
_tokens = iter(range(1 << 62))


def _own_stderr() -> int:
    """A descriptor of stderr as it is now (see the module), or of what sys.__stderr__ is."""
    try:
        return os.dup(2)
    except OSError:
        stream = sys.__stderr__
        return stream.fileno() if stream is not None else 2


_STDERR = _own_stderr()


def _call(fn: Callable[[], T]) -> T:
    __tracebackhide__ = True  # (pytest)
    return fn()


def under_deadline(seconds: float, what: str, fn: Callable[[], T]) -> T:
    """``fn()``; if the process is still in it ``seconds`` later, dump every thread's stack and exit.

    >>> under_deadline(60, "a quick block", lambda: 6 * 7)
    42
    """
    __tracebackhide__ = True  # (pytest)
    name = f"{what}, under aiocoll's deadline of {seconds:g} s"
    # a function of its own whose frame carries the name into faulthandler's dump
    code = _call.__code__.replace(co_name=name, co_qualname=name)
    named: Callable[[Callable[[], T]], T] = types.FunctionType(code, _call.__globals__)
    token = _arm(seconds)
    try:
        return named(fn)
    finally:
        _disarm(token)


def _arm(seconds: float) -> int:
    with _lock:
        token = next(_tokens)
        _armed[token] = time.monotonic() + seconds
        _reset()
        return token


def _disarm(token: int) -> None:
    with _lock:
        _armed.pop(token, None)
        _reset()


def _reset() -> None:
    """Arm faulthandler for the latest deadline in force (worlds run side by side: none cut short)."""
    faulthandler.cancel_dump_traceback_later()
    if _armed:
        left = max(_armed.values()) - time.monotonic()
        faulthandler.dump_traceback_later(max(left, 0.001), repeat=False, file=_STDERR, exit=True)
