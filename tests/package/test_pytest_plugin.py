"""aiocoll.pytest_plugin: ``@pytest.mark.world(n)`` and the ``comm`` fixture, run through pytester.

Most sessions run in this process (fast); the ones that need a process of their own
(pytest-xdist's workers, pytest-timeout's signal and the threads it leaves behind) run
in a subprocess.
"""

from __future__ import annotations

import importlib.util
import textwrap

import pytest
import torch

import aiocoll

pytest_plugins = ["pytester"]

INI = """
[pytest]
addopts = --strict-markers -p no:cacheprovider
filterwarnings = error
asyncio_default_fixture_loop_scope = function
"""

HEADER = "import asyncio, threading, time\nimport pytest, torch, torch.distributed as dist, aiocoll\n\n"


@pytest.fixture(scope="module", autouse=True)
def _imports_before_inner_sessions() -> None:
    """Run a world of each kind once here: pytester drops the modules an in-process session imports."""

    async def arank(comm: aiocoll.Comm) -> None:
        await comm.barrier()

    def srank(comm: aiocoll.Comm) -> None:
        torch.distributed.barrier()

    aiocoll.spawn(arank, world=2)
    aiocoll.spawn(srank, world=2)


def _setup(pytester: pytest.Pytester, source: str, ini: str = INI) -> None:
    pytester.makeini(ini)
    pytester.makepyfile(test_it=HEADER + textwrap.dedent(source))


def test_sync_and_async_tests_run_once_per_rank(pytester: pytest.Pytester) -> None:
    _setup(
        pytester,
        """
        @pytest.fixture
        def seen():
            return []  # set up once, shared by the ranks

        @pytest.mark.world(4)
        async def test_async(comm, seen):
            assert asyncio.current_task().get_name() == f"aiocoll rank {comm.rank}"
            assert comm.world_size == 4
            seen.append(comm.rank)
            t = torch.tensor([float(comm.rank)])
            await comm.all_reduce(t)
            assert t.item() == 6.0
            assert sorted(seen) == [0, 1, 2, 3]

        @pytest.mark.world(4)
        def test_sync(comm, seen):
            assert threading.current_thread().name == f"aiocoll rank {comm.rank}"
            assert (dist.get_rank(), dist.get_world_size()) == (comm.rank, 4)
            seen.append(comm.rank)
            dist.barrier()
            assert sorted(seen) == [0, 1, 2, 3]

        @pytest.mark.world(3)
        @pytest.mark.parametrize("x", [1.0, 2.0])
        async def test_parametrized(comm, x):
            t = torch.tensor([x])
            await comm.all_reduce(t)
            assert t.item() == 3 * x

        @pytest.mark.world(n=2, timeout=None, loop="asyncio")
        async def test_keywords(comm):
            assert comm.world_size == 2

        @pytest.mark.world(2)
        class TestClass:
            def test_method(self, comm):
                assert dist.get_world_size() == 2

            async def test_coroutine_method(self, comm):
                await comm.barrier()

        def test_unmarked():
            pass
        """,
    )
    result = pytester.runpytest()
    result.assert_outcomes(passed=8)


