"""``aiocoll run``'s processes mode with its checks: each rank a process, every group it makes checked.

The scripts are torchrun scripts; their groups are gloo's (``--no-checks``: as torch makes
them) or checked ones standing for gloo's (the default). Reports must name each rank's
call and line, as in one process, well before the run's ``--timeout``.
"""

from __future__ import annotations

import pickle
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from aiocoll._process._locals import Seeds

pytestmark = pytest.mark.processes


def run(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run(
        [sys.executable, "-m", "aiocoll", "run", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        env=None if env is None else {**os.environ, **env},
    )


def script(tmp_path: Path, name: str, body: str) -> str:
    (tmp_path / name).write_text(textwrap.dedent(body), encoding="utf-8")
    return name


EVERYTHING = r"""
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import distribute_tensor, Shard, Replicate
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
r, w = dist.get_rank(), dist.get_world_size()
print(f"TYPE {r} {type(dist.group.WORLD).__name__} {dist.get_backend()}\n", end="")
t = torch.arange(3.0) + r
dist.all_reduce(t)
out = [f"all_reduce {t.tolist()}"]
pairs = dist.new_group([0, 1])
u = torch.ones(2) * (r + 1)
if r < 2:
    dist.all_reduce(u, group=pairs, op=dist.ReduceOp.MAX)
out.append(f"pairs {u.tolist()}")
objs = [None] * w
dist.all_gather_object(objs, {"rank": r})
out.append(f"objects {objs}")
src = torch.arange(4.0) + 10 * r
dst = torch.empty(4)
dist.all_to_all_single(dst, src)
out.append(f"all_to_all {dst.tolist()}")
ring = torch.tensor([float(r)])
if r % 2 == 0:
    dist.send(ring, (r + 1) % w)
    dist.recv(ring, (r - 1) % w)
else:
    got = ring.clone()
    dist.recv(got, (r - 1) % w)
    dist.send(ring, (r + 1) % w)
    ring = got
out.append(f"ring {ring.item()}")
mesh = init_device_mesh("cpu", (2, 2))
full = torch.arange(16.0).reshape(4, 4)
d = distribute_tensor(full, mesh, [Shard(0), Shard(1)])
out.append(f"dtensor {d.redistribute(mesh, [Replicate(), Replicate()]).to_local().sum().item()}")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
ddp = DDP(model)
opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
g = torch.Generator().manual_seed(r)
for _ in range(3):
    opt.zero_grad()
    ddp(torch.randn(4, 8, generator=g)).pow(2).mean().backward()
    opt.step()
out.append(f"ddp {sum(p.sum().item() for p in model.parameters()):.5f}")
for line in out:
    print(f"RESULT {r} {line}\n", end="")  # (one write: the ranks' processes share the pipe, unbuffered)
dist.destroy_process_group()
"""


def _lines(proc: subprocess.CompletedProcess[str], mark: str) -> list[str]:
    return sorted(line for line in proc.stdout.splitlines() if line.startswith(mark))


def test_every_group_a_rank_s_process_makes_is_checked_and_gives_gloo_s_results(tmp_path: Path) -> None:
    name = script(tmp_path, "everything.py", EVERYTHING)
    checked = run(tmp_path, "--processes", "--nproc-per-node", "4", name)
    plain = run(tmp_path, "--processes", "--no-checks", "--nproc-per-node", "4", name)
    one = run(tmp_path, "--nproc-per-node", "4", name)
    for proc in (checked, plain, one):
        assert proc.returncode == 0, proc.stderr
    results = _lines(checked, "RESULT")
    assert len(results) == 4 * 7
    assert results == _lines(plain, "RESULT") == _lines(one, "RESULT")
    # (the whole output on a failure: a line seen missing once, under load, in the plain run)
    assert [line.split()[2:] for line in _lines(checked, "TYPE")] == [["CheckedProcessGroup", "gloo"]] * 4, (
        checked.stdout
    )
    assert [line.split()[2:] for line in _lines(plain, "TYPE")] == [["ProcessGroup", "gloo"]] * 4, plain.stdout


MISMATCH = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
r = dist.get_rank()
t = torch.ones(3)
dist.all_reduce(t)
if r == 2:
    dist.broadcast(t, src=0)
else:
    dist.all_reduce(t)
"""


def test_a_mismatch_is_reported_in_every_rank_with_each_call_and_line_and_dumped(tmp_path: Path) -> None:
    name = script(tmp_path, "mismatch.py", MISMATCH)
    (tmp_path / "dumps").mkdir()
    t0 = time.monotonic()
    proc = run(
        tmp_path,
        "--processes",
        "--timeout",
        "120",
        "--seed",
        "7",
        "--nproc-per-node",
        "3",
        name,
        env={"TORCH_FR_DUMP_TEMP_FILE": str(tmp_path / "dumps" / "rank_")},
    )
    took = time.monotonic() - t0
    assert proc.returncode == 1
    assert took < 60, "the report came from the group's timeout, not from the checks"
    for r in range(3):
        # torch's excepthook prefixes each line of a rank's traceback with its rank
        assert f"[rank{r}]: aiocoll._errors.CollectiveMismatchError: ranks called different collectives" in proc.stderr
        for peer, call, line in [(0, "all_reduce", 10), (1, "all_reduce", 10), (2, "broadcast", 8)]:
            assert f"[rank{r}]:   rank {peer}: {call}(float32[3]" in proc.stderr
            assert f"at mismatch.py:{line}" in proc.stderr
    assert "Root Cause (first observed failure)" in proc.stderr
    dumps = sorted((tmp_path / "dumps").iterdir())
    assert [p.name for p in dumps] == ["rank_0", "rank_1", "rank_2"]
    assert [pickle.loads(p.read_bytes())["aiocoll_rank_seed"] for p in dumps] == list(Seeds(7).attempt(0).of(3))
    analyzed = subprocess.run(
        [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(tmp_path / "dumps")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert analyzed.returncode == 0, analyzed.stderr
    assert "broadcast" in analyzed.stdout + analyzed.stderr  # (the culprit op; torch logs its findings)


DEADLOCK = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
r = dist.get_rank()
t = torch.ones(2)
dist.all_reduce(t)
if r == 1:
    dist.recv(t, src=0)
dist.all_reduce(t)
"""


def test_a_deadlock_across_processes_is_reported_with_what_each_rank_waits_in(tmp_path: Path) -> None:
    name = script(tmp_path, "deadlock.py", DEADLOCK)
    t0 = time.monotonic()
    proc = run(tmp_path, "--processes", "--timeout", "120", "--nproc-per-node", "2", name)
    assert proc.returncode == 1
    assert time.monotonic() - t0 < 60, "the report came from the group's timeout, not from the deadlock watch"
    assert "DeadlockError: deadlock: every rank's process waits for a peer that will never arrive" in proc.stderr
    assert "rank 0: blocked in all_reduce(float32[2], op=ReduceOp.SUM) #1 on group '0' at deadlock.py:9" in proc.stderr
    assert "waits for ranks [1]" in proc.stderr
    assert "rank 1: blocked in recv(float32[2], src=0, tag=0) on group '0' at deadlock.py:8" in proc.stderr
    assert "waits for a send from rank 0" in proc.stderr


SLOW = """
import time, torch, torch.distributed as dist
dist.init_process_group("gloo")
r = dist.get_rank()
t = torch.ones(2)
dist.all_reduce(t)
if r == 1:
    time.sleep(6)  # (computing, not waiting in a collective: no deadlock)
dist.all_reduce(t)
"""


def test_the_run_s_timeout_bounds_each_collective_of_a_group_without_its_own(tmp_path: Path) -> None:
    name = script(tmp_path, "slow.py", SLOW)
    proc = run(tmp_path, "--processes", "--timeout", "1", "--nproc-per-node", "2", name)
    assert proc.returncode == 1
    assert "[rank0]: aiocoll._errors.CollectiveTimeoutError: all_reduce(float32[2], op=ReduceOp.SUM)" in proc.stderr
    assert "DeadlockError" not in proc.stderr


@pytest.mark.parametrize("checks", [[], ["--no-checks"]], ids=["checked", "plain"])
def test_a_rank_failing_inside_ddp_s_backward_fails_the_run_without_a_crash(tmp_path: Path, checks: list[str]) -> None:
    name = script(
        tmp_path,
        "ddp_fails.py",
        """
        import torch, torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP
        dist.init_process_group("gloo")
        r = dist.get_rank()
        model = DDP(torch.nn.Linear(4, 4))
        for step in range(4):
            if r == 1 and step == 2:
                raise ValueError("rank 1 fails mid-training")
            model(torch.ones(2, 4)).sum().backward()
        """,
    )
    proc = run(tmp_path, "--processes", *checks, "--nproc-per-node", "2", name)
    assert proc.returncode == 1
    assert "ValueError: rank 1 fails mid-training" in proc.stderr
    assert "Root Cause (first observed failure): rank 1, exitcode 1" in proc.stderr
    assert "Segmentation fault" not in proc.stderr


INIT = r"""
import os, sys, time, torch, torch.distributed as dist
from datetime import timedelta
backend, init = sys.argv[1] or None, sys.argv[2]
if init == "tcp":
    init = f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
elif init == "file":
    init = "file://" + os.path.abspath("rendezvous")
rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group(backend, init_method=init, rank=rank, world_size=size)
r = dist.get_rank()
t = torch.ones(1)
dist.all_reduce(t)
print(f"RESULT {r} {t.item()} {dist.get_backend()}\n", end="")
print(f"TYPE {r} {type(dist.group.WORLD).__name__}\n", end="")
if r == 1:
    time.sleep(3)
try:  # (only gloo's groups have one before torch 2.15: torch's ValueError for others, in both modes)
    dist.monitored_barrier(timeout=timedelta(seconds=1))
except (RuntimeError, ValueError) as e:  # (rank 1's: whatever rank 0's leaving made of it)
    if r == 0:
        print(f"RESULT {r} monitored_barrier: {str(e).splitlines()[0]}\n", end="")
"""


@pytest.mark.parametrize(("backend", "init"), [("gloo", "tcp"), ("cpu:gloo", "env://"), ("", "file")])
def test_any_backend_and_init_method_gets_checked_groups_that_answer_as_torch_s(
    tmp_path: Path, backend: str, init: str
) -> None:
    name = script(tmp_path, "init.py", INIT)
    # No backend named: torch takes the accelerator's only (nccl, one GPU a rank) where there
    # is one, and the script's CPU tensors have no backend; a CPU machine's run is meant
    cpu = {"CUDA_VISIBLE_DEVICES": ""} if not backend else None
    checked = run(tmp_path, "--processes", "--nproc-per-node", "2", name, backend, init, env=cpu)
    (tmp_path / "rendezvous").unlink(missing_ok=True)
    plain = run(tmp_path, "--processes", "--no-checks", "--nproc-per-node", "2", name, backend, init, env=cpu)
    assert checked.returncode == plain.returncode == 0, checked.stderr + plain.stderr
    assert _lines(checked, "RESULT") == _lines(plain, "RESULT")
    results = _lines(checked, "RESULT")
    assert len(results) == 3
    if backend == "gloo":  # gloo's monitored barrier names the rank that did not come
        assert "RESULT 0 monitored_barrier: [Rank 0]: Rank 1 failed to pass monitoredBarrier in 1000 ms" in results
    assert {line.split()[2] for line in _lines(checked, "TYPE")} == {"CheckedProcessGroup"}


@pytest.mark.parametrize(
    "path",
    [
        Path(__file__).resolve().parents[2] / "examples" / "ddp_train.py",
        Path(__file__).resolve().parents[1] / "scripts" / "fsdp2_dcp.py",
    ],
    ids=["ddp-dataloader-checkpoint", "fsdp2-dcp"],
)
def test_training_scripts_give_in_process_results_in_checked_processes(tmp_path: Path, path: Path) -> None:
    """In one process they give torchrun's results (test_run_script_conformance); checked in processes, the same."""

    def printed(*options: str) -> list[str]:
        proc = run(tmp_path, *options, "--nproc-per-node", "4", str(path), str(tmp_path / options[0].strip("-")))
        assert proc.returncode == 0, proc.stderr
        return [line for line in proc.stdout.splitlines() if line.startswith("world 4:")]

    checked = printed("--processes")
    assert len(checked) == 1
    assert checked[0].endswith("True")  # the checkpoint restored what was saved
    assert checked == printed("--in-process")
