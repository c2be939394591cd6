"""What the benchmarks share: a timed loop, and torch's threaded process group run the way torch's tests run it.

``run_threaded_pg(world, rank_fn)`` starts one OS thread per rank, each calling
``dist.init_process_group("threaded", rank=r, world_size=W, store=HashStore)`` (thread isolation mode on, as
torch's ``MultiThreadedTestCase`` does) and then ``rank_fn(rank)``. Every call installs a fresh thread-local
world and uninstalls it afterwards (process groups destroyed, collective state reset, the ``sys.excepthook``
that every rank's ``init_process_group`` wraps restored, c10d's globals put back), so world sizes and repeats
do not interfere.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from aiocoll._torch import threaded_harness

if TYPE_CHECKING:
    from aiocoll import Comm

T = TypeVar("T")

PG_JOIN_TIMEOUT = 300.0  # seconds to wait for the threaded PG's threads before giving up
# torch.distributed.distributed_c10d globals that init_process_group sets and destroy_process_group leaves set
C10D_GLOBALS = ("_backend", "_default_pg_init_method")
# torch 2.13 deprecates the name (in favour of all_gather_single) with a FutureWarning; the benchmark measures the
# collective under the name the issue and aiocoll's API use, and the warning would only clutter the progress log.
warnings.filterwarnings(
    "ignore", message=r"`torch\.distributed\.all_gather_into_tensor` is deprecated", category=FutureWarning
)


class Unavailable(Exception):
    """A system cannot be measured here; the message says why."""


def timed_loop(call: Callable[[], object], warmup: int, iters: int) -> float:
    """Seconds for ``iters`` calls of ``call``, after ``warmup`` untimed ones."""
    for _ in range(warmup):
        call()
    start = time.perf_counter()
    for _ in range(iters):
        call()
    return time.perf_counter() - start


def checked_dist_all_reduce(rank: int, world: int, numel: int = 1) -> torch.Tensor:
    """A tensor of ``numel`` zeros after one checked ``dist.all_reduce`` (every rank adds ones)."""
    t = torch.ones(numel)
    dist.all_reduce(t)
    if t[0].item() != world or t[-1].item() != world:
        raise AssertionError(f"rank {rank}: all_reduce gave {t[0].item()}, expected {world}")
    return t.zero_()


def timed_dist_all_reduce(rank: int, world: int, warmup: int, iters: int, numel: int = 1) -> float:
    """One rank's part, through torch.distributed: a checked all_reduce, the warm-up, the timed loop."""
    t = checked_dist_all_reduce(rank, world, numel)
    return timed_loop(lambda: dist.all_reduce(t), warmup, iters)


async def timed_comm_all_reduce(comm: Comm, warmup: int, iters: int, numel: int = 1) -> float:
    """Seconds for ``iters`` awaited ``comm.all_reduce``, after a checked first one and ``warmup`` more."""
    t = torch.ones(numel)
    await comm.all_reduce(t)
    if t[0].item() != comm.world_size or t[-1].item() != comm.world_size:
        raise AssertionError(f"rank {comm.rank}: all_reduce gave {t[0].item()}, expected {comm.world_size}")
    t.zero_()
    for _ in range(warmup):
        await comm.all_reduce(t)
    start = time.perf_counter()
    for _ in range(iters):
        await comm.all_reduce(t)
    return time.perf_counter() - start


def timed_dist_all_gather(rank: int, world: int, warmup: int, iters: int, numel: int) -> float:
    """Like ``timed_dist_all_reduce``, for ``dist.all_gather_into_tensor`` of ``numel`` elements per rank."""
    inp = torch.full((numel,), float(rank))
    out = torch.empty(numel * world)
    dist.all_gather_into_tensor(out, inp)
    if out[numel * (world - 1)].item() != world - 1 or out[0].item() != 0:
        raise AssertionError(f"rank {rank}: all_gather_into_tensor gave wrong data")
    return timed_loop(lambda: dist.all_gather_into_tensor(out, inp), warmup, iters)


def print_report(header: Sequence[str], sections: Sequence[tuple[str | None, Sequence[str]]]) -> None:
    """Print ``header``, then each section that has lines: a blank line, its title (if any), its lines."""
    for line in header:
        print(line)
    for title, lines in sections:
        if not lines:
            continue
        print()
        if title is not None:
            print(title)
        for line in lines:
            print(line)


