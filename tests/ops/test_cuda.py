"""CUDA ops: a side stream ordered after the ranks' streams, a done event polled from the loop.

The orchestration and the polling run everywhere, with fake streams and events standing in
for CUDA (``_cuda._hw``); the tests marked ``cuda``/``two_gpus`` run the real thing.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

import aiocoll
from aiocoll._ops import AllGather, AllReduce, Reduce, ReduceScatterTensor, Reduction, _cuda, _device

SUM = Reduction.of(dist.ReduceOp.SUM)
CUDA0 = torch.device("cuda", 0)
CUDA1 = torch.device("cuda", 1)
CPU = torch.device("cpu")

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA devices"
)


# -- fakes: CUDA's calls, logged -----------------------------------------------------------


class FakeStream:
    def __init__(self, log: list[tuple[str, ...]], name: str) -> None:
        self.log = log
        self.name = name

    def wait_event(self, event: FakeEvent) -> None:
        self.log.append(("wait", self.name, event.name))


class FakeEvent:
    """Fires on the ``fire_after + 1``-th query, or once ``gate`` is set if it has one."""

    def __init__(
        self, log: list[tuple[str, ...]], name: str, fire_after: int = 0, gate: threading.Event | None = None
    ) -> None:
        self.log = log
        self.name = name
        self.fire_after = fire_after
        self.gate = gate
        self.polls = 0

    def record(self, stream: FakeStream) -> None:
        self.log.append(("record", self.name, stream.name))

    def query(self) -> bool:
        self.polls += 1
        self.log.append(("query", self.name))
        if self.gate is not None:
            return self.gate.is_set()
        return self.polls > self.fire_after


class FakeHw:
    """Stands in for ``_cuda._Torch``: tensors sit on ``where`` (default cuda:0), all on the CPU."""

    def __init__(self, where: dict[int, torch.device] | None = None, fire_after: int = 0) -> None:
        self.log: list[tuple[str, ...]] = []
        self.where = dict(where or {})
        self.fire_after = fire_after
        self.gate: threading.Event | None = None
        self.keep: list[torch.Tensor] = []  # staged copies: their ids must stay theirs
        self._names = itertools.count(1)
        self.events: list[FakeEvent] = []

    def active(self) -> bool:
        return True

    def device_of(self, t: torch.Tensor) -> torch.device:
        return self.where.get(id(t), CUDA0)

    def event(self) -> FakeEvent:
        e = FakeEvent(self.log, f"ev{next(self._names)}", self.fire_after, self.gate)
        self.events.append(e)
        return e

    def current_stream(self, device: torch.device) -> FakeStream:
        return FakeStream(self.log, f"cur{device.index}")

    def side_stream(self, device: torch.device) -> FakeStream:
        return FakeStream(self.log, f"side{device.index}")

    @contextlib.contextmanager
    def use(self, stream: FakeStream) -> Iterator[None]:
        self.log.append(("use", stream.name))
        yield
        self.log.append(("unuse", stream.name))

    def record_stream(self, t: torch.Tensor, stream: FakeStream) -> None:
        self.log.append(("record_stream", stream.name))

    def stage(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        self.log.append(("stage", str(self.device_of(t)), str(device)))
        s = t.clone()
        self.keep.append(s)
        self.where[id(s)] = device
        return s

    def host_buffer(self, t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=t.dtype)


@pytest.fixture
def hw(monkeypatch: pytest.MonkeyPatch) -> FakeHw:
    fake = FakeHw()
    monkeypatch.setattr(_cuda, "_hw", fake)
    return fake


def logged_run(log: list[tuple[str, ...]], run: Callable[[Any], list[Any]]) -> Callable[[Any], list[Any]]:
    def spy(calls: Any) -> list[Any]:
        log.append(("run",))
        return run(calls)

    return spy


def drive(fut: asyncio.Future[Any]) -> Any:
    """Run ``fut``'s loop until it completes; return its result."""
    return fut.get_loop().run_until_complete(fut)


@pytest.fixture
def loop_() -> Iterator[asyncio.AbstractEventLoop]:
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


# -- polling ------------------------------------------------------------------------------


