"""``aiocoll run``: unmodified torchrun scripts, every rank in one process, as a new user runs them."""

from __future__ import annotations

import gc
import importlib.util
import json
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.launcher

# every variable torchrun's agent sets for a worker (torch/distributed/elastic/agent/server/local_elastic_agent.py)
TORCHRUN_ENV = (
    "RANK",
    "LOCAL_RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_NAME",
    "LOCAL_WORLD_SIZE",
    "WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
)


def run(tmp_path: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "aiocoll", "run", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def script(tmp_path: Path, name: str, body: str) -> str:
    (tmp_path / name).write_text(textwrap.dedent(body), encoding="utf-8")
    return name


def test_a_torchrun_script_runs_as_its_own_main_on_every_rank(tmp_path: Path) -> None:
    name = script(
        tmp_path,
        "train.py",
        f"""
        import gc, io, json, os, sys
        import torch
        import torch.distributed as dist

        calls = 0  # a module global: each rank's __main__ has its own

        def step():
            global calls
            calls += 1

        class Model(torch.nn.Module):
            def __init__(self, rank):
                super().__init__()
                self.rank = rank

        backend, init = sys.argv[1], sys.argv[2]
        kwargs = {{}} if init == "env" else {{"init_method": "env://"}}
        dist.init_process_group(backend or None, **kwargs)
        step()
        rank = dist.get_rank()
        t = torch.full((3,), float(rank))
        dist.all_reduce(t)
        evens = dist.new_group([0, 2])
        if rank in (0, 2):
            dist.all_reduce(t, group=evens)
        dist.destroy_process_group()
        dist.init_process_group("gloo")  # again, after a destroy
        names = [None] * dist.get_world_size()
        dist.all_gather_object(names, __name__)
        dist.destroy_process_group()
        # a class the script defines pickles by name, as in a process whose __main__ is the script
        buffer = io.BytesIO()
        torch.save(Model(rank), buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        pickled = type(loaded) is Model and loaded.rank == rank and sys.modules["__main__"].calls == 1
        env = {{k: os.environ.get(k) for k in {TORCHRUN_ENV!r}}}
        print("RESULT", json.dumps([rank, t.tolist(), calls, names, sys.argv[1:], env,
                                    dist.is_torchelastic_launched(), pickled, gc.isenabled()]), flush=True)
        """,
    )
    proc = run(tmp_path, "--nproc_per_node", "3", "--master-port", "29777", name, "gloo", "env", "--lr", "0.1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = sorted(
        json.loads(line.split(" ", 1)[1]) for line in proc.stdout.splitlines() if line.startswith("RESULT")
    )
    assert [r[0] for r in results] == [0, 1, 2]
    for rank, t, calls, names, argv, env, elastic, pickled, collecting in results:
        assert pickled is True
        assert collecting is True  # (the collector is paused only while torchrun's parser loads)
        assert t == ([6.0] * 3 if rank in (0, 2) else [3.0] * 3)  # 0+1+2, then the evens' sum of 3s
        assert calls == 1  # its own module globals
        assert names == ["__main__"] * 3
        assert argv == ["gloo", "env", "--lr", "0.1"]
        assert elastic is True
        assert env["RANK"] == env["LOCAL_RANK"] == env["ROLE_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == env["ROLE_WORLD_SIZE"] == "3"
        assert (env["GROUP_RANK"], env["GROUP_WORLD_SIZE"], env["ROLE_NAME"]) == ("0", "1", "default")
        assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("127.0.0.1", "29777")
        assert (env["TORCHELASTIC_RESTART_COUNT"], env["TORCHELASTIC_MAX_RESTARTS"]) == ("0", "0")
        assert None not in env.values(), env


@pytest.mark.parametrize("backend", ["nccl", "cpu:gloo,cuda:nccl", ""])
def test_any_backend_name_runs_on_aiocoll(tmp_path: Path, backend: str) -> None:
    name = script(
        tmp_path,
        "b.py",
        """
        import sys, torch, torch.distributed as dist
        dist.init_process_group(sys.argv[1] or None, init_method="env://")
        t = torch.ones(1)
        dist.all_reduce(t)
        print("SUM", int(t.item()), dist.get_backend())
        """,
    )
    proc = run(tmp_path, "--nproc-per-node", "2", "--standalone", name, backend)
    assert proc.returncode == 0, proc.stderr
    lines = sorted(line for line in proc.stdout.splitlines() if line.startswith("SUM"))
    assert [line.split()[1] for line in lines] == ["2", "2"]


def test_a_failing_rank_is_reported_as_torchrun_would_and_better(tmp_path: Path) -> None:
    name = script(
        tmp_path,
        "fail.py",
        """
        import sys, torch, torch.distributed as dist
        dist.init_process_group("gloo")
        rank, t = dist.get_rank(), torch.ones(1)
        if sys.argv[1] == "raise" and rank == 1:
            raise ValueError("rank 1 is broken")
        if sys.argv[1] == "exit" and rank == 2:
            sys.exit(3)
        if sys.argv[1] == "mismatch" and rank == 0:
            dist.broadcast(t, 0)
        else:
            dist.all_reduce(t)
        if sys.argv[1] == "done" and rank == 0:
            sys.exit(0)  # a rank done early, as a process that exits 0
        """,
    )
    raised = run(tmp_path, "--nproc-per-node", "4", name, "raise")
    assert raised.returncode == 1
    err = raised.stderr
    assert "Root Cause (first observed failure): exitcode 1" in err
    assert "ValueError: rank 1 is broken" in err
    assert "aiocoll: raised on rank 1 of a world of 4" in err
    assert "aiocoll: ranks [0, 2, 3] were aborted because of it" in err
    # the traceback starts in the script, as a process's would
    assert err.split("Traceback (most recent call last):\n", 1)[1].startswith(f'  File "{name}", line 6')

    exited = run(tmp_path, "--nproc-per-node", "4", name, "exit")
    assert exited.returncode == 1
    assert "exitcode 3" in exited.stderr
    assert "aiocoll: raised on rank 2 of a world of 4" in exited.stderr

    mismatch = run(tmp_path, "--nproc-per-node", "4", name, "mismatch")
    assert mismatch.returncode == 1
    assert "CollectiveMismatchError" in mismatch.stderr
    assert f"rank 0: broadcast(float32[1], src=0) at {name}:10" in mismatch.stderr

    assert run(tmp_path, "--nproc-per-node", "4", name, "done").returncode == 0


def test_ranks_meet_in_a_store_of_their_own(tmp_path: Path) -> None:
    name = script(
        tmp_path,
        "stores.py",
        """
        import datetime, os, sys, torch
        import torch.distributed as dist
        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        # the pattern of torchrun's agent store: rank 0 serves on MASTER_PORT, its server
        # waiting in C code for every client; then the ranks meet in a queue
        host, port, timeout = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), datetime.timedelta(seconds=20)
        store = dist.TCPStore(host, port, size, rank == 0, timeout=timeout)
        if rank == 0:
            print("GOT", sorted(store.queue_pop("q").decode() for _ in range(size - 1)))
        else:
            store.queue_push("q", f"from {rank}")
        """,
    )
    met = run(tmp_path, "--nproc-per-node", "3", name, "store")
    assert met.returncode == 0, met.stderr
    assert "GOT ['from 1', 'from 2']" in met.stdout


def test_a_group_s_own_timeout_breaks_it_and_a_new_default_group_starts_afresh(tmp_path: Path) -> None:
    # gloo's behaviour under torchrun, measured: rank 0's barrier times out after 1 s,
    # its peers meanwhile meet in another group; after destroy_process_group, a new
    # default group (the same name, "0") works for every rank
    name = script(
        tmp_path,
        "reinit.py",
        """
        import datetime, torch
        import torch.distributed as dist
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=1))
        rank = dist.get_rank()
        side = dist.new_group(timeout=datetime.timedelta(seconds=60))
        if rank == 0:
            try:
                dist.barrier()
            except RuntimeError as e:
                print("TIMED OUT", " Timed out " in str(e), flush=True)
        dist.barrier(group=side)
        dist.destroy_process_group()
        dist.init_process_group("gloo")
        t = torch.ones(1)
        dist.all_reduce(t)
        print("SUM", rank, t.item(), flush=True)
        """,
    )
    done = run(tmp_path, "--nproc-per-node", "3", name)
    assert done.returncode == 0, done.stderr
    assert "TIMED OUT True" in done.stdout
    assert sorted(line for line in done.stdout.splitlines() if line.startswith("SUM")) == [
        "SUM 0 3.0",
        "SUM 1 3.0",
        "SUM 2 3.0",
    ]


NEEDS = """
import os, signal, sys, torch, torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
t = torch.ones(1)
dist.all_reduce(t)
signal.signal(signal.SIGUSR1, signal.SIG_IGN)
sys.stdout.write(f"PID {rank} {os.getpid()} {t.item()}\\n")  # (one write: -u's ranks interleave print's parts)
if sys.argv[1:] == ["os-exit"] and rank == 3:
    os._exit(4)
kept = open(f"kept.{rank}", "w")  # (left open: the process's end flushes it)
kept.write("kept")
dist.barrier()
"""


def _pids(out: str, size: int) -> dict[int, int]:
    """``PID rank pid sum`` lines: each rank's pid (the sum checked).

    Found anywhere in a line: each is one write, but another process's ``print`` writes its
    parts one by one under ``-u`` (torchrun's too), and one may come first on the line.
    """
    found = re.findall(r"PID (\d+) (\d+) (\S+)\n", out)
    assert all(float(sum_) == size for *_, sum_ in found), out
    return {int(rank): int(pid) for rank, pid, _ in found}


def test_a_script_one_process_cannot_serve_runs_in_processes_and_is_never_refused(tmp_path: Path) -> None:
    name = script(tmp_path, "needs.py", NEEDS)
    said = (
        f"aiocoll run: {name} runs in processes, one per rank, as under torchrun: it installs a signal handler "
        f"(signal.signal) at {tmp_path / name}:7 (--processes starts there directly; --in-process keeps every rank "
        "in this process)"
    )
    pid = run(tmp_path, "--nproc-per-node", "4", name)
    assert pid.returncode == 0, pid.stderr
    assert said in pid.stderr.splitlines()  # once, read from the script before it ran
    pids = _pids(pid.stdout, 4)
    assert sorted(pids) == [0, 1, 2, 3]
    assert len(set(pids.values())) == 4  # a process each
    assert [(tmp_path / f"kept.{r}").read_text() for r in range(4)] == ["kept"] * 4

    exited = run(tmp_path, "--nproc-per-node", "4", name, "os-exit")
    assert exited.returncode == 1  # torchrun's, for a failed worker
    assert "Root Cause (first observed failure): rank 3, exitcode 4" in exited.stderr

    # --in-process insists: the call is then refused, naming the rank, the call and the line
    insisted = run(tmp_path, "--nproc-per-node", "2", "--in-process", name)
    assert insisted.returncode == 1
    assert "PID" not in insisted.stdout
    assert re.search(
        rf"{name} needs processes of its own \(rank [01] installed a handler for signal \S+ at {name}:7\); "
        "run it without --in-process",
        insisted.stderr,
    ), insisted.stderr

    # --processes: any script, in processes
    body = NEEDS.replace("signal.signal(signal.SIGUSR1, signal.SIG_IGN)", "pass").replace("os._exit(4)", "pass")
    plain = script(tmp_path, "plain.py", body)
    chosen = run(tmp_path, "--nproc-per-node", "2", "--processes", plain)
    assert chosen.returncode == 0, chosen.stderr
    assert "runs in processes, one per rank, as under torchrun: --processes was given" in chosen.stderr
    assert sorted(_pids(chosen.stdout, 2)) == [0, 1]


PIDS = """
import logging, os, sys, torch.distributed as dist
dist.init_process_group("gloo")
rank, pid = dist.get_rank(), os.getpid()
with open(f"out.{pid}", "w") as f:  # a file named after the process, as pytorch/examples' scripts do
    f.write(str(rank))
logging.basicConfig(format="LOGGED %(process)d", level=logging.INFO)
logging.info("")  # (logging, a library, gets the real pid)
dist.barrier()
sys.stdout.write(f"PID {rank} {pid} {os.getpid()} {os.getppid()}\\n")
if sys.argv[1:] == ["kill"]:
    getattr(os, "kill")(os.getpid(), 0)  # acts on the process (as no syntax tree shows): in processes
"""


def test_each_rank_has_a_pid_of_its_own_and_the_system_never_sees_it(tmp_path: Path) -> None:
    from aiocoll._process._procstate import PID_FLOOR

    name = script(tmp_path, "pids.py", PIDS)
    proc = run(tmp_path, "--nproc-per-node", "3", name)
    assert proc.returncode == 0, proc.stderr
    assert "runs in processes" not in proc.stderr  # in this process
    lines = [line.split()[1:] for line in proc.stdout.splitlines() if line.startswith("PID ")]
    pids = {int(rank): int(pid) for rank, pid, again, _ in lines if pid == again}  # stable for the rank's life
    assert sorted(pids) == [0, 1, 2]
    assert len(set(pids.values())) == 3
    assert min(pids.values()) >= PID_FLOOR  # no real process has one: the system refuses it (ESRCH)
    assert len({parent for *_, parent in lines}) == 1  # one parent, as torchrun's agent is every worker's
    for rank, pid in pids.items():
        assert (tmp_path / f"out.{pid}").read_text() == str(rank)
    logged = {line.split()[1] for line in proc.stderr.splitlines() if line.startswith("LOGGED ")}
    assert len(logged) == 1
    assert int(logged.pop()) < PID_FLOOR  # the launcher's real pid

    # a signal to its own pid acts on the process: the run starts again in processes
    killed = run(tmp_path, "--nproc-per-node", "2", name, "kill")
    assert killed.returncode == 0, killed.stderr
    assert "sent signal 0 to its own process" in killed.stderr
    assert "the run starts again in processes" in killed.stderr


def test_a_need_met_at_run_time_stops_the_run_and_starts_it_again_in_processes(tmp_path: Path) -> None:
    # a call no syntax tree shows: found in a rank, the whole run starts again in processes
    body = NEEDS.replace("signal.signal(", "getattr(signal, 'signal')(").replace("os._exit(4)", "pass")
    name = script(tmp_path, "late.py", body)
    proc = run(tmp_path, "--nproc-per-node", "2", name)
    assert proc.returncode == 0, proc.stderr
    assert re.search(
        rf"aiocoll run: {name} needs processes of its own \(rank [01] installed a handler for signal \S+ at "
        rf"{name}:7\): every rank was stopped, and what the attempt did until then \(its output, files, "
        r"checkpoints\) stays done; the run starts again in processes",
        proc.stderr,
    ), proc.stderr
    assert sorted(_pids(proc.stdout, 2)) == [0, 1]  # the in-process attempt printed none: stopped at the call
    assert proc.stderr.count("needs processes of its own") == 1


@pytest.mark.skipif(importlib.util.find_spec("lightning") is None, reason="lightning is a pinned test dependency")
def test_a_lightning_fabric_script_runs_in_one_process_each_rank_with_its_own_rank(tmp_path: Path) -> None:
    name = script(
        tmp_path,
        "fabric.py",
        """
        import sys
        import torch
        from lightning.fabric import Fabric
        from lightning.fabric.utilities.rank_zero import rank_zero_only

        @rank_zero_only
        def announce():
            sys.stdout.write("SCRIPT rank-zero-only\\n")

        fabric = Fabric(accelerator="cpu", devices=3, strategy="ddp")
        fabric.launch()
        total = fabric.all_reduce(torch.tensor([float(fabric.global_rank)]), reduce_op="sum")
        announce()
        sys.stdout.write(f"SCRIPT {fabric.global_rank} {fabric.world_size} {rank_zero_only.rank} {total.item()}\\n")
        """,
    )
    proc = run(tmp_path, "--nproc-per-node", "3", name)
    assert proc.returncode == 0, proc.stderr
    assert "runs in processes" not in proc.stderr  # (in this process: no reason to leave it)
    lines = sorted(line for line in proc.stdout.splitlines() if line.startswith("SCRIPT"))
    assert lines == ["SCRIPT 0 3 0 3.0", "SCRIPT 1 3 1 3.0", "SCRIPT 2 3 2 3.0", "SCRIPT rank-zero-only"]


@pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="accelerate is a pinned test dependency")
def test_an_accelerate_script_runs_in_one_process_each_rank_with_its_own_state(tmp_path: Path) -> None:
    name = script(
        tmp_path,
        "acc.py",
        """
        import torch
        from accelerate import Accelerator
        from accelerate.state import PartialState
        from accelerate.utils import set_seed

        acc = Accelerator(cpu=True)  # (else accelerate >= 1.11 runs one process's worth: no accelerator)
        set_seed(acc.process_index)  # (each rank its own draws, as in its own process)
        got = acc.gather(torch.rand(1))
        same = acc.reduce(torch.tensor([float(PartialState().process_index)]), reduction="sum")
        kind = acc.distributed_type.value
        print(f"SCRIPT {acc.process_index} {acc.num_processes} {kind} {got.tolist()} {same.item()}")
        """,
    )
    proc = run(tmp_path, "--nproc-per-node", "3", name)
    assert proc.returncode == 0, proc.stderr
    assert "runs in processes" not in proc.stderr  # (in this process: no reason to leave it)
    lines = sorted(line.split(" ", 1)[1] for line in proc.stdout.splitlines() if line.startswith("SCRIPT"))
    import torch

    draws = [torch.rand(1, generator=torch.Generator().manual_seed(r)).item() for r in range(3)]
    assert [line.split(" [")[0] for line in lines] == [f"{r} 3 MULTI_CPU" for r in range(3)]
    assert {line.split(" [")[1] for line in lines} == {f"{', '.join(map(str, draws))}] 3.0"}


def test_a_rank_a_process_wide_singleton_initialised_for_is_told_so(tmp_path: Path) -> None:
    # the pattern of accelerate's PartialState (made per rank, _libstate; others are not
    # known): state kept once per process, which in
    # processes makes each rank initialise torch.distributed once, and in one process once
    script(
        tmp_path,
        "state.py",
        """
        import torch.distributed as dist
        _shared = {}
        def setup():
            if not _shared:
                _shared["backend"] = "gloo"  # (filled in before initialising, as PartialState's is)
                dist.init_process_group(_shared["backend"])
        """,
    )
    name = script(
        tmp_path,
        "single.py",
        """
        import torch.distributed as dist
        import state
        state.setup()
        dist.barrier()
        """,
    )
    proc = run(tmp_path, "--nproc-per-node", "2", name)
    assert proc.returncode == 1
    assert "ValueError: Default process group has not been initialized" in proc.stderr
    assert "aiocoll: rank 1 never initialised torch.distributed, while ranks [0] did" in proc.stderr
    assert "state that a library keeps once per process (a singleton, or a module's global)" in proc.stderr


def test_restarts_and_modules(tmp_path: Path) -> None:
    script(
        tmp_path,
        "flaky.py",
        """
        import os, torch.distributed as dist
        dist.init_process_group("gloo")
        if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and dist.get_rank() == 1:
            raise RuntimeError("first attempt fails")
        dist.barrier()
        print("OK", os.environ["TORCHELASTIC_RESTART_COUNT"])
        """,
    )
    proc = run(tmp_path, "--nproc-per-node", "2", "--max-restarts", "1", "-m", "flaky")
    assert proc.returncode == 0, proc.stderr
    assert "restarting the world (1 of 1)" in proc.stderr
    assert sorted(line for line in proc.stdout.splitlines() if line.startswith("OK")) == ["OK 1", "OK 1"]


def test_a_script_that_cannot_run_is_reported_as_python_reports_it(tmp_path: Path) -> None:
    broken = run(tmp_path, "--nproc-per-node", "2", script(tmp_path, "broken.py", "def f(:\n"))
    assert broken.returncode == 1
    assert "SyntaxError" in broken.stderr
    assert "_run.py" not in broken.stderr  # python's report of the script, not aiocoll's frames


def test_help_and_a_missing_script(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from aiocoll._cli._run import main

    monkeypatch.chdir(tmp_path)
    assert main(["--nproc-per-node", "2", "nowhere.py"]) == 2
    assert "can't open file 'nowhere.py'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as helped:
        main(["--help"])
    assert helped.value.code == 0
    assert gc.isenabled()  # as found: the collector is off only while torchrun's parser loads
    gc.disable()
    try:
        assert main(["--nproc-per-node", "2", "nowhere.py"]) == 2
        assert not gc.isenabled()  # a caller's choice stays
    finally:
        gc.enable()
    out = capsys.readouterr().out
    for option in ("--nproc-per-node", "--nproc_per_node", "--master-port", "--max-restarts", "--tee", "--log-dir"):
        assert option in out  # torchrun's own options, from this torch's parser
    for option in ("--timeout", "--schedule-seed", "--trace", "--record", "--sync-ranks"):
        assert option in out.split("aiocoll's own options")[1]


# options one process cannot honour, and what the refusal says
REFUSED = [
    (
        ["--nnodes", "2"],
        "--nnodes 2: every rank of 'aiocoll run' runs in this process; for several nodes use "
        "torchrun with aiocoll.from_process_group",
    ),
    (["--node-rank", "1"], "--node-rank 1: a run has one node"),
    (["--nnodes", "1:4"], "--nnodes 1:4: every rank of 'aiocoll run' runs in this process"),
    (["--no-python"], "--no-python: each rank runs Python code"),
    (["--logs-specs", "mine"], "--logs-specs mine: output is routed as torchrun's default"),
    (["--tee", "4"], "--tee '4': give 0, 1, 2 or 3"),
    (["--redirects", "0:1,x"], "--redirects '0:1,x': give 0, 1, 2 or 3"),
    (["--local-ranks-filter", "a"], "--local-ranks-filter 'a': give ranks"),
    (["--nproc-per-node", "many"], "--nproc-per-node 'many': give the number of ranks"),
    (["--nproc-per-node", "0"], "--nproc-per-node 0: at least one rank"),
    (["--max-restarts", "-1"], "--max-restarts -1: a count"),
]


@pytest.mark.parametrize(("options", "said"), REFUSED)
def test_options_one_process_cannot_honour_are_refused_before_anything_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], options: list[str], said: str
) -> None:
    from aiocoll._cli._run import main

    name = str(tmp_path / script(tmp_path, "x.py", "raise SystemExit('ran')\n"))
    assert main([*options, name]) == 2
    err = capsys.readouterr().err
    assert err.startswith("aiocoll run: ")
    assert said in err