def start_and_join(
    threads: list[threading.Thread],
    world: int,
    worker: Callable[[int], None],
    name: str,
    abort: Callable[[], None],
    timeout: float,
) -> None:
    """Start a daemon thread ``worker(rank)`` per rank (into ``threads``), then join them all within ``timeout`` s.

    If a thread cannot be started, ``abort()`` releases those already waiting for their peers, and this raises
    ``Unavailable``. Threads still alive after the timeout are left to the caller (they die with the process).
    """
    try:
        for rank in range(world):
            th = threading.Thread(target=worker, args=(rank,), name=f"{name} {rank}", daemon=True)
            th.start()
            threads.append(th)
    except RuntimeError as e:  # "can't start new thread"
        abort()
        raise Unavailable(f"could only start {len(threads)} of {world} threads ({e})") from e
    finally:
        deadline = time.monotonic() + timeout
        for th in threads:
            th.join(max(0.0, deadline - time.monotonic()))


def run_threaded_pg(world: int, rank_fn: Callable[[int], T], timeout: float = PG_JOIN_TIMEOUT) -> list[T]:
    """Run ``rank_fn(rank)`` on every rank of a fresh threaded-PG world; return the results in rank order.

    Raises ``Unavailable`` if the threaded PG cannot be imported, its threads cannot be started or do not
    finish within ``timeout`` seconds, or a rank fails (torch's test helper is not ours to debug).
    """
    try:
        from torch.testing._internal.distributed.multi_threaded_pg import (
            ProcessLocalGroup,
            _install_threaded_pg,
            _uninstall_threaded_pg,
        )
    except ImportError as e:  # e.g. a torch build without torch.distributed
        raise Unavailable(f"torch's threaded process group cannot be imported: {e}") from e

    store = dist.HashStore()  # type: ignore[attr-defined]  # not in torch.distributed's __all__
    # All threads meet here before init_process_group: if some cannot be started, aborting this barrier
    # releases the others at once instead of leaving them in the PG's store barrier until its timeout.
    started = threading.Barrier(world)
    results: dict[int, T] = {}
    errors: list[tuple[int, BaseException]] = []

    def worker(rank: int) -> None:
        try:
            started.wait()
            dist.init_process_group(
                "threaded", rank=rank, world_size=world, store=store, timeout=timedelta(seconds=timeout)
            )
            try:
                results[rank] = rank_fn(rank)
            finally:
                dist.destroy_process_group()
        except BaseException as e:
            errors.append((rank, e))
            ProcessLocalGroup.exception_handle(e)  # type: ignore[no-untyped-call]  # wake the ranks waiting in a collective so they exit too

    threads: list[threading.Thread] = []
    # Process-wide state that init_process_group changes and destroy_process_group does not restore: each
    # rank wraps sys.excepthook in another prefixing hook (after a few W=1024 runs, thousands of nested hooks
    # make the next uncaught exception die of RecursionError), and the default PG's backend and init method.
    saved_excepthook = sys.excepthook
    saved_c10d = {name: getattr(c10d, name) for name in C10D_GLOBALS}
    torch._C._distributed_c10d._set_thread_isolation_mode(True)  # type: ignore[attr-defined]
    # torch 2.11's harness lacks _World.comms, which destroy_process_group reads: mended, at no cost per op
    mended = threaded_harness.mend_thread_local_world()
    for change in mended:
        setattr(change.owner, change.name, change.value)
    _install_threaded_pg()  # type: ignore[no-untyped-call]
    try:
        start_and_join(threads, world, worker, "threaded-pg rank", started.abort, timeout)
        stuck = sum(th.is_alive() for th in threads)
        if stuck:
            ProcessLocalGroup.exception_handle(TimeoutError())  # type: ignore[no-untyped-call]
            raise Unavailable(f"{stuck} of {world} threads still running after {timeout:.0f}s")
    finally:
        ProcessLocalGroup.reset()  # type: ignore[no-untyped-call]
        _uninstall_threaded_pg()  # type: ignore[no-untyped-call]
        for change in mended:
            delattr(change.owner, change.name)
        torch._C._distributed_c10d._set_thread_isolation_mode(False)  # type: ignore[attr-defined]
        sys.excepthook = saved_excepthook
        for name, value in saved_c10d.items():
            setattr(c10d, name, value)
    if errors:
        # the root cause, not the SystemExit of the ranks that the PG's terminate event took down
        rank, exc = min(errors, key=lambda item: (isinstance(item[1], SystemExit), item[0]))
        raise Unavailable(f"failed on rank {rank} of {world}: {type(exc).__name__}: {exc}")
    if dist.is_initialized():  # the main thread's world must be untouched
        raise Unavailable("it left a default process group behind in the main thread")
    return [results[rank] for rank in range(world)]


def positive_int(text: str) -> int:
    """An argparse type: an int >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value
