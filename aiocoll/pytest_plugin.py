"""pytest plugin: ``@pytest.mark.world(4)`` runs a test on 4 ranks.

Installed with aiocoll (entry point ``pytest11``; ``-p no:aiocoll`` turns it off). The
body of a test marked ``world`` runs once per rank, as ``aiocoll.spawn`` runs a rank
function, and gets its rank's ``Comm`` from the ``comm`` fixture: ``async def`` tests
as tasks on a new event loop, plain ``def`` tests as threads with torch.distributed
initialised (backend ``"aiocoll"``)::

    import pytest, torch, torch.distributed as dist

    @pytest.mark.world(4)
    async def test_all_reduce(comm):
        t = torch.ones(2) * comm.rank
        await comm.all_reduce(t)
        assert t.tolist() == [6.0, 6.0]

    @pytest.mark.world(2)
    def test_torch_code(comm):
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == 2.0

Only the test body runs per rank: the other fixtures it requests are set up once, as
usual, before the ranks start, and every rank gets the same objects (``tmp_path`` is
one directory for all ranks). ``async`` fixtures run on their plugin's loop, not on
the ranks' loop.

A failing test is reported with the rank that failed first (``rank 2 of 4 failed``),
then that rank's traceback; the ranks it aborted are listed in the exception's notes.
A test cut short by pytest-timeout (or ^C) is reported where a rank that kept the
others waiting was; a rank thread stuck outside a collective cannot be stopped and is
left running, so the session goes on.

Settings, from the most specific: the marker's keywords
(``@pytest.mark.world(4, timeout=5, loop="asyncio")``), the command line
(``--aiocoll-world``, ``--aiocoll-timeout``, ``--aiocoll-loop``), the ini file
(``aiocoll_world``, ``aiocoll_timeout``, ``aiocoll_loop``). ``--aiocoll-world`` is the
size of a bare ``@pytest.mark.world``; the timeout bounds one wait in one collective.
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import os
import re
import sysconfig
import warnings
from collections.abc import Callable, Coroutine, Generator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import Literal, NoReturn, SupportsFloat, cast

import pytest
import torch
from _pytest._code.code import ExceptionChainRepr, ExceptionInfo, ReprTracebackNative, Traceback

from . import _watchdog
from ._comm import Comm
from ._errors import AiocollError
from ._lifecycle._config import DEFAULT_RECORD, loop_factory
from ._lifecycle._worldthread import WorldThread
from ._spawn import spawn_async
from ._watchdog import under_deadline

__all__ = ["DEFAULT_TEST_TIMEOUT", "DEFAULT_WORLD", "comm"]

DEFAULT_WORLD = 4
"""Ranks of a test marked ``@pytest.mark.world`` with no size, unless configured."""

DEFAULT_TEST_TIMEOUT = 60.0
"""Seconds a rank of a test may wait in one collective, unless configured.

Shorter than spawn's default: a test rank that waits a minute is stuck. With
pytest-timeout's ``--timeout T`` and no aiocoll timeout configured, half of T (if
less), so that aiocoll's report, which says who waits for whom, comes first.
"""

_Loop = Literal["auto", "asyncio", "uvloop"]
_LOOPS: tuple[_Loop, ...] = ("auto", "asyncio", "uvloop")
_GRACE = 2.0  # seconds an interrupted world of threads gets to wind down before it is left behind


@dataclass(frozen=True)
class _Settings:
    """The session's settings, from the command line, else the ini file, else the defaults."""

    world: int
    timeout: float | None
    timeout_configured: bool  # by the user: then pytest-timeout's value does not lower it
    loop: _Loop
    record: int = DEFAULT_RECORD  # flight-recorder entries per rank (failure reports)
    trace_dir: Path | None = None  # where to write each marked test's trace, if anywhere
    trace_always: bool = False  # keep the traces of passing tests too


@dataclass(frozen=True)
class _WorldRun:
    """How one marked test runs: resolved at setup, so bad settings fail there."""

    fn: Callable[..., object]  # before pytest-asyncio swaps the item's obj for its own runner
    world: int
    timeout: float | None
    loop: _Loop
    record: int = DEFAULT_RECORD
    trace: Path | None = None  # this test's trace file
    trace_always: bool = False
    test_timeout: float | None = None  # pytest-timeout's, if set: the watchdog's deadline (``_watchdog``)
    name: str = "the test"


