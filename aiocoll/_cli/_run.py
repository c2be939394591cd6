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
The command line is read and checked once, into a frozen ``RunSpec``: ``--nnodes`` above
1 and options that only make sense with several processes are refused there, with the
reason, before anything runs.
"""

from __future__ import annotations

import argparse
import builtins
import contextlib
import importlib.util
import os
import signal
import socket
import sys
import sysconfig
import threading
import time
import traceback
import types
import uuid
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from types import CodeType
from typing import Literal, NamedTuple, cast

import torch

from .. import _collector, _patches, _torch
from .._errors import RankExitedError
from .._lifecycle import _procworld
from .._lifecycle._config import DEFAULT_RECORD, DEFAULT_TIMEOUT, SyncRanks, WorldOptions
from .._paths import PACKAGE_DIR
from .._process import _procstate
from .._process._locals import Seeds
from . import _mpprocess, _mpspawn, _processes, _rankmain, _runlogs, _scriptread

__all__ = ["RunSpec", "main", "parser", "worker_env"]

Place = Literal["auto", "processes", "in-process"]

# the signals torchrun's agent handles by default (TORCHELASTIC_SIGNALS_TO_HANDLE)
_TORCHRUN_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"

# files that are not the user's: aiocoll's, the standard library's and installed packages' (torch's)
_NOT_USERS = (
    PACKAGE_DIR,
    *sorted({os.path.join(sysconfig.get_paths()[k], "") for k in ("stdlib", "platstdlib", "purelib", "platlib")}),
    "<frozen ",
)

# seconds ranks get to wind down after ^C or SIGTERM before the run ends without them (threads
# cannot be stopped: a rank busy in its own code is left behind, and ends with the process)
_WIND_DOWN = 0.5


# A run has no test's timeout: its deadline only keeps a rank stuck in C code from hanging for ever.
_NO_DEADLINE = 7 * 24 * 3600.0


def parser() -> argparse.ArgumentParser:
    """torchrun's own command line (this torch's: its options, spellings, defaults and help), plus aiocoll's."""
    from torch.distributed.run import get_args_parser  # (public; about 0.04 s to import, collector off)

    p = argparse.ArgumentParser(
        prog="aiocoll run",
        description=(
            "Run a torchrun script with every rank in this process, as aiocoll sync ranks: "
            "mismatched collectives, deadlocks and ranks that leave are reported at once. "
            "A script one process cannot serve runs in processes, one per rank, as under torchrun. "
            "torchrun's options are accepted under torchrun's spellings; those one process cannot honour "
            "(--nnodes above 1, --node-rank, --no-python, --virtual-local-rank, --logs-specs) "
            "are refused with the reason, and those about processes and "
            "rendezvous (--rdzv-*, --start-method, --monitor-interval, ...) are accepted and have nothing to do."
        ),
        epilog="Example: aiocoll run --nproc-per-node 4 train.py --epochs 1",
        parents=[get_args_parser()],
        conflict_handler="resolve",  # (both have -h)
    )
    # --master-port reads None unless given, torchrun's own default (29500 in 2.10's, None
    # later) kept aside: a run tells a port the user chose from torchrun's (_fixed_rendezvous)
    p.set_defaults(master_port=None, torchrun_master_port=p.get_default("master_port"))
    own = p.add_argument_group("aiocoll's own options")
    own.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, help="seconds a rank may wait in one collective")
    own.add_argument("--schedule-seed", type=int, default=None, help="run the ranks in a seeded random turn order")
    own.add_argument(
        "--seed",
        type=int,
        default=None,
        metavar="N",
        help="seed each rank's torch, random and NumPy generators from N (default: anew each run, as fresh "
        "processes are; a failed run says its N, to draw the same numbers again)",
    )
    own.add_argument("--trace", default=None, metavar="FILE", help="write a Chrome trace of every collective")
    own.add_argument(
        "--record", type=int, default=DEFAULT_RECORD, metavar="N", help="flight recorder: the last N ops of each rank"
    )
    where = own.add_mutually_exclusive_group()
    where.add_argument(
        "--processes",
        action="store_true",
        help="run each rank in a process of its own, as torchrun does (the default for a script one process "
        "cannot serve: os._exit, signal handlers, RPC, the profiler, ...)",
    )
    where.add_argument(
        "--in-process",
        action="store_true",
        help="run every rank in this process even if the script looks as if it needs processes (a call that "
        "does is then refused, with the reason)",
    )
    own.add_argument(
        "--no-checks",
        action="store_true",
        help="in processes, leave the groups the script makes as torch makes them (by default each collective "
        "is checked across processes first: mismatches and ranks gone are reported at once, with each rank's "
        "call and line)",
    )
    own.add_argument(
        "--sync-ranks",
        choices=["turns", "parallel"],
        default="turns",
        help="turns: one rank runs at a time (default); parallel: ranks run at once where their work frees the GIL",
    )
    return p


