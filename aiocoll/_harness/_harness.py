"""torch's multi-process test harness, in one process: each test's ranks as aiocoll sync ranks.

``aiocoll.testing.replace_process_harness()`` routes ``MultiProcessTestCase`` here, and
``MultiProcContinuousTest`` to ``_continuous``, which builds on this. A test's ranks run
as a world that stands for processes (``_procworld.InProcessWorld``), so that the test's
thread can give up on ranks that never end. Each rank runs torch's own per-process code
(``cls._run`` or ``cls._worker_loop``) on an object of a class of its own
(``rank_class``), as a process would: what one rank sets on its class, the others do not
see.

What a rank would have been as a process is handed back in torch's terms (exit codes,
the tracebacks sent down the pipes, the results in the completion queues), so that
torch's own code decides what passed, failed or was skipped, and aiocoll's report
(which rank raised first, who was aborted because of it, the flight recorder) is
added to the failure.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import signal
import traceback
import types
import unittest
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, TypeVar, cast

from .. import _torch
from .._engine._grouptimeouts import slowdown
from .._errors import RankExitedError
from .._lifecycle._outcome import echoes_abort
from .._lifecycle._procworld import InProcessWorld, WorldEnd
from .._process import _procstate

if TYPE_CHECKING:
    from .._torch import MultiProcessTestCase

C = TypeVar("C", bound=type)

__all__ = [
    "FakeProcess",
    "Fallback",
    "Mailbox",
    "RankEnd",
    "Settings",
    "exit_code",
    "rank_class",
    "report_process_ranks",
    "run_process_ranks",
]

# a rank terminated by torch's harness once another failed (-SIGTERM, as multiprocessing reports it)
TERMINATED = -int(signal.SIGTERM)


Fallback = Literal["processes", "skip"]


@dataclass(frozen=True)
class Settings:
    """How in-process tests run: set by ``replace_process_harness``."""

    timeout: float | None  # one wait in one collective; None: half the test's own timeout
    fallback: Fallback  # what becomes of tests that need processes of their own

    def collective_timeout(self, test_timeout: float) -> float:
        return self.timeout if self.timeout is not None else test_timeout / 2

    @staticmethod
    def deadline(test_timeout: float, size: int) -> float:
        """How long a test's ranks may run in-process: torch's timeout, in the CPU time its processes had.

        torch gives a test's W processes ``test_timeout`` seconds on the machine's cores;
        ranks taking turns use one core. A hang is no longer what this bound is for (a
        deadlock is reported at once, each wait in a collective has its own timeout):
        only a rank that never stops computing runs into it.
        """
        return test_timeout * slowdown(size)


def rank_class(cls: C) -> C:
    """A subclass of ``cls`` for one rank, which passes for ``cls`` (same name, module, test ids).

    In processes, a rank that sets a class attribute (``MultiProcContinuousTest`` sets
    ``cls.rank`` and ``cls.pg``) sets its own copy; here each rank sets its subclass's.
    """
    # (new_class says it makes a type: a subclass of cls, so a C)
    return cast(
        "C",
        types.new_class(
            cls.__name__,
            (cls,),
            exec_body=lambda ns: ns.update(
                __module__=cls.__module__, __qualname__=cls.__qualname__, __doc__=cls.__doc__
            ),
        ),
    )


# -- what torch's harness sees of a rank: a process, its pipe ------------------------------


class FakeProcess:
    """A rank as torch's harness sees its process: a name, a pid, an exit code (None: still running)."""

    def __init__(self, rank: int, exitcode: int | None) -> None:
        self.name = f"process {rank}"
        self.pid = f"aiocoll rank {rank}"  # a key of pid_to_pipe, and shown in torch's messages
        self.exitcode = exitcode

    def is_alive(self) -> bool:
        return self.exitcode is None

    def terminate(self) -> None:
        """Nothing to stop: the rank's thread has ended (or cannot be stopped)."""

    def kill(self) -> None:
        """As ``terminate``."""

    def join(self, timeout: float | None = None) -> None:
        """The rank has ended already."""

    def __repr__(self) -> str:
        return f"<FakeProcess {self.name} exitcode={self.exitcode}>"


class Mailbox:
    """The parent's end of a rank's pipe, as torch's harness reads it: what the rank sent."""

    def __init__(self, messages: Sequence[object]) -> None:
        self._messages = list(messages)
        self.closed = False

    def recv(self) -> object:
        if not self._messages:  # (a process's closed pipe would raise EOFError)
            return "(the rank sent nothing: its code exited with this code itself)\n"
        return self._messages.pop(0)

    def poll(self, timeout: float | None = 0.0) -> bool:
        return bool(self._messages)

    def send(self, obj: object) -> None:
        """Requests to the rank (torch asks a hung process for its traceback): answered by aiocoll's report."""

    def close(self) -> None:
        self.closed = True

    def __repr__(self) -> str:
        return f"<Mailbox {len(self._messages)} message(s)>"


