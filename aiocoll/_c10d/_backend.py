"""The torch.distributed adapter: backend ``"aiocoll"``, its ProcessGroup and Work.

Every collective torch.distributed hands to an aiocoll process group becomes a call of
the rank's ``Comm`` (same validation, same engine as async ranks). A rank running in a
thread posts its works to the loop and blocks in ``Work.wait()``; a rank running as a
task on the loop must use ``async_op=True`` and ``await`` the returned work.

torch keeps its process-group state in module globals. To give every rank its own, the
module's ``_world`` is replaced (while any aiocoll world uses torch.distributed) by a
proxy that forwards to the state of the rank running now, found through a context
variable, so it works for threads and tasks alike; code outside any rank sees torch's
own state, untouched.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
import weakref
from collections.abc import Generator, Sequence
from datetime import timedelta
from types import CodeType
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.constants as dist_constants

from .. import _current, _patches, _torch
from .._comm import Comm
from .._engine._engine_comm import EngineComm
from .._engine._rank import RankState, current_rank_state
from .._engine._world import World
from .._errors import AiocollError, BlockingCallError, InvalidArgumentError
from .._paths import PACKAGE_DIR
from .._process import _procstate
from .._stats import Phase
from .._work import Site, Work
from . import _monitored
from ._belongings import Belongings, Kind

if TYPE_CHECKING:
    from .._torch import (
        AllgatherOptions,
        AllreduceOptions,
        AllToAllOptions,
        BarrierOptions,
        BroadcastOptions,
        DeviceMesh,
        DistributedBackendOptions,
        GatherOptions,
        ReduceOptions,
        ReduceScatterOptions,
        ScatterOptions,
        Store,
    )

T = TypeVar("T")
# what an AiocollWork's result and future carry, as gloo's: the tensors the op wrote
Tensors = list[torch.Tensor] | list[list[torch.Tensor]]

__all__ = [
    "BACKEND",
    "AiocollProcessGroup",
    "AiocollWork",
    "CommProcessGroup",
    "RankSession",
    "belong",
    "register",
    "release",
    "settle",
    "user_site",
]

BACKEND = "aiocoll"


# -- per-rank torch.distributed state (the mechanism lives in _torch) ------------------


def _c10d_changes(key: object) -> list[_patches.Change]:
    return _torch.c10d_changes(
        _name_suffix,
        _mesh_made,
        lambda pg: isinstance(pg, AiocollProcessGroup),
        _store_made,
        _procstate.stepped_out,
        _own_device,
    )


# (what a world makes must die with it: on torch 2.10-2.12 every DTensorSpec and mesh an op
# hashes would stay for good, in any process, for torch's own leak)
OPSCHEMA_LEAK = _patches.PatchSet(
    "torch's OpSchema leak undone",
    "on torch 2.10-2.12, the reference torch leaks to each OpSchema's hashed arguments (pytorch#181761) is "
    "given back, so that a world's DTensorSpecs and meshes die with it (where DTensor is loaded)",
    lambda key: _torch.op_schema_leak_fix(),
    ["torch.distributed.tensor._op_schema._DTensor_OpSchema_*"],
)

PER_RANK_C10D = _patches.PatchSet(
    "torch.distributed per rank",
    "each rank has its own c10d state (default group, groups, names), its meshes and stores are its "
    "world's, group.WORLD read by an import is the process's, DeviceMesh sets each rank's CUDA device",
    _c10d_changes,
    _torch.C10D_TARGETS,
    needs=(OPSCHEMA_LEAK,),
)


_SUFFIX = "~aiocoll"


def _name_suffix() -> str | None:
    st = current_rank_state()
    if st is not None and st.world.on_loop_thread():
        # async ranks share one thread and so one C++ registry: make names unique per
        # rank and per world (worlds may nest or run side by side on one loop)
        return f"{_SUFFIX}{st.world.id}.{st.rank}"
    return None


def _base_name(name: str) -> str:
    """The rank-independent part of a group name (what all ranks of the group share)."""
    return name.split(_SUFFIX, 1)[0]


def _mesh_made(mesh: DeviceMesh) -> int | None:
    """A mesh was built: it belongs to the calling rank's world; its identity is the rank's."""
    st = current_rank_state()
    if st is None:
        return None
    belong(st.world, "mesh", mesh)
    # without a per-rank identity, DTensor's caches would hand one rank's mesh to another
    return id(st)


def _own_device() -> bool:
    """The caller is a sync rank: its thread's current CUDA device is its own, as a process's is."""
    st = current_rank_state()
    return st is not None and not st.world.on_loop_thread()


def _store_made(store: Store) -> None:
    st = current_rank_state()
    if st is not None:
        belong(st.world, "store", store)


# -- what a world made, released when it ends (see _belongings) --------------------------

_belongings: weakref.WeakKeyDictionary[World, Belongings] = weakref.WeakKeyDictionary()
_belongings_lock = threading.Lock()


def belong(world: World, kind: Kind, obj: object) -> None:
    """Record ``obj`` (a group, store or mesh one of ``world``'s ranks made) for ``release``."""
    b = _belongings.get(world)
    if b is None:
        with _belongings_lock:  # (ranks in threads make their first groups at once)
            b = _belongings.setdefault(world, Belongings())
    b.add(kind, obj)


def release(world: World, results: object = None) -> list[str]:
    """Once ``world`` has ended: free what its ranks made (``Belongings.release``); what outlives it.

    ``results``: what the world returned (which may keep some of it alive). The record
    goes too: a world kept after it ended (by its caller, or by torch 2.10-2.12's leak
    of DTensor specs, which keeps the meshes, their groups and so the world) keeps no
    list of what it made.
    """
    with _belongings_lock:
        b = _belongings.pop(world, None)
    return [] if b is None else b.release(results)


# -- Work ------------------------------------------------------------------------------


class AiocollWork(dist.Work):
    """The Work of the aiocoll backend: one or more engine works (coalesced calls).

    ``wait()`` blocks the calling thread (not allowed on the loop thread while pending);
    ``await work`` waits on the loop. Errors keep their type and message. ``hand_over``:
    the works were issued by a rank thread of a world whose ranks take turns.
    """

    def __init__(self, works: Sequence[Work], value: Tensors, hand_over: bool = False) -> None:
        super().__init__()
        self._works = list(works)
        self._value = value
        self._hand_over = hand_over
        self._future: torch.futures.Future[object] | None = None

    def wait(self, timeout: timedelta | None = None) -> bool:
        secs = None if timeout is None or timeout == timedelta(0) else timeout.total_seconds()
        for w in self._works:
            w.wait(secs)
        return True

    def is_completed(self) -> bool:
        return all(w.done() for w in self._works)

    def is_success(self) -> bool:
        return self.is_completed() and all(w.exception() is None for w in self._works)

    def exception(self) -> BaseException | None:
        for w in self._works:
            if w.done() and w.exception() is not None:
                return w.exception()
        return None

    def result(self) -> Any:
        self.wait()
        return self._value

    def get_future(self) -> torch.futures.Future[object]:
        if self._future is None:
            if self._hand_over:
                # Ranks take turns, and C++ callers (DDP's reducer) block on the future
                # itself, keeping the turn: wait here instead, giving it away. (Errors
                # are the future's to carry.)
                for w in self._works:
                    with contextlib.suppress(Exception):
                        w.wait()
            if len(self._works) == 1:
                self._future = self._works[0].torch_future(self._value)
            else:
                # each sub-future fails in C++ when its work fails, and so (at the first) does
                # collect_all's: the callback only runs when every work succeeded
                futs = [w.torch_future(None) for w in self._works]
                value = self._value
                self._future = torch.futures.collect_all(futs).then(lambda _: value)
        return self._future

    def _source_rank(self) -> int:
        src = self._works[0].result()
        assert isinstance(src, int)
        return src

    def source_rank(self) -> int:
        return self._source_rank()

    def __await__(self) -> Generator[object, None, Tensors]:
        for w in self._works:
            yield from w.__await__()
        return self._value

    def __repr__(self) -> str:
        return f"<AiocollWork {self._works!r}>"


# -- the process group -------------------------------------------------------------------

_TORCH_DIR = os.path.dirname(torch.__file__)


class _C10dComm(EngineComm):
    """A Comm whose call sites are the user's frame above torch.distributed."""

    __slots__ = ()

    def _site(self) -> Site:
        return user_site()


def user_site() -> Site:
    """File and line of the innermost frame of the user's code, above torch.distributed's and aiocoll's."""
    f = sys._getframe(1)
    while f.f_back is not None and (f.f_code in _SKIPPED or _skipped(f.f_code)):
        f = f.f_back
    return (f.f_code.co_filename, f.f_lineno)


# torch's and aiocoll's code objects seen above a call (a few hundred at most; the user's
# are not kept, so none is held alive here)
_SKIPPED: set[CodeType] = set()


def _skipped(code: CodeType) -> bool:
    """Whether a frame running ``code``, not yet in ``_SKIPPED``, is torch's or aiocoll's rather than the user's."""
    if code.co_filename.startswith((_TORCH_DIR, PACKAGE_DIR)):
        _SKIPPED.add(code)
        return True
    return False


def _one(op: str, tensors: Sequence[T]) -> T:
    if len(tensors) != 1:
        raise InvalidArgumentError(f"{op}: the aiocoll backend takes one tensor per call, got {len(tensors)}")
    return tensors[0]


def _u(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the engine gets it: writes to it leave ``t``'s autograd version counter alone.

    gloo and NCCL write their results from C++, unseen by autograd; aiocoll's ops write
    with torch ops, which count as in-place changes. A broadcast into a tensor that
    views of a tensor requiring grad share (DTensor's ``distribute_tensor`` does that)
    would then make autograd refuse those views. ``.data`` shares the storage, not the
    version counter (0.2 us).
    """
    return t.data


def _us(ts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [t.data for t in ts]


@_torch.python_process_group
class CommProcessGroup(dist.ProcessGroup):
    """A torch.distributed process group whose collectives are calls of an aiocoll ``Comm``.

    torch hands it group-local ranks and lists of tensors; each op becomes the ``Comm``
    call it stands for (same validation, same reports), and its ``Work`` waits on the
    ``Comm``'s works. Subclasses say who may call it (``_check``) and how its works are
    handed out (``_work``): ``AiocollProcessGroup`` for ranks of an in-process world,
    ``_checked.CheckedProcessGroup`` over a real group in a process of its own.
    """

    backend_name = BACKEND  # the registered backend that makes it

    def __init__(self, comm: Comm, name: str) -> None:
        # the (rank, size) constructor; the stubs of some releases know only the one taking a store
        args: Any = (comm.rank, comm.world_size)
        super().__init__(*args)
        self._comm = comm
        self._name = name
        self._reported = self.backend_name  # what pg.name() answers (report_backend)

    def _check(self, op: str, opts: object) -> None:
        """Refuse a call of ``op`` that this group cannot take from the calling code."""

    def _work(self, works: Sequence[Work], value: Tensors) -> AiocollWork:
        return AiocollWork(works, value)

    @property
    def group_name(self) -> str:  # type: ignore[override]
        return self._name

    def getBackendName(self) -> str:
        return self.backend_name  # (C++ code, DDP's among it, maps this name to a backend type)

    def name(self) -> str:
        return self._reported

    def report_backend(self, asked: object) -> None:
        """Name ``asked`` (the backend this group stands in for) in ``pg.name()``, as in processes.

        A group asked for gloo answers ``"gloo"``. A composite ``"cpu:gloo,cuda:nccl"``
        names no single backend: aiocoll's own name stays.
        """
        name = str(asked).lower()
        if name and ":" not in name and "," not in name and name != "undefined":
            self._reported = name

    @staticmethod
    def create_device(*args: object, **kwargs: object) -> dist.ProcessGroupGloo.Device:
        """gloo's ``create_device``, for code that asks its backend (aiocoll's collectives use no device)."""
        if not dist.is_gloo_available():
            raise AiocollError("create_device: gloo is not available in this build of torch")
        return dist.ProcessGroupGloo.create_device(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._name!r} rank={self._comm.rank}/{self._comm.world_size}>"

    # collectives -- c10d hands group-local ranks and tensor lists
    # (torch's stubs overload most of them with pybind's second form, for direct calls with
    # a tensor and a timeout, which this group does not take: hence the ignore[override])

    def allreduce(self, tensors: list[torch.Tensor], opts: AllreduceOptions | None = None) -> AiocollWork:  # type: ignore[override]
        self._check("all_reduce", opts)
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        t = _one("all_reduce", tensors)
        rank = _procstate.bound_rank()
        if t.is_sparse and rank is not None:  # (a rank of torch's test harness: gloo's processes can)
            raise _procstate.NeedsProcess(rank, "reduced a sparse tensor (aiocoll has no sparse collectives)")
        return self._work([self._comm.all_reduce(_u(t), op)], tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: AllreduceOptions | None = None) -> AiocollWork:
        self._check("all_reduce_coalesced", opts)
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        # gloo reduces one flat copy of the list: a tensor listed twice is reduced once
        seen: set[tuple[object, ...]] = set()
        unique = []
        for t in _us(tensors):
            key = (t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
            if key not in seen:
                seen.add(key)
                unique.append(t)
        return self._work([self._comm.all_reduce(t, op) for t in unique], tensors)

    def broadcast(self, tensors: list[torch.Tensor], opts: BroadcastOptions) -> AiocollWork:  # type: ignore[override]
        self._check("broadcast", opts)
        return self._work([self._comm.broadcast(_u(_one("broadcast", tensors)), opts.rootRank)], tensors)

    def reduce(self, tensors: list[torch.Tensor], opts: ReduceOptions) -> AiocollWork:  # type: ignore[override]
        self._check("reduce", opts)
        t = _u(_one("reduce", tensors))
        return self._work([self._comm.reduce(t, opts.rootRank, opts.reduceOp)], tensors)

    def allgather(  # type: ignore[override]
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: AllgatherOptions | None = None
    ) -> AiocollWork:
        self._check("all_gather", opts)
        outs = _one("all_gather", outputs)
        w = self._comm.all_gather(_us(outs), _u(_one("all_gather", inputs)))
        return self._work([w], outs)  # the future's value, as gloo's: the flat list

    def allgather_coalesced(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: AllgatherOptions | None = None
    ) -> AiocollWork:
        self._check("all_gather_coalesced", opts)
        # outputs[rank][i] receives input i of that rank
        if len(outputs) != self._comm.world_size or any(len(o) != len(inputs) for o in outputs):
            raise InvalidArgumentError(
                f"all_gather_coalesced on rank {self._comm.rank}: 'output_tensor_lists' must hold one list per "
                f"rank ({self._comm.world_size}), each with one tensor per input ({len(inputs)})"
            )
        works = [self._comm.all_gather([o[i].data for o in outputs], x.data) for i, x in enumerate(inputs)]
        return self._work(works, outputs)

    def all_gather_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: AllgatherOptions | None = None
    ) -> AiocollWork:
        self._check("all_gather_into_tensor", opts)
        w = self._comm.all_gather_into_tensor(_u(output), _u(input))
        return self._work([w], list(output.chunk(self._comm.world_size)))  # gloo's future value

    def all_gather_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: AllgatherOptions | None = None
    ) -> AiocollWork:
        self._check("all_gather_into_tensor", opts)
        works = [self._comm.all_gather_into_tensor(o.data, i.data) for o, i in zip(outputs, inputs, strict=True)]
        return self._work(works, outputs)

    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: GatherOptions) -> AiocollWork:  # type: ignore[override]
        self._check("gather", opts)
        gather_list = outputs[0] if outputs else None
        w = self._comm.gather(
            _u(_one("gather", inputs)), None if gather_list is None else _us(gather_list), opts.rootRank
        )
        return self._work([w], gather_list if gather_list is not None else [])

    def scatter(  # type: ignore[override]
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: ScatterOptions
    ) -> AiocollWork:
        self._check("scatter", opts)
        scatter_list = inputs[0] if inputs else None
        out = _u(_one("scatter", outputs))
        w = self._comm.scatter(out, None if scatter_list is None else _us(scatter_list), opts.rootRank)
        return self._work([w], outputs)

    def reduce_scatter(  # type: ignore[override]
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: ReduceScatterOptions | None = None
    ) -> AiocollWork:
        self._check("reduce_scatter", opts)
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        w = self._comm.reduce_scatter(_u(_one("reduce_scatter", outputs)), _us(_one("reduce_scatter", inputs)), op)
        return self._work([w], outputs)

    def reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: ReduceScatterOptions | None = None
    ) -> AiocollWork:
        self._check("reduce_scatter_tensor", opts)
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        return self._work([self._comm.reduce_scatter_tensor(_u(output), _u(input), op)], [output])

    def reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: ReduceScatterOptions | None = None
    ) -> AiocollWork:
        self._check("reduce_scatter_tensor", opts)
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        works = [self._comm.reduce_scatter_tensor(o.data, i.data, op) for o, i in zip(outputs, inputs, strict=True)]
        return self._work(works, outputs)

    def alltoall(  # type: ignore[override]
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: AllToAllOptions | None = None
    ) -> AiocollWork:
        self._check("all_to_all", opts)
        return self._work([self._comm.all_to_all(_us(outputs), _us(inputs))], outputs)

    def all_to_all_single(  # type: ignore[override,unused-ignore]  # (matches torch 2.10's stub)
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int] | None,
        input_split_sizes: list[int] | None,
        opts: AllToAllOptions | None = None,
    ) -> AiocollWork:
        self._check("all_to_all_single", opts)
        if not (output.is_contiguous() and input.is_contiguous()):
            raise ValueError("Tensors must be contiguous")  # (gloo's and NCCL's check, and error)
        w = self._comm.all_to_all_single(_u(output), _u(input), output_split_sizes, input_split_sizes)
        return self._work([w], [output])

    def barrier(self, opts: BarrierOptions | None = None) -> AiocollWork:  # type: ignore[override]
        self._check("barrier", opts)
        return self._work([self._comm.barrier()], [])

    def monitored_barrier(self, timeout: timedelta | float | None = None, wait_all_ranks: bool = False) -> None:
        """gloo's ``monitored_barrier``: here a barrier, bounded by ``timeout`` (a ``timedelta`` or seconds)."""
        self._check("monitored_barrier", None)
        secs = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
        self.barrier().wait(timedelta(seconds=secs) if secs is not None else None)

    # point to point: blocking on the loop is caught in Work.wait()

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> AiocollWork:
        self._check("send", None)
        return self._work([self._comm.send(_u(_one("send", tensors)), dst, tag)], tensors)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> AiocollWork:
        self._check("recv", None)
        return self._work([self._comm.recv(_u(_one("recv", tensors)), src, tag)], tensors)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> AiocollWork:
        self._check("recv", None)
        return self._work([self._comm.recv(_u(_one("recv", tensors)), None, tag)], tensors)


@_torch.python_process_group
class AiocollProcessGroup(CommProcessGroup):
    """The process group of one rank of an in-process world: its collectives run on the aiocoll engine."""

    _comm: EngineComm

    def __init__(self, comm: EngineComm, name: str) -> None:
        super().__init__(comm, name)
        self._on_loop = not comm.threaded
        self._owner = comm.world.ranks[comm.global_rank]  # the only rank that may call it
        # a world's ranks take turns (or not) from its start, before any group is made
        self._hand_over = comm.threaded and comm.world.turns is not None
        belong(comm.world, "group", self)

    def _check(self, op: str, opts: object) -> None:
        me = current_rank_state()
        owner = self._owner
        if me is not owner:
            who = "code outside any rank" if me is None else f"rank {me.rank}"
            raise AiocollError(
                f"torch.distributed.{op}: the process group of rank {owner.rank} was used by {who}; each rank "
                "must use its own groups (a default argument such as group=dist.group.WORLD evaluated "
                "while another rank ran, e.g. at an import inside a rank, captures that rank's group)"
            )
        if self._on_loop and not getattr(opts, "asyncOp", True):
            raise BlockingCallError(
                f"torch.distributed.{op} on rank {self._comm.global_rank}: a blocking call on the event loop "
                "thread would deadlock; use 'await dist."
                f"{op}(..., async_op=True)' or 'await comm.{op}(...)'"
            )

    def _work(self, works: Sequence[Work], value: Tensors) -> AiocollWork:
        if self._on_loop:
            # functional collectives hide their Work from Python: keep them for settle()
            issued = self._owner.issued
            if len(issued) > 64:
                issued[:] = [w for w in issued if not w.done()]
            issued.extend(works)
        return AiocollWork(works, value, self._hand_over)

    def monitored_barrier(self, timeout: timedelta | float | None = None, wait_all_ranks: bool = False) -> None:
        """gloo's ``monitored_barrier`` (see ``_monitored``): rank 0 names the ranks that did not come in ``timeout``.

        ``timeout``: a ``timedelta`` or seconds; None: the group's own timeout, if it was
        given one, else the world's.
        """
        self._check("monitored_barrier", None)
        if self._on_loop:
            raise BlockingCallError(
                f"torch.distributed.monitored_barrier on rank {self._comm.global_rank}: it blocks, and a blocking "
                "call on the event loop thread would deadlock; use 'await dist.barrier(async_op=True)'"
            )
        comm = self._comm
        world, group = comm.world, comm.group
        if group.bridge is not None:
            # other processes run some of its ranks: a plain barrier (a rank that never
            # comes is reported as for any collective)
            self.barrier().wait()
            return
        if timeout is None:
            asked = group.own_timeout[0] if group.own_timeout is not None else world.timeout
        else:
            asked = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
        kept = None if asked is None else asked * world.timeouts.stretch
        side = _C10dComm(world, world.groups.side_channel(group), comm.rank, threaded=True)

        def gone(peer: int) -> str | None:
            phase = world.ranks[group.ranks[peer]].phase
            return None if phase is Phase.RUNNING or phase is Phase.REMOTE else phase.state

        _monitored.MonitoredBarrier(
            side, asked, kept, wait_all_ranks, broke=lambda why: world.break_group(group, why), gone=gone
        ).run()


def _create_process_group(opts: DistributedBackendOptions, backend_options: object = None) -> AiocollProcessGroup:
    """The creator torch.distributed calls for backend "aiocoll" (extended API)."""
    st = current_rank_state()
    if st is None:
        raise AiocollError(
            "the 'aiocoll' torch.distributed backend serves ranks started by aiocoll.spawn(); "
            "this code runs outside any aiocoll rank"
        )
    world = st.world
    ranks = list(opts.global_ranks_in_group) or list(range(opts.group_size))
    group = world.groups.named(_base_name(str(opts.group_id)), ranks, st.rank)
    timeout = getattr(opts, "timeout", None)
    if isinstance(timeout, timedelta) and timeout not in _TORCH_DEFAULTS and not _MAKING_DEFAULT.get():
        world.timeouts.own(group, timeout.total_seconds())  # (the first of its members tells it)
    comm = _C10dComm(world, group, int(opts.group_rank), threaded=not world.on_loop_thread())
    return AiocollProcessGroup(comm, str(opts.group_id))


# the timeouts torch gives a group when none is asked for (30 min, NCCL's 10): not the
# user's, so the world's applies (whose deadlocks are reported at once)
_TORCH_DEFAULTS = {t for t in (dist_constants.default_pg_timeout, dist_constants.default_pg_nccl_timeout) if t}

# set while aiocoll makes a rank's default group itself: that group keeps the world's timeout
# (a facet of the thread, not of the task: init_process_group makes the group in one call, without
# giving the loop to another rank's task meanwhile)
_MAKING_DEFAULT = _current.Facet("making its default group", False, carried=False)


async def settle() -> None:
    """Await every torch.distributed operation the calling async rank has issued.

    Functional collectives return tensors whose work torch keeps to itself; on the
    loop thread, reading them before the peers have arrived would block the loop.
    Settle first::

        y = funcol.all_reduce(x, "sum", dist.group.WORLD)
        await aiocoll.settle()
        print(y)                      # complete: no blocking

    >>> import torch, torch.distributed as dist, aiocoll
    >>> import torch.distributed._functional_collectives as funcol
    >>> async def worker(comm):
    ...     y = funcol.all_reduce(torch.ones(1), "sum", dist.group.WORLD)
    ...     await aiocoll.settle()
    ...     return y.item()
    >>> aiocoll.spawn(worker, world=2)
    [2.0, 2.0]
    """
    st = current_rank_state()
    if st is None:
        raise AiocollError("settle() must be awaited inside an aiocoll rank")
    while st.issued:
        for w in st.take_issued():
            await w


_registered = False


def register() -> None:
    """Register backend "aiocoll" with torch.distributed (done on ``import aiocoll``)."""
    global _registered
    if _registered or BACKEND in dist.Backend.backend_list:
        _registered = True
        return
    dist.Backend.register_backend(BACKEND, _create_process_group, extended_api=True, devices=["cpu", "cuda"])
    _registered = True


# -- per-rank init and teardown (used by spawn) ------------------------------------------


@functools.lru_cache(maxsize=8)
def _identity_map(size: int) -> dict[int, int]:
    """``{r: r for r < size}``, one per size: the rank map every rank's default group shares (read-only)."""
    return {r: r for r in range(size)}


class RankSession:
    """torch.distributed for one rank: its own state and, with ``init``, the default group = world.

    Without ``init`` the rank's code initialises torch.distributed itself (torch's
    multi-process test harness, run in-process by ``aiocoll.testing``).
    """

    def __init__(self, st: RankState, store: Store, init: bool = True) -> None:
        self.st = st
        self.state = _torch.C10dState()
        self.store = store
        self.init = init

    def start(self) -> None:
        """Run in the rank's own context (its thread or task)."""
        self.st.use_c10d(self.state)
        if not self.init:
            return
        with _MAKING_DEFAULT.bound(True):
            dist.init_process_group(
                BACKEND,
                rank=self.st.rank,
                world_size=self.st.world.size,
                store=self.store,
                timeout=timedelta(seconds=self.st.world.timeout or 1800.0),
            )
        # init_process_group builds the world's {global rank: group rank} map per rank: W
        # entries for each of W ranks, 60 MB at W=1024. torch only reads (or deletes) it,
        # so every rank can share one.
        pg = self.state.default_pg
        if pg is not None and pg in self.state.pg_group_ranks:
            self.state.pg_group_ranks[pg] = _identity_map(self.st.world.size)

    def finish(self) -> None:
        """Drop this rank's groups; idempotent, callable from any thread."""
        state = self.state
        for pg, name in list(state.pg_names.items()):
            if isinstance(pg, AiocollProcessGroup):
                _torch.unregister_group(name)
            else:  # another backend's group made in the rank (aiocoll's record themselves)
                belong(self.st.world, "native group", pg)
        state.clear()
