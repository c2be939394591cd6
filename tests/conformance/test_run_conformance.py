"""``aiocoll run`` against ``torchrun``: the same scripts, the same options, compared on what they print.

Each case runs the script under torchrun (``python -m torch.distributed.run``, this torch's)
and under ``aiocoll run``, and compares the exit codes, the script's lines on stdout and on
stderr, its logging's among them (sorted: torchrun's workers write side by side, in no fixed order), the log files
written per rank, and the environment variables each rank sees (names; values where they do
not depend on the run). What scripts compute (each kind of call one process cannot serve,
random numbers, libraries' and training scripts) is compared in ``test_run_script_conformance.py``.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest
from _launchers import LAUNCHERS, PROCESSES, both, launch

pytestmark = pytest.mark.launcher_conformance

SCRIPT = r"""
import json, logging, os, sys
import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

@record
def main():
    sys.stdout.reconfigure(line_buffering=True)  # (as training scripts do)
    dist.init_process_group("gloo")
    r = dist.get_rank()
    t = torch.tensor([float(r + 1)])
    dist.all_reduce(t)
    if "two-writes" in sys.argv:  # (where torchrun's workers share the console, partial lines would interleave)
        print(f"SCRIPT {r}: sum {t.item():g}", end="")
        print(" (one line, two writes)")
    else:  # (one write each: torchrun's workers write unbuffered, side by side)
        print(f"SCRIPT {r}: sum {t.item():g}\n", end="")
    print(f"SCRIPT {r}: to stderr\n", end="", file=sys.stderr)
    sys.stdout.buffer.write(f"SCRIPT {r}: bytes \u00e9\n".encode())  # (the binary layer, a 2-byte character)
    sys.stdout.buffer.flush()
    # each rank configures logging as its process's own: its format, its level
    logging.basicConfig(format=f"SCRIPT {r}: logged %(levelname)s %(name)s: %(message)s")
    logging.getLogger("script").setLevel(logging.INFO if r == 0 else logging.WARNING)
    logging.getLogger("script").info("rank %d at info", r)
    logging.getLogger("script").warning("rank %d at warning", r)
    env = {k: v for k, v in os.environ.items() if k.startswith(("TORCHELASTIC_", "MASTER_", "RANK", "LOCAL_",
           "WORLD_", "GROUP_", "ROLE_", "OMP_NUM_THREADS"))}
    print("SCRIPT ENV " + json.dumps(env, sort_keys=True) + "\n", end="")
    if "fail" in sys.argv and r == 1:
        raise ValueError("rank 1 fails")
    dist.destroy_process_group()

if __name__ == "__main__":
    main()
