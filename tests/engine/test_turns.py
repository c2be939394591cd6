"""Sync ranks taking turns: each rank's own random generators, repeatable and seeded
interleavings, deadlocks reported at once, and what happens to code that makes ranks wait
for each other outside torch.distributed."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import aiocoll
from aiocoll import Comm
from aiocoll._engine._turns import SameCpu, TurnEvent, Turns

T = TypeVar("T")

pytestmark = pytest.mark.filterwarnings("ignore:FSDP2-wrapped module .* returned a view tensor:UserWarning")


def _seeded_model() -> nn.Sequential:
    torch.manual_seed(0)  # "seed, then build the model": the pattern of code written for torchrun
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))


def _train(model: nn.Module) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(3):
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_fsdp2_after_seeding_matches_one_process_every_time() -> None:
    reference = _train(_seeded_model())

    def fn(comm: Comm) -> list[float]:
        model = _seeded_model()
        fully_shard(model, mesh=init_device_mesh("cpu", (4,)))
        return _train(model)

    for _ in range(20):
        out = aiocoll.spawn(fn, world=4)
        for losses in out:
            assert losses == pytest.approx(reference, rel=1e-5, abs=1e-6)


def test_each_rank_has_its_own_generators() -> None:
    def fn(comm: Comm) -> tuple[list[float], list[float], float, float]:
        torch.manual_seed(comm.rank)
        random.seed(comm.rank)
        np.random.seed(comm.rank)
        a = torch.randn(3).tolist()
        dist.barrier()  # the other ranks draw meanwhile
        b = torch.rand(2).tolist()
        return a + b, [random.random(), random.random()], float(np.random.rand()), torch.initial_seed()

    out = aiocoll.spawn(fn, world=4)
    for r, (t, py, npy, seed) in enumerate(out):
        torch.manual_seed(r)
        assert t == torch.randn(3).tolist() + torch.rand(2).tolist()
        rr = random.Random(r)
        assert py == [rr.random(), rr.random()]
        assert npy == float(np.random.RandomState(r).rand())
        assert seed == r


def test_ranks_start_from_the_callers_states_and_leave_them_alone() -> None:
    torch.manual_seed(123)
    random.seed(5)
    expected = torch.randn(2).tolist()
    torch.manual_seed(123)

    def fn(comm: Comm) -> list[float]:
        random.random()  # each rank's own instance
        return torch.randn(2).tolist()

    assert aiocoll.spawn(fn, world=3) == [expected] * 3
    # the caller's generators are as it left them: not advanced by the ranks' draws
    assert torch.randn(2).tolist() == expected
    assert random.random() == random.Random(5).random()


def test_a_world_of_seeded_ranks_draws_as_each_rank_s_seed_says() -> None:
    """Worlds that stand for fresh processes give each rank a seed (``WorldConfig.rank_seeds``)."""
    from aiocoll._lifecycle._config import WorldConfig
    from aiocoll._lifecycle._driver import WorldRun
    from aiocoll._process._locals import Seeds, numpy_seed

    seeds = Seeds(42, "a world").of(3)
    assert len(set(seeds)) == 3
    torch.manual_seed(7)
    caller = torch.random.get_rng_state()

    def fn(comm: Comm) -> tuple[list[float], float, float, int]:
        a = torch.randn(2).tolist()
        dist.barrier()  # the other ranks draw meanwhile
        return a + torch.rand(1).tolist(), random.random(), float(np.random.rand()), torch.initial_seed()

    import asyncio

    out = asyncio.run(WorldRun(fn, WorldConfig(3, rank_seeds=seeds)).run())
    for seed, (t, py, npy, initial) in zip(seeds, out, strict=True):
        g = torch.Generator().manual_seed(seed)
        assert t == torch.randn(2, generator=g).tolist() + torch.rand(1, generator=g).tolist()
        assert py == random.Random(seed).random()
        assert npy == float(np.random.RandomState(numpy_seed(seed)).rand())
        assert initial == seed
    assert torch.equal(torch.random.get_rng_state(), caller)  # the caller's are its own again


def _tensors_made_in(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the threads that turn saved torch generator states into tensors, one per state."""
    from aiocoll._process._locals import _TorchStates

    real = _TorchStates._to_tensor
    threads: list[str] = []

    def to_tensor(self: _TorchStates, rank: int, gen: torch.Generator) -> None:
        threads.append(threading.current_thread().name)
        real(self, rank, gen)

    monkeypatch.setattr(_TorchStates, "_to_tensor", to_tensor)
    return threads


