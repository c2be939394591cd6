"""torch's test harnesses (``torch.testing._internal``): what ``aiocoll.testing``
replaces in the threaded one and hooks in the multi-process one (torch 2.10-2.15)."""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from .._patches import Attr
from . import _c10dstate
from ._compat import _broken, _c10d, _need

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store
    from torch.testing._internal.common_distributed import MultiProcContinuousTest, MultiProcessTestCase
    from torch.testing._internal.distributed.multi_threaded_pg import ProcessLocalGroup, ThreadLocalWorld

__all__ = ["process_harness", "threaded_harness"]


# -- torch's threaded test harness (torch.testing._internal) -------------------------


def _per_thread(name: str, kind: type) -> property:
    """A ThreadLocalWorld property: a ``kind()`` kept on the calling thread's world data."""

    def get(self: ThreadLocalWorld) -> object:
        world = self._get_world()
        if not hasattr(world, name):
            setattr(world, name, kind())
        return getattr(world, name)

    return property(get)


class threaded_harness:
    """What ``aiocoll.testing`` replaces in torch's threaded test harness (all releases)."""

    MODULE = "torch.testing._internal.common_distributed"
    PLUGIN_KEY = "THREADED"  # backend "threaded"'s key in torch's plugin table
    PLUGINS = "torch.distributed.Backend._plugins"  # (how the table is named in reports)

    @staticmethod
    def process_local_group() -> type[ProcessLocalGroup]:
        """torch's threaded ProcessGroup class (importing it registers backend "threaded")."""
        from torch.testing._internal.distributed.multi_threaded_pg import ProcessLocalGroup

        return ProcessLocalGroup

    @staticmethod
    def mend_thread_local_world() -> list[Attr]:
        """The changes that give torch's ``ThreadLocalWorld`` the ``_World`` properties it lacks.

        torch 2.11 added ``_World.comms`` (read by ``destroy_process_group``) but not to
        the harness's thread-local stand-in: every harness test failed there with
        "'ThreadLocalWorld' object has no attribute 'comms'", with aiocoll or without.
        Each added property keeps a fresh container per thread, as torch 2.12 does.
        """
        from torch.testing._internal.distributed.multi_threaded_pg import ThreadLocalWorld

        world = _c10dstate._World  # (looked up at the call: the one check_c10d reads)
        fresh = world()
        added = []
        for name in dir(world):
            held = vars(fresh).get(f"_{name}")  # state a _World keeps on the instance (not derived)
            if held is None or hasattr(ThreadLocalWorld, name):
                continue
            if not isinstance(held, (list, dict, set)):
                raise _broken(f"torch.testing's ThreadLocalWorld having every property of _World ({name!r})")
            added.append(Attr(ThreadLocalWorld, name, _per_thread(name, type(held))))
        return added

    @staticmethod
    def plugins() -> dict[str, object]:
        """c10d's table of backend plugins (name -> creator)."""
        table: dict[str, object] = _need(dist.Backend, "_plugins", threaded_harness.PLUGINS)
        return table

    @staticmethod
    def plugin(creator: Callable[..., dist.ProcessGroup]) -> object:
        """A plugin entry for ``creator`` taking the extended API."""
        return _need(dist.Backend, "_BackendPlugin", "torch.distributed.Backend._BackendPlugin")(creator, True)


# -- torch's multi-process test harness (torch.testing._internal) ---------------------