class _Rendezvous(NamedTuple):
    """What torchrun's agent would tell the workers about the rendezvous."""

    run_id: str
    master_addr: str
    master_port: int
    port_given: bool = True  # --master-port was given (else torchrun's default, or a free port)


@dataclass(frozen=True)
class RunSpec:
    """An ``aiocoll run`` command line, read and checked once: what the run does, in typed fields.

    >>> spec = RunSpec.of(parser().parse_args(["--nproc-per-node", "2", "--record", "64", "train.py", "--lr", "0.1"]))
    >>> spec
    <RunSpec train.py --lr 0.1: 2 ranks, timeout 300 s, 0 restarts>
    >>> spec.world_options["record"]
    64
    """

    script: str  # the script's path (or, with ``module``, a module's name)
    script_args: tuple[str, ...]
    module: bool  # -m: run ``script`` as ``python -m`` would
    size: int  # ranks, from --nproc-per-node
    max_restarts: int
    timeout: float  # seconds a rank may wait in one collective
    record: int
    trace: str | None
    schedule_seed: int | None
    seed: int | None  # --seed: where every rank's generators start (None: anew each run)
    sync_ranks: SyncRanks
    logs: _runlogs.LogsSpec
    role: str
    rendezvous: _Rendezvous | None  # None: a new run id and a free port, chosen as the run starts
    signals_to_handle: str | None  # torchrun's --signals-to-handle (2.13 on), which the ranks are told
    place: Place = "auto"  # where the ranks run: "auto" (in this process unless the script needs processes)
    checks: bool = True  # in processes, the script's groups are checked ones (``_checked``)

    @classmethod
    def of(cls, args: argparse.Namespace) -> RunSpec:
        """The run ``args`` (``parser()``'s) asks for; ``_Refused``, with the reason, for what one process cannot do."""
        size = _size(args)
        logs = _logs_spec(args)
        return cls(
            script=args.training_script,
            script_args=tuple(args.training_script_args),
            module=bool(args.module),
            size=size,
            max_restarts=args.max_restarts,
            timeout=args.timeout,
            record=args.record,
            trace=args.trace,
            schedule_seed=args.schedule_seed,
            seed=args.seed,
            sync_ranks=cast("SyncRanks", args.sync_ranks),  # (one of the parser's choices)
            logs=logs,
            role=args.role,
            rendezvous=_fixed_rendezvous(args),
            signals_to_handle=getattr(args, "signals_to_handle", None) or None,  # (older torchruns have none)
            place="processes" if args.processes else "in-process" if args.in_process else "auto",
            checks=not args.no_checks,
        )

    @property
    def world_options(self) -> WorldOptions:
        """What the world of each attempt is made with, besides its size and timeout."""
        return {
            "record": self.record,
            "trace": self.trace,
            "schedule_seed": self.schedule_seed,
            "sync_ranks": self.sync_ranks,
        }

    @property
    def name(self) -> str:
        """The run's name, in the watchdog's report and the world's."""
        return f"aiocoll run {self.script}"

    def __repr__(self) -> str:
        line = " ".join(["-m"] * self.module + [self.script, *self.script_args])
        where = "" if self.place == "auto" else f", {self.place}"
        return f"<RunSpec {line}: {self.size} ranks, timeout {self.timeout:g} s, {self.max_restarts} restarts{where}>"

    @property
    def signals(self) -> list[signal.Signals]:
        """The signals that end the run (torchrun's ``--signals-to-handle``; its default without it)."""
        names = (self.signals_to_handle or _TORCHRUN_SIGNALS).split(",")
        return [signal.Signals[n.strip()] for n in names if n.strip() in signal.Signals.__members__]


