"""Runs every way into aiocoll, each once passing and once failing, then says what the registry has left.

Run by ``test_patches.py`` in an interpreter of its own: ``python _every_entry.py OUT [--leak]``.
It writes a JSON object to OUT: what each entry point gave (``outcomes``), the patch sets
still installed, and every attribute a patch set replaced that is not its original object
now. ``--leak`` leases one patch set and never gives it back, as a bug would: the check
must say so.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import tempfile
import textwrap
import unittest
from typing import Any

import torch
import torch.distributed as dist

import aiocoll
import aiocoll.testing
from aiocoll import _patches
from aiocoll._cli import _run

outcomes: dict[str, str] = {}


def outcome(name: str, fn: Any) -> None:
    try:
        fn()
    except BaseException as e:  # (SystemExit too: a failing entry point may exit)
        outcomes[name] = f"raised {type(e).__name__}"
    else:
        outcomes[name] = "returned"


def sync_rank(comm: aiocoll.Comm, fail: bool = False) -> float:
    t = torch.ones(1)
    dist.all_reduce(t)
    if fail and comm.rank == 1:
        raise ValueError("rank 1 fails")
    return t.item()


async def async_rank(comm: aiocoll.Comm, fail: bool = False) -> float:
    t = torch.ones(1)
    await comm.all_reduce(t)
    if fail and comm.rank == 0:
        raise ValueError("rank 0 fails")
    return t.item()


def spawn_entries() -> None:
    outcome("spawn sync", lambda: aiocoll.spawn(sync_rank, world=2, prefix_output=True))
    outcome("spawn sync, failing", lambda: aiocoll.spawn(lambda c: sync_rank(c, True), world=2))
    outcome("spawn async", lambda: aiocoll.spawn(async_rank, world=2))
    outcome("spawn async, failing", lambda: aiocoll.spawn(functools.partial(async_rank, fail=True), world=2))


def hybrid_entries() -> None:
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())  # type: ignore[attr-defined]
    try:
        group = dist.group.WORLD
        outcome("hybrid", lambda: aiocoll.spawn(async_rank, world=2, process_group=group, timeout=30))
        outcome(
            "hybrid, failing",
            lambda: aiocoll.spawn(functools.partial(async_rank, fail=True), world=2, process_group=group, timeout=30),
        )
    finally:
        dist.destroy_process_group()


def threaded_harness_entries() -> None:
    from torch.testing._internal.common_distributed import MultiThreadedTestCase

    class Case(MultiThreadedTestCase):
        @property
        def world_size(self) -> int:
            return 2

        def setUp(self) -> None:
            super().setUp()
            self._spawn_threads()  # type: ignore[no-untyped-call]

        def test_passes(self) -> None:
            sync_rank(None)  # type: ignore[arg-type]

        def test_fails(self) -> None:
            sync_rank(None)  # type: ignore[arg-type]
            raise ValueError(f"rank {dist.get_rank()} fails")

    with aiocoll.testing.replace_threaded_pg(), open(os.devnull, "w") as quiet:
        for name in ("test_passes", "test_fails"):
            result = unittest.TextTestRunner(stream=quiet, verbosity=0).run(Case(name))
            outcomes[f"threaded harness {name}"] = "passed" if result.wasSuccessful() else "failed"


def process_harness_entries() -> None:
    from torch.testing._internal.common_distributed import MultiProcessTestCase

    class Case(MultiProcessTestCase):
        @property
        def world_size(self) -> int:
            return 2

        def setUp(self) -> None:
            super().setUp()
            self._spawn_processes()

        def _init(self) -> None:
            dist.init_process_group("gloo", rank=self.rank, world_size=2, init_method=f"file://{self.file_name}")

        def test_passes(self) -> None:
            self._init()
            sync_rank(None)  # type: ignore[arg-type]
            dist.destroy_process_group()

        def test_fails(self) -> None:
            self._init()
            sync_rank(None)  # type: ignore[arg-type]
            raise ValueError(f"rank {self.rank} fails")

    with aiocoll.testing.replace_process_harness(), open(os.devnull, "w") as quiet:
        for name in ("test_passes", "test_fails"):
            result = unittest.TextTestRunner(stream=quiet, verbosity=0).run(Case(name))
            outcomes[f"process harness {name}"] = "passed" if result.wasSuccessful() else "failed"


PLUGIN_TESTS = """
import pytest, torch, torch.distributed as dist

@pytest.mark.world(2)
def test_passes(comm):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2

@pytest.mark.world(2)
def test_fails(comm):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert comm.rank == 0
"""

SCRIPT = """
import sys
import torch, torch.distributed as dist, torch.multiprocessing as mp

def child(rank, size):
    dist.init_process_group("gloo", rank=rank, world_size=size, init_method="tcp://127.0.0.1:29555")
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.destroy_process_group()
    if "fail" in sys.argv and rank == 1:
        raise SystemExit(3)

dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
dist.destroy_process_group()
mp.spawn(child, args=(2,), nprocs=2)
"""


def plugin_and_run_entries(tmp: str) -> None:
    import pytest

    tests = os.path.join(tmp, "test_plugin_entry.py")
    with open(tests, "w") as f:
        f.write(textwrap.dedent(PLUGIN_TESTS))
    code = pytest.main(["-q", "-p", "no:cacheprovider", tests])
    outcomes["plugin"] = f"exit {int(code)}"

    script = os.path.join(tmp, "script.py")
    with open(script, "w") as f:
        f.write(textwrap.dedent(SCRIPT))
    outcomes["aiocoll run (mp.spawn inside)"] = f"exit {_run.main(['--nproc-per-node', '2', script])}"
    code = _run.main(["--nproc-per-node", "2", script, "fail"])
    outcomes["aiocoll run (mp.spawn inside), failing"] = f"exit {code}"


def left_behind() -> dict[str, Any]:
    """What the registry has left: sets still installed, and attributes that are not their originals."""
    not_original = []
    for owner, name, original in _patches.originals():
        own = getattr(owner, "__dict__", None)
        now = own.get(name) if own is not None else getattr(owner, name, None)
        if now is not original:
            not_original.append(f"{owner!r}.{name} is {now!r}")
    return {
        "installed": [f"{i.name} ({i.leases} lease(s))" for i in _patches.installed()],
        "not_original": not_original,
        "originals": len(_patches.originals()),
        "stdout": sys.stdout is sys.__stdout__ or type(sys.stdout).__name__,
    }


def main() -> None:
    out, leak = sys.argv[1], "--leak" in sys.argv[2:]
    saved_stdout = sys.stdout
    with tempfile.TemporaryDirectory() as tmp:
        spawn_entries()
        hybrid_entries()
        threaded_harness_entries()
        process_harness_entries()
        plugin_and_run_entries(tmp)
    if leak:
        _patches.acquire(aiocoll.testing.THREADED_HARNESS)  # a lease never given back: the check must see it
    result = left_behind()
    result["outcomes"] = outcomes
    result["stdout"] = sys.stdout is saved_stdout
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
