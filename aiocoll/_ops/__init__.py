"""Op semantics: pure data movement over the calls of every rank of one collective.

Each collective is a small class whose instance is one rank's call (its arguments).
The engine collects the calls of all ranks of a group in group-rank order, checks that
their ``signature()`` agree, then calls ``check(calls)`` (cross-rank consistency) and
``run(calls)`` (the data movement, returning each rank's result). Nothing here knows
about event loops, so every op can be tested by calling ``run`` directly::

    >>> import torch
    >>> a, b = torch.tensor([1.0]), torch.tensor([2.0])
    >>> AllReduce.run([AllReduce(a, Reduction.of("sum")), AllReduce(b, Reduction.of("sum"))])
    [None, None]
    >>> a, b
    (tensor([3.]), tensor([3.]))

Every ``run`` reads all inputs into fresh tensors before it writes any output, so an
output that aliases an input (in-place all_gather, reduce_scatter into a chunk of the
input) gets the right answer.
"""

from __future__ import annotations

import functools
import pickle
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, ParamSpec, Protocol, TypeVar

import torch
import torch.distributed as dist

from .. import _torch
from .._errors import InvalidArgumentError
from ._reduce import Reduction, chains, checked_reduction, copy_to_all, disjoint, factors, reduce_tensors

__all__ = [
    "OPS",
    "Call",
    "OpRecord",
    "P2PRecord",
    "Reduction",
    "checked_reduction",
    "record_of",
    "reduce_tensors",
]

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


@dataclass(slots=True)
class AllReduce(_Base):
    name: ClassVar[str] = "all_reduce"
    tensor: torch.Tensor
    op: Reduction

    def signature(self) -> Hashable:
        return (self.name, self.op.kind, self.tensor.dtype, _shape(self.tensor))

    @staticmethod
    def record(sig: Sig) -> OpRecord:
        name, _, dtype, shape = sig
        return OpRecord(name, shape, shape, dtype)

    def describe(self) -> str:
        return f"all_reduce({_fmt(self.tensor)}, op={self.op!r})"

    @property
    def nbytes(self) -> int:
        return self.tensor.nbytes

    @staticmethod
    @_no_grad
    def run(calls: Sequence[AllReduce]) -> list[None]:
        red = calls[0].op
        ts = [c.tensor for c in calls]
        if red.kind is _SUM and chains(ts) and disjoint(ts):
            # Large and in separate memory: sum into rank 0's tensor in rank order, then
            # copy it to the others. No scratch tensor, and one copy fewer.
            acc = ts[0]
            for t in ts[1:]:
                acc.add_(t)
            copy_to_all(ts[1:], acc)
            return [None] * len(calls)
        res = reduce_tensors(ts, red, factors(calls))
        copy_to_all(ts, res)
        return [None] * len(calls)


@dataclass(slots=True)
class Reduce(_Base):
    name: ClassVar[str] = "reduce"
    tensor: torch.Tensor
    dst: int
    op: Reduction

    def signature(self) -> Hashable:
        return (self.name, self.dst, self.op.kind, self.tensor.dtype, _shape(self.tensor))

    @staticmethod
    def record(sig: Sig) -> OpRecord:
        name, _, _, dtype, shape = sig
        return OpRecord(name, shape, shape, dtype)

    def describe(self) -> str:
        return f"reduce({_fmt(self.tensor)}, dst={self.dst}, op={self.op!r})"

    @property
    def nbytes(self) -> int:
        return self.tensor.nbytes

    @staticmethod
    @_no_grad
    def run(calls: Sequence[Reduce]) -> list[None]:
        dst = calls[0].dst
        res = reduce_tensors([c.tensor for c in calls], calls[0].op, factors(calls))
        calls[dst].tensor.copy_(res)
        return [None] * len(calls)


@dataclass(slots=True)
class Broadcast(_Base):
    name: ClassVar[str] = "broadcast"
    tensor: torch.Tensor
    src: int

    def signature(self) -> Hashable:
        return (self.name, self.src, self.tensor.dtype, _shape(self.tensor))

    @staticmethod
    def record(sig: Sig) -> OpRecord:
        name, _, dtype, shape = sig
        return OpRecord(name, shape, shape, dtype)

    def describe(self) -> str:
        return f"broadcast({_fmt(self.tensor)}, src={self.src})"

    @property
    def nbytes(self) -> int:
        return self.tensor.nbytes

    @staticmethod
    @_no_grad
    def run(calls: Sequence[Broadcast]) -> list[None]:
        root = calls[0].src
        copy_to_all([c.tensor for i, c in enumerate(calls) if i != root], calls[root].tensor.clone())
        return [None] * len(calls)


