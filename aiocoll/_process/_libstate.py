"""Libraries' state kept once per process, made one per rank: accelerate's states, Lightning's rank.

Two libraries keep what a process has once where ranks that are threads of one process
would share it:

- Hugging Face accelerate keeps its ``PartialState``, ``AcceleratorState`` and
  ``GradientState`` as Borg singletons: every instance's ``__dict__`` is one class-level
  dict, ``_shared_state``, filled by the first instance a process makes, so rank 1's
  ``PartialState()`` would find rank 0's ``process_index``. accelerate itself swaps that
  dict for a per-thread descriptor when torch_xla runs ranks as threads
  (``ThreadLocalSharedDict``, ``accelerate/state.py``); ``RankShared`` does the same per
  rank (``SHARED_STATES``).
- Lightning keeps the process's rank in an attribute of a function,
  ``lightning_utilities.core.rank_zero.rank_zero_only.rank``, which every function it
  decorates reads at each call through its module's global: one value for all ranks, so
  rank 0's rank-zero-only output would be the last rank's to decide. ``RankAttrs`` stands
  in for that function there, its ``rank`` each rank's own (``RANK_ATTRIBUTES``).

A rank's values start empty, as in a fresh process, and the threads it starts share them
(``carried``); any other thread gets the process's. The stand-ins are put in place while
harness worlds run, on a module imported before (a test file's import, say:
``install_imported``) or during them (``after_import``), and the process's own are given
back after (``restore``).

>>> class Borg:
...     _shared_state: dict[str, int] = {}
>>> attr = RankShared(Borg, "_shared_state")
>>> attr.install()
>>> Borg._shared_state is attr.process  # (a thread of no rank)
True
>>> attr.uninstall(); Borg._shared_state is attr.process
True
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import cast

from .. import _current

__all__ = [
    "RANK_ATTRIBUTES",
    "SHARED_STATES",
    "RankAttrs",
    "RankShared",
    "after_import",
    "bind",
    "in_forked_child",
    "install_imported",
    "installed",
    "restore",
    "target",
    "unbind",
    "watched",
]

# module -> (attribute, classes): a class-level dict every instance of these shares
SHARED_STATES: dict[str, tuple[str, tuple[str, ...]]] = {
    "accelerate.state": ("_shared_state", ("PartialState", "AcceleratorState", "GradientState")),
}
# module -> (function, attributes): a function whose attributes hold the process's state
RANK_ATTRIBUTES: dict[str, tuple[str, tuple[str, ...]]] = {
    "lightning_utilities.core.rank_zero": ("rank_zero_only", ("rank",)),
}

# the calling rank's own values, by stand-in (carried: a process's threads share its state)
_OWN: _current.Facet[dict[object, object] | None] = _current.Facet("libraries' state", None, carried=True)


def watched(module: str) -> bool:
    """Whether ``module`` keeps state that ranks get their own of."""
    return module in SHARED_STATES or module in RANK_ATTRIBUTES


def target(module: str) -> str:
    """What putting ``module``'s stand-ins in place changes (a ``_patches`` target)."""
    if module in SHARED_STATES:
        return f"{module}.*.{SHARED_STATES[module][0]}"
    return f"{module}.{RANK_ATTRIBUTES[module][0]}"


def bind() -> None:
    """In a rank's thread, before its code runs: its libraries' state starts empty, as a fresh process's."""
    _OWN.set({})


def unbind() -> None:
    _OWN.set(None)


def in_forked_child() -> None:
    """A process forked from a rank's thread (a DataLoader worker) has the rank's state as its process's own."""
    own = _OWN.get()
    if own is not None:
        for stand_in in installed():
            stand_in.make_the_process_s(own)
    unbind()


class RankShared:
    """A data descriptor in place of a class attribute: the calling rank's own value, else the process's."""

    __slots__ = ("name", "owner", "process")

    def __init__(self, owner: type, name: str) -> None:
        self.owner = owner
        self.name = name
        self.process: object = vars(owner)[name]  # the process's value, given back by ``uninstall``

    def __get__(self, obj: object, objtype: type | None = None) -> object:
        own = _OWN.get()
        if own is None:
            return self.process
        if self not in own:
            own[self] = type(self.process)()  # (empty, as in a process that has made no instance yet)
        return own[self]

    def __set__(self, obj: object, value: object) -> None:
        own = _OWN.get()
        if own is None:
            self.process = value
        else:
            own[self] = value

    def install(self) -> None:
        setattr(self.owner, self.name, self)

    def uninstall(self) -> None:
        if vars(self.owner).get(self.name) is self:  # (else the library replaced it meanwhile: its own)
            setattr(self.owner, self.name, self.process)

    def make_the_process_s(self, own: dict[object, object]) -> None:
        self.process = own[self] if self in own else type(self.process)()

    def __repr__(self) -> str:
        whose = "the process's" if _OWN.get() is None else "a rank's"
        return f"<RankShared {self.owner.__qualname__}.{self.name}: {whose} here>"


# torchrun's variables, then a scheduler's, in the order Lightning reads them for the rank
# it sets as rank_zero_only.rank on import (lightning/fabric/utilities/rank_zero.py)
_RANK_VARIABLES = ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK")


