"""Reductions: what ``all_reduce``, ``reduce`` and ``reduce_scatter`` compute, on plain tensors.

``Reduction`` is a validated reduce op (torch's ``ReduceOp`` or its name, with a
PREMUL_SUM's factor); ``reduce_tensors`` reduces one tensor per rank, as gloo and NCCL
would (integers wrap, bools are logical). The op classes of ``aiocoll._ops`` call them
under no_grad::

    >>> import torch
    >>> reduce_tensors([torch.tensor([1, 5]), torch.tensor([3, 2])], Reduction.of("max"))
    tensor([3, 5])
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .. import _torch
from .._errors import InvalidArgumentError

__all__ = ["Reduction", "chains", "checked_reduction", "copy_to_all", "disjoint", "factors", "reduce_tensors"]

_R = dist.ReduceOp
RedOpType = dist.ReduceOp.RedOpType

_NAMES = {
    _R.SUM: "SUM",
    _R.AVG: "AVG",
    _R.PRODUCT: "PRODUCT",
    _R.MIN: "MIN",
    _R.MAX: "MAX",
    _R.BAND: "BAND",
    _R.BOR: "BOR",
    _R.BXOR: "BXOR",
    _R.PREMUL_SUM: "PREMUL_SUM",
}
_BY_NAME = {name: kind for kind, name in _NAMES.items()}
_BITWISE = (_R.BAND, _R.BOR, _R.BXOR)
# The dtypes torch can reduce on CPU; it has no sum/prod/min/max kernels for uint16/32/64,
# complex32 or the float8s, so reducing those would fail inside the op, after every rank joined.
_REDUCIBLE = frozenset(
    {
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.complex64,
        torch.complex128,
    }
)


@dataclass(frozen=True, slots=True)
class Reduction:
    """A normalised reduce op: its kind and, for PREMUL_SUM, this rank's factor."""

    kind: dist.ReduceOp.RedOpType
    factor: float | torch.Tensor | None = None

    @classmethod
    def of(cls, op: object) -> Reduction:
        """Accept ``dist.ReduceOp.SUM``, ``dist.ReduceOp(...)``, a PREMUL_SUM op or ``"sum"``."""
        plain = _PLAIN.get(id(op))  # the common case, without torch's slow enum comparisons
        if plain is not None:
            return plain
        if type(op) is dist.ReduceOp:  # what torch.distributed hands a backend on every call
            return _unwrap(op)
        if isinstance(op, Reduction):
            return op
        if isinstance(op, str):
            kind = _BY_NAME.get(op.upper())
            if kind is None or kind == _R.PREMUL_SUM:
                raise InvalidArgumentError(
                    f"argument 'op': unknown reduce op {op!r}; expected one of "
                    f"{', '.join(n for n in _BY_NAME if n != 'PREMUL_SUM')} or a "
                    "torch.distributed.ReduceOp"
                )
            return cls(kind)
        if isinstance(op, RedOpType):
            if op == _R.PREMUL_SUM:
                raise InvalidArgumentError(
                    "argument 'op': PREMUL_SUM needs a factor; build it with "
                    "torch.distributed._make_nccl_premul_sum(factor)"
                )
            return _reduction(op.value)
        if isinstance(op, dist.ReduceOp):  # (a subclass; checked after RedOpType, which passes it too)
            return _unwrap(op)
        raise InvalidArgumentError(f"argument 'op': expected a torch.distributed.ReduceOp, got {type(op).__name__}")

    @property
    def name(self) -> str:
        return _NAMES[self.kind]

    def check_dtype(self, dtype: torch.dtype, arg: str) -> None:
        """Raise InvalidArgumentError if this reduction is undefined for ``dtype``."""
        key = (id(self.kind), dtype)
        if key in _DTYPE_OK:
            return
        self._check_dtype(dtype, arg)
        _DTYPE_OK.add(key)

    def _check_dtype(self, dtype: torch.dtype, arg: str) -> None:
        kind = self.kind
        if dtype not in _REDUCIBLE:
            raise InvalidArgumentError(f"argument {arg!r}: {self.name} is not supported for {dtype} tensors")
        if kind in _BITWISE:
            if dtype.is_floating_point or dtype.is_complex:
                raise InvalidArgumentError(
                    f"argument {arg!r}: {self.name} needs an integer or bool tensor, got {dtype}"
                )
        elif kind in (_R.AVG, _R.PREMUL_SUM):
            if not (dtype.is_floating_point or dtype.is_complex):
                raise InvalidArgumentError(
                    f"argument {arg!r}: {self.name} needs a floating point or complex tensor, got {dtype}"
                )
        elif kind in (_R.MIN, _R.MAX) and dtype.is_complex:
            raise InvalidArgumentError(f"argument {arg!r}: {self.name} is not defined for complex tensors ({dtype})")

    def __reduce__(
        self,
    ) -> tuple[Callable[[int, float | torch.Tensor | None], Reduction], tuple[int, float | torch.Tensor | None]]:
        # unpickled (a hybrid world's exchange), a Reduction holds the canonical kind too
        return (_reduction, (self.kind.value, self.factor))

    def __repr__(self) -> str:
        if self.factor is None:
            return f"ReduceOp.{self.name}"
        return f"ReduceOp.PREMUL_SUM({_scalar(self.factor)})"


# The RedOpType members of dist.ReduceOp are looked up by identity, as comparing them with
# == costs about a microsecond each. torch hands out other objects of equal value (e.g.
# ReduceOp(SUM).op): every Reduction holds the canonical member, so identity checks in
# the ops hold whatever spelling the caller used.
_CANON = {k.value: k for k in _NAMES}
_PREMUL_VALUE = _R.PREMUL_SUM.value
_PLAIN = {id(k): Reduction(k) for k in _NAMES if k is not _R.PREMUL_SUM}