@dataclass(slots=True)
class AllGather(_Base):
    """List form; ranks may contribute tensors of different shapes (the lists say which)."""

    name: ClassVar[str] = "all_gather"
    outputs: list[torch.Tensor]
    input: torch.Tensor

    def signature(self) -> Hashable:
        return (self.name, self.input.dtype, len(self.outputs))

    @staticmethod
    def record(sig: Sig) -> OpRecord:
        name, dtype, _ = sig
        return OpRecord(name, None, None, dtype)

    def describe(self) -> str:
        return f"all_gather({_fmt_list(self.outputs)}, {_fmt(self.input)})"

    @property
    def nbytes(self) -> int:
        return self.input.nbytes * len(self.outputs)

    @staticmethod
    def check(calls: Sequence[AllGather]) -> str | None:
        for r, c in enumerate(calls):
            for j, out in enumerate(c.outputs):
                if out.shape != calls[j].input.shape:
                    return (
                        f"rank {r}'s tensor_list[{j}] has shape {list(out.shape)} but rank {j} "
                        f"contributes shape {list(calls[j].input.shape)}"
                    )
        return None

    @staticmethod
    @_no_grad
    def run(calls: Sequence[AllGather]) -> list[None]:
        inputs = [c.input.clone() for c in calls]
        for c in calls:
            for out, x in zip(c.outputs, inputs, strict=True):
                out.copy_(x)
        return [None] * len(calls)


@dataclass(slots=True)
class AllGatherIntoTensor(_Base):
    name: ClassVar[str] = "all_gather_into_tensor"
    output: torch.Tensor
    input: torch.Tensor

    def signature(self) -> Hashable:
        return (self.name, self.input.dtype, _shape(self.input), _shape(self.output))

    @staticmethod
    def record(sig: Sig) -> OpRecord:
        name, dtype, inp, out = sig
        return OpRecord(name, inp, out, dtype)

    def describe(self) -> str:
        return f"all_gather_into_tensor({_fmt(self.output)}, {_fmt(self.input)})"

    @property
    def nbytes(self) -> int:
        return self.output.nbytes

    @staticmethod
    @_no_grad
    def run(calls: Sequence[AllGatherIntoTensor]) -> list[None]:
        # Concatenation along dim 0 and stacking are the same bytes in row-major order,
        # so rank r's input fills the r-th of len(calls) equal chunks of an output.
        first = calls[0].output
        inputs = [c.input for c in calls]
        outputs = [c.output for c in calls]
        x0 = inputs[0]
        in_place_0 = x0.data_ptr() == first.data_ptr() and x0.is_contiguous()  # rank 0 passed chunk 0
        if first.numel() and first.is_contiguous() and not _shares_storage(inputs[1:] if in_place_0 else inputs, first):
            # Gather straight into rank 0's output, then copy that to the others: the
            # bytes the floor moves, with no staging buffer. Rank r > 0 may pass a slice
            # of its own output (the usual in-place form): it is read before that output
            # is overwritten. Only inputs inside rank 0's output need the staged path.
            chunks = first.view(len(calls), -1)
            _torch.foreach_copy_(list(chunks.unbind(0)), [x.reshape(-1) for x in inputs])
            copy_to_all(outputs[1:], first)
        else:
            full = torch.stack(inputs).reshape(first.shape)
            copy_to_all(outputs, full)
        return [None] * len(calls)


@dataclass(slots=True)
class Gather(_Base):
    name: ClassVar[str] = "gather"
    input: torch.Tensor
    outputs: list[torch.Tensor] | None
    dst: int

    def signature(self) -> Hashable:
        return (self.name, self.dst, self.input.dtype, _shape(self.input))

    @staticmethod
    def record(sig: Sig) -> OpRecord:
        name, _, dtype, shape = sig
        return OpRecord(name, shape, shape, dtype)

    def describe(self) -> str:
        return f"gather({_fmt(self.input)}, gather_list={_fmt_list(self.outputs)}, dst={self.dst})"

    @property
    def nbytes(self) -> int:
        return self.input.nbytes

    @staticmethod
    @_no_grad
    def run(calls: Sequence[Gather]) -> list[None]:
        outs = calls[calls[0].dst].outputs
        assert outs is not None  # validated on the calling rank
        inputs = [c.input.clone() for c in calls]
        for out, x in zip(outs, inputs, strict=True):
            out.copy_(x)
        return [None] * len(calls)


