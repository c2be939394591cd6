"""``aiocoll run`` against ``torchrun``, end to end: each a whole command, timed from start to exit.

Run from the repository root::

    python benchmarks/bench_run.py                 # 5 rounds
    python benchmarks/bench_run.py --rounds 2 --steps 50
    python benchmarks/bench_run.py --cases small   # the one-collective script alone

Two scripts, each run 4 ranks (``--nproc-per-node 4``), the systems alternating round by
round so that a slower minute of the machine falls on both:

- ``small``: ``init_process_group("gloo")``, one all_reduce, ``destroy_process_group``;
  beside it ``spawn``, the same collective on 4 sync ranks of ``aiocoll.spawn`` with its
  imports (``python -c``): what ``aiocoll run`` adds on top of a plain world is its own
  start-up cost;
- each script also under ``aiocoll run --processes``: a process per rank, forked from the
  launcher once it has imported torch (the processes mode, for scripts one process
  cannot serve);
- ``ddp``: DDP training of a small MLP for ``--steps`` steps (a forward, a backward with its
  gradient all_reduce, an optimizer step per step).

The table gives the median wall time of each command and the ratios; ``python -c "import
torch.distributed"`` is the floor of any of them.

Every command runs with Python's bytecode cache on (in a temporary ``PYTHONPYCACHEPREFIX``,
after one untimed warm-up round), as after ``pip install``, which compiles what it installs:
where the environment sets ``PYTHONDONTWRITEBYTECODE`` (this project's CI machines do) and
aiocoll is installed editable, each command would otherwise compile aiocoll's sources again
(about 0.15 s for ``aiocoll run``), a cost no installed user pays and torch's precompiled
modules never show.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

SMALL = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
assert t.item() == dist.get_world_size()
dist.destroy_process_group()
"""

SPAWN = """
import torch, torch.distributed as dist, aiocoll
def fn(comm):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 4
aiocoll.spawn(fn, world=4)
"""

DDP = """
import sys, torch, torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo")
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
torch.manual_seed(dist.get_rank())
for _ in range(int(sys.argv[1])):
    opt.zero_grad()
    x = torch.randn(16, 32)
    nn.functional.mse_loss(model(x).squeeze(1), x.sum(1)).backward()
    opt.step()
dist.destroy_process_group()
"""


def _time(cmd: list[str], cwd: Path, env: dict[str, str], failures: list[str]) -> float:
    """Seconds the command took; a failed run is counted, its output's tail kept, and the run tried again."""
    for _ in range(3):
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600, check=False)
        took = time.perf_counter() - start
        if proc.returncode == 0:
            return took
        failures.append(f"exit code {proc.returncode}: {(proc.stdout + proc.stderr)[-600:]}")
    raise SystemExit(f"{' '.join(cmd)} failed 3 times:\n" + "\n".join(failures[-3:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="times each command runs (alternating)")
    parser.add_argument("--steps", type=int, default=300, help="training steps of the DDP script")
    parser.add_argument(
        "--cases", default="small,ddp", help="which scripts, comma-separated: small, ddp (default: both)"
    )
    args = parser.parse_args()
    cases = set(args.cases.split(","))
    if not cases or not cases <= {"small", "ddp"}:
        parser.error(f"--cases {args.cases!r}: give small, ddp or both")
    py = sys.executable
    with tempfile.TemporaryDirectory() as tmp:
        cwd = Path(tmp)
        for name, text in (("small.py", SMALL), ("ddp.py", DDP)):
            (cwd / name).write_text(textwrap.dedent(text), encoding="utf-8")
        torchrun = [py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
        aiocoll_run = [py, "-m", "aiocoll", "run", "--nproc-per-node", "4"]
        commands = {
            "import torch.distributed": [py, "-c", "import torch.distributed"],
            "small: torchrun": [*torchrun, "small.py"],
            "small: aiocoll run": [*aiocoll_run, "small.py"],
            "small: aiocoll run --processes": [*aiocoll_run, "--processes", "small.py"],
            "small: spawn (python -c)": [py, "-c", textwrap.dedent(SPAWN)],
            "ddp: torchrun": [*torchrun, "ddp.py", str(args.steps)],
            "ddp: aiocoll run": [*aiocoll_run, "ddp.py", str(args.steps)],
            "ddp: aiocoll run --processes": [*aiocoll_run, "--processes", "ddp.py", str(args.steps)],
        }
        commands = {k: v for k, v in commands.items() if ":" not in k or k.split(":")[0] in cases}
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        env["PYTHONPYCACHEPREFIX"] = str(cwd / "pycache")
        times: dict[str, list[float]] = {k: [] for k in commands}
        failed: dict[str, list[str]] = {k: [] for k in commands}
        for cmd in commands.values():  # the warm-up: bytecode cached, files in the page cache
            _time(cmd, cwd, env, [])
        for r in range(args.rounds):
            for key, cmd in commands.items():
                times[key].append(_time(cmd, cwd, env, failed[key]))
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"\n4 ranks, {args.rounds} rounds alternating, DDP {args.steps} steps; median wall seconds (min-max)\n")
    print(f"{'command':<32} {'median s':>9} {'min-max s':>13} {'failed runs':>12}")
    for key, values in times.items():
        print(f"{key:<32} {med[key]:>9.2f} {min(values):>6.2f}-{max(values):<6.2f} {len(failed[key]):>12}")
    for key, fails in failed.items():
        for f in fails:
            print(f"\n{key} failed once (run again): {f}")
    print()
    if "small" in cases:
        print(f"small: torchrun / aiocoll run         {med['small: torchrun'] / med['small: aiocoll run']:.2f}x")
        processes = med["small: torchrun"] / med["small: aiocoll run --processes"]
        print(f"small: torchrun / aiocoll run --processes  {processes:.2f}x")
        extra = med["small: aiocoll run"] - med["small: spawn (python -c)"]
        print(f"small: aiocoll run - spawn            {extra:+.2f} s  (aiocoll run's own start-up)")
    if "ddp" in cases:
        print(f"ddp:   torchrun / aiocoll run         {med['ddp: torchrun'] / med['ddp: aiocoll run']:.2f}x")
        processes = med["ddp: torchrun"] / med["ddp: aiocoll run --processes"]
        print(f"ddp:   torchrun / aiocoll run --processes  {processes:.2f}x")


if __name__ == "__main__":
    main()
