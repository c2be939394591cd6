"""Issuing aiocoll op calls on a real process group: ``Issuer``, one per group.

``issuer.issue(call)`` issues one aiocoll op call (the dataclasses of ``_ops``:
``AllReduce``, ``Send``, ``BroadcastObject``, ...) and returns an ``asyncio.Future`` of
what ``await`` returns in-process. Ops reach the group in call order, multi-step ones
(objects) included; each op's *plan* turns the call into the ``ProcessGroup`` method
call that ``dist.*(..., async_op=True)`` would make, and what to do once it completes.
"""

from __future__ import annotations

import asyncio
import pickle
import weakref
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, ClassVar, Protocol, TypeVar, cast

import torch
import torch.distributed as dist

from .. import _ops as ops
from .. import _torch
from .._diagnostics import _frdump
from .._engine._record import Stamp
from .._errors import (
    AiocollError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    InvalidArgumentError,
    WorldAbortedError,
)
from .._work import Site
from ._pgbridge import when_done
from ._pgbytes import all_gather_bytes, broadcast_bytes, device_of, gather_bytes, scatter_bytes
from ._xcheck import Checker

__all__ = ["Issuer"]

_R = dist.ReduceOp


class _Options(Protocol):
    """What every c10d option struct has (``_torch.options``)."""

    timeout: timedelta


OptionsT = TypeVar("OptionsT", bound=_Options)
_P2P = (ops.Send, ops.Recv)


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
    op: dist.ReduceOp.RedOpType
    back: Callable[[torch.Tensor], None] | None  # writes a reduced buffer into the user's tensor


class _Post:
    """Writes back staged outputs once the op is done; returns the op's result."""

    __slots__ = ("copies", "result")

    def __init__(self) -> None:
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.result: object = None

    @torch.no_grad()
    def __call__(self) -> object:
        for dst, src in self.copies:
            dst.copy_(src)
        return self.result


_Start = Callable[[], tuple[dist.Work, Callable[[], object]]]
"""Issues one call of the group's: its work, and what to do once it completes (the op's result)."""


@dataclass(frozen=True, slots=True)
class _OneCall:
    """A plan that is one call of the group's."""

    start: _Start


@dataclass(frozen=True, slots=True)
class _Steps:
    """A plan of several calls in turn (objects, new groups), run on a task; nothing else is issued meanwhile."""

    run: Callable[[], Awaitable[object]]


_Plan = _OneCall | _Steps


