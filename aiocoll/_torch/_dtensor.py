"""DTensor and DeviceMesh: the caches torch keeps per thread and per process that would
hold a world's meshes, the OpSchema leak of torch 2.10-2.12 (pytorch#181761), and the
meshes each rank builds (torch 2.10-2.15)."""

from __future__ import annotations

import ctypes
import functools
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from .._patches import Attr

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["drop_mesh_caches", "drop_thread_caches", "op_schema_leak_fix", "pins_dtensor_specs", "watch_meshes"]


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
