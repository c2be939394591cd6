"""c10d's process groups: its option structs, ``ReduceOp``'s PREMUL_SUM factor, what
torch's C++ asks of a process group written in Python, and the private helpers aiocoll
calls on real groups (torch 2.10-2.15)."""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ._compat import _C, _broken, _c10d, _need

if TYPE_CHECKING:
    from torch._C._distributed_c10d import (
        AllgatherOptions,
        AllreduceOptions,
        AllToAllOptions,
        Backend,
        BarrierOptions,
        BroadcastOptions,
        GatherOptions,
        ReduceOptions,
        ReduceScatterOptions,
        ScatterOptions,
        Store,
    )

__all__ = [
    "PREMUL_SUM_FACTOR",
    "allgather_into",
    "backend_of",
    "default_group",
    "default_store",
    "group_timeout",
    "make_group",
    "new_group_helper",
    "options",
    "premul_factor",
    "python_process_group",
    "reduce_scatter_into",
    "unregister_group",
]


class options:
    """c10d's option structs (``torch.distributed`` does not re-export them all, 2.10-2.15)."""

    AllgatherOptions: type[AllgatherOptions] = _need(
        _C, "AllgatherOptions", "torch._C._distributed_c10d.AllgatherOptions"
    )
    AllreduceOptions: type[AllreduceOptions] = _need(
        _C, "AllreduceOptions", "torch._C._distributed_c10d.AllreduceOptions"
    )
    AllToAllOptions: type[AllToAllOptions] = _need(_C, "AllToAllOptions", "torch._C._distributed_c10d.AllToAllOptions")
    BarrierOptions: type[BarrierOptions] = _need(_C, "BarrierOptions", "torch._C._distributed_c10d.BarrierOptions")
    BroadcastOptions: type[BroadcastOptions] = _need(
        _C, "BroadcastOptions", "torch._C._distributed_c10d.BroadcastOptions"
    )
    GatherOptions: type[GatherOptions] = _need(_C, "GatherOptions", "torch._C._distributed_c10d.GatherOptions")
    ReduceOptions: type[ReduceOptions] = _need(_C, "ReduceOptions", "torch._C._distributed_c10d.ReduceOptions")
    ReduceScatterOptions: type[ReduceScatterOptions] = _need(
        _C, "ReduceScatterOptions", "torch._C._distributed_c10d.ReduceScatterOptions"
    )
    ScatterOptions: type[ScatterOptions] = _need(_C, "ScatterOptions", "torch._C._distributed_c10d.ScatterOptions")


# -- ReduceOp internals ---------------------------------------------------------------

PREMUL_SUM_FACTOR = "ReduceOp.factor (2.13+) or ReduceOp.__getstate__() (2.10-2.12) for PREMUL_SUM's factor"


def premul_factor(op: dist.ReduceOp) -> float | torch.Tensor:
    """The factor of a ``_make_nccl_premul_sum(factor)`` op.

    2.13+ exposes ``op.factor``; 2.10-2.12 have no such attribute, but the pickling
    state is ``(RedOpType, factor)`` in every release.
    """
    factor = getattr(op, "factor", None)
    if factor is None:
        state = op.__getstate__() if hasattr(op, "__getstate__") else None
        if not (isinstance(state, tuple) and len(state) == 2):
            raise _broken(PREMUL_SUM_FACTOR)
        factor = state[1]
    if not isinstance(factor, (float, int, torch.Tensor)) or isinstance(factor, bool):
        raise _broken(PREMUL_SUM_FACTOR)
    return factor


# -- names torch's C++ calls on a Python ProcessGroup --------------------------------

# torch 2.10-2.12 call the old names from C++ (functional collectives, DeviceMesh) and
# from distributed_c10d.py (their libtorch_python knows no other); 2.13+ call the new
# ones and fall back to the old.
_LEGACY_PG_METHODS = {
    "all_gather_single": "_allgather_base",
    "reduce_scatter_single": "_reduce_scatter_base",
    "all_to_all_single": "alltoall_base",
    "all_gather_single_coalesced": "allgather_into_tensor_coalesced",
    "reduce_scatter_single_coalesced": "reduce_scatter_tensor_coalesced",
}


