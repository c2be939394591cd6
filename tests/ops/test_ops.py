"""Loop-free unit tests of the op semantics in ``aiocoll._ops``.

Every test calls ``Op.run`` / ``Op.check`` / ``reduce_tensors`` / ``Reduction`` directly,
with one call object per rank, and compares against values worked out by hand or in
plain Python (never through the library's own reduction code).
"""

from __future__ import annotations

import itertools
import math
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.distributed as dist

from aiocoll import InvalidArgumentError
from aiocoll import _ops as ops
from aiocoll._ops import (
    OPS,
    AllGather,
    AllGatherIntoTensor,
    AllGatherObject,
    AllReduce,
    AllToAll,
    AllToAllSingle,
    Barrier,
    Broadcast,
    BroadcastObject,
    Gather,
    GatherObject,
    NewGroup,
    Partition,
    Reduce,
    ReduceScatter,
    ReduceScatterTensor,
    Reduction,
    Scatter,
    ScatterObject,
    Split,
    dumps,
    reduce_tensors,
)

R = dist.ReduceOp
KINDS = {
    "SUM": R.SUM,
    "AVG": R.AVG,
    "PRODUCT": R.PRODUCT,
    "MIN": R.MIN,
    "MAX": R.MAX,
    "BAND": R.BAND,
    "BOR": R.BOR,
    "BXOR": R.BXOR,
}
SUM = Reduction.of("sum")

FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
INTS = [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64]
COMPLEX = [torch.complex64, torch.complex128]
ALL_DTYPES = [*FLOATS, *INTS, torch.bool, *COMPLEX]


def rank_tensor(rank: int, shape: Sequence[int], dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    """A tensor whose values depend on ``rank`` and ``seed`` (small integers: exact in every dtype)."""
    n = math.prod(shape)
    vals = [((seed * 31 + rank * 7 + i * 3) % 11) - 3 for i in range(n)]
    if dtype == torch.bool:
        return torch.tensor([v > 1 for v in vals], dtype=torch.bool).reshape(tuple(shape))
    if dtype == torch.uint8:
        vals = [v + 3 for v in vals]
    return torch.tensor(vals, dtype=torch.int64).to(dtype).reshape(tuple(shape))


def wrap(v: int, dtype: torch.dtype) -> int:
    """``v`` wrapped into ``dtype``'s range, two's complement."""
    info = torch.iinfo(dtype)
    span = 1 << info.bits
    v = (v - info.min) % span + info.min
    return v


# -- Reduction.of ------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "kind"), KINDS.items())
def test_reduction_of_accepts_every_spelling(name: str, kind: Any) -> None:
    spellings = [kind, dist.ReduceOp(kind), name, name.lower(), name.capitalize()]
    for s in spellings:
        r = Reduction.of(s)
        assert r.kind == kind, s
        assert r.factor is None
        assert r.name == name
        assert repr(r) == f"ReduceOp.{name}"
    # an already normalised Reduction passes through unchanged
    r = Reduction.of(name)
    assert Reduction.of(r) is r


@pytest.mark.parametrize("factor", [2.5, torch.tensor(0.25), torch.tensor([3.0]).squeeze()])
def test_reduction_of_premul_sum_keeps_factor(factor: float | torch.Tensor) -> None:
    r = Reduction.of(dist._make_nccl_premul_sum(factor))
    assert r.kind == R.PREMUL_SUM
    assert r.name == "PREMUL_SUM"
    f = r.factor.item() if isinstance(r.factor, torch.Tensor) else r.factor
    expected = factor.item() if isinstance(factor, torch.Tensor) else factor
    assert f == expected
    assert repr(r) == f"ReduceOp.PREMUL_SUM({expected})"


@pytest.mark.parametrize(
    "bad",
    ["premul_sum", "PREMUL_SUM", R.PREMUL_SUM, "mean", "", "sum ", 0, 1.0, None, object(), [R.SUM]],
    # not repr alone: an object's repr holds its address, which differs between pytest -n's workers
    ids=lambda bad: "object()" if type(bad) is object else repr(bad),
)
def test_reduction_of_rejects_unknown(bad: object) -> None:
    with pytest.raises(InvalidArgumentError, match="argument 'op'"):
        Reduction.of(bad)


def test_invalid_argument_error_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="unknown reduce op"):
        Reduction.of("nope")


# -- Reduction.check_dtype --------------------------------------------------------------


def dtype_allowed(kind_name: str, dtype: torch.dtype) -> bool:
    """The documented table, written out independently of the implementation."""
    is_float = dtype in FLOATS
    is_complex = dtype in COMPLEX
    is_intlike = dtype in INTS or dtype == torch.bool
    if kind_name in ("BAND", "BOR", "BXOR"):
        return is_intlike
    if kind_name in ("AVG", "PREMUL_SUM"):
        return is_float or is_complex
    if kind_name in ("MIN", "MAX"):
        return not is_complex
    return True  # SUM, PRODUCT


@pytest.mark.parametrize("kind_name", [*KINDS, "PREMUL_SUM"])
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_check_dtype_table(kind_name: str, dtype: torch.dtype) -> None:
    red = Reduction.of(dist._make_nccl_premul_sum(2.0)) if kind_name == "PREMUL_SUM" else Reduction.of(kind_name)
    if dtype_allowed(kind_name, dtype):
        red.check_dtype(dtype, "op")
    else:
        with pytest.raises(InvalidArgumentError, match=f"argument 'op': {kind_name}"):
            red.check_dtype(dtype, "op")


