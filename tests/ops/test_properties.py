"""Property tests through the real engine: ``aiocoll.spawn`` on asyncio and uvloop.

Every rank builds its own inputs from (seed, rank), runs one collective, and returns
what it got. The expected values are computed here, independently, in plain Python:
exact integers wrapped to the dtype's width, ``math.fsum`` for float sums, Python
``min``/``max``/``any``/``all`` for the rest. Float results are compared with an error
bound derived from the dtype's epsilon and the magnitude of the summed terms.
"""

from __future__ import annotations

import functools
import math
import operator
import pickle
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import aiocoll
from aiocoll import Comm

R = dist.ReduceOp
FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
INTS = (torch.int8, torch.int32, torch.int64, torch.uint8)
DTYPES = (*FLOATS, *INTS, torch.bool, torch.complex64)
KINDS = ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM")
FACTORS = (0.5, -1.0, 0.25, 2.0, 3.0, -0.75, 1.0)


def allowed(kind: str, dtype: torch.dtype) -> bool:
    """Which reduce ops make sense for which dtypes (the documented table)."""
    if kind in ("BAND", "BOR", "BXOR"):
        return dtype in INTS or dtype == torch.bool
    if kind in ("AVG", "PREMUL_SUM"):
        return dtype in FLOATS or dtype.is_complex
    if kind in ("MIN", "MAX"):
        return not dtype.is_complex
    return True


VALID = [(k, d) for k in KINDS for d in DTYPES if allowed(k, d)]

SETTINGS = settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

Fn = Callable[[Comm], Coroutine[Any, Any, Any]]


def run(fn: Fn, world: int, loop: str) -> list[Any]:
    return aiocoll.spawn(fn, world=world, loop=loop, timeout=60)


# -- inputs -------------------------------------------------------------------------------


def make_input(
    seed: int, rank: int, shape: tuple[int, ...], dtype: torch.dtype, tag: int = 0, small: bool = False
) -> torch.Tensor:
    """A tensor that depends on (seed, rank, tag) only: every rank and the test can rebuild it.

    Floats have magnitudes in [0.5, 2] and a random sign (no over/underflow in any
    reduction of up to 8 ranks, even in float16); integers span most of the dtype's
    range, or [-3, 3] (``small``) so that products do not all wrap to zero.
    """
    g = torch.Generator().manual_seed((seed * 1_000_003 + rank * 1009 + tag) % (2**62))
    n = math.prod(shape)
    if dtype == torch.bool:
        x = torch.randint(0, 2, (n,), generator=g).bool()
    elif dtype in INTS:
        info = torch.iinfo(dtype)
        lo, hi = (max(info.min, -3), 3) if small else (max(info.min, -(2**62)), min(info.max, 2**62))
        x = torch.randint(lo, hi + 1, (n,), generator=g, dtype=torch.int64).to(dtype)
    else:

        def part() -> torch.Tensor:
            mag = torch.exp2(torch.rand(n, generator=g, dtype=torch.float64) * 2 - 1)
            return mag * (torch.randint(0, 2, (n,), generator=g) * 2 - 1)

        x = torch.complex(part(), part()) if dtype.is_complex else part()
        x = x.to(dtype)
    return x.reshape(shape)


def strided(x: torch.Tensor) -> torch.Tensor:
    """``x``'s values in a non-contiguous tensor (every other element of a wider buffer)."""
    if x.dim() == 0:
        return x.clone()
    buf = torch.zeros((*x.shape[:-1], 2 * x.shape[-1]), dtype=x.dtype)
    out = buf[..., ::2]
    out.copy_(x)
    return out


def place(x: torch.Tensor, noncontig: bool) -> torch.Tensor:
    return strided(x) if noncontig else x.clone()


