"""``torch.multiprocessing.spawn`` inside ``aiocoll run``: the processes a script starts become aiocoll ranks.

PyTorch's DDP tutorial starts its ranks itself::

    def main(rank, world_size):
        os.environ["MASTER_ADDR"] = "localhost"; os.environ["MASTER_PORT"] = "12355"
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        ...

    if __name__ == "__main__":
        mp.spawn(main, args=(4,), nprocs=4, join=True)

Under ``aiocoll run script.py`` the call starts a world of ``nprocs`` sync ranks instead of
processes: rank ``i`` runs ``fn(i, *args)`` with the caller's environment (as a child process
inherits it), and the call ends as torch's does — ``None`` when every rank returned, or
``ProcessRaisedException`` / ``ProcessExitedException`` naming the first rank that failed, with
its traceback (and aiocoll's report of a mismatch or a deadlock, which processes would not
give). ``start_processes`` too; ``join=False`` returns a context whose ``join()`` waits.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import traceback
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessExitedException, ProcessRaisedException

from .. import _patches
from .._lifecycle import _outcome, _procworld
from .._process import _procstate
from .._process._locals import Seeds
from . import _rankmain, _runlogs

if TYPE_CHECKING:
    from ._mpprocess import ProcessBatch

__all__ = ["SpawnedContext", "Starter", "spawned_ranks"]


class SpawnedContext:
    """What ``mp.spawn(..., join=False)`` returns here: ``join()`` as torch's ``ProcessContext``'s."""

    def __init__(
        self,
        world: _procworld.InProcessWorld,
        failures: list[tuple[int, BaseException]],
        daemon: bool = False,
    ) -> None:
        self.daemon = daemon  # as torch's: at exit, daemon processes are stopped, the others waited for
        self.world = world
        self._failures = failures
        self._joined = False

    @property
    def joined(self) -> bool:
        """Whether ``join()`` has seen the ranks end (and ended their world)."""
        return self._joined

    def pids(self) -> list[int]:
        """Every rank's "process" is this one."""
        return [os.getpid()] * self.world.size

    def join(self, timeout: float | None = None, grace_period: float | None = None) -> bool:
        """Whether every rank has ended (``timeout``: seconds to wait; None, until then).

        Raises as torch's does when a rank failed: ``ProcessRaisedException`` for an
        exception, ``ProcessExitedException`` for a non-zero ``sys.exit``; and
        ``NeedsProcess`` when a rank did what only a process can (the run then starts
        again in processes, where these ranks are processes).
        """
        if self._joined:
            return True
        if not self.world.wait(timeout):
            return False
        end = self.world.end()
        self._joined = True
        if end.needs_process is not None:  # (the run was told as the rank met it: Starter.needs_processes)
            raise end.needs_process
        _raise_first_failure(self._failures, end.error, os.getpid())
        return True

    def wait(self) -> None:
        """Wait for every rank to end (the world stays, for ``join``)."""
        self.world.wait(None)

    def abandon(self, grace: float | None = None) -> None:
        """End the world without waiting for its ranks (those that do not end in ``grace`` seconds are left behind).

        ``grace``: None, the world's own (``_procworld.GRACE``).
        """
        if not self._joined:
            self._joined = True
            self.world.end(grace=grace)

    def __repr__(self) -> str:
        return f"<SpawnedContext ranks={self.world.size} {'joined' if self._joined else 'running'}>"


def _raise_first_failure(failures: list[tuple[int, BaseException]], error: BaseException | None, pid: int) -> None:
    """torch's exception for the first rank that failed on its own (not because another did)."""
    if not failures and error is None:
        return
    rank, e = failures[0] if failures else (getattr(error, "rank", 0) or 0, error)
    assert e is not None
    if isinstance(e, SystemExit):
        code = e.code if isinstance(e.code, int) else 1
        raise ProcessExitedException(f"process {rank:d} terminated with exit code {code:d}", rank, pid, code)
    tb = _procworld.from_rank_code(e.__traceback__) or e.__traceback__  # (as the child's traceback starts)
    text = "".join(traceback.format_exception(type(e), e, tb))
    msg = f"\n\n-- Process {rank:d} terminated with the following error:\n{text}"
    raise ProcessRaisedException(msg, rank, pid)


