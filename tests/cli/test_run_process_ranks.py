"""``multiprocessing.Process`` ranks under ``aiocoll run`` (``aiocoll._cli._mpprocess``), against ``python``.

A ``Process`` whose code initialises torch.distributed is a rank in the run's process; the
script sees what it sees under ``python``: results, exit codes, ``pid``, ``current_process()``.
Every other process of the script's own code is real, with checked groups; the others (a
library's) stay as they are.
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from aiocoll._cli import _mpprocess
from aiocoll._process._procstate import PID_FLOOR

launcher = pytest.mark.launcher


def _run(tmp_path: Path, *args: str, python: bool = False) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, *args] if python else [sys.executable, "-m", "aiocoll", "run", *args]
    return subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)


def _script(tmp_path: Path, name: str, body: str) -> str:
    (tmp_path / name).write_text(textwrap.dedent(body), encoding="utf-8")
    return name


def _reference(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The script under ``python``, taken again (twice at most) where gloo aborted a process at its exit.

    (torch's gloo at times ends a finished process by SIGABRT in its teardown: ``../shared/DESIGN.md`` 7.)
    """
    for _ in range(3):
        ref = _run(tmp_path, *args, python=True)
        if not _died_by_signal(ref):
            break
    return ref


def _died_by_signal(proc: subprocess.CompletedProcess[str]) -> bool:
    """Whether the run or a process it reports the exit code of was ended by a signal (gloo's abort at exit)."""
    codes = [line for line in _lines(proc.stdout) if "exit codes" in line]
    return proc.returncode < 0 or any(re.search(r"-\d", line) for line in codes)


def _lines(out: str) -> list[str]:
    """The script's own lines, from "SCRIPT" on (torch 2.10's gloo writes its own lines in pieces)."""
    return sorted(line[line.index("SCRIPT") :] for line in out.splitlines() if "SCRIPT" in line)


# -- which processes are ranks: read from their code ------------------------------------------------

_MODULE = """
import torch.distributed as dist
import multiprocessing

def setup(rank, size):
    dist.init_process_group("gloo", rank=rank, world_size=size)

def train(rank, size):
    setup(rank, size)  # (through a function of the script's own)

def mesh(rank):
    from torch.distributed.device_mesh import init_device_mesh
    return lambda: init_device_mesh("cpu", (2,))  # (in nested code)

class Trainer:
    def fit(self):
        dist.init_process_group("gloo")

def by_method(rank):
    Trainer().fit()

class Worker(multiprocessing.Process):
    def run(self):
        self.setup()

    def setup(self):
        dist.init_process_group("gloo")

def produce(queue):
    queue.put(sum(range(10)))

from torch.distributed import init_process_group as start_group

def aliased(rank):
    start_group("gloo", rank=rank, world_size=2)  # (torch's function under a name of its own)

def hidden(rank):
    getattr(dist, "init_" + "process_group")("gloo")
"""


@pytest.fixture
def module(tmp_path: Path) -> object:
    path = tmp_path / "ranks_module.py"
    path.write_text(_MODULE, encoding="utf-8")
    spec = importlib.util.spec_from_file_location("ranks_module", path)
    assert spec is not None
    assert spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("name", ["setup", "train", "mesh", "by_method", "aliased"])
def test_a_process_whose_code_initialises_torch_distributed_is_a_rank(module: object, name: str) -> None:
    assert _mpprocess.reaches_init(multiprocessing.Process(), getattr(module, name))


def test_a_process_class_whose_run_initialises_torch_distributed_is_a_rank(module: object) -> None:
    worker = module.Worker()  # type: ignore[attr-defined]
    assert _mpprocess.reaches_init(worker, None)


@pytest.mark.parametrize("name", ["produce", "hidden"])
def test_a_process_not_seen_to_initialise_torch_distributed_is_no_rank(module: object, name: str) -> None:
    assert not _mpprocess.reaches_init(multiprocessing.Process(), getattr(module, name))


