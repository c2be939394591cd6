"""``aiocoll run``'s processes mode: one process per rank, as torchrun starts them.

For a script that one process cannot serve (``_scriptread``, or a refusal met in a rank
at run time), and for ``--processes``. Each rank is a process of its own that runs the
script as its ``__main__`` with torchrun's environment (``_run.worker_env``); its
``init_process_group`` makes the backend it names (gloo, NCCL), as under torchrun.

Ranks are forked from this process, which has imported torch already, rather than
started as fresh interpreters behind an agent: that saves each rank the interpreter's
start and torch's import (about 1 s each here). Fork only while this process has no
thread of its own (``fork_safe``): otherwise (after an in-process attempt, say) the ranks
start as fresh interpreters (``python -u``, as torchrun starts them), which run the same
``_rank_process``. Either way a rank's generators start from the seed it would have had
in one process (``_locals.Seeds``), and its output is routed as in one process.

As torchrun's agent: the first rank to fail stops the others (SIGTERM, then SIGKILL),
the run restarts up to ``--max-restarts`` times, and the exit code is 1 with a summary
naming the first failure. SIGINT, SIGTERM, SIGHUP and SIGQUIT end the run whatever the
parent left ignored (``_run.SIGNALS``): the ranks get SIGTERM, no process is left.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import gc
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING

from .._diagnostics import _frdump
from .._lifecycle import _outcome, _procworld
from .._process._locals import Seeds, numpy_seed
from . import _checked, _mpprocess, _rankmain, _runlogs

if TYPE_CHECKING:
    from ._run import RunSpec

__all__ = ["RankProcess", "fork_safe", "interpreter_main", "replay_note", "run"]

# seconds stopped ranks get to end after SIGTERM before SIGKILL (torchrun waits up to 30)
STOP_GRACE = 5.0
_POLL = 0.02  # seconds between looks at the ranks (torchrun's --monitor-interval is 0.1 to 5)


def fork_safe() -> bool:
    """Whether this process may fork its ranks: its main thread is its only Python thread.

    (Threads that C libraries start at import, such as torch's, hold no lock a rank needs;
    Python 3.12 warns on fork with Python threads, and the suite treats warnings as errors.)
    """
    return threading.active_count() == 1


@dataclass
class RankProcess:
    """One rank's process: forked (``popen`` None) or a fresh interpreter; its exit code once it ended."""

    rank: int
    pid: int
    popen: subprocess.Popen[bytes] | None = None
    code: int | None = None
    ended_at: float = 0.0
    error_file: str | None = None  # where ``@record`` writes its failure (TORCHELASTIC_ERROR_FILE)
    streams: tuple[IO[bytes], IO[bytes]] | None = None  # its stdout and stderr, read here (routed output)
    readers: list[threading.Thread] = field(default_factory=list)

    def poll(self) -> int | None:
        """The exit code (negative: the signal that ended it), or None while it runs."""
        if self.code is not None:
            return self.code
        if self.popen is not None:
            self.code = self.popen.poll()
        else:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid == 0:
                return None
            self.code = os.waitstatus_to_exitcode(status)
        if self.code is not None:
            self.ended_at = time.time()
        return self.code

    def signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def __repr__(self) -> str:
        how = "forked" if self.popen is None else "interpreter"
        state = "running" if self.code is None else f"exit code {self.code}"
        return f"<RankProcess rank={self.rank} pid={self.pid} {how} {state}>"