UNREDUCIBLE = [torch.uint16, torch.uint32, torch.uint64, torch.complex32, torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("kind_name", [*KINDS, "PREMUL_SUM"])
@pytest.mark.parametrize("dtype", UNREDUCIBLE, ids=str)
def test_check_dtype_rejects_dtypes_torch_cannot_reduce(kind_name: str, dtype: torch.dtype) -> None:
    # torch has no CPU reduction kernels for these: reject up front, not inside run()
    red = Reduction.of(dist._make_nccl_premul_sum(2.0)) if kind_name == "PREMUL_SUM" else Reduction.of(kind_name)
    with pytest.raises(InvalidArgumentError, match=f"argument 'op': {kind_name}"):
        red.check_dtype(dtype, "op")


# -- reduce_tensors ---------------------------------------------------------------------


@pytest.mark.parametrize("world", [1, 2, 3])
def test_bool_semantics(world: int) -> None:
    # every combination of `world` bools, one element per combination
    combos = list(itertools.product([False, True], repeat=world))
    tensors = [torch.tensor([c[r] for c in combos], dtype=torch.bool) for r in range(world)]
    expected = {
        "SUM": [any(c) for c in combos],
        "MAX": [any(c) for c in combos],
        "BOR": [any(c) for c in combos],
        "PRODUCT": [all(c) for c in combos],
        "MIN": [all(c) for c in combos],
        "BAND": [all(c) for c in combos],
        "BXOR": [sum(c) % 2 == 1 for c in combos],
    }
    for name, exp in expected.items():
        res = reduce_tensors(tensors, Reduction.of(name))
        assert res.dtype == torch.bool, name
        assert res.tolist() == exp, name


@pytest.mark.parametrize(
    ("dtype", "values"),
    [
        (torch.int8, [[100, -100, 127], [100, -100, 1], [100, -29, 0]]),
        (torch.uint8, [[200, 255, 17], [100, 1, 255], [0, 255, 255]]),
        (torch.int16, [[30000, -32768, 7], [30000, -1, 9], [30000, 5, 11]]),
        (torch.int32, [[2**31 - 1, -(2**31), 65536], [1, -1, 65536], [2**30, 3, 2]]),
        (torch.int64, [[2**63 - 1, -(2**63), 2**32], [1, -1, 2**32], [2**62, 5, 2**3]]),
    ],
    ids=str,
)
def test_integer_wraparound_keeps_dtype(dtype: torch.dtype, values: list[list[int]]) -> None:
    tensors = [torch.tensor(v, dtype=dtype) for v in values]
    cols = list(zip(*values, strict=True))
    s = reduce_tensors(tensors, Reduction.of("sum"))
    p = reduce_tensors(tensors, Reduction.of("product"))
    assert s.dtype == dtype
    assert p.dtype == dtype
    assert s.tolist() == [wrap(sum(c), dtype) for c in cols]
    assert p.tolist() == [wrap(math.prod(c), dtype) for c in cols]
    # and the bitwise ops, on the two's complement bits
    for name, fn in (("BAND", int.__and__), ("BOR", int.__or__), ("BXOR", int.__xor__)):
        res = reduce_tensors(tensors, Reduction.of(name))
        assert res.dtype == dtype
        exp = [wrap(fn(fn(c[0], c[1]), c[2]), dtype) for c in cols]
        assert res.tolist() == exp, name
    assert reduce_tensors(tensors, Reduction.of("min")).tolist() == [min(c) for c in cols]
    assert reduce_tensors(tensors, Reduction.of("max")).tolist() == [max(c) for c in cols]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.complex64])
def test_float_reductions(dtype: torch.dtype) -> None:
    values = [[1.5, -2.0, 0.25, 8.0], [0.5, 3.0, -0.5, 0.125], [2.0, 1.0, 4.0, -1.0]]
    tensors = [torch.tensor(v, dtype=dtype) for v in values]
    cols = list(zip(*values, strict=True))
    exp = {
        "SUM": [sum(c) for c in cols],
        "AVG": [sum(c) / 3 for c in cols],
        "PRODUCT": [math.prod(c) for c in cols],
    }
    if not dtype.is_complex:
        exp["MIN"] = [min(c) for c in cols]
        exp["MAX"] = [max(c) for c in cols]
    for name, e in exp.items():
        res = reduce_tensors(tensors, Reduction.of(name))
        assert res.dtype == dtype, name
        assert res.tolist() == pytest.approx(e, rel=1e-6), name
    factors = [2.0, -0.5, 0.25]
    res = reduce_tensors(tensors, Reduction.of(dist._make_nccl_premul_sum(1.0)), factors)
    assert res.dtype == dtype
    assert res.tolist() == pytest.approx([sum(f * x for f, x in zip(factors, c, strict=True)) for c in cols])


def test_premul_sum_accepts_tensor_factors() -> None:
    tensors = [torch.tensor([1.0, 2.0]), torch.tensor([10.0, 20.0])]
    factors = [torch.tensor(3.0), torch.tensor(0.5)]
    res = reduce_tensors(tensors, Reduction.of(dist._make_nccl_premul_sum(torch.tensor(1.0))), factors)
    assert res.tolist() == [8.0, 16.0]


def test_complex_sum_and_product() -> None:
    a = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64)
    b = torch.tensor([2 - 1j, 1j], dtype=torch.complex64)
    assert reduce_tensors([a, b], Reduction.of("sum")).tolist() == [3 + 1j, 3 + 0j]
    assert reduce_tensors([a, b], Reduction.of("product")).tolist() == [(1 + 2j) * (2 - 1j), (3 - 1j) * 1j]


@pytest.mark.parametrize("kind_name", [*KINDS, "PREMUL_SUM"])
@pytest.mark.parametrize("world", [1, 3])
def test_reduce_tensors_returns_a_fresh_tensor(kind_name: str, world: int) -> None:
    dtype = torch.int32 if kind_name in ("BAND", "BOR", "BXOR") else torch.float32
    red = Reduction.of(dist._make_nccl_premul_sum(1.0)) if kind_name == "PREMUL_SUM" else Reduction.of(kind_name)
    tensors = [rank_tensor(r, (2, 3), dtype) for r in range(world)]
    before = [t.clone() for t in tensors]
    res = reduce_tensors(tensors, red, [1.0] * world)
    assert res.shape == (2, 3)
    assert res.dtype == dtype
    res.fill_(99)
    for t, b in zip(tensors, before, strict=True):
        assert torch.equal(t, b), kind_name