def test_a_library_s_process_is_no_rank_whatever_it_calls() -> None:
    import torch.distributed as dist

    # (installed code is not read: DataLoader workers, a library's own processes)
    assert not _mpprocess.reaches_init(multiprocessing.Process(), dist.init_process_group)


# -- under aiocoll run ---------------------------------------------------------------------------

TUTORIAL = """
import os, sys
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run(rank, size):
    tensor = torch.zeros(1)
    if rank == 0:
        tensor += 1
        dist.send(tensor=tensor, dst=1)
    else:
        dist.recv(tensor=tensor, src=0)
    # (one write: two processes' lines never run into each other)
    sys.stdout.write(f"SCRIPT rank {rank} has {tensor[0]} as {mp.current_process().name}\\n")
    sys.stdout.flush()


def init_process(rank, size, fn, port, pids):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = port
    dist.init_process_group("gloo", rank=rank, world_size=size)
    pids.put((rank, os.getpid()))
    fn(rank, size)
    dist.destroy_process_group()


if __name__ == "__main__":
    import socket

    with socket.socket() as s:  # (a free port: runs side by side)
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    mp.set_start_method(sys.argv[1])
    pids = mp.SimpleQueue()
    processes = []
    for rank in range(2):
        p = mp.Process(target=init_process, args=(rank, 2, run, port, pids))
        p.start()
        processes.append(p)
    for p in processes:
        p.join()
    seen = dict(pids.get() for _ in processes)
    print(f"SCRIPT each pid is its process's {all(seen[r] == p.pid for r, p in enumerate(processes))}")
    print(f"SCRIPT distinct {len({p.pid for p in processes}) == 2 and os.getpid() not in seen.values()}")
    print(f"SCRIPT exit codes {[p.exitcode for p in processes]} alive {[p.is_alive() for p in processes]}")
    print(f"SCRIPT PIDS {sorted(seen.values())}")
"""


@launcher
@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_the_tutorial_s_process_ranks_run_in_this_process_with_python_s_results(tmp_path: Path, method: str) -> None:
    """The "Writing Distributed Applications" tutorial's launcher: ``Process(target=init_process, ...)``."""
    name = _script(tmp_path, "tutorial.py", TUTORIAL)
    ref = _reference(tmp_path, name, method)
    ours = _run(tmp_path, name, method)
    assert ours.returncode == ref.returncode == 0, ours.stderr + ref.stderr
    ours_lines, ref_lines = (
        [line for line in _lines(out) if not line.startswith("SCRIPT PIDS")] for out in (ours.stdout, ref.stdout)
    )
    assert ours_lines == ref_lines
    assert "SCRIPT exit codes [0, 0] alive [False, False]" in ours_lines
    assert "SCRIPT rank 1 has 1.0 as Process-2" in ours_lines
    # in-process: the ranks' own pids, above any real one
    pids = next(line for line in ours.stdout.splitlines() if line.startswith("SCRIPT PIDS"))
    assert all(int(p) >= PID_FLOOR for p in pids.split("[")[1].rstrip("]").split(","))


FAILING = """
import os, sys, socket
import torch
import torch.distributed as dist
import multiprocessing as mp


def work(rank, size, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = port
    dist.init_process_group("gloo", rank=rank, world_size=size)
    if rank == 1:
        raise ValueError("rank 1 fails")
    dist.all_reduce(torch.ones(1))


if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    processes = [mp.Process(target=work, args=(r, 2, port)) for r in range(2)]
    for p in processes:
        p.start()
    processes[1].join()
    print(f"SCRIPT rank 1's exit code {processes[1].exitcode}", flush=True)
    processes[0].join(60)  # (under python it waits in all_reduce: its timeout)
    if processes[0].is_alive():
        processes[0].terminate()
        processes[0].join()
    print(f"SCRIPT rank 0 ended {processes[0].exitcode in (1, -15)}")
"""