_SETTINGS = pytest.StashKey[_Settings]()
_RUN = pytest.StashKey[_WorldRun]()


# -- configuration --------------------------------------------------------------------


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("aiocoll", "aiocoll: tests marked @pytest.mark.world(n) run on n ranks")
    group.addoption(
        "--aiocoll-world",
        dest="aiocoll_world",
        metavar="N",
        help=f"ranks of a test marked @pytest.mark.world without a size (default {DEFAULT_WORLD})",
    )
    group.addoption(
        "--aiocoll-timeout",
        dest="aiocoll_timeout",
        metavar="SECONDS",
        help=(
            f"seconds a rank may wait in one collective, or 'none' (default {DEFAULT_TEST_TIMEOUT:g}; "
            "half of pytest-timeout's --timeout if less)"
        ),
    )
    group.addoption(
        "--aiocoll-loop",
        dest="aiocoll_loop",
        choices=_LOOPS,
        help="event loop of the ranks: auto (uvloop when installed, the default), asyncio or uvloop",
    )
    group.addoption(
        "--aiocoll-record",
        dest="aiocoll_record",
        metavar="N",
        help=f"operations per rank the flight recorder keeps for failure reports, 0 for off (default {DEFAULT_RECORD})",
    )
    group.addoption(
        "--aiocoll-trace",
        dest="aiocoll_trace",
        metavar="DIR",
        help="write a Chrome/Perfetto trace of each failing @pytest.mark.world test into DIR",
    )
    group.addoption(
        "--aiocoll-trace-always",
        dest="aiocoll_trace_always",
        action="store_const",
        const="true",
        help="with --aiocoll-trace: keep the traces of passing tests too",
    )
    parser.addini("aiocoll_world", "aiocoll: ranks of a test marked @pytest.mark.world without a size", default="")
    parser.addini("aiocoll_record", "aiocoll: flight-recorder operations kept per rank, 0 for off", default="")
    parser.addini("aiocoll_trace", "aiocoll: directory for the traces of failing world tests", default="")
    parser.addini("aiocoll_trace_always", "aiocoll: true to keep the traces of passing tests too", default="")
    parser.addini("aiocoll_timeout", "aiocoll: seconds a rank may wait in one collective, or 'none'", default="")
    parser.addini("aiocoll_loop", "aiocoll: event loop of the ranks: auto, asyncio or uvloop", default="")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "world(n=None, *, timeout=None, loop=None): run the test on n ranks with aiocoll.spawn; "
        "the test gets its rank's Comm from the 'comm' fixture",
    )
    config.stash[_SETTINGS] = _read_settings(config)


def _read_settings(config: pytest.Config) -> _Settings:
    """Parse and check the options once, so a typo stops the session before any test runs."""

    def value(name: str) -> tuple[str, str] | None:
        flag = config.getoption(name)
        if flag is not None:
            return f"--{name.replace('_', '-')}", str(flag)
        ini = str(config.getini(name)).strip()
        return (f"ini setting {name}", ini) if ini else None

    world, timeout, loop = value("aiocoll_world"), value("aiocoll_timeout"), value("aiocoll_loop")
    record, trace, always = value("aiocoll_record"), value("aiocoll_trace"), value("aiocoll_trace_always")
    try:
        return _Settings(
            world=DEFAULT_WORLD if world is None else _parse_world(world[1], world[0]),
            timeout=DEFAULT_TEST_TIMEOUT if timeout is None else _parse_timeout(timeout[1], timeout[0]),
            timeout_configured=timeout is not None,
            loop="auto" if loop is None else _parse_loop(loop[1], loop[0]),
            record=DEFAULT_RECORD if record is None else _parse_record(record[1], record[0]),
            trace_dir=None if trace is None else Path(trace[1]),
            trace_always=always is not None and always[1].lower() in ("1", "true", "yes", "on"),
        )
    except ValueError as e:
        raise pytest.UsageError(f"aiocoll: {e}") from None


def _parse_world(raw: object, where: str) -> int:
    try:
        n = raw if isinstance(raw, int) and not isinstance(raw, bool) else int(str(raw))
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{where}: the world size must be a positive int, got {raw!r}")
    return n


