"""The collectives over Python objects (pickled, as torch.distributed sends them), and
the ones that make groups: new_group and split, whose outcome is a ``Partition``."""

from __future__ import annotations

import pickle
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import ClassVar

from .._errors import InvalidArgumentError
from ._base import (
    _Base,
)

__all__ = [
    "AllGatherObject",
    "BroadcastObject",
    "GatherObject",
    "NewGroup",
    "Partition",
    "ScatterObject",
    "Split",
    "dumps",
]

# Objects travel pickled, as in torch.distributed: every rank gets its own copy and an
# object that would not survive a real process group fails here too.


def dumps(obj: object, arg: str) -> bytes:
    """Pickle ``obj`` on the calling rank, raising InvalidArgumentError if it cannot be."""
    try:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:
        raise InvalidArgumentError(
            f"argument {arg!r}: object of type {type(obj).__name__} cannot be pickled: {e}"
        ) from e


@dataclass(slots=True)
class BroadcastObject(_Base):
    name: ClassVar[str] = "broadcast_object"
    payload: bytes | None
    src: int

    def signature(self) -> Hashable:
        return (self.name, self.src)

    def describe(self) -> str:
        return f"broadcast_object(src={self.src})"

    @staticmethod
    def run(calls: Sequence[BroadcastObject]) -> list[object]:
        payload = calls[calls[0].src].payload
        assert payload is not None
        return [pickle.loads(payload) for _ in calls]


@dataclass(slots=True)
class AllGatherObject(_Base):
    name: ClassVar[str] = "all_gather_object"
    payload: bytes

    def signature(self) -> Hashable:
        return self.name

    def describe(self) -> str:
        return "all_gather_object(obj)"

    @staticmethod
    def run(calls: Sequence[AllGatherObject]) -> list[object]:
        return [[pickle.loads(c.payload) for c in calls] for _ in calls]


@dataclass(slots=True)
class GatherObject(_Base):
    name: ClassVar[str] = "gather_object"
    payload: bytes
    dst: int

    def signature(self) -> Hashable:
        return (self.name, self.dst)

    def describe(self) -> str:
        return f"gather_object(obj, dst={self.dst})"

    @staticmethod
    def run(calls: Sequence[GatherObject]) -> list[object]:
        dst = calls[0].dst
        return [[pickle.loads(c.payload) for c in calls] if r == dst else None for r in range(len(calls))]


@dataclass(slots=True)
class ScatterObject(_Base):
    name: ClassVar[str] = "scatter_object"
    payloads: list[bytes] | None
    src: int

    def signature(self) -> Hashable:
        return (self.name, self.src)

    def describe(self) -> str:
        n = "None" if self.payloads is None else f"{len(self.payloads)} objects"
        return f"scatter_object({n}, src={self.src})"

    @staticmethod
    def run(calls: Sequence[ScatterObject]) -> list[object]:
        payloads = calls[calls[0].src].payloads
        assert payloads is not None
        return [pickle.loads(p) for p in payloads]


@dataclass(frozen=True, slots=True)
class Partition:
    """The outcome of new_group/split: for each group-rank, its new group or None.

    ``groups[i]`` is the tuple of parent group-ranks of the new group rank i joins,
    in their new rank order; ``None`` if rank i joins no group.
    """

    groups: tuple[tuple[int, ...] | None, ...]
    colors: tuple[Hashable, ...]


@dataclass(slots=True)
class NewGroup(_Base):
    name: ClassVar[str] = "new_group"
    ranks: tuple[int, ...]

    def signature(self) -> Hashable:
        return (self.name, self.ranks)

    def describe(self) -> str:
        return f"new_group(ranks={list(self.ranks)})"

    @staticmethod
    def run(calls: Sequence[NewGroup]) -> list[Partition]:
        ranks = calls[0].ranks
        members = set(ranks)
        part = Partition(
            tuple(ranks if r in members else None for r in range(len(calls))),
            tuple(0 if r in members else None for r in range(len(calls))),
        )
        return [part] * len(calls)


@dataclass(slots=True)
class Split(_Base):
    name: ClassVar[str] = "split"
    color: Hashable
    key: object

    def signature(self) -> Hashable:
        return self.name

    def describe(self) -> str:
        return f"split(color={self.color!r}, key={self.key!r})"

    @staticmethod
    def check(calls: Sequence[Split]) -> str | None:
        # Try the very sort ``run`` does, per color: keys of different types may compare
        # (int and float), and keys of one type may not (complex).
        by_color: dict[Hashable, list[int]] = {}
        for r, c in enumerate(calls):
            if c.color is not None:
                by_color.setdefault(c.color, []).append(r)
        for rs in by_color.values():
            try:
                sorted(rs, key=lambda r: (calls[r].key, r))
            except TypeError:
                names = sorted({type(calls[r].key).__name__ for r in rs})
                return "split keys must be mutually comparable, got " + ", ".join(names)
        return None

    @staticmethod
    def run(calls: Sequence[Split]) -> list[Partition]:
        by_color: dict[Hashable, list[int]] = {}
        for r, c in enumerate(calls):
            if c.color is not None:
                by_color.setdefault(c.color, []).append(r)
        members = {color: tuple(sorted(rs, key=lambda r: (calls[r].key, r))) for color, rs in by_color.items()}
        part = Partition(
            tuple(None if c.color is None else members[c.color] for c in calls),
            tuple(c.color for c in calls),
        )
        return [part] * len(calls)
