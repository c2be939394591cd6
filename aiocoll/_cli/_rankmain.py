"""``sys.modules["__main__"]`` per rank, for ``aiocoll run``: each rank's script is its own ``__main__``.

Under torchrun each worker is ``python script.py``: its ``__main__`` module is the script,
so ``pickle`` (``torch.save`` of a model whose class the script defines, a DataLoader
worker's batches) finds ``__main__.Net`` there. In one process the ranks run the script as
separate module objects; ``MainByRank`` stands in ``sys.modules["__main__"]`` during a run
and gives each rank thread its own module's attributes, every other thread the process's
``__main__``.

>>> import types
>>> process = types.ModuleType("__main__"); process.where = "process"
>>> mains = MainByRank(process)
>>> rank = types.ModuleType("__main__"); rank.where = "rank"
>>> with bound(mains, rank):
...     inside = mains.where
>>> inside, mains.where
('rank', 'process')
"""

from __future__ import annotations

import contextlib
import importlib.util
import types
from collections.abc import Callable
from contextlib import AbstractContextManager

from .. import _current

__all__ = ["MainByRank", "bound", "carried", "module_main", "target"]


# the script module the calling thread runs as its __main__ (None: the process's); a
# thread's is its process's, so the threads a rank starts carry it
_MAIN: _current.Facet[types.ModuleType | None] = _current.Facet("__main__", None, carried=True)


class MainByRank(_current.StandIn, types.ModuleType):
    """A ``__main__`` that is the calling rank's script module, or the process's own outside ranks.

    Every attribute is the target module's (``_current.StandIn``), so a script's names
    (``bound``, say) never clash with this class's: it is driven through the module
    functions ``bound`` and ``target``.
    """

    _aiocoll_own = _current.PerRank(_MAIN.get)

    def __init__(self, process: types.ModuleType) -> None:
        types.ModuleType.__init__(self, "__main__")
        object.__setattr__(self, "_aiocoll_process", process)

    def __repr__(self) -> str:
        return f"<aiocoll's __main__ per rank, now {target(self)!r}>"


def target(mains: MainByRank) -> types.ModuleType:
    """The module ``mains`` stands for in the calling thread."""
    module = _MAIN.get()
    return module if module is not None else object.__getattribute__(mains, "_aiocoll_process")


def bound(mains: MainByRank, module: types.ModuleType) -> AbstractContextManager[None]:
    """While the calling thread runs ``module`` as its ``__main__``."""
    return _MAIN.bound(module)


def carried() -> Callable[[], AbstractContextManager[None]]:
    """For ranks the caller starts (``mp.spawn``): binds its ``__main__`` in theirs.

    A child process's script is its parent's.
    """
    module = _MAIN.get()
    return contextlib.nullcontext if module is None else lambda: _MAIN.bound(module)


def script_main(
    script: str, module: bool, code: types.CodeType | None = None
) -> tuple[types.CodeType, dict[str, object]]:
    """The code ``python script`` (``python -m script``, with ``module``) runs as ``__main__``, and the
    globals it gets first; ``code``: the script's, compiled already."""
    if module:
        return module_main(script)
    if code is None:
        with open(script, "rb") as f:
            code = compile(f.read(), script, "exec")
    return code, {"__file__": script, "__cached__": None}


def module_main(name: str) -> tuple[types.CodeType, dict[str, object]]:
    """The code ``python -m name`` runs and the globals it gets (``runpy``'s rules: a package runs its ``__main__``)."""
    spec = importlib.util.find_spec(name)
    if spec is None:
        raise ImportError(f"No module named {name}", name=name)
    if spec.submodule_search_locations is not None:  # a package
        return module_main(f"{name}.__main__")
    loader = spec.loader
    code = loader.get_code(name) if loader is not None and hasattr(loader, "get_code") else None
    if code is None:
        raise ImportError(f"No code object available for {name}", name=name)
    origin = spec.origin if spec.has_location else None
    return code, {
        "__file__": origin,
        "__cached__": spec.cached,
        "__loader__": loader,
        "__package__": spec.parent,
        "__spec__": spec,
    }