def _fixed_rendezvous(args: argparse.Namespace) -> _Rendezvous | None:
    """torchrun's choice: the one given; None for a standalone run (or one with no port given)."""
    given = args.master_port
    default = getattr(args, "torchrun_master_port", None)
    static = args.rdzv_backend == "static" and not args.rdzv_endpoint
    if args.standalone or (static and given is None and default is None):
        return None
    port = given if given is not None else default if default is not None else 29500
    return _Rendezvous(args.rdzv_id, args.master_addr, port, port_given=given is not None)


def _rendezvous(spec: RunSpec) -> _Rendezvous:
    """The run's rendezvous: the one given, or a new run id and a free port."""
    if spec.rendezvous is not None:
        return spec.rendezvous
    return _Rendezvous(str(uuid.uuid4()), "localhost", _free_port(), port_given=False)


def _free_port() -> int:
    with socket.socket() as s:  # (a port the script may read; in this process no rendezvous happens on it)
        s.bind(("localhost", 0))
        return int(s.getsockname()[1])


def worker_env(rank: int, spec: RunSpec, rdzv: _Rendezvous, restart: int = 0) -> dict[str, str]:
    """The variables torchrun's agent sets for worker ``rank`` of ``spec.size`` (one node, one group)."""
    size = spec.size
    env = {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "GROUP_RANK": "0",
        "ROLE_RANK": str(rank),
        "ROLE_NAME": spec.role,
        "LOCAL_WORLD_SIZE": str(size),
        "WORLD_SIZE": str(size),
        "GROUP_WORLD_SIZE": "1",
        "ROLE_WORLD_SIZE": str(size),
        "MASTER_ADDR": rdzv.master_addr,
        "MASTER_PORT": str(rdzv.master_port),
        "TORCHELASTIC_RESTART_COUNT": str(restart),
        "TORCHELASTIC_MAX_RESTARTS": str(spec.max_restarts),
        "TORCHELASTIC_RUN_ID": rdzv.run_id,
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
    }
    if spec.signals_to_handle:  # (torchrun's from 2.13 on)
        env["TORCHELASTIC_SIGNALS_TO_HANDLE"] = spec.signals_to_handle
    if size > 1 and "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = "1"  # as torchrun does (it prints a warning about it)
    return env


def _rank_env(rank: int, spec: RunSpec, rdzv: _Rendezvous, restart: int, attempt_dir: str) -> dict[str, str]:
    """``worker_env``, and where torch.distributed.elastic's ``@record`` writes the rank's failure (as torchrun)."""
    error_file = os.path.join(attempt_dir, str(rank), "error.json")
    return {**worker_env(rank, spec, rdzv, restart), "TORCHELASTIC_ERROR_FILE": error_file}


class _Refused(Exception):
    """An option this run cannot honour in one process."""


