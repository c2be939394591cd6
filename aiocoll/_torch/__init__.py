"""Every use of a private torch name, in one package: a module per torch surface.

aiocoll is tested on torch ``TESTED[0]`` to ``TESTED[1]``. Each entry says what it
relies on, which releases it covers and how it adapts; features are detected, versions
are never parsed. The rest of aiocoll imports torch's private names only from here,
through this face (``from .. import _torch``, then ``_torch.name``).

A torch that breaks one of these assumptions fails with a ``TorchCompatError`` that
names the assumption and the tested range instead of a crash or wrong data: what every
world needs is checked at ``import aiocoll`` (importing this package imports every
module in it); what torch.distributed worlds need, by ``check_c10d()`` when one starts;
``premul_factor`` checks at the call, before any data moves. The helpers for real
process groups (``default_group``, ``new_group_helper``, ``group_timeout``,
``allgather_into``, ``reduce_scatter_into``) call torch directly: their names are bound
by every release tested, and torch's own error would name them.

The modules, one surface each: ``_compat`` (the tested range, ``TorchCompatError``'s
message), ``_core`` (grad mode, set-ups before rank threads), ``_groups`` (c10d's
process groups and options), ``_c10dstate`` (c10d's state per rank), ``_dtensor``
(DTensor's and DeviceMesh's caches), ``_cuda`` (CUDA devices per rank), ``_perprocess``
(module hooks, profiler, DDP logging, multiprocessing spawn), ``_harness`` (torch's
test harnesses), ``_flightrec`` (the Flight Recorder's format). Their state (what was
checked, what was prepared) lives in the module that reads it: a test that changes it
changes it there, not here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeAlias

from ._c10dstate import C10D_TARGETS, C10dState, c10d_changes, check_c10d
from ._compat import TESTED
from ._core import foreach_copy_, prepare_for_rank_threads, set_grad_enabled, version_of
from ._cuda import rank_devices
from ._dtensor import drop_mesh_caches, drop_thread_caches, op_schema_leak_fix, pins_dtensor_specs, watch_meshes
from ._flightrec import fr_accepts, fr_format_version
from ._groups import (
    PREMUL_SUM_FACTOR,
    allgather_into,
    backend_of,
    default_group,
    default_store,
    group_timeout,
    make_group,
    new_group_helper,
    options,
    premul_factor,
    python_process_group,
    reduce_scatter_into,
    unregister_group,
)
from ._harness import process_harness, threaded_harness
from ._perprocess import ddp_backend_logging, ddp_logging_data, module_hooks, profiler_start, spawned_function

if TYPE_CHECKING:
    # c10d's option structs and stores, for annotations in the rest of aiocoll
    # (``torch.distributed`` does not re-export them all); the classes themselves are
    # looked up in ``options`` (``_groups``)
    from torch._C._distributed_c10d import AllgatherOptions as AllgatherOptions
    from torch._C._distributed_c10d import AllreduceOptions as AllreduceOptions
    from torch._C._distributed_c10d import AllToAllOptions as AllToAllOptions
    from torch._C._distributed_c10d import Backend as Backend
    from torch._C._distributed_c10d import BarrierOptions as BarrierOptions
    from torch._C._distributed_c10d import BroadcastOptions as BroadcastOptions
    from torch._C._distributed_c10d import GatherOptions as GatherOptions
    from torch._C._distributed_c10d import ReduceOptions as ReduceOptions
    from torch._C._distributed_c10d import ReduceScatterOptions as ReduceScatterOptions
    from torch._C._distributed_c10d import ScatterOptions as ScatterOptions
    from torch._C._distributed_c10d import Store as Store
    from torch._C._distributed_c10d import _DistributedBackendOptions
    from torch.distributed.device_mesh import DeviceMesh as DeviceMesh

    # torch's test harnesses' base classes, for annotations in the harness drop-ins
    from torch.testing._internal.common_distributed import MultiProcContinuousTest as MultiProcContinuousTest
    from torch.testing._internal.common_distributed import MultiProcessTestCase as MultiProcessTestCase

    # what c10d hands a backend's creator (the extended API)
    DistributedBackendOptions: TypeAlias = _DistributedBackendOptions

__all__ = [
    "C10D_TARGETS",
    "PREMUL_SUM_FACTOR",
    "TESTED",
    "C10dState",
    "allgather_into",
    "backend_of",
    "c10d_changes",
    "check_c10d",
    "ddp_backend_logging",
    "ddp_logging_data",
    "default_group",
    "default_store",
    "drop_mesh_caches",
    "drop_thread_caches",
    "foreach_copy_",
    "fr_accepts",
    "fr_format_version",
    "group_timeout",
    "make_group",
    "module_hooks",
    "new_group_helper",
    "op_schema_leak_fix",
    "options",
    "pins_dtensor_specs",
    "premul_factor",
    "prepare_for_rank_threads",
    "process_harness",
    "profiler_start",
    "python_process_group",
    "rank_devices",
    "reduce_scatter_into",
    "set_grad_enabled",
    "spawned_function",
    "threaded_harness",
    "unregister_group",
    "version_of",
    "watch_meshes",
]
