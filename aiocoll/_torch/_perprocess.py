"""What torch keeps once per process and a rank meets as if it were its own: torch.nn's
global module hooks, the profiler's session, DDP's logging data of a backend, and the
function a ``torch.multiprocessing.spawn`` child runs (torch 2.10-2.15)."""

from __future__ import annotations

import importlib
import os

import torch
import torch.distributed as dist

from ._compat import _need
from ._groups import backend_of

__all__ = ["ddp_backend_logging", "ddp_logging_data", "module_hooks", "profiler_start", "spawned_function"]


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


# -- the profiler, DDP's logging data, torch.multiprocessing.spawn's children ----------


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


def spawned_function(target: object, args: tuple[object, ...]) -> object:
    """The function a ``torch.multiprocessing.spawn`` child runs, for a ``Process`` target of its
    private ``_wrap(fn, i, args, error_file)`` (2.10-2.15); any other ``target`` as it is."""
    # (the module: torch.multiprocessing's attribute of that name is its spawn function)
    spawn = importlib.import_module("torch.multiprocessing.spawn")
    wrap = getattr(spawn, "_wrap", None)
    return args[0] if wrap is not None and target is wrap and args else target