def make_op(kind: str, factor: float, spelling: str) -> Any:
    if kind == "PREMUL_SUM":
        return dist._make_nccl_premul_sum(torch.tensor(factor) if spelling == "tensor" else factor)
    if spelling == "str":
        return kind.lower()
    if spelling == "wrapped":
        return dist.ReduceOp(getattr(R, kind))
    return getattr(R, kind)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``t``, for bitwise comparison (NaN-safe, distinguishes -0.0)."""
    flat = torch.empty(t.numel(), dtype=t.dtype)
    flat.copy_(t.detach().reshape(-1))
    return flat.view(torch.uint8)


# -- the independent reference ------------------------------------------------------------


def wrap(v: int, dtype: torch.dtype) -> int:
    info = torch.iinfo(dtype)
    return (v - info.min) % (1 << info.bits) + info.min


def csum(xs: list[Any]) -> Any:
    if any(isinstance(x, complex) for x in xs):
        return complex(math.fsum(x.real for x in xs), math.fsum(x.imag for x in xs))
    return math.fsum(xs)


def reference(kind: str, inputs: list[torch.Tensor], factors: list[float]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Elementwise reduction of the ranks' tensors in plain Python.

    Returns the expected tensor and, for inexact (float) results, the per-element
    magnitude the rounding error is proportional to; None means "compare exactly".
    """
    dtype, shape, w = inputs[0].dtype, inputs[0].shape, len(inputs)
    cols = list(zip(*[t.reshape(-1).tolist() for t in inputs], strict=True))
    if dtype == torch.bool:
        bfn: Callable[[tuple[bool, ...]], bool] = {
            "SUM": any,
            "MAX": any,
            "BOR": any,
            "PRODUCT": all,
            "MIN": all,
            "BAND": all,
            "BXOR": lambda c: sum(c) % 2 == 1,
        }[kind]
        return torch.tensor([bfn(c) for c in cols], dtype=torch.bool).reshape(shape), None
    if dtype in INTS:
        ifn: Callable[[tuple[int, ...]], int] = {
            "SUM": sum,
            "PRODUCT": math.prod,
            "MIN": min,
            "MAX": max,
            "BAND": lambda c: functools.reduce(operator.and_, c),
            "BOR": lambda c: functools.reduce(operator.or_, c),
            "BXOR": lambda c: functools.reduce(operator.xor, c),
        }[kind]
        return torch.tensor([wrap(ifn(c), dtype) for c in cols], dtype=dtype).reshape(shape), None
    if kind in ("MIN", "MAX"):
        mfn = min if kind == "MIN" else max
        return torch.tensor([mfn(c) for c in cols], dtype=torch.float64).to(dtype).reshape(shape), None
    wide = torch.complex128 if dtype.is_complex else torch.float64
    if kind == "SUM":
        vals = [csum(list(c)) for c in cols]
        scale = [math.fsum(abs(x) for x in c) for c in cols]
    elif kind == "AVG":
        vals = [csum(list(c)) / w for c in cols]
        scale = [math.fsum(abs(x) for x in c) / w for c in cols]
    elif kind == "PRODUCT":
        vals = [functools.reduce(operator.mul, c) for c in cols]
        scale = [math.prod(abs(x) for x in c) for c in cols]
    elif kind == "PREMUL_SUM":
        vals = [csum([f * x for f, x in zip(factors, c, strict=True)]) for c in cols]
        scale = [math.fsum(abs(f * x) for f, x in zip(factors, c, strict=True)) for c in cols]
    else:  # pragma: no cover
        raise AssertionError(kind)
    return (
        torch.tensor(vals, dtype=wide).reshape(shape),
        torch.tensor(scale, dtype=torch.float64).reshape(shape),
    )


def assert_reduced(got: torch.Tensor, expected: torch.Tensor, scale: torch.Tensor | None, w: int, kind: str) -> None:
    assert got.shape == expected.shape
    if scale is None:
        assert got.dtype == expected.dtype
        assert torch.equal(got, expected), f"{kind}: got {got}, expected {expected}"
        return
    assert got.dtype.is_floating_point or got.dtype.is_complex
    wide = torch.complex128 if got.dtype.is_complex else torch.float64
    fi = torch.finfo(got.dtype)
    # every operation rounds by at most eps relative to the magnitudes involved;
    # complex products pick up a few more roundings per step
    k = (w + 2) * (4 if got.dtype.is_complex and kind == "PRODUCT" else 1)
    err = (got.to(wide) - expected).abs()
    bound = k * fi.eps * scale + fi.tiny
    assert bool(torch.isfinite(got.to(wide)).all())
    assert bool((err <= bound).all()), f"{kind} {got.dtype}: max error {err.max()} > bound; got {got}, exp {expected}"


