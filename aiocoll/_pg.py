"""``Comm`` over a real torch.distributed process group (gloo, NCCL): ``from_process_group``.

Every op is issued with torch's own process group (the ``ProcessGroup`` methods that
``dist.all_reduce(..., async_op=True)`` and friends call) and completes on the event loop
through a bridged future; nothing here moves data by itself, and nothing blocks the loop.

The pieces are usable on their own:

- ``bridge_work(work, loop)`` / ``bridge_future(fut, loop)``: a ``dist.Work`` or torch
  Future as an ``asyncio.Future`` of ``loop``, completed with ``call_soon_threadsafe``.
  Works without a future (gloo's send, recv and reduce-scatters) are waited on in a
  helper thread.
- ``Issuer``: one per process group (``Issuer.of(pg)``); ``issuer.issue(call)`` issues one
  aiocoll op call (the dataclasses of ``_ops``: ``AllReduce``, ``Send``,
  ``BroadcastObject``, ...) and returns an ``asyncio.Future`` of what ``await`` returns
  in-process. Ops reach the group in call order, multi-step ones (objects) included.
- ``all_gather_bytes``, ``broadcast_bytes``, ``gather_bytes``, ``scatter_bytes``: async
  exchange of byte strings (sizes first, then padded uint8 tensors, all ``async_op``);
  torch's ``all_gather_object`` and the like block, so they are not used.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import pickle
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from . import _cuda, _frdump, _torch
from . import _ops as ops
from ._comm import Comm
from ._errors import (
    AiocollError,
    BlockingCallError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    InvalidArgumentError,
    WorldAbortedError,
)
from ._record import Stamp
from ._stats import RankStatistics, Statistics
from ._work import Site, Work
from ._xcheck import Checker

__all__ = [
    "Issuer",
    "PGWork",
    "ProcessGroupComm",
    "all_gather_bytes",
    "bridge_future",
    "bridge_work",
    "broadcast_bytes",
    "from_process_group",
    "gather_bytes",
    "scatter_bytes",
]

_R = dist.ReduceOp
_P2P = (ops.Send, ops.Recv)
_Done = Callable[[BaseException | None], None]


# -- bridging torch completions into the loop ----------------------------------------------


# Completions arrive on torch's threads (gloo's workers) or ours. The callback we hand over
# is kept in a one-item box that only the loop empties: were the last reference to it
# (and through it to a Comm, its issuer and the process group) dropped on a gloo worker
# thread, after destroy_process_group, the group would be destroyed on its own worker
# thread, which aborts the process ("terminate called without an active exception").


def _call_on(loop: asyncio.AbstractEventLoop, box: list[_Done], exc: BaseException | None) -> None:
    with contextlib.suppress(RuntimeError):  # a closed loop: nobody is left to tell
        loop.call_soon_threadsafe(_take_and_call, box, exc)


def _take_and_call(box: list[_Done], exc: BaseException | None) -> None:
    box.pop()(exc)


class _Waiters:
    """Daemon threads that block in ``work.wait()`` for works that have no future.

    Grows on demand (a pending recv holds its thread until a send arrives or the group's
    timeout) and never joins at exit, so a forgotten recv cannot hold the process.
    """

    def __init__(self) -> None:
        self._q: queue.SimpleQueue[tuple[dist.Work, asyncio.AbstractEventLoop, list[_Done]]] = queue.SimpleQueue()
        self._idle = 0
        self._lock = threading.Lock()

    def submit(self, work: dist.Work, loop: asyncio.AbstractEventLoop, box: list[_Done]) -> None:
        with self._lock:
            if self._idle:
                self._idle -= 1
            else:
                threading.Thread(target=self._run, name="aiocoll-pg-wait", daemon=True).start()
        self._q.put((work, loop, box))

    def _run(self) -> None:
        while True:
            work, loop, box = self._q.get()
            exc: BaseException | None = None
            try:
                work.wait()
            except BaseException as e:
                exc = e
            _call_on(loop, box, exc)
            del work, loop, box, exc
            with self._lock:
                self._idle += 1


_waiters = _Waiters()


class _Completed:
    """``work.is_completed()`` as an event the loop can poll (``_cuda.watch``)."""

    __slots__ = ("work",)

    def __init__(self, work: dist.Work) -> None:
        self.work = work

    def query(self) -> bool:
        return bool(self.work.is_completed())


def when_done(
    work: dist.Work, loop: asyncio.AbstractEventLoop, fn: _Done, *, on_device: bool = False, wait: bool = True
) -> None:
    """Call ``fn(None)`` (or ``fn(error)``) on ``loop``'s thread once ``work`` completes.

    ``on_device``: the work runs on an accelerator's stream. NCCL completes such a work's
    future when the op is *enqueued*; the op is done once ``work.is_completed()`` (a
    non-blocking event query), which the loop then polls as it polls aiocoll's own CUDA
    ops. Then ``work.wait()`` (``wait=True``) raises the op's error, if any, and orders the
    loop thread's current stream after the op, without blocking: the op is done. Pass
    ``wait=False`` for a barrier, whose ``wait()`` synchronises the whole current stream.
    """
    if on_device:
        then = fn

        def finish() -> None:
            if wait:
                work.wait()

        def fn(exc: BaseException | None) -> None:  # on the loop
            if exc is not None:
                then(exc)
                return
            polled = _cuda.watch(loop, _Completed(work), finish)
            polled.add_done_callback(lambda f: then(f.exception()))

    box = [fn]
    try:
        tfut = work.get_future()
    except RuntimeError:  # "Work::getFuture not implemented" (gloo: send, recv, reduce-scatters)
        _waiters.submit(work, loop, box)
        return

    def done(f: torch.futures.Future[Any]) -> None:
        exc: BaseException | None = None
        try:
            f.value()  # raises the op's error
        except BaseException as e:
            exc = e
        _call_on(loop, box, exc)

    tfut.add_done_callback(done)


def bridge_work(
    work: dist.Work, loop: asyncio.AbstractEventLoop | None = None, *, on_device: bool = False
) -> asyncio.Future[None]:
    """An asyncio future of ``loop`` (default: the running loop) completed when ``work`` is.

    Its result is None, or the torch error the work failed with; ``on_device`` as for
    :func:`when_done`. For use on a real group::

        w = dist.all_reduce(t, async_op=True)
        await aiocoll._pg.bridge_work(w)          # the loop runs other tasks meanwhile
    """
    loop = loop or asyncio.get_running_loop()
    fut: asyncio.Future[None] = loop.create_future()

    def done(exc: BaseException | None) -> None:
        if not fut.done():
            if exc is None:
                fut.set_result(None)
            else:
                fut.set_exception(exc)

    when_done(work, loop, done, on_device=on_device)
    return fut


def bridge_future(
    tfut: torch.futures.Future[Any], loop: asyncio.AbstractEventLoop | None = None
) -> asyncio.Future[Any]:
    """An asyncio future of ``loop`` holding ``tfut``'s value (or error) once it has one.

    ``tfut``'s callback may run on any thread; the result reaches the loop through
    ``call_soon_threadsafe``::

        value = await aiocoll._pg.bridge_future(work.get_future())
    """
    loop = loop or asyncio.get_running_loop()
    fut: asyncio.Future[Any] = loop.create_future()

    box: list[asyncio.Future[Any]] = [fut]  # emptied on the loop (see _call_on)

    def settle(f: torch.futures.Future[Any]) -> None:
        out = box.pop()
        if out.done():
            return
        try:
            out.set_result(f.value())
        except BaseException as e:
            out.set_exception(e)

    def done(f: torch.futures.Future[Any]) -> None:
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is left to tell
            loop.call_soon_threadsafe(settle, f)

    tfut.add_done_callback(done)
    return fut


# -- byte exchange (objects) ------------------------------------------------------------------


def _bytes_tensor(payload: bytes, size: int, device: torch.device) -> torch.Tensor:
    t = torch.zeros(size, dtype=torch.uint8)
    if payload:
        t[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    return t.to(device)


def _tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.cpu().contiguous()
    return ctypes.string_at(t.data_ptr(), t.numel()) if t.numel() else b""


def _sizes(n: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(list(n), dtype=torch.int64).to(device)


def _device_of(pg: dist.ProcessGroup) -> torch.device:
    """Where byte tensors go for ``pg``: the CPU if it has a CPU backend (gloo), else its accelerator."""
    try:
        _torch.backend_of(pg, torch.device("cpu"))
    except RuntimeError:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


async def _wait(work: dist.Work, dev: torch.device) -> None:
    await bridge_work(work, on_device=dev.type != "cpu")


def _allgather_opts(timeout: timedelta | None) -> Any:
    o = _torch.options.AllgatherOptions()
    if timeout is not None:
        o.timeout = timeout
    return o


def _bcast_opts(root: int, timeout: timedelta | None) -> Any:
    o = _torch.options.BroadcastOptions()
    o.rootRank = root
    if timeout is not None:
        o.timeout = timeout
    return o


async def all_gather_bytes(pg: dist.ProcessGroup, payload: bytes, *, timeout: timedelta | None = None) -> list[bytes]:
    """Every rank's ``payload``, in rank order; two ``async_op`` all_gathers (sizes, then bytes).

    Ops reach ``pg`` in the order they are issued, so call it where no other op of ``pg``
    can be issued meanwhile (``Issuer`` does that)::

        payloads = await all_gather_bytes(pg, pickle.dumps(obj))
    """
    w, dev = pg.size(), _device_of(pg)
    sizes = torch.empty(w, dtype=torch.int64, device=dev)
    await _wait(_torch.allgather_into(pg, sizes, _sizes([len(payload)], dev), _allgather_opts(timeout)), dev)
    ns = sizes.tolist()
    most = max(ns)
    out = torch.empty(w * most, dtype=torch.uint8, device=dev)
    await _wait(_torch.allgather_into(pg, out, _bytes_tensor(payload, most, dev), _allgather_opts(timeout)), dev)
    out = out.cpu()
    return [_tensor_bytes(out[i * most : i * most + n]) for i, n in enumerate(ns)]


async def broadcast_bytes(
    pg: dist.ProcessGroup, payload: bytes | None, src: int, *, timeout: timedelta | None = None
) -> bytes:
    """Rank ``src``'s ``payload`` (group rank) on every rank; ``payload`` is ignored elsewhere::

    data = await broadcast_bytes(pg, blob if pg.rank() == 0 else None, src=0)
    """
    dev = _device_of(pg)
    mine = pg.rank() == src
    size = _sizes([len(payload) if mine and payload is not None else 0], dev)
    await _wait(pg.broadcast([size], _bcast_opts(src, timeout)), dev)
    n = int(size.item())
    buf = _bytes_tensor(payload or b"", n, dev) if mine else torch.empty(n, dtype=torch.uint8, device=dev)
    await _wait(pg.broadcast([buf], _bcast_opts(src, timeout)), dev)
    return payload if mine and payload is not None else _tensor_bytes(buf)


async def gather_bytes(
    pg: dist.ProcessGroup, payload: bytes, dst: int, *, timeout: timedelta | None = None
) -> list[bytes] | None:
    """Every rank's ``payload`` as a list on rank ``dst`` (group rank); None elsewhere::

    payloads = await gather_bytes(pg, pickle.dumps(obj), dst=0)
    """
    w, dev = pg.size(), _device_of(pg)
    sizes = torch.empty(w, dtype=torch.int64, device=dev)
    await _wait(_torch.allgather_into(pg, sizes, _sizes([len(payload)], dev), _allgather_opts(timeout)), dev)
    ns = sizes.tolist()
    most = max(ns)
    outs = [torch.empty(most, dtype=torch.uint8, device=dev) for _ in range(w)] if pg.rank() == dst else []
    o = _torch.options.GatherOptions()
    o.rootRank = dst
    if timeout is not None:
        o.timeout = timeout
    await _wait(pg.gather([outs] if outs else [], [_bytes_tensor(payload, most, dev)], o), dev)
    if not outs:
        return None
    return [_tensor_bytes(t[:n]) for t, n in zip(outs, ns, strict=True)]


async def scatter_bytes(
    pg: dist.ProcessGroup, payloads: Sequence[bytes] | None, src: int, *, timeout: timedelta | None = None
) -> bytes:
    """``payloads[i]`` of rank ``src`` (group rank) to rank i; ``payloads`` is ignored elsewhere::

    mine = await scatter_bytes(pg, blobs if pg.rank() == 0 else None, src=0)
    """
    w, dev = pg.size(), _device_of(pg)
    mine = pg.rank() == src and payloads is not None
    sizes = _sizes([len(p) for p in payloads] if mine and payloads is not None else [0] * w, dev)
    await _wait(pg.broadcast([sizes], _bcast_opts(src, timeout)), dev)
    ns = sizes.tolist()
    most = max(ns)
    out = torch.empty(most, dtype=torch.uint8, device=dev)
    ins = [[_bytes_tensor(p, most, dev) for p in payloads]] if mine and payloads is not None else []
    o = _torch.options.ScatterOptions()
    o.rootRank = src
    if timeout is not None:
        o.timeout = timeout
    await _wait(pg.scatter([out], ins, o), dev)
    return _tensor_bytes(out[: ns[pg.rank()]])


# -- issuing aiocoll op calls on a process group -------------------------------------------


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as a 1-D uint8 view: any dtype moves exactly."""
    return t.reshape(-1).view(torch.uint8)