@pytest.mark.parametrize("shape", [(), (0,), (3, 0), (2, 1, 3)], ids=str)
def test_reduce_tensors_keeps_shape(shape: tuple[int, ...]) -> None:
    tensors = [rank_tensor(r, shape) for r in range(3)]
    res = reduce_tensors(tensors, Reduction.of("max"))
    assert res.shape == shape
    flat = [t.reshape(-1).tolist() for t in tensors]
    assert res.reshape(-1).tolist() == [max(c) for c in zip(*flat, strict=True)]


# -- the collectives, one call object per rank ----------------------------------------


def test_all_reduce_run() -> None:
    ts = [rank_tensor(r, (2, 3)) for r in range(4)]
    exp = sum(t.to(torch.float64) for t in ts)
    calls = [AllReduce(t, SUM) for t in ts]
    assert AllReduce.check(calls) is None
    assert AllReduce.run(calls) == [None] * 4
    for t in ts:
        assert torch.equal(t, exp.to(torch.float32))


def test_all_reduce_premul_sum_uses_each_ranks_factor() -> None:
    ts = [torch.full((2,), float(r + 1)) for r in range(3)]
    factors = [0.5, 2.0, -1.0]
    calls = [AllReduce(t, Reduction.of(dist._make_nccl_premul_sum(f))) for t, f in zip(ts, factors, strict=True)]
    AllReduce.run(calls)
    exp = 0.5 * 1 + 2.0 * 2 - 1.0 * 3
    for t in ts:
        assert t.tolist() == [exp, exp]


@pytest.mark.parametrize("dst", [0, 2])
def test_reduce_run_only_writes_dst(dst: int) -> None:
    ts = [rank_tensor(r, (5,), torch.int64) for r in range(3)]
    orig = [t.clone() for t in ts]
    Reduce.run([Reduce(t, dst, Reduction.of("max")) for t in ts])
    exp = torch.tensor([max(o[i].item() for o in orig) for i in range(5)])
    for r, t in enumerate(ts):
        assert torch.equal(t, exp if r == dst else orig[r])


@pytest.mark.parametrize("src", [0, 1, 3])
def test_broadcast_run(src: int) -> None:
    ts = [rank_tensor(r, (3, 2), torch.bfloat16) for r in range(4)]
    orig = ts[src].clone()
    assert Broadcast.run([Broadcast(t, src) for t in ts]) == [None] * 4
    for t in ts:
        assert torch.equal(t, orig)
    assert ts[0].data_ptr() != ts[1].data_ptr()


def test_all_gather_uneven_shapes() -> None:
    shapes = [(1, 2), (3,), ()]
    ins = [rank_tensor(r, s) for r, s in enumerate(shapes)]
    outs = [[torch.empty(s) for s in shapes] for _ in shapes]
    calls = [AllGather(o, x) for o, x in zip(outs, ins, strict=True)]
    assert AllGather.check(calls) is None
    AllGather.run(calls)
    for o in outs:
        for got, x in zip(o, ins, strict=True):
            assert torch.equal(got, x)
            assert got.data_ptr() != x.data_ptr()


def test_all_gather_check_reports_shape_mismatch() -> None:
    ins = [torch.zeros(2), torch.zeros(3)]
    outs = [[torch.zeros(2), torch.zeros(3)], [torch.zeros(2), torch.zeros(2)]]
    msg = AllGather.check([AllGather(o, x) for o, x in zip(outs, ins, strict=True)])
    assert msg is not None
    assert "rank 1's tensor_list[1]" in msg
    assert "rank 1 contributes shape [3]" in msg


@pytest.mark.parametrize("layout", ["concat", "stack"])
def test_all_gather_into_tensor_run(layout: str) -> None:
    w = 3
    ins = [rank_tensor(r, (2, 2)) for r in range(w)]
    oshape = (w * 2, 2) if layout == "concat" else (w, 2, 2)
    outs = [torch.empty(oshape) for _ in range(w)]
    AllGatherIntoTensor.run([AllGatherIntoTensor(o, x) for o, x in zip(outs, ins, strict=True)])
    exp = torch.cat(ins) if layout == "concat" else torch.stack(ins)
    for o in outs:
        assert torch.equal(o, exp)


def test_all_gather_into_tensor_0d_inputs() -> None:
    ins = [torch.tensor(float(r) * 1.5) for r in range(4)]
    outs = [torch.empty(4) for _ in range(4)]
    AllGatherIntoTensor.run([AllGatherIntoTensor(o, x) for o, x in zip(outs, ins, strict=True)])
    for o in outs:
        assert o.tolist() == [0.0, 1.5, 3.0, 4.5]


@pytest.mark.parametrize("dst", [0, 2])
def test_gather_run(dst: int) -> None:
    ins = [rank_tensor(r, (2,), torch.int32) for r in range(3)]
    gl = [torch.zeros(2, dtype=torch.int32) for _ in range(3)]
    calls = [Gather(x, gl if r == dst else None, dst) for r, x in enumerate(ins)]
    assert Gather.run(calls) == [None] * 3
    for got, x in zip(gl, ins, strict=True):
        assert torch.equal(got, x)


@pytest.mark.parametrize("src", [0, 1])
def test_scatter_run(src: int) -> None:
    w = 3
    chunks = [rank_tensor(10 + r, (2, 2), torch.float64) for r in range(w)]
    outs = [torch.zeros(2, 2, dtype=torch.float64) for _ in range(w)]
    Scatter.run([Scatter(o, chunks if r == src else None, src) for r, o in enumerate(outs)])
    for o, c in zip(outs, chunks, strict=True):
        assert torch.equal(o, c)
        assert o.data_ptr() != c.data_ptr()


def test_reduce_scatter_run() -> None:
    w = 3
    ins = [[rank_tensor(r * w + j, (4,), torch.int64) for j in range(w)] for r in range(w)]
    outs = [torch.zeros(4, dtype=torch.int64) for _ in range(w)]
    ReduceScatter.run([ReduceScatter(o, i, SUM) for o, i in zip(outs, ins, strict=True)])
    for j, o in enumerate(outs):
        exp = [sum(ins[r][j][k].item() for r in range(w)) for k in range(4)]
        assert o.tolist() == exp