# -- strategies ---------------------------------------------------------------------------

shapes = st.lists(st.integers(0, 3), max_size=3).map(tuple)
nonempty_shapes = st.lists(st.integers(1, 3), max_size=3).map(tuple)
worlds = st.integers(1, 8)
seeds = st.integers(0, 2**32)
spellings = st.sampled_from(["enum", "wrapped", "str"])


def draw_factors(data: st.DataObject, kind: str, w: int) -> list[float]:
    if kind != "PREMUL_SUM":
        return [1.0] * w
    return data.draw(st.lists(st.sampled_from(FACTORS), min_size=w, max_size=w), label="factors")


def draw_spelling(data: st.DataObject, kind: str) -> str:
    if kind == "PREMUL_SUM":
        return data.draw(st.sampled_from(["float", "tensor"]), label="factor type")
    return data.draw(spellings, label="spelling")


# -- every (reduce op, dtype) pair at least once ------------------------------------------


def test_every_reduce_op_and_dtype(loop: str) -> None:
    w, shape, seed = 3, (2, 3), 7
    factors = [0.5, -2.0, 3.0]

    async def fn(comm: Comm) -> list[torch.Tensor]:
        outs = []
        for i, (kind, dtype) in enumerate(VALID):
            t = make_input(seed, comm.rank, shape, dtype, tag=i, small=True)
            await comm.all_reduce(t, op=make_op(kind, factors[comm.rank], "enum"))
            outs.append(t)
        return outs

    results = run(fn, w, loop)
    for i, (kind, dtype) in enumerate(VALID):
        inputs = [make_input(seed, r, shape, dtype, tag=i, small=True) for r in range(w)]
        exp, scale = reference(kind, inputs, factors)
        for r in range(w):
            assert results[r][i].dtype == dtype
            assert_reduced(results[r][i], exp, scale, w, kind)


INVALID = [(k, d) for k in KINDS for d in DTYPES if not allowed(k, d)]


@pytest.mark.parametrize(("kind", "dtype"), INVALID, ids=[f"{k}-{d}" for k, d in INVALID])
def test_reduce_op_rejected_where_it_makes_no_sense(loop: str, kind: str, dtype: torch.dtype) -> None:
    w = 2

    async def fn(comm: Comm) -> list[tuple[str, bool]]:
        t = make_input(3, comm.rank, (4,), dtype)
        seen = []
        for call in ("all_reduce", "reduce", "reduce_scatter_tensor"):
            try:
                op = make_op(kind, 2.0, "enum")
                if call == "all_reduce":
                    await comm.all_reduce(t, op=op)
                elif call == "reduce":
                    await comm.reduce(t, 0, op=op)
                else:
                    await comm.reduce_scatter_tensor(torch.zeros(2, dtype=dtype), t, op=op)
            except aiocoll.InvalidArgumentError as e:
                seen.append((str(e), torch.equal(t, make_input(3, comm.rank, (4,), dtype))))
        await comm.barrier()  # the world is still healthy
        return seen

    for seen in run(fn, w, loop):
        assert len(seen) == 3
        for msg, untouched in seen:
            assert kind in msg
            assert untouched


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn], ids=str)
def test_reduce_rejects_dtypes_without_kernels(loop: str, dtype: torch.dtype) -> None:
    async def fn(comm: Comm) -> tuple[str, torch.Tensor]:
        t = torch.full((3,), comm.rank + 1).to(dtype)
        try:
            await comm.all_reduce(t)
        except aiocoll.InvalidArgumentError as e:
            msg = str(e)
        else:  # pragma: no cover - the failure mode under test
            msg = ""
        # the world is still healthy: data movement works on these dtypes
        out = torch.zeros(2 * 3).to(dtype)
        await comm.all_gather_into_tensor(out, t)
        return msg, out

    for r, (msg, out) in enumerate(run(fn, 2, loop)):
        assert f"all_reduce on rank {r}" in msg
        assert str(dtype) in msg
        assert out.to(torch.float64).tolist() == [1.0] * 3 + [2.0] * 3


