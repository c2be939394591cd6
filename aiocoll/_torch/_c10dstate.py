"""c10d's state per rank: torch's ``_World`` with all of its state per instance, the
check that a torch keeps it so, and the changes that give each rank its own (torch 2.10-2.15)."""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist

from .. import _current
from .._patches import Attr, Change, Step
from ._compat import _C, _broken, _c10d, _need
from ._cuda import rank_devices
from ._dtensor import watch_meshes

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["C10D_TARGETS", "C10dState", "c10d_changes", "check_c10d"]


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
    return None if rank is None else cast("C10dState | None", rank.c10d)  # (only aiocoll sets it, to one)


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
    modules: tuple[object, ...] = (_c10d, dist)
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
