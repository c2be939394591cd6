"""``aiocoll run``: a torchrun script with every rank in this process, as aiocoll sync ranks.

``python -m aiocoll run --nproc-per-node 4 train.py --lr 0.1`` runs ``train.py`` as torchrun
would start it four times: each rank runs the script as its own ``__main__`` (its own module
globals), reads torchrun's environment in ``os.environ`` (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ... every variable torchrun's agent sets), and its
``init_process_group`` (any backend name, any init method) makes an aiocoll group. The ranks
take turns on one thread at a time (sync ranks: per-rank random generators and environment),
and a mismatch, a deadlock or a rank that left is reported at once.

Scripts that start their own ranks (``torch.multiprocessing.spawn``, PyTorch's DDP tutorial)
run with ``aiocoll run script.py``: the ranks they spawn are aiocoll ranks (``_mpspawn``).
``--nnodes`` above 1 and options that only make sense with several processes are refused
with the reason.
"""

from __future__ import annotations

import argparse
import builtins
import contextlib
import os
import runpy
import signal
import sys
import sysconfig
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from types import CodeType

from . import _harness, _mpspawn, _torch
from ._config import DEFAULT_TIMEOUT

__all__ = ["main", "parser", "worker_env"]

# files that are not the user's: aiocoll's, the standard library's and installed packages' (torch's)
_NOT_USERS = (
    os.path.dirname(os.path.abspath(__file__)) + os.sep,
    *sorted({os.path.join(sysconfig.get_paths()[k], "") for k in ("stdlib", "platstdlib", "purelib", "platlib")}),
    "<frozen ",
)

# seconds ranks get to wind down after ^C or SIGTERM before the run ends without them (threads
# cannot be stopped: a rank busy in its own code is left behind, and ends with the process)
_WIND_DOWN = 0.5

# A run has no test's timeout: its deadline only keeps a rank stuck in C code from hanging for ever.
_NO_DEADLINE = 7 * 24 * 3600.0


def parser() -> argparse.ArgumentParser:
    """torchrun's command line (its options under both spellings), plus aiocoll's own."""
    p = argparse.ArgumentParser(
        prog="aiocoll run",
        description=(
            "Run a torchrun script with every rank in this process, as aiocoll sync ranks: "
            "mismatched collectives, deadlocks and ranks that leave are reported at once."
        ),
        epilog="Example: aiocoll run --nproc-per-node 4 train.py --epochs 1",
    )

    def opt(*names: str, **kw: object) -> None:
        spelled = [*names, *("--" + n[2:].replace("-", "_") for n in names if n.startswith("--") and "-" in n[2:])]
        p.add_argument(*spelled, **kw)  # type: ignore[arg-type]

    opt("--nproc-per-node", dest="nproc_per_node", default="1", help="ranks to run (torchrun's: an int; default 1)")
    opt("--nnodes", default="1", help="only 1 (or 1:1): every rank runs in this process")
    opt("--node-rank", dest="node_rank", type=int, default=0, help="only 0")
    opt("--standalone", action="store_true", help="accepted (a run is always standalone)")
    opt("--master-addr", dest="master_addr", default="127.0.0.1", help="MASTER_ADDR the ranks read")
    opt("--master-port", dest="master_port", type=int, default=29500, help="MASTER_PORT the ranks read")
    opt("--rdzv-backend", dest="rdzv_backend", default="static", help="accepted; no rendezvous is needed")
    opt("--rdzv-endpoint", dest="rdzv_endpoint", default="", help="accepted; no rendezvous is needed")
    opt("--rdzv-id", dest="rdzv_id", default="none", help="TORCHELASTIC_RUN_ID the ranks read")
    opt("--rdzv-conf", dest="rdzv_conf", default="", help="accepted; no rendezvous is needed")
    opt("--max-restarts", dest="max_restarts", type=int, default=0, help="run the world again up to N times")
    opt("--role", default="default", help="ROLE_NAME the ranks read")
    opt("--run-path", dest="run_path", action="store_true", help="accepted: the script is run by its path")
    opt("-m", "--module", action="store_true", help="the script is a module: run it as 'python -m' would")
    opt("--no-python", dest="no_python", action="store_true", help="refused: a rank runs Python code")
    opt("--timeout", type=float, default=DEFAULT_TIMEOUT, help="aiocoll: seconds a rank may wait in one collective")
    p.add_argument("script", help="the script (or, with -m, the module) each rank runs")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")
    return p