@dataclass(slots=True)
class _Queued:
    """An op issued by its rank and not yet sent to the group: waiting for its check, or its turn."""

    plan: _Plan
    call: ops.Call
    fut: asyncio.Future[object]
    loop: asyncio.AbstractEventLoop


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
        self.pending: dict[asyncio.Future[object], ops.Call] = {}  # ops not complete yet, and their calls
        self.completed = 0
        self.groups_made = 0  # new_group/split calls issued so far: names the groups they make
        self._busy = False  # a multi-step op holds the group's order until it ends
        self._queue: deque[_Queued] = deque()
        self._tasks: set[asyncio.Task[None]] = set()
        self._dev: torch.device | None = None
        self._opts: dict[tuple[type, tuple[tuple[str, int | dist.ReduceOp.RedOpType], ...]], _Options] = {}
        # cross-process checks (see _xcheck): collectives wait for their check, in call order
        self.checker: Checker | None = None
        self._gated: deque[tuple[asyncio.Future[None] | None, _Queued]] = deque()
        self.aborted: BaseException | None = None  # why this group's ops now fail at once
        self.set_timeout(timeout)
        # the flight recorder: this process's ring, shared by its groups (see aiocoll._diagnostics._frdump)
        self._rec = _frdump.process_recorder()
        self._rec.groups[self.name] = (str(getattr(pg, "group_desc", "undefined")), self.global_ranks, self.rank)
        self._index = {self.global_ranks[self.rank]: 0}  # every stamp's one column
        self._seq = 0  # collectives issued: their sequence number, as in-process
        self._stamps: dict[asyncio.Future[object], Stamp] = {}

    def show_as(self, name: str, desc: str) -> None:
        """Name the group ``name`` in reports and the flight recorder (a group standing in for this one has it)."""
        info = self._rec.groups.pop(self.name)
        self.name = name
        self._rec.groups[name] = (desc, *info[1:])

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
            self._dev = device_of(self.pg)
        return self._dev

    # -- the order in which ops reach the group ---------------------------------------------

    def issue(
        self, call: ops.Call, loop: asyncio.AbstractEventLoop | None = None, site: Site | None = None
    ) -> asyncio.Future[object]:
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
            fut0: asyncio.Future[object] = loop.create_future()
            fut0.set_exception(self._aborted_error(call))
            fut0.exception()  # retrieved: an unawaited op is not logged
            return fut0
        plan = self._plan(call)  # raises InvalidArgumentError before anything is sent
        if isinstance(plan, _Steps) and isinstance(call, (ops.NewGroup, ops.Split)):
            self.groups_made += 1  # names the groups made here, in issue order (see ProcessGroupComm)
        fut: asyncio.Future[object] = loop.create_future()
        self.pending[fut] = call
        rec, me = self._rec, self.global_ranks[self.rank]
        if isinstance(call, _P2P):
            stamp = rec.p2p(self.name, me, call.record_info())
        else:
            stamp = rec.collective(self.name, self._index, self._seq, call.signature(), 1)
            self._seq += 1
        rec.arrived(stamp, 0, me, site)
        self._stamps[fut] = stamp
        chk = self.checker
        if chk is not None and not isinstance(call, _P2P):
            gate = chk.gate(call, stamp, loop)
            self._gated.append((gate, _Queued(plan, call, fut, loop)))
            gate.add_done_callback(self._release)
        elif self._gated and self.device.type != "cpu":
            # NCCL runs a group's ops in stream order: p2p stays behind the collectives
            # waiting for their checks. gloo matches p2p by tag alone, so there it goes at
            # once: holding a recv behind a check that waits for the sender's next
            # collective would deadlock a program that works unchecked.
            self._gated.append((None, _Queued(plan, call, fut, loop)))
        else:
            self._submit(_Queued(plan, call, fut, loop))
        return fut

    def _submit(self, op: _Queued) -> None:
        if self._busy:
            self._queue.append(op)
        else:
            self._launch(op)

    def _release(self, _: object = None) -> None:
        """Issue the checked ops at the head of the line, in call order; fail those whose check failed."""
        while self._gated:
            gate, queued = self._gated[0]
            if gate is not None and not gate.done() and self.aborted is None:
                return  # (aborted: its check can no longer matter, and may never end)
            self._gated.popleft()
            exc: BaseException | None = None
            if gate is not None and gate.done():
                exc = (
                    AiocollError(f"{queued.call.describe()} on rank {self.rank}: its cross-process check was cancelled")
                    if gate.cancelled()
                    else gate.exception()
                )
            if exc is not None:
                self._finish(queued.fut, queued.call, None, exc)
            elif self.aborted is not None:
                self._finish(queued.fut, queued.call, None, self._aborted_error(queued.call))
            else:
                self._submit(queued)

    def seq_of(self, fut: asyncio.Future[object]) -> int | None:
        """The number in this group of the collective ``fut`` stands for, while it is pending (None: a p2p op)."""
        stamp = self._stamps.get(fut)
        return None if stamp is None else stamp.seq

    def fail(self, fut: asyncio.Future[object], err: BaseException) -> None:
        """Fail the pending op of ``fut`` with ``err``, and abort the group (a deadlock seen from outside)."""
        stamp = self._stamps.get(fut)
        if stamp is not None:
            stamp.failed(err)
        self._fail(fut, err)
        self.abort(err)

    def abort(self, reason: BaseException) -> None:
        """Fail the ops waiting for their checks, and every later op, at once (a mismatch or a rank gone)."""
        if self.aborted is None:
            self.aborted = reason
        self._release()

    def _aborted_error(self, call: ops.Call) -> WorldAbortedError:
        reason = self.aborted
        first = (str(reason).splitlines() or [type(reason).__name__])[0]
        err = WorldAbortedError(
            f"{call.describe()} on rank {self.rank} of group {self.name!r}: this group's Comm was aborted "
            f"by an earlier {type(reason).__name__}: {first}",
            rank=getattr(reason, "rank", None),
        )
        err.__cause__ = reason
        return err

    def _launch(self, op: _Queued) -> None:
        plan, call, fut, loop = op.plan, op.call, op.fut, op.loop
        if isinstance(plan, _Steps):
            self._busy = True
            task = loop.create_task(self._run_steps(plan, call, fut))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return
        try:
            work, post = plan.start()
        except RuntimeError as e:  # a group already broken (a peer died) refuses at once
            self._finish(fut, call, None, e)
            return

        def done(exc: BaseException | None) -> None:
            self._finish(fut, call, post, exc)

        # a barrier's wait() would synchronise the current stream: it has nothing to order
        when_done(work, loop, done, on_device=self.device.type != "cpu", wait=not isinstance(call, ops.Barrier))

    async def _run_steps(self, steps: _Steps, call: ops.Call, fut: asyncio.Future[object]) -> None:
        try:
            result = await steps.run()
        except BaseException as e:
            self._finish(fut, call, None, e)
        else:
            self._finish(fut, call, lambda: result, None)
        finally:
            self._busy = False
            while self._queue and not self._busy:
                self._launch(self._queue.popleft())

    def _finish(
        self, fut: asyncio.Future[object], call: ops.Call, post: Callable[[], object] | None, exc: BaseException | None
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
            if err is None:
                stamp.ok()
            else:
                stamp.failed(err)
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

    def _fail(self, fut: asyncio.Future[object], err: BaseException) -> None:
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
        self,
        chk: Checker,
        fut: asyncio.Future[object],
        call: ops.Call,
        stamp: Stamp,
        exc: BaseException,
        err: BaseException,
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

    def _opt(self, cls: type[OptionsT], **fields: int | dist.ReduceOp.RedOpType) -> OptionsT:
        """A ``cls()`` with ``fields`` and the group's timeout (made once; ``reduceOp``: a RedOpType)."""
        key = (cls, tuple(sorted(fields.items())))
        o = cast(OptionsT | None, self._opts.get(key))  # (made by cls, below)
        if o is None:
            o = cls()
            for k, v in fields.items():
                setattr(o, k, dist.ReduceOp(cast(dist.ReduceOp.RedOpType, v)) if k == "reduceOp" else v)
            if self.timeout is not None:
                o.timeout = self.timeout
            self._opts[key] = o
        return o

    def _plan(self, call: ops.Call) -> _Plan:
        kind = type(call)
        steps = _STEPS.get(kind)
        if steps is None:
            return _OneCall(_PLANS[kind](self, call))
        if isinstance(call, ops.Split):
            # every rank's call travels pickled (see _partition): refuse now what cannot
            try:
                ops.dumps((call.color, call.key), "color and key")
            except InvalidArgumentError as e:
                raise InvalidArgumentError(f"split on rank {self.rank}: {e}") from e
        return _Steps(lambda: steps(self, call))

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

    def start() -> tuple[dist.Work, Callable[[], object]]:
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


async def _broadcast_object(iss: Issuer, call: ops.BroadcastObject) -> object:
    return pickle.loads(await broadcast_bytes(iss.pg, call.payload, call.src, timeout=iss.timeout))


async def _all_gather_object(iss: Issuer, call: ops.AllGatherObject) -> object:
    return [pickle.loads(p) for p in await all_gather_bytes(iss.pg, call.payload, timeout=iss.timeout)]


async def _gather_object(iss: Issuer, call: ops.GatherObject) -> object:
    got = await gather_bytes(iss.pg, call.payload, call.dst, timeout=iss.timeout)
    return None if got is None else [pickle.loads(p) for p in got]


async def _scatter_object(iss: Issuer, call: ops.ScatterObject) -> object:
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


_STEPS: dict[type, Callable[[Issuer, Any], Coroutine[object, object, object]]] = {
    ops.BroadcastObject: _broadcast_object,
    ops.AllGatherObject: _all_gather_object,
    ops.GatherObject: _gather_object,
    ops.ScatterObject: _scatter_object,
    ops.NewGroup: _partition,
    ops.Split: _partition,
}
