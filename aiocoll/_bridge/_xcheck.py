"""Cross-process checks for a ``Comm`` over a real process group: mismatches and ranks gone.

In one process the engine sees every rank's call, so it reports a mismatch or a rank that
left at once. Across processes nobody sees everything, and torch's backends do not check:
gloo completes ``all_reduce`` SUM on one rank against MAX on another with wrong numbers,
and hangs to the group's timeout on ``broadcast`` against ``all_reduce``. Two pieces
bring the in-process reports to process groups:

``Checker`` (one per checked group) gates every collective. Before the op is issued on
the group, each rank all-gathers a fingerprint of its call (three int64: a hash of the
call's ``signature()``, and two sums that cover what ``check()`` compares across ranks,
the shapes and split sizes each rank sends and expects) on a gloo *side group* of the
same ranks. Every rank issues the side op for every collective, whatever it is, so it
completes even where the main ops would hang, and each process knows within one round
trip whether the calls agree. Only then does the op reach the group: a mismatched op is
never issued, the caller's tensors stay untouched, and no wrong result can come first.
On a mismatch the ranks swap their calls (with tensors as meta tensors), call sites and
recent history through the store, and every process raises the same
``CollectiveMismatchError`` as in-process, with the flight recorder's table.

``Presence`` (one per process, see ``_presence``) keeps a heartbeat counter of this process
in the default group's store, from a daemon thread, and marks the process as left at exit. When the
transport fails (a peer's socket closed) or a check has waited ``WATCH_AFTER`` seconds,
the survivors look: ranks marked left, whose process on this host is gone or stopped,
or (on other hosts) whose counter stood still for ``Presence.STALE`` seconds, are named in
the ``WorldAbortedError``.

The gate costs one small all-gather per collective, in series with the op: see
``benchmarks/bench_checks.py``. Point-to-point ops are not gated (they carry no
signature to agree on; a gloo send waits for its recv).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import io
from collections.abc import Callable, Coroutine, Hashable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from .. import _ops as ops
from .. import _torch
from .._engine._record import Recorder, Stamp
from .._engine._world import mismatch_message
from .._errors import CollectiveMismatchError, WorldAbortedError
from .._work import Site, fmt_site
from ._presence import Presence, StoreUnreachable

if TYPE_CHECKING:
    from .._torch import Store
    from ._pgissue import Issuer  # (which imports this module at run time)


# when_done(work, loop, fn): fn(None or the error) on the loop once the work completes (_pgbridge's)
_WhenDone = Callable[[dist.Work, asyncio.AbstractEventLoop, Callable[[BaseException | None], None]], None]

__all__ = ["Checker", "fingerprint"]

_MASK = (1 << 64) - 1
FP_LEN = 3  # signature hash, sum of what each rank sends, sum of what each rank expects


# -- fingerprints -----------------------------------------------------------------------------


def _mix(x: int) -> int:
    """splitmix64's finaliser: a cheap, well-spread 64-bit hash of an int."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


_sig_hashes: dict[Hashable, int] = {}


def _sig_hash(sig: Hashable) -> int:
    """A hash of a signature that every process computes alike (``hash()`` of a str is salted per process)."""
    h = _sig_hashes.get(sig)
    if h is None:
        h = int.from_bytes(hashlib.blake2b(repr(sig).encode(), digest_size=8).digest(), "little")
        if len(_sig_hashes) < 4096:
            _sig_hashes[sig] = h
    return h


def _edge(src: int, dst: int, value: tuple[int, ...]) -> int:
    h = _mix(src * 0x100000001B3 + dst)
    for v in value:
        h = _mix(h ^ (v & _MASK))
    return _mix(h ^ len(value))


_Edges = list[tuple[int, int, tuple[int, ...]]]


def _transfers(call: ops.Call, rank: int) -> tuple[_Edges, _Edges]:
    """What ``rank`` sends to each peer and expects from each, as (src, dst, size) edges.

    These are what the ops' ``check()`` compares across ranks: the calls agree exactly
    when the two multisets, summed over all ranks, are equal.
    """
    if isinstance(call, ops.AllGather):
        n = len(call.outputs)
        shape = tuple(call.input.shape)
        return [(rank, j, shape) for j in range(n)], [(j, rank, tuple(o.shape)) for j, o in enumerate(call.outputs)]
    if isinstance(call, ops.AllToAll):
        return (
            [(rank, j, tuple(x.shape)) for j, x in enumerate(call.inputs)],
            [(j, rank, tuple(o.shape)) for j, o in enumerate(call.outputs)],
        )
    if isinstance(call, ops.AllToAllSingle):
        return (
            [(rank, j, (n,)) for j, n in enumerate(call.input_splits)],
            [(j, rank, (n,)) for j, n in enumerate(call.output_splits)],
        )
    return [], []