class process_harness:
    """What ``aiocoll.testing`` hooks in torch's multi-process test harness (2.10-2.15).

    ``MultiProcessTestCase`` starts one process per rank in ``_start_processes(proc)``
    and waits for them in ``_join_processes(fn)``, which ends with
    ``_check_return_codes(fn, elapsed)``; each process runs ``cls._run(rank, test_name,
    file_name, pipe, **kwargs)``, which makes a new test object and calls ``run_test``:
    a ``unittest.SkipTest`` becomes ``sys.exit(TEST_SKIPS["generic"].exit_code)``, an
    exception is sent down the pipe and becomes ``sys.exit(TEST_ERROR_EXIT_CODE)``.
    ``MultiProcContinuousTest`` keeps its processes across a class's tests: its
    classmethod ``_spawn_processes(world_size)`` makes ``processes``, ``task_queues``
    and ``completion_queues``; each worker runs ``cls._worker_loop(rank, world_size,
    rdvz_file, task_queue, completion_queue)``, which takes test ids from its task
    queue until ``None`` and puts a result per test (the id, a ``SkipTest`` or an
    exception). These names are the same in every release tested.
    """

    MODULE = "torch.testing._internal.common_distributed"

    @staticmethod
    def module() -> ModuleType:
        import torch.testing._internal.common_distributed as common_distributed

        return common_distributed

    @staticmethod
    def test_case() -> type[MultiProcessTestCase]:
        """``MultiProcessTestCase``, checked for every hook ``aiocoll.testing`` relies on."""
        cls: type[MultiProcessTestCase] = _need(
            process_harness.module(), "MultiProcessTestCase", "MultiProcessTestCase"
        )
        for name in (
            "_start_processes",
            "_join_processes",
            "_check_return_codes",
            "_run",
            "run_test",
            "_current_test_name",
            "TEST_ERROR_EXIT_CODE",
        ):
            _need(cls, name, f"MultiProcessTestCase.{name}")
        return cls

    @staticmethod
    def continuous_test_case() -> type[MultiProcContinuousTest] | None:
        """``MultiProcContinuousTest``, if this torch has it (checked like ``test_case``), else None."""
        cls: type[MultiProcContinuousTest] | None = getattr(process_harness.module(), "MultiProcContinuousTest", None)
        if cls is not None:
            for name in ("_spawn_processes", "_worker_loop"):
                _need(cls, name, f"MultiProcContinuousTest.{name}")
        return cls

    @staticmethod
    def skips() -> dict[int, str]:
        """The exit codes torch's harness turns into skips, with their messages."""
        table = _need(process_harness.module(), "TEST_SKIPS", "common_distributed.TEST_SKIPS")
        return {int(s.exit_code): str(s.message) for s in table.values()}

    @staticmethod
    def generic_skip_code() -> int:
        """The exit code of a rank whose test raised ``unittest.SkipTest``."""
        return int(_need(process_harness.module(), "TEST_SKIPS", "common_distributed.TEST_SKIPS")["generic"].exit_code)

    @staticmethod
    def test_timeout(test_id: str) -> float:
        """Seconds torch's harness gives the test before it stops its processes."""
        return float(_need(process_harness.module(), "get_timeout", "common_distributed.get_timeout")(test_id))

    SUITE = "torch.testing._internal.distributed.distributed_test"

    @staticmethod
    def suite_barrier(
        sync: Callable[[Callable[[int | None, float], None], int | None, float], None],
    ) -> list[tuple[object, str, object]]:
        """``(owner, name, replacement)`` for the barrier of torch's own multi-process suite, if it is loaded.

        ``distributed_test.py`` (the tests ``test_distributed_spawn.py`` runs, shipped in
        the wheel) makes its ranks meet before and after each test in ``Barrier.sync(wait_for=None,
        timeout=10)``, a classmethod: each process counts its barriers in a class attribute
        and writes the count to a file named by its pid, which ranks of one process share.
        ``sync(real, wait_for, timeout)`` runs instead, ``real(wait_for, timeout)`` being
        torch's (for threads outside a harness rank). Nothing where the module is not loaded
        (the suite is not being run).
        """
        barrier = getattr(sys.modules.get(process_harness.SUITE), "Barrier", None)
        real = None if barrier is None else barrier.__dict__.get("sync")
        if not isinstance(real, classmethod):
            return []
        fn = real.__func__

        def patched(cls: type, wait_for: int | None = None, timeout: float = 10) -> None:
            sync(lambda w, t: fn(cls, w, t), wait_for, timeout)

        functools.update_wrapper(patched, fn)
        return [(barrier, "sync", classmethod(patched))]

    INIT_TARGETS = (
        "torch.distributed.distributed_c10d._new_process_group_helper",
        "torch.distributed.distributed_c10d.rendezvous",
    )

    @staticmethod
    def init_changes(
        group_backend: Callable[[object, int, list[int]], str | None],
        rendezvous: Callable[[str, int, int], tuple[Store, int, int] | None],
    ) -> list[Attr]:
        """The changes that steer torch.distributed's group creation and rendezvous (``INIT_TARGETS``).

        ``group_backend(backend, group_rank, global_ranks_in_group)``, for every group
        c10d makes (the default group, ``new_group``, DeviceMesh's): the backend to make
        it with instead, or None to leave it. The group still reports the backend it was
        asked for (``dist.get_backend``), as torch's code branches on it.
        ``rendezvous(init_method, rank, world_size)``: ``(store, rank, world_size)`` in
        place of torch's rendezvous for ``init_process_group(init_method=...)``, or None.
        Both are module globals of ``distributed_c10d`` looked up at each call (2.10-2.15).
        """
        saved_helper = _need(_c10d, "_new_process_group_helper", "distributed_c10d._new_process_group_helper")
        saved_rendezvous = _need(_c10d, "rendezvous", "distributed_c10d.rendezvous")
        backend_at = list(inspect.signature(saved_helper).parameters).index("backend")

        @functools.wraps(saved_helper)
        def helper(*args: Any, **kwargs: Any) -> Any:
            asked = kwargs["backend"] if "backend" in kwargs else args[backend_at]
            group_rank = kwargs.get("group_rank", args[1] if len(args) > 1 else -1)
            ranks = kwargs.get("global_ranks_in_group", args[2] if len(args) > 2 else [])
            use = group_backend(asked, group_rank, list(ranks))
            if use is None:
                return saved_helper(*args, **kwargs)
            if "backend" in kwargs:
                kwargs["backend"] = use
            else:
                args = (*args[:backend_at], use, *args[backend_at + 1 :])
            kwargs["backend_options"] = None  # gloo's or NCCL's options mean nothing to it
            pg, store = saved_helper(*args, **kwargs)
            world = _c10d._world
            if pg in world.pg_map:
                world.pg_map[pg] = (asked, world.pg_map[pg][1])
            report = getattr(pg, "report_backend", None)  # (pg.name(), as torch reads it)
            if report is not None:
                report(asked)
            return pg, store

        @functools.wraps(saved_rendezvous)
        def steered_rendezvous(
            url: str, rank: int = -1, world_size: int = -1, **kwargs: object
        ) -> Iterator[tuple[Store, int, int]]:
            found = rendezvous(url, rank, world_size)
            if found is None:
                torchs: Iterator[tuple[Store, int, int]] = saved_rendezvous(url, rank, world_size, **kwargs)
                return torchs
            return iter([found])

        return [Attr(_c10d, "_new_process_group_helper", helper), Attr(_c10d, "rendezvous", steered_rendezvous)]
