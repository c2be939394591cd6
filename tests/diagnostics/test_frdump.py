"""Flight Recorder dumps, read by torch's own analyzer (``fr_trace``).

In-process worlds dump on failure when ``TORCH_FR_DUMP_TEMP_FILE`` is set, and on demand;
so do real gloo process groups (``from_process_group``, 2 processes; this file, run as a
script, is the per-rank runner). Every test hands the dumps to torch's analyzer and checks
that it points at what went wrong, or finds nothing wrong where nothing was.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import io
import logging
import os
import pickle
import subprocess
import sys
import warnings
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import aiocoll

FR_TRACE = [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace"]
# run_processes comes from tests/bridge/test_process_group.py
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bridge"))


def fr_trace_subprocess(directory: Path) -> str:
    """``python -m torch.distributed.flight_recorder.fr_trace DIR``: what it printed."""
    done = subprocess.run([*FR_TRACE, str(directory)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout + done.stderr


def fr_trace(directory: Path) -> str:
    """The analyzer's ``main``, in this process (no torch import to wait for): what it logged."""
    with warnings.catch_warnings():
        # the analyzer of torch < 2.15 calls typing._eval_type as Python 3.13 deprecates
        warnings.filterwarnings("ignore", "Failing to pass a value to the 'type_params'", DeprecationWarning)
        from torch.distributed.flight_recorder import fr_trace as analyzer

    log = logging.getLogger("Flight Recorder")
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    log.addHandler(handler)
    was = gc.isenabled()  # (its loader disables the collector and, before 2.15, leaves it so)
    try:
        analyzer.main([str(directory)])
    finally:
        log.removeHandler(handler)
        if was:
            gc.enable()
    return out.getvalue()


async def _mismatch(comm: aiocoll.Comm) -> None:
    t = torch.ones(2)
    await comm.all_reduce(t)
    await comm.barrier()
    if comm.rank == 2:
        await comm.broadcast(t, 0)  # where the others all_reduce
    else:
        await comm.all_reduce(t)


def test_mismatch_dumps_on_failure_and_fr_trace_names_the_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_FR_DUMP_TEMP_FILE", str(tmp_path / "dump" / "rank_"))
    with pytest.raises(aiocoll.CollectiveMismatchError) as info:
        aiocoll.spawn(_mismatch, world=4)
    assert sorted(p.name for p in (tmp_path / "dump").iterdir()) == ["rank_0", "rank_1", "rank_2", "rank_3"]
    note = info.value.__notes__[-1]
    assert "flight recorder dumped to" in note
    assert f"fr_trace {tmp_path / 'dump'}" in note

    out = fr_trace_subprocess(tmp_path / "dump")
    assert "Collective sequence number: 2 has errors" in out  # aiocoll's "call #2"
    assert "Culprit rank 2" in out
    assert "COLLECTIVE_TYPE_MISMATCH" in out
    assert "'all_reduce' does not match found collective type: 'broadcast'" in out
    assert f"all_reduce SUM f32[2] at {__file__}:" in out  # the call site, as a frame


def test_rank_that_returned_early_is_the_missing_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_FR_DUMP_TEMP_FILE", str(tmp_path) + os.sep)  # a directory

    async def worker(comm: aiocoll.Comm) -> None:
        t = torch.ones(3)
        for _ in range(20):  # more than the ring holds (record=8): old ops are dropped alike
            await comm.all_reduce(t)
        if comm.rank == 3:
            return
        await comm.all_gather_into_tensor(torch.empty(12), t)

    with pytest.raises(aiocoll.DeadlockError):
        aiocoll.spawn(worker, world=4, record=8)
    assert len(list(tmp_path.glob("aiocoll_trace_rank_*"))) == 4
    out = fr_trace(tmp_path)
    assert "Not all ranks joining collective, sequence number: 20" in out
    assert "missing ranks: {3}" in out
    assert "nccl:_all_gather_base" in out
    assert out.count("sequence number") == 1  # the dropped history is not mistaken for missing ranks