def test_a_failing_rank_is_named_and_its_traceback_comes_first(pytester: pytest.Pytester) -> None:
    _setup(
        pytester,
        """
        @pytest.mark.world(4)
        def test_sync_fails(comm):
            if comm.rank == 2:
                raise ValueError("rank two is unhappy")
            dist.barrier()

        @pytest.mark.world(4)
        async def test_async_fails(comm):
            if comm.rank == 1:
                assert comm.rank == 0, "wrong rank"
            await comm.barrier()
        """,
    )
    result = pytester.runpytest()
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(
        [
            "*_ test_sync_fails _*",
            "rank 2 of 4 failed",
            "",
            "comm = <Comm rank=2/4 group='world'>",
            "",
            "    @pytest.mark.world(4)",
            "    def test_sync_fails(comm):",
            "        if comm.rank == 2:",
            '>           raise ValueError("rank two is unhappy")',
            "E           ValueError: rank two is unhappy",
            "E           aiocoll: raised on rank 2 of a world of 4",
            "E           aiocoll: ranks [0, 1, 3] were aborted because of it",
        ],
        consecutive=True,
    )
    result.stdout.fnmatch_lines(
        [
            "*_ test_async_fails _*",
            "rank 1 of 4 failed",
            "",
            "comm = <Comm rank=1/4 group='world'>",
            "*",
            '>           assert comm.rank == 0, "wrong rank"',
            "E           AssertionError: wrong rank",
            "E           assert 1 == 0",
            "*",
            "E           aiocoll: raised on rank 1 of a world of 4",
        ]
    )
    # the summary line still reads the exception, not the header
    result.stdout.fnmatch_lines(["FAILED test_it.py::test_sync_fails - ValueError: rank two is unhappy*"])


def test_mismatch_and_deadlock_end_at_the_test_line(pytester: pytest.Pytester) -> None:
    _setup(
        pytester,
        """
        @pytest.mark.world(4)
        async def test_mismatch(comm):
            t = torch.ones(2)
            if comm.rank == 3:
                await comm.broadcast(t, src=0)
            else:
                await comm.all_reduce(t)

        @pytest.mark.world(2)
        def test_sync_mismatch(comm):
            t = torch.ones(2)
            if comm.rank == 0:
                dist.all_reduce(t)
            else:
                dist.broadcast(t, src=0)

        @pytest.mark.world(2)
        async def test_deadlock(comm):
            if comm.rank == 0:
                await comm.barrier()
        """,
    )
    result = pytester.runpytest()
    result.assert_outcomes(failed=3)
    out = result.stdout.str()
    result.stdout.fnmatch_lines(
        [
            "*_ test_mismatch _*",
            "ranks 0, 1, 2, 3 of 4 failed with the same CollectiveMismatchError; the traceback of rank ?:",
            "*",
            ">           await comm.*(t*)",
            "E   *CollectiveMismatchError: ranks called different collectives as call #0 of group 'world':",
            "E     *rank 3: broadcast(float32*, src=0) at *test_it.py:*",
            "test_it.py:*: CollectiveMismatchError",
        ]
    )
    result.stdout.fnmatch_lines(
        [
            "*_ test_sync_mismatch _*",
            "ranks 0, 1 of 2 failed with the same CollectiveMismatchError; the traceback of rank ?:",
            "*",
            ">           dist.*(t*)",
            "E   *CollectiveMismatchError: *",
            "*",
            "test_it.py:*: CollectiveMismatchError",
        ]
    )
    result.stdout.fnmatch_lines(
        [
            "*_ test_deadlock _*",
            "rank 0 of 2 failed",
            "*",
            ">           await comm.barrier()",
            "E   *DeadlockError: deadlock: every live rank waits for a peer that will never arrive",
            "E     *rank 1: returned",
            "*",
            "test_it.py:*: DeadlockError",
        ]
    )
    # aiocoll's and torch's frames after the test's line are left out
    assert "_engine.py" not in out
    assert "distributed_c10d.py" not in out


def test_misuse_is_reported(pytester: pytest.Pytester) -> None:
    _setup(
        pytester,
        """
        def test_unmarked(comm):
            pass

        @pytest.fixture
        def rank_of(comm):
            return comm.rank

        @pytest.mark.world(2)
        def test_fixture_uses_comm(rank_of):
            pass

        @pytest.mark.world(0)
        def test_bad_size(comm):
            pass

        @pytest.mark.world(2, colour="red")
        def test_bad_keyword(comm):
            pass

        @pytest.mark.world(2)
        def test_returns(comm):
            return comm.rank or None
        """,
    )
    result = pytester.runpytest()
    result.assert_outcomes(errors=4, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*test_unmarked: the 'comm' fixture needs the test marked @pytest.mark.world(n)",
            "*RuntimeError: aiocoll: comm.rank used outside the test body: only the test function*",
            "*aiocoll: @pytest.mark.world: the world size must be a positive int, got 0",
            "*aiocoll: @pytest.mark.world takes (n=None, *, timeout=..., loop=...), got *colour*",
            "*PytestReturnNotNoneWarning: Test functions should return None, but *test_returns returned "
            "a value on ranks [[]1[]].",
        ],
        consecutive=False,
    )