@dataclass(slots=True)
class Scatter(_Base):
    name: ClassVar[str] = "scatter"
    output: torch.Tensor
    inputs: list[torch.Tensor] | None
    src: int

    def signature(self) -> Hashable:
        return (self.name, self.src, self.output.dtype, _shape(self.output))

    @staticmethod
    def record(sig: Sig) -> OpRecord:
        name, _, dtype, shape = sig
        return OpRecord(name, shape, shape, dtype)

    def describe(self) -> str:
        return f"scatter({_fmt(self.output)}, scatter_list={_fmt_list(self.inputs)}, src={self.src})"

    @property
    def nbytes(self) -> int:
        return self.output.nbytes

    @staticmethod
    @_no_grad
    def run(calls: Sequence[Scatter]) -> list[None]:
        ins = calls[calls[0].src].inputs
        assert ins is not None  # validated on the calling rank
        chunks = [x.clone() for x in ins]
        for c, x in zip(calls, chunks, strict=True):
            c.output.copy_(x)
        return [None] * len(calls)


@dataclass(slots=True)
class ReduceScatter(_Base):
    name: ClassVar[str] = "reduce_scatter"
    output: torch.Tensor
    inputs: list[torch.Tensor]
    op: Reduction

    def signature(self) -> Hashable:
        # (ranks' outputs may differ in shape, input i being rank i's: the inputs must agree)
        return (self.name, self.op.kind, self.output.dtype, tuple(_shape(x) for x in self.inputs))

    @staticmethod
    def record(sig: Sig) -> OpRecord:
        name, _, dtype, shapes = sig
        if not shapes or any(sh != shapes[0] for sh in shapes):
            return OpRecord(name, None, None, dtype)  # outputs of several shapes: each rank's own
        return OpRecord(name, (len(shapes), *shapes[0]), tuple(shapes[0]), dtype)

    def describe(self) -> str:
        return f"reduce_scatter({_fmt(self.output)}, {_fmt_list(self.inputs)}, op={self.op!r})"

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in self.inputs)

    @staticmethod
    @_no_grad
    def run(calls: Sequence[ReduceScatter]) -> list[None]:
        red = calls[0].op
        fs = factors(calls)
        results = [reduce_tensors([c.inputs[r] for c in calls], red, fs) for r in range(len(calls))]
        for c, res in zip(calls, results, strict=True):
            c.output.copy_(res)
        return [None] * len(calls)


@dataclass(slots=True)
class ReduceScatterTensor(_Base):
    name: ClassVar[str] = "reduce_scatter_tensor"
    output: torch.Tensor
    input: torch.Tensor
    op: Reduction

    def signature(self) -> Hashable:
        return (self.name, self.op.kind, self.output.dtype, _shape(self.output), _shape(self.input))

    @staticmethod
    def record(sig: Sig) -> OpRecord:
        name, _, dtype, out, inp = sig
        return OpRecord(name, inp, out, dtype)

    def describe(self) -> str:
        return f"reduce_scatter_tensor({_fmt(self.output)}, {_fmt(self.input)}, op={self.op!r})"

    @property
    def nbytes(self) -> int:
        return self.input.nbytes

    @staticmethod
    @_no_grad
    def run(calls: Sequence[ReduceScatterTensor]) -> list[None]:
        w = len(calls)
        parts = [c.input.reshape(w, -1) for c in calls]
        res = reduce_tensors(parts, calls[0].op, factors(calls))
        for r, c in enumerate(calls):
            c.output.copy_(res[r].view(c.output.shape))
        return [None] * w


@dataclass(slots=True)
class AllToAll(_Base):
    name: ClassVar[str] = "all_to_all"
    outputs: list[torch.Tensor]
    inputs: list[torch.Tensor]

    def signature(self) -> Hashable:
        return (self.name, self.inputs[0].dtype if self.inputs else None, len(self.outputs))

    @staticmethod
    def record(sig: Sig) -> OpRecord:
        name, dtype, _ = sig
        return OpRecord(name, None, None, dtype)

    def describe(self) -> str:
        return f"all_to_all({_fmt_list(self.outputs)}, {_fmt_list(self.inputs)})"

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.inputs)

    @staticmethod
    def check(calls: Sequence[AllToAll]) -> str | None:
        for r, c in enumerate(calls):
            for j, out in enumerate(c.outputs):
                src = calls[j].inputs[r]
                if out.shape != src.shape:
                    return (
                        f"rank {r}'s output_tensor_list[{j}] has shape {list(out.shape)} but "
                        f"rank {j}'s input_tensor_list[{r}] has shape {list(src.shape)}"
                    )
        return None

    @staticmethod
    @_no_grad
    def run(calls: Sequence[AllToAll]) -> list[None]:
        sent = [[x.clone() for x in c.inputs] for c in calls]
        for r, c in enumerate(calls):
            for j, out in enumerate(c.outputs):
                out.copy_(sent[j][r])
        return [None] * len(calls)