# -- reductions ---------------------------------------------------------------------------


@SETTINGS
@given(data=st.data())
def test_all_reduce_and_reduce(loop: str, data: st.DataObject) -> None:
    kind, dtype = data.draw(st.sampled_from(VALID), label="op, dtype")
    w = data.draw(worlds, label="world")
    shape = data.draw(shapes, label="shape")
    seed = data.draw(seeds, label="seed")
    small = data.draw(st.booleans(), label="small ints")
    noncontig = data.draw(st.booleans(), label="non-contiguous")
    which = data.draw(st.sampled_from(["all_reduce", "reduce"]), label="collective")
    dst = data.draw(st.integers(0, w - 1), label="dst")
    factors = draw_factors(data, kind, w)
    spelling = draw_spelling(data, kind)

    async def fn(comm: Comm) -> torch.Tensor:
        t = place(make_input(seed, comm.rank, shape, dtype, small=small), noncontig)
        op = make_op(kind, factors[comm.rank], spelling)
        if which == "all_reduce":
            await comm.all_reduce(t, op=op)
        else:
            await comm.reduce(t, dst, op=op)
        return t

    results = run(fn, w, loop)
    inputs = [make_input(seed, r, shape, dtype, small=small) for r in range(w)]
    exp, scale = reference(kind, inputs, factors)
    for r, got in enumerate(results):
        if which == "reduce" and r != dst:
            assert torch.equal(got, inputs[r])  # non-destination ranks keep their input
        else:
            assert_reduced(got, exp, scale, w, kind)
    if which == "all_reduce":
        # every rank holds the very same bits
        assert all(torch.equal(bits(results[0]), bits(g)) for g in results)


@SETTINGS
@given(data=st.data())
def test_reduce_scatter_both_forms(loop: str, data: st.DataObject) -> None:
    kind, dtype = data.draw(st.sampled_from(VALID), label="op, dtype")
    w = data.draw(worlds, label="world")
    shape = data.draw(shapes, label="output shape")
    seed = data.draw(seeds, label="seed")
    small = data.draw(st.booleans(), label="small ints")
    noncontig = data.draw(st.booleans(), label="non-contiguous")
    form = data.draw(st.sampled_from(["list", "concat", "stack"]), label="form")
    if form == "concat" and shape == ():
        form = "stack"  # a 0-d output can only come from a stacked (w,) input
    factors = draw_factors(data, kind, w)
    spelling = draw_spelling(data, kind)

    def chunk(rank: int, j: int) -> torch.Tensor:
        return make_input(seed, rank, shape, dtype, tag=j, small=small)

    async def fn(comm: Comm) -> tuple[torch.Tensor, list[torch.Tensor]]:
        chunks = [place(chunk(comm.rank, j), noncontig) for j in range(w)]
        out = place(torch.zeros(shape, dtype=dtype), noncontig)
        op = make_op(kind, factors[comm.rank], spelling)
        if form == "list":
            await comm.reduce_scatter(out, chunks, op=op)
            return out, chunks
        x = torch.cat(chunks) if form == "concat" else torch.stack(chunks)
        x = place(x, noncontig)
        await comm.reduce_scatter_tensor(out, x, op=op)
        return out, [x]

    results = run(fn, w, loop)
    for j, (out, ins) in enumerate(results):
        exp, scale = reference(kind, [chunk(r, j) for r in range(w)], factors)
        assert_reduced(out, exp, scale, w, kind)
        # inputs are left alone
        mine = [chunk(j, i) for i in range(w)]
        if form == "list":
            assert all(torch.equal(a, b) for a, b in zip(ins, mine, strict=True))
        else:
            assert torch.equal(ins[0], torch.cat(mine) if form == "concat" else torch.stack(mine))


