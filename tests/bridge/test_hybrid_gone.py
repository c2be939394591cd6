"""Hybrid worlds whose processes go: the survivors name the process and its ranks.

Gloo processes on 127.0.0.1 (this file, run as a script, is the per-process runner; a
FileStore does the rendezvous), each running two async ranks of one hybrid world. Every
world's timeout is 60 s, so an error within 2 s comes from the heartbeats
(``aiocoll._bridge._presence``), not from a timeout. One launch per case, as a process dies in each:

* 2 processes: process 1's ranks return early and the process exits (``sys.exit``) while
  process 0's ranks wait for them: rank 0 in an all_reduce, rank 1 in a recv;
* 3 processes: process 2 is killed (SIGKILL) while the ranks of processes 0 and 1 wait in
  all_reduces of two sub-groups that span the three processes (each rank of a process in
  another one, so each says what it waited in);
* 2 processes: process 1 holds its GIL for 2.5 s (its heartbeat stalls, it is not
  gone), then stops (SIGSTOP): its sockets stay open, the transport sees nothing, and
  ``/proc`` says it is stopped;
* the same 2 processes playing two hosts (no ``/proc`` lookups): the stopped process's
  heartbeat names it.

In every survivor, each waiting rank's ``WorldAbortedError`` names the process gone, its
ranks and what that rank waited in, and ``spawn`` raises one that says what each of the
process's ranks waited in.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import aiocoll
from aiocoll._bridge._presence import Presence

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_process_group import hold_gil, linger, play_presence, run_processes

pytestmark = pytest.mark.processes

HERE = Path(__file__).name
PER_PROC = 2
TIMEOUT = 60.0

# what each local rank saw: [message, seconds from its call to its error, e.rank]
seen: dict[int, list[Any]] = {}
stopped_pid: list[int] = []  # the process that stops itself, for the survivor to kill
rank_pids: list[int] = []  # each world rank's process id
busy: dict[int, list[Any]] = {}  # rank -> [all_reduce result, seconds] while a peer held its GIL


async def _timed(rank: int, fn: Callable[[], Awaitable[object]]) -> None:
    t0 = time.perf_counter()
    try:
        await fn()
    except aiocoll.WorldAbortedError as e:
        seen[rank] = [str(e), time.perf_counter() - t0, e.rank]
        raise
    seen[rank] = ["no error", time.perf_counter() - t0, None]


async def exits(comm: aiocoll.Comm) -> None:
    await comm.barrier()
    if comm.rank >= PER_PROC:
        await asyncio.sleep(0.3)  # process 0's ranks wait in the all_reduce by now
        return  # and process 1 exits (see _process_main)
    if comm.rank == 0:
        await _timed(0, lambda: comm.all_reduce(torch.ones(4)))
    else:  # rank 1 waits for a message from the other process (rank 0 waits for rank 1 too)
        await _timed(1, lambda: comm.recv(torch.zeros(1), src=2))


async def killed(comm: aiocoll.Comm) -> None:
    r = comm.rank
    rank_pids[:] = await comm.all_gather_object(os.getpid())
    sub = await comm.split(r % 2)  # {0, 2, 4} and {1, 3, 5}: each spans the three processes
    assert sub is not None
    await sub.all_reduce(torch.ones(1))  # its process group is made and works
    await comm.barrier()
    if r == 4:
        await asyncio.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    if r >= 4:
        await asyncio.sleep(30)
    t = torch.ones(4) if r % 2 == 0 else torch.ones(2, dtype=torch.float64)
    await _timed(r, lambda: sub.all_reduce(t))


async def stopped(comm: aiocoll.Comm) -> None:
    pids = await comm.all_gather_object(os.getpid())
    stopped_pid.append(pids[PER_PROC])
    if Presence.ON_THIS_HOST:  # a busy process is not gone (its heartbeat stalls 2.5 s)
        await comm.barrier()
        if comm.rank == PER_PROC:
            await asyncio.sleep(0.3)
            hold_gil(2.5)
        t = torch.full((2,), float(comm.rank))
        t0 = time.perf_counter()
        await comm.all_reduce(t)
        busy[comm.rank] = [t.tolist(), time.perf_counter() - t0]
    await comm.barrier()
    if comm.rank == PER_PROC:
        await asyncio.sleep(0.3)
        os.kill(os.getpid(), signal.SIGSTOP)
    if comm.rank >= PER_PROC:
        await asyncio.sleep(30)
    await _timed(comm.rank, lambda: comm.all_reduce(torch.ones(4)))


SCENARIOS: dict[str, Callable[[aiocoll.Comm], Awaitable[Any]]] = {
    "exits": exits,
    "killed": killed,
    "stopped": stopped,
    "stopped_elsewhere": stopped,  # as if each process ran on a host of its own
}


def _process_main(argv: list[str]) -> None:
    """``python test_hybrid_gone.py SCENARIO PROC PROCS INIT_METHOD OUT``."""
    scenario, proc, procs, init, path = argv[0], int(argv[1]), int(argv[2]), argv[3], argv[4]
    play_presence(scenario)
    dist.init_process_group("gloo", rank=proc, world_size=procs, init_method=init, timeout=timedelta(seconds=TIMEOUT))
    world = dist.group.WORLD
    assert world is not None
    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    try:
        out["results"] = aiocoll.spawn(
            SCENARIOS[scenario], world=procs * PER_PROC, process_group=world, timeout=TIMEOUT
        )
    except aiocoll.WorldAbortedError as e:
        out["spawn"] = [str(e), getattr(e, "__notes__", []), e.rank, time.perf_counter() - t0]
    out["ranks"] = dict(seen)
    out["busy"] = dict(busy)
    out["pids"] = list(stopped_pid)
    out["rank_pids"] = list(rank_pids)
    if scenario == "exits" and proc == 1:
        sys.exit(0)  # at exit, the process says it leaves
    if scenario.startswith("stopped"):
        os.kill(stopped_pid[0], signal.SIGKILL)
    torch.save(out, path + ".tmp")
    os.replace(path + ".tmp", path)
    if scenario == "killed":
        linger(path, [0, 1])
    os._exit(0)  # a group is broken on purpose: no orderly teardown


def launch(scenario: str, procs: int, tmp: Path, survivors: list[int]) -> list[dict[str, Any] | None]:
    init = (tmp / "store").as_uri()
    args = [[scenario, str(p), str(procs), init] for p in range(procs)]
    saved, _ = run_processes(__file__, args, tmp, survivors=survivors)
    return saved


@pytest.fixture(scope="module")
def exited(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    saved = launch("exits", 2, tmp_path_factory.mktemp("exits"), [0])
    assert saved[0] is not None
    return saved[0]


@pytest.fixture(scope="module")
def killed_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    saved = launch("killed", 3, tmp_path_factory.mktemp("killed"), [0, 1])
    return [s for s in saved if s is not None]


def _check_rank(
    got: list[Any], rank: int, what: str, who: str, gone_rank: int, collective: bool = True, limit: float = 2.0
) -> None:
    msg, seconds, e_rank = got
    print(f"rank {rank}: named after {seconds:.2f} s")
    assert seconds < limit, (seconds, msg)  # the world's timeout is 60 s
    assert msg.startswith(f"{what} on rank {rank} of group "), msg
    assert f" failed: {who}; rank {rank} was waiting in it ({'call #' if collective else 'at '}" in msg, msg
    assert f"{HERE}:" in msg, msg  # its call site
    assert e_rank == gone_rank


def test_a_process_that_exits_is_named(exited: dict[str, Any]) -> None:
    who = "process 1 (ranks 2, 3) of the hybrid world exited"
    _check_rank(exited["ranks"][0], 0, "all_reduce(float32[4], op=ReduceOp.SUM)", who, 2)
    _check_rank(exited["ranks"][1], 1, "recv(float32[1], src=2, tag=0)", who, 2, collective=False)
    msg, notes, e_rank, _ = exited["spawn"]
    # spawn raises what aborted the world: who is gone, and what each local rank waited in
    assert msg.startswith(
        f"{who}; rank 0 was waiting in all_reduce(float32[4], op=ReduceOp.SUM) #1 on group 'world' at "
    )
    assert "; rank 1 was waiting in recv(float32[1], src=2, tag=0) on group 'world' at " in msg
    assert msg.count(f"{HERE}:") == 2  # each rank's call site
    assert e_rank == 2
    assert "aiocoll: ranks [0, 1] were aborted because of it" in notes


def test_a_process_that_is_killed_is_named(killed_results: list[dict[str, Any]]) -> None:
    pid = killed_results[0]["rank_pids"][4]
    who = f"process 2 (ranks 4, 5) of the hybrid world died (pid {pid} on this host is gone)"
    for proc, res in enumerate(killed_results):
        r0, r1 = 2 * proc, 2 * proc + 1
        _check_rank(res["ranks"][r0], r0, "all_reduce(float32[4], op=ReduceOp.SUM)", who, 4)
        _check_rank(res["ranks"][r1], r1, "all_reduce(float64[2], op=ReduceOp.SUM)", who, 4)
        msg, _, e_rank, _ = res["spawn"]
        assert msg.startswith(
            f"{who}; rank {r0} was waiting in all_reduce(float32[4], op=ReduceOp.SUM) #1 on group "
        ), msg
        assert f"; rank {r1} was waiting in all_reduce(float64[2], op=ReduceOp.SUM) #1 on group " in msg
        assert msg.count(f"{HERE}:") == 2
        assert e_rank == 4


@pytest.fixture(scope="module")
def stopped_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    saved = launch("stopped", 2, tmp_path_factory.mktemp("stopped"), [0])
    assert saved[0] is not None
    return saved[0]


def test_a_process_that_holds_its_gil_is_not_named(stopped_results: dict[str, Any]) -> None:
    # its heartbeat stood still 2.5 s, but /proc says it runs: the ops wait for it
    for r in (0, 1):
        result, seconds = stopped_results["busy"][r]
        assert result == [6.0, 6.0]  # 0 + 1 + 2 + 3
        assert seconds > 2.0


def test_a_process_the_transport_does_not_see_go_is_named(stopped_results: dict[str, Any]) -> None:
    res = stopped_results
    pid = res["pids"][0]
    who = f"process 1 (ranks 2, 3) of the hybrid world is stopped (pid {pid} on this host, by SIGSTOP or Ctrl-Z)"
    for r in (0, 1):
        _check_rank(res["ranks"][r], r, "all_reduce(float32[4], op=ReduceOp.SUM)", who, 2)
    assert res["spawn"][0].startswith(f"{who}; rank 0 was waiting in all_reduce(float32[4]")


def test_a_process_on_another_host_is_named_by_its_heartbeat(tmp_path: Path) -> None:
    saved = launch("stopped_elsewhere", 2, tmp_path, [0])
    res = saved[0]
    assert res is not None
    who = "process 1 (ranks 2, 3) of the hybrid world stopped responding (no heartbeat for 1s)"
    for r in (0, 1):
        _check_rank(res["ranks"][r], r, "all_reduce(float32[4], op=ReduceOp.SUM)", who, 2, limit=2.5)
    assert res["spawn"][0].startswith(f"{who}; rank 0 was waiting in all_reduce(float32[4]")


if __name__ == "__main__":
    _process_main(sys.argv[1:])