@dataclass(slots=True)
class AllToAllSingle(_Base):
    name: ClassVar[str] = "all_to_all_single"
    output: torch.Tensor
    input: torch.Tensor
    output_splits: list[int]
    input_splits: list[int]

    def signature(self) -> Hashable:
        return (self.name, self.input.dtype, _shape(self.input)[1:], _shape(self.output)[1:])

    @staticmethod
    def record(sig: Sig) -> OpRecord:
        name, dtype, _, _ = sig
        return OpRecord(name, None, None, dtype)

    def describe(self) -> str:
        return (
            f"all_to_all_single({_fmt(self.output)}, {_fmt(self.input)}, "
            f"output_split_sizes={self.output_splits}, input_split_sizes={self.input_splits})"
        )

    @property
    def nbytes(self) -> int:
        return self.input.nbytes

    @staticmethod
    def check(calls: Sequence[AllToAllSingle]) -> str | None:
        for r, c in enumerate(calls):
            for j, n in enumerate(c.output_splits):
                sent = calls[j].input_splits[r]
                if n != sent:
                    return (
                        f"rank {r} expects {n} rows from rank {j} (output_split_sizes[{j}]) but "
                        f"rank {j} sends {sent} (input_split_sizes[{r}])"
                    )
        return None

    @staticmethod
    @_no_grad
    def run(calls: Sequence[AllToAllSingle]) -> list[None]:
        sent = [list(torch.split(c.input.clone(), c.input_splits)) for c in calls]
        for r, c in enumerate(calls):
            offset = 0
            for j, n in enumerate(c.output_splits):
                c.output[offset : offset + n].copy_(sent[j][r])
                offset += n
        return [None] * len(calls)


@dataclass(slots=True)
class Barrier(_Base):
    name: ClassVar[str] = "barrier"

    def signature(self) -> Hashable:
        return self.name

    def describe(self) -> str:
        return "barrier()"

    @staticmethod
    def run(calls: Sequence[Barrier]) -> list[None]:
        return [None] * len(calls)


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


@dataclass(slots=True)
class Send(_Base):
    name: ClassVar[str] = "send"
    tensor: torch.Tensor
    dst: int
    tag: int

    def describe(self) -> str:
        return str(self.record_info())

    def record_info(self) -> P2PRecord:
        """This call as records show it (p2p calls are recorded one by one, not by signature)."""
        return P2PRecord(self.name, self.tensor.dtype, _shape(self.tensor), self.dst, self.tag)

    def signature(self) -> Hashable:
        return (self.name, self.dst, self.tag)


@dataclass(slots=True)
class Recv(_Base):
    name: ClassVar[str] = "recv"
    tensor: torch.Tensor
    src: int | None
    tag: int

    def describe(self) -> str:
        return str(self.record_info())

    def record_info(self) -> P2PRecord:
        """This call as records show it (p2p calls are recorded one by one, not by signature)."""
        return P2PRecord(self.name, self.tensor.dtype, _shape(self.tensor), self.src, self.tag)

    def signature(self) -> Hashable:
        return (self.name, self.src, self.tag)


def check_transfer(send: Send, recv: Recv) -> str | None:
    """Why a matched send and recv cannot transfer, or None.

    The dtypes and element counts must agree; shapes may differ, as with gloo and NCCL,
    which move the elements in order (torch 2.10's pipelining sends a 0-d loss into a
    receive buffer of shape [1]).
    """
    if send.tensor.dtype != recv.tensor.dtype or send.tensor.numel() != recv.tensor.numel():
        return f"send of {_fmt(send.tensor)} matched a recv into {_fmt(recv.tensor)}"
    return None


@_no_grad
def transfer(send: Send, recv: Recv) -> None:
    """Move a matched send's data into its recv (elements in order, whatever the shapes)."""
    recv.tensor.copy_(send.tensor.reshape(recv.tensor.shape))


OPS: tuple[type[_Base], ...] = (
    AllReduce,
    Reduce,
    Broadcast,
    AllGather,
    AllGatherIntoTensor,
    Gather,
    Scatter,
    ReduceScatter,
    ReduceScatterTensor,
    AllToAll,
    AllToAllSingle,
    Barrier,
    BroadcastObject,
    AllGatherObject,
    GatherObject,
    ScatterObject,
    NewGroup,
    Split,
)

_OPS_BY_NAME: dict[str, type[_Base]] = {op.name: op for op in OPS}


def record_of(sig: Hashable) -> OpRecord | P2PRecord | None:
    """How records show a call of signature ``sig``; None if no op made it.

    ``sig`` is a collective's ``signature()`` (maybe another process's: signatures travel
    in cross-process reports) or a p2p call's ``record_info()``.
    """
    if isinstance(sig, P2PRecord):
        return sig
    if isinstance(sig, str):
        sig = (sig,)
    if not (isinstance(sig, tuple) and sig and isinstance(sig[0], str)):
        return None
    op = _OPS_BY_NAME.get(sig[0])
    return None if op is None else op.record(sig)