# -- data movement ------------------------------------------------------------------------


@SETTINGS
@given(data=st.data())
def test_broadcast_gather_scatter(loop: str, data: st.DataObject) -> None:
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    w = data.draw(worlds, label="world")
    shape = data.draw(shapes, label="shape")
    seed = data.draw(seeds, label="seed")
    noncontig = data.draw(st.booleans(), label="non-contiguous")
    which = data.draw(st.sampled_from(["broadcast", "gather", "scatter"]), label="collective")
    root = data.draw(st.integers(0, w - 1), label="root")

    def x(rank: int, tag: int = 0) -> torch.Tensor:
        return make_input(seed, rank, shape, dtype, tag=tag)

    async def fn(comm: Comm) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        me = comm.rank
        t = place(x(me), noncontig)
        if which == "broadcast":
            await comm.broadcast(t, root)
            return t, None
        if which == "gather":
            gl = [place(torch.zeros(shape, dtype=dtype), noncontig) for _ in range(w)] if me == root else None
            await comm.gather(t, gl, dst=root)
            return t, gl
        sl = [place(x(me, tag=1 + j), noncontig) for j in range(w)] if me == root else None
        await comm.scatter(t, sl, src=root)
        return t, sl

    results = run(fn, w, loop)
    for r, (t, lst) in enumerate(results):
        if which == "broadcast":
            assert torch.equal(t, x(root))
        elif which == "gather":
            assert torch.equal(t, x(r))
            if r == root:
                assert lst is not None
                assert all(torch.equal(g, x(j)) for j, g in enumerate(lst))
            else:
                assert lst is None
        else:
            assert torch.equal(t, x(root, tag=1 + r))
            if r == root:
                assert lst is not None
                assert all(torch.equal(s, x(root, tag=1 + j)) for j, s in enumerate(lst))


@SETTINGS
@given(data=st.data())
def test_all_gather(loop: str, data: st.DataObject) -> None:
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    w = data.draw(worlds, label="world")
    uneven = data.draw(st.booleans(), label="uneven shapes")
    rank_shapes = (
        data.draw(st.lists(shapes, min_size=w, max_size=w), label="shapes")
        if uneven
        else [data.draw(shapes, label="shape")] * w
    )
    seed = data.draw(seeds, label="seed")
    noncontig = data.draw(st.booleans(), label="non-contiguous")

    def x(rank: int) -> torch.Tensor:
        return make_input(seed, rank, rank_shapes[rank], dtype)

    async def fn(comm: Comm) -> tuple[torch.Tensor, list[torch.Tensor]]:
        t = place(x(comm.rank), noncontig)
        outs = [place(torch.zeros(s, dtype=dtype), noncontig) for s in rank_shapes]
        await comm.all_gather(outs, t)
        return t, outs

    results = run(fn, w, loop)
    for r, (t, outs) in enumerate(results):
        assert torch.equal(t, x(r))
        assert len(outs) == w
        for j, o in enumerate(outs):
            assert o.dtype == dtype
            assert torch.equal(o, x(j))


@SETTINGS
@given(data=st.data())
def test_all_gather_into_tensor(loop: str, data: st.DataObject) -> None:
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    w = data.draw(worlds, label="world")
    shape = data.draw(shapes, label="input shape")
    seed = data.draw(seeds, label="seed")
    noncontig = data.draw(st.booleans(), label="non-contiguous")
    layout = data.draw(st.sampled_from(["concat", "stack"]), label="layout")
    if shape == ():
        oshape: tuple[int, ...] = (w,)
    elif layout == "concat":
        oshape = (w * shape[0], *shape[1:])
    else:
        oshape = (w, *shape)

    def x(rank: int) -> torch.Tensor:
        return make_input(seed, rank, shape, dtype)

    async def fn(comm: Comm) -> tuple[torch.Tensor, torch.Tensor]:
        t = place(x(comm.rank), noncontig)
        out = place(torch.zeros(oshape, dtype=dtype), noncontig)
        await comm.all_gather_into_tensor(out, t)
        return t, out

    results = run(fn, w, loop)
    ins = [x(r) for r in range(w)]
    exp = torch.stack(ins).reshape(oshape) if shape == () or layout == "stack" else torch.cat(ins)
    for r, (t, out) in enumerate(results):
        assert torch.equal(t, ins[r])
        assert out.shape == oshape
        assert torch.equal(out, exp)


