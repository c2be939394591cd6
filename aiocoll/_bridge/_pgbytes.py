"""Async exchange of byte strings over a real process group (the object collectives' transport).

``all_gather_bytes``, ``broadcast_bytes``, ``gather_bytes``, ``scatter_bytes``: sizes
first, then padded uint8 tensors, every op ``async_op`` and awaited through
``_pgbridge``; torch's ``all_gather_object`` and the like block, so they are not used.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .. import _torch
from ._pgbridge import bridge_work

__all__ = ["all_gather_bytes", "broadcast_bytes", "device_of", "gather_bytes", "scatter_bytes"]

# -- byte exchange (objects) ------------------------------------------------------------------


def _bytes_tensor(payload: bytes, size: int, device: torch.device) -> torch.Tensor:
    t = torch.zeros(size, dtype=torch.uint8)
    if payload:
        t[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    return t.to(device)


def _tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.cpu().contiguous()
    return ctypes.string_at(t.data_ptr(), t.numel()) if t.numel() else b""


def _sizes(n: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(list(n), dtype=torch.int64).to(device)


def device_of(pg: dist.ProcessGroup) -> torch.device:
    """Where byte tensors go for ``pg``: the CPU if it has a CPU backend (gloo), else its accelerator."""
    try:
        _torch.backend_of(pg, torch.device("cpu"))
    except RuntimeError:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


async def _wait(work: dist.Work, dev: torch.device) -> None:
    await bridge_work(work, on_device=dev.type != "cpu")


def _allgather_opts(timeout: timedelta | None) -> Any:
    o = _torch.options.AllgatherOptions()
    if timeout is not None:
        o.timeout = timeout
    return o


def _bcast_opts(root: int, timeout: timedelta | None) -> Any:
    o = _torch.options.BroadcastOptions()
    o.rootRank = root
    if timeout is not None:
        o.timeout = timeout
    return o


async def all_gather_bytes(pg: dist.ProcessGroup, payload: bytes, *, timeout: timedelta | None = None) -> list[bytes]:
    """Every rank's ``payload``, in rank order; two ``async_op`` all_gathers (sizes, then bytes).

    Ops reach ``pg`` in the order they are issued, so call it where no other op of ``pg``
    can be issued meanwhile (``Issuer`` does that)::

        payloads = await all_gather_bytes(pg, pickle.dumps(obj))
    """
    w, dev = pg.size(), device_of(pg)
    sizes = torch.empty(w, dtype=torch.int64, device=dev)
    await _wait(_torch.allgather_into(pg, sizes, _sizes([len(payload)], dev), _allgather_opts(timeout)), dev)
    ns = sizes.tolist()
    most = max(ns)
    out = torch.empty(w * most, dtype=torch.uint8, device=dev)
    await _wait(_torch.allgather_into(pg, out, _bytes_tensor(payload, most, dev), _allgather_opts(timeout)), dev)
    out = out.cpu()
    return [_tensor_bytes(out[i * most : i * most + n]) for i, n in enumerate(ns)]


async def broadcast_bytes(
    pg: dist.ProcessGroup, payload: bytes | None, src: int, *, timeout: timedelta | None = None
) -> bytes:
    """Rank ``src``'s ``payload`` (group rank) on every rank; ``payload`` is ignored elsewhere::

    data = await broadcast_bytes(pg, blob if pg.rank() == 0 else None, src=0)
    """
    dev = device_of(pg)
    mine = pg.rank() == src
    size = _sizes([len(payload) if mine and payload is not None else 0], dev)
    await _wait(pg.broadcast([size], _bcast_opts(src, timeout)), dev)
    n = int(size.item())
    buf = _bytes_tensor(payload or b"", n, dev) if mine else torch.empty(n, dtype=torch.uint8, device=dev)
    await _wait(pg.broadcast([buf], _bcast_opts(src, timeout)), dev)
    return payload if mine and payload is not None else _tensor_bytes(buf)


async def gather_bytes(
    pg: dist.ProcessGroup, payload: bytes, dst: int, *, timeout: timedelta | None = None
) -> list[bytes] | None:
    """Every rank's ``payload`` as a list on rank ``dst`` (group rank); None elsewhere::

    payloads = await gather_bytes(pg, pickle.dumps(obj), dst=0)
    """
    w, dev = pg.size(), device_of(pg)
    sizes = torch.empty(w, dtype=torch.int64, device=dev)
    await _wait(_torch.allgather_into(pg, sizes, _sizes([len(payload)], dev), _allgather_opts(timeout)), dev)
    ns = sizes.tolist()
    most = max(ns)
    outs = [torch.empty(most, dtype=torch.uint8, device=dev) for _ in range(w)] if pg.rank() == dst else []
    o = _torch.options.GatherOptions()
    o.rootRank = dst
    if timeout is not None:
        o.timeout = timeout
    await _wait(pg.gather([outs] if outs else [], [_bytes_tensor(payload, most, dev)], o), dev)
    if not outs:
        return None
    return [_tensor_bytes(t[:n]) for t, n in zip(outs, ns, strict=True)]


async def scatter_bytes(
    pg: dist.ProcessGroup, payloads: Sequence[bytes] | None, src: int, *, timeout: timedelta | None = None
) -> bytes:
    """``payloads[i]`` of rank ``src`` (group rank) to rank i; ``payloads`` is ignored elsewhere::

    mine = await scatter_bytes(pg, blobs if pg.rank() == 0 else None, src=0)
    """
    w, dev = pg.size(), device_of(pg)
    mine = pg.rank() == src and payloads is not None
    sizes = _sizes([len(p) for p in payloads] if mine and payloads is not None else [0] * w, dev)
    await _wait(pg.broadcast([sizes], _bcast_opts(src, timeout)), dev)
    ns = sizes.tolist()
    most = max(ns)
    out = torch.empty(most, dtype=torch.uint8, device=dev)
    ins = [[_bytes_tensor(p, most, dev) for p in payloads]] if mine and payloads is not None else []
    o = _torch.options.ScatterOptions()
    o.rootRank = src
    if timeout is not None:
        o.timeout = timeout
    await _wait(pg.scatter([out], ins, o), dev)
    return _tensor_bytes(out[: ns[pg.rank()]])
