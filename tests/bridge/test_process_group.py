"""``aiocoll.from_process_group``: the same async code on real gloo processes.

One table of Comm calls (``table``) runs twice on a world of 4: in 4 gloo processes on
127.0.0.1 (this file, run as a script, is the per-rank runner; a FileStore in a temp dir
does the rendezvous; each rank ``torch.save``s what it got), and in-process with
``aiocoll.spawn``. Every output is compared exactly. Inputs are small integers and
halves, so every reduction is exact whatever order gloo adds in.

The same launch then checks what only real processes have: the loop keeps serving other
tasks while a large all_reduce is in flight, a per-op timeout, and a peer that dies in a
collective. A second, 2-process launch goes through torchrun with the example.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Collection
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import aiocoll
from aiocoll._bridge import _pgbridge
from aiocoll._bridge._presence import Presence

WORLD = 4
LAUNCH_TIMEOUT = 120.0
ROOT = Path(__file__).resolve().parents[2]
R = dist.ReduceOp
DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
)
OPS: dict[str, Any] = {
    "SUM": R.SUM,
    "AVG": R.AVG,
    "PRODUCT": R.PRODUCT,
    "MIN": R.MIN,
    "MAX": R.MAX,
    "BAND": R.BAND,
    "BOR": R.BOR,
    "BXOR": R.BXOR,
}
PG_REJECTS = {f"{kind}/PRODUCT/complex64" for kind in ("all_reduce", "reduce", "reduce_scatter_tensor")}
"""Entries a process group refuses (InvalidArgumentError) where in-process ranks compute:
torch.distributed reduces complex tensors as pairs of reals, so it has no complex PRODUCT."""

# -- the table: one async function, run on both engines -------------------------------------


def _input(dtype: torch.dtype, rank: int, n: int = 6) -> torch.Tensor:
    """Small values whose sums, products and averages over 4 ranks are exact in ``dtype``."""
    base = torch.arange(n) % 3 + rank  # 0..5
    if dtype == torch.bool:
        return (base % 2).bool()
    if dtype.is_complex:
        return torch.complex(base.float() / 2, -base.float()).to(dtype)
    if dtype.is_floating_point:
        return (base.double() / 2).to(dtype)
    return (base + 1).to(dtype)


def _premul(rank: int) -> Any:
    return dist._make_nccl_premul_sum(0.5 * (rank + 1))


async def _attempt(fn: Callable[[], Awaitable[object]]) -> object:
    try:
        return await fn()
    except aiocoll.InvalidArgumentError:
        return "InvalidArgumentError"


async def table(comm: aiocoll.Comm, *, any_source: bool = True) -> dict[str, object]:
    """Every kind of call; returns what this rank observed, by entry name.

    ``any_source=False`` leaves out the receives from any source (hybrid worlds refuse them).
    """
    r, w = comm.rank, comm.world_size
    out: dict[str, object] = {}

    for dtype in DTYPES:
        dt = str(dtype).removeprefix("torch.")
        for name, op in [*OPS.items(), ("PREMUL_SUM", None)]:
            red = _premul(r) if op is None else op

            async def all_reduce(dtype: torch.dtype = dtype, red: Any = red) -> object:
                t = _input(dtype, r)
                await comm.all_reduce(t, red)
                return t

            async def reduce(dtype: torch.dtype = dtype, red: Any = red) -> object:
                t = _input(dtype, r)
                await comm.reduce(t, dst=1, op=red)
                return t

            async def reduce_scatter_tensor(dtype: torch.dtype = dtype, red: Any = red) -> object:
                o = torch.zeros(2, dtype=dtype)
                await comm.reduce_scatter_tensor(o, _input(dtype, r, 2 * w), red)
                return o

            out[f"all_reduce/{name}/{dt}"] = await _attempt(all_reduce)
            out[f"reduce/{name}/{dt}"] = await _attempt(reduce)
            out[f"reduce_scatter_tensor/{name}/{dt}"] = await _attempt(reduce_scatter_tensor)

    # strided views: gloo would reduce the memory at the data pointer, ignoring strides
    base = torch.arange(12.0) + r
    await comm.all_reduce(base[::3], R.MAX)
    t2 = (torch.arange(6.0) + r).reshape(2, 3)
    await comm.all_reduce(t2.t())
    out["all_reduce/strided"] = [base, t2]

    for dtype in (torch.float32, torch.uint16, torch.complex64, torch.bool, torch.float8_e4m3fn):
        t = _input(torch.float32 if dtype == torch.float8_e4m3fn else dtype, r).to(dtype)
        await comm.broadcast(t, src=2)
        out[f"broadcast/{dtype}"] = t.view(torch.uint8) if dtype == torch.float8_e4m3fn else t
    t = torch.arange(8.0).reshape(2, 4) * (r + 1)
    await comm.broadcast(t[:, 1:3], src=1)
    out["broadcast/strided"] = t

    outs = [torch.zeros(j + 1) for j in range(w)]
    await comm.all_gather(outs, torch.full((r + 1,), r + 0.5))
    out["all_gather/uneven"] = outs
    big = torch.zeros(w, 3, dtype=torch.int16)
    await comm.all_gather_into_tensor(big, torch.full((3,), r, dtype=torch.int16))
    out["all_gather_into_tensor/stack"] = big
    cat = torch.zeros(w * 2) + 7
    await comm.all_gather_into_tensor(cat, cat[r * 2 : r * 2 + 2] * 0 + r)
    out["all_gather_into_tensor/in_place"] = cat
    flat = torch.zeros(3 * w)
    await comm.all_gather_into_tensor(flat, torch.arange(3.0) + 10 * r)
    out["all_gather_into_tensor/cat"] = flat

    gl = [torch.zeros(2, dtype=torch.complex64) for _ in range(w)] if r == 3 else None
    await comm.gather(torch.full((2,), complex(r, -r), dtype=torch.complex64), gl, dst=3)
    out["gather"] = gl
    t = torch.zeros(3)
    await comm.scatter(t, [torch.full((3,), 10.0 * j) for j in range(w)] if r == 1 else None, src=1)
    out["scatter"] = t

    o = torch.zeros(2)
    await comm.reduce_scatter(o, [torch.full((2,), float(r + j)) for j in range(w)], R.MAX)
    out["reduce_scatter/MAX"] = o
    o = torch.zeros(2, dtype=torch.int16)
    await comm.reduce_scatter(o, [torch.full((2,), r * 100 + j, dtype=torch.int16) for j in range(w)])
    out["reduce_scatter/int16"] = o
    o = torch.zeros(2)
    await comm.reduce_scatter(o, [torch.full((2,), float(r + j)) for j in range(w)], _premul(r))
    out["reduce_scatter/PREMUL_SUM"] = o
    o = torch.zeros(3)
    await comm.reduce_scatter_tensor(o, (torch.arange(3.0 * w) + r).reshape(w, 3), R.AVG)
    out["reduce_scatter_tensor/stack"] = o

    ins = [torch.full((j + 1,), 10.0 * r + j) for j in range(w)]
    outs = [torch.zeros(r + 1) for _ in range(w)]
    await comm.all_to_all(outs, ins)
    out["all_to_all/uneven"] = outs
    x = torch.arange(2.0 * w) + 100 * r
    y = torch.zeros(2 * w)
    await comm.all_to_all_single(y, x)
    out["all_to_all_single/even"] = y
    in_splits = [(r + j) % 3 for j in range(w)]
    out_splits = [(j + r) % 3 for j in range(w)]
    x = (torch.arange(sum(in_splits) * 2, dtype=torch.int64) + 1000 * r).reshape(-1, 2)
    y = torch.zeros(sum(out_splits), 2, dtype=torch.int64)
    await comm.all_to_all_single(y, x, out_splits, in_splits)
    out["all_to_all_single/uneven"] = y
    await comm.barrier()

    # p2p: a ring with two tags, then any-source receives on rank 0
    right, left = (r + 1) % w, (r - 1) % w
    a, b = torch.zeros(2, dtype=torch.int32), torch.zeros(3)
    recvs = [comm.recv(b, left, tag=7), comm.recv(a, left, tag=3)]
    sends = [comm.send(torch.full((2,), r, dtype=torch.int32), right, tag=3), comm.send(torch.ones(3) * r, right, 7)]
    srcs = [await x for x in recvs]
    for s in sends:
        await s
    out["p2p/ring"] = [a, b, srcs]
    if not any_source:
        pass
    elif r == 0:
        got = []
        for _ in range(w - 1):
            t = torch.zeros(1)
            src = await comm.recv(t)
            got.append((src, t.item()))
        out["p2p/any_source"] = sorted(got)
    else:
        await comm.send(torch.tensor([r * 1.5]), dst=0)
        out["p2p/any_source"] = None

    out["broadcast_object"] = await comm.broadcast_object({"from": r, "x": [r] * 3} if r == 2 else None, src=2)
    out["all_gather_object"] = await comm.all_gather_object(("rank", r, "x" * (10 * r)))
    out["gather_object"] = await comm.gather_object({r: r * r}, dst=1)
    out["scatter_object"] = await comm.scatter_object([f"to {j}" * (j + 1) for j in range(w)] if r == 3 else None, 3)
    # issued back to back: the object collective's two steps and the all_reduce keep their order
    t = torch.ones(1) * r
    wo, wt = comm.all_gather_object(r), comm.all_reduce(t)
    out["object_then_tensor"] = [await wo, await wt, t]

    # bad arguments raise on the calling rank before anything is sent, tensors untouched
    t = torch.ones(2)
    try:
        comm.broadcast(t, src=w + 5)
        out["bad_argument"] = None
    except aiocoll.InvalidArgumentError as e:
        out["bad_argument"] = [str(e), t]
    try:
        comm.all_reduce(torch.ones(2, dtype=torch.uint32))
    except aiocoll.InvalidArgumentError as e:
        out["bad_dtype"] = str(e)

    evens = await comm.new_group([0, 2])
    t = torch.ones(1) * (r + 1)
    if evens is not None:
        await evens.all_reduce(t)
        out["new_group"] = [evens.rank, evens.world_size, evens.group_ranks, t]
    else:
        out["new_group"] = None
    sub = await comm.split(color=r % 2, key=-r)
    assert sub is not None
    t = torch.ones(1) * (r + 1)
    await sub.all_reduce(t)
    names = await sub.all_gather_object(f"r{r}")
    solo = await sub.split(color=None if sub.rank == 0 else "x")
    inner = None
    if solo is not None:
        inner = [solo.rank, solo.world_size, solo.group_ranks, await solo.all_gather_object(sub.rank)]
    out["split"] = [sub.rank, sub.world_size, sub.group_ranks, t, names, inner]
    try:
        await comm.new_group([r % 2])  # ranks disagree: a mismatch, reported on every rank
        out["new_group/mismatch"] = None
    except aiocoll.CollectiveMismatchError:
        out["new_group/mismatch"] = "CollectiveMismatchError"
    return out


# -- the per-process runner -------------------------------------------------------------------


class Unpicklable:
    """Hashable, so a valid color in-process, but it cannot travel to other processes."""

    def __reduce__(self) -> str:
        raise TypeError("this color refuses to be pickled")


async def _process_only(comm: aiocoll.Comm, out: dict[str, object]) -> None:
    """What only real processes have: checked in this rank, recorded for the test."""
    out["repr"] = repr(comm)
    out["statistics"] = comm.statistics()
    work = comm.all_reduce(torch.ones(1))
    out["work_repr"] = repr(work)
    await work
    out["work_after"] = [work.done(), work.result(), work.exception(), work.describe()]
    # split's color and key travel pickled: refused before anything is sent, as the
    # shared Comm.split hands the call to the process group
    before = await comm.split(color=0)
    made = comm.statistics().ranks[comm.rank].completed
    try:
        await comm.split(color=Unpicklable())
    except aiocoll.InvalidArgumentError as e:
        out["split/unpicklable"] = [str(e), comm.statistics().ranks[comm.rank].completed - made]
    after = await comm.split(color=0)
    out["split/names"] = [before and before.group_name, after and after.group_name]

    # the loop keeps serving a concurrent task while a large all_reduce is in flight
    big = torch.ones(8 * 1024 * 1024)  # 32 MB of float32
    ticks = 0
    stop = False

    async def ticker() -> None:
        nonlocal ticks
        while not stop:
            await asyncio.sleep(0.001)
            ticks += 1

    await comm.barrier()
    task = asyncio.create_task(ticker())
    t0 = time.perf_counter()
    await comm.all_reduce(big)
    elapsed = time.perf_counter() - t0
    stop = True
    await task
    out["ticks"] = [ticks, elapsed, big[:2].tolist(), big[-1].item()]


async def _failures(comm: aiocoll.Comm, out: dict[str, object]) -> None:
    r = comm.rank
    # a per-op timeout, on a group of its own (a timed-out gloo group is unusable after)
    pair = await comm.new_group([0, 1])
    tpair = pair and aiocoll.from_process_group(pair.process_group, timeout=1.0)  # type: ignore[attr-defined]
    dying = await comm.new_group([0, 1])
    if r == 0:
        assert tpair is not None
        t0 = time.perf_counter()
        try:
            await tpair.all_reduce(torch.ones(1))
        except aiocoll.CollectiveTimeoutError as e:
            out["timeout"] = [type(e).__name__, str(e), type(e.__cause__).__name__, time.perf_counter() - t0]
    if dying is not None:
        await dying.barrier()  # rank 1 got here once rank 0 timed out
        if r == 1:
            await asyncio.sleep(0.3)  # rank 0 is in the all_reduce by now
            os._exit(0)
        t0 = time.perf_counter()
        try:
            await dying.all_reduce(torch.ones(1000))
        except aiocoll.WorldAbortedError as e:
            out["peer_died"] = [type(e).__name__, str(e), type(e.__cause__).__name__, time.perf_counter() - t0]


def _rank_main(argv: list[str]) -> None:
    """One gloo rank: ``python test_process_group.py RANK WORLD INIT_METHOD OUT``."""
    rank, world, init_method, path = int(argv[0]), int(argv[1]), argv[2], argv[3]

    async def main() -> None:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world, init_method=init_method, timeout=timedelta(seconds=30)
        )
        comm = aiocoll.from_process_group()
        results = await table(comm)
        await _process_only(comm, results)
        save(results)
        await _failures(comm, results)  # rank 1 dies in there
        save(results)

    def save(results: dict[str, object]) -> None:
        torch.save(results, path + ".tmp")
        os.replace(path + ".tmp", path)

    asyncio.run(main())
    os._exit(0)  # some groups are broken on purpose: no orderly teardown


def _loopback_env() -> dict[str, str]:
    # the processes import the aiocoll under test, not whichever one the venv has installed
    # (an editable install of another checkout)
    root = str(Path(aiocoll.__file__).resolve().parent.parent)
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path)
    for _, name in socket.if_nameindex():
        if name in ("lo", "lo0"):
            env.setdefault("GLOO_SOCKET_IFNAME", name)
    return env


def hold_gil(seconds: float) -> None:
    """Block in C with the GIL held, as a long C call or garbage collection does: no thread runs."""
    ctypes.PyDLL(None).usleep(int(seconds * 1e6))  # a PyDLL call keeps the GIL


def play_presence(scenario: str) -> None:
    """In a process of a "stopped" scenario: how ``Presence`` judges its peers there.

    1 s without a heartbeat names a peer elsewhere (5 s by default): so a busy peer on
    this host, whose heartbeat stalls 2.5 s, is spared by /proc alone. "stopped_elsewhere"
    plays processes on hosts of their own (no /proc lookups).
    """
    if scenario.startswith("stopped"):
        Presence.STALE = 1.0
    if scenario == "stopped_elsewhere":
        Presence.ON_THIS_HOST = False


def linger(path: str, survivors: Collection[int], timeout: float = 30.0) -> None:
    """In a process of ``run_processes`` that saved to ``path``: wait until each survivor saved.

    A survivor that exits (``os._exit``, no word at exit) while another still looks for the
    processes gone would be named by it too.
    """
    saved = [Path(path).with_name(f"proc{i}.pt") for i in survivors]
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in saved) and time.monotonic() < deadline:
        time.sleep(0.05)


def run_processes(
    script: str,
    args: list[list[str]],
    tmp: Path,
    meanwhile: Callable[[], Any] = lambda: None,
    survivors: Collection[int] | None = None,
    timeout: float = LAUNCH_TIMEOUT,
) -> tuple[list[Any], Any]:
    """Run ``python script *args[i]`` for every i on loopback, each saving to ``tmp/proc{i}.pt``.

    The last argument of each command is that path. Calls ``meanwhile()`` while they run;
    returns what each process saved and what ``meanwhile`` returned. Fails the test, with
    the process's output, if one fails. ``survivors``: the processes expected to end well
    (default: all); the others die on purpose, and their entry is None. ``timeout``: seconds
    they all have to end.
    """
    procs = []
    for i, a in enumerate(args):
        err = (tmp / f"proc{i}.err").open("wb")
        cmd = [sys.executable, script, *a, str(tmp / f"proc{i}.pt")]
        procs.append((subprocess.Popen(cmd, env=_loopback_env(), stdout=err, stderr=err, cwd=tmp), err))
    try:
        other = meanwhile()
        deadline = time.monotonic() + timeout
        for p, _ in procs:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
    finally:
        for p, err in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            err.close()
    alive = range(len(args)) if survivors is None else survivors
    failed = [i for i in alive if procs[i][0].returncode != 0 or not (tmp / f"proc{i}.pt").exists()]
    if failed:
        i = failed[0]
        pytest.fail(f"process {i} failed:\n{(tmp / f'proc{i}.err').read_text()[-4000:]}")
    saved = [torch.load(tmp / f"proc{i}.pt", weights_only=False) if i in alive else None for i in range(len(args))]
    return saved, other


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, object]], list[dict[str, object]]]:
    """The table in 4 gloo processes and in-process: (gloo, aiocoll) results by rank."""
    tmp = tmp_path_factory.mktemp("pg")
    init = (tmp / "store").as_uri()
    args = [[str(rank), str(WORLD), init] for rank in range(WORLD)]
    return run_processes(__file__, args, tmp, lambda: aiocoll.spawn(table, world=WORLD, timeout=30))


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))  # type: ignore[arg-type]
    return a == b


def test_every_entry_matches_in_process(results: tuple[list[dict[str, object]], list[dict[str, object]]]) -> None:
    gloo, local = results
    names = list(local[0])
    assert len(names) > 250
    bad = []
    for rank in range(WORLD):
        for name in names:
            g, a = gloo[rank][name], local[rank][name]
            if name in PG_REJECTS:
                assert g == "InvalidArgumentError", name
                assert isinstance(a, torch.Tensor), name
            elif name == "bad_argument":
                assert isinstance(g, list)
                assert isinstance(a, list)
                assert (
                    g[0] == a[0] == f"broadcast on rank {rank}: argument 'src': rank 9 is out of range for a group of 4"
                )
                assert _same(g[1], a[1])
            elif not _same(g, a):
                bad.append(f"rank {rank} {name}: gloo {g!r} != in-process {a!r}")
    assert not bad, "\n".join(bad[:20])
    # the table exercises what it claims to
    assert local[0]["all_reduce/AVG/int32"] == "InvalidArgumentError"
    assert isinstance(local[0]["all_reduce/PREMUL_SUM/bfloat16"], torch.Tensor)
    assert local[0]["p2p/any_source"] == [(1, 1.5), (2, 3.0), (3, 4.5)]
    assert local[0]["new_group/mismatch"] == "CollectiveMismatchError"


def test_repr_statistics_and_work(results: tuple[list[dict[str, object]], list[dict[str, object]]]) -> None:
    g = results[0][1]
    assert g["repr"] == "<Comm rank=1/4 group='0' backend=gloo>"
    stats = g["statistics"]
    assert isinstance(stats, aiocoll.Statistics)
    assert [r.rank for r in stats.ranks if r.state != "remote"] == [1]
    assert stats.backend == "gloo"
    assert stats.pending_collectives + stats.pending_p2p == 0
    assert stats.ranks[1].completed > 200
    assert str(g["work_repr"]).startswith("<Work rank=1 all_reduce(float32[1], op=ReduceOp.SUM) on group '0' ")
    done, result, exc, describe = g["work_after"]  # type: ignore[misc]
    assert (done, result, exc) == (True, None, None)
    assert describe.startswith("all_reduce(float32[1], op=ReduceOp.SUM) on group '0' at ")
    assert describe.endswith("test_process_group.py:" + describe.rsplit(":", 1)[1])
    message, sent = g["split/unpicklable"]  # type: ignore[misc]
    assert message.startswith("split on rank 1: argument 'color and key': object of type tuple cannot be pickled")
    assert sent == 0  # nothing was issued
    # the refused split took no number: the groups made around it are numbered in a row
    before, after = g["split/names"]  # type: ignore[misc]
    n = int(before.removeprefix("0/aiocoll").removesuffix(".0"))
    assert after == f"0/aiocoll{n + 1}.0"


def test_loop_keeps_running_during_a_large_all_reduce(
    results: tuple[list[dict[str, object]], list[dict[str, object]]],
) -> None:
    for rank in range(WORLD):
        ticks, elapsed, head, last = results[0][rank]["ticks"]  # type: ignore[misc]
        assert head == [4.0, 4.0]
        assert last == 4.0
        # a blocked loop would tick at most once; 1 ms sleeps tick about once a millisecond
        assert ticks >= 5, (ticks, elapsed)
        assert ticks >= elapsed * 1000 * 0.1, (ticks, elapsed)


def test_timeout_and_peer_death(results: tuple[list[dict[str, object]], list[dict[str, object]]]) -> None:
    g0 = results[0][0]
    name, msg, cause, took = g0["timeout"]  # type: ignore[misc]
    assert (name, cause) == ("CollectiveTimeoutError", "RuntimeError")
    assert msg.startswith("all_reduce(float32[1], op=ReduceOp.SUM) on rank 0 of group ")
    assert "timed out" in msg
    assert took < 10
    name, msg, cause, took = g0["peer_died"]  # type: ignore[misc]
    # Two watchers race to name the dead peer, and either report is right: the transport
    # failing under the check (chained to gloo's RuntimeError), or the checks' presence
    # watch finding its process gone first (nothing to chain: no transport error yet).
    # Which one wins depends on load (seen both ways under pytest -n 2).
    assert name == "WorldAbortedError"
    assert cause in ("RuntimeError", "NoneType")
    assert msg.startswith("all_reduce(float32[1000], op=ReduceOp.SUM) on rank 0 of group ")
    # named by the checks' presence: its process (os._exit, no word at exit) is gone from /proc
    assert re.search(r"failed: rank 1 died \(pid \d+ on this host is gone\)", msg), msg
    assert took < 10


# -- without processes --------------------------------------------------------------------------


def test_from_process_group_needs_an_initialised_group() -> None:
    if dist.is_initialized():  # pragma: no cover - another test left a group behind
        pytest.skip("torch.distributed is initialised in this process")
    with pytest.raises(aiocoll.AiocollError, match="init_process_group"):
        aiocoll.from_process_group()
    with pytest.raises(aiocoll.InvalidArgumentError, match="expected a ProcessGroup"):
        aiocoll.from_process_group("world")  # type: ignore[arg-type]


class _EnqueuedWork:
    """A work as NCCL makes one: its future completes at enqueue, the op ``polls`` queries later."""

    def __init__(self, polls: int, error: Exception | None = None) -> None:
        self.future: torch.futures.Future[None] = torch.futures.Future()
        self.future.set_result(None)
        self.left = polls
        self.error = error
        self.waited: list[int] = []

    def get_future(self) -> torch.futures.Future[None]:
        return self.future

    def is_completed(self) -> bool:
        self.left -= 1
        return self.left <= 0

    def wait(self) -> bool:
        self.waited.append(threading.get_ident())
        if self.error is not None:
            raise self.error
        return True


@pytest.mark.asyncio
async def test_a_device_work_is_awaited_until_the_op_is_done_not_enqueued() -> None:
    # Found on a GPU: NCCL's future completes at enqueue, so awaiting it returned while the
    # op still ran (and a barrier's wait() on the loop would block it until every peer came).
    work = _EnqueuedWork(polls=5)
    fut = _pgbridge.bridge_work(work, on_device=True)  # type: ignore[arg-type]
    ticks = 0
    while not fut.done():
        ticks += 1
        await asyncio.sleep(0)
    await fut
    assert work.left <= 0  # polled until the op was done...
    assert ticks >= 5  # ... while the loop ran other tasks
    assert work.waited == [threading.get_ident()]  # then wait(): on the loop, the op done

    barrier = _EnqueuedWork(polls=3)
    done: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()
    _pgbridge.when_done(barrier, asyncio.get_running_loop(), done.set_result, on_device=True, wait=False)  # type: ignore[arg-type]
    assert await done is None
    assert barrier.left <= 0
    assert barrier.waited == []

    failing = _EnqueuedWork(polls=2, error=RuntimeError("NCCL error: unhandled system error"))
    with pytest.raises(RuntimeError, match="NCCL error"):
        await _pgbridge.bridge_work(failing, on_device=True)  # type: ignore[arg-type]

    host = _EnqueuedWork(polls=5)  # gloo: the future is the completion
    await _pgbridge.bridge_work(host)  # type: ignore[arg-type]
    assert host.left == 5
    assert host.waited == []


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="NCCL needs 2 GPUs")
def test_nccl(tmp_path: Path) -> None:  # pragma: no cover - no GPUs here
    code = (
        "import asyncio, os, sys, torch, torch.distributed as dist, aiocoll\n"
        "async def main():\n"
        "    r = int(os.environ['LOCAL_RANK']); torch.cuda.set_device(r)\n"
        "    dist.init_process_group('nccl')\n"
        "    comm = aiocoll.from_process_group()\n"
        "    t = torch.ones(3, device='cuda') * comm.rank\n"
        "    await comm.all_reduce(t)\n"
        "    assert t.tolist() == [1.0, 1.0, 1.0], t\n"
        "    objs = await comm.all_gather_object(comm.rank)\n"
        "    assert objs == [0, 1], objs\n"
        "    dist.destroy_process_group()\n"
        "asyncio.run(main())\n"
    )
    script = tmp_path / "nccl_check.py"
    script.write_text(code)
    r = _torchrun(script, 2)
    assert r.returncode == 0, r.stdout + r.stderr


_NCCL_ONE = """
import asyncio, sys, time, torch, torch.distributed as dist, aiocoll
sys.path.insert(0, {tests!r})
from test_cuda_streams import async_table
async def main():
    torch.cuda.set_device(0)
    dist.init_process_group("nccl")
    comm = aiocoll.from_process_group()
    out = await async_table(comm, torch.device("cuda", 0))
    out["objects"] = await comm.all_gather_object({{"rank": comm.rank}})
    # the await lasts until NCCL's op is done, ~250 ms after a producer kernel; the loop serves meanwhile
    t = torch.ones(64 << 20, device="cuda")  # 256 MB
    torch.cuda._sleep(500_000_000)
    t.mul_(3)
    ticks = 0
    async def ticker(w):
        nonlocal ticks
        while not w.done():
            await asyncio.sleep(0.001)
            ticks += 1
    w = comm.all_reduce(t)
    start = time.perf_counter()
    await asyncio.gather(w, ticker(w))
    out["big"] = (time.perf_counter() - start, ticks, t[[0, -1]].tolist())
    torch.save(out, {out!r})
    dist.destroy_process_group()