def worker_env(rank: int, size: int, args: argparse.Namespace, restart: int = 0) -> dict[str, str]:
    """The variables torchrun's agent sets for worker ``rank`` of ``size`` (one node, one group)."""
    env = {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "GROUP_RANK": "0",
        "ROLE_RANK": str(rank),
        "ROLE_NAME": args.role,
        "LOCAL_WORLD_SIZE": str(size),
        "WORLD_SIZE": str(size),
        "GROUP_WORLD_SIZE": "1",
        "ROLE_WORLD_SIZE": str(size),
        "MASTER_ADDR": args.master_addr,
        "MASTER_PORT": str(args.master_port),
        "TORCHELASTIC_RESTART_COUNT": str(restart),
        "TORCHELASTIC_MAX_RESTARTS": str(args.max_restarts),
        "TORCHELASTIC_RUN_ID": args.rdzv_id,
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
    }
    if size > 1 and "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = "1"  # as torchrun does (it prints a warning about it)
    return env


class _Refused(Exception):
    """An option this run cannot honour in one process."""


class _Signalled(BaseException):
    """SIGTERM reached the run (SIGINT arrives as ``KeyboardInterrupt``)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _raise_signalled(signum: int, frame: object) -> None:
    raise _Signalled(signum)


@contextlib.contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """SIGTERM interrupts the run as ^C does (torchrun's agent treats both alike)."""
    if threading.current_thread() is not threading.main_thread():
        yield  # (only the main thread may install handlers: main() called from a thread)
        return
    saved = signal.signal(signal.SIGTERM, _raise_signalled)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, saved)


def _size(args: argparse.Namespace) -> int:
    if args.nnodes not in ("1", "1:1"):
        raise _Refused(
            f"--nnodes {args.nnodes}: every rank of 'aiocoll run' runs in this process; for several nodes use "
            "torchrun with aiocoll.from_process_group, or a hybrid world (spawn(..., process_group=...))"
        )
    if args.node_rank != 0:
        raise _Refused(f"--node-rank {args.node_rank}: a run has one node, rank 0")
    if args.no_python:
        raise _Refused("--no-python: each rank runs Python code in this process")
    try:
        n = int(args.nproc_per_node)
    except ValueError:
        raise _Refused(f"--nproc-per-node {args.nproc_per_node!r}: give the number of ranks (an int)") from None
    if n < 1:
        raise _Refused(f"--nproc-per-node {n}: at least one rank")
    if args.max_restarts < 0:
        raise _Refused(f"--max-restarts {args.max_restarts}: a count, 0 or more")
    return n


def _rank_main(args: argparse.Namespace, code: CodeType | None, size: int, restart: int) -> Callable[[int], None]:
    """What each rank runs: the script's ``code`` (None: the module ``args.script``)."""
    script = args.script

    def rank_main(rank: int) -> None:
        os.environ.update(worker_env(rank, size, args, restart))  # this rank's view (see _procstate)
        try:
            if code is not None:
                # a module namespace of its own, as `python script.py` gives each process;
                # sys.modules["__main__"] stays the process's (ranks would swap it under each other)
                namespace = {"__name__": "__main__", "__file__": script, "__builtins__": builtins}
                namespace.update(__spec__=None, __loader__=None, __package__=None, __cached__=None)
                exec(code, namespace)
            else:
                runpy.run_module(script, run_name="__main__", alter_sys=False)
        except SystemExit as e:
            if e.code not in (0, None):
                raise  # the rank's exit code: a failure, as in torchrun
            # exit(0): this rank is done, as its process would be

    return rank_main