def _contiguous(t: torch.Tensor, copy: bool = False) -> torch.Tensor:
    """``t`` itself if it is contiguous (and no copy is asked for), else a contiguous copy.

    gloo reads and writes the contiguous memory at a tensor's data pointer, whatever its
    strides: a strided view must travel as a copy, written back afterwards.
    """
    if copy or not t.is_contiguous():
        return t.contiguous().clone() if t.is_contiguous() else t.contiguous()
    return t


def _shares(a: torch.Tensor, others: Sequence[torch.Tensor]) -> bool:
    p = a.untyped_storage().data_ptr()
    return any(o.untyped_storage().data_ptr() == p for o in others)


@dataclass(slots=True)
class _Reduce:
    """How a reduction travels: the tensor to reduce, the op to use, and how to write back."""

    buf: torch.Tensor
    op: Any  # RedOpType
    back: Callable[[torch.Tensor], None] | None  # writes a reduced buffer into the user's tensor


class _Post:
    """Writes back staged outputs once the op is done; returns the op's result."""

    __slots__ = ("copies", "result")

    def __init__(self) -> None:
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.result: Any = None

    @torch.no_grad()
    def __call__(self) -> Any:
        for dst, src in self.copies:
            dst.copy_(src)
        return self.result


_Start = Callable[[], tuple[dist.Work, Callable[[], Any]]]
_Steps = Callable[[], Coroutine[Any, Any, Any]]
_Queued = tuple["_Start | _Steps", bool, Any, asyncio.Future[Any], asyncio.AbstractEventLoop]