def test_on_demand_dump_of_a_healthy_world_has_no_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCH_FR_DUMP_TEMP_FILE", raising=False)
    paths: list[str] = []

    async def worker(comm: aiocoll.Comm) -> None:
        t = torch.arange(4.0)
        await comm.all_reduce(t)
        await comm.broadcast(t, 1)
        await comm.reduce_scatter_tensor(torch.empty(1), t)
        await comm.reduce_scatter(torch.empty(1), list(t.chunk(4)))
        await comm.reduce(t, 0)
        await comm.all_gather([torch.empty(4) for _ in range(4)], t)
        await comm.gather(t, [torch.empty(4) for _ in range(4)] if comm.rank == 0 else None, 0)
        await comm.scatter(torch.empty(4), [t.clone() for _ in range(4)] if comm.rank == 0 else None, 0)
        await comm.all_to_all_single(torch.empty(4), t)
        await comm.all_gather_object(comm.rank)
        if comm.rank == 0:
            await comm.send(t, 1)
        elif comm.rank == 1:
            await comm.recv(t, 0)
        sub = await comm.new_group([0, 1])
        if sub is not None:
            await sub.all_reduce(t)
        await comm.barrier()
        if comm.rank == 0:
            paths.extend(aiocoll.dump_flight_recorder(tmp_path / "a" / "fr"))  # a prefix
            aiocoll.dump_flight_recorder(tmp_path / "b", comm=comm)  # a directory

    (tmp_path / "b").mkdir()
    aiocoll.spawn(worker, world=4)
    assert paths == [str(tmp_path / "a" / f"fr{r}") for r in range(4)]
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == [f"aiocoll_trace_rank_{r}" for r in range(4)]
    with open(paths[1], "rb") as f:
        dump = pickle.load(f)
    assert {"version", "pg_config", "pg_status", "entries"} <= set(dump)
    names = [e["profiling_name"] for e in dump["entries"]]
    # the send/recv completed: left out (see aiocoll._diagnostics._frdump); the sub-group's op is there
    assert names == [
        "nccl:all_reduce",
        "nccl:broadcast",
        "nccl:_reduce_scatter_base",
        "nccl:reduce_scatter",
        "nccl:reduce",
        "nccl:all_gather",
        "nccl:gather",
        "nccl:scatter",
        "nccl:all_to_all",
        "nccl:all_gather",
        "nccl:all_reduce_barrier",
        "nccl:all_reduce",
        "nccl:all_reduce_barrier",
    ]
    assert all(e["state"] == "completed" for e in dump["entries"])
    sizes = {e["profiling_name"]: (e["input_sizes"], e["output_sizes"]) for e in dump["entries"]}
    assert sizes["nccl:_reduce_scatter_base"] == ([[4]], [[1]])
    assert sizes["nccl:reduce_scatter"] == ([[4, 1]], [[1]])  # four inputs of [1]
    assert sizes["nccl:reduce"] == sizes["nccl:gather"] == ([[4]], [[4]])
    assert sizes["nccl:all_to_all"] == ([[0]], [[0]])  # splits are each rank's own
    assert len(dump["pg_config"]) == 2
    for directory in (tmp_path / "a", tmp_path / "b"):
        out = fr_trace(directory)
        assert "error" not in out.lower(), out
        assert "not all ranks" not in out.lower(), out


def test_no_dump_without_the_variable_and_none_when_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCH_FR_DUMP_TEMP_FILE", raising=False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(aiocoll.CollectiveMismatchError) as info:
        aiocoll.spawn(_mismatch, world=4)
    assert not any("dumped" in n for n in info.value.__notes__)
    assert list(tmp_path.iterdir()) == []

    async def off(comm: aiocoll.Comm) -> None:
        aiocoll.dump_flight_recorder(tmp_path)

    with pytest.raises(aiocoll.AiocollError, match="flight recorder is off"):
        aiocoll.spawn(off, world=2, record=0)
    monkeypatch.setenv("TORCH_FR_DUMP_TEMP_FILE", str(tmp_path / "x_"))
    with pytest.raises(aiocoll.CollectiveMismatchError) as info:
        aiocoll.spawn(_mismatch, world=4, record=0)
    assert "could not write the flight recorder dump" in info.value.__notes__[-1]


# -- real process groups: 2 gloo processes ---------------------------------------------------------


