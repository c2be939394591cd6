"""Conformance: the "aiocoll" torch.distributed backend gives the same results as real gloo.

One table of torch.distributed calls (``run_table``) runs twice, on a world of 4:

- on gloo, in 4 processes (this file, run as a script, is the per-rank runner; a FileStore
  in a temp dir does the rendezvous; each rank ``torch.save``s its results);
- on aiocoll, in ``aiocoll.spawn`` with a plain ``def`` (4 rank threads).

Every output of every entry is then compared, rank by rank, exactly: dtypes, shapes and
values must match bitwise (``torch.equal``). The inputs are small integers, halves and
quarters, so every sum, product and average is exactly representable in every dtype and
the result does not depend on the order a backend reduces in; exact equality is then a
fair check. The one deliberate exception is ``all_reduce/SUM/float32/inexact`` (random
floats): gloo adds in its own order (ring / halving-doubling), aiocoll in rank order, and
the rounded sums differ in the last bit or two (4.8e-7 on values up to ~5), so that entry
is compared with a tight tolerance.

What gloo (torch 2.13, CPU) lacks, so the table leaves out:

- ``ReduceOp.PREMUL_SUM`` ("Cannot use ReduceOp.PREMUL_SUM with Gloo");
- ``ReduceOp.AVG`` on integer and bool tensors (it divides in float and cannot cast back);
- BAND/BOR/BXOR on floating and complex tensors; PRODUCT/MIN/MAX on complex tensors;
- dtypes int16, uint16, uint32, uint64 and the float8s ("Invalid scalar type");
- the "stack" form of ``all_gather_single`` / ``reduce_scatter_single`` (output, resp.
  input, of shape (world, *shape)): gloo only takes the concatenated form;
- ``all_to_all`` (the list form) with tensors of different sizes: gloo wants them all
  alike (uneven exchanges are covered by ``all_to_all_single`` with split sizes);
- non-contiguous tensors in general: gloo reduces the contiguous memory at the view's data
  pointer, ignoring the strides (``all_reduce(base[::2])`` sums ``base[:4]``), which is
  silently wrong; only a transpose, which spans its whole storage, is in the table;
- ``gather`` of complex tensors (torch does not view them as real there; gloo rejects them);
- ``monitored_barrier`` is gloo-only by design, and not part of the table.

``ReduceOp.AVG`` itself gloo does have (on floating and complex tensors), so it is in.
Some of gloo's works have no future ("Work::getFuture not implemented": reduce_scatter,
reduce_scatter_single, send, recv); those are waited on instead. After ``reduce`` only the
destination's tensor is compared: torch leaves the others unspecified, and gloo uses them
as scratch space. On gloo, a ``new_group(..., use_local_synchronization=True)`` hangs once
a sub-group has carried point-to-point traffic, so that entry runs first.

A mismatch is a bug in aiocoll: the entry stays, marked in ``XFAIL`` (strict).
"""

from __future__ import annotations

import functools
import os
import socket
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _coalescing_manager

WORLD = 4
GLOO_TIMEOUT = 120.0
"""Seconds the 4 gloo processes may take, start to finish, before they are killed."""
AIOCOLL_TIMEOUT = 30.0
"""Seconds an aiocoll rank may wait in one collective."""

R = dist.ReduceOp
BITWISE = (R.BAND, R.BOR, R.BXOR)
FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
INTS = (torch.int8, torch.int32, torch.int64, torch.uint8)
DTYPES = (*FLOATS, *INTS, torch.bool, torch.complex64)

# deprecated in torch 2.13 (FutureWarning), still worth covering under their old names
_DEPRECATED = (
    r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor|all_reduce_coalesced"
    r"|all_gather_coalesced)` (is|will be) deprecated"
)

# torch 2.13 named these two (the old names warn there); 2.10-2.12 have only the old names
all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)

Entry = Callable[[int, int], object]
TABLE: dict[str, Entry] = {}
"""The table: name -> a call sequence run by every rank; returns this rank's outputs."""

TOLERANT = frozenset({"all_reduce/SUM/float32/inexact"})
"""Entries compared with a tight tolerance instead of exactly (see the module docstring)."""

ISOLATED = ("new_group/local_synchronization",)
"""Entries run in a world of their own, after the rest of the table (see each entry)."""

XFAIL: dict[str, str] = {}
"""Entries where aiocoll differs from gloo: name -> the reason (strict xfail)."""


def entry(name: str) -> Callable[[Entry], Entry]:
    def register(fn: Entry) -> Entry:
        assert name not in TABLE, name
        TABLE[name] = fn
        return fn

    return register


UNSUPPORTED = "unsupported by gloo: "
"""How a gloo rank records an entry its backend refuses (every rank refuses before moving data).

A plain string: the results travel by torch.save from a process whose ``__main__`` is this file.
"""


def run_table(rank: int, world: int, only: Collection[str] | None = None, *, gloo: bool = False) -> dict[str, object]:
    """Run the table (or the entries in ``only``) on the default group; return every output.

    On gloo, an entry the backend refuses ("Backend gloo does not support alltoall" on
    torch 2.10) is recorded as ``UNSUPPORTED + message``; the comparison skips it, naming the release.
    """
    assert dist.is_initialized()
    assert (dist.get_rank(), dist.get_world_size()) == (rank, world)
    assert world == WORLD, "the table is written for a world of 4"
    out: dict[str, object] = {}
    for name, fn in TABLE.items():
        if only is None or name in only:
            try:
                out[name] = fn(rank, world)
            except RuntimeError as e:
                if not (gloo and "Backend gloo does not support" in str(e)):
                    raise
                out[name] = UNSUPPORTED + str(e).splitlines()[-1]
    dist.barrier()
    return out


# -- inputs ----------------------------------------------------------------------------------


def _op_name(op: Any) -> str:
    return str(op).rsplit(".", 1)[-1]


