"""Cross-process checks of ``from_process_group`` (``check=True``, the default), on real gloo processes.

This file, run as a script, is the per-process runner; a FileStore in a temp dir does the
rendezvous; every group's timeout is 60 s, so a report that comes in under 2 s comes from
the checks, not from a timeout. Three launches:

* 4 processes: one mismatch of each kind (collective, shape, dtype, root, reduce op, split
  sizes), each reported in every process, then ops that agree, which still work;
* 4 processes: rank 3 exits while the others wait in an all_reduce, then, in a group of
  ranks 0-2, rank 2 is killed (SIGKILL) while ranks 0 and 1 wait;
* 2 processes: rank 1 holds its GIL for 2.5 s (its heartbeat stalls, it is not gone),
  then stops (SIGSTOP), which the transport does not notice; ``/proc`` does;
* the same 2 processes playing two hosts (no ``/proc`` lookups): the stopped rank's
  heartbeat names it.
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

LAUNCH_TIMEOUT = 90.0
HERE = Path(__file__).name


async def _timed(fn: Callable[[], Awaitable[object]]) -> list[Any]:
    """[error type, message, notes, seconds] of ``fn()``; the error type is "none" if it passed."""
    t0 = time.perf_counter()
    try:
        await fn()
    except aiocoll.AiocollError as e:
        return [
            type(e).__name__,
            str(e),
            getattr(e, "__notes__", []),
            time.perf_counter() - t0,
            getattr(e, "rank", None),
        ]
    return ["none", "", [], time.perf_counter() - t0, None]


async def mismatches(comm: aiocoll.Comm) -> dict[str, Any]:
    r, w = comm.rank, comm.world_size
    out: dict[str, Any] = {}
    t = torch.ones(2)
    f32 = torch.full((2,), float(r + 1))

    cases: dict[str, Callable[[], Awaitable[object]]] = {
        "collective": lambda: comm.broadcast(t, src=0) if r == 1 else comm.all_reduce(t),
        "shape": lambda: comm.all_reduce(torch.ones(3) if r == 2 else torch.ones(2)),
        "dtype": lambda: comm.all_reduce(torch.ones(2, dtype=torch.float64) if r == 3 else torch.ones(2)),
        "root": lambda: comm.broadcast(t, src=1 if r == 3 else 0),
        "reduce_op": lambda: comm.all_reduce(f32, op=dist.ReduceOp.MAX if r == 0 else dist.ReduceOp.SUM),
        "split_sizes": lambda: comm.all_to_all_single(
            torch.zeros(w), torch.ones(w), input_split_sizes=[2, 0, 1, 1] if r == 1 else None
        ),
    }
    for name, call in cases.items():
        await comm.barrier()
        out[name] = await _timed(call)
    out["untouched"] = f32.tolist()  # the mismatched all_reduce never ran: no wrong result

    # calls that agree still work, uneven splits included (no false alarm)
    t = torch.ones(2) * r
    await comm.all_reduce(t)
    splits = [(r + j) % 3 for j in range(w)]
    theirs = [(j + r) % 3 for j in range(w)]
    got = torch.zeros(sum(theirs))
    await comm.all_to_all_single(
        got, torch.full((sum(splits),), float(r)), output_split_sizes=theirs, input_split_sizes=splits
    )
    out["after"] = [t.tolist(), got.tolist(), [float(j) for j in range(w) for _ in range(theirs[j])]]
    return out


async def gone(comm: aiocoll.Comm) -> dict[str, Any]:
    """Launch 2: rank 3 exits, then rank 2 is killed."""
    r = comm.rank
    out: dict[str, Any] = {"pids": await comm.all_gather_object(os.getpid())}
    sub = await comm.new_group([0, 1, 2])
    if sub is not None:
        await sub.all_reduce(torch.ones(1))  # its checks' side group is made
    await comm.barrier()
    if r == 3:
        await asyncio.sleep(0.3)  # the others wait in the all_reduce by now
        sys.exit(0)
    out["exited"] = await _timed(lambda: comm.all_reduce(torch.ones(4)))
    out["aborted"] = await _timed(lambda: comm.barrier())  # the Comm is aborted: at once
    assert sub is not None
    await sub.barrier()
    if r == 2:
        await asyncio.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    out["killed"] = await _timed(lambda: sub.all_reduce(torch.ones(4)))
    return out


async def stopped(comm: aiocoll.Comm) -> dict[str, Any]:
    """Launch 3: rank 1 is busy, then stops (its sockets stay open); rank 0 names it, then kills it."""
    pids = await comm.all_gather_object(os.getpid())
    out: dict[str, Any] = {"pids": pids}
    await comm.barrier()
    if Presence.ON_THIS_HOST:  # a busy peer is not gone (its heartbeat stalls 2.5 s)
        if comm.rank == 1:
            await asyncio.sleep(0.3)
            hold_gil(2.5)
        t = torch.full((4,), float(comm.rank + 1))
        out["busy"] = await _timed(lambda: comm.all_reduce(t))
        out["busy_result"] = t.tolist()
    await comm.barrier()
    if comm.rank == 1:
        await asyncio.sleep(0.3)
        os.kill(os.getpid(), signal.SIGSTOP)
    out["stopped"] = await _timed(lambda: comm.all_reduce(torch.ones(4)))
    os.kill(pids[1], signal.SIGKILL)
    return out


async def stopped_elsewhere(comm: aiocoll.Comm) -> dict[str, Any]:
    """Launch 3 as if each process ran on a host of its own: only the heartbeat tells."""
    return await stopped(comm)


SCENARIOS = {"mismatches": mismatches, "gone": gone, "stopped": stopped, "stopped_elsewhere": stopped_elsewhere}


def _process_main(argv: list[str]) -> None:
    """``python test_process_checks.py SCENARIO RANK WORLD INIT_METHOD OUT``."""
    scenario, rank, world, init, path = argv[0], int(argv[1]), int(argv[2]), argv[3], argv[4]

    play_presence(scenario)

    async def main() -> dict[str, Any]:
        dist.init_process_group("gloo", rank=rank, world_size=world, init_method=init, timeout=timedelta(seconds=60))
        return await SCENARIOS[scenario](aiocoll.from_process_group())

    out = asyncio.run(main())
    torch.save(out, path + ".tmp")
    os.replace(path + ".tmp", path)
    if scenario == "gone":
        linger(path, [0, 1])
    os._exit(0)  # some groups are broken on purpose: no orderly teardown


def launch(scenario: str, world: int, tmp: Path, survivors: list[int]) -> dict[int, dict[str, Any]]:
    """Run ``world`` processes of ``scenario``; what each survivor saved (the others die on purpose)."""
    init = (tmp / "store").as_uri()
    args = [[scenario, str(r), str(world), init] for r in range(world)]
    saved, _ = run_processes(__file__, args, tmp, survivors=survivors, timeout=LAUNCH_TIMEOUT)
    return {r: saved[r] for r in survivors}


@pytest.fixture(scope="module")
def mismatch_results(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    return launch("mismatches", 4, tmp_path_factory.mktemp("mismatch"), [0, 1, 2, 3])


EXPECTED = {
    "collective": (
        "ranks called different collectives as call #",
        ["rank 1: broadcast(float32[2], src=0) at ", "rank 0: all_reduce(float32[2], op=ReduceOp.SUM) at "],
    ),
    "shape": (
        "ranks called all_reduce with arguments that disagree as call #",
        ["rank 2: all_reduce(float32[3], op=ReduceOp.SUM) at ", "rank 3: all_reduce(float32[2], op=ReduceOp.SUM) at "],
    ),
    "dtype": (
        "ranks called all_reduce with arguments that disagree as call #",
        ["rank 3: all_reduce(float64[2], op=ReduceOp.SUM) at ", "rank 0: all_reduce(float32[2], op=ReduceOp.SUM) at "],
    ),
    "root": (
        "ranks called broadcast with arguments that disagree as call #",
        ["rank 3: broadcast(float32[2], src=1) at ", "rank 2: broadcast(float32[2], src=0) at "],
    ),
    "reduce_op": (
        "ranks called all_reduce with arguments that disagree as call #",
        ["rank 0: all_reduce(float32[2], op=ReduceOp.MAX) at ", "rank 1: all_reduce(float32[2], op=ReduceOp.SUM) at "],
    ),
    "split_sizes": (
        "rank 0 expects 1 rows from rank 1 (output_split_sizes[1]) but rank 1 sends 2 (input_split_sizes[0]) "
        "(all_to_all_single #",
        [
            "rank 1: all_to_all_single(float32[4], float32[4], output_split_sizes=[1, 1, 1, 1], "
            "input_split_sizes=[2, 0, 1, 1]) at "
        ],
    ),
}


@pytest.mark.parametrize("kind", list(EXPECTED))
def test_a_mismatch_is_reported_in_every_process_at_once(
    mismatch_results: dict[int, dict[str, Any]], kind: str
) -> None:
    head, lines = EXPECTED[kind]
    got = [mismatch_results[r][kind] for r in range(4)]
    for name, msg, notes, seconds, _ in got:
        assert name == "CollectiveMismatchError", (name, msg)
        assert seconds < 2.0, seconds  # the group's timeout is 60 s
        assert msg.startswith(head), msg
        assert "group '0'" in msg
        for line in lines:
            assert f"  {line}" in msg, (line, msg)
        assert msg.count(f"{HERE}:") == 4  # every rank's call site
        table = notes[-1]
        assert table.startswith("aiocoll: flight recorder, the last 8 operations of each rank"), notes
        assert "MISMATCH" in table
        assert "barrier ok" in table  # the group's earlier ops, from the process's flight recorder
    assert len({g[1] for g in got}) == 1  # the same report in every process
    assert len({g[2][-1] for g in got}) == 1


def test_a_mismatched_op_is_never_issued_and_the_group_goes_on(mismatch_results: dict[int, dict[str, Any]]) -> None:
    for r in range(4):
        res = mismatch_results[r]
        assert res["untouched"] == [float(r + 1)] * 2  # neither a MAX nor a SUM was written
        t, got, expected = res["after"]
        assert t == [6.0, 6.0]
        assert got == expected


@pytest.fixture(scope="module")
def gone_results(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    return launch("gone", 4, tmp_path_factory.mktemp("gone"), [0, 1])


def test_a_process_that_exits_is_named(gone_results: dict[int, dict[str, Any]]) -> None:
    for r in (0, 1):
        name, msg, _, seconds, rank = gone_results[r]["exited"]
        assert name == "WorldAbortedError", msg
        assert seconds < 2.0, seconds
        assert msg.startswith(f"all_reduce(float32[4], op=ReduceOp.SUM) on rank {r} of group '0' (gloo) failed: ")
        assert "failed: rank 3 exited; " in msg
        assert f"rank {r} was waiting in it (call #" in msg
        assert f"{HERE}:" in msg
        assert rank == 3
        name, msg, _, seconds, _ = gone_results[r]["aborted"]
        assert name == "WorldAbortedError"
        assert seconds < 0.5
        assert "this group's Comm was aborted by an earlier WorldAbortedError" in msg


def test_a_process_that_is_killed_is_named(gone_results: dict[int, dict[str, Any]]) -> None:
    for r in (0, 1):
        name, msg, _, seconds, rank = gone_results[r]["killed"]
        assert name == "WorldAbortedError", msg
        assert seconds < 2.0, seconds
        assert msg.startswith(f"all_reduce(float32[4], op=ReduceOp.SUM) on rank {r} of group '0/aiocoll")
        pid = gone_results[r]["pids"][2]
        assert f"failed: rank 2 died (pid {pid} on this host is gone); " in msg
        assert rank == 2


@pytest.fixture(scope="module")
def stopped_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return launch("stopped", 2, tmp_path_factory.mktemp("stopped"), [0])[0]


def test_a_peer_that_holds_its_gil_is_not_named(stopped_results: dict[str, Any]) -> None:
    # its heartbeat stood still 2.5 s, but /proc says it runs: the op waits for it
    name, msg, _, seconds, _ = stopped_results["busy"]
    assert name == "none", msg
    assert seconds > 2.0  # it did wait that long
    assert stopped_results["busy_result"] == [3.0] * 4


def test_a_process_the_transport_does_not_see_go_is_named(stopped_results: dict[str, Any]) -> None:
    name, msg, _, seconds, rank = stopped_results["stopped"]
    assert name == "WorldAbortedError", msg
    assert seconds < 2.0, seconds
    pid = stopped_results["pids"][1]
    assert f"failed: rank 1 is stopped (pid {pid} on this host, by SIGSTOP or Ctrl-Z); rank 0 was waiting in it" in msg
    assert rank == 1


def test_a_process_on_another_host_is_named_by_its_heartbeat(tmp_path: Path) -> None:
    res = launch("stopped_elsewhere", 2, tmp_path, [0])
    name, msg, _, seconds, rank = res[0]["stopped"]
    assert name == "WorldAbortedError", msg
    assert seconds < 2.5, seconds  # 0.5 s before the first look, 1 s without a beat
    assert "failed: rank 1 stopped responding (no heartbeat for 1s); rank 0 was waiting in it" in msg
    assert rank == 1


if __name__ == "__main__":
    _process_main(sys.argv[1:])