def _rank_main(argv: list[str]) -> None:
    """One gloo rank: ``python test_frdump.py RANK WORLD INIT_METHOD ON_DEMAND_DIR OUT``.

    ON_DEMAND_DIR "hybrid": the process runs its half of a hybrid world of 4 instead.
    """
    rank, world, init_method, on_demand, path = int(argv[0]), int(argv[1]), argv[2], argv[3], argv[4]

    async def hybrid() -> dict[str, object]:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world, init_method=init_method, timeout=timedelta(seconds=30)
        )
        try:
            await aiocoll.spawn_async(_mismatch, world=4, process_group=dist.group.WORLD, timeout=10)
        except aiocoll.CollectiveMismatchError as e:
            return {"error": [type(e).__name__, *e.__notes__]}
        return {}

    async def main() -> dict[str, object]:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world, init_method=init_method, timeout=timedelta(seconds=30)
        )
        comm = aiocoll.from_process_group(timeout=1.0)
        t = torch.ones(4)
        await comm.all_reduce(t)
        await comm.barrier()
        await comm.all_gather_object(rank)
        out: dict[str, object] = {"on_demand": aiocoll.dump_flight_recorder(on_demand + os.sep)}
        try:
            if rank == 0:
                await comm.all_reduce(t)
            else:
                await comm.broadcast(t, 0)
        except aiocoll.AiocollError as e:
            out["error"] = [type(e).__name__, *getattr(e, "__notes__", [])]
        return out

    results = asyncio.run(hybrid() if on_demand == "hybrid" else main())
    torch.save(results, path + ".tmp")
    os.replace(path + ".tmp", path)
    os._exit(0)  # at once: no teardown of the group behind the failed op


def test_process_group_dumps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from test_process_group import run_processes

    monkeypatch.setenv("TORCH_FR_DUMP_TEMP_FILE", str(tmp_path / "failed" / "rank_"))
    init = (tmp_path / "store").as_uri()
    args = [[str(r), "2", init, str(tmp_path / "on_demand")] for r in range(2)]
    results, _ = run_processes(__file__, args, tmp_path)
    for r, got in enumerate(results):
        assert got["on_demand"] == [str(tmp_path / "on_demand" / f"aiocoll_trace_rank_{r}")]
        # the cross-process check catches it before anything is issued, in every process
        assert got["error"][0] == "CollectiveMismatchError"
        assert any("flight recorder dumped to" in n for n in got["error"][1:])
    healthy = fr_trace(tmp_path / "on_demand")
    assert "error" not in healthy.lower(), healthy
    assert "not all ranks" not in healthy.lower(), healthy

    out = fr_trace_subprocess(tmp_path / "failed")
    lib = "gloo" if _gloo_known() else "nccl"  # torch 2.10's analyzer knows nccl and xccl only
    assert "Collective sequence number: 3 has errors" in out
    assert f"collective: {lib}:" in out
    assert "COLLECTIVE_TYPE_MISMATCH" in out
    assert "Culprit rank 1" in out or "Culprit rank 0" in out


def test_hybrid_world_dumps_each_process_s_ranks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from test_process_group import run_processes

    monkeypatch.setenv("TORCH_FR_DUMP_TEMP_FILE", str(tmp_path / "failed" / "rank_"))
    init = (tmp_path / "store").as_uri()
    results, _ = run_processes(__file__, [[str(r), "2", init, "hybrid"] for r in range(2)], tmp_path)
    for p, got in enumerate(results):
        assert got["error"][0] == "CollectiveMismatchError"
        assert f"flight recorder dumped to {tmp_path / 'failed' / f'rank_{2 * p}'} ... (2 files)" in got["error"][-1]
    assert sorted(p.name for p in (tmp_path / "failed").iterdir()) == ["rank_0", "rank_1", "rank_2", "rank_3"]
    out = fr_trace(tmp_path / "failed")
    assert "Collective sequence number: 2 has errors" in out
    assert "Culprit rank 2" in out
    assert "'all_reduce' does not match found collective type: 'broadcast'" in out


def _gloo_known() -> bool:
    from aiocoll import _torch

    return _torch.fr_accepts("gloo:all_reduce")


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        _rank_main(sys.argv[1:])