class Issuer:
    """Issues aiocoll op calls on one process group, in call order; one per group.

    ``issue(call)`` returns an ``asyncio.Future`` of what ``await`` returns in-process
    (None for tensor ops, the objects for object ops, the sender's rank for ``recv``,
    a ``Partition`` for ``NewGroup``/``Split``). Arguments the group cannot serve exactly
    raise ``InvalidArgumentError`` from ``issue`` itself, before anything is sent::

        issuer = Issuer.of(dist.group.WORLD)
        await issuer.issue(_ops.AllReduce(t, _ops.Reduction.of("sum")))
    """

    # weak: a group's issuer lives as long as some Comm uses it, and never keeps the group alive
    _by_pg: ClassVar[weakref.WeakValueDictionary[int, Issuer]] = weakref.WeakValueDictionary()

    def __init__(self, pg: dist.ProcessGroup, timeout: float | None = None) -> None:
        self.pg = pg
        self.rank = pg.rank()
        self.size = pg.size()
        self.name = str(pg.group_name)
        self.backend = str(dist.get_backend(pg))
        self.global_ranks = tuple(dist.get_process_group_ranks(pg))
        self.timeout: timedelta | None = None
        self.pending: dict[asyncio.Future[Any], ops.Call] = {}  # ops not complete yet, and their calls
        self.completed = 0
        self.groups_made = 0  # new_group/split calls issued so far: names the groups they make
        self._busy = False  # a multi-step op holds the group's order until it ends
        self._queue: list[tuple[_Start | _Steps, bool, Any, asyncio.Future[Any], asyncio.AbstractEventLoop]] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        self._dev: torch.device | None = None
        self._opts: dict[tuple[type, Any], Any] = {}
        # cross-process checks (see _xcheck): collectives wait for their check, in call order
        self.checker: Checker | None = None
        self._gated: deque[tuple[asyncio.Future[None] | None, _Queued]] = deque()
        self.aborted: BaseException | None = None  # why this group's ops now fail at once
        self.set_timeout(timeout)
        # the flight recorder: this process's ring, shared by its groups (see aiocoll._frdump)
        self._rec = _frdump.process_recorder()
        self._rec.groups[self.name] = (str(getattr(pg, "group_desc", "undefined")), self.global_ranks, self.rank)
        self._index = {self.global_ranks[self.rank]: 0}  # every stamp's one column
        self._seq = 0  # collectives issued: their sequence number, as in-process
        self._stamps: dict[asyncio.Future[Any], Stamp] = {}

    def recent(self, n: int) -> list[Stamp]:
        """The flight-recorder stamps of this group's last ``n`` collectives, oldest first (for the checks' reports)."""
        mine = [st for st in self._rec.ring if st.group == self.name and st.seq is not None]
        return mine[-n:]

    def set_timeout(self, seconds: float | None) -> None:
        """Bound every op of the group to ``seconds`` (None: the group's own timeout)."""
        self.timeout = None if seconds is None else timedelta(seconds=seconds)
        self._opts.clear()

    def set_check(self, check: bool) -> None:
        """Gate this group's collectives on cross-process checks (every member must say the same)."""
        if check and self.checker is None:
            self.checker = Checker(self, when_done)
        elif not check:
            self.checker = None

    @classmethod
    def of(cls, pg: dist.ProcessGroup, timeout: float | None = None, check: bool | None = None) -> Issuer:
        """The issuer of ``pg`` (made at first use): every Comm on one group shares it, and so its order.

        ``check``: turn cross-process checks on or off (None: leave them as they are).
        """
        key = id(pg)
        iss = cls._by_pg.get(key)
        if iss is None or iss.pg is not pg:
            iss = cls(pg, timeout)
            cls._by_pg[key] = iss
        elif timeout is not None:
            iss.set_timeout(timeout)
        if check is not None:
            iss.set_check(check)
        return iss

    @property
    def device(self) -> torch.device:
        if self._dev is None:
            self._dev = _device_of(self.pg)
        return self._dev

    # -- the order in which ops reach the group ---------------------------------------------

    def issue(
        self, call: Any, loop: asyncio.AbstractEventLoop | None = None, site: Site | None = None
    ) -> asyncio.Future[Any]:
        """Issue ``call`` now (or after the multi-step op in flight); see the class docstring.

        With checks on, a collective is issued once its check passed (``site``: where it was
        called, for the reports).
        """
        if loop is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                raise AiocollError(
                    f"{call.name} on a process-group Comm needs a running event loop: call it from async code"
                ) from None
        if self.aborted is not None:
            fut0: asyncio.Future[Any] = loop.create_future()
            fut0.set_exception(self._aborted_error(call))
            fut0.exception()  # retrieved: an unawaited op is not logged
            return fut0
        plan, steps = self._plan(call)  # raises InvalidArgumentError before anything is sent
        if steps and isinstance(call, (ops.NewGroup, ops.Split)):
            self.groups_made += 1  # names the groups made here, in issue order (see ProcessGroupComm)
        fut: asyncio.Future[Any] = loop.create_future()
        self.pending[fut] = call
        if isinstance(call, _P2P):
            stamp = self._stamps[fut] = self._rec.start(self.name, self._index, None, call.describe(), site)
        else:
            stamp = self._stamps[fut] = self._rec.start(self.name, self._index, self._seq, call.signature(), site)
            self._seq += 1
        chk = self.checker
        if chk is not None and not isinstance(call, _P2P):
            gate = chk.gate(call, stamp, loop)
            self._gated.append((gate, (plan, steps, call, fut, loop)))
            gate.add_done_callback(self._release)
        elif self._gated and self.device.type != "cpu":
            # NCCL runs a group's ops in stream order: p2p stays behind the collectives
            # waiting for their checks. gloo matches p2p by tag alone, so there it goes at
            # once: holding a recv behind a check that waits for the sender's next
            # collective would deadlock a program that works unchecked.
            self._gated.append((None, (plan, steps, call, fut, loop)))
        else:
            self._submit(plan, steps, call, fut, loop)
        return fut

    def _submit(
        self, plan: _Start | _Steps, steps: bool, call: Any, fut: asyncio.Future[Any], loop: asyncio.AbstractEventLoop
    ) -> None:
        if self._busy:
            self._queue.append((plan, steps, call, fut, loop))
        else:
            self._launch(plan, steps, call, fut, loop)

    def _release(self, _: object = None) -> None:
        """Issue the checked ops at the head of the line, in call order; fail those whose check failed."""
        while self._gated:
            gate, queued = self._gated[0]
            if gate is not None and not gate.done():
                return
            self._gated.popleft()
            exc = gate.exception() if gate is not None else None
            if exc is not None:
                self._finish(queued[3], queued[2], None, exc)
            elif self.aborted is not None:
                self._finish(queued[3], queued[2], None, self._aborted_error(queued[2]))
            else:
                self._submit(*queued)

    def abort(self, reason: BaseException) -> None:
        """Fail the ops waiting for their checks, and every later op, at once (a mismatch or a rank gone)."""
        if self.aborted is None:
            self.aborted = reason
        self._release()

    def _aborted_error(self, call: Any) -> WorldAbortedError:
        reason = self.aborted
        first = (str(reason).splitlines() or [type(reason).__name__])[0]
        err = WorldAbortedError(
            f"{call.describe()} on rank {self.rank} of group {self.name!r}: this group's Comm was aborted "
            f"by an earlier {type(reason).__name__}: {first}",
            rank=getattr(reason, "rank", None),
        )
        err.__cause__ = reason
        return err

    def _launch(
        self, plan: _Start | _Steps, steps: bool, call: Any, fut: asyncio.Future[Any], loop: asyncio.AbstractEventLoop
    ) -> None:
        if steps:
            self._busy = True
            task = loop.create_task(self._run_steps(plan, call, fut))  # type: ignore[arg-type]
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return
        try:
            work, post = plan()  # type: ignore[misc]
        except RuntimeError as e:  # a group already broken (a peer died) refuses at once
            self._finish(fut, call, None, e)
            return

        def done(exc: BaseException | None) -> None:
            self._finish(fut, call, post, exc)

        # a barrier's wait() would synchronise the current stream: it has nothing to order
        when_done(work, loop, done, on_device=self.device.type != "cpu", wait=not isinstance(call, ops.Barrier))

    async def _run_steps(self, steps: _Steps, call: Any, fut: asyncio.Future[Any]) -> None:
        try:
            result = await steps()
        except BaseException as e:
            self._finish(fut, call, None, e)
        else:
            self._finish(fut, call, lambda: result, None)
        finally:
            self._busy = False
            while self._queue and not self._busy:
                self._launch(*self._queue.pop(0))

    def _finish(
        self, fut: asyncio.Future[Any], call: Any, post: Callable[[], Any] | None, exc: BaseException | None
    ) -> None:
        result = None
        if exc is None and post is not None:
            try:
                result = post()  # write-backs happen even if the awaiting task was cancelled
            except BaseException as e:
                exc = e
        self.pending.pop(fut, None)
        self.completed += 1
        stamp = self._stamps.pop(fut, None)
        err = None if exc is None else self.error(call.describe(), exc)
        if stamp is not None:
            stamp.done = time.perf_counter()
            stamp.outcome = "ok" if err is None else type(err).__name__
        if fut.done():
            return
        if err is None:
            fut.set_result(result)
            return
        chk = self.checker
        if (
            chk is not None
            and stamp is not None
            and exc is not None
            and isinstance(err, WorldAbortedError)
            and err is not exc
        ):
            # the transport failed under the op: name the ranks gone before telling
            task = fut.get_loop().create_task(self._name_gone(chk, fut, call, stamp, exc, err))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return
        self._fail(fut, err)

    def _fail(self, fut: asyncio.Future[Any], err: BaseException) -> None:
        """Fail the op of ``fut`` with ``err``, dumping the flight recorder if asked (see _frdump)."""
        if fut.done():
            return
        if isinstance(err, AiocollError):  # the group failed (not a cancellation)
            dumped = _frdump.on_failure(lambda prefix: _frdump.dump_process(prefix, self.backend))
            if dumped is not None:
                err.add_note(dumped)
        fut.set_exception(err)
        fut.exception()  # retrieved: an unawaited failed op is not logged at exit

    async def _name_gone(
        self, chk: Checker, fut: asyncio.Future[Any], call: Any, stamp: Stamp, exc: BaseException, err: BaseException
    ) -> None:
        named = await chk.gone_error(call.describe(), stamp, exc)
        if named is not None:
            err = named
            self.abort(named)
        self._fail(fut, err)

    def error(self, what: str, exc: BaseException) -> BaseException:
        """An aiocoll error for a torch error of the group (chained), or ``exc`` if it is one already."""
        if not isinstance(exc, RuntimeError) or isinstance(exc, AiocollError):
            return exc  # aiocoll's own, or not the group's (a bug, a cancellation): as is
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        where = f"{what} on rank {self.rank} of group {self.name!r} ({self.backend})"
        err: AiocollError
        low = first.lower()
        if "timed out" in low or "timeout" in low:
            err = CollectiveTimeoutError(f"{where} timed out: {first}")
        else:
            err = WorldAbortedError(f"{where} failed: {first}")
        err.__cause__ = exc
        return err

    # -- the plans: what each call becomes on the group ---------------------------------------

    def _opt(self, cls: type, **fields: Any) -> Any:
        key = (cls, tuple(sorted(fields.items())))
        o = self._opts.get(key)
        if o is None:
            o = cls()
            for k, v in fields.items():
                setattr(o, k, dist.ReduceOp(v) if k == "reduceOp" else v)
            if self.timeout is not None:
                o.timeout = self.timeout
            self._opts[key] = o
        return o

    def _plan(self, call: Any) -> tuple[_Start | _Steps, bool]:
        kind = type(call)
        steps = _STEPS.get(kind)
        if steps is None:
            return _PLANS[kind](self, call), False
        if kind is ops.Split:
            # every rank's call travels pickled (see _partition): refuse now what cannot
            try:
                ops.dumps((call.color, call.key), "color and key")
            except InvalidArgumentError as e:
                raise InvalidArgumentError(f"split on rank {self.rank}: {e}") from e
        return (lambda: steps(self, call)), True

    def _reduction(self, name: str, t: torch.Tensor, red: ops.Reduction, copy: bool) -> _Reduce:
        """How to reduce ``t`` with ``red`` on the group, exactly as in-process (or refuse)."""
        kind, dtype = red.kind, t.dtype
        if dtype.is_complex and kind not in (_R.SUM, _R.AVG, _R.PREMUL_SUM):
            raise InvalidArgumentError(
                f"{name} on rank {self.rank}: a process group cannot reduce complex tensors with {red.name} "
                "(torch.distributed reduces them as pairs of reals, which only SUM and AVG allow)"
            )
        if kind == _R.PREMUL_SUM:  # no backend but NCCL has it: scale here, then sum
            assert red.factor is not None
            f = red.factor.item() if isinstance(red.factor, torch.Tensor) else red.factor
            buf = t * torch.tensor(f, dtype=dtype, device=t.device)
            return _Reduce(_real(buf), _R.SUM, _copy_into(t))
        if dtype == torch.bool:  # as 0/1 bytes: or is MAX, and is MIN, BXOR is parity
            op = {_R.SUM: _R.MAX, _R.PRODUCT: _R.MIN}.get(kind, kind)
            buf = _contiguous(t, copy)
            return _Reduce(buf.view(torch.uint8), op, None if buf is t else _copy_into(t))
        if dtype == torch.int16:  # gloo and NCCL have no int16: reduce in int32, wrap back
            return _Reduce(t.to(torch.int32), kind, _copy_into(t))
        buf = _contiguous(t, copy)
        return _Reduce(_real(buf), kind, None if buf is t else _copy_into(t))