def _dt_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _supported(op: Any, dtype: torch.dtype) -> bool:
    """Whether gloo implements ``op`` on ``dtype`` (see the module docstring)."""
    if op in BITWISE:
        return dtype in (*INTS, torch.bool)
    if op == R.AVG:
        return dtype.is_floating_point or dtype.is_complex
    if dtype.is_complex:
        return bool(op == R.SUM)
    return True


def _reduce_input(op: Any, dtype: torch.dtype, rank: int) -> torch.Tensor:
    """A (2, 3) tensor for rank ``rank`` whose reduction over 4 ranks is exact in ``dtype``."""
    r = rank
    values: list[Any]
    if dtype == torch.bool:
        values = [r % 2 == 0, r == 1, True, False, r < 2, r != 3]
    elif op in BITWISE:
        values = [0x25 ^ (1 << r), 1 << r, 0x0F + r, 3 * r + 1, 0x70 >> r, 0x7F - r]
        if dtype.is_signed:
            values[-1] = -1 - r  # two's complement bit patterns
    elif op == R.PRODUCT:
        values = [r + 1, -1, 2, 3 if r % 2 else -3, r - 1, -(r % 2) - 1]
        if dtype == torch.uint8:
            values = [abs(v) for v in values]
        if dtype.is_floating_point:
            values[2] = 0.5 * (r + 1)
    else:  # SUM, MIN, MAX, AVG
        values = [r + 1, -r, 2 * r - 3, 7, -(r + 1) * 3, r * r]
        if dtype == torch.uint8:
            values = [r + 1, 2 * r, 10 - r, 7, 3 * (r + 1), r * r]
        if dtype.is_floating_point or dtype.is_complex:
            values[3] = 0.5 * r - 0.25
    if dtype.is_complex:
        re = torch.tensor(values, dtype=torch.float32)
        return torch.complex(re, 2 * re.flip(0) - 1).reshape(2, 3)
    return torch.tensor(values).to(dtype).reshape(2, 3)


def _rolled(x: torch.Tensor, k: int) -> torch.Tensor:
    """``x`` with its elements rolled by ``k``: distinct chunks for reduce-scatter inputs."""
    return torch.roll(x.flatten(), k).reshape(x.shape)


def _arange(
    rank: int, n: int, dtype: torch.dtype = torch.float32, shape: tuple[int, ...] | None = None
) -> torch.Tensor:
    t = (torch.arange(n) + 100 * rank).to(dtype)
    return t.reshape(shape) if shape is not None else t


def _issued(w: dist.Work | None) -> dist.Work:
    assert w is not None
    return w


def _membership(g: Any) -> object:
    if g == dist.GroupMember.NON_GROUP_MEMBER:
        return "non-member"
    return [dist.get_rank(g), dist.get_world_size(g), dist.get_process_group_ranks(g)]


# -- first --------------------------------------------------------------------------------


@entry("new_group/local_synchronization")
def _new_group_local(rank: int, world: int) -> object:
    # only the members call new_group. Run in a world of its own (ISOLATED), on gloo and
    # on aiocoll: after a sub-group has carried point-to-point traffic this new_group
    # hangs on gloo (torch 2.13); and torch 2.15 advances its group counter here on the
    # members only, so a later new_group([1, 2, 3]) is named "1" on ranks 1 and 3 but
    # "2" on rank 2: its p2p hangs on gloo, and aiocoll reports a deadlock
    if rank not in (0, 2):
        return None
    g = dist.new_group([0, 2], use_local_synchronization=True)
    t = _arange(rank, 2)
    dist.all_reduce(t, group=g)
    return [_membership(g), t]


# -- all_reduce, reduce, reduce-scatter: every op gloo has, on every dtype it has -----------


def _all_reduce(op: Any, dtype: torch.dtype, rank: int, world: int) -> object:
    t = _reduce_input(op, dtype, rank)
    dist.all_reduce(t, op=op)
    return t


def _reduce(op: Any, dtype: torch.dtype, dst: int, rank: int, world: int) -> object:
    t = _reduce_input(op, dtype, rank)
    dist.reduce(t, dst=dst, op=op)
    # torch leaves the other ranks' tensors unspecified after reduce (gloo uses them as
    # scratch space), so only the destination's is compared
    return t if rank == dst else None


def _reduce_scatter(op: Any, dtype: torch.dtype, rank: int, world: int) -> object:
    x = _reduce_input(op, dtype, rank)
    out = torch.empty_like(x)
    dist.reduce_scatter(out, [_rolled(x, k) for k in range(world)], op=op)
    return out


def _reduce_scatter_single(op: Any, dtype: torch.dtype, rank: int, world: int) -> object:
    x = _reduce_input(op, dtype, rank)
    out = torch.empty_like(x)
    reduce_scatter_single(out, torch.cat([_rolled(x, k) for k in range(world)]), op=op)
    return out


for _op in (R.SUM, R.PRODUCT, R.MIN, R.MAX, R.AVG, *BITWISE):
    for _dt in DTYPES:
        if _supported(_op, _dt):
            TABLE[f"all_reduce/{_op_name(_op)}/{_dt_name(_dt)}"] = functools.partial(_all_reduce, _op, _dt)
for _op in (R.SUM, R.PRODUCT, R.MIN, R.MAX, R.AVG, *BITWISE):
    for _dt in (torch.float32, torch.int64, torch.uint8, torch.bool, torch.bfloat16):
        if _supported(_op, _dt):
            _name = f"{_op_name(_op)}/{_dt_name(_dt)}"
            TABLE[f"reduce/{_name}"] = functools.partial(_reduce, _op, _dt, 1 if _dt.is_floating_point else 3)
            TABLE[f"reduce_scatter/{_name}"] = functools.partial(_reduce_scatter, _op, _dt)
            TABLE[f"reduce_scatter_single/{_name}"] = functools.partial(_reduce_scatter_single, _op, _dt)
TABLE["reduce/SUM/complex64"] = functools.partial(_reduce, R.SUM, torch.complex64, 0)
TABLE["reduce_scatter/SUM/complex64"] = functools.partial(_reduce_scatter, R.SUM, torch.complex64)


