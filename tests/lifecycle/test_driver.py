"""The world driver and its configuration: keywords declared once, resources released on every path."""

from __future__ import annotations

import asyncio
import dataclasses
import typing
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

import aiocoll
from aiocoll import _patches
from aiocoll._c10d import _backend as _c10d
from aiocoll._lifecycle import _driver
from aiocoll._lifecycle._config import SpawnOptions, WorldConfig, WorldOptions
from aiocoll._lifecycle._driver import WorldRun


def test_every_keyword_is_a_field_of_the_config() -> None:
    # the keywords are declared once (WorldOptions); the config holds each of them, but
    # torch_distributed, which it holds as c10d
    fields = {f.name for f in dataclasses.fields(WorldConfig)}
    assert set(WorldOptions.__optional_keys__) - {"torch_distributed"} <= fields
    assert set(SpawnOptions.__optional_keys__) - set(WorldOptions.__optional_keys__) == {"loop"}
    assert typing.get_type_hints(WorldOptions)["timeout"] == float | None


@pytest.mark.parametrize("caller", ["spawn", "spawn_async"])
def test_an_unknown_keyword_is_a_type_error_with_a_hint(caller: str) -> None:
    async def fn(comm: aiocoll.Comm) -> None:
        pass

    async def main() -> None:
        await aiocoll.spawn_async(fn, 2, timout=5)  # type: ignore[call-arg]

    def call() -> None:
        if caller == "spawn":
            aiocoll.spawn(fn, 2, timout=5)  # type: ignore[call-overload]
        else:
            asyncio.run(main())

    with pytest.raises(
        TypeError, match=rf"^{caller}\(\) got an unexpected keyword argument 'timout'; did you mean 'timeout'\?$"
    ):
        call()
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'loop'$"):
        asyncio.run(aiocoll.spawn_async(fn, 2, loop="asyncio"))  # type: ignore[call-arg]


def test_the_config_is_frozen_and_its_repr_shows_what_differs() -> None:
    c = WorldConfig.of(4, {"timeout": None, "record": 0, "torch_distributed": False}, caller="spawn")
    assert repr(c) == "WorldConfig(size=4, timeout=None, c10d='off', record=0)"
    assert repr(WorldConfig(2)) == "WorldConfig(size=2)"
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.size = 5  # type: ignore[misc]
    with pytest.raises(aiocoll.InvalidArgumentError, match="argument 'c10d'"):
        WorldConfig(2, c10d="maybe")  # type: ignore[arg-type]
    with pytest.raises(aiocoll.InvalidArgumentError, match="argument 'faults' must be an iterable"):
        WorldConfig.of(2, {"faults": 3}, caller="spawn")  # type: ignore[typeddict-item]


def test_find_failing_seed_passes_the_other_keywords_on() -> None:
    seen: list[float | None] = []

    async def fn(comm: aiocoll.Comm) -> None:
        from aiocoll._engine._rank import current_rank_state

        st = current_rank_state()
        assert st is not None
        seen.append(st.world.timeout)

    assert aiocoll.find_failing_seed(fn, 2, seeds=range(3), timeout=7.0, torch_distributed=False) is None
    assert seen == [7.0] * 6


def _c10d_leases() -> int:
    return sum(i.leases for i in _patches.installed() if i.name == _c10d.PER_RANK_C10D.name)


@pytest.fixture
def c10d_installs() -> Iterator[list[int]]:
    before = _c10d_leases()
    counts: list[int] = []
    yield counts
    assert _c10d_leases() == before


def test_a_failure_while_entering_resources_undoes_the_ones_entered(
    monkeypatch: pytest.MonkeyPatch, c10d_installs: list[int]
) -> None:
    # torch.distributed's per-rank state is installed before the output prefixes: when
    # those fail, the world must not leave it installed (nor the loop's task factory set)
    def broken() -> typing.NoReturn:
        c10d_installs.append(_c10d_leases())
        raise OSError("no terminal")

    monkeypatch.setattr(_driver, "prefixed_output", broken)
    factories: list[object] = []

    def fn(comm: aiocoll.Comm) -> None:
        raise AssertionError("no rank may run")

    async def main() -> None:
        try:
            await aiocoll.spawn_async(fn, 2, prefix_output=True)
        finally:
            factories.append(asyncio.get_running_loop().get_task_factory())

    with pytest.raises(OSError, match="no terminal"):
        asyncio.run(main())
    assert c10d_installs
    assert c10d_installs[0] >= 1
    assert factories == [None]
    assert not dist.is_initialized()
    # and the next world runs as usual
    assert aiocoll.spawn(lambda comm: comm.rank, 2) == [0, 1]


def test_a_world_run_runs_once() -> None:
    async def fn(comm: aiocoll.Comm) -> int:
        t = torch.ones(1)
        await comm.all_reduce(t)
        return int(t.item())

    run = WorldRun(fn, WorldConfig(3, c10d="off"))
    assert repr(run).startswith("<WorldRun of ")
    assert "(async ranks), WorldConfig(size=3, c10d='off')>" in repr(run)
    assert asyncio.run(run.run()) == [3, 3, 3]
    with pytest.raises(RuntimeError, match="runs once"):
        asyncio.run(run.run())
    with pytest.raises(aiocoll.InvalidArgumentError, match="argument 'fn' must be callable"):
        WorldRun(3, WorldConfig(1))  # type: ignore[arg-type]


def _hosted(size: int) -> tuple[_driver.HostedRun, typing.Any]:
    from aiocoll._lifecycle._worldthread import WorldThread

    run = _driver.HostedRun(WorldConfig(size, c10d="off", sync_ranks="parallel", timeout=30))
    wt: WorldThread[list[object]] = WorldThread(run.run, "asyncio")
    wt.start()
    return run, wt


def test_a_hosted_world_gives_up_on_ranks_that_never_end_and_fails_their_waits() -> None:
    import threading

    from aiocoll._engine._engine_comm import EngineComm
    from aiocoll._engine._rank import rank_var

    run, wt = _hosted(2)
    w = run.world()
    assert all(st.live == 1 for st in w.ranks)  # every rank live before its thread joins
    errors: list[BaseException] = []

    def rank0() -> None:  # a thread the host starts: rank 1's never comes
        st = w.ranks[0]
        rank_var().set(st)
        st.runs_here()
        try:
            EngineComm(w, w.group, 0, threaded=True).all_reduce(torch.ones(1)).wait()
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=rank0)
    t.start()
    t.join(0.3)
    assert t.is_alive()  # waiting for rank 1
    run.give_up(lambda left: TimeoutError(f"ranks {left} were still running when the test ended"))
    t.join(5)
    assert not t.is_alive()
    assert wt.wait(5)
    assert wt.result() == [None, None]
    assert len(errors) == 1
    assert "ranks [0, 1] were still running when the test ended" in str(errors[0])
    assert run.outcome.failures == []  # giving up is the host's verdict, not a rank's failure


def test_a_hosted_world_reports_the_first_failure_and_ignores_a_second_end() -> None:
    run, wt = _hosted(2)
    run.ended(1, KeyError("boom"))
    run.ended(1, None)  # a failed rank then destroys its group: ignored
    run.ended(0, None)
    assert wt.wait(5)
    assert [rank for rank, _ in run.outcome.failures] == [1]
    assert run.world().aborted is not None  # the root cause aborted the world


def test_a_hosted_world_needs_parallel_ranks_and_no_torch_distributed() -> None:
    with pytest.raises(aiocoll.InvalidArgumentError, match="in parallel"):
        _driver.HostedRun(WorldConfig(2, c10d="off"))