def run(
    spec: RunSpec,
    run_dir: str,
    env_of: Callable[[int, int, str], dict[str, str]],
    seeds: Seeds,
    *,
    fork: bool,
) -> int:
    """Run every attempt of ``spec`` in processes: the exit code (0, or 1 as torchrun's).

    A signal's exception (``_run.SIGNALS``) stops every rank, then goes on.

    ``env_of(rank, restart, attempt_dir)``: the variables rank ``rank`` gets; each rank's
    generators are seeded from ``seeds`` (as in one process: the same attempt and rank,
    the same seed).
    """
    started = time.time()
    for restart in range(spec.max_restarts + 1):
        with _runlogs.routed_output(spec.logs, run_dir, restart, spec.size) as attempt_dir:
            routed = spec.logs.routes_output()
            envs = [env_of(r, restart, attempt_dir) for r in range(spec.size)]
            ranks = _start(spec, envs, seeds.attempt(restart).of(spec.size), fork, routed)
            try:
                failed = _watch(ranks)
            except BaseException:  # a signal: each rank says where it was, then all stop
                _stop(ranks, say_where=True)
                raise
            finally:
                for p in ranks:
                    for t in p.readers:
                        # (a process the rank left running may hold its output open: its
                        # lines after that are not waited for)
                        t.join(STOP_GRACE)
        if failed is None:
            return 0
        if restart == spec.max_restarts:
            _report(spec, failed, ranks, started, seeds)
            return 1
        print(f"aiocoll run: restarting the ranks' processes ({restart + 1} of {spec.max_restarts})", file=sys.stderr)
    return 1  # (not reached)


def _start(
    spec: RunSpec, envs: Sequence[dict[str, str]], seeds: Sequence[int], fork: bool, routed: bool
) -> list[RankProcess]:
    ranks: list[RankProcess] = []
    try:
        for rank, (env, seed) in enumerate(zip(envs, seeds, strict=True)):
            start = _fork if fork else _interpreter
            ranks.append(start(_RankSpec.of(spec, env, seed), rank, routed))
            ranks[-1].error_file = env.get("TORCHELASTIC_ERROR_FILE")
    except BaseException:
        _stop(ranks)
        raise
    # the threads that copy their output start once every rank is forked: a fork while one
    # of them holds a stream's lock would leave that lock held for ever in the child
    for p in ranks:
        if p.streams is not None:
            p.readers = _readers(p.rank, *p.streams)
    return ranks


def replay_note(seeds: Seeds) -> str:
    """What a failed run says of its ranks' seeds: how to draw the same numbers again."""
    return f"aiocoll: the ranks' generators were seeded from {seeds.base} (--seed {seeds.base} draws the same again)"


@dataclass(frozen=True)
class _RankSpec:
    """What one rank's process runs: the script (or module) and its arguments, its variables and its seed."""

    script: str
    args: tuple[str, ...]
    module: bool
    env: dict[str, str]
    seed: int
    checks: bool  # the groups the script makes are checked ones (``_checked``)
    timeout: float  # seconds a collective may wait, in a group the script gave no timeout

    @classmethod
    def of(cls, spec: RunSpec, env: dict[str, str], seed: int) -> _RankSpec:
        return cls(spec.script, spec.script_args, spec.module, env, seed, spec.checks, spec.timeout)


_INTERPRETER_MAIN = "import aiocoll._cli._processes as p; p.interpreter_main()"


def _interpreter(rank_spec: _RankSpec, rank: int, routed: bool) -> RankProcess:
    """Rank ``rank`` in a fresh interpreter (``python -u``, as torchrun starts a worker) running ``_rank_process``."""
    args = [sys.executable, "-u", "-c", _INTERPRETER_MAIN, json.dumps(dataclasses.asdict(rank_spec))]
    pipe = subprocess.PIPE if routed else None
    popen = subprocess.Popen(args, env={**os.environ, **rank_spec.env}, stdout=pipe, stderr=pipe)
    p = RankProcess(rank, popen.pid, popen)
    if routed:
        assert popen.stdout is not None
        assert popen.stderr is not None
        p.streams = (popen.stdout, popen.stderr)
    return p


def interpreter_main() -> None:
    """A fresh interpreter's rank: ``sys.argv[1]`` holds its ``_RankSpec``."""
    fields = json.loads(sys.argv[1])
    os._exit(_rank_process(_RankSpec(**{**fields, "args": tuple(fields["args"])})))


