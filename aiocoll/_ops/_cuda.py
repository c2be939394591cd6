"""CUDA execution: an op on a side stream, ordered after every rank's producers, awaited by polling.

The life of a CUDA collective:

1. *issue* (each rank, in its own thread, when it calls): :func:`issue` records an event on
   the rank's current stream, which is where its producer kernels were enqueued;
2. *enqueue* (the loop, when the last rank arrives): :func:`run_cuda` makes a side stream
   wait on every rank's event, runs the op's torch code under that stream and records a
   ``done`` event after it; no host sync anywhere;
3. *complete*: the loop polls ``done.query()`` with backoff and completes the op's future,
   so ``await work`` returns once the data is there;
4. a rank blocked in ``Work.wait()`` may instead go on at enqueue time, as with NCCL:
   :func:`stream_wait` makes its current stream wait on ``done``.

Python has no host callback for CUDA events, so completion is polled rather than waited
for on a thread: a query costs about a microsecond and wakes no thread, the backoff
bounds the added latency by :data:`POLL_CAP`, and a poll needs nothing to shut down.

Every CUDA call goes through :data:`_hw`, so tests can check the orchestration on a machine
without a GPU by swapping in fakes.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

import torch

from .. import _torch
from ._device import tensors_of

if TYPE_CHECKING:
    from . import Call

__all__ = ["POLL_CAP", "POLL_FIRST", "Issue", "issue", "run_cuda", "stream_wait", "watch"]

T = TypeVar("T")
CallT = TypeVar("CallT", bound="Call")

# The first poll runs on the next loop turn; then the delay doubles from POLL_FIRST up to
# POLL_CAP. A short op completes within a few polls; a long one costs at most one query
# per POLL_CAP and finishes at most POLL_CAP late. (An idle asyncio loop sleeps at least
# 1 ms in epoll anyway; a busy one runs the timer on its next turn.)
POLL_FIRST = 50e-6
POLL_CAP = 1e-3


class Query(Protocol):
    """What the poller needs of an event: ``torch.cuda.Event`` and the tests' fakes."""

    def query(self) -> bool: ...


# -- the CUDA calls, in one place ------------------------------------------------------