class FakeLoop:
    """Records what the poller schedules, so a test can step it by hand."""

    def __init__(self) -> None:
        self.scheduled: list[tuple[float, Callable[[], None]]] = []

    def call_later(self, delay: float, fn: Callable[[], None]) -> None:
        self.scheduled.append((delay, fn))

    def step(self) -> None:
        _, fn = self.scheduled.pop(0)
        fn()


def test_poll_backs_off_to_the_cap_then_completes(loop_: asyncio.AbstractEventLoop) -> None:
    fake_loop = FakeLoop()
    event = FakeEvent([], "done", fire_after=6)
    fut: asyncio.Future[str] = loop_.create_future()
    watch = _cuda._Watch(fake_loop, event, lambda: "value", fut, 1.0, 4.0)  # type: ignore[arg-type]
    watch.poll()
    delays = []
    while fake_loop.scheduled:
        delays.append(fake_loop.scheduled[0][0])
        fake_loop.step()
    assert delays == [1.0, 2.0, 4.0, 4.0, 4.0, 4.0]
    assert event.polls == 7
    assert fut.result() == "value"


def test_poll_stops_once_the_future_is_cancelled(loop_: asyncio.AbstractEventLoop) -> None:
    fake_loop = FakeLoop()
    event = FakeEvent([], "done", fire_after=1000)
    fut: asyncio.Future[None] = loop_.create_future()
    watch = _cuda._Watch(fake_loop, event, lambda: None, fut, 1.0, 4.0)  # type: ignore[arg-type]
    watch.poll()
    fake_loop.step()
    assert event.polls == 2
    assert len(fake_loop.scheduled) == 1
    fut.cancel()  # the loop is going away, or nobody waits any more
    fake_loop.step()
    assert event.polls == 2  # no query after the cancel ...
    assert fake_loop.scheduled == []  # ... and nothing rescheduled


@pytest.mark.parametrize("where", ["query", "then"])
def test_poll_puts_errors_into_the_future(loop_: asyncio.AbstractEventLoop, where: str) -> None:
    class Broken(FakeEvent):
        def query(self) -> bool:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    def then() -> None:
        raise OSError("write-back failed")

    event = Broken([], "done") if where == "query" else FakeEvent([], "done")
    fut = _cuda.watch(loop_, event, then if where == "then" else lambda: None)
    with pytest.raises(RuntimeError if where == "query" else OSError):
        drive(fut)


def test_poll_never_blocks_the_loop(loop_: asyncio.AbstractEventLoop) -> None:
    event = FakeEvent([], "done", fire_after=20)
    ticks = 0

    async def main() -> str:
        nonlocal ticks
        fut = _cuda.watch(loop_, event, lambda: "ok", first=1e-5, cap=1e-4)
        while not fut.done():
            ticks += 1
            await asyncio.sleep(0)
        return await fut

    assert loop_.run_until_complete(main()) == "ok"
    assert event.polls == 21
    assert ticks > event.polls  # the loop served the ticker between polls


def test_first_poll_is_on_the_next_loop_turn(loop_: asyncio.AbstractEventLoop) -> None:
    event = FakeEvent([], "done")
    fut = _cuda.watch(loop_, event, lambda: 7)
    assert event.polls == 0  # nothing runs inside watch(): it is called from the engine
    assert drive(fut) == 7
    assert event.polls == 1


# -- issue and enqueue ---------------------------------------------------------------------


def test_issue_records_an_event_on_the_current_stream_of_the_tensors_device(hw: FakeHw) -> None:
    t = torch.ones(2)
    hw.where[id(t)] = CUDA1
    iss = _cuda.issue(AllReduce(t, SUM))
    assert iss is not None
    assert iss.device == CUDA1
    assert iss.done is None
    assert [e.name for e in iss.ready] == ["ev1"]
    assert hw.log == [("record", "ev1", "cur1")]


def test_issue_skips_calls_without_cuda_tensors(hw: FakeHw) -> None:
    t = torch.ones(2)
    hw.where[id(t)] = CPU
    assert _cuda.issue(AllReduce(t, SUM)) is None
    assert hw.log == []


