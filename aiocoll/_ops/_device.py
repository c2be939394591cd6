"""Where an op's data work runs: inline on the loop, on a worker thread, or on a CUDA side stream.

The engine decides *when* an op runs (the last rank arrived); this module decides
*where*, so the loop never stalls on data movement:

* small CPU ops run inline: a thread hand-off costs tens of microseconds, more than the op;
* large CPU ops run on a worker thread: torch releases the GIL inside its kernels, so the
  loop keeps serving other tasks (and other ranks) meanwhile;
* CUDA ops are enqueued on a side stream and awaited through an event: ``_cuda`` does
  that, building on this module (``tensors_of``), and the engine calls it directly.

Off-loop execution returns an ``asyncio.Future`` with the op's results, completed on the
loop; the engine keeps ops in issue order around it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import enum
import os
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

import torch

if TYPE_CHECKING:
    from . import Call

__all__ = ["INLINE_BYTES", "Placement", "placement", "run_in_worker", "tensors_of"]

# Total bytes an op may move (summed over its ranks) and still run inline on the loop:
# below this a worker-thread round trip (measured 100-300 us on 2 cores, with the ranks'
# wake-ups) costs more than the copy itself; above it the loop would stall visibly.
INLINE_BYTES = 1 << 20

C = TypeVar("C")  # an op's call
R = TypeVar("R")  # what it gives a rank


class Placement(enum.Enum):
    INLINE = "inline"
    THREAD = "thread"
    CUDA = "cuda"


def placement(calls: Sequence[Call], inline_bytes: int = INLINE_BYTES) -> Placement:
    """Where to run an op over ``calls`` (one per rank)."""
    # no CUDA tensor can exist before CUDA is initialised: skip the scan on CPU-only runs.
    # Checked before the size: an op with CUDA tensors must be ordered with the ranks'
    # streams even when rank 0 moves nothing (uneven all_to_all_single).
    cuda_up: bool = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    if cuda_up and any(t.is_cuda for c in calls for t in tensors_of(c)):
        return Placement.CUDA
    nbytes = calls[0].nbytes
    if nbytes == 0:
        return Placement.INLINE
    return Placement.THREAD if nbytes * len(calls) > inline_bytes else Placement.INLINE


def tensors_of(call: Call) -> list[torch.Tensor]:
    """Every tensor a call holds, in field order (lists of tensors flattened)."""
    out: list[torch.Tensor] = []
    for f in dataclasses.fields(call):
        v = getattr(call, f.name)
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out.extend(x for x in v if isinstance(x, torch.Tensor))
    return out


_executor: concurrent.futures.ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()


def _get_executor() -> concurrent.futures.ThreadPoolExecutor:
    global _executor
    with _executor_lock:
        if _executor is None:
            # One thread is enough: the engine runs off-loop ops one at a time, in issue
            # order, and torch parallelises inside each kernel. Its threads are daemon-like
            # (atexit joins idle workers quickly), so no shutdown hook is needed.
            _executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix=f"aiocoll-op-{os.getpid()}"
            )
        return _executor


def run_in_worker(
    loop: asyncio.AbstractEventLoop, run: Callable[[Sequence[C]], list[R]], calls: Sequence[C]
) -> asyncio.Future[list[R]]:
    """Run ``run(calls)`` on aiocoll's worker thread; the future completes on ``loop``."""
    return loop.run_in_executor(_get_executor(), run, calls)