def _reduction(value: int, factor: float | torch.Tensor | None = None) -> Reduction:
    kind = _CANON[value]
    if factor is None:
        return _PLAIN[id(kind)]
    return Reduction(kind, factor)


def _unwrap(op: dist.ReduceOp) -> Reduction:
    # ReduceOp wraps a RedOpType (and PREMUL_SUM's factor); the stubs omit both. Compared
    # as plain ints: comparing the enum members costs about a microsecond
    value = getattr(op, "op").value  # noqa: B009
    return _reduction(value, _torch.premul_factor(op) if value == _PREMUL_VALUE else None)


_DTYPE_OK: set[tuple[int, torch.dtype]] = set()  # (kind, dtype) pairs that passed check_dtype
# (id of a plain ReduceOp member, dtype) -> its checked Reduction: one dict lookup for a call's
# reduce op. Keyed by id only for the members, which live as long as torch (no id reuse).
_CHECKED: dict[tuple[int, torch.dtype], Reduction] = {}


def checked_reduction(op: object, dtype: torch.dtype, arg: str = "op") -> Reduction:
    """``Reduction.of(op)``, checked for ``dtype``: one dict lookup for ``ReduceOp.SUM`` and the like.

    >>> checked_reduction(dist.ReduceOp.SUM, torch.float32)
    ReduceOp.SUM
    """
    key = (id(op), dtype)
    red = _CHECKED.get(key)
    if red is not None:
        return red
    red = Reduction.of(op)
    red.check_dtype(dtype, arg)
    if id(op) in _PLAIN:
        _CHECKED[key] = red
    return red


def _scalar(x: float | torch.Tensor) -> float | complex | bool | int:
    return x.item() if isinstance(x, torch.Tensor) else x


# elements from which a SUM adds rank by rank instead of stacking (below, one fused
# stack-and-sum beats W-1 separate adds)
_CHAIN_MIN = 1 << 15
_HALF = (torch.float16, torch.bfloat16)
# dtypes whose sum keeps the dtype without being told
_KEEPS_DTYPE = frozenset(
    {torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128, torch.int64}
)


def reduce_tensors(
    tensors: Sequence[torch.Tensor], red: Reduction, factors: Sequence[float | torch.Tensor] = ()
) -> torch.Tensor:
    """Reduce same-shaped tensors (one per rank, in rank order) into a new tensor.

    The result has the inputs' dtype; integers wrap like they do in gloo and NCCL.
    For bool, SUM/MAX/BOR are logical or and PRODUCT/MIN/BAND logical and.
    ``factors`` are the per-rank PREMUL_SUM factors. The ops call it under no_grad.
    """
    kind = red.kind
    dtype = tensors[0].dtype
    if kind is _R.SUM and dtype is not torch.bool:  # the common case first
        if chains(tensors):
            # Large tensors: W-1 in-place adds, in rank order, move 3x fewer bytes than
            # stacking (and take 2-5x less time). Half types stay on stack().sum(), which
            # accumulates in float32 and rounds once.
            acc = torch.add(tensors[0], tensors[1])
            for t in tensors[2:]:
                acc.add_(t)
            return acc
        stacked = torch.stack(list(tensors))
        # dtype=: integers would widen to int64 (it costs 5% of a small op, so only for them)
        return stacked.sum(0) if dtype in _KEEPS_DTYPE else stacked.sum(0, dtype=dtype)
    if kind in _BITWISE:
        fn = {
            _R.BAND: torch.bitwise_and,
            _R.BOR: torch.bitwise_or,
            _R.BXOR: torch.bitwise_xor,
        }[kind]
        return functools.reduce(fn, tensors[1:], tensors[0].clone())
    stacked = torch.stack(list(tensors))
    if dtype == torch.bool:
        if kind in (_R.SUM, _R.MAX):
            return stacked.any(0)
        if kind in (_R.PRODUCT, _R.MIN):
            return stacked.all(0)
    if kind == _R.SUM:
        return stacked.sum(0, dtype=dtype)
    if kind == _R.AVG:
        return stacked.mean(0, dtype=dtype)
    if kind == _R.PRODUCT:
        return stacked.prod(0, dtype=dtype)
    if kind == _R.MIN:
        return stacked.amin(0)
    if kind == _R.MAX:
        return stacked.amax(0)
    if kind == _R.PREMUL_SUM:
        scale = torch.tensor([_scalar(f) for f in factors], dtype=dtype, device=stacked.device)
        return (stacked * scale.view(-1, *([1] * (stacked.dim() - 1)))).sum(0, dtype=dtype)
    raise AssertionError(f"unhandled reduce op {red!r}")  # pragma: no cover


def factors(calls: Sequence[Any]) -> list[Any]:
    """Each rank's PREMUL_SUM factor, in rank order (empty for every other reduce op)."""
    return [c.op.factor for c in calls] if calls[0].op.kind is _R.PREMUL_SUM else []


def chains(ts: Sequence[torch.Tensor]) -> bool:
    """Whether a SUM of ``ts`` adds rank by rank (large, not half precision) rather than stacking."""
    t = ts[0]
    return t.numel() >= _CHAIN_MIN and len(ts) > 1 and t.dtype not in _HALF and t.dtype is not torch.bool


def disjoint(ts: Sequence[torch.Tensor]) -> bool:
    """Whether every tensor has storage of its own (so writing one cannot change another)."""
    return len({t.untyped_storage().data_ptr() for t in ts}) == len(ts)


def copy_to_all(outs: list[torch.Tensor], src: torch.Tensor) -> None:
    """``out.copy_(src)`` for every out, in one fused torch call (W small copies cost W calls)."""
    if outs:
        _torch.foreach_copy_(outs, [src] * len(outs))