@pytest.mark.parametrize("layout", ["concat", "stack"])
def test_reduce_scatter_tensor_run(layout: str) -> None:
    w = 4
    ishape = (w * 2, 3) if layout == "concat" else (w, 2, 3)
    ins = [rank_tensor(r, ishape, torch.int32) for r in range(w)]
    outs = [torch.zeros(2, 3, dtype=torch.int32) for _ in range(w)]
    ReduceScatterTensor.run([ReduceScatterTensor(o, x, Reduction.of("min")) for o, x in zip(outs, ins, strict=True)])
    flat = [x.reshape(-1).tolist() for x in ins]
    for j, o in enumerate(outs):
        exp = [min(f[j * 6 + k] for f in flat) for k in range(6)]
        assert o.reshape(-1).tolist() == exp


def test_reduce_scatter_tensor_0d_output() -> None:
    ins = [torch.tensor([1.0, 2.0, 3.0]) * (r + 1) for r in range(3)]
    outs = [torch.tensor(0.0) for _ in range(3)]
    ReduceScatterTensor.run([ReduceScatterTensor(o, x, SUM) for o, x in zip(outs, ins, strict=True)])
    assert [o.item() for o in outs] == [6.0, 12.0, 18.0]
    assert all(o.shape == () for o in outs)


def test_all_to_all_uneven() -> None:
    w = 3
    # rank j sends (j + r) rows of 2 to rank r
    ins = [[rank_tensor(j * w + r, (j + r, 2)) for r in range(w)] for j in range(w)]
    outs = [[torch.empty(j + r, 2) for j in range(w)] for r in range(w)]
    calls = [AllToAll(o, i) for o, i in zip(outs, ins, strict=True)]
    assert AllToAll.check(calls) is None
    AllToAll.run(calls)
    for r in range(w):
        for j in range(w):
            assert torch.equal(outs[r][j], ins[j][r])


def test_all_to_all_check_reports_mismatch() -> None:
    ins = [[torch.zeros(1), torch.zeros(2)], [torch.zeros(1), torch.zeros(1)]]
    outs = [[torch.zeros(1), torch.zeros(2)], [torch.zeros(2), torch.zeros(1)]]
    msg = AllToAll.check([AllToAll(o, i) for o, i in zip(outs, ins, strict=True)])
    assert msg is not None
    assert "rank 0's output_tensor_list[1] has shape [2] but rank 1's input_tensor_list[0] has shape [1]" in msg


def a2a_reference(ins: list[torch.Tensor], splits: list[list[int]]) -> list[torch.Tensor]:
    """splits[j][r] rows go from rank j to rank r; build every rank's output by hand."""
    w = len(ins)
    outs = []
    for r in range(w):
        rows: list[list[Any]] = []
        for j in range(w):
            start = sum(splits[j][:r])
            rows.extend(ins[j][start + k].tolist() for k in range(splits[j][r]))
        tail = ins[0].shape[1:]
        outs.append(torch.tensor(rows, dtype=ins[0].dtype).reshape(len(rows), *tail))
    return outs


def a2a_calls(outs: list[torch.Tensor], ins: list[torch.Tensor], splits: list[list[int]]) -> list[AllToAllSingle]:
    w = len(ins)
    return [AllToAllSingle(outs[r], ins[r], [splits[j][r] for j in range(w)], list(splits[r])) for r in range(w)]


def test_all_to_all_single_uneven_splits() -> None:
    splits = [[0, 2, 1], [3, 0, 0], [1, 1, 2]]
    w = 3
    ins = [rank_tensor(r, (sum(splits[r]), 2), torch.int64) for r in range(w)]
    outs = [torch.full((sum(splits[j][r] for j in range(w)), 2), -1, dtype=torch.int64) for r in range(w)]
    calls = a2a_calls(outs, ins, splits)
    assert AllToAllSingle.check(calls) is None
    AllToAllSingle.run(calls)
    for got, exp in zip(outs, a2a_reference(ins, splits), strict=True):
        assert torch.equal(got, exp)


def test_all_to_all_single_check_reports_split_mismatch() -> None:
    ins = [torch.zeros(2), torch.zeros(2)]
    outs = [torch.zeros(2), torch.zeros(2)]
    calls = [AllToAllSingle(outs[0], ins[0], [1, 1], [1, 1]), AllToAllSingle(outs[1], ins[1], [2, 0], [1, 1])]
    msg = AllToAllSingle.check(calls)
    assert msg is not None
    assert "rank 1 expects 2 rows from rank 0" in msg


def test_barrier_run() -> None:
    assert Barrier.run([Barrier() for _ in range(5)]) == [None] * 5
    assert Barrier().signature() == Barrier().signature()


def test_signatures_distinguish_what_ranks_must_agree_on() -> None:
    a = AllReduce(torch.zeros(2), SUM).signature()
    assert a == AllReduce(torch.ones(2), SUM).signature()
    assert a != AllReduce(torch.zeros(3), SUM).signature()
    assert a != AllReduce(torch.zeros(2, dtype=torch.float64), SUM).signature()
    assert a != AllReduce(torch.zeros(2), Reduction.of("max")).signature()
    assert Broadcast(torch.zeros(2), 0).signature() != Broadcast(torch.zeros(2), 1).signature()
    # PREMUL_SUM factors are per rank: they do not enter the signature
    p1 = AllReduce(torch.zeros(2), Reduction.of(dist._make_nccl_premul_sum(1.0))).signature()
    p2 = AllReduce(torch.zeros(2), Reduction.of(dist._make_nccl_premul_sum(2.0))).signature()
    assert p1 == p2
    names = [op.name for op in OPS]
    assert len(set(names)) == len(names)


# -- aliasing: outputs that share memory with inputs -----------------------------------


