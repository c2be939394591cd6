"""The collectives over tensors: all_reduce, reduce, broadcast, the gathers and scatters,
all_to_all, barrier. Each ``run`` reads every input before it writes any output."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from .. import _torch
from ._base import (
    _SUM,
    OpRecord,
    Sig,
    _Base,
    _fmt,
    _fmt_list,
    _no_grad,
    _shape,
    _shares_storage,
)
from ._reduce import Reduction, chains, copy_to_all, disjoint, factors, reduce_tensors

__all__ = [
    "AllGather",
    "AllGatherIntoTensor",
    "AllReduce",
    "AllToAll",
    "AllToAllSingle",
    "Barrier",
    "Broadcast",
    "Gather",
    "Reduce",
    "ReduceScatter",
    "ReduceScatterTensor",
    "Scatter",
]


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
