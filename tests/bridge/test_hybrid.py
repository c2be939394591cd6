"""Hybrid worlds: ``aiocoll.spawn(fn, world=N, process_group=pg)`` over M gloo processes.

Two gloo processes on 127.0.0.1 (this file, run as a script, is the per-process runner;
a FileStore does the rendezvous) each run N/2 async ranks. What they observe is saved
with ``torch.save`` and compared with a flat in-process world of N ranks:

* the whole table of ``test_process_group`` (every collective, reduce op and dtype,
  p2p across processes, objects, new_group/split) on 2 processes x 2 ranks;
* a world of 2 x 512 ranks;
* what only a hybrid world has: a mismatch across processes (reported with every
  rank's call, in every process), an any-source receive refused, a bad world size.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import aiocoll

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_process_group import _same, run_processes, table

PROCS = 2
PER_PROC = 2
BIG_PER_PROC = 512
LAUNCH_TIMEOUT = 120.0


async def big(comm: aiocoll.Comm) -> list[Any]:
    """A few collectives over a large world; inexact float sums, so the order matters."""
    r = comm.rank
    t = torch.tensor([0.1 * r, 1.0 / (r + 1), float(r) ** 1.5])
    await comm.all_reduce(t)
    out = torch.zeros(comm.world_size)
    await comm.all_gather_into_tensor(out, torch.tensor([r * 0.5]))
    half = await comm.split(r % 2, key=-r)
    assert half is not None
    u = torch.tensor([1.0 / (r + 3)])
    await half.all_reduce(u)
    b = torch.full((2,), float(r))
    await comm.broadcast(b, src=comm.world_size - 1)
    right, left = (r + 1) % comm.world_size, (r - 1) % comm.world_size
    got = torch.zeros(1)
    sent = comm.send(torch.tensor([float(r)]), right)
    await comm.recv(got, left)
    await sent
    return [t, out.sum(), half.rank, u, b, got]


def threads(comm: aiocoll.Comm) -> list[Any]:
    """Sync ranks (a plain def: one thread per rank) in a hybrid world."""
    t = torch.arange(3.0) + comm.rank
    comm.all_reduce(t).wait()
    got = torch.zeros(1)
    right, left = (comm.rank + 1) % comm.world_size, (comm.rank - 1) % comm.world_size
    sent = comm.send(torch.tensor([comm.rank * 2.0]), right)
    comm.recv(got, left).wait()
    sent.wait()
    return [t, got, comm.all_gather_object(comm.rank).wait()]


async def mismatch(comm: aiocoll.Comm) -> list[Any]:
    t = torch.ones(2)
    t0 = time.perf_counter()
    try:
        if comm.rank == 3:
            await comm.broadcast(t, src=0)
        else:
            await comm.all_reduce(t)
    except aiocoll.CollectiveMismatchError as e:
        return [str(e), time.perf_counter() - t0]
    return ["no error", 0.0]


async def uncaught_mismatch(comm: aiocoll.Comm) -> None:
    await comm.barrier()
    if comm.rank == 0:
        await comm.all_reduce(torch.ones(2), op=dist.ReduceOp.MAX)
    else:
        await comm.all_reduce(torch.ones(2))


async def failing(comm: aiocoll.Comm) -> list[Any]:
    await comm.barrier()
    if comm.rank == 3:
        raise ValueError("rank 3 gives up")
    t0 = time.perf_counter()
    w = comm.all_reduce(torch.ones(1))
    fut = w.torch_future(None)  # as DDP's reducer gets it: it must fail in C++ too
    try:
        await w
    except aiocoll.WorldAbortedError as e:
        seconds = time.perf_counter() - t0
        try:
            torch.futures.collect_all([fut]).wait()  # C++: fails only on a C++ error
        except RuntimeError as cpp:
            return [str(e), seconds, str(cpp)]
        return [str(e), seconds, "no C++ error"]
    return ["no error", 0.0, ""]


async def any_source(comm: aiocoll.Comm) -> str:
    try:
        comm.recv(torch.zeros(1))
    except aiocoll.InvalidArgumentError as e:
        return str(e)
    return "no error"


def _process_main(argv: list[str]) -> None:
    """One process: ``python test_hybrid.py PROC INIT_METHOD OUT``."""
    proc, init_method, path = int(argv[0]), argv[1], argv[2]
    dist.init_process_group("gloo", rank=proc, world_size=PROCS, init_method=init_method, timeout=timedelta(seconds=30))
    world = dist.group.WORLD
    assert world is not None
    out: dict[str, Any] = {}
    out["table"] = aiocoll.spawn(
        functools.partial(table, any_source=False), world=PROCS * PER_PROC, process_group=world, timeout=30
    )
    t0 = time.perf_counter()
    out["big"] = aiocoll.spawn(big, world=PROCS * BIG_PER_PROC, process_group=world, timeout=30)
    out["big_seconds"] = time.perf_counter() - t0
    out["threads"] = aiocoll.spawn(threads, world=4, process_group=world, timeout=30)
    out["mismatch"] = aiocoll.spawn(mismatch, world=4, process_group=world, timeout=60)
    try:
        aiocoll.spawn(uncaught_mismatch, world=4, process_group=world, timeout=60)
    except aiocoll.CollectiveMismatchError as e:
        out["mismatch_notes"] = getattr(e, "__notes__", [])
    try:
        out["failing"] = aiocoll.spawn(failing, world=4, process_group=world, timeout=30)
    except ValueError as e:
        out["failing"] = str(e)
    out["after_failure"] = aiocoll.spawn(big, world=4, process_group=world, timeout=30)
    out["garbage"] = _garbage_of_a_world(world)
    out["any_source"] = aiocoll.spawn(any_source, world=4, process_group=world, timeout=30)
    try:
        aiocoll.spawn(any_source, world=3, process_group=world)
    except aiocoll.InvalidArgumentError as e:
        out["bad_world"] = str(e)
    if proc == 0:
        # last, as it leaves the group out of step: process 1 never comes, and process 0
        # gives up on its world while its ranks wait in the exchange
        out["cancelled"] = asyncio.run(_cancel_in_exchange(world))
    else:
        time.sleep(2.0)  # alive, so process 0 waits rather than sees a closed connection
    torch.save(out, path + ".tmp")
    os.replace(path + ".tmp", path)
    os._exit(0)  # an exchange is left pending on purpose: no orderly teardown


def _garbage_of_a_world(world: dist.ProcessGroup) -> list[str]:
    """What of the process-group machinery a finished hybrid world leaves to the garbage collector."""
    gc.collect()
    gc.disable()
    try:
        aiocoll.spawn(big, world=4, process_group=world, timeout=30)
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        names = {"HybridWorld", "PGBridge", "Issuer", "ProcessGroup"}
        return sorted({type(o).__name__ for o in gc.garbage if type(o).__name__ in names})
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


def _lonely(comm: aiocoll.Comm) -> None:
    # ranks in threads: an abort, not a task cancellation, is what can release them
    comm.all_reduce(torch.ones(1)).wait()


async def _cancel_in_exchange(world: dist.ProcessGroup) -> float:
    t0 = time.perf_counter()
    try:
        await asyncio.wait_for(aiocoll.spawn_async(_lonely, world=4, process_group=world, timeout=30), 0.5)
    except TimeoutError:
        return time.perf_counter() - t0
    return -1.0


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("hybrid")
    init = (tmp / "store").as_uri()
    saved, _ = run_processes(__file__, [[str(p), init] for p in range(PROCS)], tmp)
    return saved


def _flat(fn: Any, world: int) -> list[Any]:
    return aiocoll.spawn(fn, world=world, timeout=30)


def test_table_equals_a_flat_world(results: list[dict[str, Any]]) -> None:
    hybrid = [r for proc in results for r in proc["table"]]  # each process returns its own ranks
    flat = _flat(functools.partial(table, any_source=False), PROCS * PER_PROC)
    assert len(hybrid) == len(flat) == PROCS * PER_PROC
    names = list(flat[0])
    assert len(names) > 250
    bad = [
        f"rank {r} {name}: hybrid {hybrid[r][name]!r} != flat {flat[r][name]!r}"
        for r in range(len(flat))
        for name in names
        if name != "bad_argument" and not _same(hybrid[r][name], flat[r][name])
    ]
    assert not bad, "\n".join(bad[:20])
    assert hybrid[0]["new_group/mismatch"] == "CollectiveMismatchError"
    assert hybrid[1]["p2p/ring"][2] == [0, 0]  # rank 1 received from rank 0 in its own process
    assert hybrid[2]["p2p/ring"][2] == [1, 1]  # rank 2 received from rank 1 across processes


def test_a_large_world_is_bitwise_a_flat_world(results: list[dict[str, Any]]) -> None:
    hybrid = [r for proc in results for r in proc["big"]]
    flat = _flat(big, PROCS * BIG_PER_PROC)
    assert len(hybrid) == PROCS * BIG_PER_PROC
    for r, (h, f) in enumerate(zip(hybrid, flat, strict=True)):
        assert _same(h, f), f"rank {r}: hybrid {h!r} != flat {f!r}"
    # the sum of 1024 inexact floats: reducing per process first (as a leader-based
    # hierarchy would) gives other last bits, so the equality above says something
    ins = [torch.tensor([0.1 * r, 1.0 / (r + 1), float(r) ** 1.5]) for r in range(PROCS * BIG_PER_PROC)]
    halves = [torch.stack(ins[p * BIG_PER_PROC : (p + 1) * BIG_PER_PROC]).sum(0) for p in range(PROCS)]
    assert not torch.equal(torch.stack(halves).sum(0), hybrid[0][0])
    print(f"2 x {BIG_PER_PROC} ranks: {[round(p['big_seconds'], 2) for p in results]} s per process")


def test_sync_ranks_in_a_hybrid_world(results: list[dict[str, Any]]) -> None:
    hybrid = [r for proc in results for r in proc["threads"]]
    flat = _flat(threads, 4)
    assert all(_same(h, f) for h, f in zip(hybrid, flat, strict=True))
    assert hybrid[2][1].item() == 2.0  # rank 2 got rank 1's message, from the other process


def test_a_mismatch_across_processes_is_reported_in_every_process(results: list[dict[str, Any]]) -> None:
    reports = [msg for proc in results for msg, _ in proc["mismatch"]]
    assert len(reports) == 4
    assert all(seconds < 2.0 for proc in results for _, seconds in proc["mismatch"])  # the timeout is 60 s
    for proc in results:  # spawn re-raises a rank's error with the flight recorder's table
        assert any(n.startswith("aiocoll: flight recorder") and "MISMATCH" in n for n in proc["mismatch_notes"])
    for report in reports:
        assert "ranks called different collectives as call #0 of group 'world'" in report
        assert "rank 3 in process 1: broadcast(float32[2], src=0) at " in report
        assert "rank 0 in process 0: all_reduce(float32[2], op=ReduceOp.SUM) at " in report
        assert "test_hybrid.py" in report


def test_a_failing_rank_releases_the_other_process_at_once(results: list[dict[str, Any]]) -> None:
    assert results[1]["failing"] == "rank 3 gives up"  # spawn re-raised it there
    for msg, seconds, cpp in results[0]["failing"]:
        assert "process 1 of the hybrid world aborted: rank 3 failed with ValueError: rank 3 gives up" in msg
        assert seconds < 5.0  # the notice, not the 30 s timeout
        # the torch future failed in C++, with the error (of a WorldAbortedError subclass of the bridge's)
        assert cpp.startswith("Got the following error when running the callback: ")
        assert f": {msg}" in cpp
    # the process group is still in step: a new world over it works
    flat = _flat(big, 4)
    after = [r for proc in results for r in proc["after_failure"]]
    assert all(_same(a, f) for a, f in zip(after, flat, strict=True))


def test_cancelling_a_world_releases_ranks_waiting_on_another_process(results: list[dict[str, Any]]) -> None:
    # the ranks waited in an exchange that could only end at the 30 s timeout
    assert 0.5 <= results[0]["cancelled"] < 2.0


def test_process_group_must_be_a_process_group() -> None:
    with pytest.raises(aiocoll.InvalidArgumentError, match="argument 'process_group' must be a torch\\.distributed"):
        aiocoll.spawn(big, world=4, process_group="gloo")  # type: ignore[call-overload]


def test_a_finished_world_lets_go_of_the_process_groups(results: list[dict[str, Any]]) -> None:
    # left to the garbage collector, a gloo group may be destroyed at interpreter exit,
    # which aborts the process now and then
    assert [proc["garbage"] for proc in results] == [[], []]


def test_any_source_recv_and_bad_world_are_refused(results: list[dict[str, Any]]) -> None:
    for proc in results:
        for msg in proc["any_source"]:
            assert "recv on rank" in msg
            assert "not supported in a group that spans processes" in msg
        assert "argument 'world' (3) must be a multiple of the process group's size (2)" in proc["bad_world"]


if __name__ == "__main__":
    asyncio.set_event_loop_policy(None)
    _process_main(sys.argv[1:])