@pytest.mark.parametrize("layout", ["concat", "stack"])
def test_all_gather_into_tensor_in_place(layout: str) -> None:
    w, n = 4, 3
    oshape = (w * n,) if layout == "concat" else (w, n)
    outs = [torch.full(oshape, -1.0) for _ in range(w)]
    ins = []
    for r, o in enumerate(outs):
        chunk = o[r * n : (r + 1) * n] if layout == "concat" else o[r]
        chunk.copy_(rank_tensor(r, (n,)))
        ins.append(chunk)
    exp = torch.cat([rank_tensor(r, (n,)) for r in range(w)]).reshape(oshape)
    AllGatherIntoTensor.run([AllGatherIntoTensor(o, x) for o, x in zip(outs, ins, strict=True)])
    for o in outs:
        assert torch.equal(o, exp)


def test_all_gather_in_place_list() -> None:
    w = 3
    ins = [rank_tensor(r, (2,)) for r in range(w)]
    originals = [x.clone() for x in ins]
    outs = [[ins[r] if j == r else torch.zeros(2) for j in range(w)] for r in range(w)]
    AllGather.run([AllGather(o, x) for o, x in zip(outs, ins, strict=True)])
    for o in outs:
        for got, exp in zip(o, originals, strict=True):
            assert torch.equal(got, exp)


def test_all_gather_input_aliases_a_slot_filled_from_another_rank() -> None:
    # rank r's input lives in its tensor_list[(r + 1) % w], which receives rank r+1's data:
    # the op must read every input before it writes any output
    w = 4
    outs = [[torch.zeros(2) for _ in range(w)] for _ in range(w)]
    ins = []
    for r in range(w):
        x = outs[r][(r + 1) % w]
        x.copy_(rank_tensor(r, (2,)))
        ins.append(x)
    AllGather.run([AllGather(o, x) for o, x in zip(outs, ins, strict=True)])
    for o in outs:
        for j, got in enumerate(o):
            assert torch.equal(got, rank_tensor(j, (2,)))


@pytest.mark.parametrize("layout", ["concat", "stack"])
def test_all_gather_into_tensor_input_in_another_chunk(layout: str) -> None:
    w, n = 3, 2
    oshape = (w * n,) if layout == "concat" else (w, n)
    outs = [torch.zeros(oshape) for _ in range(w)]
    ins = []
    for r, o in enumerate(outs):
        k = (r + 1) % w
        x = o[k * n : (k + 1) * n] if layout == "concat" else o[k]
        x.copy_(rank_tensor(r, (n,)))
        ins.append(x)
    exp = torch.cat([rank_tensor(r, (n,)) for r in range(w)]).reshape(oshape)
    AllGatherIntoTensor.run([AllGatherIntoTensor(o, x) for o, x in zip(outs, ins, strict=True)])
    for o in outs:
        assert torch.equal(o, exp)


def test_reduce_scatter_tensor_output_is_another_chunk_of_input() -> None:
    # every rank's output is the *first* chunk of its input, which other ranks' results read from
    w, n = 3, 2
    ins = [rank_tensor(r, (w * n,), torch.int64) for r in range(w)]
    flat = [x.tolist() for x in ins]
    outs = [x[:n] for x in ins]
    ReduceScatterTensor.run([ReduceScatterTensor(o, x, SUM) for o, x in zip(outs, ins, strict=True)])
    for j in range(w):
        assert outs[j].tolist() == [sum(f[j * n + k] for f in flat) for k in range(n)]


@pytest.mark.parametrize("op_name", ["sum", "max", "bxor"])
def test_reduce_scatter_tensor_output_is_chunk_of_input(op_name: str) -> None:
    w, n = 3, 4
    ins = [rank_tensor(r, (w * n,), torch.int32) for r in range(w)]
    flat = [x.tolist() for x in ins]
    outs = [ins[r][r * n : (r + 1) * n] for r in range(w)]
    fn: Callable[[list[int]], int] = {
        "sum": sum,
        "max": max,
        "bxor": lambda c: c[0] ^ c[1] ^ c[2],
    }[op_name]
    exp = [[fn([f[j * n + k] for f in flat]) for k in range(n)] for j in range(w)]
    ReduceScatterTensor.run([ReduceScatterTensor(o, x, Reduction.of(op_name)) for o, x in zip(outs, ins, strict=True)])
    for j in range(w):
        assert outs[j].tolist() == exp[j]
        # the rest of the input is untouched
        rest = [v for k, v in enumerate(ins[j].tolist()) if not j * n <= k < (j + 1) * n]
        assert rest == [v for k, v in enumerate(flat[j]) if not j * n <= k < (j + 1) * n]


def test_reduce_scatter_output_is_one_of_its_inputs() -> None:
    w = 3
    ins = [[rank_tensor(r * w + j, (3,)) for j in range(w)] for r in range(w)]
    orig = [[x.clone() for x in row] for row in ins]
    outs = [ins[r][r] for r in range(w)]
    ReduceScatter.run([ReduceScatter(o, i, SUM) for o, i in zip(outs, ins, strict=True)])
    for j in range(w):
        exp = sum(orig[r][j] for r in range(w))
        assert torch.equal(outs[j], exp)


@pytest.mark.parametrize(
    "splits",
    [[[1, 1, 1], [1, 1, 1], [1, 1, 1]], [[0, 2, 1], [2, 1, 0], [1, 0, 3]], [[2, 0], [0, 1]]],
    ids=["even", "uneven", "self-only"],
)
def test_all_to_all_single_output_is_input(splits: list[list[int]]) -> None:
    # symmetric split matrices: every rank receives as many rows as it sends
    w = len(splits)
    ins = [rank_tensor(r, (sum(splits[r]), 3)) for r in range(w)]
    exp = a2a_reference([x.clone() for x in ins], splits)
    AllToAllSingle.run(a2a_calls(ins, ins, splits))
    for got, e in zip(ins, exp, strict=True):
        assert torch.equal(got, e)


def test_all_to_all_output_list_is_input_list() -> None:
    w = 3
    ins = [[rank_tensor(j * w + r, (2,)) for r in range(w)] for j in range(w)]
    orig = [[x.clone() for x in row] for row in ins]
    AllToAll.run([AllToAll(row, row) for row in ins])
    for r in range(w):
        for j in range(w):
            assert torch.equal(ins[r][j], orig[j][r])