@SETTINGS
@given(data=st.data())
def test_all_to_all(loop: str, data: st.DataObject) -> None:
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    w = data.draw(worlds, label="world")
    tail = data.draw(st.lists(st.integers(0, 3), max_size=2).map(tuple), label="tail shape")
    rows = data.draw(
        st.lists(st.lists(st.integers(0, 2), min_size=w, max_size=w), min_size=w, max_size=w), label="rows j->r"
    )
    seed = data.draw(seeds, label="seed")
    noncontig = data.draw(st.booleans(), label="non-contiguous")

    def msg(j: int, r: int) -> torch.Tensor:
        """What rank j sends to rank r."""
        return make_input(seed, j, (rows[j][r], *tail), dtype, tag=r)

    async def fn(comm: Comm) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        me = comm.rank
        ins = [place(msg(me, r), noncontig) for r in range(w)]
        outs = [place(torch.zeros((rows[j][me], *tail), dtype=dtype), noncontig) for j in range(w)]
        await comm.all_to_all(outs, ins)
        return ins, outs

    results = run(fn, w, loop)
    for r, (ins, outs) in enumerate(results):
        assert all(torch.equal(i, msg(r, j)) for j, i in enumerate(ins))
        assert all(torch.equal(o, msg(j, r)) for j, o in enumerate(outs))


@SETTINGS
@given(data=st.data())
def test_all_to_all_single(loop: str, data: st.DataObject) -> None:
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    w = data.draw(worlds, label="world")
    tail = data.draw(st.lists(st.integers(0, 3), max_size=2).map(tuple), label="tail shape")
    even = data.draw(st.booleans(), label="even (no split sizes)")
    if even:
        k = data.draw(st.integers(0, 2), label="rows per peer")
        splits = [[k] * w for _ in range(w)]
    else:
        splits = data.draw(
            st.lists(st.lists(st.integers(0, 3), min_size=w, max_size=w), min_size=w, max_size=w), label="splits j->r"
        )
    inplace = even and data.draw(st.booleans(), label="output is input")
    seed = data.draw(seeds, label="seed")
    noncontig = data.draw(st.booleans(), label="non-contiguous")

    def x(rank: int) -> torch.Tensor:
        return make_input(seed, rank, (sum(splits[rank]), *tail), dtype)

    def expected(r: int) -> torch.Tensor:
        parts = []
        for j in range(w):
            start = sum(splits[j][:r])
            parts.append(x(j)[start : start + splits[j][r]])
        return torch.cat(parts)

    async def fn(comm: Comm) -> tuple[torch.Tensor, torch.Tensor]:
        me = comm.rank
        t = place(x(me), noncontig)
        nout = sum(splits[j][me] for j in range(w))
        out = t if inplace else place(torch.zeros((nout, *tail), dtype=dtype), noncontig)
        if even:
            await comm.all_to_all_single(out, t)
        else:
            await comm.all_to_all_single(out, t, [splits[j][me] for j in range(w)], splits[me])
        return t, out

    results = run(fn, w, loop)
    for r, (t, out) in enumerate(results):
        assert torch.equal(out, expected(r))
        if not inplace:
            assert torch.equal(t, x(r))


# -- determinism --------------------------------------------------------------------------


