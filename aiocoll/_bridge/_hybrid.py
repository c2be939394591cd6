"""Hybrid worlds: M processes x K async ranks each, as one world of M*K ranks.

Each process runs its K ranks on its own loop; their collectives meet there as in any
world. A group whose members all live in this process completes locally. A group that
spans processes completes in two steps: the local members meet (the engine waits for
``group.expected`` arrivals, not ``group.size``), then the group's *bridge* exchanges
every process's calls over a real process group and runs the op over all M*K calls with
the same pure op code as a flat world, so results are bitwise those of a flat world.
Exchanging whole calls costs bandwidth (each process receives every rank's inputs): this
is for tests and simulations of large worlds, not a fast data path.

The bridge talks to torch only through the process group object (an all-gather into one
tensor, ``_pgbytes.all_gather_bytes``), on a task of its own in a context with no rank in it, so
neither aiocoll's per-rank c10d state nor its task tracking sees it.

A process that exits or dies is named: every process of a hybrid world beats in the job's
store (``_presence``). When an exchange or a p2p op with other processes fails in the
transport, or has waited ``WATCH_AFTER`` seconds, the processes it waits for are looked
at off the loop; if one left, died or stopped, the world is aborted with a
``WorldAbortedError`` naming the process and its ranks, and saying what each of this
process's ranks was waiting in.
"""

from __future__ import annotations

import asyncio
import contextvars
import io
import itertools
from collections import defaultdict, deque
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from .. import _ops as ops
from .._engine._groups import Group, Rendezvous
from .._engine._rank import EngineWork
from .._engine._world import World, mismatch_message
from .._errors import CollectiveMismatchError, InvalidArgumentError, WorldAbortedError
from .._ops import _device
from .._work import Site, fmt_site
from ._pg import create_group
from ._pgbytes import all_gather_bytes
from ._pgissue import Issuer
from ._presence import Presence, StoreUnreachable

__all__ = ["HybridWorld"]

_ABORT = "aiocoll-abort"
# Hybrid worlds made in this process so far: processes make them in the same order, so
# the count names their process groups alike everywhere, and apart from earlier worlds'.
_made_worlds = itertools.count()


def _dumps(obj: object) -> bytes:
    # torch.save, not pickle: plain pickling of some dtypes' storages (uint16, uint32)
    # does not load back in torch 2.13
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _doing(status: str) -> str:
    """A rank's ``RankState.status()`` as what it was doing: "was running", "had returned"."""
    return f"was {status}" if status == "running" or status.startswith("blocked") else f"had {status}"


class _Notice(WorldAbortedError):
    """Another process of the hybrid world aborted (its notice came in an exchange)."""


