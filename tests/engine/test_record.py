"""The flight recorder: failure reports aligned by sequence number, trace export, the trace summary."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import aiocoll
from aiocoll import Comm
from aiocoll._engine._record import Recorder, Stamp, format_signature, summarize_trace


def _notes(e: BaseException) -> str:
    return "\n".join(getattr(e, "__notes__", []))


def _recorder_note(e: BaseException) -> list[str]:
    text = _notes(e)
    assert "aiocoll: flight recorder" in text, text
    return text[text.index("aiocoll: flight recorder") :].splitlines()


async def _diverge(comm: Comm) -> None:
    t = torch.ones(3)
    for _ in range(3):
        await comm.all_reduce(t)
    if comm.rank == 2:
        await comm.broadcast(t, src=0)
    else:
        await comm.all_reduce(t)


def test_mismatch_report_shows_every_rank_aligned_by_sequence(loop: str) -> None:
    with pytest.raises(aiocoll.CollectiveMismatchError) as info:
        aiocoll.spawn(_diverge, world=3, loop=loop)
    lines = _recorder_note(info.value)
    assert lines[1].split() == ["call", "rank", "0", "rank", "1", "rank", "2"]
    rows = {line.split()[1]: line for line in lines[2:]}
    assert list(rows) == ["#0", "#1", "#2", "#3"]
    for seq in ("#0", "#1", "#2"):
        assert rows[seq].count("all_reduce SUM f32[3] ok") == 3
    last = rows["#3"]
    assert last.count("MISMATCH") == 3
    assert "broadcast 0 f32[3] MISMATCH" in last
    assert last.index("broadcast") > last.index("all_reduce")  # rank 2's column is the last one


def test_deadlock_report_shows_who_is_pending(loop: str) -> None:
    async def fn(comm: Comm) -> None:
        await comm.barrier()
        if comm.rank == 1:
            return
        await comm.all_reduce(torch.ones(1))

    with pytest.raises(aiocoll.DeadlockError) as info:
        aiocoll.spawn(fn, world=2, loop=loop)
    lines = _recorder_note(info.value)
    # A cell may end in the time it waited for the last arrival ("ok +2.6ms") on a busy machine.
    rows = {line.split()[1]: [w for w in line.split()[2:] if not w.startswith("+")] for line in lines[2:]}
    assert rows["#0"] == ["barrier", "ok", "barrier", "ok"]
    assert rows["#1"] == ["all_reduce", "SUM", "f32[1]", "DEADLOCK", "-"]  # rank 1 never called it


def test_failing_rank_report_and_p2p_rows(loop: str) -> None:
    async def fn(comm: Comm) -> None:
        if comm.rank == 0:
            await comm.send(torch.ones(2), dst=1)
            raise ValueError("boom")
        await comm.recv(torch.empty(2), src=0)
        await comm.barrier()

    with pytest.raises(ValueError, match="boom") as info:
        aiocoll.spawn(fn, world=2, loop=loop)
    text = "\n".join(_recorder_note(info.value))
    assert "world p2p" in text
    assert "send(float32[2], dst=1, tag=0) ok" in text
    assert "recv(float32[2], src=0, tag=0) ok" in text
    assert "barrier aborted" in text  # rank 1 was released by rank 0's failure


def test_record_zero_turns_the_recorder_off() -> None:
    with pytest.raises(aiocoll.CollectiveMismatchError) as info:
        aiocoll.spawn(_diverge, world=3, record=0)
    assert "flight recorder" not in _notes(info.value)
    with pytest.raises(aiocoll.InvalidArgumentError, match="'record'"):
        aiocoll.spawn(_diverge, world=3, record=-1)


def test_ring_keeps_the_last_entries_only() -> None:
    async def fn(comm: Comm) -> None:
        for _ in range(10):
            await comm.barrier()
        raise RuntimeError("stop")

    with pytest.raises(RuntimeError) as info:
        aiocoll.spawn(fn, world=1, record=4)
    rows = [line.split()[1] for line in _recorder_note(info.value)[2:]]
    assert rows == ["#6", "#7", "#8", "#9"]


def test_report_picks_unfinished_ranks_in_big_worlds() -> None:
    async def fn(comm: Comm) -> None:
        await comm.barrier()
        if comm.rank == 37:
            return
        await comm.barrier()

    with pytest.raises(aiocoll.DeadlockError) as info:
        aiocoll.spawn(fn, world=40)
    lines = _recorder_note(info.value)
    assert "8 of 40 ranks" in lines[0]
    header = lines[1].split()
    shown = [int(x) for x in header[2::2]]
    assert len(shown) == 8
    assert 37 not in shown  # finished fine; the blocked ones come first
    assert shown == [0, 1, 2, 3, 4, 5, 6, 7]


def test_trace_file_and_summary(tmp_path: Path, loop: str) -> None:
    path = tmp_path / "run.json"

    async def fn(comm: Comm) -> None:
        t = torch.ones(2)
        for _ in range(3):
            if comm.rank == 2:
                await asyncio.sleep(0.01)  # the straggler
            await comm.all_reduce(t)
        await comm.all_gather_object(comm.rank)

    aiocoll.spawn(fn, world=3, loop=loop, trace=path)
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    assert names == {0: "rank 0", 1: "rank 1", 2: "rank 2"}
    ops = [e for e in events if e.get("cat") == "collective"]
    assert len(ops) == 3 * 4
    first = next(e for e in ops if e["tid"] == 0)
    assert first["args"]["op"] == "all_reduce SUM f32[2]"
    assert first["args"]["outcome"] == "ok"
    assert first["args"]["site"].endswith(f"{Path(__file__).name}:{fn.__code__.co_firstlineno + 5}")
    # the fast ranks' waits for the straggler are slices of their own
    waits = [e for e in events if e.get("cat") == "wait"]
    assert {e["tid"] for e in waits} >= {0, 1}
    assert max(e["dur"] for e in waits) >= 5_000  # us: at least half the straggler's sleep
    summary = summarize_trace(trace)
    assert summary.splitlines()[0].split() == ["op", "count", "total", "wait", "max", "wait"]
    assert summary.splitlines()[1].split()[:2] == ["all_reduce", "9"]
    assert "slowest rank: 2 (last to arrive at 3 of 4 collectives" in summary


def test_trace_is_written_when_the_run_fails(tmp_path: Path) -> None:
    path = tmp_path / "failed.json"
    with pytest.raises(aiocoll.CollectiveMismatchError):
        aiocoll.spawn(_diverge, world=3, trace=str(path))
    ops = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("cat") == "collective"]
    outcomes = [e["args"]["outcome"] for e in ops if e["args"]["seq"] == 3]
    assert outcomes == ["CollectiveMismatchError"] * 3


def test_trace_cli(tmp_path: Path) -> None:
    path = tmp_path / "cli.json"

    async def fn(comm: Comm) -> None:
        await comm.barrier()

    aiocoll.spawn(fn, world=2, trace=path)
    r = subprocess.run(
        [sys.executable, "-m", "aiocoll", "trace", str(path)], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[1].split()[:2] == ["barrier", "2"]
    bad = subprocess.run(
        [sys.executable, "-m", "aiocoll", "trace", str(tmp_path / "missing.json")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2
    assert "cannot read" in bad.stderr


def test_snapshot_and_formatting() -> None:
    rec = Recorder(2, capacity=2)
    assert rec.report() == "aiocoll: flight recorder: no operation was recorded"
    stamp = Stamp("world", {1: 0}, 4, ("barrier",), 1)
    stamp.arrived[0], stamp.files[0], stamp.lines[0] = rec.t0 + 0.25, "f.py", 7
    stamp.last, stamp.done, stamp.outcome = rec.t0 + 0.5, rec.t0 + 0.75, "ok"
    for _ in range(3):  # the ring keeps 2
        rec.ranks[1].append(stamp)
    snap = rec.snapshot()
    assert snap[0] == []
    assert len(snap[1]) == 2
    for entry in snap[1]:
        times = {k: entry.pop(k) for k in ("arrived", "last", "done")}
        assert times == pytest.approx({"arrived": 0.25, "last": 0.5, "done": 0.75})
        assert entry == {"group": "world", "seq": 4, "op": "barrier", "site": "f.py:7", "outcome": "ok"}
    assert format_signature(("all_reduce", torch.distributed.ReduceOp.MAX, torch.bfloat16, (2, 3))) == (
        "all_reduce MAX bf16[2,3]"
    )
    assert format_signature("barrier") == "barrier"


def test_a_stamp_is_written_through_its_methods_and_its_first_end_counts() -> None:
    st = Stamp("world", {0: 0, 1: 1}, 3, ("all_reduce",), 2)
    st.arrive(0, ("train.py", 12))
    st.arrive(1, None, at=5.0)
    assert (st.files, st.lines, st.arrived[1]) == (["train.py", ""], [12, 0], 5.0)
    assert st.arrived[0] > 0
    st.differs(1, ("broadcast",))
    assert (st.sig_of(0), st.sig_of(1)) == (("all_reduce",), ("broadcast",))
    st.all_here()
    st.failed(ValueError("first"))
    done = st.done
    st.failed(RuntimeError("an echo"))
    assert (st.outcome, st.done) == ("ValueError", done)  # the first end counts
    assert st.last is not None
    assert done is not None
    assert st.last <= done
    ok = Stamp("world", {0: 0}, None, "send", 1)
    ok.ok()
    assert ok.outcome == "ok"
    assert ok.done is not None