@pytest.mark.parametrize(("options", "said"), REFUSED)
def test_the_run_spec_refuses_what_one_process_cannot_honour(options: list[str], said: str) -> None:
    from aiocoll._cli._run import RunSpec, _Refused, parser

    with pytest.raises(_Refused, match=re.escape(said)):
        RunSpec.of(parser().parse_args([*options, "x.py"]))


def test_the_run_spec_is_the_command_line_checked_and_typed() -> None:
    from aiocoll._cli._run import RunSpec, parser

    argv = ["--nproc-per-node", "3", "--max-restarts", "2", "--timeout", "7", "--sync-ranks", "parallel"]
    argv += ["--schedule-seed", "5", "--master-port", "1234", "--role", "trainer", "-m", "pkg.train", "--lr", "0.1"]
    spec = RunSpec.of(parser().parse_args(argv))
    assert (spec.script, spec.script_args, spec.module, spec.size) == ("pkg.train", ("--lr", "0.1"), True, 3)
    assert (spec.max_restarts, spec.timeout, spec.role) == (2, 7.0, "trainer")
    assert spec.world_options == {"record": spec.record, "trace": None, "schedule_seed": 5, "sync_ranks": "parallel"}
    assert spec.rendezvous is not None
    assert spec.rendezvous.master_port == 1234
    assert repr(spec) == "<RunSpec -m pkg.train --lr 0.1: 3 ranks, timeout 7 s, 2 restarts>"
    with pytest.raises(AttributeError):
        spec.size = 4  # type: ignore[misc]  # frozen: checked once, never changed after
    standalone = RunSpec.of(parser().parse_args(["--standalone", "x.py"]))
    assert standalone.rendezvous is None  # a new run id and a free port, as the run starts
    # a port the user chose, told from torchrun's default (29500 in 2.10's, which the processes
    # mode does not listen on: runs side by side would share it)
    assert spec.rendezvous.port_given
    plain = RunSpec.of(parser().parse_args(["x.py"])).rendezvous
    assert plain is None or not plain.port_given
    chosen = RunSpec.of(parser().parse_args(["--master-port", "29500", "x.py"])).rendezvous
    assert chosen is not None
    assert chosen.port_given
    assert (standalone.size, standalone.script_args, standalone.module) == (1, (), False)