CONFIGURED = """
@pytest.mark.world
async def test_default_world(comm):
    assert comm.world_size == {world}
    assert type(asyncio.get_running_loop()).__module__.startswith("{loop}")

@pytest.mark.world
def test_default_world_sync(comm):
    assert dist.get_world_size() == {world}

@pytest.mark.world(2, loop="asyncio")
async def test_marker_wins(comm):
    assert type(asyncio.get_running_loop()).__module__.startswith("asyncio")

@pytest.mark.world(2)
async def test_timeout(comm):
    if comm.rank == 1:
        await asyncio.sleep(30)
    await comm.barrier()

@pytest.mark.world(2, timeout=0.2)
async def test_marker_timeout(comm):
    if comm.rank == 1:
        await asyncio.sleep(30)
    await comm.barrier()
"""


def _expect_configured(result: pytest.RunResult, timeout: str) -> None:
    result.assert_outcomes(passed=3, failed=2)
    result.stdout.fnmatch_lines([f"E * barrier #0 on group 'world' timed out after {timeout}s: *"])
    result.stdout.fnmatch_lines(["E * barrier #0 on group 'world' timed out after 0.2s: *"])


def test_defaults(pytester: pytest.Pytester) -> None:
    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    _setup(pytester, CONFIGURED.format(world=4, loop=loop))
    result = pytester.runpytest("-k", "default or marker_wins")
    result.assert_outcomes(passed=3)
    result = pytester.runpytest("--markers")
    result.stdout.fnmatch_lines(["@pytest.mark.world(n=None, *, timeout=None, loop=None): run the test on n ranks*"])


def test_options_from_the_command_line(pytester: pytest.Pytester) -> None:
    _setup(pytester, CONFIGURED.format(world=3, loop="asyncio"))
    result = pytester.runpytest("--aiocoll-world=3", "--aiocoll-timeout=0.3", "--aiocoll-loop=asyncio")
    _expect_configured(result, "0.3")