def main(argv: Sequence[str] | None = None, *, exit_when_interrupted: bool = False) -> int:
    """``aiocoll run [options] script [args]``: the exit code (0, or 1 if a rank failed, as torchrun's).

    ``exit_when_interrupted`` (the command line's): after ^C or SIGTERM the process ends at
    once, as torchrun's workers do when it stops them, without the interpreter's clean-up
    (about 0.8 s with torch loaded) and without waiting for ranks left running.
    """
    args = parser().parse_args(argv)
    try:
        size = _size(args)
    except _Refused as e:
        print(f"aiocoll run: {e}", file=sys.stderr)
        return 2
    if not args.module and not os.path.isfile(args.script):
        print(f"aiocoll run: can't open file {args.script!r}: no such file", file=sys.stderr)
        return 2  # as python's own
    script_dir = os.path.dirname(os.path.abspath(args.script)) if not args.module else os.getcwd()
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [args.script, *args.script_args]
    sys.path.insert(0, script_dir)  # as `python script.py` and `python -m` put it first
    try:
        script_code = None
        if not args.module:
            with open(args.script, "rb") as f:  # (read once: every rank and restart runs the same code)
                script_code = compile(f.read(), args.script, "exec")
    except SyntaxError as e:
        traceback.print_exception(type(e), e, None, file=sys.stderr)  # as python reports it
        return 1
    try:
        with _sigterm_interrupts(), _mpspawn.spawned_ranks(args.timeout, _NO_DEADLINE) as spawned:
            for restart in range(args.max_restarts + 1):
                code = _run_once(args, _rank_main(args, script_code, size, restart), size, spawned)
                if code is None:  # interrupted: no restart; 1 as torchrun's
                    if exit_when_interrupted:
                        sys.stdout.flush()
                        sys.stderr.flush()
                        os._exit(1)
                    return 1
                if code == 0 or restart == args.max_restarts:
                    return code
                print(f"aiocoll run: restarting the world ({restart + 1} of {args.max_restarts})", file=sys.stderr)
        return 1  # (not reached)
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path


def _run_once(
    args: argparse.Namespace, rank_main: Callable[[int], None], size: int, spawned: _mpspawn.Starter
) -> int | None:
    """One run of the world: its exit code, or None if a signal interrupted it."""
    world = _harness.InProcessWorld(size, args.timeout, _NO_DEADLINE, f"aiocoll run {args.script}")
    world.grace = _WIND_DOWN
    started = time.time()
    _torch.prepare_for_rank_threads()
    with _torch.process_harness.patched_init(_harness.group_backend, _harness.rendezvous):
        try:
            end = world.run(rank_main)
        except (KeyboardInterrupt, _Signalled) as e:
            signum = e.signum if isinstance(e, _Signalled) else signal.SIGINT
            _report_interrupted(signal.Signals(signum), world.interrupted_at, size)
            for inner in spawned.running():  # the ranks the script started with torch.multiprocessing
                with contextlib.suppress(Exception):
                    print(f"  {inner.name}:", file=sys.stderr)
                    _report_places(inner.places(), inner.size, "    ")
                inner.grace = _WIND_DOWN
                inner.end()
            return None
    if end.needs_process is not None:
        print(
            f"aiocoll run: {args.script} needs processes of its own ({end.needs_process}); run it under torchrun",
            file=sys.stderr,
        )
        return 1
    if end.error is None:
        return 0
    _report(end.error, size, started)
    return 1


def _report(error: BaseException, size: int, started: float) -> None:
    """The first failure, as torchrun's summary puts it (root cause first), with aiocoll's notes."""
    code = error.code if isinstance(error, SystemExit) and isinstance(error.code, int) else 1
    print("=" * 60, file=sys.stderr)
    print(f"aiocoll run: FAILED (a world of {size} ranks, after {time.time() - started:.1f} s)", file=sys.stderr)
    print(f"Root Cause (first observed failure): exitcode {code}", file=sys.stderr)
    tb = _harness.from_rank_code(error.__traceback__)  # from the script's frame in, as a process's starts
    with contextlib.suppress(Exception):
        traceback.print_exception(type(error), error, tb or error.__traceback__, file=sys.stderr)
    print("=" * 60, file=sys.stderr)


def _users(filename: str) -> bool:
    """Whether ``filename`` is the user's code: not aiocoll's, the standard library's or a package's."""
    return not filename.startswith(_NOT_USERS)


def _report_interrupted(sig: signal.Signals, places: dict[int, _harness.RankPlace], size: int) -> None:
    """Where each rank was when the signal came: file:line in the user's code, and what it was doing."""
    print(f"aiocoll run: got signal {sig.name}: the run ends (exit code 1, as torchrun's)", file=sys.stderr)
    _report_places(places, size, "  ")


def _report_places(places: dict[int, _harness.RankPlace], size: int, indent: str) -> None:
    for rank in range(size):
        place = places.get(rank)
        if place is None:
            print(f"{indent}rank {rank}: not running (done, or not started)", file=sys.stderr)
            continue
        frame = place.in_code(_users)
        at = f"{frame.filename}:{frame.lineno} in {frame.name}" if frame is not None else "outside the script"
        line = f": {frame.line.strip()}" if frame is not None and frame.line else ""
        print(f"{indent}rank {rank}: {place.state} at {at}{line}", file=sys.stderr)