def test_gather_and_scatter_with_own_buffer_in_list() -> None:
    w = 3
    xs = [rank_tensor(r, (2,)) for r in range(w)]
    orig = [x.clone() for x in xs]
    gl = [xs[1] if j == 1 else torch.zeros(2) for j in range(w)]
    Gather.run([Gather(x, gl if r == 1 else None, 1) for r, x in enumerate(xs)])
    for got, e in zip(gl, orig, strict=True):
        assert torch.equal(got, e)

    outs = [torch.zeros(2) for _ in range(w)]
    chunks = [rank_tensor(20 + r, (2,)) for r in range(w)]
    chunk_orig = [c.clone() for c in chunks]
    outs[0] = chunks[0]  # the source's own output is its scatter_list[0]
    Scatter.run([Scatter(o, chunks if r == 0 else None, 0) for r, o in enumerate(outs)])
    for o, e in zip(outs, chunk_orig, strict=True):
        assert torch.equal(o, e)


# -- non-contiguous tensors -------------------------------------------------------------


def strided(x: torch.Tensor) -> torch.Tensor:
    """A non-contiguous tensor with ``x``'s values (every other element of a bigger buffer)."""
    buf = torch.zeros((*x.shape[:-1], 2 * x.shape[-1]), dtype=x.dtype)
    out = buf[..., ::2]
    out.copy_(x)
    assert not out.is_contiguous()
    return out


def test_all_reduce_transposed() -> None:
    bases = [rank_tensor(r, (3, 4)) for r in range(3)]
    ts = [b.t() for b in bases]
    exp = sum(b.t().clone() for b in bases)
    AllReduce.run([AllReduce(t, SUM) for t in ts])
    for t, b in zip(ts, bases, strict=True):
        assert not t.is_contiguous()
        assert torch.equal(t, exp)
        assert torch.equal(b, exp.t())  # written through the view


def test_all_gather_into_tensor_strided_input_and_output() -> None:
    w = 3
    ins = [rank_tensor(r, (4, 2)).t() for r in range(w)]  # (2, 4), transposed view
    outs = [strided(torch.zeros(w * 2, 4)) for _ in range(w)]
    exp = torch.cat([x.contiguous() for x in ins])
    AllGatherIntoTensor.run([AllGatherIntoTensor(o, x) for o, x in zip(outs, ins, strict=True)])
    for o in outs:
        assert torch.equal(o, exp)
    # the output written through a transposed view
    outs2 = [torch.zeros(4, w * 2).t() for _ in range(w)]
    AllGatherIntoTensor.run([AllGatherIntoTensor(o, x) for o, x in zip(outs2, ins, strict=True)])
    for o in outs2:
        assert torch.equal(o, exp)


def test_reduce_scatter_tensor_noncontiguous_input() -> None:
    w = 2
    ins = [rank_tensor(r, (3, 4), torch.int64).t() for r in range(w)]  # logical (4, 3)
    outs = [strided(torch.zeros(2, 3, dtype=torch.int64)) for _ in range(w)]
    ReduceScatterTensor.run([ReduceScatterTensor(o, x, SUM) for o, x in zip(outs, ins, strict=True)])
    total = ins[0].contiguous() + ins[1].contiguous()
    assert torch.equal(outs[0], total[:2])
    assert torch.equal(outs[1], total[2:])


def test_all_to_all_single_noncontiguous() -> None:
    splits = [[1, 2], [2, 0]]
    w = 2
    ins = [strided(rank_tensor(r, (sum(splits[r]), 3))) for r in range(w)]
    nrows = [sum(splits[j][r] for j in range(w)) for r in range(w)]
    outs = [torch.zeros(3, n).t() for n in nrows]  # rows are strided views of the buffer
    exp = a2a_reference([x.contiguous() for x in ins], splits)
    AllToAllSingle.run(a2a_calls(outs, ins, splits))
    for got, e in zip(outs, exp, strict=True):
        assert not got.is_contiguous()
        assert torch.equal(got, e)


def test_broadcast_scatter_gather_all_to_all_strided() -> None:
    w = 3
    ts = [strided(rank_tensor(r, (2, 3))) for r in range(w)]
    src = ts[2].clone()
    Broadcast.run([Broadcast(t, 2) for t in ts])
    assert all(torch.equal(t, src) for t in ts)

    chunks = [rank_tensor(r, (3, 2)).t() for r in range(w)]
    outs = [strided(torch.zeros(2, 3)) for _ in range(w)]
    Scatter.run([Scatter(o, chunks if r == 0 else None, 0) for r, o in enumerate(outs)])
    assert all(torch.equal(o, c) for o, c in zip(outs, chunks, strict=True))

    gl = [torch.zeros(3, 2).t() for _ in range(w)]
    Gather.run([Gather(x, gl if r == 0 else None, 0) for r, x in enumerate(chunks)])
    assert all(torch.equal(g, c) for g, c in zip(gl, chunks, strict=True))

    ins = [[strided(rank_tensor(j * w + r, (2, 2))) for r in range(w)] for j in range(w)]
    a2a_outs = [[torch.zeros(2, 2).t() for _ in range(w)] for _ in range(w)]
    AllToAll.run([AllToAll(o, i) for o, i in zip(a2a_outs, ins, strict=True)])
    for r in range(w):
        for j in range(w):
            assert torch.equal(a2a_outs[r][j], ins[j][r])


def test_reduce_and_reduce_scatter_strided() -> None:
    w = 3
    ts = [rank_tensor(r, (4, 2)).t() for r in range(w)]
    orig = [t.clone() for t in ts]
    Reduce.run([Reduce(t, 1, Reduction.of("product")) for t in ts])
    assert torch.equal(ts[1], orig[0] * orig[1] * orig[2])
    assert torch.equal(ts[0], orig[0])

    ins = [[strided(rank_tensor(r * w + j, (2, 2))) for j in range(w)] for r in range(w)]
    outs = [torch.zeros(2, 2).t() for _ in range(w)]
    ReduceScatter.run([ReduceScatter(o, i, SUM) for o, i in zip(outs, ins, strict=True)])
    for j in range(w):
        assert torch.equal(outs[j], sum(ins[r][j].contiguous() for r in range(w)))