def _own_stream(comm: Comm, group: Any = None, rounds: int = 4) -> list[float]:
    """Draws from the rank's own seeded stream, with collectives (other ranks drawing) in between."""
    torch.manual_seed(10 + comm.rank)
    out = torch.randn(1).tolist()
    for _ in range(rounds):
        dist.barrier(group=group)
        out += torch.randn(1).tolist()
    return out


def _expected_stream(rank: int, rounds: int = 4) -> list[float]:
    torch.manual_seed(10 + rank)
    return [torch.randn(1).item() for _ in range(rounds + 1)]


def test_generator_states_become_tensors_in_one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    # every rank thread making tensors of the states pins memory in each (see _TorchStates)
    made_in = _tensors_made_in(monkeypatch)
    out = aiocoll.spawn(_own_stream, world=6)
    assert out == [_expected_stream(r) for r in range(6)]
    assert len(made_in) >= 6 * 3  # (a rank that completes a barrier goes on: no hand-over)
    assert set(made_in) == {"aiocoll rank 0"}  # the first rank to take a turn


def test_ranks_keep_their_generators_while_the_keeper_is_away(monkeypatch: pytest.MonkeyPatch) -> None:
    made_in = _tensors_made_in(monkeypatch)

    def fn(comm: Comm) -> list[float]:
        others = dist.new_group([1, 2, 3])
        t = torch.zeros(1)
        if comm.rank == 0:  # the keeper waits while the others hand over among themselves
            torch.manual_seed(10)
            first = torch.randn(1).tolist()
            dist.recv(t, src=3)
            return first + torch.randn(4).tolist()
        out = _own_stream(comm, others)
        if comm.rank == 3:
            dist.send(t, dst=0)
        return out

    out = aiocoll.spawn(fn, world=4)
    assert out == [_expected_stream(r) for r in range(4)]
    assert len(set(made_in)) > 1  # the others made their own meanwhile


def test_the_next_rank_keeps_the_states_once_the_keeper_has_ended(monkeypatch: pytest.MonkeyPatch) -> None:
    made_in = _tensors_made_in(monkeypatch)

    def fn(comm: Comm) -> list[float]:
        others = dist.new_group([1, 2, 3])
        if comm.rank == 0:
            return _expected_stream(0)
        return _own_stream(comm, others, rounds=8)

    out = aiocoll.spawn(fn, world=4)
    assert out[1:] == [_expected_stream(r, rounds=8) for r in range(1, 4)]
    assert len(set(made_in) - {"aiocoll rank 0"}) == 1


def test_generators_are_swapped_under_inference_mode() -> None:
    def fn(comm: Comm) -> list[float]:
        torch.manual_seed(10 + comm.rank)
        with torch.inference_mode():  # hands over inside it, and out of it below
            out = torch.randn(1).tolist()
            dist.barrier()
            out += torch.randn(1).tolist()
        dist.barrier()
        return out + torch.randn(3).tolist()

    for mode in (False, True):
        with torch.inference_mode(mode):
            assert aiocoll.spawn(fn, world=3) == [_expected_stream(r) for r in range(3)]


def test_parallel_ranks_share_the_generators() -> None:
    seen: list[bool] = []

    def fn(comm: Comm) -> int:
        # the module functions are Python's own unless a world takes turns
        seen.append(hasattr(random.random, "__wrapped__"))
        return 0

    aiocoll.spawn(fn, world=2, sync_ranks="parallel")
    assert seen == [False, False]
    aiocoll.spawn(fn, world=2)
    assert seen[2:] == [True, True]
    assert not hasattr(random.random, "__wrapped__")  # removed when the world ended


def test_each_rank_has_its_own_global_module_hooks() -> None:
    from torch.nn.modules import module as nn_module

    inherited: list[str] = []
    handle = nn.modules.module.register_module_forward_hook(lambda m, i, o: inherited.append(type(m).__name__))
    before = {name: getattr(nn_module, name) for name in ("_global_forward_hooks", "_global_forward_pre_hooks")}

    def rank(comm: Comm) -> list[str]:
        seen: list[str] = []
        nn.modules.module.register_module_forward_pre_hook(lambda m, i: seen.append(type(m).__name__))
        layer = nn.Linear(2, 2) if comm.rank == 0 else nn.Sequential(nn.ReLU())
        dist.barrier()  # every rank has registered its hook before any runs its module
        layer(torch.ones(2))
        dist.barrier()
        return seen

    try:
        seen = aiocoll.spawn(rank, world=3)
    finally:
        handle.remove()
    assert seen == [["Linear"], ["Sequential", "ReLU"], ["Sequential", "ReLU"]]  # each its own modules only
    assert sorted(inherited) == ["Linear", "ReLU", "ReLU", "Sequential", "Sequential"]  # as a forked process would
    after = {name: getattr(nn_module, name) for name in before}
    assert all(after[n] is before[n] for n in before)  # the caller's own dicts, back
    assert len(nn_module._global_forward_pre_hooks) == 0  # the ranks' hooks went with them