def test_issue_of_a_cpu_call_on_the_real_hardware_layer() -> None:
    # without CUDA initialised this returns before looking at the tensors
    assert _cuda.issue(AllReduce(torch.ones(2), SUM)) is None


def test_stream_wait_orders_the_callers_current_stream(hw: FakeHw) -> None:
    iss = _cuda.Issue(CUDA1, [], done=FakeEvent(hw.log, "done"))
    _cuda.stream_wait(iss)
    assert hw.log == [("wait", "cur1", "done")]


def test_enqueue_waits_for_every_rank_then_runs_on_the_side_stream_then_records_done(
    hw: FakeHw, loop_: asyncio.AbstractEventLoop
) -> None:
    ts = [torch.full((3,), float(r + 1)) for r in range(2)]
    calls = [AllReduce(t, SUM) for t in ts]
    issues = [_cuda.issue(c) for c in calls]  # at issue time, on each rank's current stream
    fut = _cuda.run_cuda(loop_, logged_run(hw.log, AllReduce.run), calls, issues)
    assert all(i is not None and i.done is hw.events[-1] and i.ready == [] for i in issues)
    assert drive(fut) == [None, None]
    assert [t.tolist() for t in ts] == [[3.0] * 3] * 2
    assert hw.log == [
        ("record", "ev1", "cur0"),  # rank 0 issues
        ("record", "ev2", "cur0"),  # rank 1 issues
        ("wait", "side0", "ev1"),  # the op waits for both ranks' producers ...
        ("wait", "side0", "ev2"),
        ("use", "side0"),  # ... runs on the side stream ...
        ("record_stream", "side0"),  # ... telling the allocator who uses the memory ...
        ("record_stream", "side0"),
        ("run",),
        ("record", "ev3", "side0"),  # ... and marks its end
        ("unuse", "side0"),
        ("query", "ev3"),  # then the loop polls
    ]


def test_an_error_while_enqueueing_fails_the_future_and_leaves_no_done(
    hw: FakeHw, loop_: asyncio.AbstractEventLoop
) -> None:
    def broken(calls: Any) -> list[None]:
        raise ValueError("bad op")

    calls = [AllReduce(torch.ones(1), SUM) for _ in range(2)]
    issues = [_cuda.issue(c) for c in calls]
    fut = _cuda.run_cuda(loop_, broken, calls, issues)
    assert fut.done()
    with pytest.raises(ValueError, match="bad op"):
        fut.result()
    assert all(i is not None and i.done is None for i in issues)  # no waiter may go on


def test_ranks_on_two_devices_run_on_rank_0s_device(hw: FakeHw, loop_: asyncio.AbstractEventLoop) -> None:
    ts = [torch.full((2,), float(r + 1)) for r in range(3)]
    hw.where[id(ts[1])] = CUDA1
    calls = [AllReduce(t, SUM) for t in ts]
    issues = [_cuda.issue(c) for c in calls]
    hw.log.clear()
    fut = _cuda.run_cuda(loop_, logged_run(hw.log, AllReduce.run), calls, issues)
    drive(fut)
    assert [t.tolist() for t in ts] == [[6.0, 6.0]] * 3
    log = hw.log
    # both side streams wait for all three ranks; rank 1's tensor is copied to cuda:0 and back
    waits = {(e[1], e[2]) for e in log if e[0] == "wait"}
    assert waits >= {(s, e) for s in ["side0", "side1"] for e in ["ev1", "ev2", "ev3"]}
    assert [e for e in log if e[0] == "use"] == [("use", "side1"), ("use", "side0")]  # op device innermost
    assert [e for e in log if e[0] == "stage"] == [("stage", "cuda:1", "cuda:0")]
    # the other device's stream is joined into the op's stream before done is recorded
    tail = log[log.index(("run",)) + 1 :]
    assert tail[:3] == [("record", "ev4", "side1"), ("wait", "side0", "ev4"), ("record", "ev5", "side0")]