asyncio.run(main())
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_nccl_in_one_process(tmp_path: Path) -> None:  # pragma: no cover - no GPUs here
    # The only NCCL world one GPU allows: every collective through from_process_group, equal
    # to the same table in-process on the CPU, and the loop serving other tasks meanwhile.
    sys.path.insert(0, str(ROOT / "tests" / "ops"))  # test_cuda_streams's folder
    from test_cuda_streams import async_table

    script = tmp_path / "nccl_one.py"
    result = tmp_path / "out.pt"
    script.write_text(_NCCL_ONE.format(tests=str(ROOT / "tests" / "ops"), out=str(result)))
    r = _torchrun(script, 1)
    assert r.returncode == 0, r.stdout + r.stderr
    got = torch.load(result)

    async def cpu(comm: aiocoll.Comm) -> dict[str, Any]:
        return await async_table(comm, torch.device("cpu"))

    (want,) = aiocoll.spawn(cpu, world=1, torch_distributed=False)
    took, ticks, big = got.pop("big")
    assert got.pop("objects") == [{"rank": 0}]
    assert got.keys() == want.keys()
    for k, v in want.items():
        g = got[k]
        pairs = zip(g, v, strict=True) if isinstance(v, list) else [(g, v)]
        for a, b in pairs:
            assert a.dtype == b.dtype, k
            assert torch.equal(a, b), f"{k}: {a} != {b}"
    assert big == [3.0, 3.0]
    assert took > 0.1, took  # the await lasted until the op was done...
    assert ticks >= 20, ticks  # ... and the loop served the ticker meanwhile


# -- torchrun and the example -------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _torchrun(script: Path, n: int) -> subprocess.CompletedProcess[str]:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(n),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(_free_port()),
        str(script),
    ]
    return subprocess.run(cmd, cwd=ROOT, env=_loopback_env(), capture_output=True, text=True, timeout=120)


def test_example_under_torchrun() -> None:
    r = _torchrun(ROOT / "examples" / "torchrun_allreduce.py", 2)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = sorted(line for line in r.stdout.splitlines() if line.startswith("rank"))
    assert lines == [
        "rank 0 of 2: all_reduce [1.0, 1.0, 1.0], objects ['rank0', 'rank1']",
        "rank 1 of 2: all_reduce [1.0, 1.0, 1.0], objects ['rank0', 'rank1']",
    ], r.stdout + r.stderr
    # then 2 processes x 2 ranks: what a flat world of 4 prints
    hybrid = sorted(line.removeprefix("hybrid ") for line in r.stdout.splitlines() if line.startswith("hybrid"))
    assert hybrid == [
        f"rank {k} of 4: all_reduce [6.0, 6.0, 6.0], objects {[f'rank{j}' for j in range(4)]}" for k in range(4)
    ]


if __name__ == "__main__":
    _rank_main(sys.argv[1:])