def _real(t: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(t) if t.is_complex() else t


def _copy_into(t: torch.Tensor) -> Callable[[torch.Tensor], None]:
    def back(buf: torch.Tensor) -> None:
        with torch.no_grad():
            t.copy_(torch.view_as_complex(buf) if t.is_complex() and not buf.is_complex() else buf)

    return back


def _reduced(red: _Reduce) -> Callable[[], None]:
    def post() -> None:
        if red.back is not None:
            red.back(red.buf)

    return post


def _plan_all_reduce(iss: Issuer, call: ops.AllReduce) -> _Start:
    red = iss._reduction("all_reduce", call.tensor, call.op, copy=False)
    opts = iss._opt(_torch.options.AllreduceOptions, reduceOp=red.op)
    return lambda: (iss.pg.allreduce([red.buf], opts), _reduced(red))


def _plan_reduce(iss: Issuer, call: ops.Reduce) -> _Start:
    # off the destination, gloo uses the tensor as scratch space; in-process leaves it alone
    red = iss._reduction("reduce", call.tensor, call.op, copy=iss.rank != call.dst)
    opts = iss._opt(_torch.options.ReduceOptions, reduceOp=red.op, rootRank=call.dst)
    post = _reduced(red) if iss.rank == call.dst else _Post()
    return lambda: (iss.pg.reduce([red.buf], opts), post)


def _plan_broadcast(iss: Issuer, call: ops.Broadcast) -> _Start:
    buf, post = _staged(call.tensor, iss.rank != call.src)
    opts = iss._opt(_torch.options.BroadcastOptions, rootRank=call.src)
    return lambda: (iss.pg.broadcast([_bytes(buf)], opts), post)


def _staged(t: torch.Tensor, write: bool) -> tuple[torch.Tensor, _Post]:
    """A contiguous buffer for ``t`` and the write-back of it, if ``t`` is written and is not it."""
    post = _Post()
    buf = _contiguous(t)
    if write and buf is not t:
        post.copies.append((t, buf))
    return buf, post


def _plan_all_gather(iss: Issuer, call: ops.AllGather) -> _Start:
    # Ranks may contribute different shapes, which gloo's all_gather refuses; each rank's
    # list already says every size, so all travel as bytes padded to the largest.
    sizes = [o.nbytes for o in call.outputs]
    most = max(sizes)
    x = _contiguous(call.input)
    send = _bytes(x)
    if send.numel() != most or _shares(x, call.outputs):
        padded = torch.zeros(most, dtype=torch.uint8, device=x.device)
        padded[: send.numel()] = send
        send = padded
    recv = torch.empty(iss.size * most, dtype=torch.uint8, device=x.device)

    @torch.no_grad()
    def post() -> None:
        for i, (o, n) in enumerate(zip(call.outputs, sizes, strict=True)):
            o.copy_(recv[i * most : i * most + n].view(o.dtype).view(o.shape))

    opts = iss._opt(_torch.options.AllgatherOptions)
    return lambda: (_torch.allgather_into(iss.pg, recv, send, opts), post)


def _plan_all_gather_into_tensor(iss: Issuer, call: ops.AllGatherIntoTensor) -> _Start:
    x = _contiguous(call.input, copy=_shares(call.input, [call.output]))
    out, post = _staged(call.output, True)
    opts = iss._opt(_torch.options.AllgatherOptions)
    return lambda: (_torch.allgather_into(iss.pg, _bytes(out), _bytes(x), opts), post)


def _plan_gather(iss: Issuer, call: ops.Gather) -> _Start:
    outs = call.outputs or []
    x = _contiguous(call.input, copy=_shares(call.input, outs))
    post = _Post()
    bufs = []
    for o in outs:
        b = _contiguous(o)
        if b is not o:
            post.copies.append((o, b))
        bufs.append(_bytes(b))
    opts = iss._opt(_torch.options.GatherOptions, rootRank=call.dst)
    return lambda: (iss.pg.gather([bufs] if bufs else [], [_bytes(x)], opts), post)


def _plan_scatter(iss: Issuer, call: ops.Scatter) -> _Start:
    ins = call.inputs or []
    bufs = [_bytes(_contiguous(x, copy=_shares(x, [call.output]))) for x in ins]
    out, post = _staged(call.output, True)
    opts = iss._opt(_torch.options.ScatterOptions, rootRank=call.src)
    return lambda: (iss.pg.scatter([_bytes(out)], [bufs] if bufs else [], opts), post)


def _plan_reduce_scatter(iss: Issuer, call: ops.ReduceScatter) -> _Start:
    # one input tensor of (world, n) rows: the list form becomes the tensor form
    x = torch.stack([t.reshape(-1) for t in call.inputs]).reshape(-1)
    return _reduce_scatter(iss, "reduce_scatter", call.output, x, call.op)


def _plan_reduce_scatter_tensor(iss: Issuer, call: ops.ReduceScatterTensor) -> _Start:
    x = _contiguous(call.input, copy=_shares(call.input, [call.output])).reshape(-1)
    return _reduce_scatter(iss, "reduce_scatter_tensor", call.output, x, call.op)


def _reduce_scatter(iss: Issuer, name: str, output: torch.Tensor, x: torch.Tensor, red: ops.Reduction) -> _Start:
    rin = iss._reduction(name, x, red, copy=False)
    rout = iss._reduction(name, output, red, copy=False)
    out = rout.buf.reshape(-1) if rout.buf.is_contiguous() else rout.buf.contiguous().reshape(-1)
    opts = iss._opt(_torch.options.ReduceScatterOptions, reduceOp=rin.op)

    def post() -> None:
        if rout.back is not None:
            rout.back(out.view(rout.buf.shape))

    return lambda: (_torch.reduce_scatter_into(iss.pg, out, rin.buf.reshape(-1), opts), post)


def _plan_all_to_all(iss: Issuer, call: ops.AllToAll) -> _Start:
    # as bytes with split sizes: gloo's list form wants every tensor alike
    ins = [_bytes(_contiguous(x)) for x in call.inputs]
    send = torch.cat(ins) if ins else torch.empty(0, dtype=torch.uint8)
    out_sizes = [o.nbytes for o in call.outputs]
    recv = torch.empty(sum(out_sizes), dtype=torch.uint8, device=send.device)

    @torch.no_grad()
    def post() -> None:
        off = 0
        for o, n in zip(call.outputs, out_sizes, strict=True):
            o.copy_(recv[off : off + n].view(o.dtype).view(o.shape))
            off += n

    opts = iss._opt(_torch.options.AllToAllOptions)
    in_sizes = [t.numel() for t in ins]
    return lambda: (iss.pg.alltoall_base(recv, send, out_sizes, in_sizes, opts), post)


def _plan_all_to_all_single(iss: Issuer, call: ops.AllToAllSingle) -> _Start:
    x = _contiguous(call.input, copy=_shares(call.input, [call.output]))
    out, post = _staged(call.output, True)
    row = x[0].nbytes if x.shape[0] else (out[0].nbytes if out.shape[0] else 0)
    opts = iss._opt(_torch.options.AllToAllOptions)
    outs = [n * row for n in call.output_splits]
    ins = [n * row for n in call.input_splits]
    return lambda: (iss.pg.alltoall_base(_bytes(out), _bytes(x), outs, ins, opts), post)


def _plan_barrier(iss: Issuer, call: ops.Barrier) -> _Start:
    opts = iss._opt(_torch.options.BarrierOptions)
    return lambda: (iss.pg.barrier(opts), _Post())


def _plan_send(iss: Issuer, call: ops.Send) -> _Start:
    x = _contiguous(call.tensor)
    return lambda: (iss.pg.send([_bytes(x)], call.dst, call.tag), _Post())


def _plan_recv(iss: Issuer, call: ops.Recv) -> _Start:
    buf, post = _staged(call.tensor, True)

    def start() -> tuple[dist.Work, Callable[[], Any]]:
        if call.src is None:
            work = iss.pg.recv_anysource([_bytes(buf)], call.tag)

            def source() -> int:
                post()
                return int(work._source_rank())

            return work, source
        post.result = call.src
        return iss.pg.recv([_bytes(buf)], call.src, call.tag), post

    return start


_PLANS: dict[type, Callable[[Issuer, Any], _Start]] = {
    ops.AllReduce: _plan_all_reduce,
    ops.Reduce: _plan_reduce,
    ops.Broadcast: _plan_broadcast,
    ops.AllGather: _plan_all_gather,
    ops.AllGatherIntoTensor: _plan_all_gather_into_tensor,
    ops.Gather: _plan_gather,
    ops.Scatter: _plan_scatter,
    ops.ReduceScatter: _plan_reduce_scatter,
    ops.ReduceScatterTensor: _plan_reduce_scatter_tensor,
    ops.AllToAll: _plan_all_to_all,
    ops.AllToAllSingle: _plan_all_to_all_single,
    ops.Barrier: _plan_barrier,
    ops.Send: _plan_send,
    ops.Recv: _plan_recv,
}


# multi-step ops: coroutines that issue several ops of the group, holding its order


async def _broadcast_object(iss: Issuer, call: ops.BroadcastObject) -> Any:
    return pickle.loads(await broadcast_bytes(iss.pg, call.payload, call.src, timeout=iss.timeout))


async def _all_gather_object(iss: Issuer, call: ops.AllGatherObject) -> Any:
    return [pickle.loads(p) for p in await all_gather_bytes(iss.pg, call.payload, timeout=iss.timeout)]


async def _gather_object(iss: Issuer, call: ops.GatherObject) -> Any:
    got = await gather_bytes(iss.pg, call.payload, call.dst, timeout=iss.timeout)
    return None if got is None else [pickle.loads(p) for p in got]


async def _scatter_object(iss: Issuer, call: ops.ScatterObject) -> Any:
    return pickle.loads(await scatter_bytes(iss.pg, call.payloads, call.src, timeout=iss.timeout))


async def _partition(iss: Issuer, call: ops.NewGroup | ops.Split) -> ops.Partition:
    """Every rank's call, checked as the in-process engine checks them, then the partition."""
    calls = [pickle.loads(p) for p in await all_gather_bytes(iss.pg, pickle.dumps(call), timeout=iss.timeout)]
    problem = None
    if any(c.signature() != calls[0].signature() for c in calls):
        problem = f"ranks called {call.name} with arguments that disagree"
    else:
        problem = type(call).check(calls)
    if problem is not None:
        table = "\n".join(f"  rank {r}: {c.describe()}" for r, c in enumerate(calls))
        raise CollectiveMismatchError(f"{problem} on group {iss.name!r}:\n{table}")
    part: ops.Partition = type(call).run(calls)[iss.rank]
    return part


_STEPS: dict[type, Callable[[Issuer, Any], Coroutine[Any, Any, Any]]] = {
    ops.BroadcastObject: _broadcast_object,
    ops.AllGatherObject: _all_gather_object,
    ops.GatherObject: _gather_object,
    ops.ScatterObject: _scatter_object,
    ops.NewGroup: _partition,
    ops.Split: _partition,
}


# -- Work and Comm ------------------------------------------------------------------------------


class PGWork(Work):
    """A ``Work`` of a process-group ``Comm``: await it, or ask ``done()``, ``result()``...

    Behaves as in-process works do; ``wait()`` blocks a thread other than the loop's::

        w = comm.all_reduce(t)         # issued on the group now
        await w                        # t holds the sum
    """

    __slots__ = ("_grank", "_group_name")

    def __init__(self, fut: asyncio.Future[Any], call: Any, rank: int, group: str, site: Site | None) -> None:
        super().__init__(fut, call, site)
        self._grank = rank
        self._group_name = group

    @property
    def _where(self) -> str:
        return f"on group {self._group_name!r}"

    @property
    def _owner(self) -> int:
        return self._grank

    def wait(self, timeout: float | None = None) -> Any:
        """Block the calling thread (not the loop's) until done; return the result or raise."""
        fut = self._fut
        loop = fut.get_loop()
        if not fut.done():
            try:
                on_loop = asyncio.get_running_loop() is loop
            except RuntimeError:
                on_loop = False
            if on_loop:
                raise BlockingCallError(f"blocking wait for {self._call.describe()} on the event loop thread: await it")

            async def waiter() -> Any:
                return await asyncio.shield(fut)

            try:
                return asyncio.run_coroutine_threadsafe(waiter(), loop).result(timeout)
            except TimeoutError:
                raise CollectiveTimeoutError(
                    f"rank {self._grank} waited {timeout}s in {self.describe()}; it is still pending"
                ) from None
        return fut.result()


class ProcessGroupComm(Comm):
    """A ``Comm`` whose collectives run on a real torch.distributed process group.

    Made by ``aiocoll.from_process_group``; same methods, arguments, checks and results
    as a ``Comm`` of ``aiocoll.spawn``::

        comm = aiocoll.from_process_group()      # the default group
        await comm.all_reduce(t)
    """

    __slots__ = ("_iss",)

    def __init__(self, pg: dist.ProcessGroup, *, timeout: float | None = None, check: bool | None = None) -> None:
        iss = Issuer.of(pg, timeout, check)
        super().__init__(iss.rank, iss.size)
        self._iss = iss

    @property
    def process_group(self) -> dist.ProcessGroup:
        """The torch.distributed group this Comm runs on (to mix in ``dist.*`` calls).

        ``dist.all_reduce(t, group=comm.process_group)`` is the blocking twin of
        ``await comm.all_reduce(t)``.
        """
        return self._iss.pg

    @property
    def backend(self) -> str:
        """The group's torch.distributed backend, such as ``"gloo"`` or ``"nccl"``."""
        return self._iss.backend

    @property
    def global_rank(self) -> int:
        """This process's rank in torch.distributed's default group."""
        return self._iss.global_ranks[self.rank]

    @property
    def group_ranks(self) -> tuple[int, ...]:
        """The global ranks of this group's members, in group-rank order.

        ``comm.group_ranks[comm.rank] == comm.global_rank``.
        """
        return self._iss.global_ranks

    @property
    def group_name(self) -> str:
        """The process group's name in torch.distributed (``"0"`` for the default group)."""
        return self._iss.name

    def __repr__(self) -> str:
        return f"<Comm rank={self.rank}/{self.world_size} group={self.group_name!r} backend={self.backend}>"

    def statistics(self) -> Statistics:
        """This process's view of the group, frozen: its ops pending and completed.

        Peers live in other processes, so their state is not known: they are ``"remote"``
        in ``ranks``, and this rank is the one that is not::

            s = comm.statistics()
            me = s.ranks[comm.rank]          # state "running", completed = ops done here
            print(s.backend, s.pending_collectives, s.pending_p2p, me.completed)
        """
        iss = self._iss
        p2p = sum(isinstance(c, _P2P) for c in iss.pending.values())
        return Statistics(
            size=self.world_size,
            aborted=False,
            live_ranks=1,
            blocked_ranks=0,
            pending_collectives=len(iss.pending) - p2p,
            pending_p2p=p2p,
            ranks=tuple(
                RankStatistics(g, "running", completed=iss.completed) if r == self.rank else RankStatistics(g, "remote")
                for r, g in enumerate(iss.global_ranks)
            ),
            backend=iss.backend,
        )

    def _join(self, call: ops.Call) -> PGWork:
        site = self._site()
        return PGWork(self._iss.issue(call, site=site), call, self.rank, self._iss.name, site)

    def _group_seq(self) -> int:
        # the issuer counts the groups made on its group as it issues their calls
        return self._iss.groups_made

    async def _subgroup(self, part: ops.Partition, seq: int, call: ops.NewGroup | ops.Split) -> ProcessGroupComm | None:
        iss = self._iss
        members = part.groups[self.rank]
        if members is None:
            return None
        ranks = [iss.global_ranks[m] for m in members]
        name = f"{iss.name}/aiocoll{seq}.{ranks[0]}"
        try:
            pg = await asyncio.to_thread(_create_group, iss.pg, ranks, name)
        except RuntimeError as e:
            raise iss.error(call.describe(), e) from e
        comm = ProcessGroupComm(pg, check=iss.checker is not None)
        comm._iss.timeout, comm._iss._opts = iss.timeout, {}
        return comm


def _create_group(parent: dist.ProcessGroup, ranks: list[int], name: str) -> dist.ProcessGroup:
    """A process group of ``ranks`` (global), made by its members only (blocking: run it off the loop).

    ``dist.new_group`` wants every process of the job in the same order (or, with
    ``use_local_synchronization``, names groups by their ranks alone, so the same ranks
    twice collide); aiocoll's groups are made by the parent's ranks only, under a name
    unique to the parent and its count of groups made.
    """
    backend = dist.get_backend(parent)
    timeout = _torch.group_timeout(parent, backend)  # the parent's, where it says
    return _torch.new_group_helper(ranks, dist.get_rank(), backend, name, timeout)


def from_process_group(
    pg: dist.ProcessGroup | None = None, *, timeout: float | None = None, check: bool = True
) -> Comm:
    """A ``Comm`` on a real torch.distributed process group (default: the world group).

    Same API and results as the ranks of ``aiocoll.spawn``: every collective, p2p,
    object collectives, ``new_group``/``split``. Ops are issued with ``async_op=True``
    and awaited through futures bridged into the running loop, which keeps serving
    other tasks. A timeout (the group's own, or ``timeout`` seconds per op if given)
    raises ``CollectiveTimeoutError``, with torch's error as ``__cause__``.

    ``check=True`` (the default; every process must pass the same) brings in-process
    reports to processes. Each collective is issued once every rank's call is known to
    agree (a fingerprint all-gathered on a gloo side group): ranks that call different
    collectives, or disagree on shapes, dtypes, roots, reduce ops or split sizes, raise
    ``CollectiveMismatchError`` in every process within a round trip, naming each rank's
    call and file:line, with the flight recorder table as a note. The op is never issued
    (tensors stay untouched, no wrong result), so the group stays in step. A rank that
    exits or dies is named in the survivors' ``WorldAbortedError``, with what each was
    waiting in (a heartbeat in the job's store); the Comm is then aborted (its later ops
    raise ``WorldAbortedError`` at once). ``check=False`` saves the side round
    trip per collective (see ``benchmarks/bench_checks.py``). Launch with torchrun::

        # torchrun --nproc-per-node 2 train.py
        async def main():
            dist.init_process_group("gloo")
            comm = aiocoll.from_process_group()
            t = torch.ones(3) * comm.rank
            await comm.all_reduce(t)

        asyncio.run(main())
    """
    if pg is None:
        if not dist.is_initialized():
            raise AiocollError("from_process_group(): call torch.distributed.init_process_group() first")
        pg = _torch.default_group()
    if not isinstance(pg, dist.ProcessGroup):
        raise InvalidArgumentError(f"from_process_group(): expected a ProcessGroup, got {type(pg).__name__}")
    if pg.rank() < 0:
        raise InvalidArgumentError("from_process_group(): this process is not a member of the group")
    if not isinstance(check, bool):
        raise InvalidArgumentError(f"from_process_group(): argument 'check' must be a bool, got {check!r}")
    return ProcessGroupComm(pg, timeout=timeout, check=check)