def _fork(rank_spec: _RankSpec, rank: int, routed: bool) -> RankProcess:
    """Rank ``rank`` forked from this process, which runs the script in the child and never returns there."""
    pipes = [os.pipe(), os.pipe()] if routed else []
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the rank's process
        code = 1
        try:
            for i, (r, w) in enumerate(pipes):
                os.dup2(w, 1 + i)
                os.close(r)
                os.close(w)
            code = _rank_process(rank_spec)
        finally:
            os._exit(code)  # (never back into the launcher's frames)
    p = RankProcess(rank, pid)
    if routed:
        for _, w in pipes:
            os.close(w)
        p.streams = (os.fdopen(pipes[0][0], "rb"), os.fdopen(pipes[1][0], "rb"))
    return p


def _rank_process(rank: _RankSpec) -> int:
    """In a rank's process: run the script as ``python -u`` would in a fresh process; its exit code."""
    # as a fresh interpreter has them under torchrun, whose agent handles these signals
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    # the process's own streams (this one's may be routed: ``_runlogs``), unbuffered as -u makes them
    sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, ValueError):
            stream.reconfigure(write_through=True)  # type: ignore[union-attr]
    # generators seeded anew, as a fresh process's (a fork would copy this one's to every rank)
    _reseed(rank.seed)
    _frdump.note_process_seed(rank.seed)
    # where the rank was, when the run is interrupted (``_stop``)
    faulthandler.register(signal.SIGUSR1, file=2, all_threads=False, chain=False)
    os.environ.update(rank.env)
    if rank.checks:
        _checked.install(rank.timeout)
        _mpprocess.checked_children(rank.timeout)  # (and the processes its script starts)
    sys.argv[:] = [rank.script, *rank.args]
    module = types.ModuleType("__main__")
    # as python puts it first: the current directory for -m, else the script's
    sys.path[0] = os.getcwd() if rank.module else os.path.dirname(os.path.abspath(rank.script))
    try:
        code, names = _rankmain.script_main(rank.script, rank.module)
        module.__dict__.update(names, __builtins__=__builtins__)
        sys.modules["__main__"] = module
        exec(code, module.__dict__)
        status = 0
    except SystemExit as e:
        status = _outcome.exit_status(e)
    except KeyboardInterrupt:
        traceback.print_exc()
        status = 128 + signal.SIGINT
    except BaseException as e:
        # from the script's frame in (torch's excepthook reads the exception's own traceback)
        e = e.with_traceback(_procworld.from_rank_code(e.__traceback__))
        sys.excepthook(type(e), e, e.__traceback__)
        status = 1
    return _finish(status)


def _reseed(seed: int) -> None:
    """Seed torch's (CPU and CUDA), ``random``'s and NumPy's global generators as a rank's are in one process."""
    import random

    import torch

    torch.manual_seed(seed)
    random.seed(seed)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(numpy_seed(seed))


def _finish(status: int) -> int:
    """What a fresh interpreter does at exit: waits for non-daemon threads, runs atexit handlers, flushes."""
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # (the interpreter's own step)
    except BaseException:
        traceback.print_exc()
    import atexit

    atexit._run_exitfuncs()
    # the interpreter's finalization would then free the script's globals, flushing the files
    # they hold open (os._exit ends the process without it)
    main = sys.modules.get("__main__")
    if main is not None:
        with contextlib.suppress(Exception):
            main.__dict__.clear()
            gc.collect()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    return status