# -- new_group and split ----------------------------------------------------------------


def expected_split(colors: list[Any], keys: list[Any]) -> tuple[tuple[int, ...] | None, ...]:
    groups: list[tuple[int, ...] | None] = []
    for c in colors:
        if c is None:
            groups.append(None)
            continue
        members = [q for q in range(len(colors)) if colors[q] == c]
        members.sort(key=lambda q: (keys[q], q))
        groups.append(tuple(members))
    return tuple(groups)


@pytest.mark.parametrize(
    ("colors", "keys"),
    [
        ([0, 1, 0, 1, 0], [0, 0, 0, 0, 0]),
        ([0, 1, 0, 1, 0], [5, 2, -1, 2, 3]),
        (["a", None, "b", "a", None, "b"], [1, 9, 0, 0, 9, 0]),
        ([None, None, None], [0, 1, 2]),
        ([7, 7, 7, 7], [3, 2, 1, 0]),
        ([(1, 2), 0, (1, 2)], [1.5, 0.0, -2.5]),
    ],
)
def test_split_partitions(colors: list[Any], keys: list[Any]) -> None:
    calls = [Split(c, k) for c, k in zip(colors, keys, strict=True)]
    assert Split.check(calls) is None
    parts = Split.run(calls)
    assert len(parts) == len(colors)
    exp = expected_split(colors, keys)
    for p in parts:
        assert isinstance(p, Partition)
        assert p.groups == exp
        assert p.colors == tuple(colors)


def test_split_ignores_keys_of_ranks_without_color() -> None:
    calls = [Split(0, 1), Split(None, "x"), Split(0, 0)]
    assert Split.check(calls) is None
    assert Split.run(calls)[0].groups == ((2, 0), None, (2, 0))


def test_split_check_rejects_incomparable_keys() -> None:
    msg = Split.check([Split(0, 1), Split(0, "a")])
    assert msg == "split keys must be mutually comparable, got int, str"
    # keys of one type that do not order are caught here too, not by a TypeError in run
    calls = [Split(0, 1j), Split(0, 2j)]
    msg = Split.check(calls)
    assert msg == "split keys must be mutually comparable, got complex"


def test_split_keys_of_different_but_comparable_types() -> None:
    calls = [Split(0, 1), Split(0, 0.5), Split(0, True), Split(1, "b"), Split(1, "a")]
    assert Split.check(calls) is None  # int/float/bool compare; str keys live in another color
    assert Split.run(calls)[0].groups == ((1, 0, 2), (1, 0, 2), (1, 0, 2), (4, 3), (4, 3))


@pytest.mark.parametrize(("world", "ranks"), [(4, (1, 3)), (3, (0, 1, 2)), (5, (4,)), (1, (0,))])
def test_new_group_partition(world: int, ranks: tuple[int, ...]) -> None:
    parts = NewGroup.run([NewGroup(ranks) for _ in range(world)])
    assert len(parts) == world
    for p in parts:
        assert p.groups == tuple(ranks if r in ranks else None for r in range(world))
        assert p.colors == tuple(0 if r in ranks else None for r in range(world))


# -- object collectives -------------------------------------------------------------------


def test_broadcast_object_gives_independent_copies() -> None:
    obj = {"a": [1, 2, 3], "t": torch.arange(3)}
    calls = [BroadcastObject(dumps(obj, "obj") if r == 1 else None, 1) for r in range(3)]
    res = BroadcastObject.run(calls)
    assert len(res) == 3
    for x in res:
        assert x["a"] == [1, 2, 3]
        assert torch.equal(x["t"], obj["t"])
        assert x is not obj
    res[0]["a"].append(4)
    res[0]["t"].add_(100)
    assert res[1]["a"] == [1, 2, 3]
    assert res[2]["t"].tolist() == [0, 1, 2]
    assert obj["a"] == [1, 2, 3]
    assert obj["t"].tolist() == [0, 1, 2]


def test_all_gather_object_gives_independent_copies() -> None:
    objs = [[r] * (r + 1) for r in range(3)]
    res = AllGatherObject.run([AllGatherObject(dumps(o, "obj")) for o in objs])
    assert res == [objs, objs, objs]
    res[0][1].append("x")
    assert res[1][1] == [1, 1]
    assert res[2][1] == [1, 1]
    assert objs[1] == [1, 1]
    assert res[0] is not res[1]


@pytest.mark.parametrize("dst", [0, 2])
def test_gather_object(dst: int) -> None:
    objs = [{"rank": r} for r in range(3)]
    res = GatherObject.run([GatherObject(dumps(o, "obj"), dst) for o in objs])
    for r, x in enumerate(res):
        if r == dst:
            assert x == objs
            assert all(a is not b for a, b in zip(x, objs, strict=True))
        else:
            assert x is None


def test_scatter_object() -> None:
    objs = [{"to": r, "data": [r]} for r in range(4)]
    payloads = [dumps(o, "objs") for o in objs]
    res = ScatterObject.run([ScatterObject(payloads if r == 2 else None, 2) for r in range(4)])
    assert res == objs
    res[2]["data"].append(0)
    assert objs[2]["data"] == [2]


def test_dumps_rejects_unpicklable() -> None:
    with pytest.raises(InvalidArgumentError, match="argument 'obj': object of type function cannot be pickled"):
        dumps(lambda: None, "obj")
    assert pickle.loads(dumps((1, "a"), "obj")) == (1, "a")


# -- autograd leaves ----------------------------------------------------------------------


def test_ops_write_into_leaves_that_require_grad() -> None:
    # like torch.distributed, collectives are not recorded by autograd
    ts = [torch.full((2,), float(r + 1), requires_grad=True) for r in range(3)]
    AllReduce.run([AllReduce(t, SUM) for t in ts])
    for t in ts:
        assert t.tolist() == [6.0, 6.0]
        assert t.requires_grad
        assert t.grad_fn is None
    outs = [torch.zeros(6, requires_grad=True) for _ in range(3)]
    AllGatherIntoTensor.run([AllGatherIntoTensor(o, t) for o, t in zip(outs, ts, strict=True)])
    assert all(o.tolist() == [6.0] * 6 for o in outs)


