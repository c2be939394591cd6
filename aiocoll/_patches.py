"""Every change aiocoll makes to torch, the standard library or another library: one registry.

Making a thread look like a process means changing what the process shares: torch's
c10d state, ``os.environ``'s methods, ``random``'s functions, ``sys.stdout``,
``sys.modules["__main__"]``, signal handlers... Each such change is one ``Change`` of
a declared, named ``PatchSet``. A set is *leased*: the first lease installs it, the
last one to end undoes it, in reverse order. So the registry can say what is installed
now (``installed()``), and what every attribute it ever replaced was (``originals()``).

A change aiocoll made is put back only if it is still aiocoll's: where someone replaced
it meanwhile (a test's ``mock.patch`` over ours, a library's own wrapper), theirs stays,
and the ``aiocoll`` logger says so once per attribute (trio restores a signal handler
the same way). A value that the code under the lease is expected to change (a script's
``sys.argv``, the ``sys.excepthook`` torch's ``init_process_group`` wraps) is put back
whatever it became (``restore="always"``).

>>> import types
>>> box = types.SimpleNamespace(value=1)
>>> doubled = PatchSet("doubled", "a doctest's", lambda key: [Attr(box, "value", 2)], ["*.value"])
>>> with lease(doubled), lease(doubled):  # the second lease shares the first's install
...     inside = box.value, [s.name for s in installed()]
>>> inside, box.value, installed()
((2, ['doubled']), 1, [])
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import sys
import threading
from collections.abc import Callable, Hashable, Iterator, MutableMapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Literal

__all__ = [
    "Attr",
    "Change",
    "Item",
    "PatchSet",
    "Step",
    "acquire",
    "declared",
    "installed",
    "lease",
    "originals",
    "release",
    "table",
]

_log = logging.getLogger("aiocoll")
_MISSING: object = type("_Missing", (), {"__repr__": lambda self: "<missing>"})()

Restore = Literal["ours", "always"]


def _where(owner: object) -> str:
    """A short name of ``owner``: a module's name, a class's qualified name, else its type's."""
    if isinstance(owner, ModuleType):
        return owner.__name__
    if isinstance(owner, type):
        return f"{owner.__module__}.{owner.__qualname__}"
    return f"<{type(owner).__name__}>"


@dataclass(frozen=True, eq=False)
class Attr:
    """``owner.name`` becomes ``value`` (an attribute missing before is deleted again)."""

    owner: object
    name: str
    value: object
    restore: Restore = "ours"

    @classmethod
    def kept(cls, owner: object, name: str) -> Attr:
        """``owner.name`` stays as it is now: whatever the code under the lease writes there, it comes back."""
        return cls(owner, name, cls(owner, name, None)._read(), restore="always")

    @property
    def target(self) -> str:
        return f"{_where(self.owner)}.{self.name}"

    def _read(self) -> object:
        # the owner's own entry (a class's __dict__), not an inherited one: what goes back
        own = getattr(self.owner, "__dict__", None)
        if own is not None:
            return own.get(self.name, _MISSING)
        return getattr(self.owner, self.name, _MISSING)

    def _write(self, value: object) -> None:
        if value is _MISSING:
            with contextlib.suppress(AttributeError):
                delattr(self.owner, self.name)
        else:
            setattr(self.owner, self.name, value)


@dataclass(frozen=True, eq=False)
class Item:
    """``mapping[key]`` becomes ``value`` (a key missing before is removed again)."""

    mapping: MutableMapping[str, Any]
    key: str
    value: object
    label: str  # how the mapping is named in reports: "sys.modules"
    restore: Restore = "ours"

    @property
    def target(self) -> str:
        return f"{self.label}[{self.key!r}]"

    def _read(self) -> object:
        return self.mapping.get(self.key, _MISSING)

    def _write(self, value: object) -> None:
        if value is _MISSING:
            self.mapping.pop(self.key, None)
        else:
            self.mapping[self.key] = value


@dataclass(frozen=True, eq=False)
class Step:
    """A change that is a call, not an assignment: ``do()`` makes it and returns its undo.

    The undo decides itself whether what it finds is still aiocoll's (a signal handler),
    and returns a description of what it left in place when it is not (anything else
    than a str: undone).
    """

    target: str
    do: Callable[[], Callable[[], str | None]]


Change = Attr | Item | Step


@dataclass(frozen=True, eq=False)
class PatchSet:
    """A named group of changes, installed by its first lease and undone by its last.

    ``build(key)`` makes the changes when the set is installed (what it replaces is read
    then, not at import); ``key`` is the lease's (a set leased per loop, per run), None
    for a set of the process. ``targets`` declares what the set may change (``*``
    stands for any text): an install that would change anything else is a bug of
    aiocoll's, and raises. ``needs``: sets of the process this one works on top of,
    leased before it and released after it.
    """

    name: str
    why: str
    build: Callable[[Hashable], Sequence[Change]]
    targets: Sequence[str]
    per: str = "process"  # what one install is for: "process", "loop", "run"
    needs: Sequence[PatchSet] = ()
    module: str = field(init=False, default="")  # the module that declares it

    def __post_init__(self) -> None:
        # (frame 0: here, 1: the dataclass's __init__, 2: the declaring code)
        object.__setattr__(self, "module", sys._getframe(2).f_globals.get("__name__", ""))
        with _lock:
            _declared.append(self)

    def __repr__(self) -> str:
        return f"<PatchSet {self.name!r}: {len(self.targets)} target(s), per {self.per}>"