class RankAttrs:
    """A function standing in for itself in its module, ``attrs`` of it each rank's own.

    Called, it calls the function; other attributes are the function's. In a rank that
    has not set one of ``attrs`` yet, it is what Lightning's import sets in a fresh
    process (the rank from the rank's environment, else 0) once any rank or the process
    has set it, and missing before, as in a process that has not imported Lightning.
    """

    __slots__ = ("__wrapped__", "_attrs", "_module", "_name", "_set")
    __wrapped__: Callable[..., object]
    _attrs: tuple[str, ...]
    _module: ModuleType
    _name: str
    _set: set[str]

    def __init__(self, module: ModuleType, name: str, attrs: tuple[str, ...]) -> None:
        object.__setattr__(self, "__wrapped__", getattr(module, name))
        object.__setattr__(self, "_module", module)
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_attrs", attrs)
        object.__setattr__(self, "_set", set())  # of attrs: set by some rank

    def __call__(self, *args: object, **kwargs: object) -> object:
        return self.__wrapped__(*args, **kwargs)

    def __getattr__(self, name: str) -> object:  # (what is not found on the stand-in itself)
        if name in RankAttrs.__slots__:  # (a stand-in being made, not yet filled: never the function's)
            raise AttributeError(name)
        own = _OWN.get()
        if own is None or name not in self._attrs:
            return getattr(self.__wrapped__, name)
        mine = _attrs_of(own, self)
        if name in mine:
            return mine[name]
        if name in self._set or hasattr(self.__wrapped__, name):
            return _rank_from_environ()
        raise AttributeError(f"{self._name!r} has no attribute {name!r} (in this rank)")

    def __setattr__(self, name: str, value: object) -> None:
        own = _OWN.get()
        if own is None or name not in self._attrs:
            setattr(self.__wrapped__, name, value)
            return
        _attrs_of(own, self, make=True)[name] = value
        self._set.add(name)

    def __delattr__(self, name: str) -> None:
        own = _OWN.get()
        if own is None or name not in self._attrs:
            delattr(self.__wrapped__, name)
            return
        mine = _attrs_of(own, self)
        if name not in mine:
            raise AttributeError(name)
        del mine[name]

    def __copy__(self) -> RankAttrs:  # (one, as a function is: copying a function gives itself)
        return self

    def __deepcopy__(self, memo: dict[int, object]) -> RankAttrs:
        return self

    def __reduce__(self) -> tuple[Callable[[str, str], object], tuple[str, str]]:
        return _module_attribute, (self._module.__name__, self._name)  # (by name, as a function pickles)

    def install(self) -> None:
        setattr(self._module, self._name, self)

    def uninstall(self) -> None:
        if getattr(self._module, self._name, None) is self:
            setattr(self._module, self._name, self.__wrapped__)

    def make_the_process_s(self, own: dict[object, object]) -> None:
        for name, value in _attrs_of(own, self).items():
            setattr(self.__wrapped__, name, value)

    def __repr__(self) -> str:
        whose = "the process's" if _OWN.get() is None else "a rank's"
        return f"<RankAttrs {self._module.__name__}.{self._name} {list(self._attrs)}: {whose} here>"


def _attrs_of(own: dict[object, object], stand_in: RankAttrs, make: bool = False) -> dict[str, object]:
    """A rank's own values of ``stand_in``'s attrs, by name (put in ``own`` if ``make``, else a new empty one)."""
    # (``own`` holds each RankShared's value as is, and each RankAttrs' values in such a dict)
    return cast("dict[str, object]", own.setdefault(stand_in, {}) if make else own.get(stand_in, {}))


def _module_attribute(module: str, name: str) -> object:
    return getattr(sys.modules[module], name)


def _rank_from_environ() -> int:
    for key in _RANK_VARIABLES:
        value = os.environ.get(key)
        if value is not None:
            return int(value)
    return 0


# by module: the stand-ins in place; and the one stand-in each function gets (kept: modules
# that imported it while a world ran hold it, and it must be the same one in the next world)
_installed: dict[str, list[RankShared | RankAttrs]] = {}
_stand_ins: dict[tuple[str, str], RankAttrs] = {}


def installed() -> list[RankShared | RankAttrs]:
    """The stand-ins in place now."""
    return [attr for attrs in _installed.values() for attr in attrs]


def after_import(module: str) -> None:
    """``module`` (``watched``) is in ``sys.modules``: put its stand-ins in place."""
    mod = sys.modules[module]
    done = _installed.setdefault(module, [])
    if module in SHARED_STATES:
        name, classes = SHARED_STATES[module]
        for cls_name in classes:
            cls = getattr(mod, cls_name, None)
            if isinstance(cls, type) and name in vars(cls) and not isinstance(vars(cls)[name], RankShared):
                attr = RankShared(cls, name)
                attr.install()
                done.append(attr)
    if module in RANK_ATTRIBUTES:
        name, attrs = RANK_ATTRIBUTES[module]
        fn: object = getattr(mod, name, None)
        if callable(fn) and not isinstance(fn, RankAttrs):
            stand_in = _stand_ins.get((module, name))
            if stand_in is None or stand_in.__wrapped__ is not fn:  # (a reload made another)
                stand_in = _stand_ins[module, name] = RankAttrs(mod, name, attrs)
            stand_in.install()
            done.append(stand_in)


def install_imported(module: str) -> None:
    """As worlds start: ``module``, if already imported, gets its stand-ins."""
    if module in sys.modules:
        after_import(module)


def restore(module: str) -> None:
    """Once no world runs: ``module`` gets the process's own back."""
    for attr in reversed(_installed.pop(module, [])):
        attr.uninstall()