@launcher
def test_a_failing_process_rank_prints_its_traceback_as_a_process_does_and_never_hangs_the_others(
    tmp_path: Path,
) -> None:
    name = _script(tmp_path, "failing.py", FAILING)
    ours = _run(tmp_path, name)
    assert ours.returncode == 0, ours.stderr
    assert _lines(ours.stdout) == ["SCRIPT rank 0 ended True", "SCRIPT rank 1's exit code 1"]
    # as multiprocessing's child prints it, from the script's frame in
    assert "Process Process-2:\nTraceback (most recent call last):\n" in ours.stderr
    assert 'failing.py", line 13, in work' in ours.stderr
    assert "ValueError: rank 1 fails" in ours.stderr
    # rank 0 was released at once (under python it waits in gloo until terminated)
    assert "Process Process-1:\naiocoll._errors.WorldAbortedError: rank 1 failed with ValueError" in ours.stderr


QUEUED = """
import os, sys, socket
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def work(rank, size, port, results):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = port
    dist.init_process_group("gloo", rank=rank, world_size=size)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    results.put((rank, t.item()))


if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    order = [int(r) for r in sys.argv[1].split(",")]
    processes = [ctx.Process(target=work, args=(r, len(order), port, results)) for r in order]
    for p in processes:
        p.start()
    # the parent waits on the queue, not on the processes: they start all the same
    print(f"SCRIPT results {sorted(results.get() for _ in processes)}", flush=True)
    for p in processes:
        p.join()
    print(f"SCRIPT exit codes {[p.exitcode for p in processes]}")
"""


@launcher
@pytest.mark.parametrize("order", ["0,1,2", "1,0,2"])
def test_process_ranks_whose_parent_waits_on_a_queue_start_and_those_out_of_order_run_in_processes(
    tmp_path: Path, order: str
) -> None:
    """In the order started, each is the rank it says: in this process; else the run starts again in processes."""
    name = _script(tmp_path, "queued.py", QUEUED)
    ref = _reference(tmp_path, name, order)
    ours = _run(tmp_path, name, order)
    assert ours.returncode == ref.returncode == 0, ours.stderr + ref.stderr
    assert _lines(ours.stdout) == _lines(ref.stdout)
    assert "SCRIPT results [(0, 6.0), (1, 6.0), (2, 6.0)]" in _lines(ours.stdout)
    restarted = "the run starts again in processes" in ours.stderr
    assert restarted == (order != "0,1,2"), ours.stderr
    if restarted:
        assert "initialised torch.distributed as rank 1 of 3" in ours.stderr


SPAWNED_OUT_OF_ORDER = """
import os, sys
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def main(i, n, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = port
    dist.init_process_group("gloo", rank=n - 1 - i, world_size=n)  # (rank i of the spawn is rank n-1-i)
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    sys.stdout.write(f"SCRIPT rank {dist.get_rank()} sum {t.item()}\\n")  # (one write: lines never mix)
    sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    mp.spawn(main, args=(2, port), nprocs=2)
    print("SCRIPT done")
"""


@launcher
def test_an_mp_spawn_rank_that_needs_a_process_restarts_the_run_in_processes(tmp_path: Path) -> None:
    """It used to fail the run: the spawn's join raised the refusal as the rank's error."""
    name = _script(tmp_path, "swapped.py", SPAWNED_OUT_OF_ORDER)
    ref = _reference(tmp_path, name)
    ours = _run(tmp_path, name)
    assert ours.returncode == ref.returncode == 0, ours.stderr + ref.stderr
    assert (
        _lines(ours.stdout) == _lines(ref.stdout) == ["SCRIPT done", "SCRIPT rank 0 sum 1.0", "SCRIPT rank 1 sum 1.0"]
    )
    assert "the run starts again in processes" in ours.stderr


HIDDEN = """
import os, sys, socket
import torch
import torch.distributed as dist
import multiprocessing as mp


def work(rank, size, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = port
    getattr(dist, "init_" + "process_group")("gloo", rank=rank, world_size=size)  # (not seen before it runs)
    t = torch.ones(1)
    if rank == 0:
        dist.all_reduce(t)
    else:
        dist.broadcast(t, 0)


if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    mp.set_start_method(sys.argv[1])
    processes = [mp.Process(target=work, args=(r, 2, port)) for r in range(2)]
    for p in processes:
        p.start()
    for p in processes:
        p.join(60)
    print(f"SCRIPT exit codes {[p.exitcode for p in processes]}")
"""