def _parse_timeout(raw: object, where: str) -> float | None:
    if raw is None or (isinstance(raw, str) and raw.strip().lower() == "none"):
        return None
    try:
        # (float() judges raw itself: anything else raises the TypeError below)
        t = float(cast("str | SupportsFloat", raw)) if not isinstance(raw, bool) else 0.0
    except (TypeError, ValueError):
        t = 0.0
    if not t > 0:
        raise ValueError(f"{where}: the timeout must be a positive number of seconds or 'none', got {raw!r}")
    return t


def _parse_record(raw: object, where: str) -> int:
    try:
        n = int(str(raw))
    except ValueError:
        n = -1
    if n < 0:
        raise ValueError(f"{where}: the flight-recorder size must be an int >= 0, got {raw!r}")
    return n


def _trace_path(item: pytest.Item, directory: Path) -> Path:
    """A file name for the item's trace, unique per test and readable."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", item.nodeid).strip("_")
    return directory / f"{name}.json"


def _parse_loop(raw: object, where: str) -> _Loop:
    if raw not in _LOOPS:
        raise ValueError(f"{where}: the loop must be one of {', '.join(_LOOPS)}, got {raw!r}")
    if raw == "uvloop" and importlib.util.find_spec("uvloop") is None:
        raise ValueError(f"{where}: loop 'uvloop' but uvloop is not installed (pip install 'aiocoll[uvloop]')")
    return raw


def _pytest_timeout(item: pytest.Item) -> float | None:
    """pytest-timeout's timeout for ``item``, if that plugin is active and sets one."""
    plugin = item.config.pluginmanager.get_plugin("timeout")
    settings_of = getattr(plugin, "_get_item_settings", None)
    if settings_of is None:
        return None
    try:
        t = settings_of(item).timeout
    except Exception:  # its own checks report a bad marker; that is not ours to report
        return None
    return float(t) if isinstance(t, (int, float)) and t > 0 else None


# -- running a marked test ------------------------------------------------------------


@pytest.fixture
def comm(request: pytest.FixtureRequest) -> Comm:
    """The rank's ``Comm`` in a test marked ``@pytest.mark.world(n)``, for example::

        @pytest.mark.world(2)
        async def test_rank(comm):
            assert comm.world_size == 2

    An unmarked test that asks for it fails at setup.
    """
    if request.node.get_closest_marker("world") is None:
        pytest.fail(
            f"{request.node.nodeid}: the 'comm' fixture needs the test marked @pytest.mark.world(n)", pytrace=False
        )
    # The rank's own Comm replaces this when the test body runs on each rank.
    return cast(Comm, _NotARank())


class _NotARank:
    """What a fixture depending on ``comm`` gets: fixtures are set up once, before the ranks exist."""

    def __getattr__(self, name: str) -> NoReturn:
        raise RuntimeError(
            f"aiocoll: comm.{name} used outside the test body: only the test function of a "
            "@pytest.mark.world test gets its rank's Comm (other fixtures are set up once, shared by all ranks)"
        )

    def __repr__(self) -> str:
        return "<comm: set per rank when the test body runs>"


