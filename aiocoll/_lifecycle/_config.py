"""A world's configuration: the keywords of ``spawn`` declared once, checked once, frozen.

``spawn(fn, 4, timeout=5)`` and ``spawn_async`` take ``**options: Unpack[SpawnOptions]``
(type checkers and IDEs see every keyword and its type); ``WorldConfig.of`` checks them
and fills in the defaults, and the driver (``_driver``) runs a world from the result.
"""

from __future__ import annotations

import asyncio
import difflib
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields
from typing import Literal, TypedDict

import torch.distributed as dist

from .._engine._faults import Fault
from .._engine._record import DEFAULT_RECORD
from .._errors import InvalidArgumentError

__all__ = [
    "DEFAULT_RECORD",
    "DEFAULT_TIMEOUT",
    "C10dSetup",
    "LoopChoice",
    "SpawnOptions",
    "SyncRanks",
    "WorldConfig",
    "WorldOptions",
    "loop_factory",
]

DEFAULT_TIMEOUT = 300.0
"""Seconds a rank may wait in one collective before ``CollectiveTimeoutError``."""

LoopChoice = Literal["auto", "asyncio", "uvloop"] | Callable[[], asyncio.AbstractEventLoop]
SyncRanks = Literal["turns", "parallel"]
C10dSetup = Literal["init", "state", "off"]


class WorldOptions(TypedDict, total=False):
    """The keywords of ``spawn_async``: what a world is made with (all optional)."""

    timeout: float | None
    torch_distributed: bool
    record: int
    trace: str | os.PathLike[str] | None
    faults: Iterable[Fault]
    schedule_seed: int | None
    prefix_output: bool
    process_group: dist.ProcessGroup | None
    sync_ranks: SyncRanks


class SpawnOptions(WorldOptions, total=False):
    """The keywords of ``spawn``: ``spawn_async``'s and the event loop to make."""

    loop: LoopChoice


@dataclass(frozen=True)
class WorldConfig:
    """One world's configuration, checked: every field has a valid value or construction failed.

    ``c10d``: "init" initialises torch.distributed in each rank (backend "aiocoll");
    "state" only gives each rank its own c10d state, for code that initialises
    torch.distributed itself (the process harness); "off" leaves torch.distributed alone.

    >>> WorldConfig.of(4, {"timeout": 5, "torch_distributed": False}, caller="spawn")
    WorldConfig(size=4, timeout=5, c10d='off')
    >>> WorldConfig(0)
    Traceback (most recent call last):
      ...
    aiocoll._errors.InvalidArgumentError: spawn: argument 'world' must be a positive int, got 0
    """

    size: int
    timeout: float | None = DEFAULT_TIMEOUT
    c10d: C10dSetup = "init"
    record: int = DEFAULT_RECORD
    trace: str | os.PathLike[str] | None = None
    faults: tuple[Fault, ...] = ()
    schedule_seed: int | None = None
    prefix_output: bool = False
    process_group: dist.ProcessGroup | None = None
    sync_ranks: SyncRanks = "turns"
    # each rank's seed for its generators, as a fresh process's (worlds that stand for
    # processes: ``_procworld``); None: every rank starts from a copy of the caller's states
    rank_seeds: tuple[int, ...] | None = None

    @classmethod
    def of(cls, world: object, options: WorldOptions, *, caller: str) -> WorldConfig:
        """The configuration ``caller(fn, world, **options)`` asks for; a keyword it does not take is a TypeError."""
        unknown = sorted(set(options) - WorldOptions.__optional_keys__)
        if unknown:
            close = difflib.get_close_matches(unknown[0], sorted(WorldOptions.__optional_keys__), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise TypeError(f"{caller}() got an unexpected keyword argument {unknown[0]!r}{hint}")
        given = dict(options)
        c10d: C10dSetup = "init" if given.pop("torch_distributed", True) else "off"
        faults = given.pop("faults", ())
        if not isinstance(faults, Iterable):
            raise InvalidArgumentError(f"spawn: argument 'faults' must be an iterable of Fault, got {faults!r}")
        return cls(world, c10d=c10d, faults=tuple(faults), **given)  # type: ignore[arg-type]

    def __repr__(self) -> str:
        # the fields that differ from the defaults: what makes this world special
        shown = [f"size={self.size}"] + [
            f"{f.name}={getattr(self, f.name)!r}"
            for f in fields(self)[1:]
            if getattr(self, f.name) is not f.default and getattr(self, f.name) != f.default
        ]
        return f"WorldConfig({', '.join(shown)})"

    def __post_init__(self) -> None:
        def bad(name: str, expected: str) -> InvalidArgumentError:
            shown = "world" if name == "size" else name
            return InvalidArgumentError(f"spawn: argument {shown!r} must be {expected}, got {getattr(self, name)!r}")

        if self.sync_ranks not in ("turns", "parallel"):
            raise bad("sync_ranks", "'turns' or 'parallel'")
        if self.schedule_seed is not None and not _is_int(self.schedule_seed):
            raise bad("schedule_seed", "an int or None")
        if not _is_int(self.record) or self.record < 0:
            raise bad("record", "an int >= 0 (0: off)")
        if not _is_int(self.size) or self.size < 1:
            raise bad("size", "a positive int")
        t = self.timeout
        if t is not None and (not isinstance(t, (int, float)) or isinstance(t, bool) or not t > 0):
            raise bad("timeout", "a positive number of seconds or None")
        if self.process_group is not None and not isinstance(self.process_group, dist.ProcessGroup):
            raise InvalidArgumentError(
                "spawn: argument 'process_group' must be a torch.distributed ProcessGroup "
                f"(e.g. dist.group.WORLD) or None, got {type(self.process_group).__name__}"
            )
        if self.c10d not in ("init", "state", "off"):
            raise bad("c10d", "'init', 'state' or 'off'")
        if self.rank_seeds is not None and len(self.rank_seeds) != self.size:
            raise bad("rank_seeds", f"one seed per rank ({self.size})")


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def loop_factory(choice: LoopChoice) -> Callable[[], asyncio.AbstractEventLoop]:
    """The factory of the event loop ``spawn(..., loop=choice)`` runs on."""
    if callable(choice):
        return choice
    if choice == "asyncio":
        return asyncio.new_event_loop
    if choice in ("auto", "uvloop"):
        try:
            import uvloop
        except ImportError:
            if choice == "uvloop":
                raise InvalidArgumentError(
                    "spawn: loop='uvloop' but uvloop is not installed (pip install 'aiocoll[uvloop]')"
                ) from None
            return asyncio.new_event_loop
        return uvloop.new_event_loop
    raise InvalidArgumentError(
        f"spawn: argument 'loop' must be 'auto', 'asyncio', 'uvloop' or a loop factory, got {choice!r}"
    )
