"""Checked groups: aiocoll's cross-process reports for the groups a rank's process makes.

In ``aiocoll run``'s processes mode each rank is a process of its own, whose script calls
``init_process_group`` (gloo, NCCL, any init method) as under torchrun. With the checks
on (the default; ``--no-checks`` leaves torch's groups alone), every group the script
makes there (the default group, ``new_group``, DeviceMesh's) is a ``CheckedProcessGroup``
standing for a real group of the backend asked, made beside it. Each collective becomes a
call of a ``ProcessGroupComm`` with checks (``_xcheck``) on the real group, so:

* ranks that call different collectives, or disagree on shapes, dtypes, roots, reduce
  ops or split sizes, raise ``CollectiveMismatchError`` in every process within a round
  trip, naming each rank's call and file:line in the script; the op is never issued;
* a rank whose process exits or dies is named in the survivors' ``WorldAbortedError``;
* every process blocked in ops that none of the others can meet is a deadlock, reported
  with what each rank waits in (``_xdeadlock``);
* ``$TORCH_FR_DUMP_TEMP_FILE`` gets the flight recorder's dumps, in torch's format.

The checks of a process run on an event loop of their own, on a daemon thread
(``_ChecksLoop``): the script's threads (its main thread, DDP's reducer, a checkpoint
writer's) issue their ops there and block in ``Work.wait()`` as on gloo's works. The
real groups and the checks' side groups are made on threads (``_REAL``) where this
module's hook on torch's group creation leaves torch alone.

>>> CHECKED
'aiocoll_checked'
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import os
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, ClassVar, NoReturn, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.constants as dist_constants

from .. import _current, _patches, _torch
from .. import _ops as ops
from .._bridge._pg import PGWork, ProcessGroupComm
from .._bridge._pgissue import Issuer
from .._bridge._presence import Presence
from .._bridge._xdeadlock import WATCH_AFTER, Wait, watching
from .._c10d._backend import CommProcessGroup, user_site
from .._errors import CollectiveTimeoutError
from .._lifecycle._config import loop_factory
from .._lifecycle._procworld import MAPPED_BACKENDS
from .._work import Site, TorchFutures, cancelled_error, fmt_site

if TYPE_CHECKING:
    from torch.nn.parallel import DistributedDataParallel

    from .._torch import DistributedBackendOptions, Store

__all__ = [
    "CHECKED",
    "CHECKED_INIT",
    "CheckedProcessGroup",
    "install",
]

CHECKED = "aiocoll_checked"  # the backend that makes checked groups (registered by install())

T = TypeVar("T")

# a thread that makes real groups (a checked group's own, or the checks' side groups): the
# hook leaves torch's group creation alone there
_REAL = _current.Facet("makes real process groups", False, carried=False)
# the backend the group being made was asked for (set by the hook, read by the creator it calls)
_ASKED: _current.Facet[object] = _current.Facet("the backend asked for the group being made", None, carried=False)
# the torch defaults for a group's timeout: the run's --timeout applies in their place, as in one process
_TORCH_DEFAULTS = {t for t in (dist_constants.default_pg_timeout, dist_constants.default_pg_nccl_timeout) if t}


class _ChecksLoop:
    """The event loop of this process's checks, run by a daemon thread (made at the first checked group)."""

    _current: ClassVar[_ChecksLoop | None] = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.loop = loop_factory("auto")()  # (uvloop where installed, as spawn's)
        # every group made on its thread, or on its executor's (the side groups), is a real one
        pool = concurrent.futures.ThreadPoolExecutor(
            thread_name_prefix="aiocoll checks", initializer=_REAL.set, initargs=(True,)
        )
        self.loop.set_default_executor(pool)
        self.thread = threading.Thread(target=self._run, name="aiocoll checks", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        _REAL.set(True)
        self.loop.run_forever()

    @classmethod
    def get(cls) -> _ChecksLoop:
        with cls._lock:
            if cls._current is None:
                cls._current = cls()
            return cls._current

    def call(self, fn: Callable[[], T]) -> T:
        """``fn()`` run on the loop's thread; its result (or error) here."""
        if threading.get_ident() == self.thread.ident:
            return fn()
        done: concurrent.futures.Future[T] = concurrent.futures.Future()

        def run() -> None:
            try:
                done.set_result(fn())
            except BaseException as e:
                done.set_exception(e)

        self.loop.call_soon_threadsafe(run)
        return done.result()

    def __repr__(self) -> str:
        return f"<_ChecksLoop thread={self.thread.name!r} alive={self.thread.is_alive()}>"


class _ThreadedWork(PGWork):
    """A ``PGWork`` handed to a thread of the script: it waits and hands out torch futures from there.

    Issued on the checks loop (``issue``, called there) without a round trip: the thread
    that called goes on at once, and waits on an event the loop sets at the op's end. A
    wait longer than ``WATCH_AFTER`` is told to the other processes, and ends in a
    ``DeadlockError`` once every process is blocked in ops none of the others can meet
    (``_xdeadlock``).
    """

    __slots__ = ("_comm", "_ended", "_inner", "_seq")

    def __init__(self, call: ops.Call, comm: _ThreadedComm, site: Site | None) -> None:
        # (an asyncio future may be made off its loop's thread; it is completed on it)
        super().__init__(asyncio.Future(loop=comm.loop), call, comm.rank, comm.group_name, site)
        self._comm = comm
        self._ended = threading.Event()  # set on the loop once _fut is done
        self._inner: asyncio.Future[object] | None = None  # the issuer's future of the op
        self._seq: int | None = None  # a collective's number in its group, once issued

    def issue(self, iss: Issuer) -> None:
        """On the checks loop: issue the op (after its check) and complete this work with it."""
        fut = self._fut
        try:
            inner = self._inner = iss.issue(self._call, fut.get_loop(), self._site)
        except BaseException as e:  # arguments the group cannot serve: nothing was sent
            fut.set_exception(e)
            self._ended.set()
            return
        self._seq = iss.seq_of(inner)

        def done(f: asyncio.Future[object]) -> None:
            if f.cancelled():
                fut.cancel()
            elif (exc := f.exception()) is not None:
                fut.set_exception(exc)
                fut.exception()  # retrieved: the thread reads it from here
            else:
                fut.set_result(f.result())
            self._ended.set()

        inner.add_done_callback(done)

    def wait(self, timeout: float | None = None) -> object:
        ended = self._ended
        if not ended.wait(WATCH_AFTER if timeout is None else min(timeout, WATCH_AFTER)):
            self._wait_long(ended, timeout)
        fut = self._fut
        if not fut.cancelled() and (exc := fut.exception()) is not None:
            # raised here, as gloo's work raises in wait(): not from the checks' frames on their loop
            raise exc.with_traceback(None)
        return fut.result()

    def done(self) -> bool:
        return self._ended.is_set()

    def is_completed(self) -> bool:
        return self._ended.is_set()

    def _wait_long(self, ended: threading.Event, timeout: float | None) -> None:
        """Wait on for ``ended``, watched for a deadlock across processes; the deadlock fails the op."""
        deadline = None if timeout is None else time.monotonic() + timeout
        comm = self._comm
        presence = comm.presence
        wait = self._as_wait()
        if presence is None or wait is None:  # (no checks yet, or an op no peer can meet by name)
            if not ended.wait(None if deadline is None else max(0.0, deadline - time.monotonic())):
                self._timed_out(timeout)
            return
        with watching(wait, presence, dist.get_rank(), dist.get_world_size()) as watch:
            while not ended.wait(WATCH_AFTER):
                if deadline is not None and time.monotonic() >= deadline:
                    self._timed_out(timeout)
                err = watch.look()
                if err is not None and self._inner is not None:
                    comm.fail(self._inner, err)
                    ended.wait()
                    return

    def _timed_out(self, timeout: float | None) -> NoReturn:
        raise CollectiveTimeoutError(f"rank {self._grank} waited {timeout}s in {self.describe()}; it is still pending")

    def _as_wait(self) -> Wait | None:
        call, ranks = self._call, self._comm.group_ranks
        what = f"{call.describe()} {self._where} at {fmt_site(self._site)}"
        if isinstance(call, ops.Send):
            return Wait(self._group_name, ranks, "send", None, ranks[call.dst], what)
        if isinstance(call, ops.Recv):
            return Wait(self._group_name, ranks, "recv", None, None if call.src is None else ranks[call.src], what)
        if self._seq is None:
            return None
        return Wait(self._group_name, ranks, "collective", self._seq, None, what)

    @property
    def _where(self) -> str:
        return f"on group {self._group_name!r}" if self._seq is None else f"#{self._seq} on group {self._group_name!r}"

    def torch_future(self, value: object) -> torch.futures.Future[object]:
        futs = TorchFutures()
        tf = futs.add(value)
        fut = self._fut

        def done(f: asyncio.Future[object]) -> None:
            futs.settle(cancelled_error(self.describe()) if f.cancelled() else f.exception())

        # (asyncio's callbacks are added on its loop's thread only)
        fut.get_loop().call_soon_threadsafe(fut.add_done_callback, done)
        return tf


class _ThreadedComm(ProcessGroupComm):
    """A checked ``ProcessGroupComm`` that any thread of the process calls: its ops are issued on the checks loop."""

    __slots__ = ("_checks",)

    def __init__(self, pg: dist.ProcessGroup, checks: _ChecksLoop, timeout: float | None) -> None:
        # the checks start at the first op: their heartbeats live in the default group's
        # store, and the default group's own comm is made before c10d has it
        super().__init__(pg, timeout=timeout, check=False)
        self._checks = checks

    def show_as(self, name: str, desc: str) -> None:
        """Name the group as the script knows it, in the reports and the flight recorder."""
        self._iss.show_as(name, desc)

    def _site(self) -> Site:
        return user_site()

    @property
    def presence(self) -> Presence | None:
        """This process's heartbeat in the job (once the checks started)."""
        chk = self._iss.checker
        return None if chk is None else chk.presence

    def fail(self, fut: asyncio.Future[object], err: BaseException) -> None:
        """Fail the op of ``fut``, and every later op of the group, with ``err`` (a deadlock seen across processes)."""
        self._checks.call(lambda: self._iss.fail(fut, err))

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._checks.loop

    def _join(self, call: ops.Call) -> _ThreadedWork:
        work = _ThreadedWork(call, self, self._site())
        iss = self._iss
        if iss.checker is None:
            self._checks.call(lambda: iss.set_check(True))  # (once, on the loop's thread)
        self._checks.loop.call_soon_threadsafe(work.issue, iss)
        return work


@_torch.python_process_group
class CheckedProcessGroup(CommProcessGroup):
    """A group of a rank's process whose collectives are checked across processes, then run on a real group.

    ``real`` is the group of the backend the script asked for (gloo, NCCL), made beside it.
    """

    backend_name = CHECKED
    _comm: _ThreadedComm

    @property
    def real(self) -> dist.ProcessGroup:
        """The real group the collectives run on."""
        return self._comm.process_group

    def monitored_barrier(self, timeout: timedelta | float | None = None, wait_all_ranks: bool = False) -> None:
        """The real group's own (gloo's): it names the ranks that did not come in ``timeout``."""
        limit = timeout if timeout is None or isinstance(timeout, timedelta) else timedelta(seconds=timeout)
        dist.monitored_barrier(self.real, limit, wait_all_ranks)


def _make_group(opts: DistributedBackendOptions, backend_options: object = None) -> CheckedProcessGroup:
    """The creator torch.distributed calls for backend ``CHECKED`` (extended API): a real group, checked."""
    global _said
    if _said is not None:
        said, _said = _said, None
        print(said.replace("{pid}", str(os.getpid())), file=sys.stderr)
    name = str(opts.group_id)
    ranks = list(opts.global_ranks_in_group)
    timeout: timedelta = opts.timeout
    with _REAL.bound(True):
        real = _torch.make_group(
            int(opts.group_size), int(opts.group_rank), ranks, _ASKED.get(), opts.store, f"{name}/real", timeout
        )
    seconds = _run_timeout if timeout in _TORCH_DEFAULTS else None  # (None: the group's own)
    comm = _ThreadedComm(real, _ChecksLoop.get(), seconds)
    comm.show_as(name, str(getattr(opts, "group_desc", "undefined")))
    return CheckedProcessGroup(comm, name)


def _group_backend(backend: object, group_rank: int, ranks: list[int]) -> str | None:
    """For ``CHECKED_INIT``: the checked backend for the groups the script makes, None for the real ones."""
    names = [part.split(":")[-1].strip().lower() for part in str(backend).split(",")]
    if _REAL.get() or not names or not all(n in MAPPED_BACKENDS for n in names):
        return None
    _ASKED.set(backend)
    return CHECKED


def _rendezvous(url: str, rank: int, world_size: int) -> tuple[Store, int, int] | None:
    return None  # torch's own: the ranks are processes, and meet as under torchrun


def _monitored_barrier(real: Callable[..., None]) -> Callable[..., None]:
    """``dist.monitored_barrier``: on a checked group, the real group's (gloo's, which names the ranks
    that did not come; torch 2.15 asks the group itself for a CPU backend, which a Python group lacks)."""

    @functools.wraps(real)
    def monitored_barrier(group: object = None, *args: object, **kwargs: object) -> None:
        pg = group if group is not None else (_torch.default_group() if dist.is_initialized() else None)
        if isinstance(pg, CheckedProcessGroup):
            group = pg.real
        real(group, *args, **kwargs)

    return monitored_barrier


def _ddp_logging_data(
    real: Callable[[DistributedDataParallel], dict[str, object]],
) -> Callable[[DistributedDataParallel], dict[str, object]]:
    """DDP's ``_get_ddp_logging_data``: on a checked group, what it says of the backend is its real group's."""

    @functools.wraps(real)
    def get_ddp_logging_data(ddp: DistributedDataParallel) -> dict[str, object]:
        data = real(ddp)
        pg = getattr(ddp, "process_group", None)
        checked = pg if isinstance(pg, CheckedProcessGroup) else None
        if checked is None and pg is not None:
            with contextlib.suppress(Exception):  # (torch's wrapper of it, for the default group)
                found = _torch.backend_of(pg, torch.device("cpu"))
                checked = found if isinstance(found, CheckedProcessGroup) else None
        if checked is not None:
            data.update(_torch.ddp_backend_logging(checked.real))
        return data

    return get_ddp_logging_data


def _checked_init(key: object) -> list[_patches.Change]:
    real = dist.monitored_barrier
    c10d = sys.modules[real.__module__]  # (distributed_c10d, where torch.distributed took it from)
    barrier = _monitored_barrier(real)
    ddp, name = _torch.ddp_logging_data()
    return [
        *_torch.process_harness.init_changes(_group_backend, _rendezvous),
        _patches.Attr(dist, "monitored_barrier", barrier),
        _patches.Attr(c10d, "monitored_barrier", barrier),
        _patches.Attr(ddp, name, _ddp_logging_data(getattr(ddp, name))),
    ]


CHECKED_INIT = _patches.PatchSet(
    "checked groups",
    "in a rank's process of aiocoll run (processes mode), the groups c10d makes for gloo, nccl... are "
    "checked ones, each over a real group of that backend; monitored_barrier on one is its real group's, and so "
    "is what DDP's logging data says of the backend",
    _checked_init,
    [
        *_torch.process_harness.INIT_TARGETS,
        "torch.distributed.monitored_barrier",
        "torch.distributed.distributed_c10d.monitored_barrier",
        "*DistributedDataParallel._get_ddp_logging_data",
    ],
)

_run_timeout: float | None = None
_said: str | None = None  # printed once, as the process makes its first checked group


def install(timeout: float | None, *, said: str | None = None) -> None:
    """In a rank's process, before its script runs: the groups it makes are checked ones.

    ``timeout``: seconds a collective may wait in a group the script gave no timeout of
    its own (``aiocoll run --timeout``); None: torch's. ``said``: what to print on stderr
    (``{pid}`` in it: the process's) when the process makes its first group, if anything.
    """
    global _run_timeout, _said
    _run_timeout = timeout
    _said = said
    if CHECKED not in dist.Backend.backend_list:
        dist.Backend.register_backend(CHECKED, _make_group, extended_api=True, devices=["cpu", "cuda"])
    if not any(inst.name == CHECKED_INIT.name for inst in _patches.installed()):
        _patches.acquire(CHECKED_INIT)


def _forked() -> None:
    # a forked child has a copy of the checks' loop object, not its thread
    _ChecksLoop._current = None
    _ChecksLoop._lock = threading.Lock()


os.register_at_fork(after_in_child=_forked)
