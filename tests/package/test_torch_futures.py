"""The futures aiocoll hands to torch fail in C++ when their work fails; ranks that exit; crashes are not silent.

torch's ``Future.set_exception`` is Python-only: the future *succeeds* in C++, with the
exception as its value, and DDP's reducer reading tensors out of it crashed the process
(issue "never a crash"). A C++ consumer is modelled here by ``torch.futures.collect_all``,
which is C++ and fails only when a future failed in C++ (with ``set_exception`` it
returned the failed future as a success). The consumers themselves (DDP, FSDP2, ...) run
in ``tests/conformance/test_fault_campaign.py``, each in a process of its own.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch
import torch.distributed as dist

import aiocoll
from aiocoll import Comm, DeadlockError, RankExitedError, WorldAbortedError
from aiocoll._bridge._pg import PGWork
from aiocoll._ops import Barrier
from aiocoll._work import SentToTorch, TorchFutures


def _fails_in_cpp(fut: torch.futures.Future[Any]) -> str:
    """The text of the error a C++ consumer of ``fut`` sees (fails the test if it sees a success)."""
    combined = torch.futures.collect_all([fut])  # C++: it fails only on a C++ error
    with pytest.raises(RuntimeError) as raised:
        combined.wait()
    return str(raised.value)


# -- TorchFutures and SentToTorch, without a world --------------------------------------------


def test_a_settled_future_carries_its_value() -> None:
    futs = TorchFutures()
    before = futs.add([torch.ones(1)])
    futs.settle(None)
    after = futs.add("later")  # handed out once settled: completed at once
    assert before.wait()[0].item() == 1.0
    assert after.wait() == "later"
    assert torch.futures.collect_all([before]).wait()[0].value()[0].item() == 1.0


def test_a_failed_future_fails_in_cpp_with_the_error_s_type_and_message() -> None:
    futs = TorchFutures()
    before = futs.add([torch.ones(1)])
    err = KeyError("lost")
    futs.settle(err)
    after = futs.add(None)
    for fut in (before, after):
        assert "KeyError: 'lost'" in _fails_in_cpp(fut)
        with pytest.raises(RuntimeError, match="Got the following error when running the callback: KeyError: 'lost'"):
            fut.wait()
    assert err.__traceback__ is None  # raising it for torch left the error as its rank sees it
    futs.settle(None)  # settled once: a later outcome changes nothing
    with pytest.raises(RuntimeError, match="KeyError"):
        after.wait()


@pytest.mark.parametrize("ending", [asyncio.CancelledError(), SystemExit(3), KeyboardInterrupt()])
def test_a_work_ended_by_a_cancel_or_an_exit_still_fails_its_futures(ending: BaseException) -> None:
    # only an Exception can fail a torch future: these become WorldAbortedError, caused by them
    futs = TorchFutures()
    fut = futs.add(None)
    futs.settle(ending)
    text = _fails_in_cpp(fut)
    assert "WorldAbortedError" in text
    assert ("cancelled" if isinstance(ending, asyncio.CancelledError) else type(ending).__name__) in text


def test_sent_to_torch_finds_an_error_in_torch_s_wrapper_of_it() -> None:
    sent = SentToTorch()
    short, long = ValueError("rank 1 failed"), ValueError("rank 1 failed with KeyError")
    sent.add(short)
    sent.add(long)
    futs = TorchFutures()
    fut = futs.add(None)
    futs.settle(long)
    with pytest.raises(RuntimeError) as raised:
        fut.wait()
    assert sent.find(raised.value) is long  # the longest text it holds, not a prefix of it
    assert sent.find(RuntimeError("rank 1 failed with KeyError")) is None  # not torch's wrapper
    assert sent.find(RuntimeError("Got the following error when running the callback: other")) is None


def test_a_process_group_work_s_future_fails_in_cpp() -> None:
    loop = asyncio.new_event_loop()
    try:
        fut: asyncio.Future[object] = loop.create_future()
        w = PGWork(fut, Barrier(), 1, "0", ("train.py", 7))
        tf = w.torch_future("value")
        fut.set_exception(aiocoll.CollectiveTimeoutError("too slow"))
        loop.run_until_complete(asyncio.sleep(0))  # the done-callback runs on the loop
        assert "CollectiveTimeoutError: too slow" in _fails_in_cpp(tf)

        cancelled: asyncio.Future[object] = loop.create_future()
        w2 = PGWork(cancelled, Barrier(), 1, "0", ("train.py", 8))
        tf2 = w2.torch_future(None)
        cancelled.cancel()
        loop.run_until_complete(asyncio.sleep(0))
        assert "barrier() on group '0' at train.py:8 was cancelled" in _fails_in_cpp(tf2)
    finally:
        loop.close()


# -- engine works ------------------------------------------------------------------------------


def test_sync_ranks_futures_fail_in_cpp_when_the_world_aborts() -> None:
    def fn(comm: Comm) -> None:
        if dist.get_rank() == 1:
            raise KeyError("rank 1 leaves")
        w = dist.all_reduce(torch.ones(1), async_op=True)
        assert w is not None
        fut = w.get_future()  # (while ranks take turns, it waits for the work first)
        with pytest.raises(RuntimeError, match="WorldAbortedError: rank 1 failed with KeyError") as seen:
            torch.futures.collect_all([fut]).wait()  # C++, as DDP's reducer reads it
        raise seen.value  # as backward() raises it: torch's wrapper of aiocoll's error

    with pytest.raises(KeyError) as raised:
        aiocoll.spawn(fn, world=2)
    notes = "\n".join(raised.value.__notes__)
    assert "raised on rank 1 of a world of 2" in notes
    assert "ranks [0] were aborted because of it" in notes  # torch's wrapper, seen through


def test_coalesced_works_futures_fail_in_cpp() -> None:
    def fn(comm: Comm) -> list[str]:
        texts = []
        with dist._coalescing_manager(async_ops=True) as cm:
            dist.all_reduce(torch.ones(1))
            if dist.get_rank() == 0:
                dist.all_reduce(torch.ones(2))
            else:
                dist.broadcast(torch.ones(2), src=0)  # the mismatch, in the second of the two
        for w in cm.works:
            try:
                torch.futures.collect_all([w.get_future()]).wait()
                texts.append("ok")
            except RuntimeError as e:
                texts.append(str(e))
        return texts

    with pytest.raises(aiocoll.CollectiveMismatchError):
        aiocoll.spawn(fn, world=2, sync_ranks="parallel")


def test_a_cancelled_async_rank_s_future_completes(loop: str) -> None:
    async def fn(comm: Comm) -> object:
        if comm.rank == 0:
            w = comm.all_reduce(torch.ones(1))  # rank 1 never joins
            tf = w.torch_future(None)
            task = asyncio.ensure_future(_await(w))
            await asyncio.sleep(0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            # the world aborts (a cancelled wait cannot complete): its torch future failed in C++
            combined = torch.futures.collect_all([tf])
            assert combined.done()
            with pytest.raises(RuntimeError, match="cancelled while waiting in all_reduce"):
                combined.wait()
            late = w.torch_future(None)  # asked for after the cancel: failed at once
            with pytest.raises(RuntimeError, match="WorldAbortedError"):
                late.wait()
            return "checked"
        await asyncio.sleep(3600)  # the abort cancels it

    with pytest.raises(WorldAbortedError, match="rank 0 was cancelled while waiting in all_reduce"):
        aiocoll.spawn(fn, world=2, loop=loop)


async def _await(w: aiocoll.Work) -> object:
    return await w


def test_a_torch_future_asked_for_after_a_failure_fails_in_cpp(loop: str) -> None:
    async def fn(comm: Comm) -> str:
        t = torch.ones(1)
        w = comm.broadcast(t, src=0) if comm.rank == 1 else comm.all_reduce(t)
        with pytest.raises(aiocoll.CollectiveMismatchError):
            await w
        return _fails_in_cpp(w.torch_future([t]))

    for text in aiocoll.spawn(fn, world=2, loop=loop):  # (each rank caught its mismatch)
        assert "CollectiveMismatchError: ranks called different collectives" in text


# -- a rank's sys.exit -----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_rank_s_non_zero_exit_fails_the_world_naming_the_rank_and_code(kind: str) -> None:
    def exits(comm: Comm) -> None:
        dist.barrier()
        if comm.rank == 2:
            sys.exit(3)
        dist.barrier()

    async def exits_async(comm: Comm) -> None:
        await comm.barrier()
        if comm.rank == 2:
            sys.exit("bad input")  # a message: exit code 1, as a process's
        await comm.barrier()

    with pytest.raises(RankExitedError) as raised:
        aiocoll.spawn(exits if kind == "sync" else exits_async, world=3)
    e = raised.value
    code = 3 if kind == "sync" else 1
    assert (e.rank, e.exit_code) == (2, code)
    assert isinstance(e.__cause__, SystemExit)
    assert str(e).startswith(f"rank 2 exited with code {code} (sys.exit(")
    notes = "\n".join(e.__notes__)
    assert "raised on rank 2 of a world of 3" in notes
    assert "ranks [0, 1] were aborted because of it" in notes


@pytest.mark.parametrize("kind", ["sync", "async"])
@pytest.mark.parametrize("code", [0, None])
def test_a_rank_s_zero_exit_is_an_early_return(kind: str, code: int | None) -> None:
    def fn(comm: Comm) -> str:
        if comm.rank == 1:
            sys.exit(code)
        return "done"

    async def fn_async(comm: Comm) -> str:
        return fn(comm)

    assert aiocoll.spawn(fn if kind == "sync" else fn_async, world=2) == ["done", None]


def test_a_rank_that_exits_zero_while_others_wait_for_it_is_a_departed_rank() -> None:
    def fn(comm: Comm) -> None:
        if dist.get_rank() == 1:
            sys.exit(0)
        dist.barrier()

    with pytest.raises(DeadlockError, match=r"rank 1: returned"):
        aiocoll.spawn(fn, world=2)


# -- a crash in C code ---------------------------------------------------------------------------


def _python(code: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``python -c code`` as a user runs it: faulthandler off unless aiocoll turns it on."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONFAULTHANDLER"}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout, env=env
    )


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_crash_in_c_code_prints_each_rank_s_stack_under_its_name(kind: str) -> None:
    rank_fn = (
        """
        def fn(comm):
            dist.barrier()
            if comm.rank == 1:
                ctypes.string_at(0)  # a segfault
            dist.barrier()
        """
        if kind == "sync"
        else """
        async def fn(comm):
            await comm.barrier()
            if comm.rank == 1:
                ctypes.string_at(0)
            await comm.barrier()
        """
    )
    proc = _python(
        "import ctypes, faulthandler, aiocoll, torch.distributed as dist\n"
        + textwrap.dedent(rank_fn)
        + "assert not faulthandler.is_enabled()\naiocoll.spawn(fn, world=3)\n"
    )
    assert proc.returncode < 0 or proc.returncode >= 128, proc.stderr  # it did crash: a signal
    err = proc.stderr
    assert "Fatal Python error: Segmentation fault" in err, err
    crashed = err.split("Current thread", 1)[1].split("\n\n", 1)[0]
    assert "in string_at" in crashed
    assert "in aiocoll rank 1" in crashed, err
    if kind == "sync":  # every rank's thread, under its name
        for r in (0, 2):
            assert f"in aiocoll rank {r}\n" in err, err


def test_what_reports_a_crash_is_undone_when_the_last_world_ends() -> None:
    proc = _python(
        """
        import faulthandler, aiocoll

        async def inner(comm):
            return faulthandler.is_enabled()

        def outer(comm):
            # a world inside a world: the inner one's end leaves it on for the outer
            return aiocoll.spawn(inner, world=2) + [faulthandler.is_enabled()]

        print(aiocoll.spawn(outer, world=1, torch_distributed=False), faulthandler.is_enabled())
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[[True, True, True]] False"


def test_a_crash_report_that_is_on_already_is_left_alone() -> None:
    # in a process of its own: whether pytest turned faulthandler on depends on how it runs
    # (off in a pytest-xdist worker), and the test must not turn it off for the rest
    proc = _python(
        """
        import faulthandler, aiocoll

        faulthandler.enable()  # the user's own

        async def fn(comm):
            return faulthandler.is_enabled()

        print(aiocoll.spawn(fn, world=2), faulthandler.is_enabled())
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[True, True] True"