@dataclass
class RankEnd:
    """How one rank ended: its exit code as a process's, what it sent, the failure behind a non-zero code."""

    exitcode: int | None = None
    sent: list[object] = field(default_factory=list)
    error: BaseException | None = None


# -- MultiProcessTestCase ------------------------------------------------------------------------


def exit_code(e: SystemExit) -> int:
    """The exit code of a process ended by ``e`` (as multiprocessing reports it)."""
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    return 1


def run_process_ranks(case: MultiProcessTestCase, settings: Settings) -> tuple[WorldEnd, list[RankEnd]]:
    """Run the ranks of ``case`` (a MultiProcessTestCase in the main process) in-process."""
    error_code = int(case.TEST_ERROR_EXIT_CODE)
    test_name = case._current_test_name()
    cls, file_name, size = type(case), case.file_name, int(case.world_size)
    kwargs = {"fake_pg": getattr(case, "fake_pg", False)}
    ends = [RankEnd() for _ in range(size)]
    skips = _torch.process_harness.skips()

    def rank_main(rank: int) -> None:
        end = ends[rank]
        parent, child = multiprocessing.Pipe()
        failure: BaseException | None = None
        try:
            rank_class(cls)._run(rank, test_name, file_name, child, **kwargs)
            end.exitcode = 0
        except SystemExit as e:
            end.exitcode = exit_code(e)
            if end.exitcode == error_code and e.__context__ is not None:
                failure = end.error = e.__context__  # what run_test caught, reported and exited for
            elif end.exitcode not in (0, *skips):
                # a process that exits with an error closes its sockets: its peers' collectives
                # with it fail at once (gloo's "connection closed"), not at the test's timeout
                failure = end.error = RankExitedError.of(rank, e)
        except _procstate.NeedsProcess:
            raise
        except BaseException as e:  # out of _run itself: a process would print it and exit with 1
            end.exitcode, failure = 1, e
            end.error = e
        finally:
            with contextlib.suppress(OSError, EOFError):  # (EOF: run_test closed its end)
                while parent.poll():
                    end.sent.append(parent.recv())
            parent.close()
            child.close()
        if failure is not None:
            raise failure  # aiocoll's world learns of it now: the others are released at once

    test_timeout = _torch.process_harness.test_timeout(case.id())
    deadline = settings.deadline(test_timeout, size)
    world = InProcessWorld(size, settings.collective_timeout(test_timeout), deadline, case.id())
    return world.run(rank_main), ends


def report_process_ranks(case: MultiProcessTestCase, fn: object, end: WorldEnd, ends: list[RankEnd]) -> None:
    """Hand the ranks' ends to torch's ``_check_return_codes``, adding aiocoll's report to a failure."""
    error_code = int(case.TEST_ERROR_EXIT_CODE)
    notes = list(getattr(end.error, "__notes__", []))
    if end.timed_out:
        first = min(end.busy, default=0)
        raise end.timeout_error(
            case.id(), end.deadline, f"Process {first} terminated or timed out after {end.elapsed} seconds"
        )
    processes, pipes = [], {}
    seen: dict[tuple[type, str], int] = {}
    for rank, e in enumerate(ends):
        code, sent = e.exitcode, list(e.sent)
        if e.error is not None and echoes_abort(e.error):
            code, sent = TERMINATED, []  # only released because another rank failed: torch stops those
        elif code == error_code and e.error is not None:
            key = (type(e.error), str(e.error))
            if key in seen:
                sent = [f"(the same {type(e.error).__name__} as process {seen[key]})\n"]
            else:
                seen[key] = rank
        elif code == 1 and e.error is not None:
            notes.append(
                f"aiocoll: process {rank} exited with code 1 on an exception out of {type(case).__name__}._run:\n"
                + "".join(traceback.format_exception(e.error))
            )
        p = FakeProcess(rank, code)
        processes.append(p)
        pipes[p.pid] = Mailbox(sent)
    if end.error is not None and not any(x.error is not None for x in ends):
        raise end.error  # not a rank's: aiocoll's own (a torch it cannot work with, a warning made an error)
    skips = _torch.process_harness.skips()
    for rank, e in enumerate(ends):
        if e.exitcode not in (0, None, error_code, 1):
            # a rank that left early (skipped, sys.exit) while others went on: why they then waited
            why = f" ({skips[e.exitcode]})" if e.exitcode in skips else ""
            notes.append(f"aiocoll: process {rank} exited with code {e.exitcode}{why}")
    case.processes, case.pid_to_pipe = processes, pipes
    try:
        case._check_return_codes(fn, end.elapsed)
    except unittest.SkipTest:
        raise
    except BaseException as failure:
        for n in notes:
            failure.add_note(n)
        raise