class Starter:
    """Starts the worlds that ``spawn``/``start_processes`` calls ask for, with the run's settings."""

    def __init__(self, timeout: float | None, deadline: float, seeds: Seeds | None = None) -> None:
        self.timeout = timeout
        self.deadline = deadline
        self.seeds = Seeds.fresh() if seeds is None else seeds  # each call's ranks: seeds of their own
        # every call's (and every batch of multiprocessing.Process ranks'), for a report of where its ranks were
        self.contexts: list[SpawnedContext | ProcessBatch] = []
        self.needs: _procstate.NeedsProcess | None = None  # the first refusal a rank of theirs met
        self.stopped = threading.Event()  # set then: the run stops, to start again in processes

    def needs_processes(self, refusal: _procstate.NeedsProcess) -> None:
        """A rank started here did what only a process can: the run stops (``stopped``), to start in processes."""
        self.needs = self.needs or refusal
        self.stopped.set()

    def finish(self) -> None:
        """The ranks never joined, as at their parent process's exit.

        multiprocessing's exit waits for non-daemon children; daemon ones are stopped.
        After a refusal none is waited for: the run starts again in processes.
        """
        for context in list(self.contexts):
            if not context.joined:
                if not context.daemon and self.needs is None:
                    context.wait()
                context.abandon()

    def running(self) -> list[SpawnedContext | ProcessBatch]:
        """The calls whose ranks have not all ended yet (and have started)."""
        return [c for c in self.contexts if not c.joined and c.world is not None and not c.world.ended]

    def start_processes(
        self,
        fn: Callable[..., object],
        args: tuple[object, ...] = (),
        nprocs: int = 1,
        join: bool = True,
        daemon: bool = False,
        start_method: str = "spawn",
    ) -> SpawnedContext | None:
        if not isinstance(nprocs, int) or isinstance(nprocs, bool) or nprocs < 1:
            raise ValueError(f"torch.multiprocessing.spawn: nprocs must be a positive int, got {nprocs!r}")
        if not callable(fn):
            raise TypeError(f"torch.multiprocessing.spawn: fn must be callable, got {type(fn).__name__}")
        failures: list[tuple[int, BaseException]] = []
        name = getattr(fn, "__qualname__", repr(fn))
        writes_as = _runlogs.OUTPUT_RANK.get()  # a child process writes to its parent's streams
        parents_main = _rankmain.carried()  # and its __main__ is its parent's script

        def rank_main(rank: int) -> None:
            _runlogs.OUTPUT_RANK.set(writes_as)
            try:
                with parents_main():
                    fn(rank, *args)
            except KeyboardInterrupt:
                pass  # as torch's child does
            except _procstate.NeedsProcess as e:
                self.needs_processes(e)  # (a parent that joins later, or never: the run stops)
                raise
            except BaseException as e:
                if isinstance(e, SystemExit) and e.code in (0, None):
                    return  # exit(0): this rank is done, as its process would be
                if not _outcome.echoes_abort(e):
                    failures.append((rank, e))
                raise

        world = _procworld.InProcessWorld(
            nprocs,
            self.timeout,
            self.deadline,
            f"torch.multiprocessing.spawn({name})",
            seeds=self.seeds.then(f"mp.spawn {len(self.contexts)}"),  # (fresh processes, told apart)
        )
        world.start(rank_main)
        context = SpawnedContext(world, failures, daemon)
        self.contexts.append(context)
        if not join:
            return context
        try:
            context.join()
        except BaseException:
            context.abandon()  # (an interrupted join: take the ranks down; nothing to do once joined)
            raise
        return None

    spawn = start_processes  # (torch's two take the same arguments; spawn calls start_processes)


_starters: list[Starter] = []  # the runs under way (aiocoll run's), innermost last


def _spawner(name: str) -> Callable[..., SpawnedContext | None]:
    real = getattr(mp, name)

    @functools.wraps(real)
    def start(*args: Any, **kwargs: Any) -> SpawnedContext | None:
        if not _starters:  # (installed, but the run that leased it ended in another thread)
            result: SpawnedContext | None = real(*args, **kwargs)
            return result
        starter = _starters[-1]
        return starter.spawn(*args, **kwargs) if name == "spawn" else starter.start_processes(*args, **kwargs)

    return start


MP_SPAWN = _patches.PatchSet(
    "torch.multiprocessing.spawn",
    "torch.multiprocessing.spawn and start_processes start aiocoll ranks in this process (aiocoll run)",
    # (torch.multiprocessing's public names, though its stubs do not re-export them)
    lambda key: [_patches.Attr(mp, name, _spawner(name)) for name in ("spawn", "start_processes")],
    ["torch.multiprocessing.spawn", "torch.multiprocessing.start_processes"],
)


@contextlib.contextmanager
def spawned_ranks(timeout: float | None, deadline: float, seeds: Seeds | None = None) -> Iterator[Starter]:
    """While the block runs, ``torch.multiprocessing.spawn`` and ``start_processes`` start aiocoll ranks.

    ``seeds``: those of the run, from which each call's ranks get theirs (None: fresh).
    """
    starter = Starter(timeout, deadline, seeds)
    _starters.append(starter)
    try:
        with _patches.lease(MP_SPAWN):
            yield starter
    finally:
        _starters.remove(starter)
        starter.finish()