def test_options_from_the_ini_file_and_flags_override_them(pytester: pytest.Pytester) -> None:
    ini = INI + "aiocoll_world = 3\naiocoll_timeout = 0.3\naiocoll_loop = asyncio\n"
    _setup(pytester, CONFIGURED.format(world=3, loop="asyncio"), ini)
    _expect_configured(pytester.runpytest(), "0.3")
    _expect_configured(pytester.runpytest("--aiocoll-timeout=0.4"), "0.4")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--aiocoll-world=0"], "aiocoll: --aiocoll-world: the world size must be a positive int, got '0'"),
        (["--aiocoll-timeout=soon"], "aiocoll: --aiocoll-timeout: the timeout must be a positive number *"),
        (["-o", "aiocoll_loop=trio"], "aiocoll: ini setting aiocoll_loop: the loop must be one of auto, asyncio, *"),
    ],
)
def test_bad_options_stop_the_session(pytester: pytest.Pytester, args: list[str], message: str) -> None:
    _setup(pytester, "def test_nothing():\n    pass\n")
    result = pytester.runpytest(*args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: {message}"])


@pytest.mark.parametrize("mode", ["strict", "auto"])
def test_with_pytest_asyncio(pytester: pytest.Pytester, mode: str) -> None:
    pytest.importorskip("pytest_asyncio")
    asyncio_mark = "@pytest.mark.asyncio" if mode == "strict" else ""
    _setup(
        pytester,
        f"""
        {asyncio_mark}
        async def test_spawn_async_in_pytest_asyncio_loop():
            async def worker(comm):
                t = torch.ones(1)
                await comm.all_reduce(t)
                return t.item()

            assert await aiocoll.spawn_async(worker, world=4) == [4.0] * 4

        @pytest.mark.world(4)
        async def test_world_is_not_run_by_pytest_asyncio(comm):
            # spawn's tasks on spawn's loop: pytest-asyncio would run one coroutine on its own
            assert asyncio.current_task().get_name() == f"aiocoll rank {{comm.rank}}"
            await comm.barrier()

        @pytest.mark.asyncio
        @pytest.mark.world(2)
        async def test_marked_both_ways(comm):
            assert asyncio.current_task().get_name() == f"aiocoll rank {{comm.rank}}"
            await comm.barrier()

        @pytest.mark.world(2)
        async def test_failure_still_reported(comm):
            assert comm.rank == 0
        """,
        INI + f"asyncio_mode = {mode}\n",
    )
    result = pytester.runpytest()
    result.assert_outcomes(passed=3, failed=1)
    result.stdout.fnmatch_lines(["*_ test_failure_still_reported _*", "rank 1 of 2 failed"])


XDIST = """
@pytest.mark.world(4)
async def test_async(comm):
    await comm.barrier()

@pytest.mark.world(2)
def test_sync(comm):
    dist.barrier()

@pytest.mark.world(3)
def test_fails(comm):
    assert comm.rank != 1
    dist.barrier()

@pytest.mark.parametrize("i", range(4))
@pytest.mark.world(2)
async def test_many(comm, i):
    await comm.barrier()
"""


def test_with_pytest_xdist(pytester: pytest.Pytester) -> None:
    pytest.importorskip("xdist")
    _setup(pytester, XDIST)
    result = pytester.runpytest_subprocess("-n", "2")
    result.assert_outcomes(passed=6, failed=1)
    # the header survives the trip from the worker
    result.stdout.fnmatch_lines(["*_ test_fails _*", "[[]gw?[]] *", "rank 1 of 3 failed"], consecutive=True)


TIMEOUT = """
@pytest.mark.world(2)
async def test_peer_sleeps(comm):
    if comm.rank == 1:
        await asyncio.sleep(60)
    await comm.barrier()

@pytest.mark.world(2)
async def test_rank_blocks_the_loop(comm):
    if comm.rank == 1:
        time.sleep(60)
    await comm.barrier()

@pytest.mark.world(2)
def test_thread_rank_stuck(comm):
    if comm.rank == 1:
        time.sleep(60)
    dist.barrier()

@pytest.mark.world(2, timeout=None)
def test_thread_rank_slow(comm):
    if comm.rank == 1:
        time.sleep(1.3)
    dist.barrier()

@pytest.mark.world(2, timeout=None)
async def test_rank_awaits_forever(comm):
    if comm.rank == 1:
        await asyncio.Event().wait()
    await comm.barrier()

def test_session_goes_on():
    pass
"""


def test_with_pytest_timeout(pytester: pytest.Pytester) -> None:
    pytest.importorskip("pytest_timeout")
    _setup(pytester, TIMEOUT)
    result = pytester.runpytest_subprocess("--timeout=1")
    result.assert_outcomes(passed=1, failed=5)
    # aiocoll's collective timeout (half of pytest-timeout's) comes first, with its report
    result.stdout.fnmatch_lines(
        [
            "*_ test_peer_sleeps _*",
            "rank 0 of 2 failed",
            "*",
            ">       await comm.barrier()",
            "E       *CollectiveTimeoutError: barrier #0 on group 'world' timed out after 0.5s: *",
            "E         rank 1: not arrived (running)",
        ]
    )
    # pytest-timeout's signal reaches the rank that blocks the loop
    result.stdout.fnmatch_lines(
        [
            "*_ test_rank_blocks_the_loop _*",
            "rank 1 of 2 failed",
            "*",
            ">           time.sleep(60)",
            "E           Failed: Timeout (>1.0s) from pytest-timeout.",
            "E           aiocoll: raised on rank 1 of a world of 2",
        ]
    )
    # with no collective timeout, the signal comes while the loop is idle (uvloop too)
    result.stdout.fnmatch_lines(
        [
            "*_ test_rank_awaits_forever _*",
            "rank 1 of 2 was running when the test was interrupted",
            "*",
            ">           await asyncio.Event().wait()",
            "*",
            "E           Failed: Timeout (>1.0s) from pytest-timeout.",
            "E           aiocoll: the test was interrupted while rank 1 of 2 was running *; every rank was cancelled",
        ]
    )
    # a thread cannot be interrupted: the test is reported where that rank is, and left behind
    result.stdout.fnmatch_lines(
        [
            "*_ test_thread_rank_stuck _*",
            "rank 1 of 2 was running when the test was interrupted",
            "*",
            ">           time.sleep(60)",
            "E           Failed: Timeout (>1.0s) from pytest-timeout.",
            "E           aiocoll: the test was interrupted while rank 1 of 2 was still running *; a thread cannot "
            "be stopped, so it was left running",
        ]
    )
    # a rank that was only slow is blamed too, where it was when the signal came
    result.stdout.fnmatch_lines(
        [
            "*_ test_thread_rank_slow _*",
            "rank 1 of 2 was running when the test was interrupted",
            "*",
            ">           time.sleep(1.3)",
            "E           Failed: Timeout (>1.0s) from pytest-timeout.",
            "E           aiocoll: the test was interrupted while rank 1 of 2 was running *; every rank has ended since",
        ]
    )


TRACED = """
@pytest.mark.world(2)
async def test_passes(comm):
    await comm.barrier()

@pytest.mark.world(2)
async def test_fails(comm):
    if comm.rank == 1:
        await comm.broadcast(torch.ones(1), src=0)
    else:
        await comm.all_reduce(torch.ones(1))
"""


def test_traces_of_failing_tests_only(pytester: pytest.Pytester) -> None:
    _setup(pytester, TRACED)
    result = pytester.runpytest("--aiocoll-trace=traces")
    result.assert_outcomes(passed=1, failed=1)
    files = sorted(p.name for p in (pytester.path / "traces").iterdir())
    assert files == ["test_it.py_test_fails.json"]
    result.stdout.fnmatch_lines(["*aiocoll trace*", "written to *test_it.py_test_fails.json"])
    # the report of the failure carries the flight recorder's table
    result.stdout.fnmatch_lines(["*aiocoll: flight recorder*", "*world #0*all_reduce SUM f32[[]1[]] MISMATCH*"])


def test_traces_always_and_recorder_off(pytester: pytest.Pytester) -> None:
    _setup(pytester, TRACED, INI + "aiocoll_trace = out\naiocoll_trace_always = true\naiocoll_record = 0\n")
    result = pytester.runpytest()
    result.assert_outcomes(passed=1, failed=1)
    assert sorted(p.name for p in (pytester.path / "out").iterdir()) == [
        "test_it.py_test_fails.json",
        "test_it.py_test_passes.json",
    ]
    # record=0 turns the recorder off, but a trace still records everything
    result.stdout.fnmatch_lines(["*aiocoll: flight recorder*"])
    result = pytester.runpytest("--aiocoll-record=0", "-p", "no:cacheprovider", "-o", "aiocoll_trace=")
    result.assert_outcomes(passed=1, failed=1)
    assert "aiocoll: flight recorder" not in result.stdout.str()
    result = pytester.runpytest("--aiocoll-record=-1")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
