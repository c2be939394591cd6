"""``_scriptread``: what a script needs processes for, read from its syntax tree (and its own modules')."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from aiocoll._cli._scriptread import Need, read


def write(path: Path, body: str) -> str:
    path.write_text(textwrap.dedent(body), encoding="utf-8")
    return str(path)


@pytest.mark.parametrize(
    ("body", "why", "line"),
    [
        ("from os import _exit as ex\nx = 1\nex(0)\n", "ends its process (os._exit)", 3),
        ("import os\nos.kill(os.getpid(), 9)\n", "sends a signal to its own process (os.kill(os.getpid()", 2),
        ("import os as o\no._exit(3)\n", "ends its process (os._exit)", 2),
        ("import os\nos.kill(0, 15)\n", "sends a signal to its own process group (os.kill(0, ...))", 2),
        ("import signal\ndef f():\n    signal.signal(signal.SIGTERM, print)\n", "installs a signal handler", 3),
        ("from signal import alarm\nalarm(3)\n", "sets an alarm (signal.alarm)", 2),
        ("import torch.distributed as dist\ndist.ProcessGroupGloo(1, 2, 3)\n", "makes a ProcessGroupGloo", 2),
        ("from torch.distributed import rpc\nrpc.init_rpc('w')\n", "starts an RPC agent", 2),
        ("import torch\nwith torch.profiler.profile() as p:\n    pass\n", "starts torch's profiler", 2),
        ("model._get_ddp_logging_data()\n", "reads DDP's logging data", 1),
        ("import lightning as L\nt = L.Trainer(devices=2)\n", "trains with Lightning's Trainer", 2),
        ("from pytorch_lightning import Trainer\n\nTrainer().fit(m)\n", "trains with Lightning's Trainer", 3),
        ("import lightning.pytorch as pl\npl.Trainer()\n", "trains with Lightning's Trainer", 2),
        # the first in the file, however deep
        ("import os\nif True:\n    print(os.abort())\nos._exit(0)\n", "ends its process (os.abort)", 3),
    ],
)
def test_what_only_a_process_can_do_is_read_with_its_line(tmp_path: Path, body: str, why: str, line: int) -> None:
    path = write(tmp_path / "script.py", body)
    need = read(path)
    assert need is not None
    assert need.why.startswith(why)
    assert need.where == f"{path}:{line}"
    assert str(need) == f"{need.why} at {path}:{line}"


@pytest.mark.parametrize(
    "body",
    [
        "import os\nos.kill(child_pid, 15)\n",  # another process: in-process ranks may do it
        "import os\nprint(os.getpid())\n",  # each rank has a pid of its own in one process
        "import os\nprint(os.getcwd(), os.environ['RANK'])\n",
        "import torch.distributed as dist\ndist.init_process_group('gloo')\n",
        "getpid()\n",  # a name no import bound: not os's
        "from accelerate import Accelerator\n",  # its states are each rank's own (_libstate)
        "from lightning.fabric import Fabric\nFabric()\n",  # and so is Lightning's rank
        "def kill(): pass\nimport signal\n",
        "this is not python (\n",  # python reports it when the script runs
    ],
)
def test_what_a_rank_in_a_thread_can_do_needs_nothing(tmp_path: Path, body: str) -> None:
    assert read(write(tmp_path / "script.py", body)) is None


def test_the_script_s_own_modules_are_read_and_installed_ones_are_not(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    write(tmp_path / "pkg" / "__init__.py", "")
    helper = write(tmp_path / "pkg" / "helper.py", "import signal\ndef quiet():\n    signal.alarm(0)\n")
    write(tmp_path / "util.py", "from pkg import helper\n")
    script = write(tmp_path / "train.py", "import json, torch\nimport util\nutil.helper.quiet()\n")
    assert read(script) == Need("sets an alarm (signal.alarm)", f"{helper}:3")
    # a module of the directory the script does not import is not its concern
    (tmp_path / "util.py").write_text("x = 1\n", encoding="utf-8")
    assert read(script) is None
