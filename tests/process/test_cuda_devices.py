"""Each sync rank's CUDA device, as each process's under torchrun, through a fake of CUDA's device model.

In N processes, ``init_device_mesh("cuda", ...)`` sets every process's device (to its
``LOCAL_RANK``, else rank modulo the GPUs) unless that process already chose one. In one
process, CUDA is initialised once for all the ranks, which torch reads as "already
chose": without aiocoll's per-rank answer every rank but the first would stay on cuda:0.
``tests/_fake_devices.py`` says what the fake models; ``test_run_conformance.py`` runs the
same through ``aiocoll run`` against ``torchrun``.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from _fake_devices import FakeDevices
from torch.distributed import device_mesh
from torch.distributed.device_mesh import init_device_mesh

import aiocoll
from aiocoll import Comm, _torch

WORLD = 4


@pytest.fixture
def devices(monkeypatch: pytest.MonkeyPatch) -> FakeDevices:
    # What aiocoll does once per process, on what torch says of CUDA, is done before the
    # fake says otherwise: done under it, torch 2.10's no-op CUDA guard would be left out
    # for the rest of the process (and a later world's DTensor ranks crash installing it).
    _torch.prepare_for_rank_threads()
    fake = FakeDevices(WORLD)
    fake.install(monkeypatch.setattr)
    return fake


def _devices_after_mesh(choose: Callable[[int], None]) -> list[tuple[int, int]]:
    def fn(comm: Comm) -> tuple[int, int]:
        choose(comm.rank)
        init_device_mesh("cuda", (comm.world_size,))
        before = torch.cuda.current_device()
        torch.distributed.barrier()  # (the others take their turns meanwhile)
        return before, torch.cuda.current_device()

    # (torch warns when it picks a device for a process that chose none)
    warns = pytest.warns(UserWarning, match="did not set/select the default device")
    with warns if choose is _none else contextlib.nullcontext():
        return aiocoll.spawn(fn, world=WORLD)


def _none(rank: int) -> None:
    pass


def test_a_rank_that_chose_no_device_gets_the_one_torch_picks_for_its_process(devices: FakeDevices) -> None:
    # (spawn sets no LOCAL_RANK: torch's fallback, rank modulo the GPUs, with its warning)
    assert _devices_after_mesh(_none) == [(r, r) for r in range(WORLD)]
    assert devices.initialized


def test_a_rank_s_own_choice_is_kept_even_cuda_0(devices: FakeDevices) -> None:
    assert _devices_after_mesh(lambda rank: torch.cuda.set_device(WORLD - 1 - rank)) == [
        (WORLD - 1 - r, WORLD - 1 - r) for r in range(WORLD)
    ]
    # every rank on cuda:0, chosen: DeviceMesh leaves it, as it leaves a process's choice
    assert _devices_after_mesh(lambda rank: torch.cuda.set_device(0)) == [(0, 0)] * WORLD
    assert _devices_after_mesh(lambda rank: torch.accelerator.set_device_index(0)) == [(0, 0)] * WORLD


def test_the_world_leaves_torch_s_functions_as_it_found_them(devices: FakeDevices) -> None:
    handle, set_device, set_index = (
        device_mesh._get_device_handle,
        torch.cuda.set_device,
        torch.accelerator.set_device_index,
    )
    _devices_after_mesh(lambda rank: torch.cuda.set_device(rank))
    assert device_mesh._get_device_handle is handle
    assert torch.cuda.set_device == set_device  # (bound methods of the fake: equal, not identical)
    assert torch.accelerator.set_device_index == set_index
    # outside any rank, DeviceMesh asks torch itself
    assert device_mesh._get_device_handle("cuda") is torch.cuda


# -- on real GPUs: where there are at least two (CI's machines have none) ----------------------

REAL_SCRIPT = r"""
import json, os, sys
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

local = int(os.environ["LOCAL_RANK"])
if sys.argv[1] == "chosen":  # as PyTorch's tutorials do
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
else:  # left to DeviceMesh, which picks LOCAL_RANK's device
    dist.init_process_group("nccl")
    init_device_mesh("cuda", (dist.get_world_size(),))
t = torch.full((2,), float(local + 1), device="cuda")  # (the current device)
dist.all_reduce(t)
torch.cuda.synchronize()
print("RESULT " + json.dumps([local, torch.cuda.current_device(), t.device.index, t.tolist()]), flush=True)
dist.destroy_process_group()
"""


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA devices (a GPU each)"
)
@pytest.mark.parametrize("how", ["chosen", "mesh"])
def test_on_real_gpus_rank_r_works_on_cuda_local_rank(tmp_path: Path, how: str) -> None:
    n = min(torch.cuda.device_count(), 4)
    (tmp_path / "devices.py").write_text(REAL_SCRIPT, encoding="utf-8")
    proc = subprocess.run(
        [sys.executable, "-m", "aiocoll", "run", "--nproc-per-node", str(n), "devices.py", how],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    results = sorted(
        json.loads(line.split(" ", 1)[1]) for line in proc.stdout.splitlines() if line.startswith("RESULT")
    )
    total = float(n * (n + 1) // 2)
    assert results == [[r, r, r, [total, total]] for r in range(n)]


def test_async_ranks_share_their_thread_s_device_so_torch_answers_for_them(devices: FakeDevices) -> None:
    async def fn(comm: Comm) -> tuple[bool, bool, bool]:
        # (one thread, one current device: there is nothing per rank to answer)
        patched = hasattr(device_mesh._get_device_handle, "__wrapped__")  # (the world's patch is in place)
        return patched, device_mesh._get_device_handle("cuda") is torch.cuda, torch.cuda.is_initialized()

    def sync(comm: Comm) -> bool:
        return device_mesh._get_device_handle("cuda") is torch.cuda

    assert aiocoll.spawn(fn, world=2) == [(True, True, False)] * 2
    assert aiocoll.spawn(sync, world=2) == [False, False]  # (a view of torch.cuda of the rank's own)