def test_aiocoll_s_own_options_reach_the_world(tmp_path: Path) -> None:
    name = script(
        tmp_path,
        "order.py",
        """
        import torch, torch.distributed as dist
        dist.init_process_group("gloo")
        for _ in range(3):
            print(f"STEP rank {dist.get_rank()}", flush=True)
            dist.all_reduce(torch.ones(1))
        """,
    )
    orders = []
    for _ in range(2):
        done = run(tmp_path, "--nproc-per-node", "4", "--schedule-seed", "7", "--trace", "trace.json", name)
        assert done.returncode == 0, done.stderr
        orders.append([line for line in done.stdout.splitlines() if line.startswith("STEP")])
    assert orders[0] == orders[1]  # a seeded schedule: the same order each time
    trace = json.loads((tmp_path / "trace.json").read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    assert sum(1 for e in events if "all_reduce" in str(e.get("name", ""))) >= 12  # 3 ops x 4 ranks

    def order(seed: int) -> list[str]:
        done = run(tmp_path, "--nproc-per-node", "4", "--schedule-seed", str(seed), name)
        return [line for line in done.stdout.splitlines() if line.startswith("STEP")]

    # other seeds, other orders: the option is honoured, not ignored (the first other seed differs
    # almost always; each run costs seconds, so stop there)
    assert any(order(seed) != orders[0] for seed in (1, 2, 3))


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_signal_ends_the_run_at_once_saying_where_each_rank_was(tmp_path: Path, sig: signal.Signals) -> None:
    name = script(
        tmp_path,
        "busy.py",
        """
        import torch, torch.distributed as dist
        dist.init_process_group("gloo")
        t = torch.ones(1)
        dist.all_reduce(t)
        if dist.get_rank() == 0:
            print("STARTED", flush=True)
        dist.all_reduce(t)

        def spin():
            while True:
                pass

        if dist.get_rank() == 3:
            spin()  # busy in its own code: a thread that cannot be stopped
        while True:
            dist.all_reduce(t)
        """,
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "aiocoll", "run", "--nproc-per-node", "4", "--max-restarts", "2", name],
        cwd=tmp_path,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # a shell's background job ignores SIGINT, and a child inherits that: ended all the same (torchrun's too)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "STARTED"
        time.sleep(0.2)  # (rank 3 is spinning by now, or soon)
        proc.send_signal(sig)
        start = time.monotonic()
        _, err = proc.communicate(timeout=30)
        took = time.monotonic() - start
    finally:
        proc.kill()
    assert proc.returncode == 1, err  # as torchrun's, for both signals; no restart
    assert f"aiocoll run: got signal {sig.name}" in err
    assert "restarting" not in err
    lines = err.splitlines()
    for rank in (0, 1, 2):  # each waits in the loop's all_reduce, for rank 3
        said = next(line for line in lines if line.strip().startswith(f"rank {rank}:"))
        assert "waiting in all_reduce" in said, err
        assert said.endswith("at busy.py:17 in <module>: dist.all_reduce(t)"), err
    assert "  rank 3: running at busy.py:11 in spin: while True:" in lines, err
    assert took < 5, f"{took:.1f} s after {sig.name}"  # (about 0.2-0.6 s here; the bound only catches a hang)


SPAWNING = """
import os, pickle, sys
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def setup(rank, world_size):  # as PyTorch's DDP tutorial does
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = "12355"
    dist.init_process_group("gloo", rank=rank, world_size=world_size)


def train(rank, world_size, mode):
    setup(rank, world_size)
    if mode == "raise" and rank == 2:
        raise ValueError("bad batch on rank 2")
    if mode == "exit" and rank == 1:
        sys.exit(3)
    if mode == "mismatch" and rank == 1:
        dist.broadcast(torch.ones(1), src=0)
    torch.manual_seed(0)
    model = DDP(nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(rank)  # each rank its own data
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(8, 4)).sum().backward()
        opt.step()
    weights = [torch.empty_like(model.module.weight) for _ in range(world_size)]
    dist.all_gather(weights, model.module.weight.detach())
    same = all(torch.equal(weights[0], w) for w in weights)
    # a class of the script pickles by name, as in a child process whose __main__ is the script
    same = same and type(pickle.loads(pickle.dumps(Batch(rank)))) is Batch
    print(f"RANK {rank} same={same} port={os.environ['MASTER_PORT']}", flush=True)
    dist.destroy_process_group()


class Batch:
    def __init__(self, rank):
        self.rank = rank


if __name__ == "__main__":
    mode = sys.argv[1]
    try:
        if mode == "nojoin":
            context = mp.start_processes(train, args=(3, mode), nprocs=3, join=False)
            while not context.join():
                pass
        else:
            mp.spawn(train, args=(3, mode), nprocs=3, join=True)
    except mp.ProcessRaisedException as e:
        print(f"RAISED by process {e.error_index}:{e}")
        sys.exit(5)
    except mp.ProcessExitedException as e:
        print(f"EXITED process {e.error_index} code {e.exit_code}: {e}")
        sys.exit(6)
    print("PARENT done, its MASTER_PORT", os.environ["MASTER_PORT"])
"""


@pytest.mark.parametrize("mode", ["join", "nojoin"])
def test_a_script_that_spawns_its_ranks_runs_them_as_aiocoll_ranks(tmp_path: Path, mode: str) -> None:
    name = script(tmp_path, "tutorial.py", SPAWNING)
    done = run(tmp_path, name, mode)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    # each rank's DDP replica ended equal to the others'; each set its own environment
    assert sorted(line for line in lines if line.startswith("RANK")) == [
        f"RANK {r} same=True port=12355" for r in range(3)
    ]
    # the parent goes on after the ranks: its environment is its own (torchrun's, one worker), not theirs
    parent = re.fullmatch(r"PARENT done, its MASTER_PORT (\d+)", lines[-1])
    assert parent is not None, done.stdout
    assert parent.group(1) != "12355"


def test_a_spawned_rank_that_fails_fails_the_spawn_call_as_torch_s_does(tmp_path: Path) -> None:
    name = script(tmp_path, "tutorial.py", SPAWNING)
    raised = run(tmp_path, name, "raise")
    assert raised.returncode == 1, raised.stderr  # the script's sys.exit(5): a failed rank, as torchrun's
    out = raised.stdout
    assert "RAISED by process 2:" in out
    assert "-- Process 2 terminated with the following error:" in out
    # the child's traceback starts in the script, as a process's would
    assert 'Traceback (most recent call last):\n  File "tutorial.py", line 19, in train' in out, out
    assert "ValueError: bad batch on rank 2" in out
    assert "Root Cause (first observed failure): exitcode 5" in raised.stderr

    exited = run(tmp_path, name, "exit")
    assert "EXITED process 1 code 3: process 1 terminated with exit code 3" in exited.stdout, exited.stderr

    mismatch = run(tmp_path, name, "mismatch")
    out = mismatch.stdout
    # where processes would hang: the mismatch, reported with each rank's call and line
    assert "CollectiveMismatchError" in out, out + mismatch.stderr
    assert "rank 1: broadcast(float32[1], src=0) at tutorial.py:23" in out
    assert re.search(r"rank 0: \w+\(.*\) at tutorial.py:25\n", out), out  # DDP's first collective, at DDP(...)


def test_a_signal_during_spawn_says_where_the_spawned_ranks_were(tmp_path: Path) -> None:
    name = script(
        tmp_path,
        "loop.py",
        """
        import torch, torch.distributed as dist, torch.multiprocessing as mp

        def work(rank, n):
            dist.init_process_group("gloo", init_method="tcp://127.0.0.1:23456", rank=rank, world_size=n)
            t = torch.ones(1)
            dist.all_reduce(t)
            if rank == 0:
                print("STARTED", flush=True)
            while True:
                dist.all_reduce(t)

        if __name__ == "__main__":
            mp.spawn(work, args=(3,), nprocs=3)
        """,
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "aiocoll", "run", name],
        cwd=tmp_path,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "STARTED"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 1, err
    lines = err.splitlines()
    assert "  rank 0: running at loop.py:14 in <module>: mp.spawn(work, args=(3,), nprocs=3)" in lines, err
    spawned = lines.index("  torch.multiprocessing.spawn(work):")
    for rank in range(3):
        assert lines[spawned + 1 + rank].startswith(f"    rank {rank}: "), err
        assert lines[spawned + 1 + rank].endswith("at loop.py:11 in work: dist.all_reduce(t)"), err


def test_spawned_ranks_left_unjoined_finish_as_at_a_process_s_exit(tmp_path: Path) -> None:
    name = script(
        tmp_path,
        "unjoined.py",
        """
        import time
        import torch, torch.distributed as dist, torch.multiprocessing as mp

        def work(rank, n):
            dist.init_process_group("gloo", init_method="tcp://127.0.0.1:23456", rank=rank, world_size=n)
            time.sleep(0.5)  # still running when the parent's code ends
            t = torch.ones(1)
            dist.all_reduce(t)
            print(f"CHILD {rank} got {t.item():g}", flush=True)

        if __name__ == "__main__":
            mp.start_processes(work, args=(3,), nprocs=3, join=False)
            print("PARENT done", flush=True)
        """,
    )
    done = run(tmp_path, name)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "PARENT done"
    assert sorted(lines[1:]) == [f"CHILD {r} got 3" for r in range(3)]  # waited for, as non-daemon children


def test_the_routed_binary_layer_keeps_a_character_split_across_writes() -> None:
    import io

    from aiocoll._cli import _runlogs

    console = io.TextIOWrapper(io.BytesIO(), encoding="utf-8")
    router = _runlogs._Router(console, {})
    encoded = "é".encode()
    router.buffer.write(encoded[:1])  # (each write through sys.stdout.buffer, as a script does)
    router.buffer.write(encoded[1:])
    console.flush()
    assert console.buffer.getvalue().decode() == "é"  # type: ignore[attr-defined]
    router.close()  # (and its binary layer: before the console goes, as closing flushes into it)


@pytest.mark.parametrize("sync_ranks", ["turns", "parallel"])
def test_threads_a_rank_starts_belong_to_it_as_in_its_process(tmp_path: Path, sync_ranks: str) -> None:
    # a pool made once for the whole process (a module's import), which both ranks use
    (tmp_path / "shared.py").write_text(
        "from concurrent.futures import ThreadPoolExecutor\nPOOL = ThreadPoolExecutor(1)\n", encoding="utf-8"
    )
    name = script(
        tmp_path,
        "threads.py",
        """
        import json, logging, os, pickle, random, sys, threading, time
        import torch, torch.distributed as dist
        import shared

        class Step:  # defined by the script: pickles as __main__.Step
            pass

        dist.init_process_group("gloo")
        rank = dist.get_rank()
        logging.basicConfig(format=f"LOG from rank {rank}: %(message)s", level=logging.INFO)
        os.environ["MINE"] = f"set by {rank}"
        random.seed(rank)
        seen = {}

        def helper():
            seen["env"] = (os.environ["RANK"], os.environ["MINE"])
            seen["rank"] = dist.get_rank()
            seen["pickled"] = type(pickle.loads(pickle.dumps(Step()))) is Step
            seen["random"] = random.random()
            logging.getLogger("helper").info("in a thread")
            print("PRINTED in a thread", flush=True)
            try:
                t = torch.ones(1)
                dist.all_reduce(t)
                seen["all_reduce"] = t.item()
            except Exception as e:
                seen["all_reduce"] = type(e).__name__ + ": " + str(e)

        thread = threading.Thread(target=helper)
        thread.start()
        thread.join()
        random.seed(rank)
        seen["random_here"] = random.random()
        time.sleep(0.05 * (1 - rank))  # rank 1 submits first and starts the pool's thread
        seen["pool"] = shared.POOL.submit(lambda: os.environ["RANK"]).result()
        print("RESULT", json.dumps(seen), flush=True)
        """,
    )
    proc = run(tmp_path, "--nproc-per-node", "2", "--tee", "3", "--sync-ranks", sync_ranks, name)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for rank in (0, 1):
        line = next(x for x in proc.stdout.splitlines() if x.startswith(f"[default{rank}]:RESULT"))
        seen = json.loads(line.split(" ", 1)[1])
        assert seen["env"] == [str(rank), f"set by {rank}"]  # the rank's environment, its own changes too
        assert seen["rank"] == rank  # its torch.distributed state
        assert seen["pickled"] is True  # its __main__
        if sync_ranks == "turns":  # (ranks that run at once share the generators, as spawn's do)
            assert seen["random"] == seen["random_here"]  # its random generator (seeded alike, the same draw)
        assert seen["pool"] == str(rank)  # a shared pool runs each rank's task as that rank
        assert f"[default{rank}]:PRINTED in a thread" in proc.stdout  # its output, with torchrun's prefix
        assert f"[default{rank}]:LOG from rank {rank}: in a thread" in proc.stderr  # its logging
        assert seen["all_reduce"] == 2.0  # its collectives (the rank waits in join meanwhile)


def test_ranks_that_a_rank_spawns_start_as_new_processes(tmp_path: Path) -> None:
    # threads aiocoll starts for them (their world's) carry nothing of the spawning rank
    name = script(
        tmp_path,
        "nested.py",
        """
        import os, torch.distributed as dist, torch.multiprocessing as mp

        def child(i):
            print("CHILD", i, dist.is_initialized(), os.environ["RANK"], flush=True)

        if __name__ == "__main__":
            dist.init_process_group("gloo")
            if dist.get_rank() == 1:
                mp.spawn(child, nprocs=2)
            dist.barrier()
        """,
    )
    proc = run(tmp_path, "--nproc-per-node", "2", name)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(x for x in proc.stdout.splitlines() if x.startswith("CHILD")) == [
        "CHILD 0 False 1",  # no process group of its parent's; its parent's environment, as a child process
        "CHILD 1 False 1",
    ]


def test_a_checkpoint_saves_on_a_pool_thread_while_the_rank_goes_on(tmp_path: Path) -> None:
    # as dcp.async_save does: dcp.save, with its collectives on a group of its own, on a pool
    # thread; the rank waits in Future.result(). (async_save itself refuses an aiocoll group:
    # it asks the group for the devices of its registered backends, and a group of its own,
    # as aiocoll's and torch's threaded one are, has none: see the command-line guide)
    name = script(
        tmp_path,
        "async_ckpt.py",
        """
        from concurrent.futures import ThreadPoolExecutor
        import torch, torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        dist.init_process_group("gloo")
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 4)
        pool = ThreadPoolExecutor(1)
        # a group of its own for the save, as async_save makes: its collectives and the
        # rank's all_reduce below would otherwise race for the default group's order
        save_pg = dist.new_group(backend="gloo")
        saving = pool.submit(dcp.save, {"model": model.state_dict()}, checkpoint_id="ckpt", process_group=save_pg)
        t = torch.ones(1)
        dist.all_reduce(t)  # the rank goes on meanwhile
        saving.result()
        loaded = {"model": torch.nn.Linear(4, 4).state_dict()}
        dcp.load(loaded, checkpoint_id="ckpt")
        same = torch.equal(loaded["model"]["weight"], model.weight.detach())
        print("RESULT", dist.get_rank(), same, t.item(), flush=True)
        """,
    )
    proc = run(tmp_path, "--nproc-per-node", "2", name)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(x for x in proc.stdout.splitlines() if x.startswith("RESULT")) == [
        "RESULT 0 True 2.0",
        "RESULT 1 True 2.0",
    ]


DRAWS = """
import random, sys
import numpy as np
import torch, torch.distributed as dist
import torch.multiprocessing as mp


def draw(rank, where):
    drawn = (torch.rand(1).item(), random.random(), float(np.random.rand()), torch.initial_seed())
    sys.stdout.write(f"DRAW {where} {rank} {drawn}\\n")


def spawned(rank, n):
    draw(rank, "spawned")


if __name__ == "__main__":
    dist.init_process_group("gloo")
    draw(dist.get_rank(), "rank")
    # (every rank has drawn before rank 0 starts more: two worlds taking turns at once would
    # each swap torch's one generator in and out, which is not the rank's own then)
    dist.barrier()
    if dist.get_rank() == 0:
        mp.spawn(spawned, args=(2,), nprocs=2)
    if sys.argv[1:] == ["fail"] and dist.get_rank() == 1:
        raise ValueError("unlucky draw")
"""


def _draws(out: str) -> dict[tuple[str, int], str]:
    """``DRAW where rank numbers`` lines: what each rank (and each rank rank 0 spawned) drew."""
    draws = {}
    for line in out.splitlines():
        if line.startswith("DRAW "):
            _, where, rank, numbers = line.split(" ", 3)
            draws[(where, int(rank))] = numbers
    return draws


def test_each_rank_draws_as_a_fresh_process_and_a_seed_replays_the_draws(tmp_path: Path) -> None:
    name = script(tmp_path, "draws.py", DRAWS)
    first, second = run(tmp_path, "--nproc-per-node", "3", name), run(tmp_path, "--nproc-per-node", "3", name)
    assert first.returncode == second.returncode == 0, first.stderr + second.stderr
    a, b = _draws(first.stdout), _draws(second.stdout)
    keys = [("rank", 0), ("rank", 1), ("rank", 2), ("spawned", 0), ("spawned", 1)]
    assert sorted(a) == sorted(b) == sorted(keys)
    # torch's, random's and NumPy's unseeded numbers: each rank its own, each run anew
    for k in range(3):
        assert len({eval(v)[k] for v in a.values()}) == 5, a
    assert not set(a.values()) & set(b.values())

    # a failed run says where its ranks' seeds came from; --seed draws the same again, in processes too
    failed = run(tmp_path, "--nproc-per-node", "3", name, "fail")
    assert failed.returncode == 1
    found = re.search(
        r"aiocoll: the ranks' generators were seeded from (\d+) \(--seed \1 draws the same again\)", failed.stderr
    )
    assert found, failed.stderr
    seed = found.group(1)
    again = run(tmp_path, "--nproc-per-node", "3", "--seed", seed, name, "fail")
    processes = run(tmp_path, "--nproc-per-node", "3", "--seed", seed, "--processes", name)
    assert again.returncode == 1
    assert processes.returncode == 0, processes.stderr
    ranks = {k: v for k, v in _draws(failed.stdout).items() if k[0] == "rank"}
    assert ranks == {k: v for k, v in _draws(again.stdout).items() if k[0] == "rank"}
    assert ranks == {k: v for k, v in _draws(processes.stdout).items() if k[0] == "rank"}


def test_the_flight_recorder_s_dumps_carry_each_rank_s_seed_and_torch_s_analyzer_reads_them(tmp_path: Path) -> None:
    import pickle

    name = script(
        tmp_path,
        "dumped.py",
        """
        import aiocoll, torch, torch.distributed as dist
        dist.init_process_group("gloo")
        dist.all_reduce(torch.ones(1))
        dist.barrier()
        if dist.get_rank() == 0:
            aiocoll.dump_flight_recorder("dumps/")
        """,
    )
    proc = run(tmp_path, "--nproc-per-node", "3", "--seed", "11", name)
    assert proc.returncode == 0, proc.stderr
    dumps = sorted((tmp_path / "dumps").iterdir())
    assert len(dumps) == 3
    seeds = [pickle.loads(p.read_bytes())["aiocoll_rank_seed"] for p in dumps]
    from aiocoll._process._locals import Seeds

    assert seeds == list(Seeds(11).attempt(0).of(3))
    analyzed = subprocess.run(
        [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(tmp_path / "dumps")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert analyzed.returncode == 0, analyzed.stderr
