"""What every op shares: the interface of a rank's call (``Call``), the base of the op
classes, how records show a call (``OpRecord``, ``P2PRecord``), and the formatting of
tensors in reports."""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Sequence
from typing import Any, ClassVar, NamedTuple, ParamSpec, Protocol, TypeVar

import torch
import torch.distributed as dist

from .. import _torch

__all__ = ["Call", "OpRecord", "P2PRecord", "Shape", "Sig"]

_SUM = dist.ReduceOp.SUM

_P = ParamSpec("_P")
_T = TypeVar("_T")


def _no_grad(fn: Callable[_P, _T]) -> Callable[_P, _T]:
    """``torch.no_grad()`` for an op's ``run``, at a fifth of its cost (about 0.2 against 1.3 us a call).

    Grad mode is per thread, and ops run on the loop's thread or a worker's: set and
    restore it around the call in whichever thread runs it.
    """

    @functools.wraps(fn)
    def run(*args: _P.args, **kwargs: _P.kwargs) -> _T:
        prev = torch.is_grad_enabled()
        _torch.set_grad_enabled(False)
        try:
            return fn(*args, **kwargs)
        finally:
            _torch.set_grad_enabled(prev)

    return run


def _shares_storage(ts: Sequence[torch.Tensor], out: torch.Tensor) -> bool:
    ptr = out.untyped_storage().data_ptr()
    return any(t.untyped_storage().data_ptr() == ptr for t in ts)


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    # a torch.Size is a tuple of ints already: a copy would cost a tenth of a signature
    return t.shape


def _fmt(t: torch.Tensor | None) -> str:
    if t is None:
        return "None"
    dt = str(t.dtype).removeprefix("torch.")
    return f"{dt}{list(t.shape)}"


def _fmt_list(ts: Sequence[torch.Tensor] | None) -> str:
    if ts is None:
        return "None"
    if ts and all(t.dtype == ts[0].dtype and t.shape == ts[0].shape for t in ts):
        return f"{len(ts)}x{_fmt(ts[0])}"
    return "[" + ", ".join(_fmt(t) for t in ts) + "]"


Shape = tuple[int, ...]
Sig = tuple[Any, ...]  # a collective's signature as a tuple: its layout is its op class's to read


class OpRecord(NamedTuple):
    """A collective as records show it, read back from its signature by its op class.

    ``inputs``/``outputs``: one rank's input and output shape, None where the signature
    leaves them to each rank (``all_gather``'s list, ``all_to_all``'s splits) or no tensor
    moves; ``dtype``: None where the op moves objects or nothing.

    >>> from aiocoll._ops import AllReduce, Reduction, record_of
    >>> record_of(AllReduce(torch.zeros(2, 3), Reduction.of(dist.ReduceOp.SUM)).signature())
    OpRecord(op='all_reduce', inputs=torch.Size([2, 3]), outputs=torch.Size([2, 3]), dtype=torch.float32)
    """

    op: str
    inputs: Shape | None = None
    outputs: Shape | None = None
    dtype: torch.dtype | None = None


class P2PRecord(NamedTuple):
    """A send or recv as records show it; its text is the call's ``describe()``.

    >>> str(P2PRecord("recv", torch.float32, (3,), None, 0))
    'recv(float32[3], src=any, tag=0)'
    """

    op: str  # "send" or "recv"
    dtype: torch.dtype
    shape: Shape
    peer: int | None  # the dst of a send, the src of a recv (None: any source)
    tag: int

    def __str__(self) -> str:
        dt = str(self.dtype).removeprefix("torch.")
        peer = "any" if self.peer is None else self.peer
        return f"{self.op}({dt}{list(self.shape)}, {'dst' if self.op == 'send' else 'src'}={peer}, tag={self.tag})"


class Call(Protocol):
    """One rank's arguments to one collective (every op class is a dataclass)."""

    name: ClassVar[str]
    __dataclass_fields__: ClassVar[dict[str, Any]]

    def signature(self) -> Hashable:
        """What every rank of the collective must agree on."""
        ...

    def describe(self) -> str:
        """A one-line summary of the arguments, for error messages."""
        ...

    @property
    def nbytes(self) -> int:
        """Bytes this call moves; the engine uses it to pick where to run the op."""
        ...

    @staticmethod
    def check(calls: Sequence[Any]) -> str | None:
        """Cross-rank consistency beyond the signature (of every rank's call); a problem or None."""
        ...


class _Base:
    __slots__ = ()
    name: ClassVar[str]

    @property
    def nbytes(self) -> int:
        return 0

    @staticmethod
    def check(calls: Sequence[Any]) -> str | None:
        """Cross-rank consistency beyond the signature; returns a problem or None."""
        return None

    @staticmethod
    def record(sig: Sig) -> OpRecord:
        """How records show a call of signature ``sig`` (one this class made).

        Read back here, beside ``signature()``, so that the tuple's layout is known to
        its class alone. The default: no tensor shapes, no dtype.
        """
        return OpRecord(sig[0])