def pytest_runtest_setup(item: pytest.Item) -> None:
    # not tryfirst: a skip mark, checked first, spares a skipped test the checks below
    marker = item.get_closest_marker("world")
    if marker is None or not isinstance(item, pytest.Function):
        return
    settings = item.config.stash[_SETTINGS]
    try:
        given: dict[str, object] = {**dict(zip(("n",), marker.args, strict=False)), **marker.kwargs}
        if len(marker.args) > 1 or set(given) - {"n", "timeout", "loop"} or ("n" in marker.kwargs and marker.args):
            raise ValueError(f"@pytest.mark.world takes (n=None, *, timeout=..., loop=...), got {marker}")
        world = settings.world if given.get("n") is None else _parse_world(given["n"], "@pytest.mark.world")
        limit = _pytest_timeout(item)
        if "timeout" in given:
            timeout = _parse_timeout(given["timeout"], "@pytest.mark.world")
        elif settings.timeout_configured:
            timeout = settings.timeout
        else:
            timeout = DEFAULT_TEST_TIMEOUT if limit is None else min(DEFAULT_TEST_TIMEOUT, limit / 2)
        loop = settings.loop if given.get("loop") is None else _parse_loop(given["loop"], "@pytest.mark.world")
    except ValueError as e:
        pytest.fail(f"aiocoll: {e}", pytrace=False)
    fn = item.obj
    if inspect.isasyncgenfunction(fn):
        pytest.fail("aiocoll: a @pytest.mark.world test must be a function or a coroutine function", pytrace=False)
    trace = None if settings.trace_dir is None else _trace_path(item, settings.trace_dir)
    if trace is not None:
        trace.parent.mkdir(parents=True, exist_ok=True)
    item.stash[_RUN] = _WorldRun(
        fn, world, timeout, loop, settings.record, trace, settings.trace_always, limit, item.nodeid
    )


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    """Run a marked test's body on every rank; first, so pytest-asyncio's auto mode does not run it."""
    __tracebackhide__ = True
    run = pyfuncitem.stash.get(_RUN, None)
    if run is None:
        return None
    args = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
    fn = run.fn
    world: _AsyncWorld | _SyncWorld
    if inspect.iscoroutinefunction(fn):

        async def async_rank(c: Comm) -> object:
            return await fn(**_with_comm(args, c))

        world = _AsyncWorld(async_rank, run)
    else:

        def sync_rank(c: Comm) -> object:
            return fn(**_with_comm(args, c))

        world = _SyncWorld(sync_rank, run)
    try:
        if run.test_timeout is None:
            results = world.result()
        else:
            # pytest-timeout's handler needs the GIL; a rank holding it in C code would hang the session
            results = under_deadline(run.test_timeout + _GRACE + _watchdog.MARGIN, run.name, world.result)
    except BaseException:
        if run.trace is not None and run.trace.exists():
            pyfuncitem.add_report_section("call", "aiocoll trace", f"written to {run.trace}")
        raise
    if run.trace is not None and not run.trace_always:
        run.trace.unlink(missing_ok=True)  # on failure only: this test passed
    returned = [rank for rank, r in enumerate(results) if r is not None]
    if returned:
        # as pytest says it for a test that returns something
        warnings.warn(
            pytest.PytestReturnNotNoneWarning(
                f"Test functions should return None, but {pyfuncitem.nodeid} returned a value on ranks {returned}."
            ),
            stacklevel=1,
        )
    return True


def _with_comm(args: dict[str, object], c: Comm) -> dict[str, object]:
    return {**args, "comm": c} if "comm" in args else args


class _SyncWorld:
    """A world of thread ranks whose loop runs on a helper thread, so this thread can be interrupted.

    Ranks in threads cannot be stopped: when pytest-timeout's signal (or ^C) interrupts
    the test, the world is cancelled, which releases every rank waiting in a
    collective, but a rank stuck elsewhere never returns. Waiting for it on this
    thread would hang the session; from here the test is reported, with the traceback
    of the rank that kept the others waiting, and stuck ranks are left behind.
    """

    def __init__(self, fn: Callable[[Comm], object], run: _WorldRun) -> None:
        self._world: WorldThread[list[object]] = WorldThread(
            lambda: spawn_async(fn, run.world, timeout=run.timeout, record=run.record, trace=run.trace), run.loop
        )
        self._size = run.world

    def result(self) -> list[object]:
        __tracebackhide__ = True
        wt = self._world
        wt.start()
        try:
            wt.wait()  # (in slices: a ^C gets through on every platform)
        except BaseException as interrupt:
            # where each rank is now: one busy outside a collective is why the others waited
            busy = {r: tb for r, tb in self._ranks().items() if not _in_collective(tb)}
            wt.cancel()
            if not wt.wait(_GRACE):
                stuck = self._ranks()
                it = (
                    "a thread cannot be stopped, so it was"
                    if len(stuck) == 1
                    else "threads cannot be stopped, so they were"
                )
                _blame(interrupt, stuck, self._size, f"still running ({{where}}); {it} left running")
            else:
                _blame(interrupt, busy, self._size, "running ({where}); every rank has ended since")
            raise
        return wt.result()

    def _ranks(self) -> dict[int, TracebackType]:
        """The stack of each rank thread of this world still alive, as a traceback."""
        stacks: dict[int, TracebackType] = {}
        for rank, frame in self._world.rank_frames().items():
            tb = _traceback(_outward(frame))
            if tb is not None:
                stacks[rank] = tb
        return stacks