class HybridWorld:
    """This process's share of a world of ``size`` ranks spread over the processes of ``pg``.

    Process ``p`` (its rank in ``pg``) runs global ranks ``p*K .. p*K+K-1``.
    """

    WATCH_AFTER = 0.5  # seconds an op with other processes may wait before their heartbeats are read

    def __init__(self, pg: dist.ProcessGroup, size: int, timeout: float | None) -> None:
        self.pg = pg
        self.procs = pg.size()
        if size % self.procs:
            raise InvalidArgumentError(
                f"spawn: argument 'world' ({size}) must be a multiple of the process group's size "
                f"({self.procs}), so that every process runs the same number of ranks"
            )
        self.per_proc = size // self.procs
        self.proc = pg.rank()
        self.local = range(self.proc * self.per_proc, (self.proc + 1) * self.per_proc)
        self.timeout = timeout
        self.id = next(_made_worlds)
        self.world: World | None = None
        self.bridge: PGBridge | None = None  # the world group's
        self.farewell: asyncio.Future[None] | None = None  # the abort notice sent to the others
        # process groups made for sub-groups that span processes, by their global ranks,
        # waiting for the engine to make the Group they serve (see attach)
        self._made: defaultdict[tuple[int, ...], deque[dist.ProcessGroup]] = defaultdict(deque)
        # a context with no rank in it, for the bridges' tasks
        self.context = contextvars.Context()
        # beating from now on, so that a peer can tell this process from a dead one
        # before any collective; the global rank of each process, for the heartbeats
        self.presence = Presence.of(pg)
        self.pg_ranks: list[int] = dist.get_process_group_ranks(pg)
        # ops with other processes that have waited WATCH_AFTER seconds: the processes each waits for
        self._slow: dict[asyncio.Future[object], tuple[int, ...]] = {}
        self._watch: asyncio.Task[None] | None = None
        self.looking: set[asyncio.Task[None]] = set()  # looks for a p2p peer gone (held: tasks are weak)
        self.gone_error: WorldAbortedError | None = None  # the error naming the processes gone

    def proc_of(self, rank: int) -> int:
        return rank // self.per_proc

    def attach(self, group: Group) -> None:
        procs = sorted({self.proc_of(g) for g in group.ranks})
        group.expected = sum(1 for g in group.ranks if g in self.local)
        if procs == [self.proc]:
            self.world = group.world
            return  # every member is here: an ordinary group
        world_group = self.world is None  # the first group made is the world's
        if world_group:
            pg = self.pg
        else:
            made = self._made.get(group.ranks)
            assert made, f"no process group was made for {group!r}"
            pg = made.popleft()
        group.bridge = PGBridge(self, group, pg, procs)
        if world_group:
            self.bridge = group.bridge
        self.world = group.world

    def aborted(self, message: str, cause: BaseException) -> None:
        """Send the other processes an abort notice as this process's next call on the world group.

        They wait at that call for this process's share; the notice ends their wait at
        once with ``WorldAbortedError`` rather than at the group's timeout. A process that
        was aborted by a notice sends none: the notice reached every process at once.
        """
        if self.bridge is None or isinstance(cause, _Notice):
            return
        if cause is self.gone_error:
            # each survivor finds the processes gone itself; a notice on a group with a
            # dead (or stopped) member would fail, or keep spawn waiting for it to be taken
            return
        self.farewell = self.bridge.notify(message)

    async def say_goodbye(self, grace: float) -> None:
        """Give the abort notice up to ``grace`` seconds to be taken (the others may be elsewhere)."""
        if self.farewell is not None:
            await asyncio.wait([self.farewell], timeout=grace)

    # -- processes gone -------------------------------------------------------------------

    def ranks_of(self, proc: int) -> range:
        return range(proc * self.per_proc, (proc + 1) * self.per_proc)

    def watch(self, op: asyncio.Future[object], procs: Sequence[int]) -> None:
        """Read the heartbeats of ``procs`` once ``op`` (an exchange or a p2p op with them) has waited a while."""
        others = tuple(p for p in procs if p != self.proc)
        if others and not op.done():
            op.get_loop().call_later(self.WATCH_AFTER, self._slow_op, op, others)

    def _slow_op(self, op: asyncio.Future[object], procs: tuple[int, ...]) -> None:
        if op.done() or self.world is None or self.world.aborted is not None:
            return
        self._slow[op] = procs
        op.add_done_callback(self._slow_done)
        if self._watch is None:
            self._watch = self.context.run(op.get_loop().create_task, self._watching())

    def _slow_done(self, op: asyncio.Future[object]) -> None:
        self._slow.pop(op, None)

    async def _watching(self) -> None:
        """While ops wait for other processes, look for those processes gone (see ``Presence.gone``)."""
        try:
            loop = asyncio.get_running_loop()
            while self._slow and self.world is not None and self.world.aborted is None:
                procs = sorted({p for ps in self._slow.values() for p in ps})
                began = loop.time()
                if await self.name_gone(procs, None):
                    return
                # a look ends at once when every peer is seen running or has not beaten yet: pace them
                await asyncio.sleep(max(0.0, Presence.INTERVAL - (loop.time() - began)))
        finally:
            self._watch = None

    async def name_gone(self, procs: Sequence[int], cause: BaseException | None) -> WorldAbortedError | None:
        """If some of ``procs`` left, died or stopped, abort the world naming them and return its error.

        ``cause``: the transport's error that prompted the look, if any. The look takes up
        to ``Presence.STALE`` seconds (see ``Presence.gone``). ``e.rank`` is the first
        world rank of the first process gone (None when the store itself is gone).
        """
        others = [p for p in procs if p != self.proc]
        try:
            settle = 0.0 if cause is None else Presence.SETTLE
            gone = await self.presence.gone([self.pg_ranks[p] for p in others], settle=settle)
        except StoreUnreachable as e:
            who = f"{e}: the process that hosts it (the job's rank 0 under env:// or tcp://) is gone"
            rank = None
        else:
            if not gone:
                return None
            procs_gone = [(self.pg_ranks.index(g), how) for g, how in gone]
            who = ", ".join(f"{self._name(p)} of the hybrid world {how}" for p, how in procs_gone)
            rank = self.ranks_of(procs_gone[0][0]).start
        return self._abort_gone(who, rank, cause)

    def _name(self, proc: int) -> str:
        ranks = self.ranks_of(proc)
        listed = ", ".join(map(str, ranks)) if len(ranks) <= 4 else f"{ranks.start} to {ranks.stop - 1}"
        glob = f"global rank {self.pg_ranks[proc]}, " if self.pg_ranks[proc] != proc else ""
        return f"process {proc} ({glob}rank{'s' if len(ranks) > 1 else ''} {listed})"

    def _abort_gone(self, who: str, rank: int | None, cause: BaseException | None) -> WorldAbortedError | None:
        """Release each local rank's waits with an error saying ``who`` is gone and what it waited in; abort."""
        world = self.world
        if world is None or world.aborted is not None:
            return self.gone_error
        states = []
        for st in (world.ranks[r] for r in self.local):
            waits = list(st.waiting)
            if not waits:
                states.append(f"rank {st.rank} {_doing(st.status())}")
                continue
            for w in waits:
                seq = f"call #{w.seq} of the group, " if w.seq is not None else ""
                e = WorldAbortedError(
                    f"{w.call.describe()} on rank {st.rank} of group {w.group.name!r} failed: {who}; "
                    f"rank {st.rank} was waiting in it ({seq}at {fmt_site(w.site)})",
                    rank=rank,
                )
                e.__cause__ = cause
                world.fail(w, e)
            what = ", ".join(f"{w.call.describe()} {w.where} at {fmt_site(w.site)}" for w in waits)
            states.append(f"rank {st.rank} was waiting in {what}")
        err = self.gone_error = WorldAbortedError(f"{who}; {'; '.join(states)}", rank=rank)
        err.__cause__ = cause
        # the ranks not waiting (running, or waiting in a local op later) get this message
        world.abort(rank, err, message=str(err))
        return err

    def close(self) -> None:
        """Let go of the process groups (the world has ended).

        The world's objects form reference cycles that only the garbage collector frees,
        perhaps at interpreter exit; a gloo group still alive then can abort the process
        ("terminate called without an active exception"). Dropping the references here
        frees the groups by refcount, when ``destroy_process_group`` expects it.
        """
        if self.world is not None:
            self.world.detach_hybrid()
        self.bridge = self.world = self.farewell = None
        self._made.clear()
        self._slow.clear()
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None

    def __repr__(self) -> str:
        return f"<HybridWorld process {self.proc}/{self.procs}, ranks {self.local.start}..{self.local.stop - 1}>"