"""

# values that depend on the run (a run id, a free port, a temporary directory): compared by name only
_RUN_SPECIFIC = {"TORCHELASTIC_RUN_ID", "MASTER_PORT", "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_USE_AGENT_STORE"}


def _log_files(tmp: Path) -> dict[str, str]:
    """``attempt_0/<rank>/<stream>.log`` (and ``attempt_0/filtered_*.log``) -> its lines, sorted.

    (The run directory's name is the run's own.)
    """
    files = {}
    paths = [*(tmp / "logs").glob("*/attempt_*/*/*.log"), *(tmp / "logs").glob("*/attempt_*/*.log")]
    for path in sorted(paths):
        key = "/".join(path.relative_to(tmp / "logs").parts[1:])  # (from attempt_N on)
        # (the script's lines: torch 2.10's gloo also prints its own "[Gloo] Rank 0 is connected ...")
        files[key] = "\n".join(sorted(line for line in path.read_text().splitlines() if "SCRIPT" in line))
    return files


def _environments(lines: list[str]) -> list[dict[str, str]]:
    envs = []
    for line in lines:
        if "SCRIPT ENV " in line:
            env = json.loads(line.split("SCRIPT ENV ", 1)[1])
            envs.append({k: ("<run>" if k in _RUN_SPECIFIC else v) for k, v in env.items()})
    return sorted(envs, key=lambda e: e["RANK"])


@pytest.mark.parametrize(
    "options",
    [
        [],
        # (the duplicate filters: tee'd lines holding a needle also go to the attempt's filtered_*.log)
        [
            *["--tee", "3", "--local-ranks-filter", "1"],
            *["--duplicate-stdout-filters", "sum,ENV", "--duplicate-stderr-filters", "warning"],
        ],
        ["--redirects", "3", "--tee", "0:1"],
    ],
    ids=["plain", "tee-filtered", "redirected-one-teed"],
)
@pytest.mark.parametrize("aiocoll", [LAUNCHERS["aiocoll"], PROCESSES], ids=["in-process", "processes"])
def test_aiocoll_run_prints_what_torchrun_prints(tmp_path: Path, options: list[str], aiocoll: list[str]) -> None:
    results = {}
    for name, launcher, tmp in both(tmp_path, SCRIPT, aiocoll=aiocoll):
        code, out, err = launch(launcher, tmp, options, ["two-writes"] if options else [])
        results[name] = (code, sorted(out), sorted(err), _log_files(tmp))
    torchrun, aiocoll = results["torchrun"], results["aiocoll"]
    assert torchrun[0] == aiocoll[0] == 0
    # the environment: the same variables, with the same values where they are not the run's own
    assert _environments(aiocoll[1] + aiocoll[3].get("attempt_0/0/stdout.log", "").splitlines()) == _environments(
        torchrun[1] + torchrun[3].get("attempt_0/0/stdout.log", "").splitlines()
    )

    def without_env(lines: list[str]) -> list[str]:
        return [line for line in lines if "SCRIPT ENV" not in line]

    assert without_env(aiocoll[1]) == without_env(torchrun[1])  # stdout, prefixes included
    assert aiocoll[2] == torchrun[2]  # stderr
    assert sorted(aiocoll[3]) == sorted(torchrun[3])  # the same log files
    for key, text in torchrun[3].items():
        assert without_env(aiocoll[3][key].splitlines()) == without_env(text.splitlines()), key


@pytest.mark.parametrize("aiocoll", [LAUNCHERS["aiocoll"], PROCESSES], ids=["in-process", "processes"])
def test_a_failing_rank_fails_both_alike_and_record_writes_its_error_file(tmp_path: Path, aiocoll: list[str]) -> None:
    codes = {}
    for name, launcher, tmp in both(tmp_path, SCRIPT, aiocoll=aiocoll):
        codes[name], _, _ = launch(launcher, tmp, [], ["fail"])
        # @record wrote the failing rank's error file where TORCHELASTIC_ERROR_FILE said, and only its
        error_files = sorted(p.parts[-2] for p in (tmp / "logs").glob("*/attempt_0/*/error.json"))
        assert error_files == ["1"], name
        error = json.loads(next((tmp / "logs").glob("*/attempt_0/1/error.json")).read_text())
        assert "rank 1 fails" in error["message"]["message"], name
    assert codes["aiocoll"] == codes["torchrun"] == 1


def test_run_specific_values_are_chosen_as_torchrun_chooses_them(tmp_path: Path) -> None:
    """With --master-port given, torchrun keeps the static rendezvous: that port, run id "none"."""
    tmp = tmp_path
    (tmp / "script.py").write_text(textwrap.dedent(SCRIPT), encoding="utf-8")
    code, out, _ = launch([sys.executable, "-m", "aiocoll", "run"], tmp, ["--master-port", "29123"], [])
    assert code == 0
    envs = [json.loads(line.split("SCRIPT ENV ", 1)[1]) for line in out if "SCRIPT ENV" in line]
    assert [(e["MASTER_PORT"], e["TORCHELASTIC_RUN_ID"]) for e in envs] == [("29123", "none")] * 2
    for rank, env in sorted((int(e["RANK"]), e) for e in envs):
        assert env["TORCHELASTIC_ERROR_FILE"].endswith(os.path.join("attempt_0", str(rank), "error.json"))


# ranks failing in processes, each way: torchrun's gloo hangs to the group's timeout (a few
# seconds here) or fails with its transport's message; aiocoll's checks name every rank's call (a
# rank that raises: test_a_failing_rank_fails_both_alike_and_record_writes_its_error_file)
FAILING = {  # (the script's group timeout, s: the deadlock watch needs about 1.5 s, loaded CI more)
    "mismatch": ("t = torch.ones(4 if r == 1 else 3)\ndist.all_reduce(t)", "CollectiveMismatchError", 4),
    "deadlock": ("t = torch.ones(1)\nif r == 1:\n    dist.recv(t, src=0)\ndist.all_reduce(t)", "DeadlockError", 8),
}
FAILING_SCRIPT = """
from datetime import timedelta
import torch, torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