@entry("all_reduce/SUM/float32/inexact")
def _all_reduce_inexact(rank: int, world: int) -> object:
    # random floats: the rounded sum depends on the order of additions, which is gloo's
    # own (ring/halving-doubling), so this one is compared with a tolerance
    t = torch.randn(64, generator=torch.Generator().manual_seed(rank))
    dist.all_reduce(t)
    return t


@entry("all_reduce/SUM/float64/precise")
def _all_reduce_precise(rank: int, world: int) -> object:
    # exact in float64, not in float32: catches a round trip through a narrower type
    t = torch.tensor([1 + rank * 2.0**-50, 2.0**50 + rank], dtype=torch.float64)
    dist.all_reduce(t)
    return t


@entry("all_reduce/SUM/int64/large")
def _all_reduce_int64_large(rank: int, world: int) -> object:
    # 2**62 + 6 needs 63 bits: catches a round trip through float64
    t = torch.tensor([2**60 + rank, -(2**61) - rank, 2**62 // 4 + rank], dtype=torch.int64)
    dist.all_reduce(t)
    m = torch.tensor([2**62 + rank, -(2**62) - rank], dtype=torch.int64)
    dist.all_reduce(m, op=R.MAX)
    return [t, m]


@entry("all_reduce/SUM/uint8/wraps")
def _all_reduce_uint8_wraps(rank: int, world: int) -> object:
    t = torch.tensor([200 + rank, 255, 128], dtype=torch.uint8)
    dist.all_reduce(t)
    return t


@entry("all_reduce/scalar_and_empty")
def _all_reduce_scalar_and_empty(rank: int, world: int) -> object:
    s = torch.tensor(rank + 1.5)
    dist.all_reduce(s, op=R.MAX)
    e = torch.empty(0, 3, dtype=torch.int32)
    dist.all_reduce(e)
    return [s, e]


@entry("all_reduce/SUM/float32/3d")
def _all_reduce_3d(rank: int, world: int) -> object:
    t = _arange(rank, 24, shape=(2, 3, 4))
    dist.all_reduce(t)
    return t


# -- broadcast, all_gather, gather, scatter, all_to_all -------------------------------------


def _broadcast(dtype: torch.dtype, src: int, rank: int, world: int) -> object:
    t = _reduce_input(R.SUM, dtype, rank)
    dist.broadcast(t, src=src)
    return t


for _src, _dt in enumerate((torch.float32, torch.int64, torch.bool, torch.bfloat16, torch.uint8, torch.complex64)):
    TABLE[f"broadcast/{_dt_name(_dt)}/src{_src % WORLD}"] = functools.partial(_broadcast, _dt, _src % WORLD)


@entry("broadcast/noncontiguous")
def _broadcast_noncontiguous(rank: int, world: int) -> object:
    # a transpose spans its whole storage, which gloo (see the module docstring) needs
    base = _arange(rank, 8, torch.int64, shape=(2, 4))
    view = base.t()
    dist.broadcast(view, src=1)
    return [view, base]


def _all_gather(dtype: torch.dtype, rank: int, world: int) -> object:
    t = _reduce_input(R.SUM, dtype, rank)
    out = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(out, t)
    return out


for _dt in (torch.float32, torch.int32, torch.bool, torch.float16, torch.complex64):
    TABLE[f"all_gather/{_dt_name(_dt)}"] = functools.partial(_all_gather, _dt)


@entry("all_gather_single/concat")
def _all_gather_single_concat(rank: int, world: int) -> object:
    t = _arange(rank, 6, shape=(2, 3))
    out = torch.empty(world * 2, 3)
    all_gather_single(out, t)
    return out


@entry("all_gather_single/int64_1d")
def _all_gather_single_int64(rank: int, world: int) -> object:
    t = _arange(rank, 5, torch.int64)
    out = torch.empty(world * 5, dtype=torch.int64)
    all_gather_single(out, t)
    return out


@entry("all_gather_into_tensor")
def _all_gather_into_tensor(rank: int, world: int) -> object:
    t = _arange(rank, 3, torch.float64)
    out = torch.empty(world * 3, dtype=torch.float64)
    dist.all_gather_into_tensor(out, t)
    return out


@entry("reduce_scatter_tensor")
def _reduce_scatter_tensor(rank: int, world: int) -> object:
    x = _arange(rank, world * 3, torch.int32)
    out = torch.empty(3, dtype=torch.int32)
    dist.reduce_scatter_tensor(out, x, op=R.MAX)
    return out


@entry("reduce_scatter_single/1d")
def _reduce_scatter_single_1d(rank: int, world: int) -> object:
    x = _arange(rank, world * 5)
    out = torch.empty(5)
    reduce_scatter_single(out, x)
    return out


def _gather(dtype: torch.dtype, dst: int, rank: int, world: int) -> object:
    t = _reduce_input(R.SUM, dtype, rank)
    gl = [torch.empty_like(t) for _ in range(world)] if rank == dst else None
    dist.gather(t, gl, dst=dst)
    return gl


TABLE["gather/float32/dst3"] = functools.partial(_gather, torch.float32, 3)
TABLE["gather/int64/dst0"] = functools.partial(_gather, torch.int64, 0)
TABLE["gather/bool/dst2"] = functools.partial(_gather, torch.bool, 2)


def _scatter(dtype: torch.dtype, src: int, rank: int, world: int) -> object:
    sl = [_reduce_input(R.SUM, dtype, k) for k in range(world)] if rank == src else None
    out = torch.empty(2, 3, dtype=dtype)
    dist.scatter(out, sl, src=src)
    return out


TABLE["scatter/float32/src2"] = functools.partial(_scatter, torch.float32, 2)
TABLE["scatter/int32/src0"] = functools.partial(_scatter, torch.int32, 0)
TABLE["scatter/bfloat16/src3"] = functools.partial(_scatter, torch.bfloat16, 3)


@entry("all_to_all/even")
def _all_to_all_even(rank: int, world: int) -> object:
    ins = [torch.full((2,), 10.0 * rank + j) for j in range(world)]
    outs = [torch.empty(2) for _ in range(world)]
    dist.all_to_all(outs, ins)
    return outs


@entry("all_to_all/int64_2d")
def _all_to_all_2d(rank: int, world: int) -> object:
    ins = [torch.arange(6).reshape(2, 3) + 100 * rank + 10 * j for j in range(world)]
    outs = [torch.empty(2, 3, dtype=torch.int64) for _ in range(world)]
    dist.all_to_all(outs, ins)
    return outs


@entry("all_to_all_single/even")
def _all_to_all_single_even(rank: int, world: int) -> object:
    x = _arange(rank, world * 3)
    out = torch.empty(world * 3)
    dist.all_to_all_single(out, x)
    return out


@entry("all_to_all_single/even_2d")
def _all_to_all_single_even_2d(rank: int, world: int) -> object:
    x = _arange(rank, world * 2 * 3, torch.int32, shape=(world * 2, 3))
    out = torch.empty(world * 2, 3, dtype=torch.int32)
    dist.all_to_all_single(out, x)
    return out


@entry("all_to_all_single/uneven")
def _all_to_all_single_uneven(rank: int, world: int) -> object:
    in_splits = [rank + j + 1 for j in range(world)]
    out_splits = [i + rank + 1 for i in range(world)]
    x = torch.cat([torch.arange(s, dtype=torch.float32) + 100 * rank + 10 * j for j, s in enumerate(in_splits)])
    out = torch.empty(sum(out_splits))
    dist.all_to_all_single(out, x, out_splits, in_splits)
    return out


@entry("all_to_all_single/uneven_with_zeros_2d")
def _all_to_all_single_uneven_zeros(rank: int, world: int) -> object:
    in_splits = [(rank + j) % 3 for j in range(world)]
    out_splits = [(i + rank) % 3 for i in range(world)]
    x = torch.cat([torch.full((s, 2), 10 * rank + j, dtype=torch.int64) for j, s in enumerate(in_splits)])
    out = torch.full((sum(out_splits), 2), -1, dtype=torch.int64)
    dist.all_to_all_single(out, x, out_splits, in_splits)
    return out


@entry("barrier")
def _barrier(rank: int, world: int) -> object:
    return [dist.barrier(), dist.barrier()]


# -- point to point ---------------------------------------------------------------------------


@entry("send_recv/ring")
def _send_recv_ring(rank: int, world: int) -> object:
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    t = _arange(rank, 5)
    got = torch.empty(5)
    if rank % 2 == 0:
        dist.send(t, nxt, tag=7)
        src = dist.recv(got, prv, tag=7)
    else:
        src = dist.recv(got, prv, tag=7)
        dist.send(t, nxt, tag=7)
    return [src, got]


@entry("send_recv/dtypes")
def _send_recv_dtypes(rank: int, world: int) -> object:
    # 0 -> 1 and 2 -> 3, several dtypes and a 0-dim tensor
    got: list[torch.Tensor] = []
    for dt in (torch.int64, torch.bool, torch.bfloat16, torch.uint8, torch.complex64):
        t = _reduce_input(R.SUM, dt, rank)
        if rank % 2 == 0:
            dist.send(t, rank + 1)
        else:
            dist.recv(t, rank - 1)
            got.append(t)
    s = torch.tensor(10.0 * rank)
    if rank % 2 == 0:
        dist.send(s, rank + 1)
    else:
        dist.recv(s, rank - 1)
        got.append(s)
    return got


@entry("isend_irecv/ring")
def _isend_irecv_ring(rank: int, world: int) -> object:
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    t = _arange(rank, 4, torch.int32)
    got = torch.empty(4, dtype=torch.int32)
    for w in [dist.irecv(got, prv), dist.isend(t, nxt)]:
        _issued(w).wait()
    return got


@entry("isend_irecv/tags_out_of_order")
def _isend_irecv_tags(rank: int, world: int) -> object:
    # rank 0 sends tag 1 then tag 2; rank 1 posts its receives the other way round
    if rank == 0:
        works = [dist.isend(torch.tensor([1.0]), 1, tag=1), dist.isend(torch.tensor([2.0]), 1, tag=2)]
        for w in works:
            _issued(w).wait()
        return None
    if rank == 1:
        a, b = torch.empty(1), torch.empty(1)
        works = [dist.irecv(b, 0, tag=2), dist.irecv(a, 0, tag=1)]
        for w in reversed(works):
            _issued(w).wait()
        return [a, b]
    return None


@entry("batch_isend_irecv/ring_both_ways")
def _batch_isend_irecv(rank: int, world: int) -> object:
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    from_prev, from_next = torch.empty(3), torch.empty(3)
    ops = [
        dist.P2POp(dist.isend, _arange(rank, 3), nxt),
        dist.P2POp(dist.irecv, from_prev, prv),
        dist.P2POp(dist.isend, -_arange(rank, 3), prv),
        dist.P2POp(dist.irecv, from_next, nxt),
    ]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    return [from_prev, from_next]


@entry("batch_isend_irecv/same_pair_in_order")
def _batch_same_pair(rank: int, world: int) -> object:
    # two messages 0 -> 1 in one batch: matched in order
    if rank == 0:
        ops = [dist.P2POp(dist.isend, torch.tensor([1.0, 2.0]), 1), dist.P2POp(dist.isend, torch.tensor([3.0, 4.0]), 1)]
    elif rank == 1:
        got = [torch.empty(2), torch.empty(2)]
        ops = [dist.P2POp(dist.irecv, got[0], 0), dist.P2POp(dist.irecv, got[1], 0)]
    else:
        return None
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    return got if rank == 1 else None


@entry("batch_isend_irecv/subgroup_ring")
def _batch_subgroup(rank: int, world: int) -> object:
    g = dist.new_group([1, 2, 3])
    if rank == 0:
        return None
    me = dist.get_rank(g)
    got = torch.empty(2, dtype=torch.int32)
    ops = [
        dist.P2POp(dist.isend, _arange(rank, 2, torch.int32), group=g, group_peer=(me + 1) % 3),
        dist.P2POp(dist.irecv, got, group=g, group_peer=(me - 1) % 3),
    ]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    return got


@entry("recv/any_source/in_turn")
def _recv_any_source_in_turn(rank: int, world: int) -> object:
    # ranks 1..3 send to rank 0 one after the other; recv(src=None) returns the sender
    got: list[object] = []
    for k in range(1, world):
        if rank == 0:
            t = torch.empty(2)
            got.append([dist.recv(t), t])
        elif rank == k:
            dist.send(torch.full((2,), 10.0 * k), 0)
        dist.barrier()
    return got


@entry("recv/any_source/concurrent")
def _recv_any_source_concurrent(rank: int, world: int) -> object:
    # all of 1..3 send at once: arrival order is up to the backend, so sort by sender
    if rank == 0:
        got: list[tuple[int, list[int]]] = []
        for _ in range(1, world):
            t = torch.empty(2, dtype=torch.int64)
            src = dist.recv(t, tag=3)
            got.append((src, t.tolist()))
        return sorted(got)
    dist.send(torch.tensor([rank, 10 * rank]), 0, tag=3)
    return None


@entry("irecv/any_source")
def _irecv_any_source(rank: int, world: int) -> object:
    if rank == 2:
        t = torch.empty(1, dtype=torch.int32)
        w = _issued(dist.irecv(t))
        w.wait()
        return [w._source_rank(), t]
    if rank == 3:
        dist.send(torch.tensor([33], dtype=torch.int32), 2)
    return None


# -- object collectives -----------------------------------------------------------------------


def _obj(rank: int) -> object:
    return {"rank": rank, "sq": rank * rank, "s": "r" * rank, "t": (rank, None, 1.5 * rank), "x": torch.arange(rank)}


@entry("broadcast_object_list")
def _broadcast_object_list(rank: int, world: int) -> object:
    objs: list[Any] = [_obj(rank), f"from {rank}", [rank] * 3] if rank == 1 else [None, None, None]
    dist.broadcast_object_list(objs, src=1)
    return objs


@entry("all_gather_object")
def _all_gather_object(rank: int, world: int) -> object:
    out: list[Any] = [None] * world
    dist.all_gather_object(out, _obj(rank))
    return out


@entry("gather_object")
def _gather_object(rank: int, world: int) -> object:
    out: list[Any] | None = [None] * world if rank == 2 else None
    dist.gather_object(_obj(rank), out, dst=2)
    return out


@entry("scatter_object_list")
def _scatter_object_list(rank: int, world: int) -> object:
    out: list[Any] = [None]
    dist.scatter_object_list(out, [_obj(10 + k) for k in range(world)] if rank == 3 else None, src=3)
    return out


@entry("send_recv_object_list")
def _send_recv_object_list(rank: int, world: int) -> object:
    if rank == 0:
        dist.send_object_list([_obj(7), "seven"], dst=3)
        return None
    if rank == 3:
        objs: list[Any] = [None, None]
        dist.recv_object_list(objs, src=0)
        return objs
    return None


# -- groups -----------------------------------------------------------------------------------


@entry("new_group/1_3")
def _new_group_1_3(rank: int, world: int) -> object:
    g = dist.new_group([1, 3])
    out: list[object] = [_membership(g)]
    if rank in (1, 3):
        t = _arange(rank, 3)
        dist.all_reduce(t, group=g)
        b = _arange(rank, 2, torch.int64)
        dist.broadcast(b, group=g, group_src=1)
        gl = [torch.empty(2) for _ in range(2)]
        dist.all_gather(gl, _arange(rank, 2), group=g)
        objs: list[Any] = [None, None]
        dist.all_gather_object(objs, {"r": rank}, group=g)
        out += [t, b, gl, objs]
    return out


@entry("new_group/unsorted_3_0_2")
def _new_group_unsorted(rank: int, world: int) -> object:
    g = dist.new_group([3, 0, 2])
    out: list[object] = [_membership(g)]
    if rank != 1:
        out.append([dist.get_group_rank(g, rank), dist.get_global_rank(g, 0)])
        t = _reduce_input(R.MAX, torch.int32, rank)
        dist.reduce(t, dst=3, op=R.MAX, group=g)
        out.append(t if rank == 3 else None)
        s = torch.empty(2)
        sl = [torch.full((2,), 1.0 + k) for k in range(3)] if rank == 2 else None
        dist.scatter(s, sl, group=g, group_src=1)
        gl = [torch.empty(2) for _ in range(3)] if rank == 0 else None
        dist.gather(s + rank, gl, group=g, group_dst=0)
        x = _arange(rank, 3 * 2)
        o = torch.empty(3 * 2)
        dist.all_to_all_single(o, x, group=g)
        out += [s, gl, o]
    return out


@entry("new_group/overlapping")
def _new_group_overlapping(rank: int, world: int) -> object:
    g1 = dist.new_group([0, 1, 2])
    g2 = dist.new_group([1, 2, 3])
    out: list[object] = []
    t = _arange(rank, 2)
    if rank in (0, 1, 2):
        dist.all_reduce(t, group=g1)
    if rank in (1, 2, 3):
        dist.all_reduce(t, op=R.MAX, group=g2)
    out.append(t)
    rs = torch.empty(2)
    if rank in (1, 2, 3):
        reduce_scatter_single(rs, _arange(rank, 6), group=g2)
    out.append(rs if rank else None)
    return out


@entry("new_group/p2p")
def _new_group_p2p(rank: int, world: int) -> object:
    g = dist.new_group([2, 3])
    if rank == 2:
        dist.send(torch.tensor([5.0, 6.0]), group=g, group_dst=1)
    if rank == 3:
        t = torch.empty(2)
        src = dist.recv(t, group=g, group_src=0)
        return [src, t]
    return None


@entry("new_group/whole_world")
def _new_group_world(rank: int, world: int) -> object:
    g = dist.new_group()
    t = _reduce_input(R.PRODUCT, torch.int64, rank)
    dist.all_reduce(t, op=R.PRODUCT, group=g)
    return [_membership(g), t]


@entry("new_subgroups")
def _new_subgroups(rank: int, world: int) -> object:
    cur, subs = dist.new_subgroups(group_size=2)  # type: ignore[no-untyped-call]
    t = _arange(rank, 3)
    dist.all_reduce(t, group=cur)
    gl = [torch.empty(3) for _ in range(2)]
    dist.all_gather(gl, t + rank, group=cur)
    return [len(subs), _membership(cur), t, gl]


@entry("new_subgroups_by_enumeration")
def _new_subgroups_by_enumeration(rank: int, world: int) -> object:
    cur, subs = dist.new_subgroups_by_enumeration([[0, 3], [1, 2]])  # type: ignore[no-untyped-call]
    t = _reduce_input(R.BXOR, torch.uint8, rank)
    dist.all_reduce(t, op=R.BXOR, group=cur)
    b = torch.tensor([rank])
    dist.broadcast(b, group=cur, group_src=1)
    return [len(subs), _membership(cur), t, b]


# -- coalescing -------------------------------------------------------------------------------


@entry("all_reduce_coalesced")
def _all_reduce_coalesced(rank: int, world: int) -> object:
    a, b = _arange(rank, 3), _arange(rank, 4, shape=(2, 2))
    dist.all_reduce_coalesced([a, b], op=R.MAX)
    return [a, b]


@entry("all_gather_coalesced")
def _all_gather_coalesced(rank: int, world: int) -> object:
    a, b = _arange(rank, 2, torch.int64), _arange(rank, 3, torch.int64)
    # outs[i][j]: rank i's input j (torch's documented layout: one list per rank)
    outs = [[torch.empty_like(a), torch.empty_like(b)] for _ in range(world)]
    dist.all_gather_coalesced(outs, [a, b])
    return outs


@entry("all_gather_coalesced/as_many_inputs_as_ranks")
def _all_gather_coalesced_square(rank: int, world: int) -> object:
    ins = [_arange(rank, 2, torch.int64) + 10 * j for j in range(world)]
    outs = [[torch.empty(2, dtype=torch.int64) for _ in range(world)] for _ in range(world)]
    dist.all_gather_coalesced(outs, ins)
    return outs


@entry("coalescing_manager/all_reduce")
def _cm_all_reduce(rank: int, world: int) -> object:
    ts = [_arange(rank, n + 1) for n in range(3)]
    with _coalescing_manager():
        for t in ts:
            dist.all_reduce(t)
    return ts


@entry("coalescing_manager/all_reduce/async")
def _cm_all_reduce_async(rank: int, world: int) -> object:
    ts = [_reduce_input(R.MIN, torch.int32, rank), _arange(rank, 2, torch.int32)]
    with _coalescing_manager(async_ops=True) as cm:
        for t in ts:
            dist.all_reduce(t, op=R.MIN, async_op=True)
    cm.wait()
    return ts


@entry("coalescing_manager/all_gather_single")
def _cm_all_gather_single(rank: int, world: int) -> object:
    ins = [_arange(rank, 2), _arange(rank, 3)]
    outs = [torch.empty(world * 2), torch.empty(world * 3)]
    with _coalescing_manager():
        for o, i in zip(outs, ins, strict=True):
            all_gather_single(o, i)
    return outs


@entry("coalescing_manager/reduce_scatter_single")
def _cm_reduce_scatter_single(rank: int, world: int) -> object:
    ins = [_arange(rank, world), _arange(rank, world * 2)]
    outs = [torch.empty(1), torch.empty(2)]
    with _coalescing_manager():
        for o, i in zip(outs, ins, strict=True):
            reduce_scatter_single(o, i)
    return outs


# -- async_op=True: Work.wait(), is_completed(), result(), get_future() -----------------------


@entry("async/all_reduce/wait")
def _async_all_reduce_wait(rank: int, world: int) -> object:
    t = _reduce_input(R.SUM, torch.float32, rank)
    w = _issued(dist.all_reduce(t, async_op=True))
    ok = w.wait()
    return [t, ok, w.is_completed()]


@entry("async/all_reduce/result")
def _async_all_reduce_result(rank: int, world: int) -> object:
    t = _reduce_input(R.SUM, torch.int64, rank)
    w = _issued(dist.all_reduce(t, async_op=True))
    w.wait()  # gloo: "Work needs to be completed before calling result()"
    res = w.result()
    return [t, res, [r.data_ptr() == t.data_ptr() for r in res]]


@entry("async/all_reduce/future")
def _async_all_reduce_future(rank: int, world: int) -> object:
    t = _reduce_input(R.MAX, torch.float64, rank)
    w = _issued(dist.all_reduce(t, op=R.MAX, async_op=True))
    fut = w.get_future()
    waited = fut.wait()
    value = fut.value()
    return [t, waited, value, [v.data_ptr() == t.data_ptr() for v in value], fut.done()]


@entry("async/all_reduce/future_then")
def _async_all_reduce_then(rank: int, world: int) -> object:
    t = _arange(rank, 3)
    w = _issued(dist.all_reduce(t, async_op=True))
    doubled = w.get_future().then(lambda f: [2 * x for x in f.value()])
    return doubled.wait()


@entry("async/many_outstanding")
def _async_many(rank: int, world: int) -> object:
    ts = [_arange(rank, k + 1) for k in range(4)]
    works = [dist.all_reduce(t, op=R.MIN if k % 2 else R.SUM, async_op=True) for k, t in enumerate(ts)]
    for w in reversed(works):
        assert w is not None
        w.wait()
    return ts


@entry("async/broadcast/future")
def _async_broadcast(rank: int, world: int) -> object:
    t = _arange(rank, 3, torch.int32)
    w = _issued(dist.broadcast(t, src=2, async_op=True))
    return [w.get_future().wait(), t]


@entry("async/all_gather/future")
def _async_all_gather(rank: int, world: int) -> object:
    out = [torch.empty(2) for _ in range(world)]
    w = _issued(dist.all_gather(out, _arange(rank, 2), async_op=True))
    return [w.get_future().wait(), out]


@entry("async/all_gather_single/future")
def _async_all_gather_single(rank: int, world: int) -> object:
    out = torch.empty(world * 2)
    w = _issued(all_gather_single(out, _arange(rank, 2), async_op=True))
    return [w.get_future().wait(), out]


@entry("async/reduce_scatter_single/wait")
def _async_reduce_scatter_single(rank: int, world: int) -> object:
    out = torch.empty(2)
    w = _issued(reduce_scatter_single(out, _arange(rank, world * 2), async_op=True))
    # no get_future() here: gloo's work for it has none ("Work::getFuture not implemented")
    return [w.wait(), out]


@entry("async/all_to_all_single/future")
def _async_all_to_all_single(rank: int, world: int) -> object:
    out = torch.empty(world)
    w = _issued(dist.all_to_all_single(out, _arange(rank, world), async_op=True))
    return [w.get_future().wait(), out]


@entry("async/gather_scatter/wait")
def _async_gather_scatter(rank: int, world: int) -> object:
    gl = [torch.empty(2) for _ in range(world)] if rank == 1 else None
    w1 = _issued(dist.gather(_arange(rank, 2), gl, dst=1, async_op=True))
    out = torch.empty(2)
    sl = [torch.full((2,), 1.0 + k) for k in range(world)] if rank == 0 else None
    w2 = _issued(dist.scatter(out, sl, src=0, async_op=True))
    w2.wait()
    w1.wait()
    return [gl, out]


@entry("async/gather/future")
def _async_gather_future(rank: int, world: int) -> object:
    gl = [torch.empty(2) for _ in range(world)] if rank == 2 else None
    w = _issued(dist.gather(_arange(rank, 2), gl, dst=2, async_op=True))
    return [w.get_future().wait(), gl]


@entry("async/scatter/future")
def _async_scatter_future(rank: int, world: int) -> object:
    out = torch.empty(2, dtype=torch.int64)
    sl = [torch.full((2,), 1 + k) for k in range(world)] if rank == 3 else None
    w = _issued(dist.scatter(out, sl, src=3, async_op=True))
    return [w.get_future().wait(), out]


@entry("async/reduce/future")
def _async_reduce_future(rank: int, world: int) -> object:
    t = _reduce_input(R.SUM, torch.int32, rank)
    w = _issued(dist.reduce(t, dst=0, async_op=True))
    value = w.get_future().wait()
    return [value, t] if rank == 0 else None  # the other ranks' tensors are gloo's scratch space


@entry("async/all_to_all/future")
def _async_all_to_all_future(rank: int, world: int) -> object:
    outs = [torch.empty(2) for _ in range(world)]
    w = _issued(dist.all_to_all(outs, [torch.full((2,), 10.0 * rank + j) for j in range(world)], async_op=True))
    return [w.get_future().wait(), outs]


@entry("async/all_to_all_single/uneven/future")
def _async_all_to_all_single_uneven(rank: int, world: int) -> object:
    in_splits = [rank + j + 1 for j in range(world)]
    out_splits = [i + rank + 1 for i in range(world)]
    out = torch.empty(sum(out_splits), dtype=torch.int64)
    w = _issued(
        dist.all_to_all_single(out, torch.arange(sum(in_splits)) + 100 * rank, out_splits, in_splits, async_op=True)
    )
    return [w.get_future().wait(), out]


@entry("async/barrier/future")
def _async_barrier_future(rank: int, world: int) -> object:
    w = _issued(dist.barrier(async_op=True))
    return w.get_future().wait()


@entry("async/barrier")
def _async_barrier(rank: int, world: int) -> object:
    w = _issued(dist.barrier(async_op=True))
    return [w.wait(), w.is_completed()]


@entry("async/all_reduce_coalesced/future")
def _async_all_reduce_coalesced(rank: int, world: int) -> object:
    a, b = _arange(rank, 2), _arange(rank, 3)
    fut = dist.all_reduce_coalesced([a, b], async_op=True)
    assert fut is not None
    fut.wait()
    return [a, b]


# -- the two runs -----------------------------------------------------------------------------


@contextmanager
def _quiet_deprecations() -> Iterator[None]:
    """Let the deprecated names (FutureWarning in torch 2.13) run; any other warning still fails."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_DEPRECATED, category=FutureWarning)
        yield


def _gloo_rank_main(argv: list[str]) -> None:
    """One gloo rank: ``python test_conformance.py RANK WORLD INIT_METHOD OUT``."""
    rank, world, init_method, out = int(argv[0]), int(argv[1]), argv[2], argv[3]
    results: dict[str, object] = {}
    rest = [name for name in TABLE if name not in ISOLATED]
    for k, only in enumerate([rest, *([name] for name in ISOLATED)]):
        # a fresh world (and rendezvous file) for each part
        dist.init_process_group(
            "gloo", rank=rank, world_size=world, init_method=f"{init_method}.{k}", timeout=timedelta(seconds=60)
        )
        try:
            with _quiet_deprecations():
                results.update(run_table(rank, world, only, gloo=True))
        finally:
            dist.destroy_process_group()
    torch.save(results, out)


def _loopback_ifname() -> str | None:
    for _, name in socket.if_nameindex():
        if name in ("lo", "lo0"):
            return name
    return None


def _start_gloo(tmp: Path) -> list[tuple[subprocess.Popen[bytes], Path, Path]]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if "GLOO_SOCKET_IFNAME" not in env and (lo := _loopback_ifname()) is not None:
        env["GLOO_SOCKET_IFNAME"] = lo  # loopback only: the rendezvous must not need a network
    init_method = (tmp / "store").as_uri()
    procs = []
    for rank in range(WORLD):
        out, err = tmp / f"rank{rank}.pt", tmp / f"rank{rank}.stderr"
        with err.open("wb") as ferr:
            cmd = [sys.executable, str(Path(__file__).resolve()), str(rank), str(WORLD), init_method, str(out)]
            p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=ferr, cwd=tmp)
        procs.append((p, out, err))
    return procs


def _finish_gloo(procs: list[tuple[subprocess.Popen[bytes], Path, Path]], deadline: float) -> list[dict[str, object]]:
    try:
        for p, _, _ in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"gloo ranks did not finish in {GLOO_TIMEOUT}s") from None
        failed = [(i, err) for i, (p, _, err) in enumerate(procs) if p.returncode != 0]
        if failed:
            i, err = failed[0]
            raise RuntimeError(f"gloo rank {i} failed:\n{err.read_text()[-4000:]}")
        return [torch.load(out, weights_only=False) for _, out, _ in procs]
    finally:
        for p, _, _ in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)


def _run_aiocoll(only: Collection[str]) -> list[dict[str, object]]:
    import aiocoll

    names = frozenset(only)
    with _quiet_deprecations():
        return aiocoll.spawn(
            lambda comm: run_table(dist.get_rank(), dist.get_world_size(), names), world=WORLD, timeout=AIOCOLL_TIMEOUT
        )


@dataclass
class Results:
    gloo: list[dict[str, object]] = field(default_factory=list)
    aiocoll: list[dict[str, object]] = field(default_factory=lambda: [{} for _ in range(WORLD)])
    errors: dict[str, BaseException] = field(default_factory=dict)
    """aiocoll entries that raised, each run in a world of its own to tell them apart."""

    def add_aiocoll(self, names: list[str]) -> None:
        try:
            part = _run_aiocoll(names)
        except Exception as e:
            if len(names) == 1:
                self.errors[names[0]] = e
            else:  # some entry failed: find which
                for name in names:
                    self.add_aiocoll([name])
            return
        for rank in range(WORLD):
            self.aiocoll[rank].update(part[rank])


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Results:
    """Both runs, once per module: gloo's ranks start first and run while aiocoll does."""
    tmp = tmp_path_factory.mktemp("gloo")
    deadline = time.monotonic() + GLOO_TIMEOUT
    procs = _start_gloo(tmp)
    res = Results()
    try:
        res.add_aiocoll([name for name in TABLE if name not in XFAIL and name not in ISOLATED])
        for name in [*XFAIL, *ISOLATED]:  # each in its own world (XFAIL: known to differ, maybe to raise)
            res.add_aiocoll([name])
    finally:
        res.gloo = _finish_gloo(procs, deadline)
    return res


# -- comparison -------------------------------------------------------------------------------


def _diff(g: object, a: object, where: str, exact: bool) -> list[str]:
    """How aiocoll's output ``a`` differs from gloo's ``g`` (empty: the same)."""
    if isinstance(g, torch.Tensor):
        if not isinstance(a, torch.Tensor):
            return [f"{where}: gloo gave a tensor, aiocoll {a!r}"]
        if (g.dtype, g.shape) != (a.dtype, a.shape):
            return [f"{where}: gloo {g.dtype}{list(g.shape)}, aiocoll {a.dtype}{list(a.shape)}"]
        same = torch.equal(g, a) if exact else torch.allclose(g, a, rtol=1e-6, atol=1e-6)
        return [] if same else [f"{where}:\n  gloo    {g.tolist()}\n  aiocoll {a.tolist()}"]
    if isinstance(g, (list, tuple)):
        if type(a) is not type(g) or len(a) != len(g):
            return [f"{where}: gloo {g!r}, aiocoll {a!r}"]
        return [m for i, (x, y) in enumerate(zip(g, a, strict=True)) for m in _diff(x, y, f"{where}[{i}]", exact)]
    if isinstance(g, dict):
        if not isinstance(a, dict) or list(a) != list(g):
            return [f"{where}: gloo {g!r}, aiocoll {a!r}"]
        return [m for k in g for m in _diff(g[k], a[k], f"{where}[{k!r}]", exact)]
    if type(a) is not type(g) or a != g:
        return [f"{where}: gloo {g!r}, aiocoll {a!r}"]
    return []


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=XFAIL[n])) if n in XFAIL else n for n in TABLE],
)
def test_same_as_gloo(results: Results, name: str) -> None:
    if name in results.errors:
        raise results.errors[name]
    lacking = {r[name] for r in results.gloo if isinstance(r[name], str) and r[name].startswith(UNSUPPORTED)}
    refused = sum(isinstance(r[name], str) and r[name].startswith(UNSUPPORTED) for r in results.gloo)
    assert refused in (0, WORLD), f"{name}: gloo refused it on {refused} of {WORLD} ranks: {lacking}"
    if lacking:
        pytest.skip(f"gloo of torch {torch.__version__} cannot run it, so there is nothing to compare: {lacking}")
    mismatches = [
        m
        for rank in range(WORLD)
        for m in _diff(results.gloo[rank][name], results.aiocoll[rank][name], f"rank {rank}", name not in TOLERANT)
    ]
    assert not mismatches, f"{name}: aiocoll differs from gloo\n" + "\n".join(mismatches)


def test_table_covers_the_calls() -> None:
    """The table exercises every call the conformance check promises to cover."""
    covered = {name.split("/", 1)[0] for name in TABLE}
    assert covered >= {
        "all_reduce", "reduce", "broadcast", "all_gather", "all_gather_single", "all_gather_into_tensor", "gather",
        "scatter", "reduce_scatter", "reduce_scatter_single", "reduce_scatter_tensor", "all_to_all",
        "all_to_all_single", "barrier", "send_recv", "isend_irecv", "batch_isend_irecv", "recv", "irecv",
        "broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list", "send_recv_object_list",
        "new_group", "new_subgroups", "new_subgroups_by_enumeration", "all_reduce_coalesced", "all_gather_coalesced",
        "coalescing_manager", "async",
    }  # fmt: skip
    dtypes = {name.split("/")[2] for name in TABLE if name.startswith("all_reduce/") and name.count("/") == 2}
    assert dtypes >= {_dt_name(dt) for dt in DTYPES}


if __name__ == "__main__":
    _gloo_rank_main(sys.argv[1:])