def fingerprint(call: ops.Call, rank: int) -> tuple[int, int, int]:
    """Three int64 that are equal on every rank's call only if the calls agree.

    The first is a hash of ``call.signature()``; the others are hashes of the edges a
    rank sends and expects. Summed over the ranks, sends and expectations must match::

        fps = [fingerprint(c, r) for r, c in enumerate(calls)]
        ok = len({f[0] for f in fps}) == 1 and sum(f[1] for f in fps) == sum(f[2] for f in fps)  # mod 2**64
    """
    sends, expects = _transfers(call, rank)
    s = sum(_edge(*e) for e in sends) & _MASK
    x = sum(_edge(*e) for e in expects) & _MASK
    return _signed(_sig_hash(call.signature()) >> 1), _signed(s), _signed(x)


def agree(rows: Sequence[Sequence[int]]) -> bool:
    """Whether every rank's fingerprint (``rows[r]``) says the calls agree."""
    sig = rows[0][0]
    return all(r[0] == sig for r in rows) and sum(r[1] for r in rows) & _MASK == sum(r[2] for r in rows) & _MASK


# -- shadows: a call without its data, to send to the other processes ------------------------


def _meta(v: object) -> object:
    if isinstance(v, torch.Tensor):
        return torch.empty(v.shape, dtype=v.dtype, device="meta")
    if isinstance(v, list) and v and isinstance(v[0], torch.Tensor):
        return [_meta(t) for t in v]
    if isinstance(v, ops.Reduction) and isinstance(v.factor, torch.Tensor):
        return ops.Reduction(v.kind, v.factor.detach().cpu())
    if isinstance(v, bytes):
        return b""  # an object collective's payload: not needed to describe or check the call
    if isinstance(v, list) and v and isinstance(v[0], bytes):
        return [b"" for _ in v]
    return v


def shadow(call: ops.Call) -> ops.Call:
    """``call`` with meta tensors in place of its tensors: same signature, describe() and check()."""
    return dataclasses.replace(call, **{f.name: _meta(getattr(call, f.name)) for f in dataclasses.fields(call)})


