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
(``faulthandler_timeout``) for the time the block runs.

A crash in C code (a segfault in torch, a bad ``ctypes`` call) is not silent either:
while a world runs, ``fatal_errors_reported`` has faulthandler print every thread's
stack when a fatal signal comes, if nothing (pytest, ``python -X faulthandler``) does
already, and each rank's stack runs through a frame named after the rank
(``named_for``), as faulthandler names threads by id only. The last world to end
turns it off again. It writes to the process's
stderr as it was when this module was first imported: aiocoll's pytest plugin imports
it as pytest loads it, before pytest captures file descriptor 2 for each test (a dump
written into a test's capture would die with the process, unread).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import threading
import time
import types
from collections.abc import Awaitable, Callable
from typing import TypeVar

from . import _patches

__all__ = ["MARGIN", "fatal_errors_reported", "named_async_call", "named_call", "under_deadline"]

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


async def _acall(fn: Callable[[], Awaitable[T]]) -> T:
    __tracebackhide__ = True  # (pytest)
    return await fn()


def _renamed(template: Callable[..., object], name: str) -> types.FunctionType:
    """``template``, as a function whose frames faulthandler's dumps show under ``name``."""
    code = template.__code__.replace(co_name=name, co_qualname=name)
    return types.FunctionType(code, template.__globals__)


def named_call(name: str, fn: Callable[[], T]) -> T:
    """``fn()``, its frames under one named ``name`` (in faulthandler's dumps and tracebacks).

    >>> named_call("aiocoll rank 0", lambda: sys._getframe(1).f_code.co_name)
    'aiocoll rank 0'
    """
    __tracebackhide__ = True  # (pytest)
    named: Callable[[Callable[[], T]], T] = _renamed(_call, name)
    return named(fn)


async def named_async_call(name: str, fn: Callable[[], Awaitable[T]]) -> T:
    """``await fn()`` under a frame named ``name``: an async rank's, seen in a dump while it runs."""
    __tracebackhide__ = True  # (pytest)
    named: Callable[[Callable[[], Awaitable[T]]], Awaitable[T]] = _renamed(_acall, name)
    return await named(fn)


def _crash_report() -> Callable[[], None]:
    if faulthandler.is_enabled():
        return lambda: None  # (pytest turns it on for its run: left as it is)
    faulthandler.enable(file=_STDERR, all_threads=True)

    def undo() -> None:
        faulthandler.disable()  # (which returns whether it was on: not a report of the undo's)

    return undo


CRASH_REPORTS = _patches.PatchSet(
    "crash reports",
    "while worlds run, a fatal signal (SIGSEGV, SIGABRT, ...) prints every thread's stack (faulthandler), "
    "unless it was on already",
    lambda key: [_patches.Step("faulthandler.enable", _crash_report)],
    ["faulthandler.enable"],
)


def fatal_errors_reported() -> contextlib.AbstractContextManager[None]:
    """While in it, a fatal signal (SIGSEGV, SIGABRT, ...) prints every thread's stack to stderr.

    faulthandler's, turned on by the first world and off by the last, unless it was on
    already (pytest turns it on for its run): then it is left as it is.
    """
    return _patches.lease(CRASH_REPORTS)


def under_deadline(seconds: float, what: str, fn: Callable[[], T]) -> T:
    """``fn()``; if the process is still in it ``seconds`` later, dump every thread's stack and exit.

    >>> under_deadline(60, "a quick block", lambda: 6 * 7)
    42
    """
    __tracebackhide__ = True  # (pytest)
    # a function of its own whose frame carries the name into faulthandler's dump
    token = _arm(seconds)
    try:
        return named_call(f"{what}, under aiocoll's deadline of {seconds:g} s", fn)
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