@SETTINGS
@given(data=st.data())
def test_bitwise_deterministic(loop: str, data: st.DataObject) -> None:
    dtype = data.draw(st.sampled_from([*FLOATS, torch.complex64]), label="dtype")
    kind = data.draw(st.sampled_from(["SUM", "AVG", "PRODUCT", "PREMUL_SUM"]), label="op")
    which = data.draw(st.sampled_from(["all_reduce", "reduce_scatter_tensor", "reduce"]), label="collective")
    w = data.draw(st.integers(2, 8), label="world")
    n = data.draw(st.integers(1, 200), label="elements per rank")
    seed = data.draw(seeds, label="seed")
    factors = [FACTORS[(seed + r) % len(FACTORS)] for r in range(w)]

    def x(rank: int) -> torch.Tensor:
        # widely spread magnitudes make float sums depend on the order of the additions
        g = torch.Generator().manual_seed(seed * 31 + rank)
        base = torch.randn(w * n, generator=g, dtype=torch.float64)
        spread = torch.exp2(torch.randint(-20, 20, (w * n,), generator=g).double())
        if kind == "PRODUCT":
            spread = torch.exp2(torch.rand(w * n, generator=g, dtype=torch.float64) - 0.5)
        v = base * spread
        return (torch.complex(v, v.flip(0)) if dtype.is_complex else v).to(dtype)

    async def fn(comm: Comm) -> torch.Tensor:
        t = x(comm.rank)
        op = make_op(kind, factors[comm.rank], "enum")
        if which == "all_reduce":
            await comm.all_reduce(t, op=op)
            return t
        if which == "reduce":
            await comm.reduce(t, 0, op=op)
            return t
        out = torch.empty(n, dtype=dtype)
        await comm.reduce_scatter_tensor(out, t, op=op)
        return out

    first = run(fn, w, loop)
    second = run(fn, w, loop)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(bits(a), bits(b))
    if which == "all_reduce":
        assert all(torch.equal(bits(first[0]), bits(t)) for t in first)


# -- outputs never alias inputs or other ranks' buffers -----------------------------------

TENSOR_OPS = (
    "all_reduce",
    "reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "gather",
    "scatter",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
)
OBJECT_OPS = ("broadcast_object", "all_gather_object", "gather_object", "scatter_object")


async def tensor_op(op: str, comm: Comm, seed: int, dtype: torch.dtype) -> tuple[list[Any], list[Any]]:
    """Run ``op`` on rank-specific data; return (this rank's inputs, its outputs)."""
    w, me = comm.world_size, comm.rank

    def x(tag: int = 0, shape: tuple[int, ...] = (2, 3)) -> torch.Tensor:
        return make_input(seed, me, shape, dtype, tag=tag)

    def z(shape: tuple[int, ...] = (2, 3)) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype)

    if op in ("all_reduce", "reduce", "broadcast"):
        t = x()
        if op == "all_reduce":
            await comm.all_reduce(t)
        elif op == "reduce":
            await comm.reduce(t, 0)
        else:
            await comm.broadcast(t, 0)
        return [], [t]
    if op == "all_gather":
        t, outs = x(), [z() for _ in range(w)]
        await comm.all_gather(outs, t)
        return [t], outs
    if op == "all_gather_into_tensor":
        t, out = x(), z((2 * w, 3))
        await comm.all_gather_into_tensor(out, t)
        return [t], [out]
    if op == "gather":
        t = x()
        gl = [z() for _ in range(w)] if me == 0 else None
        await comm.gather(t, gl, 0)
        return [t], gl or []
    if op == "scatter":
        t = z()
        sl = [x(tag=j) for j in range(w)] if me == 0 else None
        await comm.scatter(t, sl, 0)
        return sl or [], [t]
    if op == "reduce_scatter":
        ins, out = [x(tag=j) for j in range(w)], z()
        await comm.reduce_scatter(out, ins)
        return ins, [out]
    if op == "reduce_scatter_tensor":
        t, out = x(shape=(2 * w, 3)), z()
        await comm.reduce_scatter_tensor(out, t)
        return [t], [out]
    if op == "all_to_all":
        ins, outs = [x(tag=j) for j in range(w)], [z() for _ in range(w)]
        await comm.all_to_all(outs, ins)
        return ins, outs
    assert op == "all_to_all_single"
    t, out = x(shape=(2 * w, 3)), z((2 * w, 3))
    await comm.all_to_all_single(out, t)
    return [t], [out]