def test_staged_copies_only_read_are_not_written_back(hw: FakeHw, loop_: asyncio.AbstractEventLoop) -> None:
    ts = [torch.full((2,), float(r + 1)) for r in range(2)]
    hw.where[id(ts[1])] = CUDA1
    before = ts[1]._version
    calls = [Reduce(t, 0, SUM) for t in ts]
    drive(_cuda.run_cuda(loop_, Reduce.run, calls, [_cuda.issue(c) for c in calls]))
    assert ts[0].tolist() == [3.0, 3.0]
    assert ts[1].tolist() == [2.0, 2.0]
    assert ts[1]._version == before  # never written


def test_staging_keeps_the_in_place_answer_of_aliased_outputs(hw: FakeHw, loop_: asyncio.AbstractEventLoop) -> None:
    # reduce_scatter into a chunk of its own input, the input staged from another device
    def calls_for(inputs: list[torch.Tensor]) -> list[ReduceScatterTensor]:
        return [ReduceScatterTensor(x[r * 2 : r * 2 + 2], x, SUM) for r, x in enumerate(inputs)]

    want = [torch.arange(4.0) + 10 * r for r in range(2)]
    ReduceScatterTensor.run(calls_for(want))  # in place, on one device
    got = [torch.arange(4.0) + 10 * r for r in range(2)]
    hw.where[id(got[1])] = CUDA1
    calls = calls_for(got)
    for c in calls:  # the output views are tensors of their own, on their base's device
        hw.where[id(c.output)] = hw.device_of(c.input)
    drive(_cuda.run_cuda(loop_, ReduceScatterTensor.run, calls, [_cuda.issue(c) for c in calls]))
    assert [g.tolist() for g in got] == [w.tolist() for w in want]


def test_lists_of_tensors_are_staged_too(hw: FakeHw, loop_: asyncio.AbstractEventLoop) -> None:
    outs = [[torch.zeros(1) for _ in range(2)] for _ in range(2)]
    ins = [torch.tensor([float(r + 5)]) for r in range(2)]
    for t in [*outs[1], ins[1]]:
        hw.where[id(t)] = CUDA1
    calls = [AllGather(o, x) for o, x in zip(outs, ins, strict=True)]
    drive(_cuda.run_cuda(loop_, AllGather.run, calls, [_cuda.issue(c) for c in calls]))
    assert [[t.item() for t in o] for o in outs] == [[5.0, 6.0], [5.0, 6.0]]


def test_host_tensors_are_written_only_once_the_op_is_done(hw: FakeHw, loop_: asyncio.AbstractEventLoop) -> None:
    hw.fire_after = 3
    ts = [torch.full((2,), float(r + 1)) for r in range(2)]
    hw.where[id(ts[1])] = CPU  # a rank on the host, mixed into a CUDA op
    calls = [AllReduce(t, SUM) for t in ts]
    issues = [_cuda.issue(c) for c in calls]
    assert issues[1] is None  # nothing to wait for on the host
    fut = _cuda.run_cuda(loop_, AllReduce.run, calls, issues)
    assert ts[1].tolist() == [2.0, 2.0]  # the device may still be writing its buffer
    drive(fut)
    assert [t.tolist() for t in ts] == [[3.0, 3.0]] * 2


# -- through the engine, on fakes ------------------------------------------------------------


@pytest.fixture
def on_fake_cuda(monkeypatch: pytest.MonkeyPatch, hw: FakeHw) -> FakeHw:
    """Every op with tensors takes the CUDA path, on the fake hardware."""

    def placement(calls: Any, inline_bytes: int = 0) -> _device.Placement:
        if any(_device.tensors_of(c) for c in calls):
            return _device.Placement.CUDA
        return _device.Placement.INLINE

    monkeypatch.setattr(_device, "placement", placement)
    hw.fire_after = 5
    return hw


def test_async_ranks_await_a_cuda_op_while_the_loop_runs(on_fake_cuda: FakeHw, loop: str) -> None:
    async def worker(comm: aiocoll.Comm) -> tuple[list[float], int]:
        ticks = 0
        t = torch.full((2,), float(comm.rank + 1))
        w = comm.all_reduce(t)
        while not w.done():
            ticks += 1
            await asyncio.sleep(0)
        await w
        return t.tolist(), ticks

    out = aiocoll.spawn(worker, world=3, loop=loop, torch_distributed=False)
    assert [v for v, _ in out] == [[6.0, 6.0]] * 3
    assert all(ticks > 0 for _, ticks in out)
    done = on_fake_cuda.events[-1]
    assert done.polls == 6  # completed by the poll that saw the event fire
    assert ("record", done.name, "side0") in on_fake_cuda.log