@dataclass(eq=False)
class _Install:
    """One installed set (for one key): its leases, and what each change replaced."""

    patch_set: PatchSet
    key: Hashable
    leases: int = 0
    done: list[tuple[Change, object]] = field(default_factory=list)  # (change, what it replaced / its undo)

    def apply(self) -> None:
        targets = self.patch_set.targets
        try:
            for change in self.patch_set.build(self.key):
                if not any(_pattern(t).fullmatch(change.target) for t in targets):
                    raise RuntimeError(
                        f"aiocoll: patch set {self.patch_set.name!r} would change {change.target}, "
                        f"which it does not declare ({sorted(targets)})"
                    )
                if isinstance(change, Step):
                    self.done.append((change, change.do()))
                    continue
                before = change._read()
                if before is not change.value:
                    change._write(change.value)
                self.done.append((change, before))
                if isinstance(change, Attr) and change.restore == "ours" and before is not _MISSING:
                    _first_seen.setdefault((id(change.owner), change.name), (change.owner, change.name, before))
        except BaseException:
            self.undo()  # (what was applied before the failure: nothing stays half installed)
            raise

    def undo(self) -> None:
        while self.done:
            change, before = self.done.pop()
            try:
                if isinstance(change, Step):
                    assert callable(before)
                    left = before()
                    if isinstance(left, str):  # (a str says what was left in place)
                        _say_once(change.target, left)
                    continue
                now = change._read()
                if change.restore == "always" or now is change.value:
                    change._write(before)
                else:
                    _say_once(change.target, f"replaced by {now!r} while aiocoll's was in force")
            except Exception:  # an undo that fails must not keep the others from running
                _log.exception("aiocoll: undoing %s of patch set %r failed", change.target, self.patch_set.name)


@functools.cache
def _pattern(target: str) -> re.Pattern[str]:
    return re.compile(".*".join(re.escape(part) for part in target.split("*")))


_lock = threading.RLock()  # (reentrant: a set's build may read the registry)


def _forked() -> None:
    # a forked child has a copy of the lock, held if another thread of the parent held it
    # then (a world starting beside the rank that forks): the child installs sets too
    global _lock
    _lock = threading.RLock()


os.register_at_fork(after_in_child=_forked)
_declared: list[PatchSet] = []
_installs: dict[tuple[int, Hashable], _Install] = {}
_first_seen: dict[tuple[int, str], tuple[object, str, object]] = {}  # every attribute replaced: its original
_said: set[str] = set()


def _say_once(target: str, what: str) -> None:
    if target not in _said:
        _said.add(target)
        _log.warning("aiocoll: %s was %s; left in place", target, what)


def acquire(patch_set: PatchSet, key: Hashable = None) -> None:
    """Lease ``patch_set`` (for ``key``), after what it needs: the first lease installs it."""
    with _lock:
        taken: list[PatchSet] = []
        try:
            for need in patch_set.needs:
                acquire(need)
                taken.append(need)
            ident = (id(patch_set), key)
            inst = _installs.get(ident)
            if inst is None:
                inst = _Install(patch_set, key)
                inst.apply()
                _installs[ident] = inst
            inst.leases += 1
        except BaseException:
            for need in reversed(taken):  # (nothing stays leased for a set that could not be)
                release(need)
            raise


def release(patch_set: PatchSet, key: Hashable = None) -> None:
    """End one lease of ``patch_set`` (for ``key``), then of what it needs: the last one undoes it, in reverse order."""
    with _lock:
        try:
            ident = (id(patch_set), key)
            inst = _installs[ident]
            inst.leases -= 1
            if inst.leases == 0:
                del _installs[ident]
                inst.undo()
        finally:
            for need in reversed(patch_set.needs):
                release(need)


@contextlib.contextmanager
def lease(patch_set: PatchSet, key: Hashable = None) -> Iterator[None]:
    """``acquire`` for the block, ``release`` after it."""
    acquire(patch_set, key)
    try:
        yield
    finally:
        release(patch_set, key)


@dataclass(frozen=True)
class Installed:
    """A patch set in force now: its name, what it was installed for, its leases and changes."""

    name: str
    key: Hashable
    leases: int
    targets: tuple[str, ...]


def installed() -> list[Installed]:
    """The patch sets in force now, in the order they were installed."""
    with _lock:
        return [
            Installed(i.patch_set.name, i.key, i.leases, tuple(c.target for c, _ in i.done)) for i in _installs.values()
        ]


def declared() -> list[PatchSet]:
    """Every patch set aiocoll's modules declare (those imported so far), in the order declared."""
    with _lock:
        return [s for s in _declared if s.module.startswith("aiocoll.") and s.module != __name__]


def table() -> str:
    """The declared sets as the design page's table (``docs/design.md``, checked by a test)."""
    rows = ["| patch set | declared in | one install per | what it changes | why |", "| --- | --- | --- | --- | --- |"]
    for s in sorted(declared(), key=lambda s: (s.module, s.name)):
        targets = ", ".join(f"`{t}`" for t in s.targets)
        rows.append(f"| {s.name} | `{s.module}` | {s.per} | {targets} | {s.why} |")
    return "\n".join(rows)


def originals() -> list[tuple[object, str, object]]:
    """``(owner, name, original)`` for every attribute a patch set has replaced in this process.

    (Not the values a set only keeps, ``restore="always"``: those are someone else's to change.)
    """
    with _lock:
        return list(_first_seen.values())
