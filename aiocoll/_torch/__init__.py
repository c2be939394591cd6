"""Every use of a private torch name, in one place.

aiocoll is tested on torch ``TESTED[0]`` to ``TESTED[1]``. Each entry below says what it
relies on, which releases it covers and how it adapts; features are detected, versions
are never parsed. The rest of aiocoll imports torch's private names only from here.

A torch that breaks one of these assumptions fails with a ``TorchCompatError`` that
names the assumption and the tested range instead of a crash or wrong data: what every
world needs is checked at ``import aiocoll``; what torch.distributed worlds need, by
``check_c10d()`` when one starts; ``premul_factor`` checks at the call, before any data
moves. The helpers for real process groups (``default_group``, ``new_group_helper``,
``group_timeout``, ``allgather_into``, ``reduce_scatter_into``) call torch directly:
their names are bound by every release tested, and torch's own error would name them.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib
import inspect
import os
import sys
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from datetime import timedelta
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypeAlias

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d

from .. import _current
from .._errors import TorchCompatError
from .._patches import Attr, Change, Step

if TYPE_CHECKING:
    # c10d's option structs and stores, for annotations here and in the rest of aiocoll
    # (``torch.distributed`` does not re-export them all); the classes themselves are
    # looked up in ``options`` below
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
    from torch.testing._internal.common_distributed import MultiProcContinuousTest, MultiProcessTestCase
    from torch.testing._internal.distributed.multi_threaded_pg import ProcessLocalGroup, ThreadLocalWorld

    # what c10d hands a backend's creator (the extended API)
    DistributedBackendOptions: TypeAlias = _DistributedBackendOptions

# typed as Any: their stubs differ from release to release, and every use is checked here
_c10d: Any = torch.distributed.distributed_c10d
_C: Any = torch._C._distributed_c10d

__all__ = [
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
    "module_hooks",
    "new_group_helper",
    "op_schema_leak_fix",
    "options",
    "premul_factor",
    "prepare_for_rank_threads",
    "process_harness",
    "profiler_start",
    "python_process_group",
    "rank_devices",
    "reduce_scatter_into",
    "set_grad_enabled",
    "threaded_harness",
    "unregister_group",
    "watch_meshes",
]

TESTED = ("2.10", "2.15")
"""The oldest and newest torch releases aiocoll is tested on (CI runs both, and 2.13)."""


def _broken(what: str) -> TorchCompatError:
    return TorchCompatError(
        f"aiocoll relies on {what}, which torch {torch.__version__} does not provide; "
        f"aiocoll is tested on torch {TESTED[0]} to {TESTED[1]}"
    )


def _need(obj: object, name: str, what: str) -> Any:
    """``getattr(obj, name)``, or a TorchCompatError naming the assumption."""
    try:
        return getattr(obj, name)
    except AttributeError:
        raise _broken(what) from None


# -- plain private helpers (all releases) ---------------------------------------------

# Setting grad mode directly costs 0.2 us against 1.3 for torch.no_grad() (per op).
set_grad_enabled: Callable[[bool], None] = _need(torch._C, "_set_grad_enabled", "torch._C._set_grad_enabled")
# One kernel launch for many copies (the public loop of copy_ is 3x slower at W=64).
foreach_copy_: Callable[..., None] = _need(torch, "_foreach_copy_", "torch._foreach_copy_")


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


# -- process-wide lazy set-ups that must not first happen in rank threads -----------

_prepared = False


def prepare_for_rank_threads() -> None:
    """Do, once per process and from the calling thread, what crashes when rank threads race to it.

    - The autograd engine starts its device threads on the first backward, whatever
      the thread. On torch 2.10, when that was a rank thread after a DTensor world had
      run, the interpreter crashed (segmentation fault in ``Engine::start_device_threads``).
      A tiny backward here starts them.
    - ``FakeTensorMode`` (DTensor's sharding propagation, from ``parallelize_module``)
      installs a no-op CUDA device guard on its first use where CUDA is unavailable
      (``torch._C._ensureCUDADeviceGuardSet``). On torch 2.10's CUDA build without a GPU,
      rank threads doing that at once crashed in ``c10::impl::ensureCUDADeviceGuardSet``;
      done here first, their calls find it set. (See ``_install_cuda_guard`` for which
      thread installs it.)

    Costs about 0.1 ms, once, whatever the caller's grad mode.
    """
    global _prepared
    if _prepared:
        return
    # whatever grad mode the caller is in (torch.no_grad(), inference mode)
    with torch.inference_mode(False), torch.enable_grad():
        x = torch.ones(1, requires_grad=True)
        torch.autograd.backward((x * 2).sum())
    ensure_guard = getattr(torch._C, "_ensureCUDADeviceGuardSet", None)
    if ensure_guard is not None and not torch.cuda.is_available():
        _install_cuda_guard(ensure_guard)
    _prepared = True


def profiler_start() -> tuple[type, str]:
    """``(class, method name)`` of what starts a session of torch's profiler, one per process.

    ``torch.autograd.profiler.profile`` calls ``_prepare_trace`` as it is entered (only if
    enabled), and ``torch.profiler.profile`` (kineto's) through the one it holds, from
    ``start``: the same in 2.10-2.15.
    """
    from torch.autograd import profiler

    _need(profiler.profile, "_prepare_trace", "torch.autograd.profiler.profile._prepare_trace")
    return profiler.profile, "_prepare_trace"


def ddp_logging_data() -> tuple[type, str]:
    """``(class, method name)`` of what reads DDP's logging data (2.10-2.15): its C++ logger's
    view of the backend (its name, gloo's threads and transport), which torch's tests check."""
    ddp = torch.nn.parallel.DistributedDataParallel
    _need(ddp, "_get_ddp_logging_data", "DistributedDataParallel._get_ddp_logging_data")
    return ddp, "_get_ddp_logging_data"


# what DDP's C++ logger records of a group's backend, by its name (``Logger::set_env_variables``,
# 2.10-2.15): each field's environment variables, first set first ("N/A" when none is)
_DDP_BACKEND_FIELDS: dict[str, dict[str, tuple[str, ...]]] = {
    "nccl": {
        "nccl_socket_ifname": ("NCCL_SOCKET_IFNAME",),
        "nccl_blocking_wait": ("TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT"),
        "nccl_async_error_handling": ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING"),
        "nccl_debug": ("NCCL_DEBUG",),
        "nccl_nthreads": ("NCCL_NTHREADS",),
        "nccl_ib_timeout": ("NCCL_IB_TIMEOUT",),
    },
    "gloo": {"gloo_socket_ifname": ("GLOO_SOCKET_IFNAME",), "gloo_device_transport": ("GLOO_DEVICE_TRANSPORT",)},
}


def ddp_backend_logging(real: dist.ProcessGroup) -> dict[str, object]:
    """What DDP's logging data says of ``real``'s backend, as DDP on ``real`` itself would record it.

    Its name (``backend_name``), the environment variables its logger reads for that
    backend, and for gloo the number of threads of the group's gloo backend.
    """
    name = real.name()
    out: dict[str, object] = {"backend_name": name}
    for field, names in _DDP_BACKEND_FIELDS.get(name, {}).items():
        out[field] = next((os.environ[n] for n in names if n in os.environ), "N/A")
    if name == "gloo":
        gloo = backend_of(real, torch.device("cpu"))
        out["gloo_num_threads"] = int(gloo.options._threads)  # type: ignore[attr-defined]  # (pybind's)
    return out


def spawned_function(target: object, args: tuple[Any, ...]) -> object:
    """The function a ``torch.multiprocessing.spawn`` child runs, for a ``Process`` target of its
    private ``_wrap(fn, i, args, error_file)`` (2.10-2.15); any other ``target`` as it is."""
    # (the module: torch.multiprocessing's attribute of that name is its spawn function)
    spawn = importlib.import_module("torch.multiprocessing.spawn")
    wrap = getattr(spawn, "_wrap", None)
    return args[0] if wrap is not None and target is wrap and args else target


def _install_cuda_guard(ensure_guard: Callable[[], None]) -> None:
    """Install the no-op CUDA guard from a thread that lives as long as the process.

    torch 2.10 keeps the guard it installs in a ``thread_local`` of the installing
    thread (pytorch#178950): installed from a thread that then ends (a world run from a
    helper thread, as the pytest plugin and the process harness do), it is freed while
    torch still points at it, and the next ``FakeTensorMode`` crashes. The main thread
    installs it itself; any other caller hands it to a thread that never ends.
    """
    if threading.current_thread() is threading.main_thread():
        ensure_guard()
        return
    installed = threading.Event()

    def keeper() -> None:
        try:
            ensure_guard()
        finally:
            installed.set()
        threading.Event().wait()  # never set: the guard lives as long as the process

    threading.Thread(target=keeper, name="aiocoll CUDA guard keeper", daemon=True).start()
    installed.wait()


# -- torch.nn's process-wide module hooks ----------------------------------------------


class module_hooks:
    """The global module hooks of ``torch.nn`` (``register_module_forward_hook`` and the like).

    They are globals of ``torch.nn.modules.module`` (2.10-2.15): nine dicts and the flag
    ``_global_is_full_backward_hook``, read as module attributes at each use (there,
    and by dynamo). ``CommDebugMode`` and ``ModTracker`` register their hooks there;
    in one process with many ranks, each rank's tracker would see every rank's modules.
    Sync ranks taking turns swap them in and out (``_locals``): a state read here is
    what a rank had when it gave up its turn.
    """

    NAMES = (
        "_global_buffer_registration_hooks",
        "_global_module_registration_hooks",
        "_global_parameter_registration_hooks",
        "_global_backward_pre_hooks",
        "_global_backward_hooks",
        "_global_is_full_backward_hook",
        "_global_forward_pre_hooks",
        "_global_forward_hooks",
        "_global_forward_hooks_always_called",
        "_global_forward_hooks_with_kwargs",
    )

    # the module's namespace and the names it has, found at first use: read and write run
    # at every hand-over between sync ranks, where attribute calls cost 2.5 against 0.6 us
    _found: tuple[dict[str, object], tuple[str, ...]] | None = None

    @staticmethod
    def _namespace() -> tuple[dict[str, object], tuple[str, ...]]:
        found = module_hooks._found
        if found is None:
            from torch.nn.modules import module

            ns = vars(module)
            found = module_hooks._found = (ns, tuple(n for n in module_hooks.NAMES if n in ns))
        return found

    @staticmethod
    def read() -> dict[str, object]:
        """The hooks in force now (the objects themselves)."""
        ns, names = module_hooks._namespace()
        return {name: ns[name] for name in names}

    @staticmethod
    def copy(state: dict[str, object]) -> dict[str, object]:
        """A state with the same hooks in new containers (what a forked process starts with)."""
        return {name: type(v)(v) if isinstance(v, dict) else v for name, v in state.items()}

    @staticmethod
    def write(state: dict[str, object]) -> None:
        """Put ``state`` in force (a module's globals: setting them in its namespace is setattr)."""
        module_hooks._namespace()[0].update(state)


# -- what torch frees as a thread exits ------------------------------------------------

# DTensor's C++ fast path (2.10-2.15, torch/csrc/autograd/python_variable.cpp) keeps a
# sharding-propagation cache per thread and frees it through a capsule under this key of
# the thread's state dict
_DTENSOR_THREAD_CACHE = "__DTensor_fastpath_thread_cache_cleanup"
# a function pointer of our own (pythonapi's attributes are shared); it returns a borrowed
# reference, which a py_object restype would release once too often: take it as a pointer
_GetDict = ctypes.PYFUNCTYPE(ctypes.c_void_p)(("PyThreadState_GetDict", ctypes.pythonapi))
_drop_lock = threading.Lock()


def _thread_state_dict() -> dict[str, object] | None:
    """The calling thread's state dict (``PyThreadState_GetDict``), or None."""
    ptr = _GetDict()
    return None if not ptr else ctypes.cast(ptr, ctypes.py_object).value


def drop_thread_caches() -> None:
    """Free now, in the calling thread, the per-thread caches torch frees when a thread exits.

    Freeing DTensor's per-thread cache takes a C++ mutex, then the GIL (its entries hold
    Python objects). Threads that exit at once, as a world's rank threads do, can
    deadlock there: one holds the GIL and waits for the mutex, the other holds the
    mutex and waits for the GIL (seen as 1 run in about 10 of a DTensor test file on
    torch 2.10, in ``PyThreadState_Clear`` of two exiting ranks). A rank thread calls this
    before it ends; the lock, which waits without the GIL, makes threads that call it at
    once free theirs one at a time. A thread that uses DTensor again gets a new cache.
    """
    state = _thread_state_dict()
    if state is None or _DTENSOR_THREAD_CACHE not in state:
        return
    with _drop_lock:
        state.pop(_DTENSOR_THREAD_CACHE, None)


# -- what torch's process-wide caches keep for a world's meshes -----------------------

# DTensor's caches whose entries hold meshes (2.10-2.15: found by counting what grows
# over many worlds, tests/test_belongings.py). Every mesh keeps its groups, so each
# entry would keep a world that ended alive for as long as the process lives (about
# 2,400 objects a world on 2.10, 8,600 on 2.15, for a program using DTensor, FSDP2, TP
# and DCP). Each is (module, attribute path); an entry a torch lacks is skipped.
# functools caches, keyed by DTensor specs or meshes; they cannot drop one key, so they
# are cleared whole: other worlds' entries are simply made again (a plan, a topology)
_MESH_FUNCTION_CACHES = (
    ("torch.distributed.tensor._redistribute", "_gen_transform_infos"),
    ("torch.distributed.tensor._collective_utils", "MeshTopoInfo.build_from_mesh"),
)
# dicts keyed by (weakref to a mesh, ...): only the world's entries go
_MESH_KEYED_DICTS = (("torch.distributed.tensor._redistribute", "_planner_cache"),)


def _loaded(module: str, path: str) -> object:
    """``module.path`` if ``module`` is imported (never imports it) and has it, else None."""
    obj: object = sys.modules.get(module)
    for name in path.split("."):
        obj = getattr(obj, name, None)
    return obj


def drop_mesh_caches(meshes: Sequence[object]) -> None:
    """Drop what DTensor's process-wide caches keep for ``meshes`` (of a world that ended).

    The meshes must be alive (the caller holds them) so that entries can be matched.
    """
    for module, path in _MESH_FUNCTION_CACHES:
        cache_clear = getattr(_loaded(module, path), "cache_clear", None)
        if callable(cache_clear):
            cache_clear()
    ids = {id(m) for m in meshes}
    for module, path in _MESH_KEYED_DICTS:
        table = _loaded(module, path)
        if not isinstance(table, dict):
            continue
        for key in list(table):
            first = key[0] if isinstance(key, tuple) and key else None
            mesh = first() if isinstance(first, weakref.ref) else first
            if mesh is None or id(mesh) in ids:
                table.pop(key, None)


@functools.cache
def pins_dtensor_specs() -> bool:
    """Whether this torch keeps every DTensorSpec an OpSchema hashes alive for good.

    torch 2.10 to 2.12 leak one reference per OpSchema built (pytorch#181761, fixed by
    pytorch#181792), in any process. Measured by hashing one with torch's own C function,
    as torch's regression test does (``OPSCHEMA_LEAK`` undoes it while worlds run).
    """
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor._op_schema import OpSchema

    spec = DTensorSpec(mesh=None, placements=(), tensor_meta=None)  # type: ignore[arg-type]
    ref = weakref.ref(spec)
    schema = OpSchema(op=torch.ops.aten.add.Tensor, args_schema=(spec,), kwargs_schema={})
    torch._C._DTensor_OpSchema_recompute_comparison_key(schema)  # (torch's own, whatever replaces its name)
    del spec, schema
    return ref() is not None


_OP_SCHEMA = "torch.distributed.tensor._op_schema"
# the C functions that hash an OpSchema, by the names its module calls them by (2.10-2.15)
_OP_SCHEMA_HASHERS = ("_DTensor_OpSchema_post_init", "_DTensor_OpSchema_recompute_comparison_key")


def op_schema_leak_fix() -> list[Attr]:
    """Changes that undo torch's leak of one reference per OpSchema hashed (pytorch#181761), where it has it.

    torch 2.10 to 2.12 build each OpSchema's comparison key ``(op, args)`` with
    ``PyTuple_Pack(2, op, args.release().ptr())``: the fresh ``args`` tuple gets one
    reference too many, and every DTensorSpec and mesh in it stays for good. After torch's
    function returns, the key's ``args`` holds exactly that one reference too many (one
    for the key, one leaked; nothing else has seen the fresh tuple): it is given back.
    Only then: a count that says anything else (another branch, a torch without the bug,
    an interpreter that counts differently) leaves the key alone. Nothing where the
    module is not loaded (a world without DTensor), nor on a torch without the leak.
    """
    module = sys.modules.get(_OP_SCHEMA)
    if module is None or not pins_dtensor_specs():
        return []
    return [
        Attr(module, name, _unleaking(getattr(module, name))) for name in _OP_SCHEMA_HASHERS if hasattr(module, name)
    ]


def _unleaking(real: Callable[[object], None]) -> Callable[[object], None]:
    # (a prototype of its own: ctypes.pythonapi's function objects are shared with other code)
    decref = ctypes.PYFUNCTYPE(None, ctypes.py_object)(("Py_DecRef", ctypes.pythonapi))

    @functools.wraps(real)
    def hash_schema(schema: object) -> None:
        real(schema)
        key = getattr(schema, "_comparison_key", None)
        # (the key's reference, the leaked one, and getrefcount's own argument: 3)
        if type(key) is tuple and len(key) == 2 and type(key[1]) is tuple and key[1] and sys.getrefcount(key[1]) == 3:
            decref(key[1])

    return hash_schema


# -- per-rank c10d state --------------------------------------------------------------

_World: type = _need(_c10d, "_World", "distributed_c10d._World (c10d's state object)")
# the properties of _World that read module globals; the rest keep state per instance
_GLOBAL_PROPERTIES = ("pg_map", "pg_names", "pg_group_ranks", "pg_backend_config", "tags_to_pg", "pg_to_tag")


def _own_map(name: str) -> property:
    """A map kept on the state object, where torch reads a module global."""

    def get(self: C10dState) -> dict[object, object]:
        return self._maps[name]

    return property(get)


class C10dState(_World):  # type: ignore[misc]
    """torch's ``_World`` with all of its state per instance (torch keeps part in globals).

    Every release 2.10-2.15 reads the six maps and ``group_count`` from module globals
    and keeps the rest (default group, coalescing state, comms, flight-recorder hooks)
    on the instance; ``check_c10d()`` verifies that of the torch at hand.
    """

    def __init__(self) -> None:
        super().__init__()
        self._maps: dict[str, dict[object, object]] = {name: {} for name in _GLOBAL_PROPERTIES}
        self._group_count = 0

    pg_map = _own_map("pg_map")
    pg_names = _own_map("pg_names")
    pg_group_ranks = _own_map("pg_group_ranks")
    pg_backend_config = _own_map("pg_backend_config")
    tags_to_pg = _own_map("tags_to_pg")
    pg_to_tag = _own_map("pg_to_tag")

    @property
    def group_count(self) -> int:
        return self._group_count

    @group_count.setter
    def group_count(self, value: int) -> None:
        self._group_count = value

    def clear(self) -> None:
        """Forget every group (torch's objects stay alive only where referenced elsewhere)."""
        for d in self._maps.values():
            d.clear()
        self.pg_coalesce_state.clear()
        self.default_pg = None


def _rank_state() -> C10dState | None:
    """The calling rank's torch.distributed state (its ``RankState.c10d``), if it has one."""
    rank = _current.RANK.get()
    return None if rank is None else rank.c10d


class _StateProxy(_current.StandIn):
    """Stands in for ``distributed_c10d._world``: the current rank's state (``RankState.c10d``), else torch's.

    (``StandIn``'s ``__getattribute__`` rather than a ``__getattr__``: it spares the
    failed own lookup, and its AttributeError, on each of torch's reads, about three per
    collective.)
    """

    __slots__ = ("_aiocoll_process",)
    _aiocoll_own = _current.PerRank(_rank_state)

    def __init__(self, fallback: object) -> None:
        object.__setattr__(self, "_aiocoll_process", fallback)


_checked: str | None = None


def check_c10d() -> None:
    """Verify what the per-rank state and patches rely on; raise TorchCompatError if not."""
    global _checked
    if _checked == torch.__version__:
        return
    a, b = C10dState(), C10dState()
    for name in dir(_World):
        prop = getattr(_World, name, None)
        if not isinstance(prop, property) or name == "pg_config_info":  # pg_config_info derives from pg_map
            continue
        va, vb = getattr(a, name), getattr(b, name)
        if isinstance(va, (dict, list, set)) and va is vb:
            raise _broken(
                f"every map of distributed_c10d._World being per instance or one of {_GLOBAL_PROPERTIES} "
                f"({name!r} is shared)"
            )
    for mod, name, what in (
        (_C, "_set_thread_isolation_mode", "torch._C._distributed_c10d._set_thread_isolation_mode"),
        (_C, "_unregister_process_group", "torch._C._distributed_c10d._unregister_process_group"),
        (_c10d, "_process_group_name", "distributed_c10d._process_group_name (how groups are named)"),
        (_c10d, "_world", "distributed_c10d._world (c10d's state)"),
    ):
        _need(mod, name, what)
    _checked = torch.__version__


def watch_meshes(mesh_made: Callable[[DeviceMesh], int | None]) -> Attr:
    """The change that shows every ``DeviceMesh`` built while it is in force to ``mesh_made``.

    A mesh's ``_thread_id`` (2.10-2.15: what tells meshes of different ranks apart in
    DTensor's caches, set per thread only for torch's "threaded" backend) becomes what
    ``mesh_made(mesh)`` returns, unless None.
    """
    from torch.distributed import device_mesh

    mesh_cls = device_mesh.DeviceMesh
    saved = vars(mesh_cls)["__init__"]

    @functools.wraps(saved)
    def mesh_init(self: DeviceMesh, *args: object, **kwargs: object) -> None:
        saved(self, *args, **kwargs)
        ident = mesh_made(self)
        if ident is not None:
            self._thread_id = ident

    return Attr(mesh_cls, "__init__", mesh_init)


# whether the calling thread chose its CUDA device, as a process does once (a rank's thread is its own)
_DEVICE_CHOSEN = _current.Facet("CUDA device chosen", False, carried=False)


class _RankCuda:
    """``torch.cuda`` as ``DeviceMesh`` sees it from a sync rank's thread.

    DeviceMesh sets the process's CUDA device (to ``LOCAL_RANK``, else the rank modulo
    the GPUs) only "if the user has not set it", which it reads as
    ``torch.cuda.is_initialized()`` (2.10-2.15: ``_setup_world_group_and_device``): a
    fact of the process. In one process the first rank to touch CUDA initialises it for
    all, and every other rank would stay on cuda:0. CUDA's current device is per thread,
    as it is per process under torchrun, so the question goes to the rank: it has set its
    device if it chose one (``set_device``) or is on a device other than 0.
    """

    __slots__ = ("_cuda",)

    def __init__(self, cuda: ModuleType) -> None:
        self._cuda = cuda

    def __getattr__(self, name: str) -> object:
        return getattr(self._cuda, name)

    def is_initialized(self) -> bool:
        cuda = self._cuda
        # (current_device() would initialise CUDA: asked only once it is)
        return bool(cuda.is_initialized()) and (_DEVICE_CHOSEN.get() or cuda.current_device() != 0)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} of {self._cuda.__name__}>"


def rank_devices(own_device: Callable[[], bool]) -> list[Attr]:
    """The changes that let ``DeviceMesh`` set each sync rank's CUDA device as it would a process's.

    ``own_device()`` says whether the caller is a rank with a thread of its own (whose
    current CUDA device is its own). See ``_RankCuda``; choices are noted through
    ``torch.cuda.set_device`` and ``torch.accelerator.set_device_index`` while in force.
    """
    from torch.distributed import device_mesh

    out: list[Attr] = []
    real_handle = getattr(device_mesh, "_get_device_handle", None)  # (absent without torch.distributed)
    if real_handle is not None:

        @functools.wraps(real_handle)
        def device_handle(device_type: str = "cuda") -> object:
            handle = real_handle(device_type)
            return _RankCuda(handle) if handle is torch.cuda and own_device() else handle

        out.append(Attr(device_mesh, "_get_device_handle", device_handle))

    def noting(real: Callable[..., None]) -> Callable[..., None]:
        @functools.wraps(real)
        def choose(*args: object, **kwargs: object) -> None:
            real(*args, **kwargs)
            _DEVICE_CHOSEN.set(True)

        return choose

    for module, name in ((torch.cuda, "set_device"), (getattr(torch, "accelerator", None), "set_device_index")):
        real = getattr(module, name, None)
        if real is not None:
            out.append(Attr(module, name, noting(real)))
    return out


# what c10d_changes may change (the patch set's declared targets)
C10D_TARGETS = (
    "sys.excepthook",
    "torch.distributed.monitored_barrier",
    "torch.distributed.distributed_c10d.monitored_barrier",
    "torch.distributed.distributed_c10d._world",
    "torch.distributed.distributed_c10d._process_group_name",
    "torch.distributed.distributed_c10d._WorldMeta.WORLD",
    "torch._C._distributed_c10d._set_thread_isolation_mode",
    "torch.distributed.*DeviceMesh.__init__",
    "torch.distributed.device_mesh._get_device_handle",
    "torch.cuda.set_device",
    "torch.accelerator.set_device_index",
    "torch.*Store.__init__",  # (FileStore, TCPStore, HashStore, PrefixStore: their module varies by release)
)


def c10d_changes(
    name_suffix: Callable[[], str | None],
    mesh_made: Callable[[DeviceMesh], int | None],
    is_own: Callable[[dist.ProcessGroup], bool] = lambda pg: False,
    store_made: Callable[[Store], None] = lambda store: None,
    store_making: Callable[[], AbstractContextManager[object]] = contextlib.nullcontext,
    own_device: Callable[[], bool] = lambda: False,
) -> list[Change]:
    """The changes that give torch.distributed per-rank state (a patch set's, in order).

    - ``distributed_c10d._world`` becomes a proxy for the state of the rank the calling
      thread or task acts for (``RankState.c10d``) (torch's own outside any rank).
    - The C++ registry of groups by name (functional collectives) is per thread
      (``_set_thread_isolation_mode``, 2.10+); ranks that share a thread get names made
      unique by ``name_suffix()``.
    - ``DeviceMesh`` tells meshes of different ranks apart by ``_thread_id`` only for
      torch's "threaded" backend; every mesh built gets ``mesh_made(mesh)`` (None: left as is).
    - ``group.WORLD`` (``GroupMember.WORLD``) read by the module-level or class-body
      code of a module being imported is the process's own default group, not the
      importing rank's: a module is imported once for every rank, and what it binds
      then (``def all_reduce(tensor, group=group.WORLD)`` in
      ``torch.distributed.nn.functional``, the ZeroRedundancyOptimizer, FSDP's grad
      scaler) serves them all, and outlives the world. A script run as ``__main__`` is
      not being imported: it sees its rank's group.
    - Every store made (``FileStore``, ``TCPStore``, ``HashStore``, ``PrefixStore``) is
      shown to ``store_made``, so that the world can release it when it ends; its
      constructor runs inside ``store_making()`` (a ``TCPStore``'s waits for its clients,
      or for its server).
    - ``init_process_group`` wraps ``sys.excepthook`` per rank; the original comes back.
    - ``DeviceMesh`` sets a CUDA device for a rank ``own_device()`` (a thread of its own)
      when that rank has not chosen one, rather than when the process has not
      initialised CUDA (``rank_devices``).
    - ``monitored_barrier`` on a group ``is_own`` calls the group's own: torch 2.15 first
      asks the group for a CPU backend of its own, which a Python process group does not
      register (it has none: it is its own backend).
    """
    check_c10d()
    saved_world, saved_hook, saved_name = _c10d._world, sys.excepthook, _c10d._process_group_name

    def process_group_name(ranks: list[int], use_hashed_name: bool) -> str:
        name: str = saved_name(ranks, use_hashed_name)
        suffix = name_suffix()
        return name if suffix is None else type(name)(f"{name}{suffix}")

    meta = type(_c10d.group)  # _WorldMeta (2.10-2.15): group.WORLD is a property of it
    saved_world_prop = meta.__dict__["WORLD"]

    def world_get(cls: type) -> object:
        caller = sys._getframe(1)
        if not caller.f_code.co_flags & inspect.CO_OPTIMIZED:  # module or class body code, not a function's
            spec = caller.f_globals.get("__spec__")
            if getattr(spec, "_initializing", False):  # (importlib sets it while the module runs)
                return saved_world.default_pg
        return _c10d._world.default_pg

    d: Any = dist  # (its stubs do not export the store classes)
    stores = [cls for cls in (d.FileStore, d.TCPStore, d.HashStore, d.PrefixStore) if "__init__" in vars(cls)]
    saved_store_inits = [vars(cls)["__init__"] for cls in stores]

    def store_init(real: Callable[..., None]) -> Callable[..., None]:
        @functools.wraps(real)
        def init(self: Store, *args: object, **kwargs: object) -> None:
            with store_making():
                real(self, *args, **kwargs)
            store_made(self)

        return init

    saved_barrier = _c10d.monitored_barrier

    @functools.wraps(saved_barrier)
    def monitored_barrier(
        group: Any = None, timeout: timedelta | float | None = None, wait_all_ranks: bool = False
    ) -> object:
        pg = group if group is not None else _c10d._get_default_group() if _c10d.is_initialized() else None
        if pg is not None and is_own(pg):
            return pg.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)
        return saved_barrier(group, timeout, wait_all_ranks)

    def isolation() -> Callable[[], None]:
        _C._set_thread_isolation_mode(True)
        return lambda: _C._set_thread_isolation_mode(False)

    # (torch's init_process_group wraps the hook per rank: what was there comes back, whatever it became)
    changes: list[Change] = [Attr(sys, "excepthook", saved_hook, restore="always")]
    modules: tuple[Any, ...] = (_c10d, dist)
    for module in modules:
        if getattr(module, "monitored_barrier", None) is saved_barrier:
            changes.append(Attr(module, "monitored_barrier", monitored_barrier))
    changes += [
        Attr(_c10d, "_world", _StateProxy(saved_world)),
        Step("torch._C._distributed_c10d._set_thread_isolation_mode", isolation),
        Attr(_c10d, "_process_group_name", process_group_name),
        watch_meshes(mesh_made),
        *rank_devices(own_device),
        Attr(meta, "WORLD", property(world_get, saved_world_prop.fset)),
    ]
    changes += [Attr(cls, "__init__", store_init(real)) for cls, real in zip(stores, saved_store_inits, strict=True)]
    return changes


# -- torch's threaded test harness (torch.testing._internal) -------------------------


def _per_thread(name: str, kind: type) -> property:
    """A ThreadLocalWorld property: a ``kind()`` kept on the calling thread's world data."""

    def get(self: ThreadLocalWorld) -> object:
        world = self._get_world()
        if not hasattr(world, name):
            setattr(world, name, kind())
        return getattr(world, name)

    return property(get)


class threaded_harness:
    """What ``aiocoll.testing`` replaces in torch's threaded test harness (all releases)."""

    MODULE = "torch.testing._internal.common_distributed"
    PLUGIN_KEY = "THREADED"  # backend "threaded"'s key in torch's plugin table
    PLUGINS = "torch.distributed.Backend._plugins"  # (how the table is named in reports)

    @staticmethod
    def process_local_group() -> type[ProcessLocalGroup]:
        """torch's threaded ProcessGroup class (importing it registers backend "threaded")."""
        from torch.testing._internal.distributed.multi_threaded_pg import ProcessLocalGroup

        return ProcessLocalGroup

    @staticmethod
    def mend_thread_local_world() -> list[Attr]:
        """The changes that give torch's ``ThreadLocalWorld`` the ``_World`` properties it lacks.

        torch 2.11 added ``_World.comms`` (read by ``destroy_process_group``) but not to
        the harness's thread-local stand-in: every harness test failed there with
        "'ThreadLocalWorld' object has no attribute 'comms'", with aiocoll or without.
        Each added property keeps a fresh container per thread, as torch 2.12 does.
        """
        from torch.testing._internal.distributed.multi_threaded_pg import ThreadLocalWorld

        fresh = _World()
        added = []
        for name in dir(_World):
            held = vars(fresh).get(f"_{name}")  # state a _World keeps on the instance (not derived)
            if held is None or hasattr(ThreadLocalWorld, name):
                continue
            if not isinstance(held, (list, dict, set)):
                raise _broken(f"torch.testing's ThreadLocalWorld having every property of _World ({name!r})")
            added.append(Attr(ThreadLocalWorld, name, _per_thread(name, type(held))))
        return added

    @staticmethod
    def plugins() -> dict[str, object]:
        """c10d's table of backend plugins (name -> creator)."""
        table: dict[str, object] = _need(dist.Backend, "_plugins", threaded_harness.PLUGINS)
        return table

    @staticmethod
    def plugin(creator: Callable[..., dist.ProcessGroup]) -> object:
        """A plugin entry for ``creator`` taking the extended API."""
        return _need(dist.Backend, "_BackendPlugin", "torch.distributed.Backend._BackendPlugin")(creator, True)


class process_harness:
    """What ``aiocoll.testing`` hooks in torch's multi-process test harness (2.10-2.15).

    ``MultiProcessTestCase`` starts one process per rank in ``_start_processes(proc)``
    and waits for them in ``_join_processes(fn)``, which ends with
    ``_check_return_codes(fn, elapsed)``; each process runs ``cls._run(rank, test_name,
    file_name, pipe, **kwargs)``, which makes a new test object and calls ``run_test``:
    a ``unittest.SkipTest`` becomes ``sys.exit(TEST_SKIPS["generic"].exit_code)``, an
    exception is sent down the pipe and becomes ``sys.exit(TEST_ERROR_EXIT_CODE)``.
    ``MultiProcContinuousTest`` keeps its processes across a class's tests: its
    classmethod ``_spawn_processes(world_size)`` makes ``processes``, ``task_queues``
    and ``completion_queues``; each worker runs ``cls._worker_loop(rank, world_size,
    rdvz_file, task_queue, completion_queue)``, which takes test ids from its task
    queue until ``None`` and puts a result per test (the id, a ``SkipTest`` or an
    exception). These names are the same in every release tested.
    """

    MODULE = "torch.testing._internal.common_distributed"

    @staticmethod
    def module() -> ModuleType:
        import torch.testing._internal.common_distributed as common_distributed

        return common_distributed

    @staticmethod
    def test_case() -> type[MultiProcessTestCase]:
        """``MultiProcessTestCase``, checked for every hook ``aiocoll.testing`` relies on."""
        cls: type[MultiProcessTestCase] = _need(
            process_harness.module(), "MultiProcessTestCase", "MultiProcessTestCase"
        )
        for name in (
            "_start_processes",
            "_join_processes",
            "_check_return_codes",
            "_run",
            "run_test",
            "_current_test_name",
            "TEST_ERROR_EXIT_CODE",
        ):
            _need(cls, name, f"MultiProcessTestCase.{name}")
        return cls

    @staticmethod
    def continuous_test_case() -> type[MultiProcContinuousTest] | None:
        """``MultiProcContinuousTest``, if this torch has it (checked like ``test_case``), else None."""
        cls: type[MultiProcContinuousTest] | None = getattr(process_harness.module(), "MultiProcContinuousTest", None)
        if cls is not None:
            for name in ("_spawn_processes", "_worker_loop"):
                _need(cls, name, f"MultiProcContinuousTest.{name}")
        return cls

    @staticmethod
    def skips() -> dict[int, str]:
        """The exit codes torch's harness turns into skips, with their messages."""
        table = _need(process_harness.module(), "TEST_SKIPS", "common_distributed.TEST_SKIPS")
        return {int(s.exit_code): str(s.message) for s in table.values()}

    @staticmethod
    def generic_skip_code() -> int:
        """The exit code of a rank whose test raised ``unittest.SkipTest``."""
        return int(_need(process_harness.module(), "TEST_SKIPS", "common_distributed.TEST_SKIPS")["generic"].exit_code)

    @staticmethod
    def test_timeout(test_id: str) -> float:
        """Seconds torch's harness gives the test before it stops its processes."""
        return float(_need(process_harness.module(), "get_timeout", "common_distributed.get_timeout")(test_id))

    SUITE = "torch.testing._internal.distributed.distributed_test"

    @staticmethod
    def suite_barrier(
        sync: Callable[[Callable[[int | None, float], None], int | None, float], None],
    ) -> list[tuple[object, str, object]]:
        """``(owner, name, replacement)`` for the barrier of torch's own multi-process suite, if it is loaded.

        ``distributed_test.py`` (the tests ``test_distributed_spawn.py`` runs, shipped in
        the wheel) makes its ranks meet before and after each test in ``Barrier.sync(wait_for=None,
        timeout=10)``, a classmethod: each process counts its barriers in a class attribute
        and writes the count to a file named by its pid, which ranks of one process share.
        ``sync(real, wait_for, timeout)`` runs instead, ``real(wait_for, timeout)`` being
        torch's (for threads outside a harness rank). Nothing where the module is not loaded
        (the suite is not being run).
        """
        barrier = getattr(sys.modules.get(process_harness.SUITE), "Barrier", None)
        real = None if barrier is None else barrier.__dict__.get("sync")
        if not isinstance(real, classmethod):
            return []
        fn = real.__func__

        def patched(cls: type, wait_for: int | None = None, timeout: float = 10) -> None:
            sync(lambda w, t: fn(cls, w, t), wait_for, timeout)

        functools.update_wrapper(patched, fn)
        return [(barrier, "sync", classmethod(patched))]

    INIT_TARGETS = (
        "torch.distributed.distributed_c10d._new_process_group_helper",
        "torch.distributed.distributed_c10d.rendezvous",
    )

    @staticmethod
    def init_changes(
        group_backend: Callable[[object, int, list[int]], str | None],
        rendezvous: Callable[[str, int, int], tuple[Store, int, int] | None],
    ) -> list[Attr]:
        """The changes that steer torch.distributed's group creation and rendezvous (``INIT_TARGETS``).

        ``group_backend(backend, group_rank, global_ranks_in_group)``, for every group
        c10d makes (the default group, ``new_group``, DeviceMesh's): the backend to make
        it with instead, or None to leave it. The group still reports the backend it was
        asked for (``dist.get_backend``), as torch's code branches on it.
        ``rendezvous(init_method, rank, world_size)``: ``(store, rank, world_size)`` in
        place of torch's rendezvous for ``init_process_group(init_method=...)``, or None.
        Both are module globals of ``distributed_c10d`` looked up at each call (2.10-2.15).
        """
        saved_helper = _need(_c10d, "_new_process_group_helper", "distributed_c10d._new_process_group_helper")
        saved_rendezvous = _need(_c10d, "rendezvous", "distributed_c10d.rendezvous")
        backend_at = list(inspect.signature(saved_helper).parameters).index("backend")

        @functools.wraps(saved_helper)
        def helper(*args: Any, **kwargs: Any) -> Any:
            asked = kwargs["backend"] if "backend" in kwargs else args[backend_at]
            group_rank = kwargs.get("group_rank", args[1] if len(args) > 1 else -1)
            ranks = kwargs.get("global_ranks_in_group", args[2] if len(args) > 2 else [])
            use = group_backend(asked, group_rank, list(ranks))
            if use is None:
                return saved_helper(*args, **kwargs)
            if "backend" in kwargs:
                kwargs["backend"] = use
            else:
                args = (*args[:backend_at], use, *args[backend_at + 1 :])
            kwargs["backend_options"] = None  # gloo's or NCCL's options mean nothing to it
            pg, store = saved_helper(*args, **kwargs)
            world = _c10d._world
            if pg in world.pg_map:
                world.pg_map[pg] = (asked, world.pg_map[pg][1])
            report = getattr(pg, "report_backend", None)  # (pg.name(), as torch reads it)
            if report is not None:
                report(asked)
            return pg, store

        @functools.wraps(saved_rendezvous)
        def steered_rendezvous(
            url: str, rank: int = -1, world_size: int = -1, **kwargs: object
        ) -> Iterator[tuple[Store, int, int]]:
            found = rendezvous(url, rank, world_size)
            if found is None:
                torchs: Iterator[tuple[Store, int, int]] = saved_rendezvous(url, rank, world_size, **kwargs)
                return torchs
            return iter([found])

        return [Attr(_c10d, "_new_process_group_helper", helper), Attr(_c10d, "rendezvous", steered_rendezvous)]


# -- torch's Flight Recorder analyzer (``aiocoll._diagnostics._frdump`` writes dumps it reads) ------------------


@functools.cache
def fr_format_version() -> str:
    """The dump format version this torch's own Flight Recorder writes ("2.10" on 2.10-2.15).

    ``_dump_fr_trace`` (2.10-2.15) returns a pickled, empty dump when nothing is recorded;
    the analyzer checks that every rank's file carries the same version string.
    """
    import pickle

    try:
        dump = pickle.loads(_C._dump_fr_trace(includeCollectives=False, includeStackTraces=False, onlyActive=True))
        version = dump["version"]
    except (AttributeError, RuntimeError, TypeError, KeyError, pickle.UnpicklingError):
        return "2.10"
    return str(version)


@functools.cache
def fr_accepts(profiling_name: str) -> bool:
    """Whether this torch's ``fr_trace`` parses an entry named ``profiling_name``.

    Its ``Op`` class (2.10-2.15) names what it reads: 2.10 knows the "nccl" and "xccl"
    libraries only and no "barrier"; a recv from any source ("recv 1<-?") parses from
    2.15 on. An entry it cannot parse would stop the whole analysis, so aiocoll asks first.
    """
    try:
        from torch.distributed.flight_recorder.components.types import Op
    except ImportError:
        return profiling_name.startswith("nccl:")
    event = {
        "profiling_name": profiling_name,
        "state": "scheduled",
        "process_group": ("0", "undefined"),
        "input_sizes": [[1]],
        "output_sizes": [[1]],
        "input_dtypes": ["Float"],
        "output_dtypes": ["Float"],
        "collective_seq_id": 0,
        "p2p_seq_id": 0,
        "time_created_ns": 0,
    }
    try:
        Op(event, {"0": {0, 1}}, "0")
    except (AssertionError, ValueError, IndexError, KeyError):
        return False
    return True