def _readers(rank: int, out: IO[bytes], err: IO[bytes]) -> list[threading.Thread]:
    """Threads copying a rank's output where ``--redirects``/``--tee`` send it (this process's routed streams)."""

    def copy(src: IO[bytes], to: Callable[[], IO[str]]) -> None:
        _runlogs.OUTPUT_RANK.set(rank)  # (what this thread writes is the rank's)
        with src:
            for line in iter(src.readline, b""):
                stream = to()
                stream.write(line.decode(errors="replace"))
                stream.flush()

    threads = [
        threading.Thread(target=copy, args=(out, lambda: sys.stdout), name=f"aiocoll rank {rank} stdout", daemon=True),
        threading.Thread(target=copy, args=(err, lambda: sys.stderr), name=f"aiocoll rank {rank} stderr", daemon=True),
    ]
    for t in threads:
        t.start()
    return threads


def _watch(ranks: list[RankProcess]) -> RankProcess | None:
    """Wait for every rank to end; the first that failed (the others stopped then), or None."""
    while True:
        codes = [p.poll() for p in ranks]
        failed = [p for p in ranks if p.code not in (None, 0)]
        if failed:
            first = min(failed, key=lambda p: p.ended_at)
            _stop(ranks)
            return first
        if all(c == 0 for c in codes):
            return None
        time.sleep(_POLL)


def _stop(ranks: list[RankProcess], say_where: bool = False) -> None:
    """End every rank still running: SIGTERM, then SIGKILL after ``STOP_GRACE`` seconds (torchrun's order).

    ``say_where``: forked ranks first print their stack (SIGUSR1, which ``_rank_process``
    gives to ``faulthandler``), as the in-process mode says where each rank was.
    """
    forked = [p for p in ranks if p.popen is None and p.poll() is None]
    if say_where and forked:
        print("aiocoll run: where each rank's process was (innermost call first):", file=sys.stderr, flush=True)
        for p in forked:
            print(f"  rank {p.rank} (pid {p.pid}):", file=sys.stderr, flush=True)
            p.signal(signal.SIGUSR1)
            time.sleep(0.05)  # (one after the other: their dumps do not interleave)
    for p in ranks:
        p.signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE
    while any(p.poll() is None for p in ranks) and time.monotonic() < deadline:
        time.sleep(_POLL)
    for p in ranks:
        p.signal(signal.SIGKILL)
    for p in ranks:
        if p.popen is not None:
            p.popen.wait()
        elif p.code is None:
            with contextlib.suppress(ChildProcessError):
                p.code = os.waitstatus_to_exitcode(os.waitpid(p.pid, 0)[1])


def _report(spec: RunSpec, failed: RankProcess, ranks: list[RankProcess], started: float, seeds: Seeds) -> None:
    """The first failure, as torchrun's summary puts it: its rank, exit code and pid, and its error file's message."""
    code = failed.code if failed.code is not None else 1
    try:
        how = f"exitcode {code}" if code >= 0 else f"exitcode {code} (signal {signal.Signals(-code).name})"
    except ValueError:  # (a signal number Python has no name for)
        how = f"exitcode {code}"
    print("=" * 60, file=sys.stderr)
    print(
        f"aiocoll run: FAILED ({spec.size} processes, one per rank, after {time.time() - started:.1f} s)",
        file=sys.stderr,
    )
    print(f"Root Cause (first observed failure): rank {failed.rank}, {how} (pid: {failed.pid})", file=sys.stderr)
    message = "" if failed.error_file is None else _error_file_message(failed.error_file)
    if message:
        print(message, file=sys.stderr)
    others = [p for p in ranks if p is not failed and p.code not in (0, None)]
    for p in others:
        print(f"  rank {p.rank}: exitcode {p.code} (pid: {p.pid}), stopped or failed after it", file=sys.stderr)
    print(replay_note(seeds), file=sys.stderr)
    print("=" * 60, file=sys.stderr)


def _error_file_message(path: str) -> str:
    """What ``torch.distributed.elastic``'s ``@record`` wrote for a failed rank (its traceback), if anything."""
    import json

    with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
        with open(path) as f:
            data = json.load(f)
        message = data["message"]
        if isinstance(message, dict):
            return str(message.get("extraInfo", {}).get("py_callstack", "") or message.get("message", ""))
        return str(message)
    return ""