# a group's last exchange (or abort notice), which the next one waits for
_Tail = asyncio.Future[list[object]] | asyncio.Future[None]


class PGBridge:
    """Completes one group's collectives across processes, in the group's order."""

    def __init__(self, hybrid: HybridWorld, group: Group, pg: dist.ProcessGroup, procs: list[int]) -> None:
        self.hybrid = hybrid
        self.group = group
        self.pg = pg
        self.procs = procs  # pg rank i is process procs[i]
        self.name = str(getattr(pg, "group_name", "?"))
        # the group's issuer: its timeout and error mapping, and the p2p it carries (held,
        # so that all of the group's p2p goes through one)
        self.issuer = Issuer.of(pg, hybrid.timeout)
        self._tail: _Tail | None = None  # the exchange before this one

    def run(self, rdv: Rendezvous) -> asyncio.Future[list[object]]:
        loop = self.group.world.loop
        # A task of no rank: made in the bridge's context, so the engine's task factory
        # does not count it as a rank's helper, and c10d sees the process's own state.
        task = self.hybrid.context.run(loop.create_task, self._run(rdv, self._tail))
        self._tail = task
        return task

    async def _run(self, rdv: Rendezvous, prev: _Tail | None) -> list[object]:
        if prev is not None and not prev.done():
            # ops of one group reach its process group in the group's order
            await asyncio.wait([prev])
        calls, sites = await self._exchange(rdv)
        op = type(calls[0])
        sig = calls[0].signature()
        if any(c.signature() != sig for c in calls):
            raise CollectiveMismatchError(mismatch_message(calls, rdv.seq, self.group.name, self._table(calls, sites)))
        problem = op.check(calls)
        if problem is not None:
            raise CollectiveMismatchError(
                f"{problem} ({op.name} #{rdv.seq} on group {self.group.name!r}):\n{self._table(calls, sites)}"
            )
        where = _device.placement(calls, self.group.world.inline_bytes)
        if where is _device.Placement.INLINE:
            results: list[Any] = op.run(calls)
        else:
            results = await _device.run_in_worker(self.group.world.loop, op.run, calls)
        if op in (ops.NewGroup, ops.Split):
            await self._make_groups(rdv, results)
        return results

    async def _exchange(self, rdv: Rendezvous) -> tuple[list[Any], list[Site | None]]:
        """Every member's call (local ones are the ranks' own objects) and call site."""
        mine = [
            (r, rdv.calls[r], w.site if w is not None else None)
            for r, w in enumerate(rdv.works)
            if rdv.calls[r] is not None
        ]
        try:
            payload = _dumps(mine)
        except Exception as e:  # e.g. a tensor subclass that cannot travel
            raise InvalidArgumentError(
                f"{rdv.op().name} {rdv.where}: the calls cannot be sent to the other processes: {e}"
            ) from e
        waiting: asyncio.Future[object] = self.group.world.loop.create_future()  # done when the exchange is
        self.hybrid.watch(waiting, self.procs)
        try:
            blobs = await all_gather_bytes(self.pg, payload, timeout=self.issuer.timeout)
        except RuntimeError as e:
            # a peer's socket closed, or the timeout: name the processes gone, if any
            named = await self.hybrid.name_gone(self.procs, e)
            if named is not None:
                raise named from e
            raise self.issuer.error(f"{rdv.op().name} {rdv.where}", e) from e
        finally:
            waiting.set_result(None)
        calls: list[Any] = list(rdv.calls)
        sites: list[Site | None] = [None] * self.group.size
        for i, blob in enumerate(blobs):
            theirs = torch.load(io.BytesIO(blob), weights_only=False)
            if isinstance(theirs, tuple) and theirs and theirs[0] == _ABORT:
                raise _Notice(f"process {self.procs[i]} of the hybrid world aborted: {theirs[1]}")
            for r, call, site in theirs:
                sites[r] = site
                if calls[r] is None:
                    calls[r] = call
        return calls, sites

    def notify(self, message: str) -> asyncio.Future[None]:
        """Send an abort notice in place of this process's next share on the group."""

        async def send(prev: _Tail | None) -> None:
            if prev is not None and not prev.done():
                await asyncio.wait([prev])
            await all_gather_bytes(self.pg, _dumps((_ABORT, message)), timeout=self.issuer.timeout)

        loop = self.group.world.loop
        task = self.hybrid.context.run(loop.create_task, send(self._tail))
        self._tail = task
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # nobody awaits it: no log
        return task

    def close(self) -> None:
        self._tail = None  # the last exchange's task, whose frame refers back to the bridge

    def p2p(self, work: EngineWork) -> asyncio.Future[object] | None:
        call, g = work.call, self.group
        assert isinstance(call, (ops.Send, ops.Recv))  # (the engine bridges only p2p works here)
        peer = call.dst if isinstance(call, ops.Send) else call.src
        assert peer is not None  # Comm refuses any-source receives in groups that span processes
        hy = self.hybrid
        peer_g, me_g = g.ranks[peer], g.ranks[work.grank]
        proc = hy.proc_of(peer_g)
        if proc == hy.proc:
            return None
        loop = g.world.loop
        # gloo matches a pair of processes' messages by tag, in order: one tag per pair
        # of ranks (and user tag) keeps each pair's stream apart
        k = hy.per_proc
        src_g, dst_g = (me_g, peer_g) if isinstance(call, ops.Send) else (peer_g, me_g)
        tag = (call.tag * k + src_g % k) * k + dst_g % k
        if tag >= 1 << 31:
            fut: asyncio.Future[object] = loop.create_future()
            fut.set_exception(
                InvalidArgumentError(
                    f"{call.describe()} on rank {me_g}: tag {call.tag} is too large for a hybrid world"
                )
            )
            return fut
        to = self.procs.index(proc)
        wire = ops.Send(call.tensor, to, tag) if isinstance(call, ops.Send) else ops.Recv(call.tensor, to, tag)
        issued = hy.context.run(self.issuer.issue, wire, loop)
        hy.watch(issued, [proc])
        out: asyncio.Future[object] = loop.create_future()

        async def name_gone(exc: BaseException) -> None:
            named = await hy.name_gone([proc], exc)
            if not out.done():
                out.set_exception(named or exc)

        def done(f: asyncio.Future[object]) -> None:
            exc = None if f.cancelled() else f.exception()
            if f.cancelled():
                out.cancel()
            elif isinstance(exc, RuntimeError):  # the transport failed: is the peer gone?
                task = hy.context.run(loop.create_task, name_gone(exc))
                hy.looking.add(task)
                task.add_done_callback(hy.looking.discard)
            elif exc is not None:
                out.set_exception(exc)
            else:
                out.set_result(None if isinstance(call, ops.Send) else peer)

        issued.add_done_callback(done)
        return out

    def _table(self, calls: list[Any], sites: list[Site | None]) -> str:
        lines = []
        for r, c in enumerate(calls):
            g = self.group.ranks[r]
            who = f"rank {r}" if g == r else f"rank {r} (global {g})"
            lines.append(f"  {who} in process {self.hybrid.proc_of(g)}: {c.describe()} at {fmt_site(sites[r])}")
        return "\n".join(lines)

    async def _make_groups(self, rdv: Rendezvous, parts: list[ops.Partition]) -> None:
        """Make a process group for each new sub-group that spans processes, this one among them."""
        # Every process walks the new groups in the same order (by rank) and makes, one
        # after the other, those it takes part in: the makers of each group agree.
        seen: set[tuple[int, ...]] = set()
        pg_ranks = dist.get_process_group_ranks(self.hybrid.pg)
        for members in parts[0].groups:
            if members is None:
                continue
            ranks = tuple(self.group.ranks[m] for m in members)
            if ranks in seen:
                continue
            seen.add(ranks)
            procs = sorted({self.hybrid.proc_of(g) for g in ranks})
            name = f"{self.name}/aiocoll-hybrid{self.hybrid.id}/{self.group.name}/{rdv.seq}.{ranks[0]}"
            if len(procs) < 2 or self.hybrid.proc not in procs:
                continue
            pg = await asyncio.to_thread(create_group, self.hybrid.pg, [pg_ranks[p] for p in procs], name)
            self.hybrid._made[ranks].append(pg)

    def __repr__(self) -> str:
        return f"<PGBridge group={self.group.name!r} processes={self.procs} pg={self.name!r}>"