def _dumps(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loads(blob: bytes) -> Any:
    return torch.load(io.BytesIO(blob), weights_only=False)


# -- the checker -----------------------------------------------------------------------------


# side groups made per group name in this process: their names (processes make them alike)
_side_groups_made: dict[str, int] = {}


class Checker:
    """Gates a group's collectives on a fingerprint all-gathered on a gloo side group.

    ``gate(call, stamp, loop)`` (``stamp``: the op's record in the issuer's flight
    recorder, which the reports read) returns a future that is done (None) once every rank's call
    agrees, or fails with ``CollectiveMismatchError`` (each rank's call and file:line,
    the flight recorder table as a note) or, when a rank is gone, ``WorldAbortedError``
    naming it. The side group is made at the first gate, by the group's members.
    """

    WATCH_AFTER = 0.5  # seconds a check may wait before the heartbeats are read
    HISTORY = 8

    def __init__(self, iss: Issuer, when_done: _WhenDone) -> None:
        self.iss = iss
        self._when_done = when_done
        self.presence = Presence.of(iss.pg)
        made = _side_groups_made.get(iss.name, 0)
        _side_groups_made[iss.name] = made + 1
        self.side_name = f"{iss.name}/aiocoll-check{made}"
        self.side: dist.ProcessGroup | None = None
        self._making: asyncio.Task[None] | None = None
        self._backlog: list[tuple[ops.Call, asyncio.Future[None], Stamp]] = []
        self._opts = _torch.options.AllgatherOptions()
        self._tasks: set[asyncio.Task[None]] = set()

    # -- gating ---------------------------------------------------------------------------------

    def gate(self, call: ops.Call, stamp: Stamp, loop: asyncio.AbstractEventLoop) -> asyncio.Future[None]:
        fut: asyncio.Future[None] = loop.create_future()
        if self.side is None:
            self._backlog.append((call, fut, stamp))
            if self._making is None:
                self._making = self._spawn(loop, self._make_side(loop))
        else:
            self._send(call, fut, stamp, loop)
        return fut

    def _spawn(self, loop: asyncio.AbstractEventLoop, coro: Coroutine[object, object, None]) -> asyncio.Task[None]:
        task = loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _make_side(self, loop: asyncio.AbstractEventLoop) -> None:
        iss = self.iss
        timeout = iss.timeout or _torch.group_timeout(iss.pg, iss.backend)
        try:
            self.side = await asyncio.to_thread(
                _torch.new_group_helper, list(iss.global_ranks), dist.get_rank(), "gloo", self.side_name, timeout
            )
        except BaseException as e:
            for call, fut, _ in self._backlog:  # (the peers never came to make the side group)
                if not fut.done():
                    fut.set_exception(iss.error(call.describe(), e))
            self._backlog.clear()
            raise
        if iss.timeout is not None:
            self._opts.timeout = iss.timeout
        backlog, self._backlog = self._backlog, []
        for call, fut, stamp in backlog:
            self._send(call, fut, stamp, loop)

    def _send(self, call: ops.Call, fut: asyncio.Future[None], stamp: Stamp, loop: asyncio.AbstractEventLoop) -> None:
        assert self.side is not None
        size = self.iss.size
        mine = torch.tensor(fingerprint(call, self.iss.rank), dtype=torch.int64)
        out = torch.empty(size * FP_LEN, dtype=torch.int64)
        try:
            work = _torch.allgather_into(self.side, out, mine, self._opts)
        except RuntimeError as e:  # the side group is broken already: a peer is gone
            self._spawn(loop, self._transport_failed(call, fut, stamp, e))
            return
        watch = loop.call_later(self.WATCH_AFTER, self._start_watch, call, fut, stamp, loop)

        def done(exc: BaseException | None) -> None:
            watch.cancel()
            if fut.done():
                return
            if exc is not None:
                self._spawn(loop, self._transport_failed(call, fut, stamp, exc))
                return
            vals = out.tolist()
            rows = [vals[i * FP_LEN : (i + 1) * FP_LEN] for i in range(size)]
            if agree(rows):
                fut.set_result(None)
            else:
                self._spawn(loop, self._mismatch(call, fut, stamp))

        self._when_done(work, loop, done)

    # -- a mismatch ---------------------------------------------------------------------------

    async def _mismatch(self, call: ops.Call, fut: asyncio.Future[None], stamp: Stamp) -> None:
        """Swap every rank's call, site and history through the store; fail ``fut`` as in-process."""
        iss = self.iss
        seq = stamp.seq
        assert seq is not None  # (only collectives are checked: they are numbered)
        history = [(st.seq, st.sig, _site_of(st), st.outcome) for st in iss.recent(self.HISTORY)]
        blob = _dumps((shadow(call), _site_of(stamp), history))
        key = f"{self.presence.prefix}mismatch/{self.side_name}/{seq}/"
        try:
            blobs = await asyncio.to_thread(_swap, self.presence.store, key, iss.rank, iss.size, blob, 30.0)
        except Exception as e:
            err = CollectiveMismatchError(
                f"the ranks' calls to {call.describe()} #{seq} on group {iss.name!r} disagree "
                f"(their fingerprints differ), and their calls could not be exchanged: {e}"
            )
            self._fail(fut, err)
            return
        got = [_loads(b) for b in blobs]
        calls = [g[0] for g in got]
        sites: list[Site | None] = [g[1] for g in got]
        kind = type(calls[0])
        sig = calls[0].signature()
        table = self._table(calls, sites)
        if any(c.signature() != sig for c in calls):
            msg = mismatch_message(calls, seq, iss.name, table)
        else:
            problem = kind.check(calls)
            if problem is None:  # the fingerprints collided: the calls do agree
                if not fut.done():
                    fut.set_result(None)
                return
            msg = f"{problem} ({kind.name} #{seq} on group {iss.name!r}):\n{table}"
        err = CollectiveMismatchError(msg)
        err.add_note(self._report([g[2] for g in got], seq))
        self._fail(fut, err)

    def _table(self, calls: Sequence[ops.Call], sites: Sequence[Site | None]) -> str:
        ranks = self.iss.global_ranks
        lines = []
        for r, c in enumerate(calls):
            who = f"rank {r}" if ranks[r] == r else f"rank {r} (global {ranks[r]})"
            lines.append(f"  {who}: {c.describe()} at {fmt_site(sites[r])}")
        return "\n".join(lines)

    def _report(self, histories: Sequence[Sequence[tuple[int, Hashable, Site | None, str | None]]], bad: int) -> str:
        """The flight recorder's table of every rank's last collectives on this group."""
        size = self.iss.size
        rec = Recorder(size, self.HISTORY)
        index = {r: r for r in range(size)}
        stamps: dict[int, Stamp] = {}
        for r, hist in enumerate(histories):
            for seq, sig, site, outcome in hist:
                st = stamps.get(seq)
                if st is None:
                    st = stamps[seq] = rec.collective(self.iss.name, index, seq, sig, size)
                    st.told(outcome)
                elif sig != st.sig:
                    st.differs(r, sig)
                # one clock for all processes: the order of calls
                rec.arrived(st, r, r, site, at=float(seq))
                if seq == bad:
                    st.told("CollectiveMismatchError")
                elif outcome != "ok" and st.outcome == "ok":
                    st.told(outcome)
        return rec.report()

    # -- a rank gone --------------------------------------------------------------------------

    def _start_watch(
        self, call: ops.Call, fut: asyncio.Future[None], stamp: Stamp, loop: asyncio.AbstractEventLoop
    ) -> None:
        if not fut.done():
            self._spawn(loop, self._watch(call, fut, stamp))

    async def _watch(self, call: ops.Call, fut: asyncio.Future[None], stamp: Stamp) -> None:
        """While the check waits, look for ranks that left, died or stopped; fail it if some did."""
        loop = asyncio.get_running_loop()
        while not fut.done():
            began = loop.time()
            look = asyncio.ensure_future(self.gone_error(call.describe(), stamp, None))
            either: list[asyncio.Future[WorldAbortedError | None] | asyncio.Future[None]] = [look, fut]
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
            if not look.done():  # the check completed first (a look can last Presence.STALE)
                look.cancel()
                return
            err = look.result()
            if err is not None:
                self._fail(fut, err)
                return
            # a look ends at once when every peer is seen running: pace them
            await asyncio.sleep(max(0.0, Presence.INTERVAL - (loop.time() - began)))

    async def _transport_failed(
        self, call: ops.Call, fut: asyncio.Future[None], stamp: Stamp, exc: BaseException
    ) -> None:
        err = await self.gone_error(call.describe(), stamp, exc)
        self._fail(fut, err if err is not None else self.iss.error(call.describe(), exc))

    async def gone_error(self, what: str, stamp: Stamp, cause: BaseException | None) -> WorldAbortedError | None:
        """A ``WorldAbortedError`` naming the members that left or died, or None if none did.

        ``what``: the op this rank waits in (``stamp``: its number and call site);
        ``cause``: the transport's error, if any. For example::

            all_reduce(float32[4], op=ReduceOp.SUM) on rank 0 of group '0' (gloo) failed:
            rank 2 exited; rank 0 was waiting in it (call #7 of the group, at train.py:31)
        """
        iss = self.iss
        me = iss.global_ranks[iss.rank]
        others = [g for g in iss.global_ranks if g != me]
        try:
            gone = await self.presence.gone(others, settle=0.0 if cause is None else Presence.SETTLE)
        except StoreUnreachable as e:
            group_ranks: list[int] = []
            who = f"{e}: the process that hosts it (rank 0 under env:// or tcp://) is gone"
        else:
            if not gone:
                return None
            group_ranks = [iss.global_ranks.index(g) for g, _ in gone]
            named = zip(group_ranks, gone, strict=True)
            who = ", ".join(f"rank {r}{'' if r == g else f' (global {g})'} {how}" for r, (g, how) in named)
        err = WorldAbortedError(
            f"{what} on rank {iss.rank} of group {iss.name!r} ({iss.backend}) failed: {who}; rank {iss.rank} "
            f"was waiting in it (call #{stamp.seq} of the group, at {fmt_site(_site_of(stamp))})",
            rank=group_ranks[0] if group_ranks else None,
        )
        err.__cause__ = cause
        return err

    def _fail(self, fut: asyncio.Future[None], err: BaseException) -> None:
        if not fut.done():
            fut.set_exception(err)
            fut.exception()  # retrieved: the issuer reports it through the op
        if not isinstance(err, CollectiveMismatchError):
            # A rank is gone: nothing on this group can complete. A mismatched op, by
            # contrast, was never issued and every rank consumed its check alike, so the
            # group stays in step: ranks that catch the error may go on.
            self.iss.abort(err)


def _site_of(stamp: Stamp) -> Site | None:
    """Where this process called the op a stamp records (its only column)."""
    return (stamp.files[0], stamp.lines[0]) if stamp.files[0] else None


def _swap(store: Store, key: str, rank: int, size: int, blob: bytes, timeout: float) -> list[bytes]:
    """Every rank's ``blob`` through the store under ``key`` (blocking: run it in a thread)."""
    store.set(f"{key}{rank}", blob)  # type: ignore[arg-type]  # (torch's stub: str only; it takes bytes too)
    keys = [f"{key}{r}" for r in range(size)]
    store.wait(keys, timedelta(seconds=timeout))
    return [bytes(store.get(k)) for k in keys]