def test_each_rank_has_its_own_default_dtype() -> None:
    def rank(comm: Comm) -> list[str]:
        if comm.rank == 1:
            torch.set_default_dtype(torch.float64)  # as a test's setUp may, in one process
        seen = []
        for _ in range(3):
            dist.barrier()  # the turn goes round
            seen.append(str(torch.ones(1).dtype))
        return seen

    before = torch.get_default_dtype()
    assert aiocoll.spawn(rank, world=3) == [
        ["torch.float32"] * 3,
        ["torch.float64"] * 3,
        ["torch.float32"] * 3,
    ]
    assert torch.get_default_dtype() is before


def test_module_trackers_see_each_ranks_modules() -> None:
    from torch.distributed._tools.mod_tracker import ModTracker
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    class Mlp(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = nn.Linear(4, 8)
            self.down = nn.Linear(8, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.down(torch.relu(self.up(x)))

    def rank(comm: Comm) -> tuple[list[str], int, dict[str, int]]:
        mesh = init_device_mesh("cpu", (comm.world_size,))
        model = parallelize_module(Mlp(), mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
        entered: list[str] = []
        tracker = ModTracker()
        tracker.register_user_hooks(pre_fw_hook=lambda m, i: entered.append(type(m).__name__))
        mode = CommDebugMode()
        with tracker, mode:
            dist.barrier()  # every rank's trackers are on before any rank runs its model
            model(torch.ones(2, 4, requires_grad=True)).sum().backward()  # (inputs with grad: no warning)
        per_module = {
            fqn: sum(counts["forward"].values()) for fqn, counts in mode.comm_module_counts.items() if counts["forward"]
        }
        return entered, mode.get_total_counts(), per_module

    # as in a process of its own: each tracker sees its rank's three modules once; RowwiseParallel
    # reduces once forward (in Mlp.down), ColwiseParallel once backward
    expected = (["Mlp", "Linear", "Linear"], 2, {"Global": 1, "Mlp": 1, "Mlp.down": 1})
    assert aiocoll.spawn(rank, world=2) == [expected] * 2


def _interleaving(comm: Comm) -> list[int]:
    """The order in which the ranks got past each of three barriers, as seen by a shared list."""
    order.append(comm.rank)
    for _ in range(3):
        dist.barrier()
        order.append(comm.rank)
    return []


order: list[int] = []


def _run_order(**kw: Any) -> list[int]:
    order.clear()
    aiocoll.spawn(_interleaving, world=4, **kw)
    return list(order)


def test_turns_repeat_and_seeds_vary_them() -> None:
    plain = _run_order()
    # the rank that completes a barrier goes on; the others follow in rank order
    assert plain == [0, 1, 2, 3, 3, 0, 1, 2, 2, 0, 1, 3, 3, 0, 1, 2]
    assert all(_run_order() == plain for _ in range(5))
    seeded = {s: _run_order(schedule_seed=s) for s in range(8)}
    for s, o in seeded.items():
        assert _run_order(schedule_seed=s) == o  # the same seed replays the same interleaving
        assert sorted(o) == sorted(plain)
    assert len({tuple(o) for o in seeded.values()}) > 4  # and seeds differ


def test_find_failing_seed_finds_a_thread_race() -> None:
    shared: list[int] = []

    def racy(comm: Comm) -> None:
        if comm.rank == 0:
            shared.clear()
        dist.barrier()
        shared.append(comm.rank)
        dist.barrier()
        # assumes that the rank that arrived last (rank 2) gets past a barrier first
        assert shared[0] == 2, f"rank {shared[0]} came first"

    aiocoll.spawn(racy, world=3)  # holds in rank order
    found = aiocoll.find_failing_seed(racy, world=3, seeds=range(50))
    assert found is not None
    assert isinstance(found.error, AssertionError)
    for _ in range(3):
        with pytest.raises(AssertionError) as info:
            aiocoll.spawn(racy, world=3, schedule_seed=found.seed)
        assert str(info.value).splitlines()[0] == str(found.error).splitlines()[0]


def test_sync_deadlock_is_reported_at_once() -> None:
    def fn(comm: Comm) -> None:
        t = torch.zeros(1)
        dist.recv(t, src=1 - comm.rank)  # each waits for the other's send

    start = time.perf_counter()
    with pytest.raises(aiocoll.DeadlockError, match="every live rank waits") as info:
        aiocoll.spawn(fn, world=2, timeout=60)
    assert time.perf_counter() - start < 5
    text = str(info.value)
    assert "rank 0: blocked in recv" in text
    assert "rank 1: blocked in recv" in text


def test_a_rank_waiting_on_a_threading_barrier_does_not_hang_the_world() -> None:
    barrier = threading.Barrier(2, timeout=30)

    def fn(comm: Comm) -> int:
        barrier.wait()  # rank 0 waits here holding its turn until the stall watch lets rank 1 on
        t = torch.ones(1)
        dist.all_reduce(t)
        return int(t.item())

    with pytest.warns(RuntimeWarning, match=r"rank 0 waited in threading\.Barrier\.wait at .*test_turns\.py"):
        assert aiocoll.spawn(fn, world=2) == [2, 2]
    assert aiocoll.spawn(fn, world=2, sync_ranks="parallel") == [2, 2]


def test_an_abort_frees_ranks_from_a_rank_busy_with_the_turn() -> None:
    def fn(comm: Comm) -> None:
        if comm.rank == 0:
            raise ValueError("rank 0 broke")
        if comm.rank == 1:
            time.sleep(0.3)  # still busy, holding the turn, when rank 2 learns of the abort
            return
        dist.barrier()

    with pytest.raises(ValueError, match="rank 0 broke"):
        aiocoll.spawn(fn, world=3, timeout=60)


def test_get_future_waits_for_the_work_giving_the_turn_away() -> None:
    def fn(comm: Comm) -> float:
        t = torch.ones(1) * (comm.rank + 1)
        fut = dist.all_reduce(t, async_op=True).get_future()  # type: ignore[union-attr]
        return float(fut.wait()[0].item())  # a C++-style wait on the future itself

    assert aiocoll.spawn(fn, world=3) == [6.0, 6.0, 6.0]


def test_rank_threads_wake_the_loop_once_as_they_end() -> None:
    import asyncio

    wakes: list[object] = []

    class Loop(asyncio.SelectorEventLoop):
        def call_soon_threadsafe(self, callback: Any, *args: Any, **kwargs: Any) -> asyncio.Handle:
            wakes.append(callback)
            return super().call_soon_threadsafe(callback, *args, **kwargs)

    def fn(comm: Comm) -> int:
        dist.barrier()
        return comm.rank

    counts = []
    for world in (2, 16):
        wakes.clear()
        assert aiocoll.spawn(fn, world=world, loop=Loop) == list(range(world))
        counts.append(len(wakes))
    assert counts[0] == counts[1]  # not one per rank


def test_sync_ranks_is_checked() -> None:
    with pytest.raises(aiocoll.InvalidArgumentError, match="'sync_ranks' must be 'turns' or 'parallel'"):
        aiocoll.spawn(lambda comm: None, world=2, sync_ranks="threads")  # type: ignore[call-overload]


# -- the scheduler itself, without spawn ---------------------------------------------------


def _take_turns(turns: Turns, rank: Callable[[int], None], size: int) -> None:
    """Runs ``rank(r)`` for ranks 0 to ``size - 1``, a thread each, taking ``turns`` in rank order."""
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    turns.start(range(size))
    for t in threads:
        t.join(10)


def test_turns_hand_over_in_order_and_time_out() -> None:
    turned: list[int] = []
    turns = Turns(2, None, turned.append)
    events = [turns.event(r) for r in range(2)]
    log: list[str] = []

    def rank(r: int) -> None:
        turns.begin(r)
        log.append(f"{r} runs")
        if r == 0:
            assert not events[0].wait(0.05)  # timed out: rank 1 ran meanwhile, and rank 0 has the turn back
            log.append("0 timed out")
            events[1].set()
        else:
            events[1].wait()
            log.append("1 woke")
        turns.end(r)

    _take_turns(turns, rank, 2)
    assert log == ["0 runs", "1 runs", "0 timed out", "1 woke"]
    assert turned == [0, 1, 0, 1]
    assert turns.holder is None
    assert isinstance(events[0], TurnEvent)
    assert "rank=0" in repr(events[0])
    assert "holder=None" in repr(turns)


def test_a_rank_stepped_out_lets_the_others_run_then_takes_a_turn_again() -> None:
    # rank 0 waits in a call aiocoll cannot see into (a lock here, a store's C code in
    # life) for rank 1, which could not run if rank 0 kept the turn
    turned: list[int] = []
    turns = Turns(2, None, turned.append)
    released = threading.Lock()
    released.acquire()
    log: list[str] = []

    def rank(r: int) -> None:
        turns.begin(r)
        if r == 0:
            with turns.stepped_out(0):
                assert released.acquire(timeout=10)
            log.append(f"0 back, holder {turns.holder}")
        else:
            log.append("1 runs")
            released.release()
            time.sleep(0.05)  # still its turn: rank 0 must wait for it to end
            log.append("1 ends")
        turns.end(r)

    _take_turns(turns, rank, 2)
    assert log == ["1 runs", "1 ends", "0 back, holder 0"]
    assert turned == [0, 1, 0]
    assert turns.holder is None


def test_a_rank_stepped_out_of_an_aborted_world_comes_back_at_once() -> None:
    turns = Turns(1, None, lambda r: None)
    done = threading.Event()

    def rank(r: int) -> None:
        turns.begin(r)
        with turns.stepped_out(r):
            turns.free_all()  # (the world was aborted meanwhile)
        done.set()

    _take_turns(turns, rank, 1)
    assert done.is_set()


def test_a_failure_taking_a_turn_is_the_ranks_and_hangs_no_one(monkeypatch: pytest.MonkeyPatch) -> None:
    from aiocoll._process._locals import RankLocals

    real = RankLocals.switch

    def switch(self: RankLocals, rank: int) -> None:
        if rank == 1:
            raise OSError("no state for rank 1")
        real(self, rank)

    monkeypatch.setattr(RankLocals, "switch", switch)

    def fn(comm: Comm) -> None:
        dist.barrier()

    with pytest.raises(OSError, match="no state for rank 1") as info:
        aiocoll.spawn(fn, world=3, timeout=60)
    assert "aiocoll: raised on rank 1 of a world of 3" in info.value.__notes__


_affinity = pytest.mark.skipif(
    SameCpu.detect() is None, reason="needs per-thread CPU affinity (Linux) and at least two allowed CPUs"
)


def _woken_then_running(cpus: SameCpu, probe: Callable[[int], T]) -> dict[str, T]:
    """``probe(0)`` in a rank thread woken after ``cpus.pin`` ("woken"), then after its ``unpin`` ("running")."""
    seen: dict[str, T] = {}
    registered, pinned = threading.Event(), threading.Event()

    def rank() -> None:
        cpus.register(0)
        registered.set()
        pinned.wait(10)
        seen["woken"] = probe(0)
        cpus.unpin(0)
        seen["running"] = probe(0)

    th = threading.Thread(target=rank)
    th.start()
    assert registered.wait(10)
    cpus.pin(0)
    pinned.set()
    th.join(10)
    return seen


@_affinity
def test_a_hand_over_wakes_the_next_rank_on_this_cpu_and_then_frees_it() -> None:
    import os

    mask = os.sched_getaffinity(0)
    cpu = min(mask)
    cpus = SameCpu(1, lambda: cpu)
    seen = _woken_then_running(cpus, os.sched_getaffinity)
    assert seen == {"woken": {cpu}, "running": mask}
    assert cpus.on


@_affinity
def test_a_woken_rank_waits_for_the_waking_thread_to_sleep_then_gets_its_policy_back() -> None:
    import os

    cpu = min(os.sched_getaffinity(0))
    cpus = SameCpu(1, lambda: cpu, batch=True)
    # woken: SCHED_BATCH, so it does not preempt the waking thread
    seen = _woken_then_running(cpus, os.sched_getscheduler)
    assert seen == {"woken": os.SCHED_BATCH, "running": os.SCHED_OTHER}


@_affinity
def test_a_rank_still_pinned_from_its_start_is_not_pinned_again(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    cpus = SameCpu.detect(1)
    assert cpus is not None
    registered, go = threading.Event(), threading.Event()

    def rank() -> None:
        cpus.register(0)
        registered.set()
        go.wait(10)
        cpus.unpin(0)

    th = threading.Thread(target=rank)
    with cpus.starting():
        th.start()
    assert registered.wait(10)
    mask = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpus._start_cpu})  # back on the CPU it started on, as a rank handing over
    calls: list[object] = []
    real = os.sched_setaffinity
    monkeypatch.setattr(os, "sched_setaffinity", lambda *a: calls.append(a) or real(*a))
    try:
        cpus.pin(0)
    finally:
        real(0, mask)
    assert calls == []
    go.set()
    th.join(10)


@_affinity
def test_same_cpu_turns_itself_off_when_the_os_refuses() -> None:
    cpus = SameCpu(1, lambda: 1 << 20)  # a CPU that does not exist: sched_setaffinity fails
    cpus.register(0)  # (this thread stands for the rank)
    cpus.pin(0)
    assert not cpus.on
    cpus.pin(0)  # off: a no-op from now on
    assert repr(cpus) == "<SameCpu off ranks=1>"


@_affinity
def test_rank_threads_start_on_the_starting_threads_cpu_and_get_its_cpus_back() -> None:
    import os

    mask = os.sched_getaffinity(0)
    cpus = SameCpu.detect(1)
    assert cpus is not None
    seen: dict[str, set[int]] = {}
    policies: list[int] = []
    registered, go = threading.Event(), threading.Event()

    def rank() -> None:
        seen["started"] = os.sched_getaffinity(0)
        policies.append(os.sched_getscheduler(0))
        cpus.register(0)
        registered.set()
        go.wait(10)
        cpus.unpin(0)  # its first turn
        seen["running"] = os.sched_getaffinity(0)
        policies.append(os.sched_getscheduler(0))

    th = threading.Thread(target=rank)
    with cpus.starting():
        seen["starting"] = os.sched_getaffinity(0)
        th.start()
    assert os.sched_getaffinity(0) == mask  # the starting thread's CPUs, back at once
    assert registered.wait(10)  # (whether it registers before or after starting() ends)
    go.set()
    th.join(10)
    assert len(seen["starting"]) == 1
    assert seen["started"] == seen["starting"]
    assert seen["running"] == mask
    if cpus._batch:  # the caller runs under SCHED_OTHER: started under SCHED_BATCH, as if woken by a hand-over
        assert policies == [os.SCHED_BATCH, os.SCHED_OTHER]
    assert os.sched_getscheduler(0) == os.SCHED_OTHER


@_affinity
def test_sync_ranks_keep_their_cpus_across_hand_overs() -> None:
    import os

    def fn(comm: Comm) -> tuple[set[int], set[int], float, list[int]]:
        before = os.sched_getaffinity(0)
        policies = [os.sched_getscheduler(0)]
        t = torch.ones(1)
        for _ in range(20):
            dist.all_reduce(t.fill_(1.0))
            policies.append(os.sched_getscheduler(0))
        return before, os.sched_getaffinity(0), t.item(), sorted(set(policies))

    mask = os.sched_getaffinity(0)
    other = [os.SCHED_OTHER]
    assert aiocoll.spawn(fn, world=3) == [(mask, mask, 3.0, other)] * 3
    assert os.sched_getaffinity(0) == mask  # the thread that called spawn, too
    assert os.sched_getscheduler(0) == os.SCHED_OTHER


def test_a_thread_a_rank_starts_makes_collectives_but_waits_only_for_its_own() -> None:
    # it takes no turns: it waits on a latch of its own. A wait for the rank's own work would
    # hand the rank's turn around behind its back: refused before anything moves
    def fn(comm: Comm) -> tuple[bool, list[str], float, float]:
        t = torch.ones(1)
        pending = comm.all_reduce(t)  # (done at once on the rank that comes last; a wait then has nothing to do)
        was_pending = not pending.done()
        other = torch.full((1,), float(comm.rank))
        said: list[str] = []

        def helper() -> None:
            try:
                pending.wait()
            except aiocoll.BlockingCallError as e:
                said.append(str(e))
            comm.all_reduce(other).wait()

        thread = threading.Thread(target=helper, name="helper")
        thread.start()
        pending.wait()  # the rank's own thread may, and the collective completes
        thread.join()
        return was_pending, said, t.item(), other.item()

    results = aiocoll.spawn(fn, world=2)
    assert [r[0] for r in results] == [True, False]
    for rank, (was_pending, said, total, others) in enumerate(results):
        assert (total, others) == (2.0, 1.0)  # 1 + 1, and 0 + 1 made on the helpers
        assert len(said) == int(was_pending)
        if was_pending:
            assert said[0].startswith(f"rank {rank}: a wait for all_reduce(")
            assert "'helper'" in said[0]