class _AsyncWorld:
    """A world of task ranks on a new loop on this thread, so pytest-timeout's signal reaches a busy rank.

    A signal that arrives while the loop is idle raises out of ``select`` on asyncio's
    loop, but uvloop runs signal handlers in a callback and would only log what they
    raise (the test would hang): this loop's exception handler takes it and cancels
    the world. Either way the test is reported where a rank that kept the others
    waiting is.
    """

    def __init__(self, fn: Callable[[Comm], Coroutine[object, None, object]], run: _WorldRun) -> None:
        self._fn = fn
        self._run = run
        self._main: asyncio.Task[object] | None = None
        self._interrupt: BaseException | None = None
        self._busy: dict[int, TracebackType] = {}

    def result(self) -> list[object]:
        __tracebackhide__ = True
        with asyncio.Runner(loop_factory=self._new_loop) as runner:
            try:
                results = runner.run(self._world())
                if self._interrupt is None:
                    return results
                interrupt = self._interrupt  # came as the world was ending: still, the test was cut short
            except asyncio.CancelledError:
                if self._interrupt is None:
                    raise
                interrupt = self._interrupt
            except BaseException as e:
                if isinstance(e, Exception):
                    raise  # the test's failure, as spawn reports it
                interrupt, self._busy = e, self._ranks(runner.get_loop())
        _blame(interrupt, self._busy, self._run.world, "running ({where}); every rank was cancelled")
        raise interrupt

    async def _world(self) -> list[object]:
        self._main = asyncio.current_task()
        return await spawn_async(
            self._fn, self._run.world, timeout=self._run.timeout, record=self._run.record, trace=self._run.trace
        )

    def _new_loop(self) -> asyncio.AbstractEventLoop:
        loop = loop_factory(self._run.loop)()
        loop.set_exception_handler(self._on_error)
        return loop

    def _on_error(self, loop: asyncio.AbstractEventLoop, context: dict[str, object]) -> None:
        exc = context.get("exception")
        interrupted = not isinstance(exc, (Exception, asyncio.CancelledError))
        if isinstance(exc, BaseException) and interrupted and self._main is not None and self._interrupt is None:
            self._interrupt, self._busy = exc, self._ranks(loop)
            self._main.cancel()
            return
        loop.default_exception_handler(context)

    def _ranks(self, loop: asyncio.AbstractEventLoop) -> dict[int, TracebackType]:
        """Where each rank task awaits, as a traceback; only the ranks busy outside a collective."""
        stacks: dict[int, TracebackType] = {}
        for task in asyncio.all_tasks(loop):
            if re.fullmatch(r"aiocoll rank \d+", task.get_name()):
                tb = _traceback(_awaiting(task.get_coro()))
                if tb is not None and not _in_collective(tb):
                    stacks[int(task.get_name().rsplit(" ", 1)[1])] = tb
        return stacks


def _outward(frame: FrameType | None) -> list[FrameType]:
    """A thread's frames, outermost first."""
    frames = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    return frames[::-1]


def _awaiting(coro: object) -> list[FrameType]:
    """A suspended coroutine's frames, down the chain of what each awaits, outermost first."""
    frames = []
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is None:
            break
        frames.append(frame)
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return frames


def _traceback(frames: list[FrameType]) -> TracebackType | None:
    """A traceback through ``frames`` (outermost first), as if the innermost had raised."""
    tb = None
    for frame in reversed(frames):
        tb = TracebackType(tb, frame, frame.f_lasti, frame.f_lineno)
    return tb


def _blame(interrupt: BaseException, ranks: dict[int, TracebackType], world: int, state: str) -> None:
    """Report ``interrupt`` where the first of ``ranks`` is, as if that rank had raised it.

    ``state`` ends the note: "running ({where}); ...", where ``{where}`` says whose traceback it is.
    """
    if not ranks:
        return
    first, listed = min(ranks), sorted(ranks)
    interrupt.with_traceback(ranks[first])
    if len(listed) == 1:
        who, where = f"rank {first} of {world} was", "the traceback shows where"
    else:
        who, where = f"ranks {listed} of {world} were", f"the traceback shows where rank {first} is"
    interrupt.add_note(f"aiocoll: the test was interrupted while {who} {state.format(where=where)}")


# -- the report -----------------------------------------------------------------------

_RAISED = re.compile(r"aiocoll: raised on rank (\d+) of a world of (\d+)")
_STUCK = re.compile(r"aiocoll: the test was interrupted while ranks? \[?([\d, ]+)\]? of (\d+) w")
_SAME = re.compile(r"aiocoll: ranks \[([\d, ]*)\] raised the same (\w+)")


def _dirs(*paths: str | None) -> tuple[str, ...]:
    """Prefixes of the files under these directories, as written and with links resolved."""
    return tuple({p + os.sep for d in paths if d for p in (os.path.abspath(d), str(Path(d).resolve()))})