class _Signalled(BaseException):
    """A signal that ends the run reached it (``SIGNALS``)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _raise_signalled(signum: int, frame: object) -> None:
    raise _Signalled(signum)


def _ending_on(sig: signal.Signals) -> Callable[[], Callable[[], str | None]]:
    """A step: ``sig`` ends the run (``_Signalled`` in the main thread), whatever the process had for it."""

    def install() -> Callable[[], str | None]:
        if threading.current_thread() is not threading.main_thread():
            return lambda: None  # (only the main thread may install handlers: main() called from a thread)
        saved = signal.signal(sig, _raise_signalled)

        def undo() -> str | None:
            now = signal.getsignal(sig)
            if now is not _raise_signalled:  # (the script's own, or a library's, installed since)
                return f"replaced by {now!r} during the run"
            signal.signal(sig, saved)
            return None

        return undo

    return install


SIGNALS = _patches.PatchSet(
    "aiocoll run's signals",
    "while aiocoll run runs: each signal torchrun's agent handles (SIGTERM, SIGINT, SIGHUP, SIGQUIT, or "
    "--signals-to-handle) ends the run, with where each rank was, even where the parent left it ignored",
    lambda sigs: [_patches.Step(f"signal.signal({s.name})", _ending_on(s)) for s in sigs],  # type: ignore[attr-defined]
    ["signal.signal(*)"],
    per="run",
)


@dataclass(frozen=True, eq=False)
class _Script:
    """What the process shows of the script a run runs (one run's; compared by identity)."""

    argv: list[str]
    directory: str  # put first on sys.path
    mains: _rankmain.MainByRank  # sys.modules["__main__"]: each rank's script module


def _script_changes(script: Hashable) -> list[_patches.Change]:
    assert isinstance(script, _Script)

    def path_first() -> Callable[[], None]:
        saved = list(sys.path)
        sys.path.insert(0, script.directory)  # as `python script.py` and `python -m` put it first

        def undo() -> None:
            sys.path[:] = saved  # (whatever the script added goes too)

        return undo

    return [
        _patches.Attr(sys, "argv", script.argv, restore="always"),  # (the script may assign its own)
        _patches.Step("sys.path", path_first),
        _patches.Item(sys.modules, "__main__", script.mains, "sys.modules"),
    ]


SCRIPT = _patches.PatchSet(
    "aiocoll run's script",
    "while aiocoll run runs a script in this process: its sys.argv, its directory first on sys.path, and each "
    "rank's own __main__",
    _script_changes,
    ["sys.argv", "sys.path", "sys.modules['__main__']"],
    per="run",
)


def _nproc(value: str) -> int:
    """``--nproc-per-node``, as torchrun reads it: an int, ``cpu``, ``gpu`` or ``auto`` (GPUs, else CPUs)."""
    if value in ("gpu", "auto") and torch.cuda.is_available():
        return torch.cuda.device_count()
    if value == "gpu":
        raise _Refused("--nproc-per-node gpu: CUDA is not available")
    if value in ("cpu", "auto"):
        return os.cpu_count() or 1
    try:
        return int(value)
    except ValueError:
        raise _Refused(f"--nproc-per-node {value!r}: give the number of ranks (an int), cpu, gpu or auto") from None


def _size(args: argparse.Namespace) -> int:
    """The number of ranks, once the options one process cannot honour were refused (``RunSpec.of``'s)."""
    if args.nnodes not in ("1", "1:1"):
        raise _Refused(
            f"--nnodes {args.nnodes}: every rank of 'aiocoll run' runs in this process; for several nodes use "
            "torchrun with aiocoll.from_process_group, or a hybrid world (spawn(..., process_group=...))"
        )
    if args.node_rank != 0:
        raise _Refused(f"--node-rank {args.node_rank}: a run has one node, rank 0")
    if args.no_python:
        raise _Refused("--no-python: each rank runs Python code in this process")
    if getattr(args, "virtual_local_rank", False):
        raise _Refused(
            "--virtual-local-rank: it gives each rank CUDA_VISIBLE_DEVICES of its own, which only a process of its "
            "own reads; without it rank r uses cuda:LOCAL_RANK"
        )
    if getattr(args, "logs_specs", None):
        raise _Refused(f"--logs-specs {args.logs_specs}: output is routed as torchrun's default logs spec does")
    n = _nproc(args.nproc_per_node)
    if n < 1:
        raise _Refused(f"--nproc-per-node {n}: at least one rank")
    if args.max_restarts < 0:
        raise _Refused(f"--max-restarts {args.max_restarts}: a count, 0 or more")
    return n


def _logs_spec(args: argparse.Namespace) -> _runlogs.LogsSpec:
    """torchrun's output options, checked (``RunSpec.of``'s)."""
    try:
        redirects = _runlogs.Std.parse(args.redirects, "--redirects")
        tee = _runlogs.Std.parse(args.tee, "--tee")
    except ValueError as e:
        raise _Refused(str(e)) from None
    try:
        shown = frozenset(int(r) for r in args.local_ranks_filter.split(",") if r.strip())
    except ValueError:
        raise _Refused(f"--local-ranks-filter {args.local_ranks_filter!r}: give ranks, e.g. 0,1") from None
    template = getattr(args, "log_line_prefix_template", "") or ""  # (torchrun's from 2.15 on)
    duplicated = {  # torchrun's lists of needles (its parser splits them on commas)
        _runlogs.Std.OUT: tuple(getattr(args, "duplicate_stdout_filters", None) or ()),
        _runlogs.Std.ERR: tuple(getattr(args, "duplicate_stderr_filters", None) or ()),
    }
    return _runlogs.LogsSpec(args.log_dir, redirects, tee, shown, args.role, template, duplicated)


def _rank_main(
    spec: RunSpec,
    code: CodeType | None,
    restart: int,
    attempt_dir: str,
    rdzv: _Rendezvous,
    mains: _rankmain.MainByRank,
) -> Callable[[int], None]:
    """What each rank runs: the script's ``code`` (None: the module ``spec.script``) as its ``__main__``."""
    script = spec.script

    def rank_main(rank: int) -> None:
        _runlogs.OUTPUT_RANK.set(rank)  # (what this thread prints goes where the rank's stream does)
        os.environ.update(_rank_env(rank, spec, rdzv, restart, attempt_dir))  # this rank's view (see _procstate)
        # a module of its own, as `python script.py` gives each process, which is this rank's
        # sys.modules["__main__"] (where pickle finds the classes the script defines)
        module = types.ModuleType("__main__")
        try:
            run, names = _rankmain.script_main(script, spec.module, code)
            module.__dict__.update(names, __builtins__=builtins)
            with _rankmain.bound(mains, module):
                exec(run, module.__dict__)
        except SystemExit as e:
            if e.code not in (0, None):
                raise  # the rank's exit code: a failure, as in torchrun
            # exit(0): this rank is done, as its process would be

    return rank_main


def main(argv: Sequence[str] | None = None, *, exit_when_interrupted: bool = False) -> int:
    """``aiocoll run [options] script [args]``: the exit code (0, or 1 if a rank failed, as torchrun's).

    Every rank runs in this process, unless the script does what only a process of its own
    can (``_scriptread`` reads it before it runs; a rank meets it at run time) or
    ``--processes`` says so: then each rank runs in a process of its own (``_processes``),
    and the user is told why, once.

    ``exit_when_interrupted`` (the command line's): after ^C or SIGTERM the process ends at
    once, as torchrun's workers do when it stops them, without the interpreter's clean-up
    (about 0.8 s with torch loaded) and without waiting for ranks left running.
    """
    with _patches.lease(_collector.PAUSED):
        args = parser().parse_args(argv)
    try:
        spec = RunSpec.of(args)
    except _Refused as e:
        print(f"aiocoll run: {e}", file=sys.stderr)
        return 2
    if not spec.module and not os.path.isfile(spec.script):
        print(f"aiocoll run: can't open file {spec.script!r}: no such file", file=sys.stderr)
        return 2  # as python's own
    try:
        rdzv = _rendezvous(spec)
        run_dir = spec.logs.make_run_dir(rdzv.run_id)  # (each rank's error file, and its logs if routed)
    except OSError as e:
        print(f"aiocoll run: --log-dir {spec.logs.log_dir}: {e}", file=sys.stderr)
        return 2
    with _patches.lease(SIGNALS, tuple(spec.signals)):
        try:
            code = _main(spec, rdzv, run_dir)
        except _Signalled as e:  # (in processes; in this process, _run_once reports it)
            name = signal.Signals(e.signum).name
            print(
                f"aiocoll run: got signal {name}: the ranks were stopped (exit code 1, as torchrun's)",
                file=sys.stderr,
            )
            code = None
    if code is not None:
        return code
    if exit_when_interrupted:  # interrupted: 1, as torchrun's
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    return 1


def _main(spec: RunSpec, rdzv: _Rendezvous, run_dir: str) -> int | None:
    """The run's exit code; None if a signal ended it in this process (reported)."""
    # the ranks' seeds: the same per attempt and rank in both modes (a replay may go either way)
    seeds = Seeds.fresh() if spec.seed is None else Seeds(spec.seed)
    need = _needs_processes(spec)
    if need is not None:
        print(
            f"aiocoll run: {spec.script} runs in processes, one per rank, as under torchrun: {need} "
            "(--processes starts there directly; --in-process keeps every rank in this process)",
            file=sys.stderr,
        )
        return _in_processes(spec, rdzv, run_dir, seeds, fork=_processes.fork_safe())
    outcome = _in_this_process(spec, rdzv, run_dir, seeds)
    if outcome is None or isinstance(outcome, int):
        return outcome
    where = _call_site(outcome, spec.script)
    if spec.place == "in-process":
        print(
            f"aiocoll run: {spec.script} needs processes of its own ({outcome}{where}); "
            "run it without --in-process (or with --processes) to run each rank in a process of its own",
            file=sys.stderr,
        )
        return 1
    print(
        f"aiocoll run: {spec.script} needs processes of its own ({outcome}{where}): every rank was stopped, and "
        "what the attempt did until then (its output, files, checkpoints) stays done; the run starts again "
        "in processes, one per rank, as under torchrun (--processes starts there directly)",
        file=sys.stderr,
    )
    # fresh interpreters: the attempt left threads (torch's, gloo's) that a fork would copy mid-work
    return _in_processes(spec, rdzv, run_dir, seeds, fork=False)


def _needs_processes(spec: RunSpec) -> str | None:
    """Why the run starts in processes, said once (None: in this process)."""
    if spec.place == "processes":
        return "--processes was given"
    if spec.place == "in-process":
        return None
    path: str | None = spec.script
    if spec.module:
        try:
            found = importlib.util.find_spec(spec.script)
        except (ImportError, ValueError):
            found = None
        path = found.origin if found is not None and found.has_location else None
    need = None if path is None else _scriptread.read(path)
    return None if need is None else f"it {need}"


def _in_processes(spec: RunSpec, rdzv: _Rendezvous, run_dir: str, seeds: Seeds, *, fork: bool) -> int:
    if not rdzv.port_given:
        # rank 0 serves the store on it for real here: a free one rather than torchrun's
        # default 29500 (older torchruns' without --standalone), which runs side by side share
        rdzv = rdzv._replace(master_port=_free_port())

    def env_of(rank: int, restart: int, attempt_dir: str) -> dict[str, str]:
        return _rank_env(rank, spec, rdzv, restart, attempt_dir)

    return _processes.run(spec, run_dir, env_of, seeds, fork=fork)


def _in_this_process(
    spec: RunSpec, rdzv: _Rendezvous, run_dir: str, seeds: Seeds
) -> int | _procstate.NeedsProcess | None:
    """Every attempt with every rank in this process: the exit code, the refusal a rank met (the run
    stopped), or None if a signal interrupted it (reported)."""
    script_code = None
    if not spec.module:
        try:
            with open(spec.script, "rb") as f:  # (read once: every rank and restart runs the same code)
                script_code = compile(f.read(), spec.script, "exec")
        except SyntaxError as e:
            traceback.print_exception(type(e), e, None, file=sys.stderr)  # as python reports it
            return 1
    script_dir = os.path.dirname(os.path.abspath(spec.script)) if not spec.module else os.getcwd()
    mains = _rankmain.MainByRank(sys.modules["__main__"])
    script = _Script([spec.script, *spec.script_args], script_dir, mains)
    with (
        _patches.lease(SCRIPT, script),
        _mpspawn.spawned_ranks(spec.timeout, _NO_DEADLINE, seeds.then("mp.spawn")) as spawned,
        _mpprocess.process_ranks(spawned),
    ):
        for restart in range(spec.max_restarts + 1):
            with _runlogs.routed_output(spec.logs, run_dir, restart, spec.size) as attempt_dir:
                rank_main = _rank_main(spec, script_code, restart, attempt_dir, rdzv, mains)
                code = _run_once(spec, rank_main, spawned, seeds.attempt(restart))
            if code is None or isinstance(code, _procstate.NeedsProcess) or code == 0 or restart == spec.max_restarts:
                return code
            print(f"aiocoll run: restarting the world ({restart + 1} of {spec.max_restarts})", file=sys.stderr)
    return 1  # (not reached)


def _call_site(e: BaseException, script: str) -> str:
    """`` at file:line``: where the rank made the call it was refused (and the script's line, if elsewhere)."""
    frames = [
        f
        for f in traceback.extract_tb(_procworld.from_rank_code(e.__traceback__))
        if not f.filename.startswith(PACKAGE_DIR) and not f.filename.startswith("<frozen ")  # (the import system's)
    ]
    if not frames:
        return ""
    call = frames[-1]
    out = f" at {call.filename}:{call.lineno}"
    mine = [f for f in frames if os.path.abspath(f.filename) == os.path.abspath(script)]
    if mine and mine[-1] is not call:
        out += f", called from {mine[-1].filename}:{mine[-1].lineno}"
    return out


def _run_once(
    spec: RunSpec, rank_main: Callable[[int], None], spawned: _mpspawn.Starter, seeds: Seeds
) -> int | _procstate.NeedsProcess | None:
    """One run of the world: its exit code, the refusal a rank met, or None if a signal interrupted it."""
    size = spec.size
    world = _procworld.InProcessWorld(
        size, spec.timeout, _NO_DEADLINE, spec.name, options=spec.world_options, grace=_WIND_DOWN, seeds=seeds
    )
    started = time.time()
    _torch.prepare_for_rank_threads()
    with _patches.lease(_procworld.STEERED_INIT):
        try:
            end = world.run(rank_main, until=spawned.stopped)
            spawned.finish()  # (ranks the script started and left running end before its groups do)
        except (KeyboardInterrupt, _Signalled) as e:
            signum = e.signum if isinstance(e, _Signalled) else signal.SIGINT
            _report_interrupted(signal.Signals(signum), world.interrupted_at, size)
            for spawn_call in spawned.running():  # the ranks the script started with (torch.)multiprocessing
                inner = spawn_call.world
                if inner is None:
                    continue
                with contextlib.suppress(Exception):
                    print(f"  {inner.name}:", file=sys.stderr)
                    _report_places(inner.places(), inner.size, "    ")
                spawn_call.abandon(grace=_WIND_DOWN)
            return None
    if end.needs_process is not None:
        return end.needs_process
    if spawned.needs is not None:  # (a rank the script started met it, where its parent waited elsewhere)
        return spawned.needs
    if end.error is None:
        return 0
    _report(end.error, size, started, seeds)
    return 1


def _report(error: BaseException, size: int, started: float, seeds: Seeds) -> None:
    """The first failure, as torchrun's summary puts it (root cause first), with aiocoll's notes."""
    code = error.exit_code if isinstance(error, RankExitedError) else 1
    print("=" * 60, file=sys.stderr)
    print(f"aiocoll run: FAILED (a world of {size} ranks, after {time.time() - started:.1f} s)", file=sys.stderr)
    print(f"Root Cause (first observed failure): exitcode {code}", file=sys.stderr)
    notes: list[str] = []
    if isinstance(error, RankExitedError) and error.__cause__ is not None:
        # the script's own sys.exit, as torchrun shows it, then what aiocoll says of it
        notes = [f"aiocoll: {error}", *getattr(error, "__notes__", ())]
        error = error.__cause__
    tb = _procworld.from_rank_code(error.__traceback__)  # from the script's frame in, as a process's starts
    with contextlib.suppress(Exception):
        traceback.print_exception(type(error), error, tb or error.__traceback__, file=sys.stderr)
    for note in notes:
        print(note, file=sys.stderr)
    print(_processes.replay_note(seeds), file=sys.stderr)
    print("=" * 60, file=sys.stderr)


def _users(filename: str) -> bool:
    """Whether ``filename`` is the user's code: not aiocoll's, the standard library's or a package's."""
    return not filename.startswith(_NOT_USERS)


def _report_interrupted(sig: signal.Signals, places: dict[int, _procworld.RankPlace], size: int) -> None:
    """Where each rank was when the signal came: file:line in the user's code, and what it was doing."""
    print(f"aiocoll run: got signal {sig.name}: the run ends (exit code 1, as torchrun's)", file=sys.stderr)
    _report_places(places, size, "  ")


def _report_places(places: dict[int, _procworld.RankPlace], size: int, indent: str) -> None:
    for rank in range(size):
        place = places.get(rank)
        if place is None:
            print(f"{indent}rank {rank}: not running (done, or not started)", file=sys.stderr)
            continue
        frame = place.in_code(_users)
        at = f"{frame.filename}:{frame.lineno} in {frame.name}" if frame is not None else "outside the script"
        line = f": {frame.line.strip()}" if frame is not None and frame.line else ""
        print(f"{indent}rank {rank}: {place.state} at {at}{line}", file=sys.stderr)