@record
def main():
    dist.init_process_group("gloo", timeout=timedelta(seconds=TIMEOUT))
    r = dist.get_rank()
    dist.all_reduce(torch.ones(1))
    print(f"SCRIPT {r}: before\\n", end="")
BODY

main()
"""


@pytest.mark.parametrize("kind", sorted(FAILING))
def test_in_processes_a_failing_rank_fails_both_alike_and_aiocoll_names_each_call(tmp_path: Path, kind: str) -> None:
    body, said, timeout = FAILING[kind]
    script = FAILING_SCRIPT.replace("BODY", textwrap.indent(body, "    ")).replace("TIMEOUT", str(timeout))
    results = {}
    for name, launcher, tmp in both(tmp_path, script, aiocoll=PROCESSES):
        code, out, _ = launch(launcher, tmp, [], [])
        # each rank that failed wrote its error file with @record (one the agent stopped
        # while it wrote may have left it empty)
        errors = {
            p.parts[-2]: json.loads(text)["message"]["message"]
            for p in (tmp / "logs").glob("*/attempt_0/*/error.json")
            if (text := p.read_text())
        }
        results[name] = (code, sorted(out), errors)
    (code, out, errors), (torch_code, torch_out, torch_errors) = results["aiocoll"], results["torchrun"]
    assert code == torch_code == 1
    assert out == torch_out == ["SCRIPT 0: before", "SCRIPT 1: before"]
    assert torch_errors, torch_errors
    assert errors, errors
    for message in errors.values():
        assert said in message
        if kind == "mismatch":
            assert "rank 0: all_reduce(float32[3], op=ReduceOp.SUM) at script.py:13" in message
            assert "rank 1: all_reduce(float32[4], op=ReduceOp.SUM) at script.py:13" in message
        else:
            waits = "rank 0: blocked in all_reduce(float32[1], op=ReduceOp.SUM) #1 on group '0' at script.py:15"
            assert waits in message
            assert "rank 1: blocked in recv(float32[1], src=0, tag=0) on group '0' at script.py:14" in message
    assert all(said not in m for m in torch_errors.values())


DEVICES_SCRIPT = r"""
import json, os
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

dist.init_process_group("gloo")
local = int(os.environ["LOCAL_RANK"])
if local >= 2:  # ranks 2 and 3 choose a device (one of them cuda:0); 0 and 1 leave it to DeviceMesh
    torch.cuda.set_device(local - 2)
# (2-D: a mesh over the whole world on a gloo default group would have torch make a NCCL group,
# which torch's own CUDA builds try to make even without a GPU)
init_device_mesh("cuda", (2, 2), mesh_dim_names=("dp", "tp"))
t = torch.ones(1)
dist.all_reduce(t)  # (in one process the other ranks take their turns meanwhile)
# (one write: torchrun's workers write side by side)
print("SCRIPT " + json.dumps([dist.get_rank(), local, torch.cuda.current_device(), t.item()]) + "\n", end="")
dist.destroy_process_group()
"""


def test_each_rank_s_cuda_device_is_the_one_torchrun_s_process_gets(tmp_path: Path) -> None:
    """Point 8 of the ``aiocoll run`` issue through a fake of CUDA's device model (four GPUs).

    The fake (``tests/_fake_devices.py``) is installed at start-up in every Python of
    both runs; under torchrun each worker process has its own. DeviceMesh sets a device
    (``LOCAL_RANK``) only where the rank chose none.
    """
    from _fake_devices import sitecustomize_dir

    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(sitecustomize_dir(tmp_path, 4)), os.environ.get("PYTHONPATH", "")]),
    }
    results = {}
    for name, launcher, tmp in both(tmp_path, DEVICES_SCRIPT):
        code, out, err = launch(launcher, tmp, [], [], nproc=4, env=env)
        assert code == 0, f"{name}: {err}"
        results[name] = sorted(json.loads(line.split("SCRIPT ", 1)[1]) for line in out)
    assert results["torchrun"] == [[0, 0, 0, 4.0], [1, 1, 1, 4.0], [2, 2, 0, 4.0], [3, 3, 1, 4.0]]
    assert results["aiocoll"] == results["torchrun"]