def _gather_into(inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> None:
    from aiocoll._ops import AllGatherIntoTensor

    AllGatherIntoTensor.run([AllGatherIntoTensor(o, i) for o, i in zip(outputs, inputs, strict=True)])


def test_all_gather_into_tensor_in_place_forms() -> None:
    # every rank passes the slice of its own output it contributes (FSDP's form)
    outs = [torch.zeros(6) for _ in range(3)]
    ins = [o[2 * r : 2 * r + 2] for r, o in enumerate(outs)]
    for r, x in enumerate(ins):
        x.fill_(r + 1)
    _gather_into(ins, outs)
    for o in outs:
        assert o.tolist() == [1, 1, 2, 2, 3, 3]


def test_all_gather_into_tensor_input_inside_rank0s_output_is_staged() -> None:
    # rank 1's input lives in rank 0's output, at a chunk that gets overwritten first
    out0 = torch.zeros(4)
    out1 = torch.zeros(4)
    x0 = torch.tensor([7.0, 8.0])
    x1 = out0[:2]
    x1.copy_(torch.tensor([5.0, 6.0]))
    _gather_into([x0, x1], [out0, out1])
    assert out0.tolist() == [7, 8, 5, 6]
    assert out1.tolist() == [7, 8, 5, 6]


def test_all_gather_into_tensor_2d_and_empty() -> None:
    ins = [torch.full((2, 3), float(r)) for r in range(2)]
    outs = [torch.zeros(4, 3) for _ in range(2)]
    _gather_into(ins, outs)
    assert outs[1][:, 0].tolist() == [0, 0, 1, 1]
    empty_outs = [torch.zeros(0) for _ in range(2)]
    _gather_into([torch.zeros(0), torch.zeros(0)], empty_outs)
    assert all(o.numel() == 0 for o in empty_outs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int8, torch.complex64])
def test_large_sums_add_in_rank_order(dtype: torch.dtype) -> None:
    from aiocoll._ops._reduce import _CHAIN_MIN, Reduction, reduce_tensors

    gen = torch.Generator().manual_seed(0)
    ts = [(torch.randn(_CHAIN_MIN, generator=gen) * 100).to(dtype) for _ in range(7)]
    expected = ts[0].clone()
    for t in ts[1:]:
        expected = expected + t  # a left fold: the rank order the docs promise
    got = reduce_tensors(ts, Reduction.of(dist.ReduceOp.SUM))
    assert torch.equal(got, expected)
    assert all(got.data_ptr() != t.data_ptr() for t in ts)  # a new tensor: outputs never alias inputs


def test_large_half_sums_accumulate_once() -> None:
    from aiocoll._ops._reduce import _CHAIN_MIN, Reduction, reduce_tensors

    ts = [torch.full((_CHAIN_MIN,), 0.1, dtype=torch.bfloat16) for _ in range(64)]
    got = reduce_tensors(ts, Reduction.of(dist.ReduceOp.SUM))
    # accumulated in float32 and rounded once, not rounded at every one of 63 adds
    assert torch.equal(got, torch.stack(ts).sum(0, dtype=torch.bfloat16))
    assert got[0].item() == pytest.approx(6.4, rel=1e-2)


def test_large_all_reduce_in_place_and_with_shared_storage() -> None:
    from aiocoll._ops import AllReduce
    from aiocoll._ops._reduce import _CHAIN_MIN, Reduction

    red = Reduction.of(dist.ReduceOp.SUM)
    ts = [torch.full((_CHAIN_MIN,), float(r + 1)) for r in range(3)]
    AllReduce.run([AllReduce(t, red) for t in ts])
    assert all(t[0].item() == 6.0 for t in ts)
    # ranks 0 and 2 pass views of the same memory: summing into rank 0's tensor would
    # change rank 2's input before it is read (giving (1 + 2) * 2 = 6), so the op stages
    buf = torch.ones(_CHAIN_MIN)
    a, c = buf[:], buf.view(-1)
    b = torch.full((_CHAIN_MIN,), 2.0)
    AllReduce.run([AllReduce(a, red), AllReduce(b, red), AllReduce(c, red)])
    assert a[0].item() == b[0].item() == c[0].item() == 4.0


def test_every_spelling_of_a_reduce_op_gets_the_canonical_kind() -> None:
    from aiocoll._ops import Reduction

    R = dist.ReduceOp
    for spelling in (R.SUM, dist.ReduceOp(R.SUM), "sum", pickle.loads(pickle.dumps(Reduction.of(R.SUM)))):
        # identity, not just equality: the ops' fast paths test "kind is SUM"
        assert Reduction.of(spelling).kind is R.SUM
    premul = pickle.loads(pickle.dumps(Reduction.of(dist._make_nccl_premul_sum(2.0))))
    assert premul.kind is R.PREMUL_SUM
    assert premul.factor == 2.0


def test_checked_reduction_caches_only_what_passed() -> None:
    # a cached SUM for float32 must not let an unsupported dtype through, before or after
    with pytest.raises(InvalidArgumentError, match="uint16"):
        ops.checked_reduction(dist.ReduceOp.SUM, torch.uint16)
    assert ops.checked_reduction(dist.ReduceOp.SUM, torch.float32).kind is dist.ReduceOp.SUM
    assert ops.checked_reduction(dist.ReduceOp.SUM, torch.float32) == ops.checked_reduction("sum", torch.float32)
    with pytest.raises(InvalidArgumentError, match="uint16"):
        ops.checked_reduction(dist.ReduceOp.SUM, torch.uint16)
    with pytest.raises(InvalidArgumentError, match="BAND"):
        ops.checked_reduction(dist.ReduceOp.BAND, torch.float32)
    # a ReduceOp object (what torch.distributed hands a backend) is unwrapped each time
    assert ops.checked_reduction(dist.ReduceOp(dist.ReduceOp.MAX), torch.int8).kind is dist.ReduceOp.MAX