def python_process_group(cls: type[dist.ProcessGroup]) -> type[dist.ProcessGroup]:
    """Class decorator for a ProcessGroup subclass written in Python (no C++ backend).

    - It answers to both generations of method names (above).
    - ``pg._get_backend(device)`` returns the group itself. c10d's Python code asks the
      group for its per-device backend before p2p (2.15: ``batch_isend_irecv``, ``send``
      look up ``supports_coalescing`` with a default, "because custom Python backends are
      ProcessGroup subclasses"); a Python group registers no C++ backend, and torch's
      ``_get_backend`` would raise "No backend type associated with device type cpu".
    """
    for new, old in _LEGACY_PG_METHODS.items():
        if new in vars(cls) and old not in vars(cls):
            setattr(cls, old, vars(cls)[new])

    def _get_backend(self: dist.ProcessGroup, device: object = None) -> dist.ProcessGroup:
        return self

    cls._get_backend = _get_backend  # type: ignore[method-assign,assignment]
    # Standing in for its backend, it answers c10d's capability questions: none of them
    # (splitting, coalescing, shrinking, time estimates, tensor allocation), so torch
    # raises its own clear error ("... does not support splitting") or takes its
    # fallback, instead of an AttributeError.
    for name in dir(_C.Backend):
        if "supports" not in name or name in vars(cls):
            continue
        if isinstance(getattr(_C.Backend, name), property):
            setattr(cls, name, False)
        else:
            setattr(cls, name, _supports_nothing)
    return cls


def _supports_nothing(self: object, *args: object, **kwargs: object) -> bool:
    return False


def allgather_into(pg: dist.ProcessGroup, out: torch.Tensor, inp: torch.Tensor, opts: AllgatherOptions) -> dist.Work:
    """``pg``'s all-gather into one tensor (``_allgather_base``, bound on every release)."""
    return pg._allgather_base(out, inp, opts)


def reduce_scatter_into(
    pg: dist.ProcessGroup, out: torch.Tensor, inp: torch.Tensor, opts: ReduceScatterOptions
) -> dist.Work:
    """``pg``'s reduce-scatter of one tensor (``_reduce_scatter_base``, bound on every release)."""
    return pg._reduce_scatter_base(out, inp, opts)


def backend_of(pg: dist.ProcessGroup, device: torch.device) -> Backend:
    """``pg``'s backend for ``device`` (gloo's, NCCL's); RuntimeError where it has none."""
    return pg._get_backend(device)


def group_timeout(pg: dist.ProcessGroup, backend: str) -> timedelta:
    """The timeout ``pg`` was made with where its CPU backend tells it, else c10d's default."""
    try:
        t = backend_of(pg, torch.device("cpu")).options._timeout
    except (RuntimeError, AttributeError):
        t = None
    if isinstance(t, timedelta):
        return t
    default: timedelta = _c10d._get_default_timeout(dist.Backend(backend))
    return default


def default_group() -> dist.ProcessGroup:
    """The default (world) group of torch.distributed; it must be initialised."""
    pg: dist.ProcessGroup = _c10d._get_default_group()
    return pg


def default_store() -> Store:
    """The store of torch.distributed's default group (the job's rendezvous store)."""
    store: Store = _c10d._get_default_store()
    return store


def new_group_helper(ranks: list[int], me: int, backend: str, name: str, timeout: timedelta) -> dist.ProcessGroup:
    """A group of global ``ranks`` made by its members only, on the default store (see ``make_group``)."""
    return make_group(len(ranks), ranks.index(me), ranks, backend, _c10d._get_default_store(), name, timeout)


def make_group(
    size: int, rank: int, ranks: list[int], backend: object, store: Store, name: str, timeout: timedelta
) -> dist.ProcessGroup:
    """A group of ``backend`` named ``name`` (the default group's stand-in if ``ranks`` is empty), registered.

    ``_new_process_group_helper`` (2.10-2.15) makes and registers the group on ``store``;
    its global-to-group rank map is filled in here, as ``new_group`` does. Group names are
    ``GroupName``, a str subclass (plain str where a torch has none).
    """
    group_name = getattr(_c10d, "GroupName", str)(name)
    pg, _ = _c10d._new_process_group_helper(size, rank, ranks, backend, store, group_name, timeout=timeout)
    _c10d._world.pg_group_ranks[pg] = {g: i for i, g in enumerate(ranks or range(size))}
    return pg  # type: ignore[no-any-return]


def unregister_group(name: str) -> None:
    """Drop ``name`` from the C++ registry of groups (functional collectives resolve by it)."""
    _C._unregister_process_group(name)