def test_sync_ranks_complete_a_cuda_op(on_fake_cuda: FakeHw) -> None:
    def worker(comm: aiocoll.Comm) -> list[float]:
        t = torch.full((2,), float(comm.rank + 1))
        comm.all_reduce(t).wait()
        return t.tolist()

    assert aiocoll.spawn(worker, world=2, torch_distributed=False) == [[3.0, 3.0]] * 2


def test_sync_wait_returns_once_enqueued_and_orders_the_callers_stream(on_fake_cuda: FakeHw) -> None:
    gate = on_fake_cuda.gate = threading.Event()  # the op "runs" on the device until set
    backstop = threading.Timer(10, gate.set)  # a failure must not hang the suite
    backstop.start()
    both = threading.Barrier(2, timeout=10)

    def worker(comm: aiocoll.Comm) -> tuple[bool, list[float]]:
        t = torch.full((2,), float(comm.rank + 1))
        w = comm.all_reduce(t)
        w.wait()
        early = not w.done()  # wait() returned while the op is still on the device
        both.wait()
        gate.set()
        return early, t.tolist()

    try:
        # ranks take turns: rank 0 waits in the barrier holding its turn until the stall
        # watch lets rank 1 go on, and spawn says so
        with pytest.warns(RuntimeWarning, match=r"rank 0 waited in threading\.Barrier\.wait at .*test_cuda\.py"):
            out = aiocoll.spawn(worker, world=2, torch_distributed=False)
    finally:
        backstop.cancel()
    assert out == [(True, [3.0, 3.0])] * 2
    done = on_fake_cuda.events[-1]
    # each rank's current stream was made to wait on the op instead
    assert on_fake_cuda.log.count(("wait", "cur0", done.name)) == 2


