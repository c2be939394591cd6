"""Libraries' state kept once per process in a class attribute, made one per rank.

Hugging Face accelerate keeps its ``PartialState``, ``AcceleratorState`` and
``GradientState`` as Borg singletons: every instance's ``__dict__`` is one class-level
dict, ``_shared_state``, filled by the first instance a process makes. Ranks that are
threads of one process would share it: rank 1's ``PartialState()`` would find rank 0's
``process_index``. accelerate itself swaps that dict for a per-thread descriptor when
torch_xla runs ranks as threads (``ThreadLocalSharedDict``, ``accelerate/state.py``);
``RankShared`` does the same per rank: a rank reads and writes its own dict, empty at
its start as in a fresh process, and the threads it starts share it (``carried``); any
other thread gets the process's.

Only the classes listed in ``SHARED_STATES`` get it. They get it while harness worlds
run, on a module imported before (a test file's import, say: ``install_imported``) or
during them (``after_import``), and give the process's dict back after (``restore``).

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

import sys
from typing import Any

from . import _current

__all__ = [
    "SHARED_STATES",
    "RankShared",
    "after_import",
    "bind",
    "in_forked_child",
    "install_imported",
    "installed",
    "restore",
    "unbind",
]

# module -> (attribute, classes): a class-level dict every instance of these shares
SHARED_STATES: dict[str, tuple[str, tuple[str, ...]]] = {
    "accelerate.state": ("_shared_state", ("PartialState", "AcceleratorState", "GradientState")),
}

# the calling rank's own values, by descriptor (carried: a process's threads share its state)
_OWN: _current.Facet[dict[RankShared, Any] | None] = _current.Facet("libraries' state", None, carried=True)


def bind() -> None:
    """In a rank's thread, before its code runs: its libraries' state starts empty, as a fresh process's."""
    _OWN.set({})


def unbind() -> None:
    _OWN.set(None)


def in_forked_child() -> None:
    """A process forked from a rank's thread (a DataLoader worker) has the rank's state as its process's own."""
    own = _OWN.get()
    if own is not None:
        for attr in installed():
            attr.process = own[attr] if attr in own else type(attr.process)()
    unbind()


class RankShared:
    """A data descriptor in place of a class attribute: the calling rank's own value, else the process's."""

    __slots__ = ("name", "owner", "process")

    def __init__(self, owner: type, name: str) -> None:
        self.owner = owner
        self.name = name
        self.process: Any = vars(owner)[name]  # the process's value, given back by ``uninstall``

    def __get__(self, obj: object, objtype: type | None = None) -> Any:
        own = _OWN.get()
        if own is None:
            return self.process
        if self not in own:
            own[self] = type(self.process)()  # (empty, as in a process that has made no instance yet)
        return own[self]

    def __set__(self, obj: object, value: Any) -> None:
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

    def __repr__(self) -> str:
        here = _OWN.get()
        whose = "the process's" if here is None else "a rank's"
        return f"<RankShared {self.owner.__qualname__}.{self.name}: {whose} here>"


# by module: the descriptors in place
_installed: dict[str, list[RankShared]] = {}


def installed() -> list[RankShared]:
    """The descriptors in place now."""
    return [attr for attrs in _installed.values() for attr in attrs]


def after_import(module: str) -> None:
    """``module`` (one of ``SHARED_STATES``) is in ``sys.modules``: put its classes' descriptors in place."""
    name, classes = SHARED_STATES[module]
    mod = sys.modules[module]
    for cls_name in classes:
        cls = getattr(mod, cls_name, None)
        if isinstance(cls, type) and name in vars(cls) and not isinstance(vars(cls)[name], RankShared):
            attr = RankShared(cls, name)
            attr.install()
            _installed.setdefault(module, []).append(attr)


def install_imported(module: str) -> None:
    """As worlds start: ``module``, if already imported, gets its descriptors."""
    if module in sys.modules:
        after_import(module)


def restore(module: str) -> None:
    """Once no world runs: ``module``'s classes get the process's values back."""
    for attr in reversed(_installed.pop(module, [])):
        attr.uninstall()