@launcher
@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_a_process_not_seen_to_be_a_rank_is_a_real_one_with_checked_groups_and_says_so(
    tmp_path: Path, method: str
) -> None:
    """Never unchecked and unsaid: its mismatch is reported by aiocoll, in the process itself."""
    name = _script(tmp_path, "hidden.py", HIDDEN)
    for _ in range(3):  # (real processes on real gloo: taken again where gloo aborted one at its exit)
        ours = _run(tmp_path, name, method)
        if not _died_by_signal(ours):
            break
    assert ours.returncode == 0, ours.stderr
    assert _lines(ours.stdout) == ["SCRIPT exit codes [1, 1]"]
    for n in (1, 2):
        assert f"aiocoll run: Process-{n} (pid " in ours.stderr
    assert ours.stderr.count("its groups are checked ones, as with --processes") == 2
    assert "CollectiveMismatchError: ranks called different collectives" in ours.stderr
    assert "rank 1: broadcast(float32[1], src=0) at" in ours.stderr
    # real processes: real pids
    pids = [int(line.split("(pid ")[1].split(")")[0]) for line in ours.stderr.splitlines() if "(pid " in line]
    assert len(pids) == 2
    assert all(pid < PID_FLOOR for pid in pids)


@launcher
def test_in_processes_the_processes_mp_spawn_starts_make_checked_groups(tmp_path: Path) -> None:
    """``--processes``: the script's process spawns its ranks (fresh interpreters); each reports the mismatch."""
    body = HIDDEN.replace('getattr(dist, "init_" + "process_group")', "dist.init_process_group")
    body = body.replace("def work(rank, size, port):", "def work(rank, size, port):  # (mp.spawn's fn)")
    body = body.split('if __name__ == "__main__":')[0] + textwrap.dedent(
        """
        if __name__ == "__main__":
            import torch.multiprocessing
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = str(s.getsockname()[1])
            try:
                torch.multiprocessing.spawn(work, args=(2, port), nprocs=2)
            except torch.multiprocessing.ProcessRaisedException as e:
                print(f"SCRIPT raised {'CollectiveMismatchError' in str(e)}")
        """
    )
    name = _script(tmp_path, "spawned.py", body)
    ours = _run(tmp_path, "--processes", name)
    assert ours.returncode == 0, ours.stderr
    assert _lines(ours.stdout) == ["SCRIPT raised True"], ours.stdout + ours.stderr


POLLING = """
import os, sys, socket, time
import multiprocessing as mp
from multiprocessing.connection import wait
import torch
import torch.distributed as dist


def work(rank, size, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = port
    dist.init_process_group("gloo", rank=rank, world_size=size)
    dist.barrier()
    sys.exit(3 + rank)


if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    processes = [mp.Process(target=work, args=(r, 2, port)) for r in range(2)]
    for p in processes:
        p.start()
        print(f"SCRIPT started {p.name} alive {p.is_alive()} exitcode {p.exitcode}")  # (looks between starts)
    wait([p.sentinel for p in processes], timeout=60)
    while any(p.is_alive() for p in processes):
        time.sleep(0.01)
    print(f"SCRIPT exit codes {[p.exitcode for p in processes]}")
    for p in processes:
        p.close()
"""


@launcher
def test_a_parent_that_looks_at_its_processes_between_starts_and_polls_them_gets_them_as_python_does(
    tmp_path: Path,
) -> None:
    """``is_alive()``, ``exitcode`` and ``repr`` between two starts do not start the ranks one by one;
    ``sentinel`` becomes ready, and ``sys.exit``'s code is the exit code."""
    name = _script(tmp_path, "polling.py", POLLING)
    ref = _reference(tmp_path, name)
    ours = _run(tmp_path, name)
    assert ours.returncode == ref.returncode == 0, ours.stderr + ref.stderr
    assert _lines(ours.stdout) == _lines(ref.stdout)
    assert "SCRIPT exit codes [3, 4]" in _lines(ours.stdout)
    assert "the run starts again in processes" not in ours.stderr