def test_an_error_in_a_cuda_op_keeps_its_type(on_fake_cuda: FakeHw, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(calls: Any) -> list[None]:
        raise OSError("device on fire")

    monkeypatch.setattr(AllReduce, "run", staticmethod(broken))

    async def worker(comm: aiocoll.Comm) -> None:
        await comm.all_reduce(torch.ones(1))

    with pytest.raises(OSError, match="device on fire"):
        aiocoll.spawn(worker, world=2, torch_distributed=False)


# -- on a GPU ------------------------------------------------------------------------------

# GPU time to spin before the producer writes: long enough that reading too early would
# see the old values (about 10-100 ms on current GPUs)
SPIN = 100_000_000


@cuda
def test_cuda_all_reduce_runs_on_a_side_stream(monkeypatch: pytest.MonkeyPatch, loop: str) -> None:
    streams: list[torch.cuda.Stream] = []
    real_run = AllReduce.run

    def spy(calls: Any) -> list[None]:
        streams.append(torch.cuda.current_stream(calls[0].tensor.device))
        return real_run(calls)

    monkeypatch.setattr(AllReduce, "run", staticmethod(spy))

    async def worker(comm: aiocoll.Comm) -> list[float]:
        t = torch.full((1 << 16,), float(comm.rank + 1), device="cuda:0")
        await comm.all_reduce(t)
        return t[[0, -1]].tolist()

    assert aiocoll.spawn(worker, world=3, loop=loop) == [[6.0, 6.0]] * 3
    assert len(streams) == 1
    assert streams[0] != torch.cuda.default_stream(CUDA0)
    assert streams[0] == _cuda._hw.side_stream(CUDA0)


@cuda
def test_cuda_producer_on_the_users_stream_is_waited_for(loop: str) -> None:
    async def worker(comm: aiocoll.Comm) -> tuple[list[float], int]:
        t = torch.zeros(1 << 20, device=CUDA0)
        s = torch.cuda.Stream(CUDA0)
        s.wait_stream(torch.cuda.current_stream(CUDA0))  # t's zeros come first
        with torch.cuda.stream(s):  # no await inside: async ranks share the thread's streams
            torch.cuda._sleep(SPIN)  # type: ignore[no-untyped-call]
            t.fill_(comm.rank + 1.0)
            w = comm.all_reduce(t)  # issued on s: the op must start after the fill
        ticks = 0
        while not w.done():
            ticks += 1
            await asyncio.sleep(0)
        await w
        return t[[0, -1]].tolist(), ticks

    out = aiocoll.spawn(worker, world=2, loop=loop)
    assert [v for v, _ in out] == [[3.0, 3.0]] * 2
    assert all(ticks > 0 for _, ticks in out)  # the loop ran while the GPU worked


@cuda
def test_cuda_sync_ranks_through_torch_distributed() -> None:
    def worker(comm: aiocoll.Comm) -> list[float]:
        s = torch.cuda.Stream(CUDA0)
        with torch.cuda.stream(s):
            t = torch.zeros(1 << 20, device=CUDA0)
            torch.cuda._sleep(SPIN)  # type: ignore[no-untyped-call]
            t.fill_(dist.get_rank() + 1.0)
            dist.all_reduce(t)  # returns once enqueued; s waits on the op (NCCL's semantics)
            out = t * 2  # on s: after the op
        s.synchronize()
        return out[[0, -1]].tolist()

    assert aiocoll.spawn(worker, world=3) == [[12.0, 12.0]] * 3


@cuda
def test_cuda_wait_orders_the_stream_without_a_host_sync() -> None:
    def worker(comm: aiocoll.Comm) -> tuple[bool, list[float]]:
        t = torch.zeros(1 << 20, device=CUDA0)
        torch.cuda._sleep(10 * SPIN)  # type: ignore[no-untyped-call]
        t.fill_(comm.rank + 1.0)
        w = comm.all_reduce(t)
        w.wait()
        early = not w.done()  # wait() returned while the GPU still spins
        # Every rank looks before any reads to the host: ranks take turns, so a rank that
        # synchronised first would keep the others from looking until the GPU were done.
        # (Found on a GPU: this test, written without one, read first.)
        comm.barrier().wait()
        out = (t + 0)[[0, -1]].tolist()  # on the current stream: ordered after the op
        return early, out

    out = aiocoll.spawn(worker, world=2)
    assert [v for _, v in out] == [[3.0, 3.0]] * 2
    assert all(early for early, _ in out)


@cuda
def test_cuda_and_host_ranks_mixed(loop: str) -> None:
    async def worker(comm: aiocoll.Comm) -> list[float]:
        dev = CUDA0 if comm.rank == 0 else CPU
        t = torch.full((4,), float(comm.rank + 1), device=dev)
        await comm.all_reduce(t)
        return t.cpu().tolist()

    assert aiocoll.spawn(worker, world=2, loop=loop) == [[3.0] * 4] * 2


@two_gpus
def test_ranks_on_two_gpus(loop: str) -> None:
    async def worker(comm: aiocoll.Comm) -> dict[str, list[float]]:
        r, w = comm.rank, comm.world_size
        dev = torch.device("cuda", r % 2)
        t = torch.full((3,), float(r + 1), device=dev)
        await comm.all_reduce(t)
        g = torch.zeros(w, device=dev)
        await comm.all_gather_into_tensor(g, torch.tensor([float(r)], device=dev))
        x = torch.arange(float(w), device=dev) + 10 * r
        await comm.reduce_scatter_tensor(x[r : r + 1], x)  # into a chunk of its own input
        return {"all_reduce": t.tolist(), "all_gather": g.tolist(), "reduce_scatter": x.tolist()}

    out = aiocoll.spawn(worker, world=4, loop=loop)
    for r, o in enumerate(out):
        assert o["all_reduce"] == [10.0] * 3
        assert o["all_gather"] == [0.0, 1.0, 2.0, 3.0]
        expect = [float(i + 10 * r) for i in range(4)]
        expect[r] = float(4 * r + 60)  # sum over ranks q of (r + 10 q)
        assert o["reduce_scatter"] == expect