# the frames that end the traceback of an aiocoll error are dropped from these
_LIBRARIES = _dirs(os.path.dirname(__file__), os.path.dirname(torch.__file__ or ""))
# a rank whose stack ends in these (a lock, a sleep) is busy where it called them
_STDLIB = _dirs(sysconfig.get_paths()["stdlib"])
_SITE = _dirs(sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"])


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    ours = call.when == "call" and call.excinfo is not None and _RUN in item.stash
    if ours and call.excinfo is not None and isinstance(call.excinfo.value, AiocollError):
        _hide_aiocoll_frames(item)
    report = yield
    if ours and call.excinfo is not None and report.failed:
        header = _header(call.excinfo.value)
        if header is not None:
            _prepend(report, header)
    return report


def pytest_runtest_teardown(item: pytest.Item) -> None:
    # the session keeps every item to its end: what a marked test ran with need not stay
    if _RUN in item.stash:
        del item.stash[_RUN]


def _in_collective(tb: TracebackType) -> bool:
    """Whether a rank's stack ends in aiocoll or torch (a collective), past any stdlib frame (a lock)."""
    frames = []
    cur: TracebackType | None = tb
    while cur is not None:
        frames.append(cur.tb_frame.f_code.co_filename)
        cur = cur.tb_next
    for path in reversed(frames):
        if path.startswith(_LIBRARIES):
            return True
        # site-packages may sit inside the stdlib's directory (no virtualenv)
        if not path.startswith(_STDLIB) or path.startswith(_SITE):
            return False
    return True


def _hide_aiocoll_frames(item: pytest.Item) -> None:
    """End the traceback of aiocoll's own errors at the caller's line, as pytest hides its frames.

    A mismatch, deadlock or timeout says all in its message; the frames of aiocoll and
    torch.distributed after the test's ``await comm.all_reduce(t)`` (or
    ``dist.all_reduce(t)``) would only push it down. ``--full-trace`` shows them.
    """
    base = getattr(type(item), "_traceback_filter", None)  # pytest's own filter (cut to the test)
    if base is None:
        return

    def tbfilter(excinfo: ExceptionInfo[BaseException]) -> Traceback:
        tb: Traceback = base(item, excinfo)
        kept = list(tb)
        while kept and str(kept[-1].path).startswith(_LIBRARIES):
            kept.pop()
        if not kept:
            return tb
        # the last entry carries the error: in full, even if it was a middle one before
        return Traceback((*kept[:-1], kept[-1].with_repr_style(None)))

    item._traceback_filter = tbfilter  # type: ignore[method-assign]


def _header(exc: BaseException) -> str | None:
    """``rank 2 of 4 failed``, from the notes spawn adds to the exception it re-raises."""
    notes = [str(n) for n in getattr(exc, "__notes__", ())]
    for m in map(_STUCK.match, notes):
        if m:
            ranks = [int(r) for r in m[1].split(",")]
            if len(ranks) == 1:
                return f"rank {ranks[0]} of {m[2]} was running when the test was interrupted"
            listed = ", ".join(map(str, ranks))
            return f"ranks {listed} of {m[2]} were running when the test was interrupted; rank {ranks[0]}'s traceback:"
    raised = [m for m in map(_RAISED.fullmatch, notes) if m]
    if not raised:
        return None
    rank, size = int(raised[-1][1]), int(raised[-1][2])  # the last: the outermost world, this test's
    for m in map(_SAME.fullmatch, notes):
        if m:
            ranks = sorted([rank, *(int(r) for r in m[1].split(",") if r.strip())])
            return (
                f"ranks {', '.join(map(str, ranks))} of {size} failed with the same {m[2]}; "
                f"the traceback of rank {rank}:"
            )
    return f"rank {rank} of {size} failed"


def _prepend(report: pytest.TestReport, header: str) -> None:
    longrepr = report.longrepr
    if isinstance(longrepr, ExceptionChainRepr):
        # A chain element of its own, before the exception's: pytest and xdist carry it
        # as they carry tracebacks, and the summary line still reads the exception.
        new = ExceptionChainRepr([(ReprTracebackNative([header + "\n"]), None, None), *longrepr.chain])
        new.sections.extend(longrepr.sections)
        report.longrepr = new
    elif isinstance(longrepr, str):
        report.longrepr = f"{header}\n{longrepr}"