class _Torch:
    """Every CUDA call the orchestration makes; tests replace ``_hw`` with a fake."""

    def __init__(self) -> None:
        self._sides: dict[torch.device, torch.cuda.Stream] = {}

    def active(self) -> bool:
        # no CUDA tensor can exist before CUDA is initialised: the fast path on CPU runs
        return bool(torch.cuda.is_initialized())  # type: ignore[no-untyped-call]

    def device_of(self, t: torch.Tensor) -> torch.device:
        return t.device

    def event(self) -> torch.cuda.Event:
        # no timing: cheaper to record; blocking_sync is moot as nobody synchronises on it
        return torch.cuda.Event()  # type: ignore[no-untyped-call]

    def current_stream(self, device: torch.device) -> torch.cuda.Stream:
        return torch.cuda.current_stream(device)

    def side_stream(self, device: torch.device) -> torch.cuda.Stream:
        # One per device for the process: ops run one at a time in issue order, so a
        # single stream keeps them ordered on the device too.
        s = self._sides.get(device)
        if s is None:
            s = self._sides.setdefault(device, torch.cuda.Stream(device))  # type: ignore[no-untyped-call]
        return s

    def use(self, stream: torch.cuda.Stream) -> contextlib.AbstractContextManager[object]:
        return torch.cuda.stream(stream)

    def record_stream(self, t: torch.Tensor, stream: torch.cuda.Stream) -> None:
        t.record_stream(stream)

    def stage(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        if t.device.type == "cpu":
            # a copy from pageable memory may synchronise the host with the stream, which
            # waits on the ranks' producers: go through pinned memory, so the loop never waits
            t = t.pin_memory()
        return t.to(device, non_blocking=True)

    def host_buffer(self, t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=True)


_hw = _Torch()  # (the tests' fakes stand in for it)


# -- issue ------------------------------------------------------------------------------


@dataclasses.dataclass(slots=True, eq=False)
class Issue:
    """One rank's CUDA side of one collective."""

    device: torch.device
    """The rank's CUDA device: the one whose current stream ``stream_wait`` orders."""
    ready: list[torch.cuda.Event]
    """Events on the rank's current stream(s) when it called; dropped once the op waits on them."""
    done: torch.cuda.Event | None = None
    """The op's completion event, once the op is enqueued."""


def issue(call: Call) -> Issue | None:
    """Mark where ``call``'s CUDA inputs are ready: call at issue time, in the caller's thread.

    Returns None for a call without CUDA tensors (current streams are per thread, so this
    must run in the thread that issues the call).
    """
    if not _hw.active():
        return None
    devices: list[torch.device] = []
    for t in tensors_of(call):
        d = _hw.device_of(t)
        if d.type == "cuda" and d not in devices:
            devices.append(d)
    if not devices:
        return None
    ready = []
    for d in devices:
        e = _hw.event()
        e.record(_hw.current_stream(d))  # type: ignore[no-untyped-call,unused-ignore]  # (untyped in torch 2.10)
        ready.append(e)
    return Issue(devices[0], ready)


def stream_wait(iss: Issue) -> None:
    """Order the caller's current stream after the op (NCCL's ``wait()``: no host sync)."""
    if iss.done is not None:
        _hw.current_stream(iss.device).wait_event(iss.done)


# -- enqueue ----------------------------------------------------------------------------


def run_cuda(
    loop: asyncio.AbstractEventLoop,
    run: Callable[[Sequence[Call]], list[object]],
    calls: Sequence[Call],
    issues: Sequence[Issue | None],
    *,
    first: float = POLL_FIRST,
    cap: float = POLL_CAP,
) -> asyncio.Future[list[object]]:
    """Enqueue ``run(calls)`` on a side stream; the future completes on ``loop`` when it has run.

    ``issues`` are the ranks' :func:`issue` records (None for a rank without CUDA
    tensors). On return each has ``done`` set, unless the enqueue failed: then the future
    already holds the error.
    """
    try:
        done, finish = _enqueue(run, calls, issues)
    except Exception as e:
        fut: asyncio.Future[list[object]] = loop.create_future()
        fut.set_exception(e)
        return fut
    for iss in issues:
        if iss is not None:
            iss.ready = []  # waited on by the side streams: free them now
            iss.done = done
    return watch(loop, done, finish, first=first, cap=cap)


@torch.no_grad()
def _enqueue(
    run: Callable[[Sequence[Call]], list[object]], calls: Sequence[Call], issues: Sequence[Issue | None]
) -> tuple[torch.cuda.Event, Callable[[], list[object]]]:
    """Enqueue the op; return its ``done`` event and what to call on the loop once it is done."""
    hw = _hw
    where = [hw.device_of(t) for c in calls for t in tensors_of(c)]
    # every CUDA device of the op, in rank order: the op runs on the first (rank 0's)
    devices = list(dict.fromkeys(d for d in where if d.type == "cuda"))
    op_dev = devices[0]
    mixed = any(d != op_dev for d in where)  # some tensor must be staged
    sides = {d: hw.side_stream(d) for d in devices}
    ready = [e for iss in issues if iss is not None for e in iss.ready]
    for s in sides.values():
        for e in ready:
            s.wait_event(e)
    with contextlib.ExitStack() as stack:
        # Make each side stream current on its device (torch's cross-device copies order
        # themselves after both devices' current streams); the op's device last, so it
        # stays the current device.
        for d in reversed(devices):
            stack.enter_context(hw.use(sides[d]))
        if not mixed:
            for c in calls:
                for t in tensors_of(c):
                    hw.record_stream(t, sides[op_dev])
            results = run(calls)
            host: list[tuple[torch.Tensor, torch.Tensor]] = []
        else:
            results, host = _run_staged(run, calls, op_dev, sides)
        s = sides[op_dev]
        for d in devices[1:]:  # one event to cover the other devices' copies too
            e = hw.event()
            e.record(sides[d])  # type: ignore[no-untyped-call,unused-ignore]  # (untyped in torch 2.10)
            s.wait_event(e)
        done = hw.event()
        done.record(s)  # type: ignore[no-untyped-call,unused-ignore]  # (untyped in torch 2.10)

    @torch.no_grad()
    def finish() -> list[object]:
        for orig, buf in host:
            orig.copy_(buf)
        return results

    return done, finish


def _run_staged(
    run: Callable[[Sequence[Call]], list[object]],
    calls: Sequence[Call],
    op_dev: torch.device,
    sides: dict[torch.device, torch.cuda.Stream],
) -> tuple[list[object], list[tuple[torch.Tensor, torch.Tensor]]]:
    """Run an op whose ranks' tensors sit on several devices (or the host) on ``op_dev``.

    torch's reductions need their inputs on one device: tensors elsewhere are copied to
    ``op_dev`` (peer to peer where the devices allow it, else staged by the driver), the
    op runs there, and the copies it wrote (their version counter moved) go back. Copies
    of a tensor the op only read are never written back, so an output that aliases an
    input (a chunk of it) gets the op's answer, as it does in place. Host tensors come
    back through pinned buffers, copied into place on the loop once the op is done.
    """
    hw = _hw
    staged: dict[int, torch.Tensor] = {}  # by id: a tensor passed twice is staged once
    back: list[tuple[torch.Tensor, torch.Tensor, int]] = []  # (original, copy, copy's version)

    def place(t: torch.Tensor) -> torch.Tensor:
        d = hw.device_of(t)
        if d.type == "cuda":
            # the caching allocator must not reuse its memory before the side stream is done
            hw.record_stream(t, sides[d])
        if d == op_dev:
            return t
        s = staged.get(id(t))
        if s is None:
            s = staged[id(t)] = hw.stage(t, op_dev)
            back.append((t, s, _torch.version_of(s)))
        return s

    results = run([_with_tensors(c, place) for c in calls])
    host: list[tuple[torch.Tensor, torch.Tensor]] = []
    for orig, s, version in back:
        if _torch.version_of(s) == version:
            continue  # only read
        if hw.device_of(orig).type == "cuda":
            orig.copy_(s, non_blocking=True)
        else:
            buf = hw.host_buffer(s)
            buf.copy_(s, non_blocking=True)
            host.append((orig, buf))
    return results, host


def _with_tensors(call: CallT, fn: Callable[[torch.Tensor], torch.Tensor]) -> CallT:
    """A shallow copy of ``call`` with ``fn`` applied to each of its tensors."""
    new = copy.copy(call)
    for f in dataclasses.fields(new):
        v = getattr(new, f.name)
        if isinstance(v, torch.Tensor):
            object.__setattr__(new, f.name, fn(v))
        elif isinstance(v, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in v):
            object.__setattr__(new, f.name, type(v)(fn(x) if isinstance(x, torch.Tensor) else x for x in v))
    return new


# -- complete ---------------------------------------------------------------------------


class _Watch(Generic[T]):
    """Polls an event from the loop with backoff; completes ``fut`` with ``then()`` when it fires."""

    __slots__ = ("cap", "delay", "event", "fut", "loop", "polls", "then")

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        event: Query,
        then: Callable[[], T],
        fut: asyncio.Future[T],
        first: float,
        cap: float,
    ) -> None:
        self.loop = loop
        self.event = event
        self.then = then
        self.fut = fut
        self.delay = first
        self.cap = cap
        self.polls = 0

    def poll(self) -> None:
        fut = self.fut
        if fut.done():  # cancelled: nobody waits any more
            return
        self.polls += 1
        try:
            fired = self.event.query()  # raises on a CUDA error in the op
            if fired:
                value = self.then()
        except Exception as e:
            fut.set_exception(e)
            return
        if fired:
            fut.set_result(value)
            return
        self.loop.call_later(self.delay, self.poll)
        self.delay = min(self.delay * 2, self.cap)


def watch(
    loop: asyncio.AbstractEventLoop,
    event: Query,
    then: Callable[[], T],
    *,
    first: float = POLL_FIRST,
    cap: float = POLL_CAP,
) -> asyncio.Future[T]:
    """A future on ``loop`` completed with ``then()`` once ``event.query()`` is true.

    Never blocks the loop: the first query runs on the next loop turn, then after delays
    doubling from ``first`` up to ``cap``. An error from ``query()`` or ``then()`` goes into
    the future; cancelling the future stops the polling. Call on the loop's thread.
    """
    fut: asyncio.Future[T] = loop.create_future()
    loop.call_soon(_Watch(loop, event, then, fut, first, cap).poll)
    return fut