async def object_op(op: str, comm: Comm, seed: int) -> tuple[Any, Any]:
    """Run ``op`` on rank-specific objects; return (what this rank sent, what it received)."""
    w, me = comm.world_size, comm.rank

    def obj(tag: int = 0) -> dict[str, Any]:
        return {"rank": me, "tag": tag, "items": [seed, me, tag], "t": make_input(seed, me, (3,), torch.float32, tag)}

    if op == "broadcast_object":
        sent = obj() if me == 0 else None
        return sent, await comm.broadcast_object(sent, 0)
    if op == "all_gather_object":
        sent = obj()
        return sent, await comm.all_gather_object(sent)
    if op == "gather_object":
        sent = obj()
        return sent, await comm.gather_object(sent, 0)
    assert op == "scatter_object"
    sent_list = [obj(tag=j) for j in range(w)] if me == 0 else None
    return sent_list, await comm.scatter_object(sent_list, 0)


def vandalise(x: Any) -> None:
    """Mutate everything reachable in ``x`` in place."""
    if isinstance(x, torch.Tensor):
        if x.dtype == torch.bool:
            x.logical_not_()
        else:
            x.add_(1)  # changes every element
    elif isinstance(x, list):
        for y in x:
            vandalise(y)
        x.append("vandalised")
    elif isinstance(x, dict):
        for y in x.values():
            vandalise(y)
        x["vandalised"] = True


def snapshot(x: Any) -> bytes:
    return pickle.dumps(x)


@SETTINGS
@given(data=st.data())
def test_outputs_are_independent(loop: str, data: st.DataObject) -> None:
    op = data.draw(st.sampled_from(TENSOR_OPS + OBJECT_OPS), label="collective")
    w = data.draw(st.integers(2, 6), label="world")
    victim = data.draw(st.integers(0, w - 1), label="rank that mutates its outputs")
    dtype = data.draw(st.sampled_from([torch.float32, torch.int64, torch.bool]), label="dtype")
    seed = data.draw(seeds, label="seed")

    async def fn(comm: Comm) -> tuple[Any, Any]:
        if op in OBJECT_OPS:
            sent, got = await object_op(op, comm, seed)
            mine = [sent, got]
        else:
            sent, got = await tensor_op(op, comm, seed, dtype)
            mine = [*sent, *got]
        before = [snapshot(m) for m in mine]
        await comm.barrier()
        if comm.rank == victim:
            vandalise(got)
        await comm.barrier()
        # nothing another rank holds changed; the victim's own inputs did not change either
        if comm.rank != victim:
            assert [snapshot(m) for m in mine] == before, f"rank {comm.rank}'s buffers changed"
        elif op in OBJECT_OPS:
            assert snapshot(sent) == before[0], "the sent object changed with the received one"
        else:
            assert [snapshot(m) for m in sent] == before[: len(sent)], "inputs changed with the outputs"
        return sent, got

    results = run(fn, w, loop)
    if op not in OBJECT_OPS:
        return
    # what the other ranks received is still what was sent
    expect_t = make_input(seed, 0, (3,), torch.float32)
    for r, (_, got) in enumerate(results):
        if r == victim:
            continue
        if op == "broadcast_object":
            assert got["rank"] == 0
            assert got["items"] == [seed, 0, 0]
            assert torch.equal(got["t"], expect_t)
        elif op == "scatter_object":
            assert (got["rank"], got["tag"]) == (0, r)
            assert got["items"] == [seed, 0, r]
        elif op == "all_gather_object" or r == 0:
            assert [g["rank"] for g in got] == list(range(w))
            assert all(g["items"] == [seed, j, 0] for j, g in enumerate(got))
        else:
            assert got is None
